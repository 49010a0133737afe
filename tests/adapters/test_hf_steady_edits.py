"""Always-on edits on the steady path: a request whose every generated token from
some index on gets the same edits (``add`` on ``generated[*]`` or
``generated[a:]``, no ``when``, stride 1) has its decode steps planned once
and repeated a token later with their edits, held in windows beside its
probes, and its log of applied edits kept as one journal of shifts for every
request (``EditLog``), built when read.

The oracle is the same generation planned and routed step by step, request
by request (``StepPlan.add_steady_tokens`` and ``add_alike_tokens``
declining, each step routed as it comes): the tokens, signals, records with
the edits at each, and the applied edits, compared exactly. The tokens
themselves are checked against a hand-written forward hook in
``tests/steering/test_hf_edits.py``, whose edit-only generations now take
this path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_hf_windows import (  # noqa: E402
    MAX_NEW,
    WEIGHT,
    Windows,
    _generate,
    _point,
    _record_view,
    _view,
)

from undercurrent.adapters.edit_log import EditLog  # noqa: E402
from undercurrent.adapters.outputs import AppliedEdit  # noqa: E402
from undercurrent.adapters.session import CaptureSession, StepPlan  # noqa: E402
from undercurrent.records import LazySequence  # noqa: E402
from undercurrent.spec.types import Edit, ExtractionPoint, TensorType  # noqa: E402
from undercurrent.steering.vectors import resolve_edits  # noqa: E402

VECTOR = [0.5 * ((index * 5) % 3 - 1) for index in range(len(WEIGHT))]


def _edit(position: str = "generated[*]", *, layers: tuple[int, ...] = (1,),
          tensor_type: str = "residual_stream", stride: int = 1,
          when: dict[str, str] | None = None, name: str = "steer",
          coefficient: float = 2.0) -> Edit:
    return Edit(name=name, layers=layers, tensor_type=tensor_type, position=position,
                stride=stride, op="add", vector=VECTOR, coefficient=coefficient, when=when)


class Shifts:
    """Counts the plans made a token later that apply edits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.edited = 0
        shifted, advanced = StepPlan.shifted, StepPlan.advanced

        def counted_shifted(plan: StepPlan, delta: int = 1) -> StepPlan:
            made = shifted(plan, delta)
            self.edited += bool(made.edits)
            return made

        def counted_advanced(plan: StepPlan, delta: int = 1) -> StepPlan:
            made = advanced(plan, delta)
            self.edited += bool(made.edits) and made is plan
            return made

        monkeypatch.setattr(StepPlan, "shifted", counted_shifted)
        monkeypatch.setattr(StepPlan, "advanced", counted_advanced)


class Taken:
    """What ``_Window.take`` answered each decode step it was asked, beside
    whether that step's plan was made afresh (not a repeat of a plan held)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from undercurrent.adapters import delivery

        self.answers: list[tuple[bool, bool]] = []  # (taken, plan made afresh)
        take = delivery._Window.take

        def counted(window: Any, session: Any, batches: Any) -> bool:
            plan = getattr(batches[0][1], "plan", None) if batches else None
            fresh = plan is None or plan.base is None  # (read before: take lets go of it)
            self.answers.append((take(window, session, batches), fresh))
            return self.answers[-1][0]

        monkeypatch.setattr(delivery._Window, "take", counted)

    def check(self) -> None:
        """Every repeat of a plan whose steps the window holds was taken as the
        hooks handed it over, whichever of the window's layouts it repeats;
        only the plans made afresh went through the general path."""
        assert self.answers  # (asked from the window's second step on)
        assert [taken for taken, fresh in self.answers if not fresh] == [True] * sum(
            not fresh for _, fresh in self.answers)
        assert not any(taken for taken, fresh in self.answers if fresh)


def _moves(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each layout asked to move to a new plan's (``_SteadyLayout.moved``,
    after a change of edits) did, appended as each is asked."""
    from undercurrent.adapters import delivery

    moved: list[bool] = []
    move = delivery._SteadyLayout.moved

    def counted(layout: Any, *args: Any) -> Any:
        made = move(layout, *args)
        moved.append(made is not None)
        return made

    monkeypatch.setattr(delivery._SteadyLayout, "moved", counted)
    return moved


def _planned_alone(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The generated index of each decode step planned a request at a time
    (``StepPlan.add_window``), appended as it is planned."""
    alone: list[int] = []
    add_window = StepPlan.add_window

    def counted(plan: StepPlan, state: Any, start: int, stop: int, slot_of: Any) -> None:
        if start >= state.prompt_len:
            alone.append(start - state.prompt_len)
        add_window(plan, state, start, stop, slot_of)

    monkeypatch.setattr(StepPlan, "add_window", counted)
    return alone


def _each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step planned request by request (the general path)."""
    monkeypatch.setattr(StepPlan, "add_steady_tokens", lambda self, fed: False)
    monkeypatch.setattr(StepPlan, "add_alike_tokens", lambda self, fed: False)


def _full_view(output: Any) -> Any:
    return (_view(output), [_record_view(record) for record in output.records],
            list(output.edits))


@pytest.mark.parametrize("edits", [
    [_edit()],
    [_edit("generated[3:]", layers=(0, 2))],  # (steady from the fourth generated token)
    [_edit(layers=(1,)), _edit(layers=(1, 2), tensor_type="mlp_out", name="second")],
])
def test_steps_with_always_on_edits_repeat_their_plans_and_are_held_in_windows(
        monkeypatch, edits):
    windows, shifts = Windows(monkeypatch), Shifts(monkeypatch)
    point = _point("linear_probe")  # (layers 0 to 2, every generated token)
    mine = _generate(point, windows=True, records=True, edits=edits)
    assert shifts.edited > 0 and windows.steps and max(windows.steps) > 1
    assert all(type(output.edits) is LazySequence for output in mine)
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate(point, windows=False, records=True, edits=edits)
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]
    # (the records at an edited site say so, the others not)
    sites = {(layer, edit.tensor_type) for edit in edits for layer in edit.layers}
    for output in mine:
        assert output.edits and {record.edits != () for record in output.records} == {
            True, False}
        for record in output.records:
            edited = (record.layer, TensorType(record.tensor_type)) in sites
            assert bool(record.edits) == (edited and record.generated_index >= min(
                edit.position.start for edit in edits))


@pytest.mark.parametrize(("edits", "edited"), [
    ([_edit("generated[1:6]")], True),  # (a slice that ends: steady in it, then after)
    ([_edit("prompt[-1]", layers=(0, 2))], False),  # (the prefill's: every step steady)
    ([_edit("generated[2]")], False),  # (one token: steady before it and after)
    ([_edit("generated[1:4]"), _edit("generated[6]", name="late", layers=(2,))], True),
    ([_edit(), _edit("generated[0:3]", name="early", tensor_type="mlp_out")], True),
])
@pytest.mark.parametrize("several", [False, True])
def test_steps_around_edits_that_end_repeat_their_plans_and_are_held_in_windows(
        monkeypatch, edits, edited, several):
    """A slice of tokens, a prompt token or one generated token edited: the
    steps where the edits are the same at every token repeat their plans, and
    are held in one window, before, while and after (no decode step is planned
    a request at a time: each where an edit starts or stops applying is
    planned at once); the same generation planned and routed a step at a time
    is the oracle. ``several``: a second point beside the first (of another
    tensor type and layers, judged by another probe)."""
    windows, shifts = Windows(monkeypatch), Shifts(monkeypatch)
    alone, taken = _planned_alone(monkeypatch), Taken(monkeypatch)
    moved = _moves(monkeypatch)
    point: Any = _point("linear_probe")
    if several:
        point = [point, dataclasses.replace(_point("norm_probe", threshold=0.11), name="mlp",
                                            layers=(0, 2), tensor_type=TensorType.MLP_OUT)]
    mine = _generate(point, windows=True, records=True, edits=edits)
    # (one window holds every decode step: the layouts before, within and after
    # an edit share it, each row with its own step's edits; the repeats of
    # each layout's plan taken as they came, and each layout after a change
    # the one before it moved, not worked out again per request)
    assert windows.steps == [MAX_NEW - 1]
    taken.check()
    # (every case but the prompt token's edit changes during the decode steps)
    assert all(moved) and bool(moved) == (edits[0].position.kind.value != "prompt")
    assert (shifts.edited > 0) == edited
    assert alone == []
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate(point, windows=False, records=True, edits=edits)
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]
    assert all(output.edits for output in mine)
    # (the records say which edits changed them, at the tokens each selects)
    for output in mine:
        for record in output.records:
            assert record.edits == tuple(
                edit.name for edit in edits if record.layer in edit.layers
                and TensorType(record.tensor_type) == edit.tensor_type
                and _selects(edit, record.token_index, output.prompt_len))


@pytest.mark.parametrize("position", ["generated[*]", "generated[2:]"])
def test_an_edit_of_the_points_stride_repeats_with_their_strided_plan(monkeypatch, position):
    """Points of every second token beside an edit of every second token, in
    phase with them (from their first, or from the third token): the steady
    steps are every second one, each with the edit, nothing planned between;
    the general path is the oracle."""
    import dataclasses

    windows, shifts = Windows(monkeypatch), Shifts(monkeypatch)
    alone = _planned_alone(monkeypatch)
    point = dataclasses.replace(_point("linear_probe"), stride=2)
    edits = [_edit(position, stride=2, layers=(0, 2))]
    mine = _generate(point, windows=True, records=True, edits=edits)
    assert shifts.edited > 0 and alone == []
    assert windows.steps and max(windows.steps) > 1
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate(point, windows=False, records=True, edits=edits)
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]
    for output in mine:
        assert [entry.generated_index for entry in output.edits if entry.layer == 0] == [
            index for index in range(0, MAX_NEW - 1, 2) if index >= edits[0].position.start]


def _selects(edit: Edit, token_index: int, prompt_len: int) -> bool:
    position = edit.position
    if not position.is_continuous:
        return position.target_index(prompt_len) == token_index
    generated = token_index - prompt_len
    return generated >= position.start and (position.stop is None or generated < position.stop)


def test_a_stream_of_steady_steered_steps_gives_each_event_its_edits(monkeypatch):
    """``stream()`` reads each step's edits as it comes (``unread_edits``): the
    journal is read a step at a time."""
    from hf_models import build_model, build_tokenizer
    from test_hf_equivalence import PROMPTS

    from undercurrent.adapters import SamplingParams
    from undercurrent.adapters.hf.backend import HFBackend
    from undercurrent.router import Router

    def events() -> list[Any]:
        backend = HFBackend(build_model("llama"), build_tokenizer())
        with Router() as router:
            session = CaptureSession(router, [_point("linear_probe")],
                                     edits=resolve_edits([_edit()], hidden_size=len(WEIGHT)))
            return [(event.token_id, event.edits) for event in backend.stream(
                PROMPTS[0], "a", SamplingParams(max_new_tokens=8), session)]

    shifts = Shifts(monkeypatch)
    mine = events()
    assert shifts.edited > 0
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = events()
    assert mine == theirs
    assert [len(edits) for _, edits in mine[1:-1]] == [1] * (len(mine) - 2)


def _state(edits: list[Edit], points: list[ExtractionPoint] | None = None,
           prompt_len: int = 4) -> Any:
    points = [ExtractionPoint(name="p", layers=(0,), tensor_type="residual_stream",
                              position="generated[*]", probe_type="none",
                              probe_kind="trajectory")] if points is None else points
    session = CaptureSession(None, points,
                             edits=resolve_edits(edits, hidden_size=len(VECTOR)))
    return session.open_request("r", "x", [1] * prompt_len)


@pytest.mark.parametrize(("edits", "stride", "steady"), [
    ([], 1, (4, None)),
    ([_edit()], 1, (4, None)),
    ([_edit("generated[3:]")], 1, (4, 7)),  # (the steps before it starts)
    ([_edit("generated[*]", stride=2)], 1, None),  # (every second token)
    ([_edit("generated[2:]", stride=2)], 1, (4, 6)),  # (before it starts)
    ([_edit("generated[1:6]")], 1, (4, 5)),  # (a slice that ends: before it)
    ([_edit("generated[0:5]")], 1, (4, 9)),  # (in it)
    ([_edit("prompt[-1]")], 1, (4, None)),  # (a prompt token: none generated)
    ([_edit("generated[2]")], 1, (4, 6)),  # (one generated token: the steps before it)
    ([_edit("generated[0]")], 1, (4, 5)),  # (the first token: that one alone)
    ([_edit("generated[0]")], 2, None),  # (beside points of a stride, on at the first)
    ([_edit("prompt[-1]")], 2, (4, None)),  # (points of a stride, no token edited)
    ([_edit("generated[0:5]")], 2, None),  # (points of a stride, every token edited)
    ([_edit("generated[3:5]")], 2, (4, 7)),  # (points of a stride, before it)
    ([_edit("generated[0:6]"), _edit("generated[8]", name="late")], 1, (4, 10)),
    ([_edit("generated[0:6]"), _edit("generated[3]", name="inside")], 1, (4, 7)),
    ([_edit(when={"point": "p", "action": "flag"})], 1, (4, None)),  # (none armed yet)
    ([_edit(), _edit("generated[*]", stride=2, name="second",
                     when={"point": "p", "action": "flag"})], 1, (4, None)),
    ([_edit()], 2, None),  # (points every second token, the edit on each)
    ([_edit(stride=2)], 2, (4, None)),  # (the edit on the tokens the points match)
    ([_edit("generated[1:]", stride=2)], 2, (4, 5)),  # (before it: then between the points)
    ([_edit("generated[2:9]", stride=2)], 2, (4, 6)),  # (before it, then in it)
    ([_edit(stride=3)], 2, None),  # (another stride)
])
def test_a_request_is_steady_only_where_every_token_gets_the_same_edits(edits, stride, steady):
    point = ExtractionPoint(name="p", layers=(0,), tensor_type="residual_stream",
                            position="generated[*]", stride=stride, probe_type="none",
                            probe_kind="trajectory")
    state = _state(edits, [point])
    assert (None if state.steady_from is None else (state.steady_from, state.steady_until)
            ) == steady


def test_a_request_is_steady_again_where_each_edit_starts_and_after_it_ends():
    """(``edits_in_window`` of the step before a token where an edit starts or
    stops applying works the request's steady steps out again from there,
    where the edit retires once done and where it is kept, as in a vLLM
    worker, for recomputed windows)"""
    for retire in (True, False):
        state = _state([_edit("generated[1:6]"), _edit("generated[8]", name="late")])
        state.retire_edits = retire
        assert (state.steady_from, state.steady_until) == (4, 5)  # (before the slice)
        assert state.edits_in_window(4, 5) == []
        assert (state.steady_from, state.steady_until) == (5, 10)  # (in it)
        assert [index for index, _ in state.edits_in_window(9, 10)] == [9]
        assert (state.steady_from, state.steady_until) == (10, 12)  # (before the late one)
        assert len(state._live_edits) == (1 if retire else 2)
        assert state.edit_sites_at(11) == []
        assert [index for index, _ in state.edits_in_window(11, 12)] == []
        assert (state.steady_from, state.steady_until) == (12, 13)  # (the late one's token)
        assert state.edit_sites_at(12) == [("late", 1, "residual_stream")]
        assert [index for index, _ in state.edits_in_window(12, 13)] == [12]
        assert (state.steady_from, state.steady_until) == (13, None)
        assert state.edits_on_at(13) == [] and state.edit_sites_at(13) == []
        assert state.edits_in_window(13, 20) == [] and state.steady_from == 13
    # (the prefill plans a prompt edit, the decode steps are steady from the start)
    state = _state([_edit("prompt[-1]")])
    assert state.edits_prompt() and state.steady_from == 4
    assert [index for index, _ in state.edits_in_window(0, 4)] == [3]
    assert not _state([_edit("generated[0]")]).edits_prompt()


def test_requests_opened_together_work_out_each_mark_once_per_prompt_length(monkeypatch):
    """(``pass_edit_marks`` of requests opened together, with the same points
    and edits and a prompt of one length, works their steady steps out once
    per mark; each request then holds what working them out alone gives, a
    request whose edit is switched on and one whose edits never retire
    included)"""
    from undercurrent.adapters.session import RequestState
    from undercurrent.records import SignalAction

    edits = [_edit("generated[2:4]"), _edit("generated[5:7]", name="late"),
             _edit("generated[2:]", name="armed", when={"point": "p", "action": "flag"})]
    point = ExtractionPoint(name="p", layers=(0,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="none",
                            probe_kind="trajectory")

    class _Router:
        def register_requests(self, contexts: Any, points: Any) -> None:
            pass

        def register_request(self, request_id: str, points: Any, context: Any) -> None:
            pass

    def opened() -> list[Any]:
        session = CaptureSession(_Router(), [point],
                                 edits=resolve_edits(edits, hidden_size=len(VECTOR)))
        states = session.open_requests([(f"r{index}", "x", [1] * length)
                                        for index, length in enumerate([4, 6, 4, 6, 4])])
        states[3].retire_edits = False
        assert states[2].arm("p", SignalAction.FLAG, 4)
        return states

    def steps(states: list[Any]) -> list[Any]:
        seen = []
        for generated in range(12):
            for state in states:
                state.edits_in_window(state.prompt_len + generated,
                                      state.prompt_len + generated + 1)
                seen.append((state.steady_from, state.steady_stride, state.steady_until,
                             [resolved.edit.name for resolved in state._live_edits]))
        return seen

    worked = []
    steady_after = RequestState._steady_after

    def counted(state: Any, stop: int) -> None:
        worked.append((state.request_id, stop))
        steady_after(state, stop)

    monkeypatch.setattr(RequestState, "_steady_after", counted)
    together = steps(opened())
    # (the armed request, r2, each mark itself; r3's edits kept: its own key)
    assert {request for request, _ in worked} == {"r0", "r1", "r2", "r3"}
    assert len(worked) == len(set(worked))
    monkeypatch.setattr(CaptureSession, "open_requests", lambda self, requests: [
        self.open_request(*request) for request in requests])
    alone = opened()
    assert all(state._worked is None for state in alone)
    assert steps(alone) == together


def test_a_triggered_edit_switched_on_moves_the_request_s_steady_steps_past_its_signal():
    from undercurrent.records import SignalAction

    state = _state([_edit(when={"point": "p", "action": "flag"})])
    assert state.steady_from == 4
    assert not state.arm("p", SignalAction.ABORT, 5)  # (another action: nothing armed)
    assert state.steady_from == 4
    assert state.arm("p", SignalAction.FLAG, 5) and state.armed == {"steer": 5}
    # (on from the token after the signal's, every token on: steady again there)
    assert state.steady_from == 6 and not state.arm("p", SignalAction.FLAG, 6)
    # A switched-on edit from a later token on: steady up to its first token.
    late = _state([_edit("generated[9:]", when={"point": "p", "action": "flag"})])
    assert late.arm("p", SignalAction.FLAG, 5)
    assert (late.steady_from, late.steady_until) == (6, 13)
    # One that is strided: each step planned from the signal on.
    other = _state([_edit(stride=2, when={"point": "p", "action": "flag"})])
    assert other.steady_from == 4
    assert other.arm("p", SignalAction.FLAG, 5) and other.steady_from is None
    # One that ends: steady from the signal to its end, then without it.
    bounded = _state([_edit("generated[0:20]", when={"point": "p", "action": "flag"})])
    assert bounded.arm("p", SignalAction.FLAG, 5)
    assert (bounded.steady_from, bounded.steady_until) == (6, 24)
    bounded.edits_in_window(23, 24)
    assert (bounded.steady_from, bounded.steady_until) == (24, None)
    # One switched on past its end, or a single token's before it: never applies.
    for position in ("generated[0:1]", "generated[0]"):
        past = _state([_edit(position, when={"point": "p", "action": "flag"})])
        assert past.arm("p", SignalAction.FLAG, 5)
        assert (past.steady_from, past.steady_until) == (6, None)
    # A backend whose switches come from elsewhere plans each step of such a request.
    mirror = _state([_edit(when={"point": "p", "action": "flag"})])
    mirror.steady_until_armed = False
    assert mirror.arm("p", SignalAction.FLAG, 5) and mirror.steady_from is None


@pytest.mark.parametrize("early", [False, True])
def test_steps_before_and_after_a_triggered_edit_is_switched_on_repeat_their_plans(
        monkeypatch, early):
    """A probe flags mid-generation and switches on an edit for that request
    alone: the steps before repeat their plans and are held in a window (the
    probe's scores tell that none flags), the step that flags is routed as it
    comes (so the edit applies from the next step), and the steps after repeat
    their plans with the edit at that request's row only, held again; the
    outputs, records and applied edits are the general path's. ``early``: an
    edit of the first generated token beside it (adding nothing), whose end
    moves the layout held (``_SteadyLayout.moved``) before the step that
    flags is routed from it."""
    watched = _generate(_point("linear_probe", threshold=None), windows=False)
    scores = sorted((s.score, s.generated_index) for output in watched for s in output.signals)
    (second, _), (top, at) = scores[-2:]
    assert top > second and at >= 1  # (one signal flags: after the first step)
    point = _point("linear_probe", threshold=(top + second) / 2)
    edits = [dataclasses.replace(_edit(), when={"point": "watch", "action": "flag"})]
    if early:
        edits.append(_edit("generated[0:1]", name="early", layers=(2,), coefficient=0.0))
    windows, shifts = Windows(monkeypatch), Shifts(monkeypatch)
    repeated: list[int] = []
    advanced = StepPlan.advanced
    moved = _moves(monkeypatch)

    def counted(plan: StepPlan, delta: int = 1) -> StepPlan:
        repeated.append(delta)
        return advanced(plan, delta)

    monkeypatch.setattr(StepPlan, "advanced", counted)
    mine = _generate(point, windows=True, records=True, edits=edits)
    assert repeated and shifts.edited > 0
    assert (True in moved) == early
    # (the steps before the flag's held in one window, routed when it came;
    # those after, where the other requests' edits may still switch on, too)
    assert windows.steps[0] == at and len(windows.steps) > 1
    assert [any(entry.edit_name == "steer" for entry in output.edits)
            for output in mine].count(True) == 1
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate(point, windows=False, records=True, edits=edits)
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]


def test_a_triggered_edit_switched_on_for_each_request_at_its_own_token_rides_the_steady_path(
        monkeypatch):
    """Every request's probe flags within its first three tokens, each at its
    own: the steps between repeat their plans with the edit at the rows of
    the requests switched on so far (each row's ``edits`` its own), and once
    every request's edit is on, the steps are held in windows again. The
    outputs, records and applied edits are the general path's."""
    import dataclasses

    from undercurrent.adapters import delivery

    watched = _generate(_point("linear_probe", threshold=None), windows=False)
    firsts = [max(s.score for s in output.signals if s.generated_index <= 2)
              for output in watched]
    point = _point("linear_probe", threshold=min(firsts) - 1e-9)
    edit = dataclasses.replace(_edit(), when={"point": "watch", "action": "flag"})
    windows, shifts = Windows(monkeypatch), Shifts(monkeypatch)
    per_row: list[bool] = []
    edited_everywhere = delivery._edited_everywhere

    def seen(base: Any) -> Any:
        found = edited_everywhere(base)
        per_row.append(any(isinstance(names, dict) for names in found.values()))
        return found

    monkeypatch.setattr(delivery, "_edited_everywhere", seen)
    mine = _generate(point, windows=True, records=True, edits=[edit])
    assert shifts.edited > 0 and windows.steps and True in per_row
    assert all(output.edits for output in mine)
    assert len({output.edits[0].generated_index
                for output in mine}) > 1  # (switched on at different tokens)
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate(point, windows=False, records=True, edits=[edit])
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]


def test_edits_alone_are_steady_before_and_from_their_first_token_and_after_a_slice_ends():
    alone = _state([_edit("generated[2:]")], points=[])
    assert (alone.steady_from, alone.steady_until) == (0, 6)  # (nothing to do before)
    alone.edits_in_window(5, 6)
    assert (alone.steady_from, alone.steady_until) == (6, None)
    slice_point = ExtractionPoint(name="p", layers=(0,), tensor_type="residual_stream",
                                  position="generated[0:3]", probe_type="none",
                                  probe_kind="trajectory")
    state = _state([_edit()], [slice_point])
    assert (state.steady_from, state.steady_until) == (4, 7)
    state.matches_in_window(6, 7)  # (the slice's last token: the point retires)
    assert (state.steady_from, state.steady_until) == (7, None)


def test_an_edit_log_builds_a_journal_s_entries_in_order_and_keeps_what_it_followed():
    journal = [0]
    log, other = EditLog(), EditLog()
    first = AppliedEdit("prompt", 0, 1, None, "residual_stream")
    log.append(first)
    sites = [("a", 1, "residual_stream"), ("b", 0, "mlp_out")]
    log.follow(journal, 10, 4, sites)
    other.follow(journal, 20, 6, sites)
    journal.append(1)
    assert log.following and len(log) == 5  # (built when read, and followed on)
    journal.append(2)
    other.freeze()  # (its request ended: later shifts are not its own)
    journal.append(3)
    assert list(log) == [first] + [
        AppliedEdit(name, layer, 10 + shift, 6 + shift, tensor_type)
        for shift in range(4) for name, layer, tensor_type in sites]
    assert [entry.token_index for entry in other] == [20, 20, 21, 21, 22, 22]
    log.append(first)  # (planned on its own again: the journal is no longer its)
    journal.append(4)
    assert not log.following and len(log) == 10 and log[-1] == first
    assert log == list(log) and log != [first]


def test_an_edit_log_cut_at_a_token_keeps_the_entries_before_it_and_follows_no_further():
    # (a request the engine ran past its end: its entries from that token on go,
    # those of a journal it followed included, and later shifts are not its own)
    journal = [0, 1]
    log = EditLog()
    first = AppliedEdit("prompt", 0, 1, None, "residual_stream")
    log.append(first)
    log.follow(journal, 10, 4, [("a", 1, "residual_stream")])
    journal += [2, 3]
    log.cut(12)
    journal.append(4)
    assert not log.following and not log.pending
    assert list(log) == [first] + [AppliedEdit("a", 1, 10 + shift, 6 + shift, "residual_stream")
                                   for shift in range(2)]
    log.cut(0)
    assert list(log) == []


def test_an_edit_log_s_journal_entries_on_prompt_tokens_have_no_generated_index():
    # (vLLM feeds a prompt in chunks: a later chunk's steady step edits prompt
    # tokens, which have no generated index, as the HF backend reports them)
    journal = [0, 1, 2]
    log = EditLog()
    log.follow(journal, 3, 4, [("a", 1, "residual_stream")])
    assert list(log) == [AppliedEdit("a", 1, 3, None, "residual_stream"),
                         AppliedEdit("a", 1, 4, 0, "residual_stream"),
                         AppliedEdit("a", 1, 5, 1, "residual_stream")]


def test_journals_stopped_at_a_change_of_edits_are_built_when_read_each_in_its_place(
        monkeypatch):
    """(a journal stopped when its request follows another, or logs an entry of
    its own, keeps its shifts read so far; its entries are built when the log
    is read, between the entries logged before and after it)"""
    from undercurrent.adapters import edit_log

    made: list[int] = []
    entries = edit_log._entries

    def counted(shifts: list[int], *args: Any) -> list[AppliedEdit]:
        made.append(len(shifts))
        return entries(shifts, *args)

    monkeypatch.setattr(edit_log, "_entries", counted)
    first, later = [0], [0]
    log = EditLog()
    head = AppliedEdit("prompt", 0, 3, None, "residual_stream")
    log.append(head)
    log.follow(first, 10, 4, [("a", 1, "residual_stream")])
    first += [1, 2]
    log.follow(later, 15, 4, [("b", 2, "mlp_out")])  # (the edits changed)
    first.append(3)  # (another request's shift: not this log's)
    later.append(1)
    middle = AppliedEdit("once", 1, 17, 13, "residual_stream")
    log.append(middle)
    assert made == [] and log.pending and not log.following
    assert list(log) == [head, *[AppliedEdit("a", 1, 10 + shift, 6 + shift, "residual_stream")
                                 for shift in range(3)],
                         AppliedEdit("b", 2, 15, 11, "mlp_out"),
                         AppliedEdit("b", 2, 16, 12, "mlp_out"), middle]
    assert made == [3, 2] and not log.pending
    # (the journals' entries, for the edited sites, once, each journal's shifts
    # read so far, and no entry built for it)
    assert log.take_unsited() == [([0, 1, 2], 10, (("a", 1, "residual_stream"),)),
                                  ([0, 1], 15, (("b", 2, "mlp_out"),))]
    assert log.take_unsited() == [] and made == [3, 2]


def test_the_edited_sites_of_steady_steps_are_read_from_the_journal():
    state = _state([_edit(layers=(0, 2))])
    state.generated.extend([7, 7, 7])
    plan = StepPlan()
    assert plan.add_steady_tokens([(state, 4, (0, 0))])
    plan.shifted(1)
    plan.shifted(2)
    assert state.edited_sites == {
        (layer, TensorType.RESIDUAL_STREAM, token): ("steer",)
        for layer in (0, 2) for token in (4, 5, 6)}
    assert [(entry.layer, entry.token_index) for entry in state.applied] == [
        (layer, token) for token in (4, 5, 6) for layer in (0, 2)]


def test_a_plan_whose_edits_are_not_steady_cannot_be_shifted():
    state = _state([_edit("generated[*]", stride=2)])
    state.generated.extend([7, 7])
    plan = StepPlan()
    plan.add_window(state, 4, 5, lambda token: (0, 0))
    assert plan.edits
    with pytest.raises(ValueError, match="not steady cannot be shifted"):
        plan.shifted(1)


def test_edits_meeting_at_one_site_apply_in_each_request_s_order_whichever_is_planned_first():
    """Two edits at one site, the first triggered: a request that has it switched
    on gets it before the always-on one (its spec's order), even where a
    request planned before it has only the second. The plan applies each
    pair's edits in the order it lists them."""
    from undercurrent.records import SignalAction

    edits = resolve_edits([_edit(when={"point": "p", "action": "flag"}, name="first"),
                           _edit(name="second")], hidden_size=len(VECTOR))
    session = CaptureSession(None, [], edits=edits)
    plain, switched = (session.open_request(request_id, "x", [1] * 4)
                       for request_id in ("a", "b"))
    assert switched.arm("p", SignalAction.FLAG, 4)
    for planned in ([plain, switched], [switched, plain]):
        plan = StepPlan()
        for row, state in enumerate(planned):
            state.generated.append(7)
            plan.add_window(state, 5, 6, lambda token, row=row: (row, 0))
        entries = list(plan.get_edits(1, TensorType.RESIDUAL_STREAM) or ())
        assert [entry.resolved.edit.name for entry in entries] == ["first", "second"]
        rows = {entry.resolved.edit.name: entry.slots for entry in entries}
        assert rows["first"] == [(planned.index(switched), 0)]
        assert sorted(rows["second"]) == [(0, 0), (1, 0)]
        for state in planned:
            state.generated.pop()


@pytest.mark.parametrize(("strides", "edits", "period", "eos"), [
    ((1, 2), [_edit()], 2, None),
    ((2, 3), [_edit(layers=(0, 2))], 6, None),  # (steps that capture nothing still edit)
    ((2, 2), [_edit("generated[3:]")], 2, None),  # (the cycle starts at the edit's first token)
    # (adding nothing, the tokens are the unedited ones: eos ends a request once its
    # log follows the cycle's shifts; with stride 3, the requests left follow anew)
    ((1, 2), [_edit(coefficient=0.0), _edit(layers=(1,), tensor_type="mlp_out",
                                            name="second", coefficient=0.0)], 2, 15),
    ((1, 3), [_edit(coefficient=0.0)], 3, 60),
])
def test_points_of_several_strides_beside_always_on_edits_repeat_their_cycle(
        monkeypatch, strides, edits, period, eos):
    """Points of several strides beside edits on every generated token: the
    steps of one period are planned with their edits, then each plan repeats a
    period later with them, every request's log of applied edits following
    one list of shifts for all the period's plans (also once a request has
    ended, ``eos``: the requests left start a cycle again). The tokens,
    signals, records with their edits and the applied edits are those of
    every step planned request by request and routed as it comes."""
    import dataclasses

    every = dataclasses.replace(_point("linear_probe"), layers=(0, 2), stride=strides[0])
    second = dataclasses.replace(every, name="second", tensor_type=TensorType.MLP_OUT,
                                 layers=(1,), stride=strides[1])
    repeated: list[int] = []
    advanced = StepPlan.advanced

    def counted(plan: StepPlan, delta: int = 1) -> StepPlan:
        made = advanced(plan, delta)
        if made.edits:
            repeated.append(delta)
        return made

    monkeypatch.setattr(StepPlan, "advanced", counted)
    windows, taken = Windows(monkeypatch), Taken(monkeypatch)
    mine = _generate([every, second], windows=True, records=True, eos=eos, edits=edits)
    assert repeated and set(repeated) == {period}
    assert windows.steps and max(windows.steps) > 1
    if eos is None:  # (each plan of the period repeated, whichever layout: taken)
        taken.check()
    if eos is not None:
        ended = [len(output.token_ids) for output in mine if output.finish_reason == "eos"]
        assert ended and min(ended) < max(len(output.token_ids) for output in mine)
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate([every, second], windows=False, records=True, eos=eos, edits=edits)
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]
    assert all(output.edits for output in mine)


def test_points_of_several_strides_repeat_their_cycle_until_a_triggered_edit_is_switched_on(
        monkeypatch):
    """Points of strides 1 and 2 beside an edit one request's flag switches on
    mid-generation: until then the edit applies nowhere, so the steps of the
    period are planned at once and repeated a period later (routed as they
    come: a signal may switch the edit on); the switch makes the driver plan
    again. The tokens, signals, records with their edits and the applied
    edits are those of every step planned request by request."""
    import dataclasses

    # (the guard reads from the third generated token on, at the highest
    # threshold one request alone reaches: its flag comes once the cycle has
    # repeated)
    guard = dataclasses.replace(_point("linear_probe", threshold=None), layers=(0, 2),
                                position="generated[2:]")
    watched = _generate(guard, windows=False)
    tops = sorted(max(s.score for s in output.signals) for output in watched)
    assert tops[-1] > tops[-2]
    every = dataclasses.replace(guard, probe_args={
        **guard.probe_args, "threshold": (tops[-1] + tops[-2]) / 2})
    second = dataclasses.replace(_point("linear_probe", threshold=None), name="second",
                                 tensor_type=TensorType.MLP_OUT, layers=(1,), stride=2)
    edit = dataclasses.replace(_edit(), when={"point": "watch", "action": "flag"})
    repeated: list[int] = []
    advanced = StepPlan.advanced

    def counted(plan: StepPlan, delta: int = 1) -> StepPlan:
        made = advanced(plan, delta)
        repeated.append(delta)
        return made

    monkeypatch.setattr(StepPlan, "advanced", counted)
    mine = _generate([every, second], windows=True, records=True, edits=[edit])
    assert 2 in repeated  # (a cycle of period 2 repeated, before the switch)
    assert [bool(output.edits) for output in mine].count(True) == 1
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate([every, second], windows=False, records=True, edits=[edit])
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]


def test_prompts_planned_at_once_give_what_planning_each_request_s_prompt_gives(monkeypatch):
    """The prefill plans every prompt with what each prompt length matches,
    retires and gets worked out once (``StepPlan.add_prompts``); the oracle is
    each request's prompt planned alone (``add_window``). Prompts of three
    lengths, two of each; points on prompt tokens (one that retires, one
    beside generated tokens), an absolute token and generated tokens; edits on
    a prompt token and on a slice of generated tokens: the tokens, signals,
    results, records (with the edits at each) and applied edits are the same,
    and the batched run plans no prompt alone."""
    from hf_models import build_model, build_tokenizer, prompt

    import undercurrent.adapters.hf.backend as hf_backend
    from undercurrent.adapters import SamplingParams
    from undercurrent.adapters.hf.backend import HFBackend
    from undercurrent.router import Router

    prompts = [prompt(3, 1, 4, 1, 5, 9), prompt(2, 6), prompt(5, 3, 5, 8),
               prompt(2, 7, 1, 8, 2, 8), prompt(1, 4), prompt(1, 4, 1, 4)]
    ids = [f"p{index}" for index in range(len(prompts))]
    linear = {"weight": WEIGHT, "bias": 0.0, "threshold": 0.0, "action": "flag"}
    points = [
        ExtractionPoint(name="last", layers=(0, 2), tensor_type="residual_stream",
                        position="prompt[-1]", probe_type="linear_probe",
                        probe_kind="single_shot", probe_args=linear),
        ExtractionPoint(name="first", layers=(1,), tensor_type="attn_out",
                        position="prompt[0]", probe_type="norm_probe", probe_kind="single_shot"),
        ExtractionPoint(name="absolute", layers=(1,), tensor_type="mlp_out", position=1,
                        probe_type="norm_probe", probe_kind="single_shot"),
        ExtractionPoint(name="watch", layers=(0, 1, 2), tensor_type="residual_stream",
                        position="generated[*]", probe_type="linear_probe",
                        probe_kind="trajectory", probe_args=linear),
    ]
    edits = resolve_edits([_edit("prompt[-1]", name="prompt_edit", layers=(0, 1)),
                           _edit("generated[2:5]", name="slice_edit")],
                          hidden_size=len(WEIGHT))

    def generate(batched: bool) -> tuple[list[Any], list[tuple[str, int]]]:
        # (each window planned alone: its request and first generated index, < 0
        # for a prompt)
        alone: list[tuple[str, int]] = []
        add_window = StepPlan.add_window

        def counted(plan: StepPlan, state: Any, start: int, stop: int, slot_of: Any) -> None:
            alone.append((state.request_id, start - state.prompt_len))
            add_window(plan, state, start, stop, slot_of)

        with monkeypatch.context() as patch:
            patch.setattr(StepPlan, "add_window", counted)
            patch.setattr(hf_backend._RowDriver, "batch_windows", batched)
            backend = HFBackend(build_model("llama"), build_tokenizer())
            with Router() as router:
                session = CaptureSession(router, points, keep_records=True, edits=edits)
                outputs = backend.generate(prompts, ids, SamplingParams(max_new_tokens=MAX_NEW),
                                           session)
        return outputs, alone

    batched, alone = generate(True)
    planned, each = generate(False)
    prefills = [(request, -output.prompt_len) for request, output in zip(ids, planned,
                                                                          strict=True)]
    assert each[:len(prompts)] == prefills and len({index for _, index in prefills}) == 3
    # The decode steps are planned alike: each request left as its prompt alone
    # leaves it (its points retired, its steady steps and edit marks worked out).
    assert alone == each[len(prompts):]
    assert any(output.signals for output in planned)
    for mine, theirs in zip(batched, planned, strict=True):
        assert _view(mine) == _view(theirs)
        assert [_record_view(r) for r in mine.records] == [_record_view(r)
                                                           for r in theirs.records]
        assert list(mine.edits) == list(theirs.edits)
        assert {edit.edit_name for edit in mine.edits} == {"prompt_edit", "slice_edit"}
        assert {r.extraction_point_name for r in mine.records} == {"last", "first", "absolute",
                                                                   "watch"}


_LOG_STEPS = st.lists(st.one_of(
    st.tuples(st.just("follow"), st.integers(0, 2), st.integers(0, 40), st.integers(1, 2)),
    st.tuples(st.just("shift"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("entry"), st.integers(0, 40)),
    st.tuples(st.just("take"),),
    st.tuples(st.just("read"),),
    st.tuples(st.just("freeze"),),
), max_size=30)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(_LOG_STEPS)
def test_a_log_s_unsited_journal_pieces_name_the_entries_built_from_journals(steps):
    """Whatever a log does (follow journals that others also append to, log
    entries of its own, be read, be frozen), the journals' pieces it hands
    over for the edited sites (``take_unsited``), each given once, name
    exactly the entries it builds from the journals, in order."""
    journals: list[list[int]] = [[], [], []]
    log = EditLog()
    pieces: list[tuple[list[int], int, tuple[Any, ...]]] = []
    frozen = False
    for step in steps:
        if step[0] == "follow" and not frozen:
            _, which, token, count = step
            log.follow(journals[which], token, 4,
                       [(f"e{which}", layer, "residual_stream") for layer in range(count)])
        elif step[0] == "shift":
            _, which, shift = step
            journals[which].append((journals[which] or [0])[-1] + shift)
        elif step[0] == "entry" and not frozen:
            log.append(AppliedEdit("own", 0, step[1], None, "mlp_out"))
        elif step[0] == "take":
            pieces += log.take_unsited()
        elif step[0] == "read":
            list(log)
        elif step[0] == "freeze":
            log.freeze()
            frozen = True
    log.freeze()
    pieces += log.take_unsited()
    assert log.take_unsited() == []
    named = [(name, layer, token_index + shift, tensor_type)
             for shifts, token_index, sites in pieces for shift in shifts
             for name, layer, tensor_type in sites]
    built = [(entry.edit_name, entry.layer, entry.token_index, entry.tensor_type)
             for entry in log if entry.edit_name != "own"]
    assert named == built


def test_windows_that_start_at_a_moved_layout_admit_the_next_one_at_its_own_shift(
        monkeypatch):
    """Windows of three steps each: a later window starts at a layout moved
    after a change of edits and admits the next change's layout, moved from
    the same first one; each row is at its own token, as the oracle (each
    step planned and routed as it comes) has it."""
    from undercurrent.adapters import delivery

    monkeypatch.setattr(delivery, "WINDOW_STEPS", 3)
    windows, taken, moved = Windows(monkeypatch), Taken(monkeypatch), _moves(monkeypatch)
    admitted: list[tuple[int, int]] = []  # (a moved point's shift, its window's first's)
    admits = delivery._Window.admits

    def counted(window: Any, layout: Any, limit: int) -> bool:
        fresh = layout is not window.layout and id(layout) not in window.sizes
        answer = admits(window, layout, limit)
        if answer and fresh:
            for point in layout.points:
                ref = window.refs[point.name]
                if point.origin[1] and ref.origin[1]:  # (both moved)
                    admitted.append((point.origin[1], ref.origin[1]))
        return answer

    monkeypatch.setattr(delivery._Window, "admits", counted)
    edits = [_edit("generated[2:4]"), _edit("generated[5:7]", name="late", layers=(0, 2))]
    point = _point("linear_probe")
    mine = _generate(point, windows=True, records=True, edits=edits)
    assert windows.steps == [3, 3, 3]
    taken.check()
    assert moved and all(moved)
    # (a window whose first layout was moved admitted a later one: both shifts
    # from the first layout, not from each other)
    assert any(shift != ref_shift for shift, ref_shift in admitted)
    monkeypatch.undo()
    _each_step(monkeypatch)
    theirs = _generate(point, windows=False, records=True, edits=edits)
    assert [_full_view(output) for output in mine] == [_full_view(output) for output in theirs]
