"""The error note left when a request ends with records unprocessed reports what
ending the request actually waited for, and how long."""

from __future__ import annotations

import threading
from typing import Any

from router_helpers import block, point, record

from undercurrent.probes import Probe
from undercurrent.records import ProbeSignal
from undercurrent.spec.types import ProbeKind


class Gated(Probe):
    """Every call waits for ``release``; ``entered`` is set when a call starts."""

    probe_kind = ProbeKind.TRAJECTORY
    entered = threading.Event()
    release = threading.Event()

    def on_activation(self, record: Any) -> ProbeSignal | None:
        Gated.entered.set()
        Gated.release.wait(60)
        return ProbeSignal(score=1.0)


def test_a_hung_blocking_probe_reports_the_grace_it_was_given_not_the_drain_timeout(
        make_router):
    router = make_router(drain_timeout_s=30, probes={"recorder": _gated()})
    router.register_request("r", [point("p", intervention=block(20))])
    try:
        assert router.route(record("r", "p", 0)).metadata["reason"] == "timeout"
        result = router.end_request("r")["p"]
    finally:
        Gated.release.set()
    assert "30s" not in result.error and "drain" not in result.error
    assert ("a block_until_signal call that missed its deadline was still running 1s after "
            "the request ended") in result.error
    assert "0 unprocessed record(s) and one in flight, counted as dropped" in result.error


def test_an_async_drain_reports_the_time_it_waited(make_router):
    router = make_router(workers=1, probes={"recorder": _gated()})
    router.register_request("r", [point("a", mode="async")])
    try:
        for t in range(3):
            router.route(record("r", "a", t))
        assert Gated.entered.wait(30)
        result = router.end_request("r", timeout_s=0.2)["a"]
    finally:
        Gated.release.set()
    assert ("drain timed out after 0.2s with 2 unprocessed record(s) and one in flight, "
            "counted as dropped") in result.error


def test_ending_a_request_with_no_drain_time_says_it_did_not_wait(make_router):
    router = make_router(workers=1, probes={"recorder": _gated()})
    router.register_request("r", [point("a", mode="async")])
    try:
        for t in range(3):
            router.route(record("r", "a", t))
        result = router.end_request("r", timeout_s=0)["a"]
    finally:
        Gated.release.set()
    assert "the request ended without waiting for its queue (no drain time) with " \
           in result.error
    assert "timed out" not in result.error


def _gated() -> type:
    Gated.entered.clear()
    Gated.release.clear()
    return Gated
