"""The HF backend on a CUDA device: memory given back at ``close()``, async-only
delivery that issues no host sync per step, the same records as inline delivery,
``prompt_activations`` and the activation store on a half-precision model.

Every test here needs a GPU and is skipped without one (this project's CI has
none); ``docs/benchmarks.md`` ("On a GPU") says when and where they last ran.
The placement test (records land on the CPU and equal a CPU run) is in
``test_hf_backend.py``; the equivalence with transformers' own hidden states
on each device and dtype is in ``test_hf_equivalence.py``.
"""

from __future__ import annotations

import copy
import gc
import threading
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    build_model,
    build_tokenizer,
    generated_points,
    kv_point,
    prompt,
    transformers_generate,
)

from benchmarks.sync_count import cuda_sync_log  # noqa: E402
from undercurrent import ProbedModel  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, TensorType  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [prompt(3, 1, 4, 1, 5), prompt(2, 6), prompt(5, 3, 5, 8), prompt(9)]
PACKAGE = str(Path(__file__).resolve().parents[2] / "undercurrent")


def _points(mode: str) -> list[ExtractionPoint]:
    """Residual stream at every layer and mlp_out at one, every generated token, and
    kv at two layers, all in ``mode``."""
    return [*generated_points(mode, mode), kv_point(mode)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _allocated() -> int:
    """Bytes of live tensors on the GPU. torch keeps a cuBLAS workspace (32 MiB on
    an H200) for each (cuBLAS handle, stream) that ran a matrix product, for the
    process's lifetime, and counts it here: a generation on another thread (what
    ``stream()`` runs) takes one. Those are torch's, not ours: cleared first."""
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return torch.cuda.memory_allocated()


def test_async_only_delivery_on_cuda_gives_the_records_of_inline_delivery(tokenizer):
    model = copy.deepcopy(build_model("llama")).to("cuda", torch.bfloat16)
    outputs, delivered_off_thread = {}, {}
    for mode in ("async", "inline"):
        with ProbedModel(model, tokenizer, spec=_points(mode)) as probed:
            started = []
            original = probed.backend.hooks.start_delivery

            def spy(session, states, original=original, started=started):
                started.append(original(session, states))
                return started[-1]

            probed.backend.hooks.start_delivery = spy
            outputs[mode] = probed.generate(PROMPTS, max_new_tokens=6, records=True)
            delivered_off_thread[mode] = any(started)
    assert delivered_off_thread == {"async": True, "inline": False}
    for fast, slow in zip(outputs["async"], outputs["inline"], strict=True):
        assert fast.token_ids == slow.token_ids
        # the same (point, layer, token) records, whatever the request ids
        fast_records = sorted(fast.records, key=lambda r: r.key()[1:])
        slow_records = sorted(slow.records, key=lambda r: r.key()[1:])
        assert [r.key()[1:] for r in fast_records] == [r.key()[1:] for r in slow_records]
        for a, b in zip(fast_records, slow_records, strict=True):
            assert a.tensor.device.type == "cpu" and a.tensor.dtype == torch.bfloat16
            assert torch.equal(a.tensor, b.tensor), a.key()
        for name, result in fast.results.items():
            assert result.stats.received == slow.results[name].stats.received > 0
            assert result.stats.dropped == 0


def test_async_only_generation_issues_no_host_sync_per_step(tokenizer):
    """The device's own count of synchronising calls that undercurrent's code makes
    on the generation thread grows by one per step, and only in ``after_token``
    (reading the sampled tokens, as transformers' own stopping checks do each
    step): capture, hooks and delivery add none, however many steps run."""
    model = copy.deepcopy(build_model("llama")).to("cuda", torch.bfloat16)
    ours: dict[int, list[tuple[str, str]]] = {}
    with ProbedModel(model, tokenizer, spec=_points("async")) as probed:
        probed.generate(PROMPTS, max_new_tokens=4)  # warm-up: caches, pinned blocks
        main = threading.current_thread().name
        for steps in (4, 12):
            with cuda_sync_log() as calls:
                outputs = probed.generate(PROMPTS, max_new_tokens=steps)
            ours[steps] = [c for c in calls if c[0] == main and c[1].startswith(PACKAGE)]
            assert all(len(o.token_ids) == steps for o in outputs)
            assert all(r.stats.received > 0 for o in outputs for r in o.results.values())
    reads = {steps: [c for c in calls if c[1].endswith("(after_token)")]
             for steps, calls in ours.items()}
    others = {steps: [c for c in calls if c not in reads[steps]]
              for steps, calls in ours.items()}
    assert len(others[12]) == len(others[4]), Counter(others[12]) - Counter(others[4])
    assert len(reads[12]) - len(reads[4]) == 12 - 4


def test_a_model_passed_in_keeps_its_memory_and_nothing_more_after_close(tokenizer):
    model = copy.deepcopy(build_model("llama")).to("cuda", torch.bfloat16)
    transformers_generate(model, tokenizer, PROMPTS, max_new_tokens=3)  # its own caches
    before = _allocated()
    probed = ProbedModel(model, tokenizer, spec=[*_points("async"), *[
        ExtractionPoint(name="inline", layers=(2,), tensor_type="attn_out",
                        position="prompt[-1]", probe_type="norm_probe",
                        probe_kind="single_shot")]])
    kept = probed.generate(PROMPTS, max_new_tokens=6, records=True)
    kept += list(probed.stream(PROMPTS[0], max_new_tokens=4, records=True))
    kept += probed.prompt_activations(PROMPTS)
    probed.close()
    del probed
    assert _allocated() == before  # outputs kept: they hold no GPU memory
    assert kept


def test_from_pretrained_on_cuda_gives_every_byte_back_after_close():
    before = _allocated()
    probed = ProbedModel.from_pretrained("undercurrent/tiny", device="cuda", dtype="bfloat16",
                                         spec=[ExtractionPoint(
                                             name="res", layers=(0, 1, 2, 3),
                                             tensor_type="residual_stream",
                                             position="generated[*]",
                                             probe_type="trajectory_probe",
                                             probe_kind="trajectory",
                                             execution_mode="async")])
    assert _allocated() > before
    outputs = probed.generate(["hello there", "how do i bake bread ?"], max_new_tokens=8,
                              records=True)
    assert all(r.tensor.device.type == "cpu" for o in outputs for r in o.records)
    probed.close()
    del probed
    assert _allocated() == before


def test_prompt_activations_on_cuda_equal_transformers_hidden_states(tokenizer):
    model = copy.deepcopy(build_model("llama")).to("cuda", torch.float16)
    points = [ExtractionPoint(name=name, layers=(0, 1), tensor_type="residual_stream",
                              position=position, probe_type="capture",
                              probe_kind="single_shot")
              for name, position in (("first", "prompt[0]"), ("last", "prompt[-1]"))]
    with ProbedModel(model, tokenizer, spec=points) as probed:
        outputs = probed.prompt_activations(PROMPTS)
    for text, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(text, return_tensors="pt")["input_ids"].to("cuda")
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states
        assert len(output.records) == 4
        for record in output.records:
            assert record.tensor.device.type == "cpu" and record.tensor.dtype == torch.float16
            expected = hidden[record.layer + 1][0, record.token_index].cpu()
            # one padded batch against one unpadded forward: other kernel shapes, so
            # float16 rounding may differ; a wrong row or layer would differ by O(1)
            torch.testing.assert_close(record.tensor, expected, rtol=2e-2, atol=2e-2)


def test_a_bfloat16_store_on_cuda_holds_what_generate_returns(tmp_path):
    from undercurrent import open_activations

    spec = [ExtractionPoint(name="res", layers=(1, 3), tensor_type="residual_stream",
                            position="generated[*]", probe_type="capture",
                            probe_kind="trajectory")]
    prompts = ["hello there", "how do i bake bread ?", "tell me a story about a cat"]
    with ProbedModel.from_pretrained("undercurrent/tiny", device="cuda", dtype="bfloat16",
                                     spec=spec) as probed:
        from undercurrent.store.capture import request_id_for

        ids = [request_id_for(index) for index in range(len(prompts))]
        oracle = probed.generate(prompts, request_ids=ids, records=True, max_new_tokens=6)
        summary = probed.capture(prompts, tmp_path, max_new_tokens=6, progress=False)
    assert summary.requests == len(prompts)
    store = open_activations(tmp_path)
    expected = {r.key(): r.tensor.float().numpy() for o in oracle for r in o.records}
    index = store.index
    vectors = store.vectors(index)
    assert len(index) == len(expected) > 0
    for row, vector in zip(index.itertuples(index=False), vectors, strict=True):
        key = (row.request_id, row.extraction_point_name, int(row.layer), int(row.token_index))
        assert (vector.astype("float32") == expected[key]).all(), key


@pytest.mark.parametrize("mode", ["async", "inline"])
def test_cuda_rows_copy_into_pinned_memory_before_the_output_is_written_in_place(
        tokenizer, mode):
    """On CUDA a hook enqueues one non-blocking copy of its rows, taken from the
    module's output itself (no device clone first), into pinned host memory. A
    later forward hook on the same module that zeroes that output in place runs
    after the copy on the stream: the records hold the values from before it."""
    model = copy.deepcopy(build_model("llama")).to("cuda", torch.bfloat16)
    point = ExtractionPoint(name="res", layers=(1,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="capture",
                            probe_kind="trajectory", execution_mode=mode)
    with ProbedModel(model, tokenizer, spec=[point]) as probed:
        hooks = probed.backend.hooks
        module = hooks.module_for(1, TensorType.RESIDUAL_STREAM)
        before: list[torch.Tensor] = []  # each forward's output, before it is zeroed

        def zero(module, args, output):
            hidden = output if isinstance(output, torch.Tensor) else output[0]
            before.append(hidden[:, -1].detach().cpu())
            hidden.zero_()

        queued = []
        original = hooks._queue

        def spy(tensor_type, targets, gathered):
            original(tensor_type, targets, gathered)
            queued.append(hooks._pending[-1][2])

        hooks._queue = spy
        handle = module.register_forward_hook(zero)  # after undercurrent's hook
        try:
            outputs = probed.generate(PROMPTS, max_new_tokens=5, records=True)
        finally:
            handle.remove()
    assert queued and all(host.is_pinned() and host.is_contiguous() for host in queued)
    assert len(before) == 5  # the prompt's forward, then decode steps 1-4
    for row, output in enumerate(outputs):  # one batch: row i is prompt i
        # generated token g is fed, and captured, at decode step g + 1
        assert sorted(r.generated_index for r in output.records) == [0, 1, 2, 3]
        for record in output.records:
            expected = before[record.generated_index + 1][row]
            assert record.tensor.abs().sum() > 0
            assert torch.equal(record.tensor, expected), record.key()
