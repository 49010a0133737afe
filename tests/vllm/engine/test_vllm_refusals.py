"""Models the vLLM adapter cannot hook are refused at load, naming what to use instead."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from undercurrent.adapters.capabilities import UnsupportedArchitectureError
from undercurrent.api import ProbedModel


def test_a_model_run_through_vllm_s_transformers_backend_is_refused(model_dir, tmp_path,
                                                                    monkeypatch):
    # vLLM's Transformers modeling backend wraps the transformers model: its layers
    # are found where a native model's are, but see the step's tokens flattened, so
    # records would hold other requests' rows. Refused, as docs/vllm.md says, and
    # the staged copy of the model is removed (staged in a directory of this test's
    # own: other processes may stage theirs in the shared one meanwhile).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"Transformers modeling backend.*'TransformersForCausalLM'"
                             r".*backend='hf'"):
        ProbedModel.from_pretrained(model_dir, backend="vllm", max_model_len=256,
                                    model_impl="transformers")
    assert not list(Path(tmp_path).glob("undercurrent-vllm-model-*"))


def test_a_family_outside_the_architecture_table_is_refused_naming_its_model_type(tmp_path):
    # vLLM serves StableLM natively, but its decoder layers return (hidden, residual)
    # with the residual already in hidden: read as the table's families are, its
    # residual stream would hold the residual twice. The HF backend refuses the
    # family too; a clear refusal, not wrong records.
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from undercurrent.models import tiny_model_path

    config = AutoConfig.for_model("stablelm", vocab_size=189, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path() / name, tmp_path)
    spec = {"version": "1", "extraction_points": [{
        "name": "res", "layers": 0, "tensor_type": "residual_stream", "position": "prompt[-1]",
        "probe_type": "norm_probe", "probe_kind": "single_shot"}]}
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"vLLM model class 'StablelmForCausalLM' \(config.model_type="
                             r"'stablelm'\) is not a family in undercurrent's architecture "
                             r"table.*supported model_type values: .*llama"):
        ProbedModel.from_pretrained(str(tmp_path), spec=spec, backend="vllm", dtype="float32",
                                    max_model_len=128)
