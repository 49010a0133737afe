"""shutdown with live requests, metrics, and the request() context manager."""

from __future__ import annotations

import threading

import pytest
from router_helpers import Recorder, binding_of, event, point, record, wait_until

from undercurrent.router import Router, RouterError


def test_shutdown_ends_live_requests_and_returns_their_results(make_router):
    router = make_router(workers=1)
    router.register_request("a", [point("inline"), point("async", mode="async",
                                                           probe_args={"sleep_s": 0.001})])
    router.register_request("b", [point("inline")])
    for t in range(20):
        router.route(record("a", "async", t))
    router.route(record("a", "inline", 0))
    results = router.shutdown()
    assert set(results) == {"a", "b"}
    drained = results["a"]["async"]
    assert drained.stats.processed == 20 and drained.verdict == {"seen": list(range(20))}
    assert results["a"]["inline"].verdict == {"seen": [0]}
    assert all(probe.ended == 1 for probe in Recorder.instances)
    # Stragglers from generation still running are ignored, not errors.
    assert router.route(record("a", "inline", 1)) is None
    assert router.end_request("a") is results["a"]
    with pytest.raises(RouterError, match="shut down"):
        router.register_request("c", [point()])
    assert router.shutdown() == {}  # idempotent


def test_shutdown_without_waiting_discards_queues_even_with_a_hung_probe(make_router):
    router = make_router(workers=1, default_overflow="drop_newest")
    router.register_request("r", [point("a", mode="async", queue_depth=10,
                                        probe_args={"gate": "gate", "entered": "entered"})])
    for t in range(6):
        router.route(record("r", "a", t))
    assert event("entered").wait(60)
    # The probe stays hung (its gate opens only at teardown): a shutdown that waited
    # for it would never return.
    result = router.shutdown(wait=False)["r"]["a"]
    stats = result.stats
    assert (stats.received, stats.processed, stats.dropped) == (6, 0, 6)
    assert result.verdict is None and "on_end was not called" in result.error


def test_shutdown_releases_a_producer_blocked_on_a_full_queue(make_router):
    router = make_router(workers=1, default_overflow="block")
    router.register_request("r", [point("a", mode="async", queue_depth=1,
                                        probe_args={"gate": "gate", "entered": "entered"})])
    router.route(record("r", "a", 0))
    assert event("entered").wait(60)
    router.route(record("r", "a", 1))  # fills the queue
    binding = binding_of(router, "r", "a")
    producer = threading.Thread(target=router.route, args=(record("r", "a", 2),))
    producer.start()
    assert wait_until(lambda: binding.waiting == 1)  # blocked, waiting for room
    assert producer.is_alive()
    result = router.shutdown(wait=False)["r"]["a"]
    producer.join(60)
    assert not producer.is_alive()
    assert result.stats.received == 3 == result.stats.dropped + result.stats.processed


def test_shutdown_stops_the_worker_threads():
    router = Router(workers=2)
    router.register_request("r", [point("n", probe_type="norm_probe", mode="async")])
    router.route(record("r", "n", 0))
    assert router.metrics()["workers"] == 2
    router.shutdown()
    assert wait_until(lambda: router.metrics()["workers"] == 0)


def test_metrics_report_each_live_binding_and_running_totals(make_router):
    router = make_router()
    router.register_request("r", [point("p", probe_args={"fail_at": 1}),
                                  point("q", mode="async", queue_depth=7)])
    for t in range(3):
        router.route(record("r", "p", t))
    snapshot = {b["point"]: b for b in router.metrics()["bindings"]}
    p = snapshot["p"]
    assert (p["received"], p["processed"], p["errors"], p["execution_mode"]) == (3, 3, 1, "inline")
    assert p["mean_latency_s"] >= 0 and p["max_latency_s"] >= p["mean_latency_s"]
    assert snapshot["q"]["queue_capacity"] == 7 and snapshot["q"]["queue_depth"] == 0
    router.end_request("r")
    metrics = router.metrics()
    assert metrics["bindings"] == [] and metrics["totals"]["received"] == 3
    assert metrics["totals"]["errors"] == 1


def test_request_context_manager_registers_and_collects_results(make_router):
    router = make_router()
    with router.request([point("p", probe_args={"abort_at": 1})], request_id="r") as handle:
        assert router.live_requests() == ("r",)
        handle.route(record("r", "p", 0))
        handle.route(record("r", "p", 1))
        assert handle.abort_requested
    assert router.live_requests() == ()
    assert handle.results["p"].verdict == {"seen": [0, 1]}
    assert handle.results["p"].flagged


def _recorded_joins(router, monkeypatch) -> list[float | None]:
    """The timeouts the router's workers will be joined with, as shutdown gives them."""
    joins: list[float | None] = []
    stop = router._scheduler.stop

    def recorded_stop(wait: bool = True, timeout_s: float | None = None) -> None:
        joins.append(timeout_s)
        stop(wait=wait, timeout_s=timeout_s)

    monkeypatch.setattr(router._scheduler, "stop", recorded_stop)
    return joins


@pytest.mark.parametrize("given", ["timeout_s", "drain_timeout_s"])
def test_shutdown_shares_one_timeout_among_the_drains_and_the_join_of_a_stuck_worker(
        make_router, monkeypatch, given):
    # Each drain, then the join of the workers, had timeout_s to itself: with a probe
    # stuck in a call, shutdown took about twice its timeout (N + 1 times, with N
    # requests). drain_timeout_s: the default that ProbedModel.close() shuts down with.
    router = make_router(workers=1, stall_timeout_s=3600,  # (no replacement worker)
                         drain_timeout_s=0.2 if given == "drain_timeout_s" else 60)
    for request_id in ("r", "s"):
        router.register_request(request_id, [point("a", mode="async", probe_args={
            "gate": "gate", "entered": "entered"})])
    router.route(record("r", "a", 0))
    assert event("entered").wait(60)  # the one worker is stuck in r's call
    router.route(record("s", "a", 0))  # queued behind it
    joins = _recorded_joins(router, monkeypatch)
    results = router.shutdown(timeout_s=0.2) if given == "timeout_s" else router.shutdown()
    assert ("drain timed out after 0.2s with 0 unprocessed record(s) and one in flight"
            in results["r"]["a"].error)
    # r's drain spent it all: s's drain and the join get nothing left
    assert ("the request ended without waiting for its queue (no drain time) with 1 "
            "unprocessed record(s)" in results["s"]["a"].error)
    assert joins == [0.0]


def test_shutdown_joins_the_workers_with_what_the_drains_left(make_router, monkeypatch):
    router = make_router(workers=1)
    router.register_request("r", [point("a", mode="async")])
    router.route(record("r", "a", 0))
    joins = _recorded_joins(router, monkeypatch)
    results = router.shutdown(timeout_s=3600)
    assert results["r"]["a"].stats.processed == 1
    assert len(joins) == 1 and 0 < joins[0] <= 3600
