"""Decode steps routed in windows (``delivery._Window``): in a ``generate()``
call, the steps of one steady point, inline with probes that cannot abort or
async, are routed several at a time. The oracle is the same generation with each step
routed as it comes (``windows=False``, what ``stream()`` does): the same
tokens, signals in order, verdicts and counts, records included, while the
probes are called once per window. Scores are compared bit for bit: the
built-ins score each row on its own, whatever the height of the matrix it is
in (the linear readout sums each row on its own, not by a threaded BLAS product).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer  # noqa: E402
from test_hf_equivalence import PROMPTS  # noqa: E402

from tests.probes.sae_helpers import write_sae  # noqa: E402
from undercurrent.adapters import CaptureSession, SamplingParams, delivery  # noqa: E402
from undercurrent.adapters.hf.backend import HFBackend  # noqa: E402
from undercurrent.adapters.hf.backend import _RowDriver as HF_DRIVER  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.probes.base import ScoresRows  # noqa: E402
from undercurrent.probes.linear import LinearProbe  # noqa: E402
from undercurrent.probes.sae import SaeScreen  # noqa: E402
from undercurrent.probes.sae_files import SparseAutoencoder  # noqa: E402
from undercurrent.probes.statistics import NormProbe  # noqa: E402
from undercurrent.probes.trajectory import TrajectoryProbe  # noqa: E402
from undercurrent.records import ActivationRecord, BatchSignals, ProbeSignal  # noqa: E402
from undercurrent.router import Router  # noqa: E402
from undercurrent.spec.types import (  # noqa: E402
    ExtractionPoint,
    InterventionPolicy,
    ProbeKind,
    TensorType,
)
from undercurrent.steering.vectors import resolve_edits  # noqa: E402

MAX_NEW = 10
IDS = ["a", "b", "c"]
WEIGHT = [0.05 * ((i % 7) - 3) for i in range(32)]


def _point(probe_type: str = "linear_probe", *, action: str = "flag",
           mode: str = "inline", depth: int = 256, **probe_args: Any) -> ExtractionPoint:
    if probe_type in ("linear_probe", "trajectory_probe"):
        probe_args = {"weight": WEIGHT, "bias": 0.0, "threshold": 0.0, "action": action,
                      **probe_args}
    elif action != "flag":
        probe_args = {"action": action, **probe_args}
    return ExtractionPoint(name="watch", layers=(0, 1, 2), tensor_type="residual_stream",
                           position="generated[*]", probe_type=probe_type,
                           probe_kind="trajectory", execution_mode=mode,
                           queue_depth=depth if mode == "async" else None,
                           probe_args=probe_args)


class Windows:
    """Counts the windows routed and the rows and steps of each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[int] = []
        original = delivery._Window.route

        def route(window: Any, session: Any) -> None:
            self.steps.append(len(window.steps))
            original(window, session)

        monkeypatch.setattr(delivery._Window, "route", route)


def _generate(point: ExtractionPoint | list[ExtractionPoint], *, windows: bool,
              records: bool = False,
              eos: int | None = None, probes: dict[str, Any] | None = None,
              overflow: str = "block", forwards: list[float] | None = None,
              edits: list[Any] | None = None) -> list[Any]:
    """``forwards``: each forward's start time (``time.time()``) is appended;
    ``edits``: live edits (``Edit`` s, resolved here) for every request."""
    model = build_model("llama")  # one model per process: its eos is put back
    config = model.generation_config
    before = config.eos_token_id
    if eos is not None:
        config.eos_token_id = eos
    timed = None if forwards is None else model.register_forward_pre_hook(
        lambda *_: forwards.append(time.time()))
    try:
        backend = HFBackend(model, build_tokenizer())
        with Router(probes=probes or {}, default_overflow=overflow) as router:
            points = point if isinstance(point, list) else [point]
            resolved = () if not edits else resolve_edits(edits, hidden_size=len(WEIGHT))
            session = CaptureSession(router, points, keep_records=records, windows=windows,
                                     edits=resolved)
            return backend.generate(PROMPTS, IDS, SamplingParams(max_new_tokens=MAX_NEW),
                                    session)
    finally:
        config.eos_token_id = before
        if timed is not None:
            timed.remove()


def _view(output: Any) -> Any:
    signals = [(s.extraction_point_name, s.layer, s.token_index, s.generated_index,
                s.action, s.score, dict(s.signal.metadata))
               for s in output.signals]
    results = {name: (result.verdict, result.stats.received, result.stats.processed,
                      result.stats.dropped, result.stats.errors, result.error,
                      [(s.action, s.layer, s.token_index, s.score,
                        dict(s.metadata)) for s in result.signals])
               for name, result in output.results.items()}
    return list(output.token_ids), output.finish_reason, signals, results


def _record_view(record: ActivationRecord) -> Any:
    return (record.request_id, record.extraction_point_name, record.layer,
            record.token_index, record.generated_index, record.token_id,
            record.tensor.tolist(), record.edits)


@pytest.mark.parametrize("probe_type", ["linear_probe", "trajectory_probe", "norm_probe"])
def test_windows_give_what_routing_each_step_gives(monkeypatch, probe_type):
    """Every built-in that judges in groups: one window for the steady steps,
    and outputs equal to routing each step (signals with their scores and
    metadata, verdicts, counts)."""
    counted = Windows(monkeypatch)
    point = _point(probe_type) if probe_type != "norm_probe" else _point(
        "norm_probe", threshold=0.11)
    windowed = _generate(point, windows=True)
    assert len(counted.steps) == 1 and counted.steps[0] > 1  # the steady steps: one window
    stepped = _generate(point, windows=False)
    assert len(counted.steps) == 1  # routing each step: no window
    assert any(output.signals for output in stepped)
    assert any(s.action.value == "flag" for output in stepped for s in output.signals)
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]
    for output in windowed:
        result = output.results["watch"]
        assert result.stats.received == result.stats.processed == 3 * (MAX_NEW - 1)


@pytest.mark.parametrize("probe_type", ["linear_probe", "norm_probe"])
def test_held_steps_taken_as_they_come_give_what_the_general_path_gives(monkeypatch,
                                                                        probe_type):
    """After its first held step, a window takes each next steady step's rows as
    the hooks hand them over (``_Window.take``): the same windows, outputs and
    counts as when every step goes through the general path (``take`` refusing)."""
    point = _point(probe_type) if probe_type != "norm_probe" else _point(
        "norm_probe", threshold=0.11)
    taken: list[bool] = []
    plans: list[Any] = []
    original = delivery._Window.take

    def take(window: Any, session: Any, batches: Any) -> bool:
        plans.append(batches[0][1].plan)
        taken.append(original(window, session, batches))
        return taken[-1]

    monkeypatch.setattr(delivery._Window, "take", take)
    counted = Windows(monkeypatch)
    fast = _generate(point, windows=True)
    # MAX_NEW - 1 decode steps, all held in one window: the first starts it
    # (its plan made afresh), every later one is taken as it comes.
    assert counted.steps == [MAX_NEW - 1] and taken == [True] * (MAX_NEW - 2)
    # (one shifted plan, moved on from step to step once delivered: StepPlan.advanced)
    assert all(plan is plans[0] for plan in plans) and plans[0].base is not None
    monkeypatch.setattr(delivery._Window, "take", lambda *args: False)
    general = _generate(point, windows=True)
    assert counted.steps == [MAX_NEW - 1] * 2
    assert [_view(output) for output in fast] == [_view(output) for output in general]
    assert any(output.signals for output in fast)


def _abort_view(output: Any) -> Any:
    abort = output.abort
    return _view(output), None if abort is None else (
        abort.extraction_point_name, abort.layer, abort.token_index, abort.generated_index)


def _first_crossings(outputs: list[Any], threshold: float) -> dict[str, int | None]:
    """Each request's first generated index with a score at or above ``threshold``."""
    return {output.request_id: min((s.generated_index for s in output.signals
                                    if s.score >= threshold), default=None)
            for output in outputs}


@pytest.mark.parametrize("probe_type, screened", [("linear_probe", True),
                                                   ("linear_probe", False),
                                                   ("norm_probe", True),
                                                   ("norm_probe", False)])
def test_a_step_that_would_abort_is_routed_at_once_and_the_others_wait(monkeypatch,
                                                                       probe_type, screened):
    """Probes that may abort, but tell from a step's values whether it would
    (``ScoresRows.abort_test``): the steps are held in windows as for probes that
    cannot abort, and the step that aborts is routed as it comes, after those
    held. The outputs are those of routing each step: the same tokens, abort
    (at the same token), signals, verdicts and counts, with fewer routings.
    Without a screen (``ScoresRows.signal_screen``), each step's values are
    computed as it comes and reused by its window; a linear probe's screen
    clears most steps before any value is computed, and their window's values
    are computed at once (a norm probe's screen does the same)."""
    kind = LinearProbe if probe_type == "linear_probe" else NormProbe
    if not screened:
        monkeypatch.setattr(kind, "signal_screen",
                            classmethod(lambda cls, probes, actions: None))
    point = _point(probe_type, threshold=_guard_threshold(probe_type), action="abort")
    routed: list[int] = []
    original = Router.route_columns

    def route_columns(router: Any, batch: Any, spans: Any = None) -> Any:
        routed.append(len(batch))
        return original(router, batch, spans)

    monkeypatch.setattr(Router, "route_columns", route_columns)
    computed: list[int] = []  # the rows of each batch whose values were computed
    values_of = kind.row_values

    def row_values(probe: Any, batch: Any) -> Any:
        computed.append(len(batch))
        return values_of(probe, batch)

    monkeypatch.setattr(kind, "row_values", row_values)
    counted = Windows(monkeypatch)
    windowed = _generate(point, windows=True)
    held, windowed_routings = list(counted.steps), len(routed)
    if screened:  # (steps cleared by the screen: a window's values computed at once)
        assert computed and max(computed) > 3 * len(IDS)
    else:  # each step's values computed once, when it was held: never a window's again
        assert computed and max(computed) <= 3 * len(IDS)
    stepped = _generate(point, windows=False)
    assert counted.steps == held  # routing each step held none
    assert held and max(held) > 1
    assert windowed_routings < len(routed) - windowed_routings
    aborted = [output for output in stepped if output.abort is not None]
    assert aborted and len(aborted) < len(stepped)
    assert all(output.finish_reason == "abort" for output in aborted)
    assert [_abort_view(output) for output in windowed] == [
        _abort_view(output) for output in stepped]


@pytest.mark.parametrize("statistic, source", [("ewma", "linear"), ("mean", "linear"),
                                               ("max", "linear"), ("ewma", "norm")])
def test_a_running_statistic_that_may_abort_is_held_while_no_row_can_reach_it(
        monkeypatch, statistic, source):
    """``trajectory_probe`` may abort on a running statistic (the state earlier
    rows left). Its steps are held in windows while no statistic can reach the
    threshold (``RunningBound``: the largest statistic held and the largest
    value asked of since; for norms, read from the captured pieces by its
    screen), and routed as they come once one may: with a threshold above
    every statistic, every step is held; with one some requests reach
    mid-way, the steps before are held and the aborts, signals and verdicts
    are what routing each step gives."""
    args: dict[str, Any] = {"statistic": statistic}
    if source == "norm":
        args.update(source="norm", weight=None, bias=None)
    watched = _generate(_point("trajectory_probe", **args, threshold=None), windows=False)
    scores = sorted(s.score for output in watched for s in output.signals)
    counted = Windows(monkeypatch)
    above = _point("trajectory_probe", **args, threshold=scores[-1] + 1.0, action="abort")
    computed: list[int] = []
    row_values = TrajectoryProbe.row_values
    monkeypatch.setattr(TrajectoryProbe, "row_values", lambda probe, batch: (
        computed.append(len(batch)), row_values(probe, batch))[1])
    windowed = _generate(above, windows=True)
    assert sum(counted.steps) == MAX_NEW - 1  # (every decode step held)
    # Norms are screened on the pieces: the values are computed once, the
    # window's; scores are computed for each step's test (and kept).
    assert len(computed) == (1 if source == "norm" else MAX_NEW - 1), computed
    monkeypatch.setattr(TrajectoryProbe, "row_values", row_values)
    assert all(output.abort is None for output in windowed)
    assert [_view(output) for output in windowed] == [
        _view(output) for output in _generate(above, windows=False)]
    counted.steps.clear()
    # (the highest peak of any request: that request reaches it, the others not)
    peaks = sorted(max(s.score for s in output.signals) for output in watched)
    assert peaks[-2] < peaks[-1]
    reached = _point("trajectory_probe", **args, threshold=peaks[-1], action="abort")
    windowed = _generate(reached, windows=True)
    held = list(counted.steps)
    stepped = _generate(reached, windows=False)
    assert counted.steps == held  # (routing each step held none)
    aborted = [output for output in stepped if output.abort is not None]
    assert aborted and len(aborted) < len(stepped)
    assert [_abort_view(output) for output in windowed] == [
        _abort_view(output) for output in stepped]


def test_a_window_is_judged_before_a_request_ends_mid_generation(monkeypatch):
    """A request that ends early (its eos) is judged before it ends: the window
    is routed when the steady layout is left, and the other requests go on."""
    first = _generate(_point(), windows=False)
    tokens = {output.request_id: list(output.token_ids) for output in first}
    # An eos that request "a" samples mid-way, before any other request does.
    index, eos = next((index, token) for index, token in enumerate(tokens["a"][2:], 2)
                      if all(token not in tokens[other][:index + 1] for other in ("b", "c")))
    assert index < MAX_NEW - 1
    counted = Windows(monkeypatch)
    windowed = _generate(_point(), windows=True, eos=eos)
    stepped = _generate(_point(), windows=False, eos=eos)
    by_id = {output.request_id: output for output in windowed}
    assert by_id["a"].finish_reason == "eos" and len(by_id["a"].token_ids) == index + 1
    assert any(output.finish_reason == "length" for output in windowed)
    assert len(counted.steps) >= 1
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]


def test_windows_hold_at_most_window_steps(monkeypatch):
    """A window is routed once it holds WINDOW_STEPS steps: several windows,
    the same outputs."""
    monkeypatch.setattr(delivery, "WINDOW_STEPS", 3)
    counted = Windows(monkeypatch)
    windowed = _generate(_point(), windows=True)
    assert len(counted.steps) >= 2 and max(counted.steps) == 3
    stepped = _generate(_point(), windows=False)
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]


def test_records_are_kept_with_their_window_and_their_own_step_s_time(monkeypatch):
    """records=True: the records of a window's steps are kept with the window
    (rows of its one batch), and are the records routing each step keeps; each
    carries the time its own step was captured, not the window's: after the
    forward that captured it started and before the next one did."""
    counted = Windows(monkeypatch)
    forwards: list[float] = []
    windowed = _generate(_point(), windows=True, records=True, forwards=forwards)
    stepped = _generate(_point(), windows=False, records=True)
    assert counted.steps == [MAX_NEW - 1]
    assert len(forwards) == MAX_NEW
    for mine, theirs in zip(windowed, stepped, strict=True):
        assert len(mine.records) == len(theirs.records) == 3 * (MAX_NEW - 1)
        assert [_record_view(r) for r in mine.records] == [
            _record_view(r) for r in theirs.records]
        for record in mine.records:
            # generated token g is fed, and captured, by forward g + 1
            fed_by = record.generated_index + 1
            assert forwards[fed_by] <= record.timestamp
            if fed_by + 1 < len(forwards):
                assert record.timestamp <= forwards[fed_by + 1]
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]


@pytest.mark.parametrize("windows", [True, False])
@pytest.mark.parametrize("points", ["one", "several", "capture"])
def test_the_records_of_one_output_keep_its_own_rows_alive_not_its_batch_s(windows, points):
    """records=True: the records of one output kept (the others dropped) keep
    alive its own activations, not every request's of its batch: its rows are
    copied out of the batches it shares with the others (a window's steps of
    every request are one tensor) when it ends."""
    point = {"one": _point(), "capture": _point("capture"),
             "several": [_point(), _named("mlp", _point(), tensor_type="mlp_out")]}[points]
    outputs = _generate(point, windows=windows, records=True)
    kept = outputs[0].records
    del outputs
    gc.collect()
    own = sum(record.tensor.nelement() * record.tensor.element_size() for record in kept)
    storages = {record.tensor.untyped_storage().data_ptr(): record.tensor.untyped_storage()
                for record in kept}
    assert len(kept) == 3 * (MAX_NEW - 1) * (2 if points == "several" else 1)
    assert sum(storage.nbytes() for storage in storages.values()) == own


def _named(name: str, point: ExtractionPoint, **fields: Any) -> ExtractionPoint:
    """``point`` renamed (a spec's points need distinct names), with ``fields`` changed."""
    return dataclasses.replace(point, name=name, **fields)


def _guard_threshold(probe_type: str) -> float:
    """An abort threshold for ``_point(probe_type)`` that one request crosses
    from its third generated token on at the earliest and another never does
    (else a test of it would prove nothing)."""
    watch = {"threshold": None} if probe_type == "linear_probe" else {}
    scores = _generate(_point(probe_type, **watch), windows=False)
    candidates = sorted({s.score for output in scores for s in output.signals})
    threshold = next((value for value in candidates
                      if None in (found := _first_crossings(scores, value)).values()
                      and any(index is not None and index >= 2 for index in found.values())),
                     None)
    assert threshold is not None, "no threshold aborts one request mid-generation"
    return threshold


class Routed:
    """Counts the points of each window routed, and the routings of each point."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.windows: list[tuple[int, int]] = []  # (points, steps) per window
        self.routings: dict[str, int] = {}
        self.taken: list[bool] = []  # what _Window.take answered, step by step
        route, route_columns = delivery._Window.route, Router.route_columns
        take = delivery._Window.take

        def counted_take(window: Any, session: Any, batches: Any) -> bool:
            self.taken.append(take(window, session, batches))
            return self.taken[-1]

        def counted_route(window: Any, session: Any) -> None:
            self.windows.append((len(window.layout.points), len(window.steps)))
            route(window, session)

        def counted_columns(router: Any, batch: Any, spans: Any = None) -> Any:
            name = batch.point_names[0]
            self.routings[name] = self.routings.get(name, 0) + 1
            return route_columns(router, batch, spans)

        monkeypatch.setattr(delivery._Window, "route", counted_route)
        monkeypatch.setattr(delivery._Window, "take", counted_take)
        monkeypatch.setattr(Router, "route_columns", counted_columns)


@pytest.mark.parametrize("records", [False, True])
def test_several_points_are_held_together_and_give_what_routing_each_step_gives(
        monkeypatch, records):
    """The demo spec's shape, a guard that aborts a request mid-generation and
    an async observer of the same rows, with an inline point on fewer layers
    and an async one of another tensor type beside them: the steps of all four
    are held in windows together (taken as the hooks hand them over), and the
    step that aborts is routed at once. Outputs equal routing each step: the
    tokens, the abort and its token, every point's signals in (layer, point)
    order within a token, verdicts, counts and records, with fewer routings."""
    guard = _named("guard", _point(threshold=_guard_threshold("linear_probe"),
                                   action="abort"))
    observer = _named("observer", _point("trajectory_probe", mode="async", depth=64))
    narrow = _named("narrow", _point("norm_probe", threshold=0.11), layers=(1,))
    mlp = _named("mlp", _point("norm_probe", mode="async", depth=64), layers=(0, 2),
                 tensor_type=TensorType.MLP_OUT)
    points = [guard, observer, narrow, mlp]
    counted = Routed(monkeypatch)
    windowed = _generate(points, windows=True, records=records)
    windows, routings = list(counted.windows), dict(counted.routings)
    assert counted.taken.count(True) > 1  # (held steps taken as they came)
    counted.windows.clear()
    counted.routings.clear()
    stepped = _generate(points, windows=False, records=records)
    assert counted.windows == []  # (routing each step holds nothing)
    assert windows and all(width == 4 for width, _ in windows)
    assert max(steps for _, steps in windows) > 1
    for name in ("guard", "observer", "narrow", "mlp"):
        assert routings[name] < counted.routings[name], name
    aborted = [output for output in stepped if output.abort is not None]
    assert aborted and len(aborted) < len(stepped)
    assert [_abort_view(output) for output in windowed] == [
        _abort_view(output) for output in stepped]
    # Both inline points signal, so the order across points within a token is tested.
    assert {s.extraction_point_name for output in stepped for s in output.signals} == {
        "guard", "narrow"}
    for mine, theirs in zip(windowed, stepped, strict=True):
        if records:
            assert len(mine.records) == len(theirs.records) > 0
            assert [_record_view(r) for r in mine.records] == [
                _record_view(r) for r in theirs.records]
            assert {r.extraction_point_name for r in mine.records} == {
                "guard", "observer", "narrow", "mlp"}
        for result in mine.results.values():
            assert result.stats.received == result.stats.processed > 0


def test_an_sae_guard_and_its_features_are_held_together_and_encode_each_row_once(
        monkeypatch, tmp_path):
    """The shipped SAE spec's shape (``specs/sae_features.yaml``): an inline
    ``sae_probe`` guard on watched features that aborts a request
    mid-generation, and an async ``sae_probe`` reporting the top features of
    the same rows. Both are held in windows, the guard's steps screened
    (``SaeScreen``) and the one that aborts routed at once; the two points
    share each window's encoding, so each row is encoded once, not once per
    point. Outputs equal routing each step, bit for bit (each row's product
    is the same whatever batch it is in)."""
    write_sae(tmp_path / "sae", architecture="topk", d_in=32, d_sae=24, seed=11,
              hook_name=None, config={"k": 6})
    sae = {"path": str(tmp_path / "sae"), "check_hook": False}
    watch = _named("guard", _point("sae_probe", features=[1, 6], **sae))
    scores = _generate(watch, windows=False)
    candidates = sorted({s.score for output in scores for s in output.signals})
    threshold = next(value for value in candidates
                     if None in (found := _first_crossings(scores, value)).values()
                     and any(index is not None and index >= 2 for index in found.values()))
    guard = _named("guard", _point("sae_probe", action="abort", features=[1, 6],
                                   threshold=threshold, **sae))
    features = _named("features", _point("sae_probe", mode="async", depth=64, top_k=3, **sae))
    points = [guard, features]
    encoded: list[int] = []
    screened: list[bool] = []
    encode, screen = SparseAutoencoder.encode_sparse, SaeScreen.__call__

    def counted_encode(self: Any, matrix: Any) -> Any:
        encoded.append(len(matrix))
        return encode(self, matrix)

    def counted_screen(self: Any, pieces: Any) -> bool:
        screened.append(screen(self, pieces))
        return screened[-1]

    monkeypatch.setattr(SparseAutoencoder, "encode_sparse", counted_encode)
    monkeypatch.setattr(SaeScreen, "__call__", counted_screen)
    counted = Routed(monkeypatch)
    windowed = _generate(points, windows=True, records=True)
    rows = sum(output.results["features"].stats.received for output in windowed)
    assert counted.windows and all(width == 2 for width, _ in counted.windows)
    assert max(steps for _, steps in counted.windows) > 1
    assert False in screened and True in screened  # (cleared steps, and the one that aborts)
    # each held row encoded once for both points (the steps a screen sent on, again)
    assert sum(encoded) < 2 * rows, (sum(encoded), rows)
    counted.windows.clear()
    stepped = _generate(points, windows=False, records=True)
    assert counted.windows == []
    aborted = [output for output in stepped if output.abort is not None]
    assert aborted and len(aborted) < len(stepped)
    assert [_abort_view(output) for output in windowed] == [
        _abort_view(output) for output in stepped]
    for mine, theirs in zip(windowed, stepped, strict=True):
        assert [_record_view(r) for r in mine.records] == [
            _record_view(r) for r in theirs.records]
        assert mine.results["features"].signals  # (the async point's own signals compared)


def _as_planned_afresh(monkeypatch: pytest.MonkeyPatch, counted: Routed, points: Any,
                       windowed: list[Any]) -> None:
    """The oracle of the layouts a driver repeats: the same generation with every
    step planned afresh from the points' positions and routed as it comes
    gives the same outputs and records as ``windowed``."""
    counted.windows.clear()
    monkeypatch.setattr(HF_DRIVER, "repeat_plans", False)
    stepped = _generate(points, windows=False, records=True)
    assert counted.windows == []
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]
    for mine, theirs in zip(windowed, stepped, strict=True):
        assert [_record_view(r) for r in mine.records] == [
            _record_view(r) for r in theirs.records]


@pytest.mark.parametrize("position", ["prompt[-1]", "prompt[-1]+1", "generated[0:3]"])
def test_points_that_end_let_the_others_be_held_once_they_have(monkeypatch, position):
    """A point of one token (the last prompt token, the first generated one) or
    of a bounded slice, beside one on every generated token: once it has read
    its last token the other's steps are held in windows (a plan holding its
    captures is never repeated past them; a slice's steps are held with the
    other's while it lasts), with the outputs of routing each step."""
    counted = Routed(monkeypatch)
    points = [_point(), _named("once", _point("norm_probe", threshold=0.11), layers=(2,),
                               position=position)]
    windowed = _generate(points, windows=True, records=True)
    assert counted.windows and max(steps for _, steps in counted.windows) > 1
    assert counted.windows[-1][0] == 1  # (the point left, once the other has ended)
    if position.startswith("generated"):  # (a slice: both held while it lasts)
        assert counted.windows[0][0] == 2
    assert any(s.extraction_point_name == "once" for output in windowed
               for s in output.signals)
    _as_planned_afresh(monkeypatch, counted, points, windowed)


@pytest.mark.parametrize("mode", ["inline", "async"])
def test_strided_points_are_held_a_stride_apart(monkeypatch, mode):
    """Points of one stride and phase (every second generated token from the
    second on): the plan is repeated a stride later, nothing is planned for the
    tokens between, and the matching steps are held in windows. The oracle
    plans and routes every step afresh: the same captures, signals, verdicts
    and records."""
    counted = Routed(monkeypatch)
    points = [_named("a", _point(mode=mode), position="generated[1:]", stride=2),
              _named("b", _point("norm_probe", threshold=0.11), layers=(1,),
                     position="generated[3:]", stride=2)]
    windowed = _generate(points, windows=True, records=True)
    assert counted.windows and max(steps for _, steps in counted.windows) > 1
    _as_planned_afresh(monkeypatch, counted, points, windowed)
    for mine in windowed:
        # generated 1, 3, 5, 7 of the 9 fed back, on 3 layers; from 3 on, on 1 layer
        assert sorted((r.extraction_point_name, r.generated_index) for r in mine.records
                      if r.layer == 1) == [("a", 1), ("a", 3), ("a", 5), ("a", 7),
                                          ("b", 3), ("b", 5), ("b", 7)]


@pytest.mark.parametrize("stride", [1, 2])
def test_a_slice_is_held_until_it_ends(monkeypatch, stride):
    """A bounded slice (generated 1 to 6): its plan is repeated until the
    slice's last token, never past it, and its steps are held in windows; the
    oracle plans and routes every step afresh."""
    counted = Routed(monkeypatch)
    point = _named("slice", _point(), position="generated[1:7]", stride=stride)
    windowed = _generate(point, windows=True, records=True)
    assert counted.windows and max(steps for _, steps in counted.windows) > 1
    _as_planned_afresh(monkeypatch, counted, point, windowed)
    for mine in windowed:
        assert sorted({r.generated_index for r in mine.records}) == list(range(1, 7, stride))




class FlagsOnly(Probe):
    """A probe written per record: the router cannot know it never aborts."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def on_activation(self, record: ActivationRecord) -> ProbeSignal:
        return ProbeSignal(score=float(record.tensor[0]),
                           metadata={"token_id": record.token_id,
                                     "generated_index": record.generated_index})


def test_several_points_wait_for_the_one_that_cannot(monkeypatch):
    """Where one point's steps must be routed as they come (a probe written per
    record, which the router cannot know never aborts), no step of the others
    waits either: no window."""
    counted = Routed(monkeypatch)
    points = [_named("flag", _point()), _named("guard", _point("flags_only"))]
    probes = {"flags_only": FlagsOnly}
    windowed = _generate(points, windows=True, probes=probes)
    assert counted.windows == []
    assert [_view(output) for output in windowed] == [
        _view(output) for output in _generate(points, windows=False, probes=probes)]


@pytest.mark.parametrize("probe_type, probes", [
    ("trajectory_probe", None), ("flags_only", {"flags_only": FlagsOnly}),
], ids=["trajectory", "user-probe"])
def test_async_windows_queue_what_routing_each_step_queues(monkeypatch, probe_type, probes):
    """An async point, any probe: a window holds half a queue (queue_depth 24,
    3 layers: 4 steps), or more where the queue is free then, never more than
    the queue (8 steps). The first window finds the queues empty (nothing was
    queued before it), so it holds 8 steps. Under ``block`` (nothing dropped,
    however the workers keep up) the workers' observations, verdicts and counts
    are those of queueing each step."""
    counted = Windows(monkeypatch)
    point = _point(probe_type, mode="async", depth=24)
    windowed = _generate(point, windows=True, probes=probes)
    assert counted.steps[0] == 8 and len(counted.steps) > 1, counted.steps
    assert max(counted.steps) == 8 and min(counted.steps[:-1]) >= 4, counted.steps
    stepped = _generate(point, windows=False, probes=probes)
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]
    for output in windowed:
        stats = output.results["watch"].stats
        assert stats.received == stats.processed == 3 * (MAX_NEW - 1) and stats.dropped == 0
        assert output.results["watch"].signals


@pytest.mark.parametrize("overflow", ["drop_oldest", "drop_newest"])
def test_async_windows_under_a_drop_policy_count_every_row(monkeypatch, overflow):
    """Under a drop policy a window's rows go to the queue as a step's do: every
    row is counted received, and processed or dropped (how many a worker keeps
    up with depends on the machine)."""
    counted = Windows(monkeypatch)
    outputs = _generate(_point("trajectory_probe", mode="async", depth=24), windows=True,
                        overflow=overflow)
    assert counted.steps[0] == 8 and max(counted.steps) == 8, counted.steps
    for output in outputs:
        stats = output.results["watch"].stats
        assert stats.received == 3 * (MAX_NEW - 1) == stats.processed + stats.dropped


@pytest.mark.parametrize("room, expected", [(0, [4, 4, 1]), (13, [4, 4, 1]),
                                           (15, [5, 4]), (24, [8, 1])])
def test_an_async_window_grows_only_into_free_room(monkeypatch, room, expected):
    """A window that reaches half the queue (4 steps of 3 rows) grows to as
    many steps as the queues have room for then (``Router.window_room``, read
    when it gets there), never less than it holds, never past WINDOW_STEPS;
    the rows and counts are those of routing each step."""
    counted = Windows(monkeypatch)
    asked: list[tuple[str, list[str]]] = []

    def window_room(router: Router, name: str, request_ids: list[str]) -> int:
        asked.append((name, sorted(request_ids)))
        return room

    monkeypatch.setattr(Router, "window_room", window_room)
    point = _point("trajectory_probe", mode="async", depth=24)
    windowed = _generate(point, windows=True, overflow="block")
    assert counted.steps == expected
    assert asked and all(entry == ("watch", sorted(IDS)) for entry in asked), asked
    stepped = _generate(point, windows=False, overflow="block")
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]


@pytest.mark.parametrize("rooms, expected", [(None, None), ([8, 5], [1] * (MAX_NEW - 1)),
                                             ([5], [])])
def test_an_async_window_of_one_step_grows_where_two_fit(monkeypatch, rooms, expected):
    """Half the queue holds one step (queue_depth 8, 3 layers: 4 rows), the
    whole queue two: a window holds one step and grows to two where the queues
    have room for them when it is full (the first window finds them empty).
    Where they have room for one step only when a window is full (a worker
    behind), it is routed at once; where they have room for one step only at
    the first step, every step is routed as it comes. Either way the rows and
    counts are those of routing each step."""
    counted = Windows(monkeypatch)
    if rooms is not None:  # (the room read at the first step, then each time a window fills)
        asked = iter(range(1000))
        monkeypatch.setattr(Router, "window_room", lambda router, name, ids: rooms[
            min(next(asked), len(rooms) - 1)])
    point = _point("trajectory_probe", mode="async", depth=8)
    windowed = _generate(point, windows=True, overflow="block")
    if rooms is None:  # the workers may lag: a window of one step where they do
        assert counted.steps[0] == 2 and max(counted.steps) == 2, counted.steps
        assert sum(counted.steps) == MAX_NEW - 1
    else:
        assert counted.steps == expected
    stepped = _generate(point, windows=False, overflow="block")
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]
    for output in windowed:
        stats = output.results["watch"].stats
        assert stats.received == stats.processed == 3 * (MAX_NEW - 1) and stats.dropped == 0


def test_the_router_says_how_much_room_the_queues_have():
    """``Router.window_room``: the least free room over the requests' async
    queues (capacity less what is queued), unbounded without one, 0 for a
    request that is not live. Rows queued inside ``step()`` wait for the
    workers until the step ends, so the room read there is exact."""
    rows_of = {"a": 3, "b": 1}
    with Router() as router:
        router.register_request("a", [_point("trajectory_probe", mode="async", depth=24)])
        router.register_request("b", [_point("trajectory_probe", mode="async", depth=10)])
        router.register_request("inline", [_point()])
        assert router.window_room("watch", ["a", "b"]) == 10
        assert router.window_room("watch", ["inline"]) == sys.maxsize
        assert router.window_room("watch", ["a", "gone"]) == 0
        with router.step():
            for request_id, count in rows_of.items():
                records = [ActivationRecord(
                    request_id=request_id, extraction_point_name="watch", layer=0,
                    tensor_type="residual_stream", token_index=5 + row, is_generated=True,
                    generated_index=row, token_id=1, tensor=torch.ones(32)) for row in range(count)]
                router.route_batch(records)
            assert router.window_room("watch", ["a"]) == 21
            assert router.window_room("watch", ["a", "b", "inline"]) == 9
            router._requests["b"].bindings["watch"].close()  # a closed queue takes nothing
            assert router.window_room("watch", ["a", "b"]) == 0
            assert router.window_room("watch", ["a", "inline"]) == 21
        # The same requests asked of again once one ended, then came back: its
        # binding as it is now (the bindings found before are not kept past it).
        router.end_request("b")
        assert router.window_room("watch", ["a", "b"]) == 0
        router.register_request("b", [_point("trajectory_probe", mode="async", depth=4)])
        assert router.window_room("watch", ["b", "a"]) == 4
        assert router.window_room("watch", ["a", "b"]) == 4


@pytest.mark.parametrize("point, probes", [
    (_point(action="abort"), None),
    (_point("flags_only"), {"flags_only": FlagsOnly}),
    (_point(mode="async", depth=5), None),
], ids=["abort", "user-probe", "async-small-queue"])
def test_no_window_where_a_step_must_be_routed_before_the_next(monkeypatch, point, probes):
    """A probe that may abort (a threshold with ``action: abort``), an inline
    user probe (the router cannot know it never aborts) and an async point
    whose queue holds less than two steps (queue_depth 5, 3 layers): every
    step is routed as it comes."""
    counted = Windows(monkeypatch)
    outputs = _generate(point, windows=True, probes=probes)
    assert counted.steps == []
    assert all(output.results["watch"].stats.received > 0 for output in outputs)
    if point.probe_args.get("action") == "abort":
        assert any(output.finish_reason == "abort" for output in outputs)


def test_the_router_says_how_many_rows_may_wait():
    """``Router.window_rows``: no limit inline (judged in a group, cannot
    abort), half the queue async, 0 otherwise."""
    unbounded = sys.maxsize
    points = {"flag": _point(), "abort": _point(action="abort"),
              "async": _point(mode="async", depth=40), "none": _point(threshold=None),
              "user": _point("flags_only"),
              "blocking": ExtractionPoint(
                  name="watch", layers=(0,), tensor_type="residual_stream",
                  position="generated[*]", probe_type="linear_probe",
                  probe_kind="trajectory",
                  intervention=InterventionPolicy(mode="block_until_signal", timeout_ms=50),
                  probe_args={"weight": WEIGHT, "bias": 0.0})}
    expected = {"flag": unbounded, "abort": 0, "async": 20, "none": unbounded, "user": 0,
                "blocking": 0}
    with Router(probes={"flags_only": FlagsOnly}) as router:
        for key, point in points.items():
            router.register_request(key, [point])
            assert router.window_rows("watch", [key]) == expected[key], key
        assert router.window_rows("watch", ["flag", "none"]) == unbounded
        assert router.window_rows("watch", ["flag", "async"]) == 20
        assert router.window_rows("watch", ["flag", "abort"]) == 0
        assert router.window_rows("watch", ["flag", "never-registered"]) == 0
        assert router.window_rows("other", ["flag"]) == 0


def _rows_batch(request_ids: list[str], rows: Any) -> Any:
    from undercurrent.records import ActivationBatch

    count = len(request_ids)
    return ActivationBatch(rows, request_ids=request_ids, point_names=["watch"] * count,
                           layers=[0] * count, tensor_type="residual_stream",
                           token_indices=[5] * count, is_generated=[True] * count,
                           generated_indices=[0] * count, token_ids=[1] * count)


def test_the_router_tells_whether_routing_a_batch_would_abort():
    """``Router.abort_guard``: for inline probes that may abort and tell it
    from the values (linear and norm probes), whether some row reaches the
    threshold, the values kept on the batch for its routing; for a running
    statistic, a bound; None for a probe that cannot tell (a user probe, a
    subclass), for async points, for a request not live; True where the values
    fail."""
    weight = torch.tensor(WEIGHT)
    points = {"abort": _point(threshold=0.5, action="abort"),
              "norm": _point("norm_probe", threshold=2.0, action="abort"),
              "trajectory": _point("trajectory_probe", threshold=0.5, action="abort"),
              "user": _point("flags_only"), "async": _point(mode="async", depth=40)}
    with Router(probes={"flags_only": FlagsOnly}) as router:
        for key, point in points.items():
            for request in (key, f"{key}-2"):
                router.register_request(request, [point])
        ids = ["abort", "abort-2"]
        guard = router.abort_guard("watch", ids)
        assert guard is not None
        below = torch.stack([-weight, -weight])  # sigmoid(-|w|^2) < 0.5 for both rows
        above = torch.stack([-weight, weight])
        batch = _rows_batch(ids, above)
        assert guard(_rows_batch(ids, below)) is False
        assert guard(batch) is True
        assert batch.cache  # the scores, computed once for its routing
        assert router.route_columns(batch).any_abort()
        norm = router.abort_guard("watch", ["norm", "norm-2"])
        assert norm is not None
        assert norm(_rows_batch(["norm", "norm-2"], torch.ones(2, 32) * 0.1)) is False
        assert norm(_rows_batch(["norm", "norm-2"], torch.ones(2, 32))) is True
        # A running statistic: a bound, from what the probes hold and every
        # step asked of since (those held are judged later).
        running = ["trajectory", "trajectory-2"]
        bound = router.abort_guard("watch", running)
        assert bound is not None
        assert bound(_rows_batch(running, below)) is False
        high = _rows_batch(running, above)
        assert bound(high) is True
        assert bound(_rows_batch(running, below)) is True  # (the high step is not judged yet)
        assert router.route_columns(high).any_abort()
        fresh = router.abort_guard("watch", running)
        assert fresh is not None and fresh(_rows_batch(running, below)) is True  # (held now)
        for key in ("user", "async"):
            assert router.abort_guard("watch", [key, f"{key}-2"]) is None, key
        assert router.abort_guard("watch", ["abort", "norm"]) is None  # two classes
        assert router.abort_guard("watch", ["abort", "never-registered"]) is None
        # values that cannot be computed (the wrong width): routed now, to count the error
        assert guard(_rows_batch(ids, torch.ones(2, 7))) is True


def test_the_router_tells_whether_routing_a_batch_would_give_a_signal_of_some_action():
    """``Router.signal_guard``: the same test for the actions asked (a ``flag``
    that switches an edit on, say): a probe whose rule flags answers for
    ``flag`` and never for ``abort``, and for both where both are asked; a
    probe whose rule aborts never answers for ``flag`` alone; a norm probe
    screens a step's pieces, a running statistic is bounded; a probe written
    per record gets no guard."""
    from undercurrent.records import SignalAction

    flag, abort = frozenset({SignalAction.FLAG}), frozenset({SignalAction.ABORT})
    weight = torch.tensor(WEIGHT)
    below = torch.stack([-weight, -weight])
    above = torch.stack([-weight, weight])
    points = {"flags": _point(threshold=0.5), "aborts": _point(threshold=0.5, action="abort"),
              "norm": _point("norm_probe", threshold=2.0),
              "trajectory": _point("trajectory_probe", threshold=0.5),
              "user": _point("flags_only")}
    with Router(probes={"flags_only": FlagsOnly}) as router:
        for key, point in points.items():
            for request in (key, f"{key}-2"):
                router.register_request(request, [point])
        flags = ["flags", "flags-2"]
        for actions, fires in ((flag, True), (abort, False), (flag | abort, True)):
            guard = router.signal_guard("watch", flags, actions)
            assert guard is not None
            assert guard(_rows_batch(flags, below)) is False
            assert guard(_rows_batch(flags, above)) is fires, actions
        aborts = ["aborts", "aborts-2"]
        never = router.signal_guard("watch", aborts, flag)
        assert never is not None and never(_rows_batch(aborts, above)) is False
        assert never.screen is not None and never.screen([above]) is False  # (no value made)
        norm = ["norm", "norm-2"]
        screened = router.signal_guard("watch", norm, flag)
        assert screened is not None and screened.screen is not None
        assert screened(_rows_batch(norm, torch.ones(2, 32))) is True
        assert screened(_rows_batch(norm, torch.ones(2, 32) * 0.1)) is False
        running = ["trajectory", "trajectory-2"]
        bound = router.signal_guard("watch", running, flag)
        assert bound is not None and bound(_rows_batch(running, below)) is False
        assert bound(_rows_batch(running, above)) is True
        assert router.signal_guard("watch", ["user", "user-2"], flag) is None
        assert router.signal_guard("watch", ["user", "user-2"], abort) is None
        # (abort_guard is signal_guard for abort alone)
        assert router.abort_guard("watch", flags)(_rows_batch(flags, above)) is False



class Interrupted(Exception):
    """Raised by the first result callback."""


def test_held_steps_are_judged_before_an_error_ends_the_requests(monkeypatch):
    """The first request's end routes the window; its result callback raises,
    and the others are ended by ``abandon``: every captured row was judged and
    counted, none lost with the window."""
    counted = Windows(monkeypatch)
    seen: list[Any] = []

    def fail(result: Any) -> None:
        seen.append(result)
        raise Interrupted("the first result callback fails")

    backend = HFBackend(build_model("llama"), build_tokenizer())
    with Router() as router:
        session = CaptureSession(router, [_point()], windows=True, on_result=fail)
        with pytest.raises(Interrupted):
            backend.generate(PROMPTS, IDS, SamplingParams(max_new_tokens=MAX_NEW), session)
        totals = router.metrics()["totals"]
        assert router.metrics()["live_requests"] == 0
    assert len(counted.steps) == 1 and len(seen) == 1
    rows = 3 * 3 * (MAX_NEW - 1)  # 3 requests, 3 layers, every token fed back
    assert totals["received"] == totals["processed"] == rows and totals["dropped"] == 0


def test_an_interrupt_while_steps_are_held_still_ends_every_request(monkeypatch):
    """A KeyboardInterrupt between two held steps: ``abandon`` judges what was
    held (or, if that fails too, drops it) and ends every request."""
    calls = {"steps": 0}
    original = delivery._Window._add

    def add(*args: Any) -> None:  # (every step held comes here)
        calls["steps"] += 1
        if calls["steps"] == 3:
            raise KeyboardInterrupt
        original(*args)

    monkeypatch.setattr(delivery._Window, "_add", add)
    backend = HFBackend(build_model("llama"), build_tokenizer())
    with Router() as router:
        session = CaptureSession(router, [_point()], windows=True)
        with pytest.raises(KeyboardInterrupt):
            backend.generate(PROMPTS, IDS, SamplingParams(max_new_tokens=MAX_NEW), session)
        metrics = router.metrics()
    assert metrics["live_requests"] == 0
    totals = metrics["totals"]
    assert totals["received"] == totals["processed"] + totals["dropped"] > 0


@pytest.mark.parametrize("probe_type, mode, stacked", [
    ("capture", "inline", False), ("linear_probe", "inline", False),
    ("trajectory_probe", "inline", False), ("norm_probe", "async", False),
    ("flags_only", "async", True)])
def test_a_window_stacks_its_rows_only_for_a_probe_that_reads_them(monkeypatch, probe_type,
                                                                  mode, stacked):
    """A window's rows are stacked when first read (``records.DeferredRows``):
    ``capture`` judges without them; the built-ins that score rows one by one
    read the pieces the rows would be stacked from (``arrays.map_rows``), so
    the rows are never stacked either; a user probe reading its records gets
    them from stacked rows. The outputs equal routing each step."""
    from undercurrent import records as records_module

    made: list[int] = []
    original = records_module.DeferredRows.__init__

    def counting(self: Any, make: Any, pieces: Any = None) -> None:
        def counted() -> Any:
            made.append(1)
            return make()
        original(self, counted, pieces)

    monkeypatch.setattr(records_module.DeferredRows, "__init__", counting)
    counted = Windows(monkeypatch)
    probes = {"flags_only": FlagsOnly}
    point = (_point(probe_type, mode=mode) if probe_type != "norm_probe"
             else _point(probe_type, mode=mode, threshold=0.11))
    windowed = _generate(point, windows=True, probes=probes)
    assert len(counted.steps) >= 1 and bool(made) is stacked
    stepped = _generate(point, windows=False, probes=probes)
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]


def test_steps_values_are_laid_out_as_the_window_batch_s_rows():
    """``delivery._interleaved``: the values of each step (``count`` rows per
    request, request after request) in a window batch's order (each request's
    rows of every step in turn), for arrays (of rows of several values too),
    lists, and tuples and dicts of them."""
    np = pytest.importorskip("numpy")
    steps, requests, count = 3, 2, 2
    # (step, request, layer) of each row, as a step's rows come
    rows = [[(step, request, layer) for request in range(requests) for layer in range(count)]
            for step in range(steps)]
    code = [np.array([100 * s + 10 * r + k for s, r, k in step], dtype=np.float64)
            for step in rows]
    wide = [np.stack([values, -values], axis=1) for values in code]
    values = [(code[step], {"wide": wide[step], "where": rows[step]}) for step in range(steps)]
    laid = delivery._interleaved(values, requests, count)
    expected = [(s, r, k) for r in range(requests) for s in range(steps) for k in range(count)]
    assert laid[1]["where"] == expected
    assert laid[0].tolist() == [100.0 * s + 10 * r + k for s, r, k in expected]
    assert laid[1]["wide"].tolist() == [[v, -v] for v in laid[0].tolist()]


def test_steps_routed_as_they_come_keep_no_match_in_the_signal_logs():
    """Points of two strides (no steady layout: each decode step planned and
    routed as it comes): what a request's signal log keeps of each step is
    its rows' order, so no step's matches outlive its delivery (they would
    stay until the request's signals are read, for each full garbage
    collection to walk). The signals are those the steps gave."""
    import gc

    every = _point()
    second = dataclasses.replace(every, name="second", tensor_type=TensorType.MLP_OUT,
                                 layers=(1,), stride=2)
    outputs = _generate([every, second], windows=False)
    gc.collect()
    assert delivery.PlanMatch not in set(map(type, gc.get_objects()))
    for output in outputs:
        seen = [(s.extraction_point_name, s.generated_index) for s in output.signals]
        assert seen.count(("second", 0)) == 1 and ("second", 1) not in seen
        fed = len(output.token_ids) - 1  # (the last token sampled is never fed back)
        assert len(seen) == 3 * fed + (fed + 1) // 2


@pytest.mark.parametrize(("strides", "period", "eos"), [((1, 2), 2, None), ((2, 3), 6, None),
                                                        ((1, 2), 2, 17), ((1, 2), 2, 33)])
def test_points_of_several_strides_repeat_each_plan_of_their_period(monkeypatch, strides,
                                                                     period, eos):
    """Points of several strides plan the steps of one period (each step's plan
    differs: which points match), then repeat each plan a period later
    (``_RowDriver._cycle``), the steps of every plan held in one window
    (``_Window.admits``), also once a request has ended (``eos``: the
    requests left plan the period again): the outputs and records of every
    step planned request by request and routed as it comes."""
    from undercurrent.adapters.session import StepPlan

    every = dataclasses.replace(_point(), layers=(0, 2), stride=strides[0])
    second = dataclasses.replace(every, name="second", tensor_type=TensorType.MLP_OUT,
                                 layers=(1,), stride=strides[1])
    repeated: list[int] = []
    rows: list[int] = []  # the requests each repeated plan feeds
    shifted = StepPlan.shifted

    def counted(plan: StepPlan, delta: int = 1) -> StepPlan:
        made = shifted(plan, delta)
        if made.base.alternates:
            repeated.append(made.delta)
            rows.append(len(next(iter(made.groups.values())).slots))
        return made

    monkeypatch.setattr(StepPlan, "shifted", counted)
    windows = Windows(monkeypatch)
    windowed = _generate([every, second], windows=True, records=True, eos=eos)
    assert repeated and set(repeated) == {period}  # (each plan a period later)
    assert max(windows.steps) > 2  # (steps of several plans in one window)
    ended = [len(output.token_ids) for output in windowed if output.finish_reason == "eos"]
    if eos is not None:  # (one ended before the others: plans repeated after it too)
        assert ended and min(ended) < max(len(output.token_ids) for output in windowed)
        assert min(rows) < len(windowed)  # (repeated for the requests left)
    monkeypatch.undo()
    monkeypatch.setattr(StepPlan, "add_steady_tokens", lambda self, fed: False)
    monkeypatch.setattr(StepPlan, "add_alike_tokens", lambda self, fed: False)
    stepped = _generate([every, second], windows=False, records=True, eos=eos)
    assert [_view(output) for output in windowed] == [_view(output) for output in stepped]
    for mine, theirs in zip(windowed, stepped, strict=True):
        assert [_record_view(r) for r in mine.records] == [
            _record_view(r) for r in theirs.records]


class FirstValues(ScoresRows):
    """A user's ScoresRows probe that flags nothing: each row's first value as
    its score, judged in a group; it may not abort."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def group_key(self) -> Any:
        return ("first values",)

    def may_abort(self) -> bool:
        return False

    def row_values(self, batch: Any) -> Any:
        return batch.tensor[:, 0].double().tolist()

    def judge_rows(self, values: Any, token_indices: Any, layers: Any) -> BatchSignals:
        return BatchSignals.from_signals([ProbeSignal(score=value) for value in values])


def _broken(*args: Any) -> Any:
    raise RuntimeError("broken hook")


class MayAbortRaises(FirstValues):
    may_abort = _broken  # type: ignore[assignment]


class MayAbortAbortTestRaises(FirstValues):
    """May abort, and tells from the values whether it would: by raising."""

    def may_abort(self) -> bool:
        return True

    abort_test = classmethod(_broken)  # type: ignore[assignment]


class AbortTestFunctionRaises(FirstValues):
    """May abort; its ``abort_test`` gives a test that raises when asked."""

    def may_abort(self) -> bool:
        return True

    @classmethod
    def abort_test(cls, probes: Any) -> Any:
        return _broken


class AbortScreenFunctionRaises(AbortTestFunctionRaises):
    """Its test works; the screen its ``abort_screen`` gives raises when asked."""

    @classmethod
    def abort_test(cls, probes: Any) -> Any:
        return lambda values: False

    @classmethod
    def abort_screen(cls, probes: Any) -> Any:
        return _broken


class GroupKeyRaises(FirstValues):
    group_key = _broken  # type: ignore[assignment]


class GroupKeyUnhashable(FirstValues):
    def group_key(self) -> Any:
        return ["not", "hashable"]


@pytest.mark.parametrize("probe_class, mode, note", [
    (MayAbortRaises, "inline",
     "may_abort: RuntimeError: broken hook (taken as True: it may abort)"),
    (MayAbortAbortTestRaises, "inline",
     "abort_test: RuntimeError: broken hook (every decode step is routed as it comes)"),
    (AbortTestFunctionRaises, "inline", "abort_test's function: RuntimeError: broken hook "
     "(the steps it was asked of are routed as they come)"),
    (AbortScreenFunctionRaises, "inline", "abort_screen's function: RuntimeError: broken hook "
     "(the steps it was asked of are routed as they come)"),
    (GroupKeyRaises, "inline", "group_key: RuntimeError: broken hook (the probe is judged on "
     "its own)"),
    (GroupKeyRaises, "async", "group_key: RuntimeError: broken hook (the probe is judged on "
     "its own)"),
    (GroupKeyUnhashable, "inline", "group_key: TypeError: it returned ['not', 'hashable'], "
     "which is not hashable (the probe is judged on its own)"),
    (GroupKeyUnhashable, "async", "group_key: TypeError: it returned ['not', 'hashable'], "
     "which is not hashable (the probe is judged on its own)"),
], ids=["may_abort", "abort_test", "abort_test-function", "abort_screen-function",
        "group_key-inline", "group_key-async", "unhashable-inline", "unhashable-async"])
def test_a_user_probe_s_planning_hook_that_raises_is_noted_on_its_result(
        monkeypatch, probe_class, mode, note):
    """``may_abort``, ``abort_test`` or ``group_key`` raising (or giving a key
    that is not hashable), or the test or screen ``abort_test`` /
    ``abort_screen`` gave raising when asked (the screen escaped generate(),
    the test's error went unnoted): generation goes on; each request's result notes the
    hook and the error, counted, and the router does what is safe without it
    (every step routed as it comes, the probe judged on its own). Where only
    the hook is broken, the tokens and signals are those of the same probe
    with the hook working."""
    counted = Windows(monkeypatch)
    point = _point("user", mode=mode)
    outputs = _generate(point, windows=True, probes={"user": probe_class})
    if probe_class in (MayAbortRaises, MayAbortAbortTestRaises):
        assert counted.steps == []  # (no window: it may abort)
    oracle = _generate(point, windows=False, probes={"user": FirstValues})
    for output, expected in zip(outputs, oracle, strict=True):
        result = output.results["watch"]
        assert result.error is not None and result.error.startswith(note), result.error
        assert result.stats.received == result.stats.processed + result.stats.dropped
        assert list(output.token_ids) == list(expected.token_ids)
        if probe_class is not GroupKeyRaises:  # (its on_batch asks group_key too)
            assert result.error == note
            assert result.stats.errors == 1
            assert [(s.token_index, s.layer, s.score) for s in output.signals] == [
                (s.token_index, s.layer, s.score) for s in expected.signals]
