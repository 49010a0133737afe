"""Async queues: the ``block`` policy never deadlocks, and ``queue_depth`` counts records
with room for at least one token's records, so a probe that keeps up loses none.

A point captures one record per layer for each token, and the adapters route a
token's records for a point as one batch (inside ``router.step()``). These tests
route batches with more records than the point's ``queue_depth``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from router_helpers import point, record

from undercurrent.probes import Probe
from undercurrent.records import ActivationRecord, ProbeSignal
from undercurrent.spec.types import ProbeKind

HANG_GUARD_S = 60  # only a deadlock reaches it


class Tally(Probe):
    """Counts the (token, layer) pairs it has processed; tests wait on ``changed``."""

    probe_kind = ProbeKind.TRAJECTORY
    changed = threading.Condition()
    instances: list[Tally] = []

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []
        Tally.instances.append(self)

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        with Tally.changed:
            self.seen.append((record.token_index, record.layer))
            Tally.changed.notify_all()
        return ProbeSignal(score=float(record.layer))

    def on_end(self, ctx: Any) -> Any:
        return {"seen": list(self.seen)}


@pytest.fixture
def tally_router(make_router):
    Tally.instances.clear()

    def build(**kwargs: Any):
        return make_router(probes={"tally": Tally}, **kwargs)

    yield build
    Tally.instances.clear()


def _token_records(token: int, layers: tuple[int, ...]) -> list[ActivationRecord]:
    return [record("r", "a", token, layer=layer) for layer in layers]


def _run_guarded(work) -> None:
    """Run ``work`` on a daemon thread; fail (instead of hanging the suite) on a deadlock."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as exc:  # surfaced in the test thread
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "routing deadlocked under the block overflow policy"
    if failure:
        raise failure[0]


@pytest.mark.parametrize(("layers", "depth"), [((0, 3), 1), ((0, 1, 2), 2), ((0, 1, 2, 3), 1)])
@pytest.mark.parametrize("in_step", [True, False], ids=["in_step", "bare"])
def test_block_never_deadlocks_when_a_batch_holds_more_records_than_the_queue(
        tally_router, layers, depth, in_step):
    router = tally_router(default_overflow="block", workers=1)
    router.register_request("r", [point("a", probe_type="tally", mode="async",
                                        layers=layers, queue_depth=depth)])
    tokens = range(6)

    def produce() -> None:
        for first in range(0, len(tokens), 3):  # three tokens' records in one batch
            batch = [rec for t in tokens[first:first + 3] for rec in _token_records(t, layers)]
            if in_step:
                with router.step():
                    router.route_batch(batch)
            else:
                router.route_batch(batch)

    _run_guarded(produce)
    result = router.end_request("r")["a"]
    expected = [(t, layer) for t in tokens for layer in layers]
    assert result.verdict == {"seen": expected}
    stats = result.stats
    assert (stats.received, stats.processed, stats.dropped) == (len(expected),) * 2 + (0,)


@pytest.mark.parametrize(("layers", "depth"), [((0, 1, 2, 3), 2), ((0, 3), 1)])
def test_queue_capacity_is_never_smaller_than_one_tokens_records(tally_router, layers, depth):
    router = tally_router()
    router.register_request("r", [point("a", probe_type="tally", mode="async",
                                        layers=layers, queue_depth=depth)])
    assert router.metrics()["bindings"][0]["queue_capacity"] == len(layers)


def test_queue_depth_larger_than_a_token_is_kept(tally_router):
    router = tally_router()
    router.register_request("r", [point("a", probe_type="tally", mode="async",
                                        layers=(0, 1), queue_depth=5)])
    assert router.metrics()["bindings"][0]["queue_capacity"] == 5


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_a_probe_that_keeps_up_loses_no_record_with_more_layers_than_queue_depth(
        tally_router, policy):
    layers = (0, 1, 2, 3)
    router = tally_router(default_overflow=policy, workers=1)
    router.register_request("r", [point("a", probe_type="tally", mode="async",
                                        layers=layers, queue_depth=2)])
    tokens = range(5)
    for token in tokens:  # one engine step per token, as the adapters deliver them
        with router.step():
            router.route_batch(_token_records(token, layers))
        with Tally.changed:  # the probe keeps up: it finishes a step before the next
            done = Tally.changed.wait_for(
                lambda t=token: len(Tally.instances[0].seen) == (t + 1) * len(layers)
                or router.metrics()["bindings"][0]["dropped"] > 0,
                timeout=HANG_GUARD_S,
            )
        assert done
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": [(t, layer) for t in tokens for layer in layers]}
    assert (result.stats.received, result.stats.processed, result.stats.dropped) == (20, 20, 0)


def test_a_binding_makes_its_condition_only_once_a_thread_must_wait(tally_router):
    """A binding's condition is made when a thread first waits on it (the rest
    take its lock only): an inline binding never makes one. A producer that
    waits for room in a full queue makes it and is woken through it (whether
    it waits depends on how fast the worker drains; the deadlock tests above
    cover that path)."""
    router = tally_router(default_overflow="block", workers=1)
    router.register_request("i", [point("a", probe_type="tally", layers=(0, 1))])
    router.register_request("r", [point("a", probe_type="tally", mode="async",
                                        layers=(0, 1), queue_depth=1)])
    inline = router._requests["i"].bindings["a"]
    router.route_batch([record("i", "a", t, layer=layer) for t in range(3) for layer in (0, 1)])
    assert inline._cond is None
    # Six records for a queue of two: the producer may wait for room.
    _run_guarded(lambda: router.route_batch(
        [record("r", "a", t, layer=layer) for t in range(3) for layer in (0, 1)]))
    results = {rid: router.end_request(rid)["a"] for rid in ("i", "r")}
    assert inline._cond is None
    for result in results.values():
        assert result.verdict == {"seen": [(t, layer) for t in range(3) for layer in (0, 1)]}
        assert (result.stats.received, result.stats.processed) == (6, 6)
