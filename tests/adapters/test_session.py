"""Backend-neutral bookkeeping: window matching agrees with ExtractionPoint.matches
token by token, points retire once they can match nothing more, records and
aborts. No torch needed."""

from __future__ import annotations

import contextlib
import itertools

import pytest

from undercurrent.adapters.outputs import AbortInfo
from undercurrent.adapters.session import CaptureSession, RequestState, StepPlan
from undercurrent.records import BatchSignals, ProbeSignal, SignalAction
from undercurrent.spec.types import ExtractionPoint

POSITIONS = ["0", "3", "9", "prompt[0]", "prompt[-1]", "prompt[-3]", "prompt[2]+3",
             "prompt[-1]+1", "prompt[-2]-1", "generated[0]", "generated[2]", "generated[1]-2",
             "generated[*]", "generated[2:]", "generated[1:5]", "generated[0:1]"]


def point(position, stride=1, name="p"):
    continuous = "*" in position or ":" in position
    return ExtractionPoint(name=name, layers=(0, 2), tensor_type="mlp_out", position=position,
                           stride=stride if continuous else 1, probe_type="none",
                           probe_kind="trajectory" if continuous else "single_shot")


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("prompt_len", [1, 4])
def test_window_matching_equals_matches_token_by_token(position, stride, prompt_len):
    p = point(position, stride)
    total = prompt_len + 9
    expected = [t for t in range(total) if p.matches(
        t, t >= prompt_len, prompt_len, t - prompt_len if t >= prompt_len else None)]
    # the prefill window, then one token at a time, as a backend feeds them
    state = RequestState("r", "x", list(range(prompt_len)), [p])
    found = [t for t, _ in state.matches_in_window(0, prompt_len)]
    for t in range(prompt_len, total):
        found += [i for i, _ in state.matches_in_window(t, t + 1)]
    assert found == expected
    # uneven chunks (chunked prefill, speculative steps) give the same tokens
    state = RequestState("r", "x", list(range(prompt_len)), [p])
    found, start = [], 0
    for size in itertools.cycle([3, 1, 2]):
        if start >= total:
            break
        found += [i for i, _ in state.matches_in_window(start, min(total, start + size))]
        start += size
    assert found == expected
    # every token alone, the prompt's too (one-token windows take their own path)
    state = RequestState("r", "x", list(range(prompt_len)), [p])
    assert [i for t in range(total) for i, _ in state.matches_in_window(t, t + 1)] == expected


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("prompt_len", [1, 4])
def test_no_token_before_quiet_until_is_matched_or_edited(position, stride, prompt_len):
    # quiet_until is a lower bound on the tokens a request's points match and
    # its edits apply to, exact where the first one matches its first token;
    # a request with nothing left is quiet for good.
    from undercurrent.adapters.session import NEVER
    from undercurrent.spec.types import Edit
    from undercurrent.steering.vectors import resolve_edits

    total = prompt_len + 9
    p = point(position, stride)
    expected = [t for t in range(total) if p.matches(
        t, t >= prompt_len, prompt_len, t - prompt_len if t >= prompt_len else None)]
    state = RequestState("r", "x", list(range(prompt_len)), [p])
    assert all(t >= state.quiet_until for t in expected)
    if expected and (stride == 1 or ":" not in position and "*" not in position):
        assert expected[0] == state.quiet_until
    quiet = state.quiet_until
    state.matches_in_window(0, total)  # (a point retires past its last token)
    assert (state.quiet_until == NEVER) == state.exhausted
    # An edit brings the bound forward to its first token where that is sooner.
    for start in (8, 1):
        edit = Edit(name="e", layers=(0,), tensor_type="residual_stream",
                    position=f"generated[{start}:]", op="add", vector=(1.0, 0.0))
        edited = RequestState("r", "x", list(range(prompt_len)), [p],
                              edits=resolve_edits([edit], hidden_size=2))
        assert edited.quiet_until == min(quiet, prompt_len + start)


def test_quiet_steps_are_the_least_gap_and_stop_at_the_first_request_due():
    from undercurrent.adapters.session import NEVER, quiet_steps

    asked: list[str] = []

    class Quiet:  # (a request's quiet_until, counting the requests asked)
        def __init__(self, name: str, until: int) -> None:
            self.name, self.until = name, until

        @property
        def quiet_until(self) -> int:
            asked.append(self.name)
            return self.until

    far, near, due = Quiet("far", 30), Quiet("near", 12), Quiet("due", 9)
    assert quiet_steps([(far, 10), (near, 10)]) == 2 and asked == ["far", "near"]
    asked.clear()
    # (one due: nothing quiet, and no request after it asked)
    assert quiet_steps([(far, 10), (due, 10), (near, 10)]) == 0 and asked == ["far", "due"]
    assert quiet_steps([(Quiet("done", NEVER), 10)]) == NEVER - 10
    assert quiet_steps([]) == NEVER


def test_points_retire_once_they_cannot_match():
    state = RequestState("r", "x", [1, 2, 3], [point("prompt[-1]", name="a"),
                                               point("generated[0:2]", name="b"),
                                               point("generated[*]", name="c")])
    state.matches_in_window(0, 3)
    assert {p.name for p in state._live_points} == {"b", "c"}
    state.matches_in_window(3, 4)
    state.matches_in_window(4, 5)
    assert {p.name for p in state._live_points} == {"c"}


class _Router:
    def __init__(self, abort_at):
        self.abort_at, self.routed, self.ended = abort_at, [], []

    def register_request(self, request_id, points, ctx=None):
        self.ctx = ctx

    def route_columns(self, batch, spans=None):  # what CaptureSession calls
        return BatchSignals.from_signals([self.route(record) for record in batch.records()])

    def route(self, record):
        self.routed.append((record.token_index, record.layer))
        if record.token_index == self.abort_at:
            return ProbeSignal(action=SignalAction.ABORT, score=1.0)
        return ProbeSignal(score=0.0)

    def end_request(self, request_id):
        self.ended.append(request_id)
        return {}


def test_deliver_routes_in_token_then_layer_order_and_stops_after_the_aborting_token():
    router = _Router(abort_at=4)
    session = CaptureSession(router, [point("generated[*]")], keep_records=True)
    state = session.open_request("r", "x", [7, 8, 9])
    assert router.ctx.prompt_len == 3 and router.ctx.prompt_token_ids == (7, 8, 9)
    state.generated += [10, 11, 12]
    plan = StepPlan()
    plan.add_window(state, 3, 6, lambda t: (0, t))
    # hooks fire layer by layer; deliver re-sorts by token then layer
    batches = [(tensor_type, group.targets, [f"row{i}" for i in range(len(group.slots))])
               for (_, tensor_type), group in sorted(plan.groups.items(),
                                                     key=lambda item: -item[0][0])]
    session.deliver(batches)
    # the aborting token still reaches every point and layer; nothing after it does
    assert router.routed == [(3, 0), (3, 2), (4, 0), (4, 2)]
    assert state.abort.token_index == 4 and state.abort.generated_index == 1
    assert not state.live and [r.token_id for r in state.records] == [10, 10, 11, 11]
    out = session.close_request("r", "text")
    assert out.aborted and out.finish_reason == "abort" and router.ended == ["r"]


def _layered_point(name, position, tensor_type, layers=(0, 1, 2), **extra):
    continuous = "*" in position or ":" in position
    return ExtractionPoint(name=name, layers=layers, tensor_type=tensor_type, position=position,
                           probe_kind="trajectory" if continuous else "single_shot", **extra)


class _BatchRouter:
    """Records every route_columns call, and whether it came inside step()."""

    def __init__(self):
        self.calls, self.steps, self.in_step = [], 0, False

    def register_request(self, request_id, points, ctx=None):
        pass

    @contextlib.contextmanager
    def step(self):
        self.steps += 1
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def route_columns(self, batch, spans=None):
        self.calls.append((self.in_step, batch, spans))
        return BatchSignals.none(len(batch))

    def end_request(self, request_id):
        return {}


def test_one_decode_forward_routes_one_batch_per_point_grouped_by_request_in_layer_order():
    router = _BatchRouter()
    points = [_layered_point("m", "generated[*]", "mlp_out", probe_type="none"),
              _layered_point("s", "generated[*]", "residual_stream", probe_type="none")]
    session = CaptureSession(router, points, keep_records=True)
    first = session.open_request("r1", "x", [1, 2, 3])
    second = session.open_request("r2", "y", [4, 5])
    first.generated.append(10)
    second.generated.append(20)
    plan = StepPlan()
    plan.add_window(first, 3, 4, lambda t: ("r1", t))  # decode: one token per request
    plan.add_window(second, 2, 3, lambda t: ("r2", t))
    # hooks fire from the last layer to the first here; each row names what it holds
    batches = [(tensor_type, group.targets,
                [f"{tensor_type.value}/{layer}/{slot[0]}" for slot in group.slots])
               for (layer, tensor_type), group in sorted(plan.groups.items(),
                                                         key=lambda item: -item[0][0])]
    session.deliver(batches)
    assert router.steps == 1
    assert len(router.calls) == 2  # one batch per point, across both requests
    routed = set()
    for in_step, batch, spans in router.calls:
        assert in_step  # the whole forward is delivered inside one router.step()
        records = batch.records()
        name = records[0].extraction_point_name
        assert all(r.extraction_point_name == name for r in records)
        assert spans == [("r1", 0, 3), ("r2", 3, 6)]
        assert [r.request_id for r in records] == ["r1"] * 3 + ["r2"] * 3
        assert [r.layer for r in records] == [0, 1, 2, 0, 1, 2]
        kind = "mlp_out" if name == "m" else "residual_stream"
        assert batch.tensor_type == kind and all(r.tensor_type == kind for r in records)
        assert [r.tensor for r in records] == [f"{kind}/{layer}/{request_id}"
                                               for request_id in ("r1", "r2")
                                               for layer in (0, 1, 2)]
        for request_id, start, stop in spans:
            token = 3 if request_id == "r1" else 2
            assert {(r.token_index, r.generated_index, r.token_id)
                    for r in records[start:stop]} == {
                (token, 0, 10 if request_id == "r1" else 20)}
        routed.add(name)
    assert routed == {"m", "s"}
    for state, token in ((first, 3), (second, 2)):
        kept = [(r.token_index, r.layer) for r in state.records]
        assert kept == [(token, 0), (token, 0), (token, 1), (token, 1), (token, 2), (token, 2)]
        assert {r.request_id for r in state.records} == {state.request_id}


def test_a_shifted_plan_repeats_the_groups_and_matches_one_token_later():
    points = [_layered_point("m", "generated[*]", "mlp_out", probe_type="none"),
              _layered_point("s", "generated[1:]", "residual_stream", probe_type="none")]
    session = CaptureSession(None, points)
    state = session.open_request("r1", "x", [1, 2, 3])
    assert state.steady_from == 4  # generated[1:] selects every token from index 4
    state.generated.extend([10, 11])
    plan = StepPlan()
    plan.add_window(state, 4, 5, lambda t: ("r1", 0))
    later = plan.shifted(1).shifted(2)
    assert later.base is plan and later.delta == 3
    assert set(later.groups) == set(plan.groups)
    for key, group in plan.groups.items():
        assert later.groups[key].slots is group.slots and later.groups[key].plan is later
    assert [(m.point.name, m.token_index, m.layers, m.rows, m.seq) for m in later.matches] == [
        (m.point.name, m.token_index + 3, m.layers, m.rows, m.seq) for m in plan.matches]
    with pytest.raises(ValueError, match="shifted step plan is complete"):
        later.add_window(state, 8, 9, lambda t: ("r1", 0))


def test_an_advanced_plan_is_moved_on_only_once_delivered():
    """``advanced``: a base plan, or a shifted one still read (not delivered),
    gives a new shifted plan; a delivered one is moved on itself, its groups
    serving it again, with what ``shifted`` from the base gives at that delta."""
    session = CaptureSession(None, [_layered_point("m", "generated[*]", "mlp_out",
                                                   probe_type="none")])
    state = session.open_request("r1", "x", [1, 2, 3])
    state.generated.extend([10, 11])
    base = StepPlan()
    base.add_window(state, 4, 5, lambda t: ("r1", 0))
    first = base.advanced(1)
    assert first is not base and first.base is base and first.delta == 1
    assert [m.token_index for m in first.matches] == [m.token_index + 1 for m in base.matches]
    assert first.advanced(1) is not first  # not delivered: its groups still read it
    first.delivered()
    groups = list(first.groups.values())
    assert first.advanced(2) is first and first.delta == 3
    assert list(first.groups.values()) == groups and all(g.plan is first for g in groups)
    again = base.shifted(3)
    assert [(m.point.name, m.token_index, m.layers, m.rows, m.seq) for m in first.matches] == [
        (m.point.name, m.token_index, m.layers, m.rows, m.seq) for m in again.matches]
    assert [m.token_index for m in first.matches] == [m.token_index + 3 for m in base.matches]


def test_steady_from_is_none_for_a_point_that_picks_one_token():
    for position in ("prompt[-1]", "generated[0]", "prompt[-1]+1"):
        state = RequestState("r", "x", [1, 2], [point(position), point("generated[*]")])
        assert state.steady_from is None, position
    assert RequestState("r", "x", [1, 2], [point("generated[*]")]).steady_from == 2
    assert RequestState("r", "x", [1, 2], []).steady_from == 0


def test_a_slice_is_steady_until_it_ends_and_the_points_left_from_then_on():
    """A bounded slice is steady from its first token up to its end
    (``steady_until``, exclusive); once it retires, the points left give the
    pattern from then on."""
    state = RequestState("r", "x", [1, 2], [point("generated[1:5]")])
    assert (state.steady_from, state.steady_stride, state.steady_until) == (3, 1, 7)
    state = RequestState("r", "x", [1, 2], [point("generated[1:6]", 2)])
    assert (state.steady_from, state.steady_stride, state.steady_until) == (3, 2, 8)
    state = RequestState("r", "x", [1, 2], [point("generated[9:10]", 3)])
    assert (state.steady_from, state.steady_until) == (11, 12)
    both = RequestState("r", "x", [1, 2], [point("generated[0:3]", name="slice"),
                                           point("generated[*]", name="all")])
    assert (both.steady_from, both.steady_until) == (2, 5)
    for token in range(2, 4):  # (the slice's tokens: both match)
        assert len(both.matches_in_window(token, token + 1)) == 2
        assert both.steady_from == 2  # (nothing retired yet)
    assert len(both.matches_in_window(4, 5)) == 2
    # its last token planned, the slice retired: the point left is steady from
    # the next token, for good
    assert (both.steady_from, both.steady_stride, both.steady_until) == (5, 1, None)
    assert [p.name for _, p in both.matches_in_window(5, 6)] == ["all"]


def test_strided_points_are_steady_when_one_stride_and_one_phase_hold_for_all():
    """From ``steady_from`` on, every ``steady_stride`` th token matches every
    point and the tokens between match none; points of different strides, or
    of one stride out of phase, are not steady."""
    def steady(*points: ExtractionPoint) -> tuple[int | None, int]:
        state = RequestState("r", "x", [1, 2, 3], list(points))
        return state.steady_from, state.steady_stride

    assert steady(point("generated[*]", 2)) == (3, 2)
    assert steady(point("generated[1:]", 3)) == (4, 3)
    # generated[1:] and generated[3:] at stride 2 match generated 3, 5, 7...
    assert steady(point("generated[1:]", 2), point("generated[3:]", 2)) == (6, 2)
    assert steady(point("generated[*]", 2), point("generated[1:]", 2)) == (None, 1)  # (phases)
    assert steady(point("generated[*]", 2), point("generated[*]", 3)) == (None, 1)
    # every token matched as the pattern says, from steady_from on, for good
    for positions in (("generated[1:]", "generated[3:]"), ("generated[2:]", "generated[*]")):
        points = [point(position, 2, name=position) for position in positions]
        state = RequestState("r", "x", [1, 2, 3], points)
        first, stride = state.steady_from, state.steady_stride
        for token in range(first, first + 12):
            found = {p.name for _, p in state.matches_in_window(token, token + 1)}
            expected = {p.name for p in points} if (token - first) % stride == 0 else set()
            assert found == expected, (positions, token)


def test_an_inline_abort_at_one_prefill_token_stops_the_later_tokens_records_being_routed():
    np = pytest.importorskip("numpy")
    from undercurrent.router import Router

    points = [_layered_point("first", "prompt[0]", "mlp_out", layers=(0, 1),
                             probe_type="norm_probe",
                             probe_args={"threshold": 0.0, "action": "abort"}),
              _layered_point("last", "prompt[-1]", "mlp_out", layers=(0, 1),
                             probe_type="norm_probe")]
    with Router() as router:
        session = CaptureSession(router, points, keep_records=True)
        state = session.open_request("r", "a b c d", [7, 8, 9, 6])
        plan = StepPlan()
        plan.add_window(state, 0, 4, lambda t: t)  # prefill: both tokens in one forward
        assert sorted({t.token_index for g in plan.groups.values() for t in g.targets}) == [0, 3]
        batches = [(tensor_type, group.targets,
                    [np.full(4, 1.0 + slot, dtype=np.float32) for slot in group.slots])
                   for (_, tensor_type), group in sorted(plan.groups.items(),
                                                         key=lambda item: -item[0][0])]
        session.deliver(batches)
        assert state.abort is not None and state.abort.token_index == 0
        assert (state.abort.extraction_point_name, state.abort.layer) == ("first", 0)
        assert not state.live and state.finish_reason == "abort"
        assert [(r.token_index, r.layer) for r in state.records] == [(0, 0), (0, 1)]
        assert [(s.token_index, s.layer) for s in state.signals] == [(0, 0), (0, 1)]
        out = session.close_request("r", "")
    first, last = out.results["first"], out.results["last"]
    assert (first.stats.received, first.stats.processed) == (2, 2)
    assert [s.action for s in first.signals] == [SignalAction.ABORT, SignalAction.ABORT]
    assert first.signals[0].score == pytest.approx(2.0)  # |(1, 1, 1, 1)| at slot 0
    assert last.stats.received == 0  # token 3 was never routed
    assert last.verdict["count"] == 0


class _ManyRouter(_BatchRouter):
    """Registers requests one at a time or several at once, and says which."""

    def __init__(self):
        super().__init__()
        self.registered: list[tuple[str, ...]] = []

    def register_request(self, request_id, points, ctx=None):
        self.registered.append((request_id,))

    def register_requests(self, contexts, points):
        self.registered.append(tuple(ctx.request_id for ctx in contexts))
        self.contexts = list(contexts)


def test_requests_opened_together_are_registered_in_one_call():
    """``open_requests``: one ``register_requests`` call for the session's points,
    the states and contexts those of opening each request; a router without it
    registers them one at a time."""
    requests = [("a", "x", [7, 8]), ("b", "yy", [1, 2, 3])]
    router = _ManyRouter()
    session = CaptureSession(router, [point("generated[*]")])
    states = session.open_requests(requests)
    assert router.registered == [("a", "b")] and session.registered == {"a", "b"}
    assert [s.request_id for s in states] == ["a", "b"] and session.requests["b"] is states[1]
    assert [(c.prompt, c.prompt_len, c.prompt_token_ids) for c in router.contexts] == [
        ("x", 2, (7, 8)), ("yy", 3, (1, 2, 3))]
    assert router.contexts == [session._context(state) for state in states]
    alone = CaptureSession(router, [point("generated[*]")])
    expected = [alone.open_request(*request) for request in requests]
    assert [(s.prompt_token_ids, s.points, s.steady_from) for s in states] == [
        (s.prompt_token_ids, s.points, s.steady_from) for s in expected]
    plain = CaptureSession(_BatchRouter(), [point("generated[*]")])
    assert [s.request_id for s in plain.open_requests(requests)] == ["a", "b"]
    assert plain.registered == {"a", "b"}


def test_requests_opened_together_refuse_an_id_given_twice_and_register_none():
    router = _ManyRouter()
    session = CaptureSession(router, [point("generated[*]")])
    session.open_request("a", "x", [1])
    for ids in (["b", "a"], ["c", "c"]):
        with pytest.raises(ValueError, match="is already open in this generation"):
            session.open_requests([(rid, "x", [1]) for rid in ids])
    assert router.registered == [("a",)] and set(session.requests) == {"a"}


def _closing_run(together: bool, router_class=None):
    """Three requests on a real router with an inline norm probe, each routed
    rows of its own, then closed together or one at a time: the outputs and the
    results ``on_result`` saw."""
    import numpy as np

    from undercurrent.records import ActivationBatch, ActivationRecord
    from undercurrent.router import Router

    seen = []
    router = (router_class or Router)()
    norm = ExtractionPoint(name="n", layers=(0,), tensor_type="mlp_out",
                           position="generated[*]", probe_type="norm_probe",
                           probe_kind="trajectory", probe_args={"threshold": 2.5})
    session = CaptureSession(router, [norm], on_result=seen.append)
    ids = ["a", "b", "c"]
    session.open_requests([(rid, "x", [1, 2]) for rid in ids])
    for token in range(3):
        records = [ActivationRecord(request_id=rid, extraction_point_name="n", layer=0,
                                    tensor_type="mlp_out", token_index=2 + token,
                                    is_generated=True, generated_index=token, token_id=5,
                                    tensor=np.full(4, 0.5 * (row + token + 1), np.float32))
                   for row, rid in enumerate(ids)]
        router.route_columns(ActivationBatch.from_records(records),
                             [(rid, row, row + 1) for row, rid in enumerate(ids)])
    closing = [("b", "tb", "eos"), ("a", "ta", None), ("c", "tc", "stop")]
    if together:
        outputs = session.close_requests(closing)
    else:
        outputs = [session.close_request(*item) for item in closing]
    router.shutdown()
    return outputs, seen, session


def _output_view(output):
    return (output.request_id, output.text, output.finish_reason, output.prompt_token_ids,
            {name: (result.verdict, result.stats.received, result.stats.processed,
                    [(s.action, s.score) for s in result.signals])
             for name, result in output.results.items()})


def test_requests_closed_together_give_the_outputs_of_closing_each():
    """``close_requests``: the outputs (in the order given) and the ``on_result``
    calls are those of closing each request in turn."""
    mine, mine_seen, session = _closing_run(True)
    theirs, theirs_seen, _ = _closing_run(False)
    assert [_output_view(o) for o in mine] == [_output_view(o) for o in theirs]
    assert [(o.request_id, o.finish_reason) for o in mine] == [
        ("b", "eos"), ("a", "length"), ("c", "stop")]
    assert [(r.request_id, r.verdict) for r in mine_seen] == [
        (r.request_id, r.verdict) for r in theirs_seen]
    assert [r.request_id for r in mine_seen] == ["b", "a", "c"]
    # each request's own rows: the verdicts differ, and the threshold flagged some
    assert len({str(o.results["n"].verdict) for o in mine}) == 3
    assert any(o.results["n"].flagged for o in mine)
    assert session.registered == set() and session.closes == 3
    assert all(state.closed for state in session.requests.values())


def test_requests_closed_together_end_one_at_a_time_on_a_router_without_end_requests():
    from undercurrent.router import Router

    ended = []

    class OneAtATime(Router):
        end_requests = None  # type: ignore[assignment]

        def end_request(self, request_id, **kwargs):
            ended.append(request_id)
            return super().end_request(request_id, **kwargs)

    outputs, _, _ = _closing_run(True, OneAtATime)
    assert ended == ["b", "a", "c"]
    assert [_output_view(o) for o in outputs] == [
        _output_view(o) for o in _closing_run(False)[0]]


def _plan_view(plan):
    return ([(key, group.slots, group._slot_index) for key, group in plan.groups.items()],
            [(m.state.request_id, m.point.name, m.token_index, m.layers, m.rows, m.seq)
             for m in plan.matches])


@pytest.mark.parametrize("names", [("m",), ("m", "s")])
def test_steady_tokens_planned_at_once_give_the_plan_of_each_window(names):
    kinds = {"m": ("generated[*]", "mlp_out", (2, 0, 1)), "s": ("generated[1:]",
                                                             "residual_stream", (1, 3))}
    points = [_layered_point(name, kinds[name][0], kinds[name][1], layers=kinds[name][2],
                             probe_type="none") for name in names]
    session = CaptureSession(None, points)
    states = [session.open_request(f"r{i}", "x", [1] * (2 + i)) for i in range(3)]
    for state in states:
        state.generated.extend([7, 8])
    fed = [(state, state.prompt_len + 1, (row, 0)) for row, state in enumerate(states)]
    each, together = StepPlan(), StepPlan()
    for state, index, slot in fed:
        each.add_window(state, index, index + 1, lambda t, slot=slot: slot)
    assert together.add_steady_tokens(fed)
    assert _plan_view(together) == _plan_view(each)
    assert len(together.matches) == len(states) * len(points)


def test_a_layout_of_steady_tokens_planned_at_once_is_the_general_paths():
    """``_SteadyLayout.of`` reads a one-point plan made by ``add_steady_tokens``
    (``one_each``) without grouping its matches again: the same layout as the
    general path makes; a closed or aborted request leaves it to the general path."""
    import torch

    from undercurrent.adapters.delivery import _SteadyLayout

    point = _layered_point("m", "generated[*]", "mlp_out", layers=(2, 0, 1), probe_type="none")
    session = CaptureSession(None, [point])
    states = [session.open_request(f"r{i}", "x", [1] * (2 + i)) for i in range(3)]
    for state in states:
        state.generated.extend([7, 8])
    plan = StepPlan()
    assert plan.add_steady_tokens([(state, state.prompt_len + 1, (row, 0))
                                   for row, state in enumerate(states)])
    assert plan.one_each
    sources = {key: torch.zeros(len(states), 4) for key in plan.groups}
    fast = _SteadyLayout.of(plan, session, sources)
    plan.one_each = False
    general = _SteadyLayout.of(plan, session, sources)
    fields = ("name", "keys", "count", "states", "base_tokens", "known", "request_ids",
              "point_names", "layers", "spans", "routed_spans")
    assert fast is not None and general is not None and fast.states == general.states
    for mine, theirs in zip(fast.points, general.points, strict=True):
        for name in fields:
            assert getattr(mine, name) == getattr(theirs, name), name
        assert mine.tokens.tolist() == theirs.tokens.tolist()
        assert mine.generated.tolist() == theirs.generated.tolist()
    plan.one_each = True
    states[1].closed = True
    assert _SteadyLayout.of(plan, session, sources) is None  # (as the general path says)
    states[1].closed = False
    states[2].abort = AbortInfo(extraction_point_name="m", layer=0, token_index=3,
                                generated_index=0, signal=ProbeSignal(score=1.0))
    assert _SteadyLayout.of(plan, session, sources) is None
    plan.add_window(states[0], 2, 3, lambda t: (0, 1))
    assert not plan.one_each  # (a plan added to is no longer one match per request)


def test_steady_tokens_are_refused_where_each_request_must_be_planned():
    shared = [_layered_point("m", "generated[*]", "mlp_out", probe_type="none"),
              _layered_point("n", "generated[*]", "mlp_out", layers=(2, 5), probe_type="none")]
    session = CaptureSession(None, shared)  # two points share (2, mlp_out)
    state = session.open_request("r", "x", [1, 2])
    state.generated.append(7)
    assert not StepPlan().add_steady_tokens([(state, 2, (0, 0))])
    session = CaptureSession(None, [_layered_point("m", "generated[2:]", "mlp_out",
                                                   probe_type="none")])
    early = session.open_request("r", "x", [1, 2])
    early.generated.append(7)
    assert not StepPlan().add_steady_tokens([(early, 2, (0, 0))])  # before steady_from
    late = session.open_request("q", "x", [1, 2])
    twice = [(late, 4, (0, 0)), (late, 4, (0, 0))]  # one slot given twice
    assert not StepPlan().add_steady_tokens(twice)
    plan = StepPlan()
    plan.add_window(late, 4, 5, lambda t: (1, 0))
    assert not plan.add_steady_tokens([(late, 5, (0, 0))])  # not a fresh plan
    other = CaptureSession(None, [_layered_point("m", "generated[*]", "mlp_out",
                                                 probe_type="none")])
    stranger = other.open_request("s", "x", [1, 2])
    assert not StepPlan().add_steady_tokens([(late, 4, (0, 0)), (stranger, 4, (1, 0))])
    ended, going = (other.open_request(name, "x", [1, 2]) for name in ("e", "g"))
    assert StepPlan().add_steady_tokens([(ended, 4, (0, 0)), (going, 4, (1, 0))])
    ended.closed = True  # a closed request, or an aborted one, is planned on its own
    assert not StepPlan().add_steady_tokens([(ended, 4, (0, 0)), (going, 4, (1, 0))])
    ended.closed = False
    ended.abort = AbortInfo(extraction_point_name="m", layer=0, token_index=3,
                            generated_index=1, signal=ProbeSignal(score=1.0))
    assert not StepPlan().add_steady_tokens([(ended, 4, (0, 0)), (going, 4, (1, 0))])


def test_wanted_pairs_of_requests_sharing_points_are_each_requests_pairs():
    points = [_layered_point("m", "generated[*]", "mlp_out", probe_type="none"),
              _layered_point("p", "prompt[0]", "residual_stream", layers=(3,),
                             probe_type="none")]
    session = CaptureSession(None, points)
    states = [session.open_request(f"r{i}", "x", [1, 2, 3]) for i in range(3)]
    union = set().union(*(state.wanted_pairs() for state in states))
    assert session.wanted_pairs() == union
    # The prompt point retires in one request only: the others still want its pair.
    states[0].matches_in_window(0, 3)
    assert states[0].wanted_pairs() != states[1].wanted_pairs()
    assert session.wanted_pairs() == union
    for state in states[1:]:
        state.matches_in_window(0, 3)
    assert session.wanted_pairs() == states[0].wanted_pairs() != union


def test_wanted_pairs_of_requests_of_different_points_are_each_requests_pairs():
    """Requests of two points tuples (one opened with its own) want the pairs of
    both; a finished request wants none."""
    mlp = _layered_point("m", "generated[*]", "mlp_out", probe_type="none")
    residual = _layered_point("r", "generated[*]", "residual_stream", layers=(1, 3),
                              probe_type="none")
    session = CaptureSession(None, [mlp])
    first = session.open_request("a", "x", [1, 2])
    second = session.open_request("b", "x", [1, 2], points=[residual])
    session.open_request("c", "x", [1, 2])
    assert session.wanted_pairs() == first.wanted_pairs() | second.wanted_pairs()
    assert second.wanted_pairs() == {(1, residual.tensor_type), (3, residual.tensor_type)}
    second.finish_reason = "length"
    assert session.wanted_pairs() == first.wanted_pairs()
    assert [state.request_id for state in session.live_requests()] == ["a", "c"]


def test_requests_closed_together_give_every_field_closing_each_gives():
    def views(outputs):
        found = []
        for output in outputs:
            fields = dict(vars(output))
            fields["results"] = {name: (result.verdict, result.stats.received,
                                        [(s.action, s.score) for s in result.signals])
                                 for name, result in fields["results"].items()}
            fields["signals"] = [(s.point, s.token_index, s.action, s.score)
                                 for s in fields["signals"]]
            found.append((list(vars(output)), fields))
        return found

    mine, _, session = _closing_run(True)
    theirs, _, _ = _closing_run(False)
    assert views(mine) == views(theirs)
    assert [type(output.signals).__name__ for output in mine] == ["LazySequence"] * 3


def _edited_session(point_specs, edit_specs, prompt_lengths):
    from undercurrent.spec.types import Edit
    from undercurrent.steering.vectors import resolve_edits

    points = [_layered_point(f"p{index}", position, tensor_type, layers=layers, stride=stride,
                             probe_type="none")
              for index, (position, tensor_type, layers, stride) in enumerate(point_specs)]
    edits = resolve_edits([Edit(name=f"e{index}", layers=layers, tensor_type=tensor_type,
                                position=position, stride=stride, op="add",
                                vector=[1.0, 0.0, 0.0, 0.0], coefficient=1.0)
                           for index, (position, tensor_type, layers, stride)
                           in enumerate(edit_specs)], hidden_size=4)
    session = CaptureSession(None, points, edits=edits)
    states = [session.open_request(f"r{i}", "x", [1] * length)
              for i, length in enumerate(prompt_lengths)]
    return session, states


def _edit_view(plan, states):
    return ([(key, [(entry.resolved.edit.name, entry.slots) for entry in entries.values()])
             for key, entries in plan.edits.items()],
            [(state.request_id, state.applied, state.edited_sites) for state in states])


_ALIKE_CASES = [
    # (points, edits, generated tokens before the step): points of several strides
    # with an edit on every token, an edit every third token from the second, edits
    # at two layers, no point at all, no edit, and steps where only some match.
    ([("generated[*]", "residual_stream", (0, 1), 1), ("generated[*]", "mlp_out", (2,), 2)],
     [("generated[*]", "residual_stream", (1,), 1)], 4),
    ([("generated[*]", "residual_stream", (0,), 1)],
     [("generated[1:]", "residual_stream", (2, 0), 3), ("generated[*]", "mlp_out", (1,), 1)], 4),
    ([("generated[*]", "residual_stream", (0,), 1)],
     [("generated[1:]", "residual_stream", (2, 0), 3)], 5),
    ([], [("generated[*]", "residual_stream", (1, 3), 1)], 2),
    ([("generated[*]", "mlp_out", (3,), 2)], [("generated[*]", "residual_stream", (0,), 2)], 4),
    ([("generated[*]", "residual_stream", (0, 1), 1), ("generated[1:]", "mlp_out", (2,), 3)],
     [], 4),
    ([("generated[*]", "mlp_out", (3,), 2)], [("generated[*]", "residual_stream", (0,), 2)], 3),
]


@pytest.mark.parametrize("points, edits, before", _ALIKE_CASES)
def test_alike_tokens_planned_at_once_give_the_plan_and_logs_of_each_window(points, edits,
                                                                            before):
    """``add_alike_tokens``: the groups, matches, edit slots (in order) and each
    request's log of applied edits that ``add_window`` of each request gives."""
    lengths = [2, 3, 5]
    mine, theirs = (_edited_session(points, edits, lengths) for _ in range(2))
    plans = []
    for (_, states), together in ((mine, True), (theirs, False)):
        for state in states:
            state.generated.extend([7] * (before + 1))
        fed = [(state, state.prompt_len + before, (row, 0)) for row, state in enumerate(states)]
        plan = StepPlan()
        if together:
            assert plan.add_alike_tokens(fed)
        else:
            for state, index, slot in fed:
                plan.add_window(state, index, index + 1, lambda t, slot=slot: slot)
        plans.append((plan, states))
    (plan, states), (oracle, oracle_states) = plans
    assert _plan_view(plan) == _plan_view(oracle)
    assert _edit_view(plan, states) == _edit_view(oracle, oracle_states)
    assert plan.one_each == oracle.one_each
    # (something planned, but at a token between the strides of the last case)
    assert bool(plan.edits or plan.groups) == (before != 3)


def test_alike_tokens_are_planned_each_alone_where_requests_differ():
    """Requests whose edits differ, a triggered edit, an edit that ends, a point
    that picks one token, or an aborted request: ``add_alike_tokens`` plans
    nothing and says so."""
    from dataclasses import replace

    every = [("generated[*]", "residual_stream", (1,), 1)]
    point = [("generated[*]", "residual_stream", (0,), 1)]

    def fed_of(states):
        for state in states:
            state.generated.extend([7, 7])
        return [(state, state.prompt_len + 1, (row, 0)) for row, state in enumerate(states)]

    _, states = _edited_session(point, [("generated[0:5]", "residual_stream", (1,), 1)], [2, 3])
    assert not StepPlan().add_alike_tokens(fed_of(states))  # (an edit that ends)
    _, states = _edited_session([("3", "residual_stream", (0,), 1)], every, [2, 3])
    assert not StepPlan().add_alike_tokens(fed_of(states))  # (a point of one token)
    _, states = _edited_session(point, every, [2, 3])
    states[1]._live_edits = [replace(states[1]._live_edits[0])]  # (another edit object)
    assert not StepPlan().add_alike_tokens(fed_of(states))
    _, states = _edited_session(point, every, [2, 3])
    trigger = replace(states[0]._live_edits[0].edit, when={"point": "p0", "action": "flag"})
    for state in states:
        state._live_edits = [replace(state._live_edits[0], edit=trigger)]
    assert not StepPlan().add_alike_tokens(fed_of(states))  # (a triggered edit)
    _, states = _edited_session(point, every, [2, 3])
    states[0].abort = AbortInfo(extraction_point_name="p0", layer=0, token_index=3,
                                generated_index=1, signal=ProbeSignal(score=1.0))
    plan = StepPlan()
    assert not plan.add_alike_tokens(fed_of(states))
    assert not plan.edits and not plan.groups and not states[1].applied
