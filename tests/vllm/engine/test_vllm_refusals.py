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
