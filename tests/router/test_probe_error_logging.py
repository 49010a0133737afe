"""A probe that raises: one warning line per failing binding, the traceback at
DEBUG level and in ``ProbeResult.metadata["traceback"]``, never a traceback in the
default log output."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from router_helpers import point, record

from undercurrent.probes import Probe
from undercurrent.probes.base import ScoresRows
from undercurrent.records import ActivationBatch
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




_INTERRUPTS = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}


class _InterruptsInOne(Probe):
    """Raises ``interrupt`` (``KeyboardInterrupt`` or ``SystemExit``, by name)."""

    probe_kind = ProbeKind.TRAJECTORY

    def __init__(self, *, interrupt: str) -> None:
        self.interrupt = _INTERRUPTS[interrupt]

    def on_activation(self, record):
        raise self.interrupt


class _InterruptsInMany(_InterruptsInOne):
    def on_activations(self, records):
        raise self.interrupt


class _InterruptsInBatch(_InterruptsInOne):
    def on_batch(self, batch):
        raise self.interrupt


class _InterruptsInJudgeRows(ScoresRows):
    """A probe judged in a group (one per request, values computed once)."""

    probe_kind = ProbeKind.TRAJECTORY

    def __init__(self, *, interrupt: str) -> None:
        self.interrupt = _INTERRUPTS[interrupt]

    def group_key(self):
        return ("interrupts",)

    def row_values(self, batch):
        return np.asarray(batch.tensor).sum(axis=1)

    def judge_rows(self, values, token_indices, layers):
        raise self.interrupt


def _route_to_interrupting_probes(router, interrupt, mode, requests):
    """Each request's rows of token 3 at layers 0 and 1, routed as one batch."""
    for request_id in requests:
        router.register_request(request_id, [point(
            "p", probe_type="x", mode=mode, layers=(0, 1), probe_args={"interrupt": interrupt})])
    rows = 2 * len(requests)
    router.route_columns(ActivationBatch(
        np.ones((rows, 4), dtype=np.float32),
        request_ids=[request_id for request_id in requests for _ in (0, 1)],
        point_names=["p"] * rows, layers=[0, 1] * len(requests),
        tensor_type="residual_stream", token_indices=[3] * rows,
        is_generated=[True] * rows, generated_indices=[0] * rows, token_ids=[9] * rows))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("interrupt", ["KeyboardInterrupt", "SystemExit"])
@pytest.mark.parametrize(("probe_class", "where", "requests"), [
    (_InterruptsInOne, "on_activation (token 3, layer 0)", ("r",)),
    (_InterruptsInMany, "on_activations (token 3, 2 records)", ("r",)),
    (_InterruptsInBatch, "on_batch (token 3, 2 records)", ("r",)),
    (_InterruptsInJudgeRows, "on_batch (token 3, 2 records)", ("r", "s")),  # as one group
])
def test_an_interrupt_an_inline_probe_raises_is_logged_as_stopping_generation(
        make_router, caplog, probe_class, where, requests, interrupt):
    # The interrupt goes on up from the route (Ctrl-C must stop the generation);
    # the warning said "generation continues".
    router = make_router(probes={"x": probe_class})
    with caplog.at_level(logging.WARNING, logger="undercurrent.router"), \
            pytest.raises(_INTERRUPTS[interrupt]):
        _route_to_interrupting_probes(router, interrupt, "inline", requests)
    warnings = _warnings(caplog)
    assert len(warnings) == 1  # the binding that raised; the group's others never ran
    assert f"raised in {where}: {interrupt}; it is re-raised and generation stops" in warnings[0]
    assert "generation continues" not in warnings[0]
    for request_id in requests:
        stats = router.end_request(request_id)["p"].stats
        assert stats.received == stats.processed + stats.dropped


def test_an_interrupt_an_async_probe_raises_is_recorded_and_generation_continues(
        make_router, caplog):
    router = make_router(probes={"x": _InterruptsInOne}, workers=1)
    with caplog.at_level(logging.WARNING, logger="undercurrent.router"):
        _route_to_interrupting_probes(router, "KeyboardInterrupt", "async", ("r",))
        result = router.end_request("r")["p"]
    assert result.error == "on_activation (token 3, layer 0): KeyboardInterrupt"
    assert result.stats.errors == 2
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "raised in on_activation (token 3, layer 0): KeyboardInterrupt; generation continues" \
        in warnings[0]
