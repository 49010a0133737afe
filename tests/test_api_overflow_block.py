"""End to end on the HF backend with the bundled model: an async point with more
layers than its ``queue_depth`` under the ``block`` overflow policy finishes, and
its probe sees every record (issue 21: this used to hang ``generate()`` forever)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.router import Router  # noqa: E402

HANG_GUARD_S = 300  # only a deadlock reaches it
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny():
    model = ProbedModel.from_pretrained("undercurrent/tiny")
    yield model
    model.close()


def _spec(layers: list[int], depth: int) -> dict:
    return {"version": "1", "extraction_points": [{
        "name": "watch", "layers": layers, "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory",
        "execution_mode": "async", "queue_depth": depth,
    }]}


@pytest.mark.parametrize(("layers", "depth"), [([0, 3], 1), ([0, 1, 2], 2)])
def test_block_policy_with_more_layers_than_queue_depth_finishes_and_loses_nothing(
        tiny, layers, depth):
    router = Router(default_overflow="block", workers=1)
    model = ProbedModel(tiny.backend, spec=_spec(layers, depth), router=router)
    outputs: list = []
    worker = threading.Thread(
        target=lambda: outputs.extend(model.generate(["the cat", "a dog runs"],
                                                     max_new_tokens=MAX_NEW_TOKENS,
                                                     records=True)),
        daemon=True,
    )
    try:
        worker.start()
        worker.join(HANG_GUARD_S)
        assert not worker.is_alive(), "generate() deadlocked under the block overflow policy"
    finally:
        if not worker.is_alive():
            router.shutdown()
    assert len(outputs) == 2
    for output in outputs:
        captured = [r for r in output.records if r.extraction_point_name == "watch"]
        assert len(captured) == len(layers) * (len(output.token_ids) - 1)
        stats = output.results["watch"].stats
        assert (stats.received, stats.processed, stats.dropped) == (len(captured),) * 2 + (0,)
