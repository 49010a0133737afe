"""A probe that raises: one warning line per failing binding, the traceback at
DEBUG level and in ``ProbeResult.metadata["traceback"]``, never a traceback in the
default log output."""

from __future__ import annotations

import logging

from router_helpers import point, record


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
