"""Decoder families other than Llama on the vLLM backend, each a random tiny model
(float32) with the bundled tokenizer: every tensor type at prompt and generated
positions gives the HF backend's tokens and records. OPT has no MLP module: its
``mlp_out`` is the ``fc2`` projection on both backends; Mixtral's is its sparse
mixture-of-experts block. Falcon uses its new decoder
architecture (grouped kv heads, as Falcon-40B/180B)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_engine_helpers import compare, hf_reference, prompts, spec_points

from undercurrent.adapters.base import SamplingParams
from undercurrent.adapters.session import CaptureSession
from undercurrent.api import ProbedModel
from undercurrent.models import tiny_model_path

CONFIGS = {
    "gpt2": dict(n_embd=128, n_layer=3, n_head=2, n_positions=256),
    "opt": dict(hidden_size=128, ffn_dim=256, num_hidden_layers=3, num_attention_heads=2,
                max_position_embeddings=256, word_embed_proj_dim=128),
    # Falcon-40B/180B's layout: 2 kv heads shared by 4 query heads, which
    # transformers caches once per query head (the HF backend keeps one copy)
    "falcon": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                   new_decoder_architecture=True, num_kv_heads=2, max_position_embeddings=256),
    # Gemma2 caps its attention logits (attn_logit_softcapping 50): the HF backend
    # loads it with eager attention, which applies the cap as vLLM does
    "gemma2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   max_position_embeddings=256),
    # vLLM names the sparse mixture-of-experts block block_sparse_moe, transformers mlp
    "mixtral": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                  tie_word_embeddings=False),
}


def build(model_type: str, directory: Path) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=189, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, **CONFIGS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # (weights large enough that every layer moves the tokens)
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.2)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path() / name, directory)
    return str(directory)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_each_family_gives_the_hf_backend_s_tokens_and_records(model_type, tmp_path):
    model_dir = build(model_type, tmp_path)
    texts = [" ".join(text.split()[:40]) for text in prompts(6)]
    params = SamplingParams(max_new_tokens=6)
    points = spec_points(3)
    expected = hf_reference(model_dir, texts, points, params)
    with ProbedModel.from_pretrained(model_dir) as hf:
        caps = hf.capabilities()
    loaded = ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                         max_model_len=256)
    try:
        vllm_caps = loaded.capabilities()
        assert vllm_caps.layers == caps.layers
        # (a kv record is (2, num_kv_heads, head_dim) on both: compare() checks shapes)
        assert (vllm_caps.num_kv_heads, vllm_caps.head_dim) == (caps.num_kv_heads, caps.head_dim)
        session = CaptureSession(None, points, keep_records=True)
        outputs = loaded.backend.generate(texts, [f"r{i}" for i in range(len(texts))], params,
                                          session)
    finally:
        loaded.close()
    assert all(output.records for output in outputs)
    compare(outputs, expected, atol=1e-3)  # (float32 rounding of activations in the tens)
