"""kv records read from every cache layout ``generate()`` may use, against an oracle
built by transformers alone: the cache a fresh ``DynamicCache`` holds after one
forward of each sequence by itself (no padding, no sliding-window trimming), and,
for Falcon's grouped heads, the values its fused projection computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import SPECIAL, VOCAB, build_tokenizer  # noqa: E402

from undercurrent.adapters.base import BackendError  # noqa: E402
from undercurrent.api import ProbedModel  # noqa: E402
from undercurrent.spec.types import ExtractionPoint  # noqa: E402

WINDOW = 4
PROMPTS = [[1, 5, 9, 14, 20, 7, 33, 41], [1, 12, 6], [1, 30, 22, 17, 9, 8]]
MAX_NEW = 6


def _model(model_type: str, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **dict(SPECIAL, eos_token_id=None),
                                  **config)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def _kv_spec(num_layers: int) -> list[ExtractionPoint]:
    """Every token of every sequence, at every layer (one point per absolute index)."""
    longest = max(map(len, PROMPTS)) + MAX_NEW
    return [ExtractionPoint(name=f"t{i}", layers=tuple(range(num_layers)), tensor_type="kv",
                            position=i, probe_type="capture", probe_kind="single_shot")
            for i in range(longest)]


def _oracle_cache(model, ids: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache()  # no config: every token kept, on every layer
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def _generate_kv(model):
    with ProbedModel(model, build_tokenizer(), spec=_kv_spec(model.config.num_hidden_layers)) as pm:
        assert pm.capabilities().supports("kv")
        return pm.generate(input_ids=PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0,
                           records=True)


def _kept(model, cache_implementation: str | None, layer: int, prompt_len: int) -> int:
    """The earliest prompt token of a sequence a layer's cache still holds after the
    prefill: on a sliding-window layer, transformers' dynamic cache keeps the last
    ``window - 1`` tokens, its static one the last ``window``; other layers keep all."""
    layer_types = getattr(model.config, "layer_types", None)
    if not layer_types or layer_types[layer] != "sliding_attention":
        return 0
    keep = WINDOW if cache_implementation == "static" else WINDOW - 1
    return max(prompt_len - keep, 0)


@pytest.mark.parametrize(("model_type", "config", "cache_implementation"), [
    ("llama", {}, "static"),
    ("gemma2", dict(head_dim=8, sliding_window=WINDOW), "static"),
    ("gemma2", dict(head_dim=8, sliding_window=WINDOW), None),
])
def test_kv_records_equal_a_plain_forward_whatever_cache_generate_uses(
        model_type, config, cache_implementation):
    model = _model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, **config)
    # (what a checkpoint's generation_config.json may set)
    model.generation_config.cache_implementation = cache_implementation
    outputs = _generate_kv(model)
    for ids, output in zip(PROMPTS, outputs, strict=True):
        assert len(output.token_ids) == MAX_NEW
        fed = ids + list(output.token_ids)[:-1]  # (the last sampled token is never fed)
        oracle = _oracle_cache(model, fed)
        records = {(r.layer, r.token_index): r.tensor for r in output.records}
        expected = {(layer, t) for layer in range(model.config.num_hidden_layers)
                    for t in range(_kept(model, cache_implementation, layer, len(ids)), len(fed))}
        assert set(records) == expected
        for (layer, t), tensor in records.items():
            cached = oracle.layers[layer]
            want = torch.stack([cached.keys[0, :, t], cached.values[0, :, t]])
            torch.testing.assert_close(tensor, want, rtol=1e-5, atol=1e-6)


def test_falcon_grouped_kv_heads_give_one_record_head_per_kv_head():
    # Falcon-40B/180B's layout: transformers caches each kv head once per query head.
    model = _model("falcon", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   new_decoder_architecture=True, num_kv_heads=2)
    kv_heads, head_dim, group = 2, 8, 2  # (4 query heads share 2 kv heads)
    projected = []
    handles = [layer.self_attention.query_key_value.register_forward_hook(
        lambda module, args, output: projected.append(output.detach().clone()))
        for layer in model.transformer.h]
    try:
        outputs = _generate_kv(model)
        with ProbedModel(model, build_tokenizer()) as pm:
            caps = pm.capabilities()
        projected.clear()
        fed = PROMPTS[0] + list(outputs[0].token_ids)[:-1]
        oracle = _oracle_cache(model, fed)
    finally:
        for handle in handles:
            handle.remove()
    assert (caps.num_kv_heads, caps.head_dim) == (kv_heads, head_dim)
    records = list(outputs[0].records)
    assert len(records) == 2 * len(fed)
    for record in records:
        assert tuple(record.tensor.shape) == (2, kv_heads, head_dim)
        # Values (no rotary) straight from the fused projection: per kv head, the
        # query heads of its group, then its key, then its value.
        fused = projected[record.layer][0, record.token_index]
        value = fused.view(kv_heads, group + 2, head_dim)[:, -1]
        torch.testing.assert_close(record.tensor[1], value, rtol=1e-5, atol=1e-6)
        # Keys (after rotary) from the cache: each kv head's copies are equal.
        keys = oracle.layers[record.layer].keys[0, :, record.token_index].view(
            kv_heads, group, head_dim)
        assert torch.equal(keys, keys[:, :1].expand_as(keys))
        torch.testing.assert_close(record.tensor[0], keys[:, 0], rtol=1e-5, atol=1e-6)


def test_kv_from_a_quantized_cache_is_refused_not_left_empty(monkeypatch):
    # A quantized layer moves the tokens out of its keys/values into packed storage
    # (here an identity "quantization", so no quantization package is needed).
    from transformers import cache_utils

    class IdentityQuantizedLayer(cache_utils.QuantizedLayer):
        def _quantize(self, tensor, axis):
            return tensor

        def _dequantize(self, q_tensor):
            return q_tensor

    monkeypatch.setattr(cache_utils, "QuantoQuantizedLayer", IdentityQuantizedLayer)
    model = _model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
    model.generation_config.cache_implementation = "quantized"
    model.generation_config.cache_config = {"backend": "quanto"}
    with pytest.raises(BackendError, match=r"IdentityQuantizedLayer at layer 0.*"
                                           r"cache_implementation"):
        _generate_kv(model)
