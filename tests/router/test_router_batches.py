"""Router.route_batch and Router.step: a token's records for one point routed as one batch.

Batching changes how many calls a probe gets, never what is counted: every record
still ends up processed or dropped, errors and fallbacks are counted per record,
and the results equal routing the same records one by one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from router_helpers import Recorder, binding_of, block, event, point, record

from undercurrent.probes import Probe
from undercurrent.records import BatchSignals, ProbeSignal, SignalAction
from undercurrent.router import RouterError
from undercurrent.spec.types import ProbeKind

LAYERS = (0, 1, 2)


class Batcher(Probe):
    """Scores batches natively (overrides on_activations) and records each call's tokens.

    probe_args: ``fail`` (every call raises RuntimeError), ``interrupt`` (every call
    raises KeyboardInterrupt), ``short`` (returns one signal too few), ``wrong_type``
    (returns dicts), ``sleep_s`` (per call).
    """

    probe_kind = (ProbeKind.TRAJECTORY, ProbeKind.SINGLE_SHOT)
    instances: list[Batcher] = []

    def __init__(self, *, fail: bool = False, interrupt: bool = False, short: bool = False,
                 wrong_type: bool = False, sleep_s: float = 0.0) -> None:
        self.fail, self.interrupt, self.short = fail, interrupt, short
        self.wrong_type, self.sleep_s = wrong_type, sleep_s
        self.calls: list[list[int]] = []
        self.seen: list[int] = []
        Batcher.instances.append(self)

    def on_activation(self, record: Any) -> ProbeSignal | None:
        return self.on_activations([record])[0]

    def on_activations(self, records: Any) -> Any:
        self.calls.append([r.token_index for r in records])
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.fail:
            raise RuntimeError("batch boom")
        if self.interrupt:
            raise KeyboardInterrupt
        if self.wrong_type:
            return [{"score": 1.0} for _ in records]
        signals = [ProbeSignal(score=float(r.token_index)) for r in records]
        self.seen.extend(r.token_index for r in records)
        return signals[:-1] if self.short else signals

    def on_end(self, ctx: Any) -> Any:
        return {"seen": list(self.seen)}


class Interrupting(Probe):
    """A plain (non-batching) probe whose ``on_activation`` raises KeyboardInterrupt
    at token ``at``."""

    probe_kind = ProbeKind.TRAJECTORY

    def __init__(self, *, at: int) -> None:
        self.at = at
        self.seen: list[int] = []

    def on_activation(self, record: Any) -> ProbeSignal | None:
        if record.token_index == self.at:
            raise KeyboardInterrupt
        self.seen.append(record.token_index)
        return ProbeSignal(score=float(record.token_index))

    def on_end(self, ctx: Any) -> Any:
        return {"seen": list(self.seen)}


class HeldAtLayer(Probe):
    """A plain (non-batching) probe that answers at once, except at layer ``layer``,
    where it waits for the ``gate`` event first."""

    probe_kind = ProbeKind.TRAJECTORY

    def __init__(self, *, layer: int) -> None:
        self.layer = layer
        self.seen: list[int] = []

    def on_activation(self, record: Any) -> ProbeSignal | None:
        if record.layer == self.layer:
            event("gate").wait(60)
        self.seen.append(record.layer)
        return ProbeSignal(score=float(record.layer))

    def on_end(self, ctx: Any) -> Any:
        return {"seen": list(self.seen)}


#: What :class:`Columns` returns for ``n`` rows, each wrong in one way, and what the
#: error says of it.
WRONG_COLUMNS: dict[str, tuple[Any, str]] = {
    "float codes": (lambda n: BatchSignals([2.0] * n, [0.5] * n),
                    "BatchSignals with action codes of type float"),
    "float code array": (lambda n: BatchSignals(np.full(n, 2.0), np.full(n, 0.5)),
                         "BatchSignals with action codes of dtype float64"),
    "code 7": (lambda n: BatchSignals([7] * n),
               "BatchSignals with action codes outside ACTION_CODES / NO_SIGNAL"),
    "code -2 array": (lambda n: BatchSignals(np.full(n, -2), [0.5] * n),
                      "BatchSignals with action codes outside ACTION_CODES / NO_SIGNAL"),
    "code -3": (lambda n: BatchSignals([-3] * n, [0.5] * n),
                "BatchSignals with action codes outside ACTION_CODES / NO_SIGNAL"),
    "scores short": (lambda n: BatchSignals([1] * n, [0.5]), "BatchSignals with 1 scores"),
    "metadata short": (lambda n: BatchSignals([1] * n, [0.5] * n, {"k": [1]}),
                       "BatchSignals with 1 metadata column 'k'"),
    "a list": (lambda n: [ProbeSignal("flag")] * n, "list"),
}


class Columns(Probe):
    """Scores batches with ``on_batch`` and returns what ``WRONG_COLUMNS[case]``
    makes of the batch's row count."""

    probe_kind = (ProbeKind.TRAJECTORY, ProbeKind.SINGLE_SHOT)

    def __init__(self, *, case: str) -> None:
        self.case = case

    def on_batch(self, batch: Any) -> Any:
        return WRONG_COLUMNS[self.case][0](len(batch))


PROBES = {"recorder": Recorder, "batcher": Batcher, "interrupting": Interrupting,
          "held_at_layer": HeldAtLayer, "columns": Columns}


@pytest.fixture(autouse=True)
def _forget_batchers():
    Batcher.instances.clear()
    yield
    Batcher.instances.clear()


@pytest.fixture
def router_for(make_router):
    def build(**kwargs):
        return make_router(probes=PROBES, **kwargs)
    return build


def token_batch(request_id: str, name: str, token: int) -> list:
    """One token's records for one point: its layers, in layer order."""
    return [record(request_id, name, token, value=_value(token, layer), layer=layer)
            for layer in LAYERS]


def _value(token: int, layer: int) -> float:
    return 0.5 + 0.37 * ((token * 3 + layer) % 7)  # norms 1.0 .. 5.44


def _signal_view(signal: ProbeSignal | None) -> Any:
    if signal is None:
        return None
    return (signal.action, signal.score, dict(signal.metadata))


def _stats(result) -> tuple:
    s = result.stats
    return (s.received, s.processed, s.dropped, s.errors, s.timeouts)


# -- equivalence -----------------------------------------------------------------------

def test_route_batch_gives_one_entry_per_record_and_the_same_results_as_routing_one_by_one(
        router_for):
    router = router_for(workers=1)
    points = [
        point("traj", probe_type="trajectory_probe", layers=LAYERS,
              probe_args={"statistic": "ewma", "threshold": 3.5}),
        point("norm", probe_type="norm_probe", layers=LAYERS, probe_args={"threshold": 4.0}),
        point("rec", layers=LAYERS),
        point("batcher", probe_type="batcher", layers=LAYERS),
        point("async_traj", probe_type="trajectory_probe", layers=LAYERS, mode="async",
              queue_depth=64, probe_args={"statistic": "max", "threshold": 4.0}),
        point("linear", probe_type="linear_probe", layers=LAYERS,
              probe_args={"weight": [0.4, -0.1, 0.3, 0.2], "bias": -0.9, "threshold": 0.7}),
    ]
    router.register_request("one", points)
    router.register_request("batched", points)
    returned: dict[str, dict[str, list]] = {"one": {}, "batched": {}}
    for token in range(6):
        for p in points:
            one = [router.route(r) for r in token_batch("one", p.name, token)]
            batched = router.route_batch(token_batch("batched", p.name, token))
            assert len(batched) == len(LAYERS)
            returned["one"].setdefault(p.name, []).extend(one)
            returned["batched"].setdefault(p.name, []).extend(batched)
    one_results = router.end_request("one")
    batched_results = router.end_request("batched")
    flagged = 0
    for p in points:
        expected, got = one_results[p.name], batched_results[p.name]
        assert [_signal_view(s) for s in returned["batched"][p.name]] == \
            [_signal_view(s) for s in returned["one"][p.name]], p.name
        assert [_signal_view(s) for s in got.signals] == \
            [_signal_view(s) for s in expected.signals], p.name
        assert _stats(got) == _stats(expected) == (18, 18, 0, 0, 0), p.name
        assert got.verdict == expected.verdict, p.name
        assert got.error is None
        flagged += sum(s.action is SignalAction.FLAG for s in got.signals)
    assert returned["batched"]["async_traj"] == [None] * 18  # async: queued, nothing to apply
    assert flagged > 0  # the thresholds above really produced flags to compare
    linear = [s.action for s in batched_results["linear"].signals]
    assert SignalAction.FLAG in linear and SignalAction.CONTINUE in linear
    # the batching probe got one call per token (its three layers), not one per record
    assert [len(call) for call in Batcher.instances[1].calls] == [3] * 6


def test_an_empty_batch_routes_nothing(router_for):
    router = router_for()
    router.register_request("r", [point("p")])
    assert router.route_batch([]) == []
    assert _stats(router.end_request("r")["p"]) == (0, 0, 0, 0, 0)


def test_a_batch_mixing_requests_or_points_is_refused_naming_both_and_counts_nothing(
        router_for):
    router = router_for()
    router.register_request("a", [point("p"), point("q")])
    router.register_request("b", [point("p"), point("q")])
    with pytest.raises(RouterError) as mixed_requests:
        router.route_batch([record("a", "p", 0), record("b", "p", 0)])
    assert "('a', 'p')" in str(mixed_requests.value)
    assert "('b', 'p')" in str(mixed_requests.value)
    with pytest.raises(RouterError) as mixed_points:
        router.route_batch([record("a", "p", 0), record("a", "p", 1), record("a", "q", 1)])
    assert "('a', 'p')" in str(mixed_points.value)
    assert "('a', 'q')" in str(mixed_points.value)
    assert router.metrics()["totals"]["received"] == 0
    assert all(not probe.seen for probe in Recorder.instances)


def test_records_of_a_batch_for_a_request_that_just_ended_count_each_as_late(router_for):
    router = router_for()
    router.register_request("r", [point("p", layers=LAYERS)])
    router.end_request("r")
    assert router.route_batch(token_batch("r", "p", 0)) == [None, None, None]
    assert router.metrics()["late_records"] == 3
    with pytest.raises(RouterError, match="no live request 'never'"):
        router.route_batch(token_batch("never", "p", 0))


# -- errors ----------------------------------------------------------------------------

def test_a_plain_probe_raising_on_one_record_of_a_batch_costs_only_that_record(router_for):
    router = router_for()
    router.register_request("r", [point("p", probe_args={"fail_at": 2})])
    signals = router.route_batch([record("r", "p", t) for t in range(4)])
    assert [None if s is None else s.score for s in signals] == [0.0, 1.0, None, 3.0]
    result = router.end_request("r")["p"]
    assert _stats(result) == (4, 4, 0, 1, 0)
    assert result.verdict == {"seen": [0, 1, 3]}
    assert "RuntimeError: boom at 2" in result.error


def test_a_batching_probe_raising_makes_every_record_of_its_batch_an_error(router_for):
    router = router_for()
    router.register_request("r", [point("p", probe_type="batcher", layers=LAYERS,
                                        probe_args={"fail": True})])
    assert router.route_batch(token_batch("r", "p", 0)) == [None, None, None]
    result = router.end_request("r")["p"]
    stats = result.stats
    assert (stats.received, stats.processed, stats.errors) == (3, 3, 3)
    assert stats.received == stats.processed + stats.dropped
    assert "RuntimeError: batch boom" in result.error
    assert Batcher.instances[0].calls == [[0, 0, 0]]  # one call for the whole batch


def test_a_batching_probe_returning_the_wrong_number_of_signals_is_an_error_per_record(
        router_for):
    router = router_for()
    router.register_request("r", [point("p", probe_type="batcher", layers=LAYERS,
                                        probe_args={"short": True})])
    assert router.route_batch(token_batch("r", "p", 0)) == [None, None, None]
    result = router.end_request("r")["p"]
    assert _stats(result) == (3, 3, 0, 3, 0)
    assert not result.signals  # the two signals it did return are not kept either
    assert "on_activations returned 2 signals for 3 records" in result.error


def test_a_batching_probe_returning_something_other_than_signals_is_an_error_per_record(
        router_for):
    router = router_for()
    router.register_request("r", [point("p", probe_type="batcher", layers=LAYERS,
                                        probe_args={"wrong_type": True})])
    assert router.route_batch(token_batch("r", "p", 0)) == [None, None, None]
    result = router.end_request("r")["p"]
    assert _stats(result) == (3, 3, 0, 3, 0)
    assert "on_activations returned dict; expected ProbeSignal or None" in result.error


@pytest.mark.parametrize("mode", ["inline", "async"])
@pytest.mark.parametrize("case", list(WRONG_COLUMNS))
def test_an_on_batch_returning_columns_that_are_not_a_signal_per_row_is_an_error_per_row(
        router_for, mode, case):
    # Refused at the call: read later, a code outside the table or a short column
    # would raise (or, for -2 and -3, read as another action) where nobody asked.
    router = router_for(workers=1)
    router.register_request("r", [point("p", probe_type="columns", layers=LAYERS, mode=mode,
                                        queue_depth=8 if mode == "async" else None,
                                        probe_args={"case": case})])
    with router.step():
        router.route_batch(token_batch("r", "p", 0))
    result = router.end_request("r")["p"]
    assert _stats(result) == (3, 3, 0, 3, 0)
    assert not result.signals
    error = "TypeError" if case == "a list" else "ValueError"
    assert (f"{error}: Columns.on_batch at point 'p' returned {WRONG_COLUMNS[case][1]} "
            "for 3 rows") in result.error


def test_a_keyboard_interrupt_mid_batch_reaches_the_caller_and_every_record_is_accounted(
        router_for):
    router = router_for()
    router.register_request("r", [point("p", probe_type="interrupting",
                                        probe_args={"at": 1})])
    with pytest.raises(KeyboardInterrupt):
        router.route_batch([record("r", "p", t) for t in range(4)])
    # The binding was left idle, not busy (a deadline already past: no waiting).
    assert binding_of(router, "r", "p").wait_idle(deadline=0)
    result = router.end_request("r")["p"]
    stats = result.stats
    assert (stats.received, stats.processed, stats.errors, stats.dropped) == (4, 2, 1, 2)
    assert result.verdict == {"seen": [0]}  # on_end ran; records 2 and 3 never reached it
    assert "KeyboardInterrupt" in result.error


def test_a_keyboard_interrupt_from_a_batching_probe_makes_the_whole_batch_an_error(router_for):
    router = router_for()
    router.register_request("r", [point("p", probe_type="batcher",
                                        probe_args={"interrupt": True})])
    with pytest.raises(KeyboardInterrupt):
        router.route_batch([record("r", "p", t) for t in range(4)])
    stats = router.end_request("r")["p"].stats
    assert (stats.received, stats.processed, stats.errors, stats.dropped) == (4, 4, 4, 0)
    assert Batcher.instances[0].calls == [[0, 1, 2, 3]]


# -- block_until_signal ----------------------------------------------------------------

def test_a_batch_that_misses_the_deadline_gets_one_timeout_fallback_per_record(router_for):
    router = router_for()
    router.register_request("r", [point("p", probe_type="batcher", layers=LAYERS,
                                        intervention=block(30),
                                        probe_args={"sleep_s": 0.1})])
    signals = router.route_batch(token_batch("r", "p", 0))
    assert [s.metadata["reason"] for s in signals] == ["timeout"] * 3
    assert all(s.action is SignalAction.CONTINUE and s.metadata["fallback"] for s in signals)
    assert binding_of(router, "r", "p").wait_idle(time.monotonic() + 60)  # the late call ended
    result = router.end_request("r")["p"]
    assert result.stats.timeouts == 3
    assert [s.metadata["reason"] for s in result.signals] == ["timeout"] * 3
    assert result.stats.processed == 3 and result.metadata["late_results"] == 3
    assert Batcher.instances[0].calls == [[0, 0, 0]]  # the probe was called once


def test_a_plain_probe_under_block_until_signal_gets_one_deadline_for_the_whole_batch(
        router_for):
    # Layers 0 and 1 are answered at once; layer 2 is held until after the call. With a
    # deadline per record the first two would get their own signals; one deadline for
    # the batch means all three fall back.
    router = router_for()
    router.register_request("r", [point("p", probe_type="held_at_layer", layers=LAYERS,
                                        intervention=block(100), probe_args={"layer": 2})])
    signals = router.route_batch(token_batch("r", "p", 0))
    assert [s.metadata["reason"] for s in signals] == ["timeout"] * 3
    binding = binding_of(router, "r", "p")
    event("gate").set()
    assert binding.wait_idle(time.monotonic() + 60)  # the late call ended
    result = router.end_request("r")["p"]
    assert result.stats.timeouts == 3 and result.stats.processed == 3
    assert result.verdict == {"seen": [0, 1, 2]}  # the helper still ran the whole batch


def test_the_breaker_trips_once_when_one_batch_brings_more_failures_than_its_threshold(
        router_for):
    router = router_for(breaker_threshold=2)
    router.register_request("r", [point("p", probe_type="batcher", layers=LAYERS,
                                        intervention=block(2000),
                                        probe_args={"fail": True})])
    signals = router.route_batch(token_batch("r", "p", 0))
    assert [s.metadata["reason"] for s in signals] == ["error", "circuit_open", "error"]
    assert signals[1].action is SignalAction.FLAG
    result = router.end_request("r")["p"]
    reasons = [s.metadata.get("reason") for s in result.signals]
    assert reasons.count("circuit_open") == 1
    assert reasons == ["error", "error", "circuit_open", "error"]
    assert result.metadata["breaker_open"] is True
    assert result.stats.timeouts == 3 and result.stats.errors == 3


# -- Router.step and the async scheduler -----------------------------------------------

def test_inside_a_step_async_records_wait_queued_and_no_worker_starts_until_it_ends(
        router_for):
    router = router_for(workers=2)
    router.register_request("r", [point("a", mode="async", queue_depth=16),
                                  point("i")])
    with router.step():
        for t in range(5):
            assert router.route(record("r", "a", t)) is None
            assert router.route(record("r", "i", t)).score == float(t)  # inline: unaffected
        metrics = router.metrics()
        assert metrics["workers"] == 0
        async_binding = next(b for b in metrics["bindings"] if b["point"] == "a")
        assert async_binding["queue_depth"] == 5 and async_binding["processed"] == 0
    assert router.metrics()["workers"] == 2  # woken once, at the end of the block
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": [0, 1, 2, 3, 4]}
    assert _stats(result) == (5, 5, 0, 0, 0)


def test_nested_steps_wake_the_workers_only_when_the_outermost_block_ends(router_for):
    router = router_for(workers=1)
    router.register_request("r", [point("a", mode="async", queue_depth=16)])
    with router.step():
        with router.step():
            router.route_batch([record("r", "a", t) for t in range(3)])
        assert router.metrics()["workers"] == 0
        router.route(record("r", "a", 3))
    assert router.metrics()["workers"] == 1
    assert router.end_request("r")["a"].verdict == {"seen": [0, 1, 2, 3]}


def test_overflow_block_inside_a_step_wakes_the_worker_at_once_so_routing_never_deadlocks(
        make_router):
    router = make_router(default_overflow="block", workers=1)
    router.register_request("r", [point("a", mode="async", queue_depth=2)])
    routed: list[int] = []

    def produce():
        with router.step():
            for t in range(10):  # five times what the queue holds
                router.route(record("r", "a", t))
                routed.append(t)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(60)
    assert not producer.is_alive(), f"routing deadlocked after {len(routed)} records"
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": list(range(10))}
    assert _stats(result) == (10, 10, 0, 0, 0)


def test_a_batching_async_probe_gets_the_queued_records_in_batches(router_for):
    router = router_for(workers=1)
    router.register_request("r", [point("a", probe_type="batcher", mode="async",
                                        queue_depth=64)])
    batch_size = router._scheduler.batch_size
    total = 2 * batch_size + 3
    with router.step():  # everything is queued before the worker wakes
        for t in range(total):
            router.route(record("r", "a", t))
    result = router.end_request("r")["a"]
    calls = Batcher.instances[0].calls
    assert [len(call) for call in calls] == [batch_size, batch_size, 3]
    assert [t for call in calls for t in call] == list(range(total))  # in order
    assert result.verdict == {"seen": list(range(total))}
    assert _stats(result) == (total, total, 0, 0, 0)


def test_a_plain_async_probe_still_gets_one_record_per_call(router_for):
    router = router_for(workers=1)
    router.register_request("r", [point("a", mode="async", queue_depth=64)])
    with router.step():
        router.route_batch([record("r", "a", t) for t in range(6)])
    result = router.end_request("r")["a"]
    assert result.verdict == {"seen": list(range(6))}
    assert not Recorder.instances[0].overlapped
    assert _stats(result) == (6, 6, 0, 0, 0)
