"""Async points: bounded queues, overflow policies with exact counts, order, fairness."""

from __future__ import annotations

import threading

import pytest
from router_helpers import Recorder, binding_of, event, point, record, wait_until

from undercurrent.records import SignalAction


def _wait_for(predicate):
    if not wait_until(predicate):
        raise AssertionError("condition not reached (hung?)")


def _stuck_first_call(router, depth):
    """Register an async point whose first activation blocks on the 'gate' event."""
    router.register_request("r", [point("a", mode="async", queue_depth=depth,
                                        probe_args={"gate": "gate", "entered": "entered"})])
    assert router.route(record("r", "a", 0)) is None
    assert event("entered").wait(60)  # the worker holds token 0; the queue is empty again


def test_async_records_are_processed_in_order_and_route_returns_none(make_router):
    router = make_router(workers=2)
    router.register_request("r", [point("a", mode="async", queue_depth=1000)])
    assert all(router.route(record("r", "a", t)) is None for t in range(500))
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": list(range(500))}
    assert (result.stats.received, result.stats.processed, result.stats.dropped) == (500, 500, 0)


def test_drop_oldest_keeps_the_newest_records_with_exact_counts(make_router):
    router = make_router(workers=1, default_overflow="drop_oldest")
    _stuck_first_call(router, depth=4)
    for t in range(1, 11):
        router.route(record("r", "a", t))
    assert router.metrics()["bindings"][0]["queue_depth"] == 4
    event("gate").set()
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": [0, 7, 8, 9, 10]}
    assert (result.stats.received, result.stats.processed, result.stats.dropped) == (11, 5, 6)


def test_drop_newest_keeps_the_oldest_records_with_exact_counts(make_router):
    router = make_router(workers=1, default_overflow="drop_newest")
    _stuck_first_call(router, depth=4)
    for t in range(1, 11):
        router.route(record("r", "a", t))
    event("gate").set()
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": [0, 1, 2, 3, 4]}
    assert (result.stats.received, result.stats.processed, result.stats.dropped) == (11, 5, 6)


def test_block_makes_the_producer_wait_for_room_and_loses_nothing(make_router):
    router = make_router(workers=1, default_overflow="block")
    _stuck_first_call(router, depth=4)
    produced = []

    def produce():
        for t in range(1, 11):
            router.route(record("r", "a", t))
            produced.append(t)

    binding = binding_of(router, "r", "a")
    producer = threading.Thread(target=produce)
    producer.start()
    _wait_for(lambda: binding.waiting == 1)  # the producer waits for room
    assert len(produced) == 4 and producer.is_alive()  # blocked on the full queue
    event("gate").set()
    producer.join(60)
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": list(range(11))}
    assert (result.stats.received, result.stats.processed, result.stats.dropped) == (11, 11, 0)


def test_queue_depth_defaults_to_the_router_default(make_router):
    router = make_router(default_queue_depth=3, default_overflow="drop_newest", workers=1)
    router.register_request("r", [point("a", mode="async",
                                        probe_args={"gate": "gate", "entered": "entered"})])
    router.route(record("r", "a", 0))
    assert event("entered").wait(60)
    for t in range(1, 6):
        router.route(record("r", "a", t))
    assert router.metrics()["bindings"][0]["queue_capacity"] == 3
    event("gate").set()
    assert router.end_request("r")["a"].stats.dropped == 2


def test_async_abort_is_recorded_as_flag_and_never_stops_generation(make_router):
    router = make_router()
    router.register_request("r", [point("a", mode="async", probe_args={"abort_at": 1})])
    for t in range(3):
        assert router.route(record("r", "a", t)) is None
    result = router.end_request("r")["a"]
    assert not router.abort_requested("r")
    assert [s.action for s in result.signals] == [
        SignalAction.CONTINUE, SignalAction.FLAG, SignalAction.CONTINUE
    ]
    assert result.signals[1].metadata["requested_action"] == "abort"


def test_a_raising_async_probe_keeps_going_and_reports_the_error(make_router):
    router = make_router()
    router.register_request("r", [point("a", mode="async", probe_args={"fail_at": 2})])
    for t in range(5):
        router.route(record("r", "a", t))
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": [0, 1, 3, 4]}
    assert result.stats.errors == 1 and result.stats.processed == 5
    assert "boom at 2" in result.error


class Ordered(Recorder):
    """A Recorder that also logs (request, token) in the order the probes ran."""

    log: list[tuple[str, int]] = []

    def on_activation(self, record):
        Ordered.log.append((record.request_id, record.token_index))
        return super().on_activation(record)


def test_every_binding_progresses_with_many_more_bindings_than_workers(make_router):
    # One worker, a binding with a deep backlog, and 30 more bindings behind it: the
    # backlog is served in bounded batches, so the others are not starved. Everything
    # is queued while the only worker is held, so the order it then serves them in is
    # the scheduler's, not the machine's speed.
    Ordered.log = []
    router = make_router(workers=1, probes={"recorder": Recorder, "ordered": Ordered})
    router.register_request("holder", [point("a", mode="async",
                                             probe_args={"gate": "gate", "entered": "entered"})])
    router.route(record("holder", "a", 0))
    assert event("entered").wait(60)  # the worker is held
    router.register_request("big", [point("a", probe_type="ordered", mode="async",
                                          queue_depth=5000)])
    for t in range(600):
        router.route(record("big", "a", t))
    for i in range(30):
        router.register_request(f"small{i}", [point("a", probe_type="ordered", mode="async")])
        router.route(record(f"small{i}", "a", 0))
    event("gate").set()
    results = {name: router.end_request(name)["a"] for name in
               ["big", *(f"small{i}" for i in range(30))]}
    assert results["big"].verdict["seen"] == list(range(600))
    assert all(results[f"small{i}"].verdict["seen"] == [0] for i in range(30))
    last_small = max(i for i, (request, _) in enumerate(Ordered.log) if request != "big")
    # Every small binding ran while the big backlog was still being worked on.
    assert last_small < Ordered.log.index(("big", 599)), last_small


def test_a_hanging_async_probe_does_not_stall_other_bindings(make_router):
    router = make_router(workers=1, stall_timeout_s=0.05)
    router.register_request("hung", [point("a", mode="async",
                                           probe_args={"gate": "gate", "entered": "entered"})])
    router.route(record("hung", "a", 0))
    assert event("entered").wait(60)
    router.register_request("other", [point("a", mode="async")])
    for t in range(10):
        router.route(record("other", "a", t))
    result = router.end_request("other", timeout_s=60)["a"]
    assert result.verdict == {"seen": list(range(10))}


def test_drain_timeout_counts_leftovers_as_dropped_and_skips_on_end_of_a_busy_probe(make_router):
    router = make_router(workers=1)
    _stuck_first_call(router, depth=8)
    for t in range(1, 4):
        router.route(record("r", "a", t))
    # The probe stays held until the gate opens below: an end that waited for it
    # instead of timing out would never return.
    result = router.end_request("r", timeout_s=0.1)["a"]
    stats = result.stats
    assert (stats.received, stats.processed, stats.dropped) == (4, 0, 4)
    assert result.verdict is None and "on_end was not called" in result.error
    assert "3 unprocessed record(s) and one in flight" in result.error
    event("gate").set()
    router.shutdown()  # joins the worker: whatever it does after the late call is done
    assert Recorder.instances[0].seen == [0]  # the probe returned
    assert Recorder.instances[0].ended == 0  # on_end never called, even after that
    assert result.stats.processed == 0  # the late completion changed nothing


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest", "block"])
def test_accounting_is_exact_under_each_policy_with_concurrent_producers(make_router, policy):
    router = make_router(workers=2, default_overflow=policy, default_queue_depth=4)
    router.register_request("r", [point(f"a{i}", mode="async", probe_args={"sleep_s": 0.0001})
                                  for i in range(4)])

    def produce(name):
        for t in range(300):
            router.route(record("r", name, t))

    threads = [threading.Thread(target=produce, args=(f"a{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = router.end_request("r")
    for name, result in results.items():
        stats = result.stats
        seen = result.verdict["seen"]
        assert stats.received == 300 == stats.processed + stats.dropped, name
        assert stats.processed == len(seen) and seen == sorted(seen), name
        if policy == "block":
            assert stats.dropped == 0
