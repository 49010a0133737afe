"""Preemption under a KV cache too small for every request: vLLM takes a running
request out and later recomputes its whole sequence. Each (request, point, layer,
token) must still be captured once, with HF's values, whether the worker planned
each step from the requests' windows or repeated a steady step from the runner's
arrays (its capture mark then moves on without a pass over the requests)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from vllm_engine_helpers import CHUNK_BUDGET, compare, hf_reference, prompts, spec_points

from undercurrent.adapters.base import SamplingParams
from undercurrent.adapters.session import CaptureSession
from undercurrent.adapters.vllm import worker
from undercurrent.api import ProbedModel

#: Long enough for running requests to need blocks the cache has given away.
PARAMS = SamplingParams(max_new_tokens=40)
#: KV blocks of 32 tokens (the CPU attention's block size): one more than the
#: longest sequence needs, far fewer than 18 requests at once need.
BLOCKS = 9


@pytest.fixture(scope="module")
def points(num_layers):
    # Points that select every generated token: decode steps repeat one another.
    return [point for point in spec_points(num_layers)
            if point.name in ("residual_all", "final_norm")]


@pytest.fixture(scope="module")
def strided(num_layers):
    # Points of several strides: the lower layers on every generated token, the
    # upper ones on every second (the worker's steps repeat a cycle of plans).
    (every,) = [point for point in spec_points(num_layers) if point.name == "residual_all"]
    half = num_layers // 2
    return [dataclasses.replace(every, name="lower", layers=tuple(range(half))),
            dataclasses.replace(every, name="upper", layers=tuple(range(half, num_layers)),
                                stride=2)]


@pytest.fixture(scope="module")
def references(model_dir, points, strided):
    # The oracles run before vLLM is imported in this process.
    texts = prompts()
    return {"steady": (texts, hf_reference(model_dir, texts, points, PARAMS)),
            "strided": (texts, hf_reference(model_dir, texts, strided, PARAMS))}


@pytest.fixture(scope="module")
def reference(references):
    return references["steady"]


@pytest.fixture(scope="module")
def backend(model_dir, reference):
    loaded = ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                         max_model_len=256, max_num_batched_tokens=CHUNK_BUDGET,
                                         max_num_seqs=32, num_gpu_blocks_override=BLOCKS,
                                         block_size=32)
    yield loaded.backend
    loaded.close()


def _count_preemptions_and_repeats(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts, as the engine runs: the requests the scheduler preempts, and the
    worker's steps repeated from the runner's arrays."""
    from vllm.v1.core.sched.scheduler import Scheduler

    counts = {"preempted": 0, "repeated": 0}
    preempt, repeat_step = Scheduler._preempt_request, worker._Capture._repeat_step

    def counted_preempt(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["preempted"] += 1
        return preempt(self, *args, **kwargs)

    def counted_repeat(self: Any, feed: Any, forward: int) -> bool:
        found = repeat_step(self, feed, forward)
        counts["repeated"] += found
        return found

    monkeypatch.setattr(Scheduler, "_preempt_request", counted_preempt)
    monkeypatch.setattr(worker._Capture, "_repeat_step", counted_repeat)
    return counts


@pytest.mark.parametrize("repeat_feeds", [True, False])
def test_preempted_requests_are_captured_once_with_hfs_records(backend, reference, points,
                                                               monkeypatch, repeat_feeds):
    counts = _count_preemptions_and_repeats(monkeypatch)
    monkeypatch.setattr(worker._Capture, "repeat_feeds", repeat_feeds)
    texts, hf_outputs = reference
    session = CaptureSession(None, points, keep_records=True)
    outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], PARAMS, session)
    assert counts["preempted"] > 0, "the cache must be small enough to preempt a request"
    assert (counts["repeated"] > 0) is repeat_feeds, counts
    # compare: the same tokens, one record per key, the same keys and token ids, and
    # tensors within 1e-4 of HF's (a recomputed token captured again is a duplicate).
    compare(outputs, hf_outputs)


def test_preempted_requests_of_points_of_several_strides_are_captured_once(
        backend, references, strided, monkeypatch):
    """The same with points of several strides: the worker repeats a cycle of
    plans (told from the runner's arrays where it can) and the driver repeats
    its plans that alternate, while requests are taken out and recomputed."""
    counts = _count_preemptions_and_repeats(monkeypatch)
    texts, hf_outputs = references["strided"]
    session = CaptureSession(None, strided, keep_records=True)
    outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], PARAMS, session)
    assert counts["preempted"] > 0 and counts["repeated"] > 0, counts
    compare(outputs, hf_outputs)
