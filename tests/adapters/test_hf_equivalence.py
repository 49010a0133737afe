"""Captured activations equal what transformers itself computes.

Oracles, all independent of undercurrent's hooks and architecture table:
``output_hidden_states`` of a plain ``generate()`` on the same padded batch
(``residual_stream`` at layer l is ``hidden_states[l + 1]``, ``final_norm`` is
``hidden_states[N]``), plain forward hooks on module paths written out here by
hand (``attn_out``, ``mlp_out``, the last layer's residual), and the contents of
the cache ``generate()`` returns (``kv``). Prompts of different lengths run as
one left-padded batch; greedy and seeded sampling.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer, prompt, transformers_generate  # noqa: E402

from undercurrent.adapters import CaptureSession, SamplingParams  # noqa: E402
from undercurrent.adapters.hf.backend import HFBackend  # noqa: E402
from undercurrent.spec.types import ExtractionPoint  # noqa: E402

# model_type -> (decoder layers, attention attr, mlp attr), read off named_modules()
ORACLE_PATHS = {
    "llama": ("model.layers", "self_attn", "mlp"),
    "qwen2": ("model.layers", "self_attn", "mlp"),
    "gemma2": ("model.layers", "self_attn", "mlp"),
    "gpt2": ("transformer.h", "attn", "mlp"),
    "gpt_neox": ("gpt_neox.layers", "attention", "mlp"),
    "opt": ("model.decoder.layers", "self_attn", "fc2"),
    "falcon": ("transformer.h", "self_attention", "mlp"),
}
N_LAYERS = 3
EOS = 2
PROMPTS = [prompt(3, 1, 4, 1, 5, 9), prompt(2, 6), prompt(5, 3, 5, 8)]
MAX_NEW = 5
TENSOR_TYPES = ("residual_stream", "attn_out", "mlp_out", "kv", "final_norm")


def _points() -> list[ExtractionPoint]:
    """Every prompt token (via prompt[i]/absolute positions) and every fed generated
    token, for every tensor type at every layer."""
    positions = ["prompt[0]", "1", "prompt[2]", "prompt[-1]", "prompt[-2]", "generated[*]",
                 "prompt[3]", "prompt[4]", "prompt[5]"]
    points = []
    for tensor_type in TENSOR_TYPES:
        layers = (N_LAYERS,) if tensor_type == "final_norm" else tuple(range(N_LAYERS))
        for i, position in enumerate(positions):
            points.append(ExtractionPoint(
                name=f"{tensor_type}_{i}", layers=layers, tensor_type=tensor_type,
                position=position, probe_type="none",
                probe_kind="trajectory" if position == "generated[*]" else "single_shot"))
    return points


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _oracle(model, tokenizer, params):
    """Plain generate() with output_hidden_states and hand-placed forward hooks, on
    the tokenizer's own left-padded batch (no undercurrent code builds its input)."""
    layers_path, attn_name, mlp_name = ORACLE_PATHS[model.config.model_type]
    layers = model.get_submodule(layers_path)
    captured = {"attn_out": {}, "mlp_out": {}, "last_residual": []}
    handles = []
    for index, layer in enumerate(layers):
        for kind, name in (("attn_out", attn_name), ("mlp_out", mlp_name)):
            store = captured[kind].setdefault(index, [])

            def hook(module, args, output, store=store):
                out = _first(output)
                store.append(out.detach().clone())
            handles.append(getattr(layer, name).register_forward_hook(hook))
    handles.append(layers[N_LAYERS - 1].register_forward_hook(
        lambda m, a, o: captured["last_residual"].append(_first(o).detach().clone())))
    sampling = {} if params.greedy else dict(temperature=params.temperature,
                                             top_k=params.top_k, top_p=params.top_p)
    try:
        batch, out = transformers_generate(
            model, tokenizer, PROMPTS, max_new_tokens=params.max_new_tokens, seed=params.seed,
            return_dict_in_generate=True, output_hidden_states=True, use_cache=True,
            **sampling)
    finally:
        for handle in handles:
            handle.remove()
    return out, captured, batch["input_ids"].shape[1]


def _expected(record, row, out, captured, width, prompt_len):
    """The oracle's tensor for a record of batch row ``row``."""
    if record.is_generated:
        step, col = record.generated_index + 1, 0
        cache_pos = width + record.generated_index
    else:
        step, col = 0, width - prompt_len + record.token_index
        cache_pos = col
    layer = record.layer
    kind = record.tensor_type
    if kind == "final_norm":
        return out.hidden_states[step][N_LAYERS][row, col]
    if kind == "residual_stream":
        if layer == N_LAYERS - 1:
            return captured["last_residual"][step][row, col]
        return out.hidden_states[step][layer + 1][row, col]
    if kind in ("attn_out", "mlp_out"):
        full = captured[kind][layer][step]
        if full.dim() == 2:
            full = full.view(out.hidden_states[step][0].shape[0], -1, full.shape[-1])
        return full[row, col]
    cache = out.past_key_values.layers[layer]
    return torch.stack([cache.keys[row, :, cache_pos], cache.values[row, :, cache_pos]])


def _check(model_type, params, device=None, dtype=None):
    """Records against the oracle; ``device``/``dtype``: on a copy of the model moved
    there (records must still land on the CPU, in the model's dtype)."""
    model = build_model(model_type)
    if device is not None:
        model = copy.deepcopy(model).to(device=device, dtype=dtype)
    tokenizer = build_tokenizer()
    backend = HFBackend(model, tokenizer)
    out, captured, width = _oracle(model, tokenizer, params)
    session = CaptureSession(None, _points(), keep_records=True)
    outputs = backend.generate(PROMPTS, ["a", "b", "c"], params, session)
    checked = 0
    for row, output in enumerate(outputs):
        plain = out.sequences[row, width:].tolist()
        if EOS in plain:  # plain generate() pads a row out after its eos
            plain = plain[: plain.index(EOS) + 1]
            assert output.finish_reason == "eos"
        assert list(output.token_ids) == plain, "probing changed the tokens"
        prompt_len = output.prompt_len
        seen = {(r.tensor_type, r.layer, r.token_index) for r in output.records}
        # every prompt token and every fed generated token, every type and layer
        fed = list(range(prompt_len)) + [prompt_len + g for g in range(len(plain) - 1)]
        for kind in TENSOR_TYPES:
            layers = [N_LAYERS] if kind == "final_norm" else range(N_LAYERS)
            for layer in layers:
                for index in fed:
                    assert (kind, layer, index) in seen, (kind, layer, index, row)
        for record in output.records:
            assert record.token_id == (list(output.prompt_token_ids) + list(output.token_ids))[
                record.token_index]
            expected = _expected(record, row, out, captured, width, prompt_len)
            assert record.tensor.device.type == "cpu", record.key()
            assert record.tensor.dtype == next(model.parameters()).dtype, record.key()
            torch.testing.assert_close(record.tensor, expected.to("cpu", record.tensor.dtype),
                                       msg=lambda m, r=record: f"{r.key()} {r.tensor_type}: {m}")
            checked += 1
    assert checked > 0
    return outputs


@pytest.mark.parametrize("model_type", sorted(ORACLE_PATHS))
def test_every_tensor_type_matches_transformers_greedy_batched(model_type):
    outputs = _check(model_type, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.prompt_len for o in outputs] == [7, 3, 5]  # <bos> counts, padding does not


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ON_DEVICES = [
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float32, marks=CUDA),
    pytest.param("cuda", torch.bfloat16, marks=CUDA),
    pytest.param("cuda", torch.float16, marks=CUDA),
]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize(("device", "dtype"), ON_DEVICES)
def test_every_tensor_type_matches_transformers_on_the_device_in_its_dtype(model_type, device,
                                                                            dtype):
    outputs = _check(model_type, SamplingParams(max_new_tokens=MAX_NEW), device, dtype)
    assert [o.prompt_len for o in outputs] == [7, 3, 5]


@pytest.mark.parametrize(("device", "dtype"), ON_DEVICES[:2])
def test_seeded_sampling_matches_plain_generate_on_the_device(device, dtype):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_k=20, seed=7)
    first = _check("llama", params, device, dtype)
    again = _check("llama", params, device, dtype)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_seeded_sampling_matches_plain_generate(model_type):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_k=20, seed=7)
    first = _check(model_type, params)
    again = _check(model_type, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox"])
def test_capture_last_token_matches_a_full_forward(model_type):
    model = build_model(model_type)
    backend = HFBackend(model, build_tokenizer())
    point = ExtractionPoint(name="all", layers=(0, 2), tensor_type="residual_stream",
                            position="generated[*]", probe_type="none",
                            probe_kind="trajectory")
    session = CaptureSession(None, [point], keep_records=True)
    params = SamplingParams(max_new_tokens=4, capture_last_token=True)
    outputs = backend.generate(PROMPTS[:2], ["a", "b"], params, session)
    for output in outputs:
        indices = sorted({r.generated_index for r in output.records})
        assert indices == [0, 1, 2, 3]  # the last sampled token too
        sequence = torch.tensor([list(output.prompt_token_ids) + list(output.token_ids)])
        with torch.no_grad():
            hidden = model(sequence, output_hidden_states=True).hidden_states
        for record in output.records:
            if record.layer == 0:
                torch.testing.assert_close(record.tensor, hidden[1][0, record.token_index],
                                           rtol=1e-4, atol=1e-5)


def test_without_capture_last_token_the_last_token_has_no_record():
    backend = HFBackend(build_model("llama"), build_tokenizer())
    point = ExtractionPoint(name="all", layers=(1,), tensor_type="mlp_out",
                            position="generated[*]", probe_type="none", probe_kind="trajectory")
    session = CaptureSession(None, [point], keep_records=True)
    (output,) = backend.generate([PROMPTS[0]], ["a"], SamplingParams(max_new_tokens=4), session)
    assert [r.generated_index for r in output.records] == [0, 1, 2]
