"""The error note left when a request ends with records unprocessed reports what
ending the request actually waited for, and how long."""

from __future__ import annotations

import threading
import time
from typing import Any

from router_helpers import binding_of, block, point, record, wait_until

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


def test_the_drain_note_counts_the_rows_of_a_producer_waiting_for_room_when_it_ended(
        make_router, monkeypatch):
    # Under block, a producer waiting for room when the request ends (close() wakes
    # it) drops its rows itself; the note left them out ("2 unprocessed record(s)
    # and one in flight" where stats.dropped was 4).
    router = make_router(workers=1, default_overflow="block", probes={"recorder": _gated()})
    router.register_request("r", [point("a", mode="async", queue_depth=2)])
    binding = binding_of(router, "r", "a")
    produced = threading.Event()

    def produce() -> None:
        for t in range(4):  # 0 taken by the worker, 1-2 queued, 3 waits for room
            router.route(record("r", "a", t))
        produced.set()

    drain = binding.wait_idle

    def wait_idle_once_the_producer_dropped(deadline: float) -> bool:
        assert produced.wait(30)  # close() woke it: its row is dropped
        return drain(time.monotonic())  # the probe is still stuck: the drain gives up

    monkeypatch.setattr(binding, "wait_idle", wait_idle_once_the_producer_dropped)
    threading.Thread(target=produce, daemon=True).start()
    try:
        assert Gated.entered.wait(30)
        assert wait_until(lambda: binding.snapshot()["received"] == 4)  # 3 is waiting
        result = router.end_request("r", timeout_s=0.2)["a"]
    finally:
        Gated.release.set()
    stats = result.stats
    assert (stats.received, stats.processed, stats.dropped) == (4, 0, 4)
    assert ("drain timed out after 0.2s with 3 unprocessed record(s) and one in flight, "
            "counted as dropped") in result.error


def _gated() -> type:
    Gated.entered.clear()
    Gated.release.clear()
    return Gated
