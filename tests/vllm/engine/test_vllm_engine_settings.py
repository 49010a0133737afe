"""Settings of the engine the vLLM backend sets or reads: the CPU KV cache size
(``kv_cache_gib``). One engine for the whole file."""

from __future__ import annotations

import os

import pytest

from undercurrent.api import ProbedModel

GIB = 1 << 30


@pytest.fixture(scope="module")
def model(model_dir):
    before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    with ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                     max_model_len=128, kv_cache_gib=2.0) as loaded:
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
