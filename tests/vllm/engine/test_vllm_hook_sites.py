"""The worker hooks only the (layer, tensor type) sites the open requests ask for:
counted on the engine's own modules (``_forward_hooks``/``_forward_pre_hooks``), a
site is hooked while a request can still capture there, unhooked once its
positions are past or its requests end, and a later generation with other sites
gets those hooked; the records of the re-hooked sites still equal the HF
backend's. One engine (float32, in-process) for the whole file."""

from __future__ import annotations

import pytest
from vllm_engine_helpers import MAX_NEW_TOKENS, compare, hf_reference, prompts

from undercurrent.adapters.base import SamplingParams
from undercurrent.api import ProbedModel
from undercurrent.probes import probe
from undercurrent.router import Router
from undercurrent.spec import parse_dict

GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
SEEN: list[frozenset[str]] = []
"""The hooked module names at every inline probe call (the worker waits meanwhile)."""
MODEL: list = []


def hooked(model) -> frozenset[tuple[str, int]]:
    """(module name, hook count) for the model's modules that carry forward
    (pre-)hooks now."""
    counts = ((name, len(module._forward_hooks) + len(module._forward_pre_hooks))
              for name, module in model.named_modules())
    return frozenset((name, count) for name, count in counts if count)


def sites(*names: str) -> frozenset[tuple[str, int]]:
    """The model's own step hooks (begin, end) and one hook on each named module."""
    return frozenset({("", 2), *((name, 1) for name in names)})


@probe(register=False)
def snapshot(record):
    """Remembers which modules are hooked while the step's records are routed."""
    SEEN.append(hooked(MODEL[0]))


def point(name, layers, tensor_type, position, probe_type="snapshot"):
    return {"name": name, "layers": layers, "tensor_type": tensor_type, "position": position,
            "probe_type": probe_type, "probe_kind": "single_shot"}


def spec_a(last):
    return {"version": "1", "extraction_points": [
        point("resid0", [0], "residual_stream", "generated[*]"),
        point("attn_prompt", [last], "attn_out", "prompt[-1]"),
        point("kv_gen2", [1], "kv", "generated[2]"),
    ]}


def spec_b(num_layers):
    return {"version": "1", "extraction_points": [
        point("mlp1", [1], "mlp_out", "generated[*]"),
        point("resid_last", [num_layers - 1], "residual_stream", "generated[1:]"),
        point("final", [num_layers], "final_norm", "generated[*]"),
        point("attn_prompt0", [0], "attn_out", "prompt[0]"),
    ]}


@pytest.fixture(scope="module")
def references(model_dir, num_layers):
    # The oracle runs before vLLM is imported in this process.
    texts = prompts(8)
    a = parse_dict(spec_a(num_layers - 1)).extraction_points
    b = parse_dict(spec_b(num_layers)).extraction_points
    return texts, hf_reference(model_dir, texts, list(a), GREEDY), hf_reference(
        model_dir, texts, list(b), GREEDY)


@pytest.fixture(scope="module")
def backend(model_dir, references):
    loaded = ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                         max_model_len=256, max_num_seqs=16)
    MODEL.append(loaded.backend.engine.collective_rpc(
        lambda worker: worker.model_runner.get_model())[0])
    yield loaded.backend
    loaded.close()


def probed(backend, spec):
    router = Router(probes={"snapshot": snapshot})
    return ProbedModel(backend, spec=spec, router=router), router


def test_only_the_asked_sites_are_hooked_and_past_ones_are_unhooked(backend, references,
                                                                    num_layers):
    model = MODEL[0]
    last = num_layers - 1
    # Attached, no request open: only the model's step hooks (begin, end).
    assert hooked(model) == sites()
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    texts, hf_a, _ = references
    chosen = next(i for i, out in enumerate(hf_a) if len(out.token_ids) == MAX_NEW_TOKENS)
    resid0, attn_last, kv1 = "model.layers.0", f"model.layers.{last}.self_attn", \
        "model.layers.1.self_attn.attn"
    model_a, router = probed(backend, spec_a(last))
    by_event = []
    try:
        for event in model_a.stream(texts[chosen], max_new_tokens=MAX_NEW_TOKENS):
            if not event.finished:
                by_event.append(hooked(model))
    finally:
        router.shutdown()
    assert len(by_event) == MAX_NEW_TOKENS
    # The prompt's forward: its last token's attention output, the residual stream
    # at layer 0 (for what comes) and the kv site waiting for generated[2].
    assert by_event[0] == sites(resid0, attn_last, kv1)
    # Past the prompt the attention site goes; kv goes once generated[2] was fed.
    assert by_event[1] == sites(resid0, kv1)
    assert by_event[-1] == sites(resid0)
    # The request released: every site unhooked.
    assert hooked(model) == sites()


def test_a_later_request_with_other_sites_is_rehooked_and_gives_hf_records(backend, references,
                                                                           num_layers):
    model = MODEL[0]
    texts, hf_a, hf_b = references
    ids = [f"r{i}" for i in range(len(texts))]
    for spec, expected, names in (
        (spec_a(num_layers - 1), hf_a,
         {"model.layers.0", f"model.layers.{num_layers - 1}.self_attn",
          "model.layers.1.self_attn.attn"}),
        (spec_b(num_layers), hf_b,
         {"model.layers.1.mlp", f"model.layers.{num_layers - 1}", "model.norm",
          "model.layers.0.self_attn"}),
    ):
        SEEN.clear()
        model_x, router = probed(backend, spec)
        try:
            outputs = model_x.generate(texts, request_ids=ids, max_new_tokens=MAX_NEW_TOKENS,
                                       records=True)
        finally:
            router.shutdown()
        compare(outputs, expected)
        # Every site hooked at some step is one the spec asks for, all of them were,
        # and each carried exactly one hook.
        assert SEEN and set().union(*SEEN) == sites(*names)
        assert hooked(model) == sites()
