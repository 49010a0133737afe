"""Decoder families other than Llama on the vLLM backend, each a random tiny model
(float32) with the bundled tokenizer: every tensor type at prompt and generated
positions gives the HF backend's tokens and records. OPT has no MLP module: its
``mlp_out`` is the ``fc2`` projection on both backends; Mixtral's is its sparse
mixture-of-experts block. Falcon uses its new decoder
architecture (grouped kv heads, as Falcon-40B/180B), and falcon-rw's layout
(sequential attention and MLP, biased projections: vLLM's output projections
return their bias beside the output, which the decoder layer adds later; the
records and edits of ``attn_out``/``mlp_out`` include it, as the HF backend's do).
Under tensor parallelism Falcon's new decoder architecture leaves those outputs
unreduced: they are refused, the residual stream still matches."""

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
    # falcon-rw's layout: sequential attention and MLP, every projection biased
    "falcon_rw": dict(model_type="falcon", hidden_size=128, num_hidden_layers=3,
                      num_attention_heads=4, bias=True, parallel_attn=False,
                      new_decoder_architecture=False, max_position_embeddings=256),
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


def build(family: str, directory: Path) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(CONFIGS[family])
    model_type = settings.pop("model_type", family)
    config = AutoConfig.for_model(model_type, vocab_size=189, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # (weights large enough that every layer moves the tokens)
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.2)
            elif family == "falcon_rw" and name.endswith(".bias"):
                parameter.normal_(0, 0.3)  # (biases as a trained checkpoint has: not zero)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path() / name, directory)
    return str(directory)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_family_gives_the_hf_backend_s_tokens_and_records(family, tmp_path):
    model_dir = build(family, tmp_path)
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


def _residual_records(model_dir: str, spec: dict, texts: list[str], **load) -> tuple[list, dict]:
    """Each request's tokens, and its residual-stream records by (request, layer, token)."""
    with ProbedModel.from_pretrained(model_dir, spec=spec, **load) as model:
        outputs = model.generate(texts, max_new_tokens=5, records=True,
                                 request_ids=[f"r{i}" for i in range(len(texts))])
    return ([output.token_ids for output in outputs],
            {(record.request_id, record.layer, record.token_index): record.tensor.float()
             for output in outputs for record in output.records})


def _agree(model_dir: str, spec: dict, texts: list[str], **load) -> None:
    hf_tokens, hf = _residual_records(model_dir, spec, texts)
    tokens, records = _residual_records(model_dir, spec, texts, backend="vllm",
                                        dtype="float32", max_model_len=256, **load)
    assert tokens == hf_tokens
    assert records.keys() == hf.keys() and records
    assert max(float((records[key] - hf[key]).abs().max()) for key in hf) < 1e-3


RESIDUAL = {"name": "resid", "layers": [0, 1, 2], "tensor_type": "residual_stream",
            "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory"}


def test_falcon_rw_edits_read_the_biased_attention_and_mlp_outputs(tmp_path):
    """A clamp reads the component of ``out + bias`` along its direction: an edit on
    the bare ``out`` would move the residual stream by the bias's component."""
    import torch

    model_dir = build("falcon_rw", tmp_path)
    direction = torch.Generator().manual_seed(1)
    edits = [{"name": f"{tensor_type}_{layer}", "layers": layer, "tensor_type": tensor_type,
              "position": "generated[*]", "op": "clamp", "coefficient": 0.5,
              "vector": torch.randn(128, generator=direction).tolist()}
             for tensor_type in ("attn_out", "mlp_out") for layer in (0, 1)]
    spec = {"version": "2", "extraction_points": [RESIDUAL], "edits": edits}
    _agree(model_dir, spec, [" ".join(text.split()[:20]) for text in prompts(3)])


def test_falcon_unreduced_outputs_are_refused_under_tensor_parallelism(tmp_path):
    """Falcon's new decoder architecture under tensor_parallel_size=2: each rank's
    attention and MLP outputs are partial sums (the decoder layer all-reduces their
    sum), so attn_out and mlp_out points and edits are refused, naming why; the
    residual stream still equals the HF backend's."""
    from undercurrent.adapters.capabilities import CapabilityError
    from undercurrent.spec import SpecValidationError

    model_dir = build("falcon", tmp_path)
    texts = [" ".join(text.split()[:20]) for text in prompts(3)]
    hf_tokens, hf = _residual_records(model_dir, {"extraction_points": [RESIDUAL]}, texts)
    with ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                     max_model_len=256, tensor_parallel_size=2) as loaded:
        caps = loaded.capabilities()
        assert {"attn_out", "mlp_out"}.isdisjoint(t.value for t in caps.tensor_types)
        assert "unreduced" in caps.notes["attn_out"]
        for tensor_type in ("attn_out", "mlp_out"):
            point = {**RESIDUAL, "name": "block", "tensor_type": tensor_type}
            with pytest.raises(CapabilityError, match="tensor parallelism"):
                ProbedModel(loaded.backend, spec={"extraction_points": [point]})
            push = {"name": "push", "layers": 1, "tensor_type": tensor_type,
                    "position": "generated[*]", "op": "add", "coefficient": 1.0,
                    "vector": [0.5] * 128}
            with pytest.raises(SpecValidationError, match="tensor parallelism"):
                ProbedModel(loaded.backend, spec={"version": "2", "extraction_points": [RESIDUAL],
                                                  "edits": [push]})
        model = ProbedModel(loaded.backend, spec={"extraction_points": [RESIDUAL]})
        outputs = model.generate(texts, max_new_tokens=5, records=True,
                                 request_ids=[f"r{i}" for i in range(len(texts))])
    assert [output.token_ids for output in outputs] == hf_tokens
    records = {(record.request_id, record.layer, record.token_index): record.tensor.float()
               for output in outputs for record in output.records}
    assert records.keys() == hf.keys()
    assert max(float((records[key] - hf[key]).abs().max()) for key in hf) < 1e-3
