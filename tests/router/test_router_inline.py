"""Inline points: run on the caller's thread; reject vs block_until_signal; the breaker."""

from __future__ import annotations

import logging
import threading
import time

from router_helpers import Recorder, binding_of, block, event, point, record

from undercurrent.probes import Probe
from undercurrent.records import SignalAction


def test_reject_runs_the_probe_to_completion_and_its_abort_applies(make_router):
    router = make_router()
    router.register_request("r", [point("p", probe_args={"abort_at": 2, "sleep_s": 0.05})])
    signals = [router.route(record("r", "p", t)) for t in range(3)]
    # No deadline: every call ran in full and returned the probe's own signal.
    assert [s.score for s in signals] == [0.0, 1.0, 2.0]
    assert not any("fallback" in s.metadata for s in signals)
    assert [s.action for s in signals] == ["continue", "continue", SignalAction.ABORT]
    assert router.abort_requested("r")
    result = router.end_request("r")["p"]
    assert result.verdict == {"seen": [0, 1, 2]}
    assert result.stats.processed == 3 and result.stats.timeouts == 0


def test_a_raising_probe_is_isolated_and_on_end_still_runs(make_router):
    router = make_router()
    router.register_request("r", [point("bad", probe_args={"fail_at": 1}), point("good")])
    for t in range(3):
        assert router.route(record("r", "bad", t)) is None or t != 1
        assert router.route(record("r", "good", t)).score == t
    results = router.end_request("r")
    bad = results["bad"]
    assert bad.stats.errors == 1 and bad.stats.processed == 3
    assert "RuntimeError: boom at 1" in bad.error and "token 1" in bad.error
    assert bad.verdict == {"seen": [0, 2]}
    assert results["good"].error is None and results["good"].verdict == {"seen": [0, 1, 2]}


def test_on_end_that_raises_still_yields_a_result_with_the_error(make_router):
    class BadEnd(Probe):
        probe_kind = "single_shot"

        def on_activation(self, record):
            return None

        def on_end(self, ctx):
            raise ValueError("cannot conclude")

    router = make_router(probes={"bad_end": BadEnd, "recorder": Recorder})
    router.register_request("r", [point("x", probe_type="bad_end", kind="single_shot"),
                                  point("y")])
    router.route(record("r", "x", 0))
    results = router.end_request("r")
    assert results["x"].verdict is None
    assert results["x"].error == "on_end: ValueError: cannot conclude"
    assert results["x"].stats.errors == 1 and results["x"].stats.processed == 1
    assert results["y"].error is None


def test_block_until_signal_returns_at_the_deadline_while_the_probe_is_still_running(
        make_router):
    gate = event("gate")
    router = make_router()
    router.register_request("r", [point("p", intervention=block(50),
                                        probe_args={"gate": "gate", "entered": "entered"})])
    started = time.monotonic()
    signal = router.route(record("r", "p", 0))
    elapsed = time.monotonic() - started
    # The probe is held until the gate opens, after route returned: only the
    # deadline can have ended the wait (which load can lengthen, never shorten).
    # Under load the probe's worker may reach it only after the deadline: wait.
    assert event("entered").wait(timeout=120) and Recorder.instances[0].seen == []
    gate.set()
    assert elapsed >= 0.05 - 0.001
    assert signal.action is SignalAction.CONTINUE
    assert signal.metadata["reason"] == "timeout" and signal.metadata["fallback"] is True
    result = router.end_request("r")["p"]
    assert result.stats.timeouts == 1
    assert result.signals[0].metadata["reason"] == "timeout"  # the fallback is visible


def test_a_deadline_past_the_platform_s_longest_wait_waits_for_the_probe(make_router):
    # 10**13 ms is past threading.TIMEOUT_MAX (a raw OverflowError from the wait
    # before): such a deadline is "wait for the probe", and its signal comes back.
    assert 10**13 / 1000 > threading.TIMEOUT_MAX
    router = make_router()
    router.register_request("r", [point("p", intervention=block(10**13),
                                        probe_args={"abort_at": 1})])
    first, second = (router.route(record("r", "p", t)) for t in range(2))
    assert first.action is SignalAction.CONTINUE and "fallback" not in first.metadata
    assert second.action is SignalAction.ABORT and "fallback" not in second.metadata
    result = router.end_request("r", timeout_s=float("inf"))["p"]
    assert result.stats.timeouts == 0 and result.stats.processed == 2


def test_on_timeout_abort_aborts_the_request(make_router):
    gate = event("gate")
    router = make_router()
    router.register_request("r", [point("p", intervention=block(20, "abort"),
                                        probe_args={"gate": "gate"})])
    signal = router.route(record("r", "p", 0))
    gate.set()
    assert signal.action is SignalAction.ABORT and signal.metadata["reason"] == "timeout"
    assert router.abort_requested("r")


def test_a_fast_probe_under_block_until_signal_gives_its_own_signal(make_router):
    router = make_router()
    router.register_request("r", [point("p", intervention=block(2000),
                                        probe_args={"abort_at": 1})])
    first, second = (router.route(record("r", "p", t)) for t in range(2))
    assert first.score == 0.0 and first.action is SignalAction.CONTINUE
    assert second.action is SignalAction.ABORT and "fallback" not in second.metadata
    result = router.end_request("r")["p"]
    assert result.stats.timeouts == 0 and result.stats.processed == 2


def test_late_answer_is_discarded_and_never_overlaps_the_next_activation(make_router):
    gate = event("gate")
    entered = event("entered")
    router = make_router()
    router.register_request("r", [point("p", intervention=block(30),
                                        probe_args={"gate": "gate", "entered": "entered"})])
    assert router.route(record("r", "p", 0)).metadata["reason"] == "timeout"
    assert entered.wait(60)
    # The first call is still running: the next activation waits for it, then falls back.
    busy = router.route(record("r", "p", 1))
    assert busy.metadata["reason"] == "busy"
    binding = binding_of(router, "r", "p")
    gate.set()
    assert binding.wait_idle(time.monotonic() + 30)  # the late call has finished
    assert Recorder.instances[0].seen == [0]
    third = router.route(record("r", "p", 2))
    assert third.score == 2.0 and "fallback" not in third.metadata
    result = router.end_request("r")["p"]
    probe = Recorder.instances[0]
    assert not probe.overlapped and not probe.ended_while_active
    assert probe.seen == [0, 2]  # token 1 never reached the probe
    stats = result.stats
    assert (stats.received, stats.processed, stats.dropped, stats.timeouts) == (3, 2, 1, 2)
    assert result.metadata["late_results"] == 1
    assert [s.score for s in result.signals if s.score is not None] == [2.0]  # late one discarded


def test_an_exception_under_block_until_signal_falls_back_with_the_reason(make_router):
    router = make_router()
    router.register_request("r", [point("p", intervention=block(2000, "abort"),
                                        probe_args={"fail_at": 0})])
    signal = router.route(record("r", "p", 0))
    assert signal.action is SignalAction.ABORT
    assert signal.metadata["reason"] == "error" and "boom at 0" in signal.metadata["error"]
    result = router.end_request("r")["p"]
    assert result.stats.errors == 1 and result.stats.timeouts == 1
    assert "boom at 0" in result.error


def test_breaker_stops_waiting_visibly_after_consecutive_failures(make_router, caplog):
    gate = event("gate")
    router = make_router(breaker_threshold=2)
    router.register_request("r", [point("p", intervention=block(30),
                                        probe_args={"gate": "gate", "abort_at": 5})])
    with caplog.at_level(logging.WARNING, logger="undercurrent.router"):
        assert router.route(record("r", "p", 0)).metadata["reason"] == "timeout"
        tripped = router.route(record("r", "p", 1))
    assert tripped.action is SignalAction.FLAG and tripped.metadata["reason"] == "circuit_open"
    assert any("circuit breaker open" in message for message in caplog.messages)
    # Not waited on: while the first call is still held by the gate, a waited call
    # could only end in a "busy" fallback; an unwaited one returns None (and is dropped,
    # the probe being busy).
    assert router.route(record("r", "p", 2)) is None
    binding = binding_of(router, "r", "p")
    gate.set()
    assert binding.wait_idle(time.monotonic() + 30)  # the gated call has finished
    assert router.route(record("r", "p", 5)) is None  # runs unwaited; its abort only flags
    result = router.end_request("r")["p"]
    assert result.metadata["breaker_open"] is True
    assert not router.abort_requested("r")
    observed = [s for s in result.signals if s.score == 5.0]
    assert observed and observed[0].action is SignalAction.FLAG
    assert observed[0].metadata["requested_action"] == "abort"
    stats = result.stats
    assert stats.received == stats.processed + stats.dropped == 4


def test_concurrent_routes_to_one_inline_binding_never_overlap(make_router):
    router = make_router()
    router.register_request("r", [point("p", probe_args={"sleep_s": 0.002})])
    threads = [
        threading.Thread(target=lambda base=base: [router.route(record("r", "p", base + i))
                                                   for i in range(20)])
        for base in (0, 100, 200)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result = router.end_request("r")["p"]
    assert not Recorder.instances[0].overlapped
    assert result.stats.processed == 60


def test_ending_a_request_waits_only_a_short_grace_for_a_hung_blocking_probe(make_router,
                                                                            monkeypatch):
    from undercurrent.router.binding import Binding

    router = make_router(drain_timeout_s=30)
    router.register_request("r", [point("p", intervention=block(20), probe_args={"gate": "gate"})])
    assert router.route(record("r", "p", 0)).metadata["reason"] == "timeout"
    granted: list[float] = []
    wait_idle = Binding.wait_idle

    def recording(self, deadline):
        granted.append(deadline - time.monotonic())
        return wait_idle(self, deadline)

    monkeypatch.setattr(Binding, "wait_idle", recording)
    result = router.end_request("r")["p"]
    # The wait it was granted is the short grace (1 s), not the 30 s drain timeout.
    assert len(granted) == 1 and granted[0] <= 1.0
    assert result.verdict is None and "on_end was not called" in result.error
    stats = result.stats
    assert (stats.received, stats.processed, stats.dropped, stats.timeouts) == (1, 0, 1, 1)
