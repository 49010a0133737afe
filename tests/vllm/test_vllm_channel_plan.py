"""The vLLM step path as columns, without an engine: the worker's plan of a step turned
into the wire's columns (``worker.match_columns``), pickled, rebuilt by the driver
(``channel.step_deliveries``) and delivered whole, against the oracle: the same
captures delivered as one ``CaptureTarget`` per vector (what the channel did before,
built here from the worker's plan) through the session's general path. Records,
signals, aborts and probe results (verdicts and accounting) must be the same."""

from __future__ import annotations

from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from undercurrent.adapters import delivery  # noqa: E402
from undercurrent.adapters.session import CaptureSession, CaptureTarget, StepPlan  # noqa: E402
from undercurrent.adapters.vllm import channel, wire  # noqa: E402
from undercurrent.adapters.vllm.channel import step_deliveries  # noqa: E402
from undercurrent.adapters.vllm.worker import MirrorState, match_columns  # noqa: E402
from undercurrent.router import Router  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, TensorType  # noqa: E402

HIDDEN = 6
WEIGHT = [0.5, -1.0, 0.25, 2.0, -0.75, 1.5]
TYPES = (TensorType.RESIDUAL_STREAM, TensorType.MLP_OUT)
PROMPT_LENS = {"uc1": 3, "uc2": 5, "uc3": 2}
DRIVER_IDS = {"uc1": "a", "uc2": "b"}  # uc3 is not tracked by the driver
ABORT_AT = ("uc2", 2)  # (engine id, generated index) whose layer-1 row makes the norm abort
# Each request has points of its own, so one match's rows differ from layer to layer
# (uc2's "lin" at layers 0, 2, 3 is in groups that hold different requests).
POINTS_OF = {"uc1": ("side", "guard", "first", "last_mlp"),
             "uc2": ("lin", "guard", "first", "last_mlp", "traj"),
             "uc3": ("lin", "side")}


def _points() -> list[ExtractionPoint]:
    def point(name, probe_type, layers, position, tensor_type="residual_stream", **extra):
        return ExtractionPoint(name=name, layers=layers, tensor_type=tensor_type,
                               position=position, probe_type=probe_type,
                               probe_kind="trajectory", **extra)

    return [
        # layers out of order: the wire and the plan keep them ascending
        point("lin", "linear_probe", (3, 0, 2), "generated[*]",
              probe_args={"weight": WEIGHT, "bias": 0.1, "threshold": 0.6, "action": "flag"}),
        point("side", "norm_probe", (3, 2), "generated[*]",
              probe_args={"threshold": 2.4, "action": "flag"}),
        point("guard", "norm_probe", (1,), "generated[*]",
              probe_args={"threshold": 40.0, "action": "abort"}),
        # prompt positions: a prefill serves several tokens of a request (waves)
        point("first", "capture", (1, 2), "prompt[0]"),
        point("last_mlp", "mean_probe", (2, 0), "prompt[-1]", tensor_type="mlp_out",
              probe_args={"threshold": 0.0, "action": "flag"}),
        point("traj", "trajectory_probe", (0, 1, 2, 3), "generated[1:]",
              execution_mode="async", queue_depth=1024,
              probe_args={"weight": WEIGHT, "bias": 0.0, "statistic": "ewma", "alpha": 0.5}),
    ]


def _simulate(points: list[ExtractionPoint], steps: int, seed: int,
              unreached: dict[int, tuple[int, TensorType]], *,
              driver_ids: dict[str, str] = DRIVER_IDS, repeat: bool = False,
              keep_records: bool = True, points_of: dict[str, tuple[str, ...]] = POINTS_OF,
              windows: bool = False) -> tuple[dict, dict, int]:
    """Both deliveries of the same generation; ``unreached[step]`` is a site the worker
    does not reach in that step (its rows are not sent). Returns each path's outputs
    and how many steps the new path delivered as a whole plan (with ``repeat``: as
    the server does, a step that repeats the last one a token later as its plan
    shifted; then how many steps were). ``keep_records``: the new path's."""
    repeats = channel._Repeat()
    rng = np.random.default_rng(seed)
    engine_ids = list(PROMPT_LENS)
    table = rng.normal(size=(len(engine_ids), 4, len(TYPES), 16, HIDDEN)).astype(np.float32)
    abort_row, abort_generated = engine_ids.index(ABORT_AT[0]), ABORT_AT[1]
    table[abort_row, 1, 0, PROMPT_LENS[ABORT_AT[0]] + abort_generated] *= 100.0
    worker_points = [wire.point_from_wire(wire.point_to_wire(p)) for p in points]
    by_name = {p.name: p for p in points}
    worker_by_name = {p.name: p for p in worker_points}
    mirrors = {eid: MirrorState(eid, PROMPT_LENS[eid],
                                [worker_by_name[name] for name in points_of[eid]])
               for eid in engine_ids}
    outputs = []
    whole = 0
    with Router(default_overflow="block", workers=1) as new_router, \
            Router(default_overflow="block", workers=1) as old_router:
        new = CaptureSession(new_router, points, keep_records=keep_records, windows=windows)
        old = CaptureSession(old_router, points, keep_records=True)
        sessions = {"new": new, "old": old}
        states: dict[str, dict[str, Any]] = {name: {} for name in sessions}
        for eid, request_id in driver_ids.items():
            prompt = [int(t) for t in rng.integers(3, 90, size=PROMPT_LENS[eid])]
            for name, session in sessions.items():
                states[name][eid] = session.open_request(
                    request_id, "", prompt, [by_name[n] for n in points_of[eid]])
        generated: dict[str, int] = dict.fromkeys(engine_ids, 0)
        fed = dict.fromkeys(engine_ids, 0)
        for step in range(steps):
            # -- the worker: plan, gather the rows of the sites it reaches, send
            plan = StepPlan()
            flat: list[tuple[int, int]] = []  # the step's token batch: (request, token)
            for row, eid in enumerate(engine_ids):
                mirror = mirrors[eid]
                if not mirror.live:
                    continue
                start, stop = fed[eid], mirror.prompt_len + generated[eid]
                base = len(flat)
                flat += [(row, token) for token in range(start, stop)]
                plan.add_window(mirror, start, stop, lambda t, b=base, s=start: b + t - s)
                fed[eid] = stop
            reached = [key for key in plan.groups if key != unreached.get(step)]
            groups, pieces, offset = [], [], 0
            for key in reached:
                layer, tensor_type = key
                slots = plan.groups[key].slots
                pieces.append(np.stack([table[flat[s][0], layer, TYPES.index(tensor_type),
                                              flat[s][1]] for s in slots]))
                groups.append(wire.GroupRows(layer, tensor_type.value, 0, offset, len(slots)))
                offset += len(slots)
            # float32 rows cross as numpy (the worker's bank for a dtype numpy has)
            batch = wire.StepBatch(step=step, groups=groups, banks=[np.concatenate(pieces)])
            batch.requests, batch.matches, batch.match_rows = match_columns(plan, reached)
            batch = wire.decode(wire.encode(batch))
            assert isinstance(batch, wire.StepBatch)
            # -- the driver, new: the plan rebuilt from the columns, delivered whole
            known = [states["new"].get(eid) for eid in batch.requests]
            if repeat:
                deliveries = repeats.deliveries(batch, known)
                whole += deliveries[0][1].plan.base is not None
            else:
                deliveries = step_deliveries(batch, known)
                whole += delivery._whole_plan(deliveries) is not None
            new.deliver(deliveries)
            # -- the oracle: one CaptureTarget per vector, from the worker's own plan
            targets = []
            for key, wire_group in zip(reached, batch.groups, strict=True):
                targets.append((key[1], [
                    CaptureTarget(states["old"][t.state.request_id], by_name[t.point.name],
                                  t.layer, t.token_index, t.slot_index)
                    for t in plan.groups[key].targets if t.state.request_id in driver_ids],
                    batch.rows(wire_group)))
            old.deliver(targets)
            # -- aborts reach the worker; the engine samples one token per live request
            for eid in driver_ids:
                assert states["new"][eid].aborted == states["old"][eid].aborted
                if states["new"][eid].aborted:
                    mirrors[eid].finish_reason = "abort"
            for row, eid in enumerate(engine_ids):
                if mirrors[eid].live:
                    for name, session in sessions.items():
                        if eid in driver_ids:
                            session.add_token(states[name][eid], 50 + 7 * row + step)
                    generated[eid] += 1
        for session in sessions.values():
            outputs.append({eid: session.close_request(driver_ids[eid], "")
                            for eid in driver_ids})
    return outputs[0], outputs[1], whole


def _result_view(result: Any) -> Any:
    stats = result.stats
    signals = [(s.action, s.score, s.layer, s.token_index, s.generated_index)
               for s in result.signals]
    return (result.verdict, signals, (stats.received, stats.processed, stats.dropped,
                                      stats.errors, stats.timeouts), result.error)


@pytest.mark.parametrize(("seed", "unreached"), [
    (0, {}),
    (1, {}),
    # a site not reached in a decode step and in the prefill: its rows are left out
    (2, {3: (2, TensorType.RESIDUAL_STREAM), 0: (0, TensorType.MLP_OUT)}),
])
def test_columns_through_the_channel_deliver_what_capture_targets_deliver(seed, unreached):
    steps = 6
    got, expected, whole = _simulate(_points(), steps, seed, unreached)
    assert whole == steps  # every step took the planned path
    assert got["uc2"].abort is not None, "the test's abort did not happen"
    assert got["uc2"].abort.generated_index == ABORT_AT[1]
    for eid, out in got.items():
        want = expected[eid]
        assert (out.finish_reason, out.token_ids) == (want.finish_reason, want.token_ids)
        assert (out.abort is None) == (want.abort is None)
        if out.abort is not None:
            assert (out.abort.extraction_point_name, out.abort.layer, out.abort.token_index,
                    out.abort.generated_index, out.abort.signal.score) == (
                want.abort.extraction_point_name, want.abort.layer, want.abort.token_index,
                want.abort.generated_index, want.abort.signal.score)
        assert len(out.records) == len(want.records) > 0
        assert all(isinstance(record.tensor, torch.Tensor) for record in out.records)
        for mine, theirs in zip(out.records, want.records, strict=True):
            assert mine.key() + (mine.is_generated, mine.generated_index, mine.token_id) == (
                theirs.key() + (theirs.is_generated, theirs.generated_index, theirs.token_id))
            assert np.array_equal(np.asarray(mine.tensor), np.asarray(theirs.tensor))
        assert [(s.extraction_point_name, s.layer, s.token_index, s.generated_index,
                 s.signal.action, s.signal.score) for s in out.signals] == [
            (s.extraction_point_name, s.layer, s.token_index, s.generated_index,
             s.signal.action, s.signal.score) for s in want.signals]
        assert out.signals, "no inline signal was compared"
        assert sorted(out.results) == sorted(want.results) == sorted(POINTS_OF[eid])
        for name, result in out.results.items():
            assert _result_view(result) == _result_view(want.results[name]), name


@pytest.mark.parametrize("keep_records", [True, False])
def test_steps_that_repeat_the_last_a_token_later_deliver_what_planned_steps_deliver(
        keep_records, steady_deliveries):
    # Every request tracked, none steered: from the first decode step on, each step
    # repeats the last one a token later until uc2 aborts (then it is planned again).
    every = {"uc1": "a", "uc2": "b", "uc3": "c"}
    steps = 8
    got, _, repeated = _simulate(_points(), steps, 4, {}, driver_ids=every, repeat=True,
                                 keep_records=keep_records)
    want, _, planned = _simulate(_points(), steps, 4, {}, driver_ids=every)
    assert planned == steps and 0 < repeated < steps - 1
    # the repeats were delivered from the layout kept on the first (no match planned),
    # and so were some plans kept to be repeated, from their own step on
    assert 0 < repeated <= steady_deliveries.count <= steps
    assert got["uc2"].abort is not None and want["uc2"].abort is not None
    for eid, out in got.items():
        mine, theirs = out, want[eid]
        assert (mine.finish_reason, mine.token_ids) == (theirs.finish_reason, theirs.token_ids)
        assert (mine.abort is None) == (theirs.abort is None)
        if mine.abort is not None:
            assert (mine.abort.extraction_point_name, mine.abort.layer,
                    mine.abort.token_index) == (theirs.abort.extraction_point_name,
                                                theirs.abort.layer, theirs.abort.token_index)
        _assert_same_routing(mine, theirs, records=keep_records)


def _assert_same_routing(mine: Any, theirs: Any, *, records: bool = True) -> None:
    """The same records (keys, token ids, values; with ``records``), inline
    signals and probe results in two outputs of one request."""
    if records:
        assert [r.key() + (r.token_id,) for r in mine.records] == [
            r.key() + (r.token_id,) for r in theirs.records]
        for record, other in zip(mine.records, theirs.records, strict=True):
            assert np.array_equal(np.asarray(record.tensor), np.asarray(other.tensor))
    assert [(s.extraction_point_name, s.layer, s.token_index, s.signal.action,
             s.signal.score) for s in mine.signals] == [
        (s.extraction_point_name, s.layer, s.token_index, s.signal.action,
         s.signal.score) for s in theirs.signals]
    for name, result in mine.results.items():
        assert _result_view(result) == _result_view(theirs.results[name]), name


@pytest.mark.parametrize("windows", [False, True])
def test_a_cycle_of_layouts_repeats_each_plan_a_period_later(steady_deliveries, monkeypatch,
                                                             windows):
    """Points of several strides (``lin`` on every generated token, ``side`` on
    every second one): the driver's steps alternate between two layouts, and
    from the second turn of each on, each step is the plan of two steps
    before, shifted (a plan that alternates: each request handed its rows),
    with ``windows`` held in windows of both layouts' steps (as a generation
    does). Records, signals and results are those of every step planned from
    its columns, and those of one CaptureTarget per vector."""
    import dataclasses

    points = [dataclasses.replace(point, stride=2) if point.name == "side" else point
              for point in _points() if point.name in ("lin", "side", "first")]
    every = {"uc1": "a", "uc2": "b", "uc3": "c"}
    both = dict.fromkeys(every, ("lin", "side", "first"))  # (the prefill reads prompt[0])
    steps = 12
    plans: list[tuple[int, bool]] = []  # per step: the shift (None: planned), alternates
    deliveries = channel._Repeat.deliveries

    def seen(repeat: Any, batch: Any, table: Any) -> Any:
        made = deliveries(repeat, batch, table)
        plan = made[0][1].plan  # (read now: a repeat moves the plan itself on)
        plans.append((None if plan.base is None else plan.delta,
                      (plan.base or plan).alternates))
        return made

    held: list[int] = []
    route = delivery._Window.route

    def counted(window: Any, session: Any) -> None:
        held.append(len(window.steps))
        route(window, session)

    monkeypatch.setattr(delivery._Window, "route", counted)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(channel._Repeat, "deliveries", seen)
        got, expected, repeated = _simulate(points, steps, 5, {}, driver_ids=every,
                                            repeat=True, points_of=both, windows=windows)
    assert bool(held) == windows and (not windows or max(held) > 2)
    assert steady_deliveries.count >= repeated
    want, _, planned = _simulate(points, steps, 5, {}, driver_ids=every, points_of=both)
    assert planned == steps
    # (the prefill, the first decode step of each layout, each planned again to
    # alternate, then each step its layout's plan of two steps before)
    assert plans[:5] == [(None, False)] * 3 + [(None, True)] * 2
    assert plans[5:] == [(2 * (turn // 2 + 1), True) for turn in range(steps - 5)]
    assert repeated == steps - 5
    for outputs in (want, expected):
        for eid, out in got.items():
            theirs = outputs[eid]
            assert out.token_ids == theirs.token_ids
            _assert_same_routing(out, theirs)


def test_a_layer_count_the_driver_does_not_expect_is_refused_with_the_point_named():
    point = _points()[0]
    session = CaptureSession(None, [point])
    state = session.open_request("a", "", [1, 2, 3])
    groups = [wire.GroupRows(layer, "residual_stream", 0, index, 1)
              for index, layer in enumerate((0, 2, 3))]
    batch = wire.StepBatch(step=1, banks=[torch.zeros((3, HIDDEN))], requests=["uc1"],
                           groups=groups, matches=wire.match_array([(0, 0, 3, 2)]),
                           match_rows=wire.row_array([0, 0]))
    with pytest.raises(RuntimeError, match="2 rows for point 'lin'.*3 layers"):
        step_deliveries(batch, [state])
    batch.groups = groups[:2]
    batch.matches = wire.match_array([(0, 0, 3, 3)])
    batch.match_rows = wire.row_array([0, 0, 0])
    with pytest.raises(RuntimeError, match=r"point 'lin' but none at its layer\(s\) \[3\]"):
        step_deliveries(batch, [state])


def test_a_shifted_claim_is_taken_only_against_the_batch_just_before_it():
    # The worker says a batch repeats the last one a token later (StepBatch.shifted);
    # the driver takes it so only for the same request table as the batch it read
    # just before, and compares the columns of a batch that says nothing.
    point = _points()[0]
    session = CaptureSession(None, [point])
    state = session.open_request("a", "", [1, 2, 3])
    other = session.open_request("b", "", [1, 2, 3])

    def batch(token: int, shifted: bool) -> wire.StepBatch:
        groups = [wire.GroupRows(layer, "residual_stream", 0, index, 1)
                  for index, layer in enumerate((0, 2, 3))]
        return wire.StepBatch(step=token, banks=[torch.full((3, HIDDEN), float(token))],
                              requests=["uc1"], groups=groups,
                              matches=wire.match_array([(0, 0, token, 3)]),
                              match_rows=wire.row_array([0, 0, 0]), shifted=shifted)

    def delivered(deliveries: list[Any]) -> tuple[bool, list[int], list[float]]:
        """Whether the plan was the last one shifted, its matches' tokens, its rows."""
        plan = deliveries[0][1].plan
        return (plan.base is not None, [match.token_index for match in plan.matches],
                [float(rows[0, 0]) for _, _, rows in deliveries])

    repeats = channel._Repeat()
    # no batch before it: planned from its columns, whatever it says
    assert delivered(repeats.deliveries(batch(3, True), [state])) == (False, [3], [3.0] * 3)
    assert delivered(repeats.deliveries(batch(4, True), [state])) == (True, [4], [4.0] * 3)
    # another request table: planned again
    assert delivered(repeats.deliveries(batch(5, True), [other])) == (False, [5], [5.0] * 3)
    # a batch that says nothing: its columns compared with the last one's, each
    # match the same number of tokens on (a strided layout's: its stride)
    assert delivered(repeats.deliveries(batch(6, False), [other])) == (True, [6], [6.0] * 3)
    assert delivered(repeats.deliveries(batch(8, False), [other])) == (True, [8], [8.0] * 3)
    # not on (the same token again, or one before): planned again
    assert delivered(repeats.deliveries(batch(8, False), [other])) == (False, [8], [8.0] * 3)
    assert delivered(repeats.deliveries(batch(7, False), [other])) == (False, [7], [7.0] * 3)


def test_a_batch_is_the_last_one_shifted_only_where_every_match_moved_alike():
    # Two requests: both a stride on, the last plan shifted; one a token on and
    # the other two, planned from the columns.
    point = _points()[0]
    session = CaptureSession(None, [point])
    states = [session.open_request(rid, "", [1, 2, 3]) for rid in ("a", "b")]

    def batch(tokens: tuple[int, int]) -> wire.StepBatch:
        groups = [wire.GroupRows(layer, "residual_stream", 0, 2 * index, 2)
                  for index, layer in enumerate((0, 2, 3))]
        return wire.StepBatch(step=tokens[0], banks=[torch.zeros((6, HIDDEN))],
                              requests=["uc1", "uc2"], groups=groups,
                              matches=wire.match_array([(0, 0, tokens[0], 3),
                                                        (1, 0, tokens[1], 3)]),
                              match_rows=wire.row_array([0, 0, 0, 1, 1, 1]))

    def shifted(tokens: tuple[int, int]) -> tuple[bool, list[int]]:
        plan = repeats.deliveries(batch(tokens), states)[0][1].plan
        return plan.base is not None, [match.token_index for match in plan.matches]

    repeats = channel._Repeat()
    assert shifted((3, 5)) == (False, [3, 5])
    assert shifted((5, 7)) == (True, [5, 7])
    assert shifted((6, 9)) == (False, [6, 9])


def test_held_step_batches_go_to_the_driver_in_step_order_each_once(monkeypatch):
    # With hold (no reply can change a step), the worker keeps step batches and
    # sends them together: at HOLD_STEPS, or HOLD_BYTES of rows, when the driver
    # asks (flush), or ahead of the next batch once the hold is over.
    from undercurrent.adapters.vllm import worker

    monkeypatch.setattr(worker, "HOLD_STEPS", 3)
    monkeypatch.setattr(worker, "HOLD_BYTES", 1000)
    capture = object.__new__(worker._Capture)
    capture.hold, capture.held, capture.held_bytes = True, [], 0
    sent: list[list[int]] = []
    capture._exchange = lambda batch: sent.append(  # type: ignore[method-assign]
        [earlier.step for earlier in batch.earlier] + [batch.step])
    for step in range(1, 8):
        capture._ship(wire.StepBatch(step=step), 10)
    assert sent == [[1, 2, 3], [4, 5, 6]]
    capture._ship(wire.StepBatch(step=8), 2000)  # over the bytes: sent with 7
    capture.flush()  # nothing left to send
    capture._ship(wire.StepBatch(step=9), 10)
    capture.flush()
    assert sent == [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    capture._ship(wire.StepBatch(step=10), 10)
    capture.hold = False  # (a later open without hold)
    capture._ship(wire.StepBatch(step=11), 10)
    capture._ship(wire.StepBatch(step=12), 10)
    assert sent[4:] == [[10, 11], [12]] and capture.held == [] and capture.held_bytes == 0


def test_the_worker_s_copy_of_a_request_is_steady_again_once_the_driver_switches_its_edit_on():
    """The worker's copy of a request with an edit the driver switches on
    (``when``) is steady as if it had none until the switch reaches it
    (``_Capture._arm``, from the driver's reply), once its points that end
    have retired; the switch drops the plans the worker keeps (they lack the
    edit) and makes the request steady again from the token after the
    signal's. A switch named twice, or for a request that is gone, changes
    nothing. The same request with the edit always on is steady once the
    edit applies."""
    from undercurrent.adapters.vllm import worker
    from undercurrent.spec.types import Edit
    from undercurrent.steering.vectors import resolve_edits

    points = [ExtractionPoint(name=name, layers=(0,), tensor_type="residual_stream",
                              position=position, probe_type="none", probe_kind=kind)
              for name, position, kind in (("every", "generated[*]", "trajectory"),
                                           ("last", "prompt[-1]", "single_shot"))]

    def edits(when: dict[str, str] | None) -> list[Any]:
        return resolve_edits([Edit(name="steer", layers=(1,), tensor_type="residual_stream",
                                   position="generated[*]", op="add", vector=[1.0] * HIDDEN,
                                   coefficient=1.0, when=when)], hidden_size=HIDDEN)

    triggered = MirrorState("uc1", 3, points, edits({"point": "every", "action": "flag"}))
    always = MirrorState("uc2", 3, points, edits(None))
    for state in (triggered, always):
        state.matches_in_window(0, 3)  # (the prompt: "last" retires)
    assert triggered.steady_from == 3 and triggered.edits_same_until(3) is None
    assert always.steady_from == 3
    capture = object.__new__(worker._Capture)
    capture.states = {"uc1": triggered}
    kept = object()
    capture.steady = capture.cycle = kept  # type: ignore[assignment]
    capture._arm([("gone", "steer", 4)])
    assert capture.steady is kept and capture.cycle is kept  # (nothing switched)
    capture._arm([("uc1", "steer", 5)])
    assert triggered.armed == {"steer": 5} and triggered.steady_from == 6
    assert capture.steady is None and capture.cycle is None
    assert triggered.edits_same_until(5) == 6 and triggered.edits_same_until(6) is None
    capture.steady = kept  # type: ignore[assignment]
    capture._arm([("uc1", "steer", 7)])  # (named again: the first switch stands)
    assert triggered.armed == {"steer": 5} and capture.steady is kept


def test_the_driver_replays_each_request_s_log_of_applied_edits_as_the_worker_kept_it():
    """The worker sends each steered request's log as a tape (its entries, the
    journals it follows and where it stopped reading them) and each journal's
    new shifts once for every request (``_Capture._applied_edits``); the
    driver's copy (``StepServer.take_edits``, ``RequestState.replay_edits``)
    ends with the same applied edits, in the same order, and the same edited
    sites, whichever batch each part crossed in: a journal that grows after
    the log stopped following it (the log reads no further), an entry
    appended while following, a second journal with an entry of its own at
    the start."""
    from undercurrent.adapters.session import RequestState
    from undercurrent.adapters.vllm import worker
    from undercurrent.spec.types import Edit
    from undercurrent.steering.vectors import resolve_edits

    edits = resolve_edits([Edit(name="steer", layers=(1,), tensor_type="residual_stream",
                                position="generated[*]", op="add", vector=[1.0] * HIDDEN)],
                          hidden_size=HIDDEN)
    mine = MirrorState("uc1", 3, [], edits)
    theirs = RequestState("uc1", "", range(3), [], edits=edits)
    capture = object.__new__(worker._Capture)
    capture.steered, capture.journals, capture.journal_count = {"uc1": mine}, {}, 0
    capture.steady = None
    server = object.__new__(channel.StepServer)
    server._journals, server._states = {}, {"uc1": theirs}
    sites = [("steer", 1, "residual_stream")]

    def send() -> None:
        server.take_edits(capture._applied_edits())

    residual = TensorType.RESIDUAL_STREAM
    mine.log_applied("steer", residual, 1, 3)
    journal: list[int] = []
    mine.applied.follow(journal, 4, 3, sites)
    journal += [0, 1]
    send()
    journal.append(2)
    send()
    journal.append(3)
    mine.log_applied("steer", residual, 1, 9)  # (stops following after 4 entries)
    journal.append(4)  # (others' entries: not this log's)
    send()
    other = [0]
    mine.applied.follow(other, 10, 3, sites)
    other.append(1)
    send()
    other.append(2)
    send()
    assert [entry.token_index for entry in mine.applied] == [3, 4, 5, 6, 7, 9, 10, 11, 12]
    assert list(theirs.applied) == list(mine.applied)
    assert theirs.edited_sites == mine.edited_sites
    assert capture._applied_edits() == ([], [])  # (everything sent; the journals let go)
    assert capture.journals == {}
