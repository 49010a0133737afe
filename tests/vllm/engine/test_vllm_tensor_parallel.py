"""Tensor parallelism (TP=2 on CPU): capture runs on rank 0 only, so every record
exists once; records equal the single-worker engine's and the HF backend's; sharded
tensor types are refused; an inline abort stops a request within one step."""

from __future__ import annotations

import pytest
from vllm_engine_helpers import (
    CHUNK_BUDGET,
    compare,
    hf_reference,
    prompts,
    spec_points,
    stop_at,
)

from undercurrent.adapters.base import SamplingParams
from undercurrent.adapters.capabilities import CapabilityError
from undercurrent.adapters.session import CaptureSession
from undercurrent.api import ProbedModel
from undercurrent.router import Router

PARAMS = SamplingParams(max_new_tokens=8)
COUNT = 10


@pytest.fixture(scope="module")
def points(num_layers):
    return spec_points(num_layers, kv=False)


@pytest.fixture(scope="module")
def hf_outputs(model_dir, points):
    return hf_reference(model_dir, prompts(COUNT), points, PARAMS)


def _load(model_dir, tensor_parallel_size):
    from undercurrent.adapters.vllm.backend import VLLMBackend

    return VLLMBackend.from_pretrained(model_dir, dtype="float32", max_model_len=256,
                                       max_num_batched_tokens=CHUNK_BUDGET,
                                       tensor_parallel_size=tensor_parallel_size)


def _generate(backend, points):
    texts = prompts(COUNT)
    session = CaptureSession(None, points, keep_records=True)
    return backend.generate(texts, [f"r{i}" for i in range(COUNT)], PARAMS, session)


@pytest.fixture(scope="module")
def single_worker_outputs(model_dir, points, hf_outputs):
    backend = _load(model_dir, 1)
    try:
        return _generate(backend, points)
    finally:
        backend.close()


@pytest.fixture(scope="module")
def backend(model_dir, single_worker_outputs):
    loaded = _load(model_dir, 2)
    yield loaded
    loaded.close()


def test_two_ranks_with_exactly_one_capturing(backend):
    assert backend.shape["tensor_parallel_size"] == 2
    assert sorted(backend.engine.collective_rpc("undercurrent_describe"),
                  key=lambda d: d["tensor_parallel_rank"])[1]["tensor_parallel_rank"] == 1


def test_records_equal_single_worker_and_hf_once_per_key(backend, points, hf_outputs,
                                                          single_worker_outputs):
    outputs = _generate(backend, points)
    assert compare(outputs, hf_outputs) <= 1e-4
    assert compare(outputs, single_worker_outputs) <= 1e-4
    assert sum(len(output.records) for output in outputs) > 100


def test_sharded_kv_is_refused_at_registration(backend, num_layers):
    caps = backend.capabilities()
    assert "kv" not in {t.value for t in caps.tensor_types}
    with pytest.raises(CapabilityError, match="tensor parallelism"):
        ProbedModel(backend, spec={"extraction_points": [{
            "name": "keys", "layers": 0, "tensor_type": "kv", "position": "prompt[-1]",
            "probe_type": "norm_probe", "probe_kind": "single_shot"}]})


def test_inline_abort_under_tensor_parallelism_stops_within_one_step(backend, hf_outputs):
    texts = prompts(COUNT)
    marked = {"r2", "r5", "r8"}
    router = Router(probes={"stop_at": stop_at})
    model = ProbedModel(backend, router=router, spec={"extraction_points": [{
        "name": "guard", "layers": 1, "tensor_type": "attn_out", "position": "generated[*]",
        "probe_type": "stop_at", "probe_kind": "single_shot",
        "probe_args": {"request_ids": sorted(marked), "generated_index": 2}}]})
    try:
        outputs = model.generate(texts, request_ids=[f"r{i}" for i in range(COUNT)],
                                 max_new_tokens=PARAMS.max_new_tokens)
    finally:
        router.shutdown()
    for output, plain in zip(outputs, hf_outputs, strict=True):
        if output.request_id in marked and len(plain.token_ids) > 3:
            assert output.aborted and output.token_ids == plain.token_ids[:3]
            assert backend.engine_token_counts[output.request_id] == 3
        else:
            assert not output.aborted and output.token_ids == plain.token_ids
