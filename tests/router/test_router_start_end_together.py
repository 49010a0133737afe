"""A call's probes started and ended together: ``Router.register_requests`` starts
each point's built-in probes in one ``start_many`` call, and ``end_requests``
ends every idle binding of a call at once (``Binding.end_idle_together``), the
built-ins' verdicts from one ``end_many`` call and the results made a column at
a time. The oracle is the one-by-one path: each request registered and ended
on its own (``register_request``, ``end_request``), whose probes get
``on_start`` and ``on_end`` one at a time."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from router_helpers import Recorder, held_elsewhere, point, record, route_rows, wait_until

from undercurrent.probes import LinearProbe, NormProbe, Probe, RequestContext
from undercurrent.probes.scoring import ScoreSummary, summary_verdicts
from undercurrent.records import ActivationBatch
from undercurrent.router import Router
from undercurrent.router.binding import Binding

IDS = ["a", "b", "c", "d"]
WEIGHT = [0.5, -0.25, 1.0, 0.0]
NAMES = ("lin", "traj", "norm", "mean", "rec")


def _contexts(ids=IDS):
    return [RequestContext(request_id=rid, prompt="hi", prompt_len=2, model_name="tiny")
            for rid in ids]


def _points():
    return [
        point("lin", probe_type="linear_probe", kind="single_shot",
              probe_args={"weight": WEIGHT, "bias": 0.1, "threshold": 0.9}),
        point("traj", probe_type="trajectory_probe", probe_args={"alpha": 0.5}),
        point("norm", probe_type="norm_probe", kind="single_shot",
              probe_args={"threshold": 3.0}),
        point("mean", probe_type="mean_probe", kind="single_shot"),
        point("rec"),
    ]


def _route(router, ids, names=NAMES):
    """Different rows for each request (values by request and token)."""
    route_rows(router, ids, names, 0.3)


def _view(result):
    """Everything a result holds but its timings, its signals read as plain values."""
    stats = dataclasses.asdict(result.stats)
    metadata = dict(result.metadata)
    assert stats.pop("mean_latency_s") >= 0 and metadata.pop("max_latency_s") >= 0
    return (result.request_id, result.extraction_point_name, result.verdict,
            [(s.action, s.score, s.token_index, s.layer, dict(s.metadata))
             for s in result.signals],
            stats, result.error, list(metadata), metadata)


def _views(results):
    return [{name: _view(result) for name, result in by_point.items()} for by_point in results]


@pytest.fixture
def calls(monkeypatch):
    """How often the together paths ran, and what they returned."""
    seen: dict[str, list[object]] = {"start": [], "end": []}
    start, end = Binding.start_together, Binding.end_idle_together

    def counted_start(bindings):
        seen["start"].append(done := start(bindings))
        return done

    def counted_end(columns):
        seen["end"].append(ended := end(columns))
        return ended

    monkeypatch.setattr(Binding, "start_together", staticmethod(counted_start))
    monkeypatch.setattr(Binding, "end_idle_together", staticmethod(counted_end))
    return seen


def _together_against_one_by_one(make_router, calls, points, started):
    """Register, route and end IDS together (each point started together or not,
    as ``started`` says; ended together), and check the results against the
    one-by-one path's: returns them."""
    router = make_router()
    router.register_requests(_contexts(), points)
    assert calls["start"] == started
    _route(router, IDS, [p.name for p in points])
    together = router.end_requests(IDS)
    assert calls["end"][-1] is not None
    assert _views(together) == _views(_one_by_one(make_router, points))
    return together


def _one_by_one(make_router, points, probes=None):
    router = make_router(probes=probes or {"recorder": Recorder})
    for ctx in _contexts():
        router.register_request(ctx.request_id, points, ctx)
    _route(router, IDS, [p.name for p in points])
    return [router.end_request(rid) for rid in IDS]


def test_starting_and_ending_together_gives_what_one_by_one_gives(make_router, calls):
    points = _points()
    router = make_router(probes={"recorder": Recorder})
    router.register_requests(_contexts(), points)
    # the built-ins started in one call per point; the user probe one by one
    assert calls["start"] == [True, True, True, True, False]
    probes = {name: [router._requests[rid].bindings[name].probe for rid in IDS]
              for name in NAMES}
    for name in ("lin", "norm", "mean"):
        assert len({id(probe.summary) for probe in probes[name]}) == len(IDS)
        assert len({id(probe.summary.extra) for probe in probes[name]}) == len(IDS)
    assert [probe.started for probe in probes["rec"]] == [1] * len(IDS)
    _route(router, IDS)
    together = router.end_requests(IDS)
    assert calls["end"] and calls["end"][-1] is not None  # (the together path ran)
    alone = _one_by_one(make_router, points)
    assert _views(together) == _views(alone)
    # every request judged its own rows, and some crossed: flags and signals kept
    assert len({str(by_point["traj"].verdict) for by_point in together}) == len(IDS)
    assert any(by_point["norm"].verdict["flagged"] for by_point in together)
    assert not all(by_point["norm"].verdict["flagged"] for by_point in together)
    assert [len(by_point["rec"].signals) for by_point in together] == [3] * len(IDS)
    assert router.metrics()["totals"]["received"] == len(IDS) * len(NAMES) * 3
    assert router.live_requests() == ()


class Logged(Probe):
    """A user probe that logs its on_start and on_end calls in one shared list, and
    fails in ``on_start`` or ``on_end`` for the request named by ``fail_start`` /
    ``fail_end``."""

    probe_kind = "single_shot"
    log: list[tuple[str, str, str]] = []

    def __init__(self, *, fail_start: str | None = None, fail_end: str | None = None) -> None:
        self.fail_start, self.fail_end = fail_start, fail_end

    def on_start(self, ctx):
        Logged.log.append(("start", ctx.request_id, ctx.extraction_point.name))
        if ctx.request_id == self.fail_start:
            raise RuntimeError("no start")

    def on_activation(self, record):
        return None

    def on_end(self, ctx):
        Logged.log.append(("end", ctx.request_id, ctx.extraction_point.name))
        if ctx.request_id == self.fail_end:
            raise ValueError("no end")
        return ctx.request_id


def test_user_probes_start_and_end_request_by_request_with_their_failures_noted(
        make_router, calls):
    """Probes of a class that does not start or end together keep the order ending
    each request gives (request by request, point by point), and a probe whose
    on_start or on_end raised is noted as one by one notes it."""
    points = [point("u1", probe_type="logged", kind="single_shot",
                    probe_args={"fail_start": "b"}),
              point("lin", probe_type="linear_probe", kind="single_shot",
                    probe_args={"weight": WEIGHT, "bias": 0.0}),
              point("u2", probe_type="logged", kind="single_shot",
                    probe_args={"fail_end": "c"})]
    Logged.log.clear()
    router = make_router(probes={"logged": Logged})
    router.register_requests(_contexts(), points)
    _route(router, IDS, ["u1", "lin", "u2"])
    together = router.end_requests(IDS)
    assert calls["end"][-1] is not None
    mine = list(Logged.log)
    Logged.log.clear()
    alone = _one_by_one(make_router, points, {"logged": Logged})
    assert mine == Logged.log
    assert [entry[:2] for entry in mine if entry[0] == "end"] == [
        ("end", "a"), ("end", "a"), ("end", "b"), ("end", "c"), ("end", "c"),
        ("end", "d"), ("end", "d")]  # (b's u1 never started: no on_end)
    assert _views(together) == _views(alone)
    assert "on_start: RuntimeError: no start" in together[1]["u1"].error
    assert together[1]["u1"].verdict is None
    assert together[2]["u2"].error == "on_end: ValueError: no end"
    assert together[2]["u2"].stats.errors == 1 and together[0]["u2"].verdict == "a"
    assert together[2]["lin"].error is None and together[2]["lin"].verdict["count"] == 3


def test_a_start_many_that_raises_leaves_each_probe_to_its_own_on_start(
        make_router, monkeypatch, calls):
    def broken(cls, probes, contexts):
        raise RuntimeError("start_many broke")

    monkeypatch.setattr(LinearProbe, "start_many", classmethod(broken))
    monkeypatch.setattr(LinearProbe, "end_many", classmethod(
        lambda cls, probes, contexts: 1 / 0))
    together = _together_against_one_by_one(make_router, calls, [_points()[0]], [False])
    assert all(by_point["lin"].error is None for by_point in together)


def test_a_subclass_starts_and_ends_with_its_own_methods(make_router, calls):
    class Counting(LinearProbe):
        def on_start(self, ctx):
            super().on_start(ctx)
            self.extra_note = ctx.request_id

        def on_end(self, ctx):
            return {**super().on_end(ctx), "note": self.extra_note}

    lin = point("lin", probe_type="counting", kind="single_shot",
                probe_args={"weight": WEIGHT, "bias": 0.0})
    router = make_router(probes={"counting": Counting})
    router.register_requests(_contexts(), [lin])
    assert calls["start"] == [False]
    _route(router, IDS, ["lin"])
    assert [by_point["lin"].verdict["note"] for by_point in router.end_requests(IDS)] == IDS


def test_ending_waits_for_busy_or_locked_bindings_the_usual_way(make_router):
    """A binding that is busy, or whose lock another thread holds, is not ended
    together: nothing is changed, and ending each request then ends it."""
    router = make_router()
    router.register_requests(_contexts(), [_points()[0]])
    _route(router, IDS, ["lin"])
    columns = [[router._requests[rid].bindings["lin"] for rid in IDS]]
    busy = columns[0][2]
    busy.begin_call(1)
    assert Binding.end_idle_together(columns) is None
    assert not any(binding.finalised for binding in columns[0])
    busy.end_call()
    with held_elsewhere(columns[0][1]._mutex):
        assert Binding.end_idle_together(columns) is None
        assert not any(binding.finalised for binding in columns[0])
        assert not columns[0][0]._mutex._is_owned()  # (each lock taken was let go)
    ended = router.end_requests(IDS)
    assert [by_point["lin"].stats.received for by_point in ended] == [3] * len(IDS)


def test_requests_with_other_points_are_ended_each_on_its_own(make_router, calls):
    router = make_router()
    router.register_request("a", [_points()[0]])
    router.register_request("b", [_points()[2]])
    ended = router.end_requests(["a", "b"])
    assert calls["end"] == []
    assert [list(by_point) for by_point in ended] == [["lin"], ["norm"]]


def test_summary_verdicts_are_each_summarys_verdict():
    summaries = [ScoreSummary(0.5), ScoreSummary(None, extra={"statistic": "l2_norm"})]
    crossing = ScoreSummary(0.5)
    row = record("a", "p", 4, layer=2)
    for score in (0.1, 0.7, -0.3):
        crossing.add(score, row, score >= 0.5)
    scored = ScoreSummary(None)
    scored.add(None, row, False)
    scored.add(2.0, row, False)
    summaries += [crossing, scored]
    verdicts = summary_verdicts(summaries)
    assert verdicts == [summary.verdict() for summary in summaries]
    assert [list(v) for v in verdicts] == [list(s.verdict()) for s in summaries]
    assert verdicts[2]["first_crossing_token_index"] == 4 and verdicts[2]["flagged"]
    assert summary_verdicts([]) == []


def test_the_statistic_probes_start_together_with_their_extra_entry():
    probes = [NormProbe(threshold=1.0) for _ in IDS]
    contexts = [ctx.at_point(point("norm", probe_type="norm_probe", kind="single_shot"))
                for ctx in _contexts()]
    assert NormProbe.start_many(probes, contexts)
    oracle = NormProbe(threshold=1.0)
    oracle.on_start(contexts[0])
    assert all(vars(probe.summary) == vars(oracle.summary) for probe in probes)
    assert NormProbe.end_many(probes, contexts) == [oracle.on_end(contexts[0])] * len(IDS)


def _routed_and_ended(make_router, names=NAMES, signals_kept=False):
    """IDS registered together and request "z" alone, its linear probe of other
    weights (a group of its own, whose rows come first: the group of IDS then
    starts past row 0 of each routed batch); IDS's results."""
    router = make_router(probes={"recorder": Recorder})
    points = [p for p in _points() if p.name in names]
    router.register_requests(_contexts(), points)
    other = [dataclasses.replace(p, probe_args={**p.probe_args, "weight": [1.0] * 4})
             if p.name == "lin" else p for p in points]
    router.register_request("z", other)
    ids = ["z", *IDS]
    _route(router, ids, names)
    if signals_kept:  # (a second window: each binding keeps signals already)
        _route(router, ids, names)
    assert router.end_request("z")["lin"].stats.received == (6 if signals_kept else 3)
    return router.end_requests(IDS)


@pytest.mark.parametrize("signals_kept", [False, True])
def test_a_group_admitted_and_settled_together_counts_what_each_alone_counts(
        make_router, monkeypatch, signals_kept):
    """A group's bindings admitted and settled in one pass each
    (``Binding.admit_together``, ``Binding.finish_together``) hold what admitting
    and settling each one (``admit_inline``, ``finish_rows``) leaves."""
    names = ("lin", "norm", "mean")
    monkeypatch.setattr(Binding, "admit_together", staticmethod(lambda *args: False))
    monkeypatch.setattr(Binding, "finish_together", staticmethod(lambda *args: False))
    alone = _routed_and_ended(make_router, names, signals_kept)
    monkeypatch.undo()
    seen: list[bool] = []
    admit, finish = Binding.admit_together, Binding.finish_together
    monkeypatch.setattr(Binding, "admit_together", staticmethod(
        lambda *args: seen.append(admit(*args)) or seen[-1]))
    monkeypatch.setattr(Binding, "finish_together", staticmethod(
        lambda *args: seen.append(finish(*args)) or seen[-1]))
    together = _routed_and_ended(make_router, names, signals_kept)
    assert seen and all(seen)
    assert _views(together) == _views(alone)
    assert sum(len(by_point["norm"].signals) for by_point in together) == (
        len(IDS) * 3 * (2 if signals_kept else 1))


def test_a_busy_finalised_or_locked_binding_is_admitted_and_settled_on_its_own(make_router):
    router = make_router()
    router.register_requests(_contexts(), [_points()[0]])
    bindings = [router._requests[rid].bindings["lin"] for rid in IDS]
    counts = [2] * len(IDS)

    def state():
        return [(b.received, b.processed, b.busy, b._in_flight, b._unread) for b in bindings]

    before = state()
    bindings[1].begin_call(1)
    assert not Binding.admit_together(bindings, counts)
    bindings[1].end_call()
    assert state() == before
    assert Binding.admit_together(bindings, counts)
    assert [b.received for b in bindings] == counts and all(b.busy for b in bindings)
    admitted = state()
    bindings[3].finalise(0.0)
    spans = [(2 * i, 2 * i + 2) for i in range(len(IDS))]
    assert not Binding.finish_together(bindings, None, spans, None, 0.5, 0)
    assert state()[:3] == admitted[:3]
    with held_elsewhere(bindings[0]._mutex):
        assert not Binding.admit_together(bindings, counts)
        assert not Binding.finish_together(bindings[:3], None, spans[:3], None, 0.5, 0)
    assert state()[:3] == admitted[:3]
    assert Binding.finish_together(bindings[:3], None, spans[:3], None, 0.5, 0)
    assert [(b.processed, b.busy, b.latency_total, b.latency_max) for b in bindings[:3]] == [
        (2, False, 1.0, 0.5)] * 3


def _async_bindings(router, depth=6):
    later = point("later", probe_type="norm_probe", mode="async", queue_depth=depth)
    router.register_requests(_contexts(), [later])
    return [router._requests[rid].bindings["later"] for rid in IDS]


def _queue_state(bindings):
    return [(b.received, b.dropped, b._queued, b._scheduled,
             [(rows.batch, rows.start, rows.stop) for rows in b._queue]) for b in bindings]


def test_rows_queued_together_are_queued_as_each_binding_queues_them(make_router):
    """``Binding.enqueue_together`` leaves each async binding as ``enqueue_batch``
    of its rows does (counts, queue, scheduled), and hands over the bindings not
    scheduled yet; where a queue would drop, or a binding is closed, it does
    nothing."""
    batch = ActivationBatch.from_records([record(rid, "later", 0) for rid in IDS] * 2)
    starts, stops = [0, 2, 4, 6], [2, 4, 6, 8]
    alone, together = (_async_bindings(make_router(workers=1)) for _ in range(2))
    for bindings in (alone, together):  # (nobody takes the rows: no worker is woken)
        bindings[1]._scheduled = True
    handed_alone = [b for b, start, stop in zip(alone, starts, stops, strict=True)
                    if b.enqueue_batch(batch, start, stop)]
    handed = Binding.enqueue_together(together, batch, starts, stops)
    assert handed == [together[i] for i in (0, 2, 3)] and len(handed_alone) == 3
    assert _queue_state(together) == _queue_state(alone)
    before = _queue_state(together)
    assert Binding.enqueue_together(together, batch, [0, 0, 0, 0], [6, 1, 1, 1]) is None
    together[3].close()
    assert Binding.enqueue_together(together, batch, starts, stops) is None
    assert _queue_state(together) == before


def test_an_async_generation_routes_its_windows_queued_together(make_router, monkeypatch):
    """The async point's windows are queued together and the results equal the
    ones of queueing each binding on its own."""
    seen: list[object] = []
    original = Binding.enqueue_together

    def counted(*args):
        seen.append(result := original(*args))
        return result

    def routed(router):
        later = point("later", probe_type="trajectory_probe", mode="async", queue_depth=64,
                      probe_args={"alpha": 0.5})
        router.register_requests(_contexts(), [later])
        _route(router, IDS, ["later"])
        return router.end_requests(IDS)

    monkeypatch.setattr(Binding, "enqueue_together", staticmethod(lambda *args: None))
    alone = routed(make_router())
    monkeypatch.setattr(Binding, "enqueue_together", staticmethod(counted))
    together = routed(make_router())
    assert len(seen) == 3 and all(found is not None for found in seen)
    assert _views(together) == _views(alone)
    assert [by_point["later"].stats.processed for by_point in together] == [3] * len(IDS)


def _gated_call(make_router, monkeypatch, gate_name):
    """A router whose requests (``IDS``) have one async point ``slow`` whose probe
    waits on the event ``gate_name`` (cleared), and the tries to end requests
    together it makes: (how many requests, whether they were ended)."""
    from router_helpers import event

    tries: list[tuple[int, bool]] = []
    original = Router._end_together

    def counted(requests):
        tries.append((len(requests), (found := original(requests)) is not None))
        return found

    monkeypatch.setattr(Router, "_end_together", staticmethod(counted))
    gate = event(gate_name)
    gate.clear()
    router = make_router(probes={"recorder": Recorder})
    slow = point("slow", mode="async", queue_depth=16, probe_args={"gate": gate_name})
    router.register_requests(_contexts(), [slow])
    return tries, router, gate


def _end_in_thread(router):
    """``router.end_requests(IDS)`` started on another thread, and the list its
    results land in."""
    ended: list[list[dict]] = []
    ender = threading.Thread(target=lambda: ended.append(router.end_requests(IDS)))
    ender.start()
    return ender, ended


def test_requests_whose_async_work_is_still_running_end_as_each_in_turn_ends(
        make_router, monkeypatch):
    """Ending a call's requests while their async probes still work: each request
    waits for its own bindings in turn, and the ones left are ended together
    once they are all idle; every row is processed and counted."""
    tries, router, gate = _gated_call(make_router, monkeypatch, "end-together-gate")
    _route(router, IDS, ["slow"])
    ender, ended = _end_in_thread(router)
    try:
        assert wait_until(lambda: len(tries) >= 1)  # (the first try found work going on)
        assert tries[0][1] is False
    finally:
        gate.set()
        ender.join(60)
    (results,) = ended
    assert [by_point["slow"].stats.processed for by_point in results] == [3] * len(IDS)
    assert [by_point["slow"].verdict for by_point in results] == [{"seen": [0, 1, 2]}] * 4
    assert all(by_point["slow"].error is None for by_point in results)
    assert router.metrics()["totals"]["processed"] == 3 * len(IDS)


def test_requests_before_one_still_working_end_together_while_it_works(
        make_router, monkeypatch):
    """A call whose last request's async probe is still working: the requests
    before it, all idle, are ended together at once (not one by one), while
    the last one's probe is held; it is ended after, with every row counted."""
    tries, router, gate = _gated_call(make_router, monkeypatch, "idle-prefix-gate")
    route_rows(router, IDS[-1:], ["slow"], 0.3)  # (rows for the last request only)
    ender, ended = _end_in_thread(router)
    try:
        # The three idle requests end together while the last one's probe waits.
        assert wait_until(lambda: (3, True) in tries)
        assert tries[:2] == [(4, False), (3, True)]
        assert not ended
    finally:
        gate.set()
        ender.join(60)
    (results,) = ended
    assert [by_point["slow"].request_id for by_point in results] == IDS
    assert [by_point["slow"].stats.processed for by_point in results] == [0, 0, 0, 3]
    assert [by_point["slow"].verdict for by_point in results] == [{"seen": []}] * 3 + [
        {"seen": [0, 1, 2]}]
    assert router.metrics()["totals"]["processed"] == 3


def test_capture_points_start_and_end_together_with_no_verdict(make_router, calls):
    together = _together_against_one_by_one(
        make_router, calls, [point("keep", probe_type="capture")], [True])
    assert [(r["keep"].verdict, r["keep"].stats.processed) for r in together] == [(None, 3)] * 4


@pytest.mark.parametrize("answer, problem", [
    (lambda verdicts: verdicts[:-1], "returned 3 verdicts for 4 probes"),
    (lambda verdicts: [*verdicts, "extra"], "returned 5 verdicts for 4 probes"),
    (lambda verdicts: 42, "returned int: TypeError"),
    # (a dict of the right length was read as its keys: every verdict a request id)
    (lambda verdicts: dict(zip(IDS, verdicts, strict=True)), "returned dict: TypeError"),
], ids=["one short", "one over", "not a sequence", "a mapping"])
def test_an_end_many_with_a_verdict_per_probe_wrong_leaves_each_to_its_on_end_and_says_so(
        make_router, monkeypatch, calls, answer, problem):
    own = LinearProbe.end_many.__func__

    monkeypatch.setattr(LinearProbe, "end_many", classmethod(
        lambda cls, probes, contexts: answer(own(cls, probes, contexts))))
    points = [_points()[0]]
    router = make_router()
    router.register_requests(_contexts(), points)
    _route(router, IDS, ["lin"])
    together = router.end_requests(IDS)
    assert calls["end"][-1] is not None
    alone = _one_by_one(make_router, points)
    assert [r["lin"].verdict for r in together] == [r["lin"].verdict for r in alone]
    assert all(r["lin"].verdict["count"] == 3 for r in together)
    for by_point in together:
        result = by_point["lin"]
        assert result.stats.errors == 1
        assert result.stats.received == result.stats.processed == 3
        assert result.error.startswith(
            f"end_many: LinearProbe.end_many at point 'lin' {problem}")
        assert "it must return one verdict per probe (on_end gave each)" in result.error
