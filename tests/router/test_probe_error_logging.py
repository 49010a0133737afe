"""A probe that raises: one warning line per failing binding, the traceback at
DEBUG level and in ``ProbeResult.metadata["traceback"]``, never a traceback in the
default log output."""

from __future__ import annotations

import logging

import pytest
from router_helpers import point, record

from undercurrent.probes import Probe
from undercurrent.spec import ProbeKind


def test_each_failing_binding_logs_one_line_and_keeps_its_traceback(make_router, caplog):
    router = make_router()
    for request_id in ("r1", "r2"):
        router.register_request(request_id, [point("p", probe_args={"fail_at": 1}),
                                             point("q", probe_args={"fail_at": 2})])
    with caplog.at_level(logging.DEBUG, logger="undercurrent.router"):
        for request_id in ("r1", "r2"):
            for t in range(4):
                router.route(record(request_id, "p", t))
                router.route(record(request_id, "q", 2))  # fails every time
        results = {request_id: router.end_request(request_id) for request_id in ("r1", "r2")}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # one per failing binding: 2 requests x 2 points
    for warning in warnings:
        message = warning.getMessage()
        assert warning.exc_info is None and "\n" not in message
        assert "RuntimeError: boom at" in message and "generation continues" in message
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert len(debug) == 4
    for by_point in results.values():
        for name, result in by_point.items():
            assert result.error.startswith("on_activation (token")
            trace = result.metadata["traceback"]
            assert trace.startswith("Traceback (most recent call last)")
            assert trace.rstrip().endswith(f"RuntimeError: boom at {1 if name == 'p' else 2}")
            assert "on_activation" in trace  # the probe's own frame


def test_a_probe_that_never_raises_has_no_traceback(make_router):
    router = make_router()
    router.register_request("r", [point("p")])
    router.route(record("r", "p", 0))
    result = router.end_request("r")["p"]
    assert result.error is None and "traceback" not in result.metadata


class _RaisesInBatch(Probe):
    probe_kind = ProbeKind.TRAJECTORY

    def on_batch(self, batch):
        raise RuntimeError("boom in on_batch")


class _RaisesInMany(Probe):
    probe_kind = ProbeKind.TRAJECTORY

    def on_activations(self, records):
        raise RuntimeError("boom in on_activations")


class _RaisesInOne(Probe):
    probe_kind = ProbeKind.TRAJECTORY

    def on_activation(self, record):
        raise RuntimeError("boom in on_activation")


@pytest.mark.parametrize("mode", ["inline", "async"])
@pytest.mark.parametrize(("probe_class", "where"), [
    (_RaisesInBatch, "on_batch (token 3, 2 records)"),
    (_RaisesInMany, "on_activations (token 3, 2 records)"),
    (_RaisesInOne, "on_activation (token 3, layer 0)"),
])
def test_the_error_note_names_the_method_that_raised(make_router, probe_class, where, mode):
    router = make_router(probes={"x": probe_class})
    router.register_request("r", [point("p", probe_type="x", mode=mode, layers=(0, 1))])
    router.route_batch([record("r", "p", 3, layer=0), record("r", "p", 3, layer=1)])
    result = router.end_request("r")["p"]
    method = where.split(" ")[0]
    assert result.error == f"{where}: RuntimeError: boom in {method}"
    assert result.stats.errors == 2 and result.stats.processed == 2
