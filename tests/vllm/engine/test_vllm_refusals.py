"""Models the vLLM adapter cannot hook are refused at load, naming what to use instead."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from undercurrent.adapters.capabilities import UnsupportedArchitectureError
from undercurrent.api import ProbedModel


def test_a_model_run_through_vllm_s_transformers_backend_is_refused(model_dir):
    # vLLM's Transformers modeling backend wraps the transformers model: its layers
    # are found where a native model's are, but see the step's tokens flattened, so
    # records would hold other requests' rows. Refused, as docs/vllm.md says.
    def staged():
        return set(Path(tempfile.gettempdir()).glob("undercurrent-vllm-model-*"))

    before = staged()
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"Transformers modeling backend.*'TransformersForCausalLM'"
                             r".*backend='hf'"):
        ProbedModel.from_pretrained(model_dir, backend="vllm", max_model_len=256,
                                    model_impl="transformers")
    assert staged() == before
