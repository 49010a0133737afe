"""Async bindings judged together: a worker that takes one binding also takes every
ready binding whose probe shares its values (one per request of a point) and
judges them with one ``judge_many`` call. The oracle is the scheduler with that
grouping switched off (``GROUP_LIMIT = 1``: each binding served alone, its probe's
own ``on_batch``), on the same routed batches; trajectory statistics are also
checked against a recurrence computed here."""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import pytest

np = pytest.importorskip("numpy")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from undercurrent.probes.base import ScoresRows  # noqa: E402
from undercurrent.records import ActivationBatch, BatchSignals  # noqa: E402
from undercurrent.router import Router, scheduler  # noqa: E402
from undercurrent.spec.types import ExtractionPoint  # noqa: E402

HIDDEN = 5
WEIGHT = [0.5, -1.0, 0.25, 2.0, -0.75]


def _point(probe_type: str, layers: tuple[int, ...], threshold: float | None, action: str,
           statistic: str, depth: int) -> ExtractionPoint:
    args: dict[str, Any] = {"threshold": threshold, "action": action}
    if probe_type == "linear_probe":
        args.update(weight=WEIGHT, bias=0.1)
    if probe_type == "trajectory_probe":
        args.update(statistic=statistic, alpha=0.5, source="norm")
    return ExtractionPoint(name="p", layers=layers, tensor_type="residual_stream",
                           position="generated[*]", probe_type=probe_type,
                           probe_kind="trajectory", execution_mode="async",
                           queue_depth=depth, probe_args=args)


def _run(grouped: bool, points: dict[str, ExtractionPoint], batches: list[ActivationBatch],
         overflow: str) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as patch, Router(default_overflow=overflow,
                                                       workers=2) as router:
        patch.setattr(scheduler, "GROUP_LIMIT", 256 if grouped else 1)
        for request_id, point in points.items():
            router.register_request(request_id, [point])
        with router.step():  # nothing is drained before every batch is queued
            for batch in batches:
                router.route_columns(batch)
        return {request_id: router.end_request(request_id)["p"] for request_id in points}


def _steps(rng: Any, ids: list[str], layers: tuple[int, ...], steps: int
           ) -> list[ActivationBatch]:
    """One routed batch per decode step: each request's rows at ``layers``, random."""
    batches = []
    for step in range(steps):
        rows = len(ids) * len(layers)
        batches.append(ActivationBatch(
            rng.normal(size=(rows, HIDDEN)).astype(np.float32),
            request_ids=[request_id for request_id in ids for _ in layers],
            point_names=["p"] * rows, layers=list(layers) * len(ids),
            tensor_type="residual_stream", token_indices=[3 + step] * rows,
            is_generated=[True] * rows, generated_indices=[step] * rows,
            token_ids=[9] * rows))
    return batches


def _view(result: Any) -> Any:
    stats = result.stats
    signals = [(s.action.value, round(s.score, 12), s.layer, s.token_index,
                dict(s.metadata)) for s in result.signals]
    verdict = {key: round(value, 12) if isinstance(value, float) else value
               for key, value in result.verdict.items() if key != "final_by_layer"}
    return (verdict, signals, (stats.received, stats.processed, stats.dropped, stats.errors),
            result.error)


@settings(max_examples=25, deadline=None)
@given(probe_type=st.sampled_from(("trajectory_probe", "linear_probe", "norm_probe")),
       thresholds=st.lists(st.one_of(st.none(), st.floats(0.0, 3.0)), min_size=1, max_size=5),
       layers=st.sets(st.integers(0, 3), min_size=1, max_size=4),
       statistic=st.sampled_from(("ewma", "mean", "max")),
       steps=st.integers(1, 5), overflow=st.sampled_from(("block", "drop_newest")),
       seed=st.integers(0, 2**31 - 1))
def test_grouped_workers_equal_serving_each_binding_alone(probe_type, thresholds, layers,
                                                          statistic, steps, overflow, seed):
    rng = np.random.default_rng(seed)
    layers = tuple(sorted(layers))
    # Each request its own threshold (so the one-rule shortcut is not always taken);
    # the queue holds every vector, so serving order cannot change what is dropped.
    depth = 64 if overflow == "block" else steps * len(layers)
    points = {f"r{index}": _point(probe_type, layers, threshold, "flag", statistic, depth)
              for index, threshold in enumerate(thresholds)}
    ids = list(points)
    batches = _steps(rng, ids, layers, steps)
    alone = _run(False, points, batches, overflow)
    together = _run(True, points, batches, overflow)
    for request_id in ids:
        assert _view(together[request_id]) == _view(alone[request_id])
        assert together[request_id].stats.processed == steps * len(layers)
    if probe_type != "trajectory_probe":
        return
    # the recurrence, computed here from the rows, per layer
    for index, request_id in enumerate(ids):
        running: dict[int, list[float]] = {}
        expected = []
        for batch in batches:
            for row, layer in enumerate(layers):
                value = float(np.linalg.norm(
                    np.asarray(batch.tensor[index * len(layers) + row], dtype=np.float64)))
                seen = running.setdefault(layer, [])
                seen.append(value)
                if statistic == "mean":
                    stat = sum(seen) / len(seen)
                elif statistic == "max":
                    stat = max(seen)
                else:
                    stat = seen[0]
                    for later in seen[1:]:
                        stat = 0.5 * later + 0.5 * stat
                expected.append(stat)
        got = [signal.score for signal in together[request_id].signals]
        assert got == pytest.approx(expected, rel=1e-9)
        threshold = thresholds[index]
        flagged = [signal.action.value == "flag" for signal in together[request_id].signals]
        assert flagged == [threshold is not None and value >= threshold
                           for value in expected]


def test_a_probe_without_judge_many_is_served_alone_with_its_own_errors(monkeypatch):
    # A built-in subclass that judges rows its own way has no one-pass judgement:
    # the worker serves each binding alone, and one request's failure is its own.
    from undercurrent.probes.statistics import NormProbe

    class Fussy(NormProbe):
        def judge_rows(self, values, token_indices, layers):
            if any(value > 2.4 for value in values.tolist()):
                raise ValueError("too large")
            return super().judge_rows(values, token_indices, layers)

    monkeypatch.setattr(scheduler, "GROUP_LIMIT", 256)
    point = ExtractionPoint(name="p", layers=(0, 1), tensor_type="residual_stream",
                            position="generated[*]", probe_type="fussy",
                            probe_kind="trajectory", execution_mode="async")
    scale = {"a": 0.5, "b": 2.0, "c": 0.5}
    rows = np.concatenate([np.full((2, HIDDEN), value, dtype=np.float32)
                           for value in scale.values()])
    results = _routed_two_rows_each({"fussy": Fussy}, point, rows, list(scale))
    assert results["b"].stats.errors == 2 and "too large" in results["b"].error
    for request_id in ("a", "c"):
        assert results[request_id].error is None
        assert results[request_id].stats.processed == 2
        assert results[request_id].verdict["max_score"] == pytest.approx(
            0.5 * math.sqrt(HIDDEN))


class Misjudging(ScoresRows):
    """Judges rows by their sum (request "b"'s rows abort); ``where`` (its class's
    ``judge_many``, or each instance's ``judge_rows``) returns what ``fault`` says
    instead: its rows but the first, or a list of signals."""

    probe_kind = "trajectory"

    def __init__(self, *, where: str, fault: str) -> None:
        self.where, self.fault = where, fault

    def on_start(self, ctx: Any) -> None:
        self.aborts = ctx.request_id == "b"

    def group_key(self) -> Any:
        return ("misjudging",)

    def row_values(self, batch: Any) -> Any:
        return np.asarray(batch.tensor).sum(axis=1)

    def judge_rows(self, values: Any, token_indices: Any, layers: Any) -> Any:
        signals = BatchSignals([2 if self.aborts else 1] * len(token_indices),
                               [float(value) for value in values])
        return self.wrong(signals) if self.where == "judge_rows" else signals

    def wrong(self, signals: BatchSignals) -> Any:
        return signals[1:len(signals)] if self.fault == "short" else signals.signals()

    @classmethod
    def judge_many(cls, probes: Any, values: Any, spans: Any, token_indices: Any,
                   layers: Any) -> Any:
        if probes[0].where != "judge_many":
            return None
        return probes[0].wrong(BatchSignals.concat([
            probe.judge_rows(values[start:stop], token_indices[start:stop],
                             layers[start:stop])
            for probe, (start, stop) in zip(probes, spans, strict=True)]))


@pytest.mark.parametrize("mode, where", [("inline", "judge_many"), ("async", "judge_many"),
                                         ("inline", "judge_rows")])
@pytest.mark.parametrize("fault", ["short", "list"])
def test_a_judge_many_or_judge_rows_without_a_signal_per_row_is_an_error_on_every_row(
        mode, where, fault):
    # Unchecked, a row short shifted the signals (request b's abort onto a's row),
    # and a list stopped generation (inline) or killed the async worker.
    point = ExtractionPoint(name="p", layers=(0, 1), tensor_type="residual_stream",
                            position="generated[*]", probe_type="misjudging",
                            probe_kind="trajectory", execution_mode=mode,
                            queue_depth=8 if mode == "async" else None,
                            probe_args={"where": where, "fault": fault})
    ids = ["a", "b", "c"]
    results = list(_routed_two_rows_each(
        {"misjudging": Misjudging}, point,
        np.arange(6 * HIDDEN, dtype=np.float32).reshape(6, HIDDEN), ids).values())
    rows = 2 if where == "judge_rows" else 6  # (inline: each request's, or all at once)
    returned = {"short": f"returned BatchSignals with {rows - 1} action codes for {rows} rows",
                "list": f"returned list for {rows} rows"}[fault]
    if mode == "async":  # (as many rows as the worker's turn took)
        returned = {"short": "returned BatchSignals with", "list": "returned list for"}[fault]
    for result in results:
        stats = result.stats
        assert (stats.received, stats.processed, stats.dropped, stats.errors) == (2, 2, 0, 2)
        assert not result.signals
        assert f"Misjudging.{where} at point 'p' {returned}" in result.error
        assert result.error.startswith("on_batch (token 4, ")  # (the call that judged them)


@pytest.mark.parametrize("together", [True, False], ids=["taken together", "each alone"])
def test_a_binding_found_empty_is_not_handed_back_once_a_producer_queued_on_it(
        monkeypatch, together):
    """A worker serving a group finds one binding empty (so it is unscheduled);
    before the turn ends a producer queues on it and schedules it itself. The
    worker must not hand it back too: on the ready line twice, two workers could
    serve it at once, out of order. Taken together (``Binding.take_together``,
    every lock free) or each alone (a lock was taken)."""
    from undercurrent.router.binding import Binding

    point = _point("trajectory_probe", (0,), None, "flag", "ewma", 8)
    batch = ActivationBatch(np.ones((1, HIDDEN)), request_ids=["r0"], point_names=["p"],
                            layers=[0], tensor_type="residual_stream", token_indices=[3],
                            is_generated=[True], generated_indices=[0], token_ids=[1])
    with Router(workers=1) as router:
        for request_id in ("r0", "r1"):
            router.register_request(request_id, [point])
        served, empty = (router._requests[r].bindings["p"] for r in ("r0", "r1"))
        assert served.enqueue_batch(batch)  # queued, not handed to any worker here
        producer_scheduled = []

        def a_producer_queues():
            other = ActivationBatch(np.ones((1, HIDDEN)), request_ids=["r1"], point_names=["p"],
                                    layers=[0], tensor_type="residual_stream",
                                    token_indices=[3], is_generated=[True],
                                    generated_indices=[0], token_ids=[1])
            producer_scheduled.append(empty.enqueue_batch(other))

        if together:
            take_together = Binding.take_together

            def take_then_a_producer_queues(bindings):
                taken = take_together(bindings)
                assert [binding for binding, _ in taken] == [served]  # the empty one left
                a_producer_queues()
                return taken

            monkeypatch.setattr(Binding, "take_together",
                                staticmethod(take_then_a_producer_queues))
        else:
            take = empty.take_queued_rows

            def take_alone_then_a_producer_queues(limit):
                found = take(limit)
                assert found is None  # empty: unscheduled by this very call
                a_producer_queues()
                return found

            monkeypatch.setattr(Binding, "take_together", staticmethod(lambda bindings: None))
            empty.take_queued_rows = take_alone_then_a_producer_queues
        handed = scheduler.AsyncScheduler(1)._run_group([served, empty], scheduler._Worker())
        assert producer_scheduled == [True]  # the producer scheduled it itself
        assert empty not in handed
        assert served.processed == 1
        if not together:
            del empty.take_queued_rows  # the real method again, for the router's worker
        monkeypatch.undo()
        router._scheduler.schedule(empty)  # what the producer does with its True
        assert router.end_request("r1")["p"].stats.processed == 1


def test_a_group_turn_is_taken_and_settled_at_once_only_with_every_lock_free():
    """``Binding.take_together`` takes each binding's whole queue (one found empty
    is unscheduled); ``finish_ranges_together`` settles them, or does nothing
    while another thread holds one lock (each then finishes alone, waiting for
    its lock)."""
    from undercurrent.router.binding import Binding

    @contextlib.contextmanager
    def held_elsewhere(binding):
        taken, done = threading.Event(), threading.Event()

        def hold():
            with binding._mutex:
                taken.set()
                done.wait()

        thread = threading.Thread(target=hold)
        thread.start()
        taken.wait()
        try:
            yield
        finally:
            done.set()
            thread.join()

    point = _point("trajectory_probe", (0,), None, "flag", "ewma", 8)

    def rows(request_id, count):
        return ActivationBatch(np.ones((count, HIDDEN)), request_ids=[request_id] * count,
                               point_names=["p"] * count, layers=[0] * count,
                               tensor_type="residual_stream", token_indices=list(range(count)),
                               is_generated=[True] * count, generated_indices=list(range(count)),
                               token_ids=[1] * count)

    with Router(workers=1) as router:
        for request_id in ("r0", "r1", "r2"):
            router.register_request(request_id, [point])
        first, second, empty = (router._requests[r].bindings["p"] for r in ("r0", "r1", "r2"))
        assert first.enqueue_batch(rows("r0", 2))  # (queued here, handed to no worker)
        assert first.enqueue_batch(rows("r0", 1)) is False  # (scheduled already)
        assert second.enqueue_batch(rows("r1", 1))
        with held_elsewhere(first):  # a lock taken: nothing taken
            assert Binding.take_together([first, second, empty]) is None
        assert (first._queued, second._queued) == (3, 1)
        taken = Binding.take_together([first, second, empty])
        assert [(binding, [stop - start for _, start, stop in pieces])
                for binding, pieces in taken] == [(first, [2, 1]), (second, [1])]
        assert (first._busy, first._in_flight, first._queued) == (True, 3, 0)
        assert (empty._scheduled, empty._busy) == (False, False)
        ranges = [(binding, [(batch, start, stop, start) for batch, start, stop in pieces])
                  for binding, pieces in taken]
        with held_elsewhere(second):
            assert Binding.finish_ranges_together(ranges, None, [0.3, 0.1], 0.1) is None
        assert second._busy and second.processed == 0
        assert Binding.finish_ranges_together(ranges, None, [0.3, 0.1], 0.1) == [False, False]
        for binding, processed in ((first, 3), (second, 1)):
            assert (binding.processed, binding._busy, binding._scheduled) == (processed, False,
                                                                             False)
        results = {r: router.end_request(r)["p"].stats for r in ("r0", "r1", "r2")}
        assert [(stats.received, stats.processed, stats.dropped)
                for stats in results.values()] == [(3, 3, 0), (1, 1, 0), (0, 0, 0)]


def test_a_group_turn_takes_each_binding_s_whole_queue(monkeypatch):
    """A worker serving a group takes everything each binding has queued (here
    40 vectors, more than the scheduler's ``batch_size``, less than the queue
    of 64): one ``judge_many`` call for the whole turn, the counts and
    observations those of serving each binding alone."""
    from undercurrent.probes.trajectory import TrajectoryProbe

    calls: list[list[tuple[int, int]]] = []
    judge_many = TrajectoryProbe.judge_many.__func__  # type: ignore[attr-defined]

    def counted(cls, probes, values, spans, token_indices, layers):
        calls.append(list(spans))
        return judge_many(cls, probes, values, spans, token_indices, layers)

    monkeypatch.setattr(TrajectoryProbe, "judge_many", classmethod(counted))
    rng = np.random.default_rng(7)
    steps, layers, ids = 20, (0, 1), ["r0", "r1"]
    assert steps * len(layers) > scheduler.AsyncScheduler(1).batch_size
    points = {request_id: _point("trajectory_probe", layers, 1.0, "flag", "ewma", 64)
              for request_id in ids}
    batches = _steps(rng, ids, layers, steps)
    with Router(workers=1) as router:
        for request_id, point in points.items():
            router.register_request(request_id, [point])
        with router.step():  # both queues are full before the worker wakes
            for batch in batches:
                router.route_columns(batch)
        together = {request_id: router.end_request(request_id)["p"] for request_id in ids}
    assert calls == [[(0, 40), (40, 80)]]
    alone = _run(False, points, batches, "block")
    for request_id in ids:
        assert _view(together[request_id]) == _view(alone[request_id])
        assert together[request_id].stats.processed == steps * len(layers)


def test_turns_count_a_group_key_once_per_group_limit_and_other_bindings_each(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(scheduler, "GROUP_LIMIT", 3)
    bindings = ([SimpleNamespace(async_group="k")] * 7 + [SimpleNamespace(async_group=None)] * 2
                + [SimpleNamespace(async_group="j")])
    assert scheduler._turns(bindings) == 3 + 2 + 1  # k: 3 + 3 + 1; each None; j
    monkeypatch.setattr(scheduler, "GROUP_LIMIT", 1)  # grouping off: one turn each
    assert scheduler._turns(bindings) == len(bindings)


def test_one_worker_is_woken_for_a_call_s_bindings_judged_together():
    """Eight requests' bindings of one point, queued in one step: one worker
    takes them all, so one is woken (the others would only take the
    interpreter lock to find the ready line empty), and every row is judged."""
    point = _point("trajectory_probe", (0, 1), None, "flag", "ewma", 8)
    ids = [f"r{index}" for index in range(8)]
    batch = _steps(np.random.default_rng(3), ids, (0, 1), 1)[0]
    with Router(workers=4) as router:
        for request_id in ids:
            router.register_request(request_id, [point])
        cond = router._scheduler._cond
        woken = []
        notify = cond.notify
        cond.notify = lambda n=1: (woken.append(n), notify(n))
        with router.step():
            router.route_columns(batch)
        cond.notify = notify  # (notify_all, at the router's exit, calls notify too)
        results = [router.end_request(request_id)["p"] for request_id in ids]
    assert woken == [1]
    assert [result.stats.processed for result in results] == [2] * 8


def _routed_two_rows_each(probes: dict[str, Any], point: ExtractionPoint, rows: Any,
                          ids: list[str]) -> dict[str, Any]:
    """Point ``p``'s results for requests ``ids``, each given two of ``rows`` (layers
    0 and 1 of token 4) in one routed step, by a router of two workers."""
    batch = ActivationBatch(rows, request_ids=[r for r in ids for _ in range(2)],
                            point_names=["p"] * len(rows), layers=[0, 1] * len(ids),
                            tensor_type="residual_stream", token_indices=[4] * len(rows),
                            is_generated=[True] * len(rows),
                            generated_indices=[0] * len(rows), token_ids=[1] * len(rows))
    with Router(probes=probes, workers=2) as router:
        for request_id in ids:
            router.register_request(request_id, [point])
        with router.step():
            router.route_columns(batch)
        return {request_id: router.end_request(request_id)["p"] for request_id in ids}
