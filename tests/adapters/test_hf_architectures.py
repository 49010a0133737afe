"""The architecture table: every entry locates its capture sites on a tiny random
model built from a config, captures every tensor type at every layer, and agrees
with the model's own hidden states."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    CONFIGS,
    build_model,
    build_tokenizer,
    prompt,
    transformers_generate,
)

from undercurrent.adapters import CaptureSession, SamplingParams  # noqa: E402
from undercurrent.adapters.hf.architectures import (  # noqa: E402
    ARCHITECTURES,
    find_architecture,
    supported_model_types,
)
from undercurrent.adapters.hf.backend import HFBackend  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, TensorType  # noqa: E402

REQUIRED = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
            "phi3", "gpt2", "gpt_neox", "gptj", "opt", "falcon"}


def test_the_table_covers_the_required_families_and_every_entry_is_tested():
    assert REQUIRED <= set(supported_model_types())
    assert set(supported_model_types()) == set(CONFIGS)
    assert len({e.family for e in ARCHITECTURES}) == len(ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_tensor_type_at_every_layer(model_type):
    model = build_model(model_type)
    backend = HFBackend(model, build_tokenizer())
    caps = backend.capabilities()
    assert find_architecture(model).model_types[0] == model_type or model_type in \
        find_architecture(model).model_types
    n = caps.num_layers
    assert n == 3 and set(caps.tensor_types) == set(TensorType)
    points = [ExtractionPoint(name=f"{t.value}_{pos}", layers=caps.valid_layers(t), tensor_type=t,
                              position=pos, probe_type="none",
                              probe_kind="trajectory" if "*" in pos else "single_shot")
              for t in TensorType for pos in ("prompt[-1]", "generated[*]")]
    prompts = [prompt(4, 8, 15, 16, 23), prompt(42, 7)]
    session = CaptureSession(None, points, keep_records=True)
    params = SamplingParams(max_new_tokens=3)
    outs = backend.generate(prompts, ["a", "b"], params, session)
    batch, generated = transformers_generate(model, backend.tokenizer, prompts,
                                             max_new_tokens=params.max_new_tokens)
    ids = batch["input_ids"]
    plain = generated[:, ids.shape[1]:].tolist()
    for row, out in enumerate(outs):
        assert list(out.token_ids) == plain[row][: len(out.token_ids)]
        fed = 1 + len(out.token_ids) - 1  # last prompt token + fed generated tokens
        per_token = 4 * n + 1  # four per-layer types at n layers, plus final_norm
        assert len(out.records) == fed * per_token
        for record in out.records:
            if record.tensor_type == "kv":
                assert tuple(record.tensor.shape) == (2, caps.num_kv_heads, caps.head_dim)
            else:
                assert tuple(record.tensor.shape) == (caps.hidden_size,)
            assert record.tensor.device.type == "cpu" and record.tensor.dtype == torch.float32
    # the unpadded row against a plain forward of its own prompt
    first = {(r.tensor_type, r.layer): r.tensor for r in outs[0].records if not r.is_generated}
    with torch.no_grad():
        hidden = model(ids[:1], output_hidden_states=True).hidden_states
    torch.testing.assert_close(first[("residual_stream", 0)], hidden[1][0, -1])
    torch.testing.assert_close(first[("final_norm", n)], hidden[n][0, -1])
    backend.close()  # (build_model's model is shared: leave no hook on it)
