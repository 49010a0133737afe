"""HF backend behaviour: per-row aborts, stop strings, eos, hooks that do work
only where asked, and no hook left behind after close, errors or interrupts."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    build_model,
    build_tokenizer,
    own_model,
    prompt,
    transformers_generate,
)

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.adapters import CaptureSession, SamplingParams  # noqa: E402
from undercurrent.adapters.capabilities import CapabilityError  # noqa: E402
from undercurrent.adapters.hf.architectures import UnsupportedArchitectureError  # noqa: E402
from undercurrent.adapters.hf.backend import HFBackend  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.records import BatchSignals, ProbeSignal, SignalAction  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, ProbeKind  # noqa: E402

PROMPTS = [prompt(3, 1, 4, 1, 5), prompt(2, 6), prompt(5, 3, 5, 8)]


class AbortAt(Probe):
    """Aborts the request whose prompt starts with ``word`` at generated token ``at``
    (or at prompt token ``prompt_at``); scores every activation with its token index."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def __init__(self, word: str, at: int | None = None, prompt_at: int | None = None):
        self.word, self.at, self.prompt_at = word, at, prompt_at

    def on_start(self, ctx):
        self.mine = ctx.prompt.split()[0] == self.word
        self.seen = []

    def on_activation(self, record):
        self.seen.append(record.token_index)
        hit = (record.generated_index == self.at) if record.is_generated else (
            record.token_index == self.prompt_at)
        action = SignalAction.ABORT if (self.mine and hit) else SignalAction.CONTINUE
        return ProbeSignal(action=action, score=float(record.token_index))

    def on_end(self, ctx):
        return list(self.seen)


def all_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def plain_tokens(backend, prompts, params):
    """Greedy tokens from transformers alone (``hf_models.transformers_generate``)."""
    assert params.greedy and params.seed is None
    batch, out = transformers_generate(backend.model, backend.tokenizer, prompts,
                                       max_new_tokens=params.max_new_tokens)
    return out[:, batch["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _abort_spec(**args):
    return [ExtractionPoint(name="watch", layers=(1,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="abort_at",
                            probe_kind="trajectory", probe_args=args),
            ExtractionPoint(name="first", layers=(0,), tensor_type="mlp_out",
                            position="prompt[-1]", probe_type="abort_at",
                            probe_kind="single_shot", probe_args=args)]


def test_an_abort_stops_only_its_row_before_the_next_token(tokenizer):
    model = build_model("llama")
    pm = ProbedModel(model, tokenizer, spec=_abort_spec(word="w2", at=2),
                     probes={"abort_at": AbortAt})
    params = SamplingParams(max_new_tokens=8)
    expected = plain_tokens(pm.backend, PROMPTS, params)
    outs = pm.generate(PROMPTS, max_new_tokens=8, records=True)
    aborted = outs[1]
    assert aborted.aborted and aborted.finish_reason == "abort"
    assert aborted.abort.extraction_point_name == "watch"
    assert aborted.abort.generated_index == 2
    assert aborted.abort.token_index == aborted.prompt_len + 2
    assert aborted.abort.signal.action is SignalAction.ABORT
    # g2's activations were probed and aborted: nothing after g2 was produced
    assert list(aborted.token_ids) == expected[1][:3]
    assert max(r.token_index for r in aborted.records) == aborted.prompt_len + 2
    assert aborted.results["watch"].verdict == [aborted.prompt_len + i for i in range(3)]
    for row in (0, 2):  # the other rows ran to the end, unchanged
        assert not outs[row].aborted
        assert list(outs[row].token_ids) == expected[row]
        assert outs[row].results["watch"].verdict == [
            outs[row].prompt_len + i for i in range(7)]
    pm.close()


def test_an_abort_on_a_prompt_token_produces_nothing(tokenizer):
    pm = ProbedModel(build_model("gpt2"), tokenizer, spec=_abort_spec(word="w5", prompt_at=4),
                     probes={"abort_at": AbortAt})
    outs = pm.generate(PROMPTS, max_new_tokens=4)
    assert outs[2].aborted and outs[2].token_ids == () and outs[2].text == ""
    assert outs[2].abort.extraction_point_name == "first" and outs[2].abort.token_index == 4
    assert outs[2].abort.generated_index is None
    assert len(outs[0].token_ids) == 4 and len(outs[1].token_ids) == 4
    pm.close()


def test_stop_strings_end_a_row_and_are_cut_from_the_text(tokenizer):
    model = build_model("llama")
    backend = HFBackend(model, tokenizer)
    params = SamplingParams(max_new_tokens=8)
    full = plain_tokens(backend, PROMPTS, params)
    row0 = [tokenizer.decode([t]) for t in full[0]]
    stop_word = row0[3]
    first = row0.index(stop_word)
    outs = backend.generate(PROMPTS, ["a", "b", "c"],
                            SamplingParams(max_new_tokens=8, stop=(stop_word,)),
                            CaptureSession(None, []))
    assert outs[0].finish_reason == "stop"
    assert list(outs[0].token_ids) == full[0][:first + 1]
    assert outs[0].text == " ".join(row0[:first]) + (" " if first else "")
    assert stop_word not in outs[0].text


def test_eos_ends_a_row_and_stays_in_its_tokens(tokenizer):
    model = build_model("gpt2")
    params = SamplingParams(max_new_tokens=6)
    full = plain_tokens(HFBackend(model, tokenizer), PROMPTS, params)
    eos = full[0][2]  # make the third token of row 0 the model's eos
    model.generation_config.eos_token_id = eos
    try:
        backend = HFBackend(model, tokenizer)
        outs = backend.generate(PROMPTS, ["a", "b", "c"], params, CaptureSession(None, []))
    finally:
        model.generation_config.eos_token_id = None
    assert outs[0].finish_reason == "eos"
    for row, out in enumerate(outs):
        if eos in full[row]:
            assert list(out.token_ids) == full[row][: full[row].index(eos) + 1]
        else:
            assert out.finish_reason == "length" and list(out.token_ids) == full[row]


def test_an_eos_set_after_the_probed_model_was_built_ends_rows_as_plain_generate_does(
        tokenizer):
    # The eos ids were read once, when the backend was built: a generation_config
    # changed afterwards was ignored (plain generate() obeys it). Read at each call,
    # on the batched path, the per-row one (stop strings) and a stream alike.
    model = copy.deepcopy(build_model("llama"))
    params = SamplingParams(max_new_tokens=6)
    with ProbedModel(model, tokenizer) as pm:
        full = plain_tokens(pm.backend, PROMPTS, params)
        # (a token of row 0 that first comes after its first token)
        cut = next(i for i, token in enumerate(full[0]) if i and token not in full[0][:i])
        eos = full[0][cut]
        model.generation_config.eos_token_id = eos
        expected = [tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
                    for tokens in full]
        # (plain generate() ends row 0 there, then pads it)
        assert plain_tokens(pm.backend, PROMPTS, params)[0][:cut + 1] == expected[0]
        for stop in (None, ["zz"]):
            outs = pm.generate(PROMPTS, max_new_tokens=6, stop=stop)
            assert outs[0].finish_reason == "eos"
            for out, tokens in zip(outs, expected, strict=True):
                assert list(out.token_ids) == tokens
                assert out.finish_reason == ("eos" if eos in tokens else "length")
        streamed = list(pm.stream(PROMPTS[0], max_new_tokens=6))
        assert [event.token_id for event in streamed[:-1]] == expected[0]
        model.generation_config.eos_token_id = None
        assert [list(out.token_ids) for out in pm.generate(PROMPTS, max_new_tokens=6)] == full


def test_hooks_are_installed_only_for_wanted_pairs_and_do_work_only_when_matching(tokenizer):
    model = build_model("llama")
    backend = HFBackend(model, tokenizer)
    point = ExtractionPoint(name="p", layers=(1,), tensor_type="attn_out", position="prompt[-1]",
                            probe_type="none", probe_kind="single_shot")
    installed, gathers = [], []
    original_flush = backend.hooks.flush

    def counting_flush(session):  # what the forward's hooks gathered, before it is routed
        for _, _, gathered in backend.hooks._pending:
            installed.append(set(backend.hooks.installed))
            gathers.append(gathered.shape[0])
        return original_flush(session)

    backend.hooks.flush = counting_flush
    session = CaptureSession(None, [point], keep_records=True)
    outs = backend.generate(PROMPTS, ["a", "b", "c"], SamplingParams(max_new_tokens=6), session)
    # one hook for (1, attn_out) plus the per-forward pre-hook; one gather for all
    # three rows at prefill; no work at the five decode steps
    assert installed == [{(1, point.tensor_type)}]
    assert gathers == [3]
    assert [len(o.records) for o in outs] == [1, 1, 1]


def test_close_and_interrupts_leave_no_hook_behind(tokenizer):
    model = build_model("qwen2")
    baseline = all_hooks(model)
    points = [ExtractionPoint(name=f"p{i}", layers=(0, 1, 2), tensor_type=t,
                              position="generated[*]", probe_type="none",
                              probe_kind="trajectory")
              for i, t in enumerate(("residual_stream", "attn_out", "mlp_out", "kv"))]

    class InterruptingRouter:
        def __init__(self, exc):
            self.exc, self.live, self.routed = exc, set(), 0

        def register_request(self, request_id, points, ctx=None):
            self.live.add(request_id)

        def route_columns(self, batch, spans=None):  # what CaptureSession calls
            return BatchSignals.from_signals([self.route(r) for r in batch.records()])

        def route(self, record):
            self.routed += 1
            assert all_hooks(model) > baseline  # hooks are live during generation
            if self.routed == 5:
                raise self.exc

        def end_request(self, request_id):
            self.live.discard(request_id)
            return {}

    for exc in (KeyboardInterrupt(), RuntimeError("boom")):
        router = InterruptingRouter(exc)
        backend = HFBackend(model, tokenizer)
        with pytest.raises(type(exc)):
            backend.generate(PROMPTS, ["a", "b", "c"], SamplingParams(max_new_tokens=5),
                             CaptureSession(router, points))
        assert all_hooks(model) == baseline
        assert router.live == set()  # every request ended with the router
        backend.close()
    # an early-closed stream cleans up too
    backend = HFBackend(model, tokenizer)
    router = InterruptingRouter(RuntimeError("unused"))
    router.routed = -10**6
    stream = backend.stream(PROMPTS[0], "s", SamplingParams(max_new_tokens=6),
                            CaptureSession(router, points))
    next(stream)
    stream.close()
    assert all_hooks(model) == baseline and router.live == set()
    # and the model behaves exactly as before
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        before = model(ids).logits
    pm = ProbedModel(model, tokenizer, spec=points[:1],
                     probe_defaults={"none": {"word": "the"}}, probes={"none": AbortAt})
    pm.close()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    assert all_hooks(model) == baseline


def test_capability_errors_are_clear(tokenizer):
    model = build_model("llama")
    caps = HFBackend(model, tokenizer).capabilities()
    assert caps.num_layers == 3 and caps.valid_layers("final_norm") == (3,)
    assert caps.valid_layers("kv") == (0, 1, 2)
    assert (caps.num_kv_heads, caps.head_dim, caps.hidden_size) == (2, 8, 32)
    bad = [ExtractionPoint(name="too_deep", layers=(1, 3), tensor_type="mlp_out",
                           position="prompt[-1]", probe_type="none", probe_kind="single_shot"),
           ExtractionPoint(name="norm", layers=(2,), tensor_type="final_norm",
                           position="prompt[-1]", probe_type="none", probe_kind="single_shot")]
    with pytest.raises(CapabilityError) as info:
        ProbedModel(model, tokenizer, spec=bad)
    message = str(info.value)
    assert "'too_deep'" in message and "[3]" in message and "valid: 0..2" in message
    assert "'final_norm'" in message  # layer 3 is the final norm: the hint says so
    assert "'norm'" in message and "layer N = 3" in message

    class MambaForCausalLM:
        class config:  # noqa: N801
            model_type = "mamba"

    with pytest.raises(UnsupportedArchitectureError) as info:
        HFBackend(MambaForCausalLM(), tokenizer)
    assert "MambaForCausalLM" in str(info.value) and "'mamba'" in str(info.value)
    assert "llama" in str(info.value)


def test_stream_yields_tokens_with_signals_then_the_output(tokenizer):
    pm = ProbedModel(build_model("llama"), tokenizer, spec=_abort_spec(word="none"),
                     probes={"abort_at": AbortAt})
    events = list(pm.stream(PROMPTS[0], max_new_tokens=5))
    tokens, final = events[:-1], events[-1]
    assert final.finished and final.output is not None and final.token_id is None
    assert [e.token_id for e in tokens] == list(final.output.token_ids)
    assert "".join(e.text for e in tokens).strip() == final.output.text.strip()
    assert [e.generated_index for e in tokens] == [0, 1, 2, 3, 4]
    # generated token g is probed on the step after it is sampled: its signal comes
    # with the event of g + 1
    streamed = [s.token_index for e in events for s in e.signals if s.extraction_point_name
                == "watch"]
    assert streamed == [final.output.prompt_len + i for i in range(4)]
    pm.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_placement_is_honoured_and_records_land_on_the_cpu(tokenizer):
    model = copy.deepcopy(build_model("llama")).to("cuda")
    point = ExtractionPoint(name="p", layers=(0, 2), tensor_type="kv", position="generated[*]",
                            probe_type="none", probe_kind="trajectory")
    gpu = HFBackend(model, tokenizer)
    cpu = HFBackend(build_model("llama"), tokenizer)
    params = SamplingParams(max_new_tokens=4)
    outs = [b.generate(PROMPTS, ["a", "b", "c"], params,
                       CaptureSession(None, [point], keep_records=True)) for b in (gpu, cpu)]
    for on_gpu, on_cpu in zip(*outs, strict=True):
        assert on_gpu.token_ids == on_cpu.token_ids
        for a, b in zip(on_gpu.records, on_cpu.records, strict=True):
            assert a.tensor.device.type == "cpu" and a.key() == b.key()
            torch.testing.assert_close(a.tensor, b.tensor, rtol=1e-3, atol=1e-4)


# -- forwards that are not the generation's -----------------------------------------

def _lens_spec(probe_type: str) -> list[ExtractionPoint]:
    return [ExtractionPoint(name="lens", layers=(1,), tensor_type="residual_stream",
                            position="generated[*]", probe_type=probe_type,
                            probe_kind="single_shot"),
            ExtractionPoint(name="norm", layers=(3,), tensor_type="final_norm",
                            position="generated[*]", probe_type="none", probe_kind="trajectory"),
            ExtractionPoint(name="kv", layers=(0,), tensor_type="kv",
                            position="generated[*]", probe_type="none", probe_kind="trajectory")]


def _keys(output):
    return [(r.extraction_point_name, r.layer, r.token_index, tuple(r.tensor.flatten().tolist()))
            for r in output.records]


class _Scores(Probe):
    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def __init__(self, **args):
        pass

    def on_start(self, ctx):
        pass

    def on_activation(self, record):
        return ProbeSignal(action=SignalAction.CONTINUE, score=float(record.tensor.flatten()[0]))

    def on_end(self, ctx):
        return None


@pytest.mark.timeout(120)
def test_forwards_a_probe_runs_during_routing_are_not_captured(tokenizer):
    # A logit lens calls the final norm (a hooked module) and the whole model from
    # an inline probe: those forwards went through the generation's hooks, adding
    # final_norm records (or failing in a hook). Only the generation's are captured.
    model = build_model("llama")
    ids = torch.tensor([[1, 5, 6]])

    class Lens(_Scores):
        def on_activation(self, record):
            with torch.no_grad():
                model.lm_head(model.model.norm(record.tensor[None]))
                model(ids, use_cache=True)
            return super().on_activation(record)

    outputs = []
    for probe in (_Scores, Lens):
        with ProbedModel(model, tokenizer, spec=_lens_spec("lens"),
                         probes={"lens": probe, "none": _Scores}) as pm:
            outputs.append(pm.generate(PROMPTS, max_new_tokens=5, records=True))
    for plain, lens in zip(*outputs, strict=True):
        assert lens.token_ids == plain.token_ids
        assert _keys(lens) == _keys(plain)
        assert all(result.error is None for result in lens.results.values())


def test_a_probe_s_forward_while_the_last_token_replay_is_routed_is_not_steered(tokenizer):
    # capture_last_token: the replay's records were routed after its forward, and a
    # probe's model(...) then looked like the generation's own: steered by its
    # edits, captured by its plan (or failing in a hook on another shape).
    from undercurrent.spec.types import Edit

    model = build_model("llama")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10] * 2] * 3)
    with torch.no_grad():
        clean = model(ids).logits
    steered: list[tuple[int, float]] = []

    class Lens(_Scores):
        def on_activation(self, record):
            with torch.no_grad():
                diff = float((model(ids).logits - clean).abs().max())
            if diff:
                steered.append((record.token_index, diff))
            return super().on_activation(record)

    edit = Edit(name="push", layers=(0,), tensor_type="residual_stream",
                position="generated[*]", op="add", vector=[1.0] * 32, coefficient=4.0)
    with ProbedModel(model, tokenizer, spec=_lens_spec("lens"),
                     probes={"lens": Lens, "none": _Scores}) as pm:
        outputs = pm.generate(PROMPTS, max_new_tokens=4, edits=[edit], capture_last_token=True)
    assert steered == []
    assert all(result.error is None for output in outputs for result in output.results.values())
    # (the replay's records reached the probe: one per generated token, the last too)
    assert all(output.results["lens"].stats.processed == len(output.token_ids)
               for output in outputs)


def test_a_model_whose_weights_accelerate_offloads_is_probed_like_the_model(tokenizer):
    # cpu_offload leaves the parameters on the meta device: the kv check's forward
    # (and each call's inputs) went there, and ProbedModel(...) failed with "Cannot
    # copy out of meta tensor". Inputs go to accelerate's execution device.

    accelerate = pytest.importorskip("accelerate")
    model = copy.deepcopy(build_model("llama"))  # (build_model's is shared: not offloaded)
    point = ExtractionPoint(name="resid", layers=(0, 1), tensor_type="residual_stream",
                            position="prompt[-1]", probe_type="capture",
                            probe_kind="single_shot")
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                               do_sample=False)[0, ids.shape[1]:].tolist()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert next(model.parameters()).device.type == "meta"
    with ProbedModel(model, tokenizer, spec=[point]) as pm:
        (prompt,) = pm.prompt_activations([PROMPTS[0]])
        (output,) = pm.generate([PROMPTS[0]], max_new_tokens=4)
    assert list(prompt.prompt_token_ids) == ids[0].tolist() and len(prompt.records) == 2
    for record in prompt.records:
        torch.testing.assert_close(record.tensor, hidden[record.layer + 1][0, record.token_index])
    assert list(output.token_ids) == plain[:len(output.token_ids)]


@pytest.mark.timeout(120)
def test_another_thread_using_the_model_during_a_generation_leaves_it_untouched(tokenizer):
    # Building a second ProbedModel on the model (its kv check runs one forward) and
    # a plain forward, from another thread while a steered generation waits in its
    # probe: both went through the generation's hooks (steered, captured as an extra
    # decode step, or failing with its internal error).
    from undercurrent.spec.types import Edit

    model = build_model("llama")
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        clean = model(ids).logits
    reached, release = threading.Event(), threading.Event()

    class Gate(_Scores):
        def on_activation(self, record):
            if record.generated_index == 2 and not release.is_set():
                reached.set()
                release.wait()
            return super().on_activation(record)

    edit = Edit(name="push", layers=(1,), tensor_type="residual_stream",
                position="generated[*]", op="add", vector=[1.0] * 32, coefficient=4.0)
    with ProbedModel(model, tokenizer, spec=_lens_spec("gate"),
                     probes={"gate": Gate, "none": _Scores}) as pm:
        release.set()
        alone = pm.generate(PROMPTS, max_new_tokens=6, records=True, edits=[edit])
        release.clear()
        done: dict[str, Any] = {}
        generating = threading.Thread(target=lambda: done.update(outputs=pm.generate(
            PROMPTS, max_new_tokens=6, records=True, edits=[edit])))
        generating.start()
        reached.wait()
        try:
            with ProbedModel(model, tokenizer) as other:
                assert other.capabilities().supports("kv")
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, clean, rtol=0, atol=0)
        finally:
            release.set()
            generating.join()
    for undisturbed, disturbed in zip(alone, done["outputs"], strict=True):
        assert disturbed.token_ids == undisturbed.token_ids
        assert _keys(disturbed) == _keys(undisturbed)
        assert list(disturbed.edits) == list(undisturbed.edits)


def test_a_torch_compiled_model_is_probed_as_the_model_it_wraps(tokenizer):
    # The hooks went on torch.compile's wrapper, whose generate() is the wrapped
    # model's own: no probe ran, no record came, no guard fired, silently. The
    # backend probes the wrapped model, whose (uncompiled) forward generate() runs.
    model = own_model("llama")
    points = [ExtractionPoint(name="resid", layers=(0, 2), tensor_type="residual_stream",
                              position="generated[*]", probe_type="capture",
                              probe_kind="trajectory"),
              ExtractionPoint(name="last", layers=(1,), tensor_type="kv",
                              position="prompt[-1]", probe_type="capture",
                              probe_kind="single_shot")]
    with ProbedModel(model, tokenizer, spec=points) as pm:
        plain = pm.generate(PROMPTS, max_new_tokens=4, records=True)
        (plain_prompt,) = pm.prompt_activations([PROMPTS[0]])
    compiled = torch.compile(model)
    with ProbedModel(compiled, tokenizer, spec=points) as pm:
        probed = pm.generate(PROMPTS, max_new_tokens=4, records=True)
        (probed_prompt,) = pm.prompt_activations([PROMPTS[0]])
        probed_model = pm.backend.model
    assert all_hooks(model) == all_hooks(compiled) == 0
    for output, reference in zip([*probed, probed_prompt], [*plain, plain_prompt], strict=True):
        assert output.token_ids == reference.token_ids and output.records
        assert _keys(output) == _keys(reference)
        assert {name: result.stats.processed for name, result in output.results.items()} == {
            name: result.stats.processed for name, result in reference.results.items()}
    assert probed_model is model
