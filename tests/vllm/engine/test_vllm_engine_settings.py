"""Settings of the engine the vLLM backend sets or reads: the CPU KV cache size
(``kv_cache_gib``), prefix caching as the engine resolved it. One engine for the
whole file."""

from __future__ import annotations

import os

import pytest

from undercurrent.adapters.capabilities import CapabilityError
from undercurrent.api import ProbedModel

GIB = 1 << 30


@pytest.fixture(scope="module")
def model(model_dir):
    before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    with ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                     max_model_len=128, kv_cache_gib=2.0,
                                     enable_prefix_caching=None) as loaded:
        # kv_cache_gib sized this engine only: an engine loaded later in the process
        # without it gets the process's size (it got 2 GiB, and after a refused
        # kv_cache_gib every later load failed the same way).
        assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == before
        yield loaded


def test_kv_cache_gib_is_whole_gib_a_float_included(model, model_dir):
    # (vLLM reads VLLM_CPU_KVCACHE_SPACE with int(): "2.0" failed deep in its config)
    assert model.backend.engine.vllm_config.cache_config.kv_cache_memory_bytes == 2 * GIB
    from undercurrent.adapters.vllm.backend import VLLMBackend

    with pytest.raises(ValueError, match="kv_cache_gib must be a whole number of GiB, at "
                                         "least 1 .* got 0.5"):
        VLLMBackend.from_pretrained(model_dir, kv_cache_gib=0.5)


def test_prefix_caching_is_read_from_the_engine(model):
    # None is vLLM's own default, "on": the backend took it for off, so a prompt
    # point went unrefused and its records went missing on a cache hit.
    assert model.backend.engine.vllm_config.cache_config.enable_prefix_caching
    assert model.backend.prefix_caching is True
    with pytest.raises(CapabilityError, match="position prompt\\[0\\] can select prompt "
                                              "tokens, but this vLLM engine has prefix caching"):
        ProbedModel(model.backend, spec={"extraction_points": [{
            "name": "first", "layers": [0], "tensor_type": "residual_stream",
            "position": "prompt[0]", "probe_type": "norm_probe",
            "probe_kind": "single_shot"}]})
