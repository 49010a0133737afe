"""Property: decode steps held in windows (``delivery._Window``) and plans
repeated a stride later give what planning and routing each step afresh
gives, on random specs of a real model.

A spec of one to three points, each drawn at random: tensor type, layers,
position (every generated token, with a stride or a slice, or one token),
probe (every built-in that judges in groups, an SAE's watched or top
features among them, and a probe written per record), inline or async (a
queue of 4 to 256 vectors, ``block``: nothing dropped, however the workers
keep up), and for an inline point ``flag`` or ``abort`` at a threshold drawn
among the scores the point gives. The generation's eos token,
``records=True``, whether the driver repeats its last plan, and a live edit
for every request (none, or an ``add`` at some layers of one tensor type, on
every generated token, from the third, every second one, on a slice, the
prompt's last token or one generated token, at times switched on by the
first point's signals) are drawn too. The oracle is
the same generation with ``windows=False`` (each step routed as it comes,
what ``stream()`` does) and every step planned afresh, each request on its
own, from the points' and edits' positions (``StepPlan.add_steady_tokens``
declines): the tokens, the finish reasons, any abort and its token, every
signal in order with its score and metadata, each point's verdict and
counts, the records with the edits at each, and each request's log of
applied edits, compared exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_hf_windows import WEIGHT, _abort_view, _generate, _record_view  # noqa: E402

from tests.probes.sae_helpers import write_sae  # noqa: E402
from undercurrent.adapters import delivery  # noqa: E402
from undercurrent.adapters.hf.backend import _RowDriver  # noqa: E402
from undercurrent.adapters.session import StepPlan  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.probes.scoring import ThresholdRule  # noqa: E402
from undercurrent.records import ActivationRecord, ProbeSignal  # noqa: E402
from undercurrent.spec.types import Edit, ExtractionPoint, ProbeKind  # noqa: E402

LAYERS = 3  # (the tiny llama of hf_models)
POSITIONS = [("generated[*]", 1), ("generated[*]", 2), ("generated[2:]", 1),
             ("generated[0:5]", 1), ("generated[1:]", 3), ("generated[2:7]", 2),
             ("prompt[-1]+1", 1), ("prompt[0]", 1)]
# (a probe written per record that may abort has every step of its spec routed
# as it comes: drawn less often than the others)
PROBES = ["linear_probe", "linear_probe", "trajectory_probe", "trajectory_probe",
          "norm_probe", "norm_probe", "mean_probe", "per_record", "sae_probe", "sae_probe"]


class PerRecord(Probe):
    """A probe written per record, with a threshold rule: the router cannot
    tell from a step's values whether it aborts."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def __init__(self, *, threshold: float | None = None, action: str = "flag") -> None:
        self.rule = ThresholdRule.from_options(threshold, action)
        self.seen = 0

    def on_activation(self, record: ActivationRecord) -> ProbeSignal:
        self.seen += 1
        return self.rule.signal(float(record.tensor[1]) - float(record.tensor[0]),
                                {"seen": self.seen})

    def on_end(self, ctx: Any) -> Any:
        return {"seen": self.seen}


@dataclasses.dataclass(frozen=True)
class Drawn:
    """One point as drawn: its threshold is a quantile of the scores it gives."""

    point: ExtractionPoint
    quantile: float | None  # None: no threshold

    def with_threshold(self, scores: list[float]) -> ExtractionPoint:
        args = dict(self.point.probe_args)
        if self.quantile is None or not scores:
            args["threshold"] = None
            args.pop("action", None)
        else:
            ordered = sorted(scores)
            args["threshold"] = ordered[round(self.quantile * (len(ordered) - 1))]
        return dataclasses.replace(self.point, probe_args=args)

    def watching(self) -> ExtractionPoint:
        """The point with no threshold: every signal carries its score."""
        args = {key: value for key, value in self.point.probe_args.items()
                if key not in ("threshold", "action")}
        return dataclasses.replace(self.point, probe_args=args)


@st.composite
def drawn_points(draw: Any, index: int) -> Drawn:
    tensor_type = draw(st.sampled_from(["residual_stream", "attn_out", "mlp_out"]))
    layers = tuple(sorted(draw(st.sets(st.integers(0, LAYERS - 1), min_size=1))))
    position, stride = draw(st.sampled_from(POSITIONS))
    probe_type = draw(st.sampled_from(PROBES))
    mode = draw(st.sampled_from(["inline", "async"]))
    if mode == "async" or (probe_type == "per_record" and draw(st.integers(0, 3))):
        action = "flag"
    else:
        action = draw(st.sampled_from(["flag", "abort"]))
    args: dict[str, Any] = {"action": action}
    if probe_type == "linear_probe" or (probe_type == "trajectory_probe"
                                        and draw(st.booleans())):
        args.update(weight=WEIGHT, bias=0.0)
    if probe_type == "trajectory_probe":  # (each running statistic, of scores or norms)
        args.update(statistic=draw(st.sampled_from(["ewma", "mean", "max"])))
    if probe_type == "sae_probe":  # (its path is the test's SAE: see _with_sae)
        args.update(draw(st.sampled_from([{"features": [1, 6]}, {"top_k": 3}])),
                    check_hook=False)
    quantile = draw(st.none() | st.floats(0.0, 1.0))
    point = ExtractionPoint(
        name=f"p{index}", layers=layers, tensor_type=tensor_type, position=position,
        stride=stride, probe_type=probe_type, probe_kind="trajectory", execution_mode=mode,
        queue_depth=draw(st.sampled_from([4, 8, 24, 256])) if mode == "async" else None,
        probe_args=args)
    return Drawn(point, quantile)


@st.composite
def specs(draw: Any) -> list[Drawn]:
    count = draw(st.integers(1, 3))
    return [draw(drawn_points(index)) for index in range(count)]


# (always on, every generated token: the steps repeat; from the third; every
# second one, and a slice: each step planned)
EDIT_POSITIONS = [("generated[*]", 1), ("generated[*]", 1), ("generated[2:]", 1),
                  ("generated[*]", 2), ("generated[1:6]", 1), ("prompt[-1]", 1),
                  ("generated[3]", 1)]


@st.composite
def drawn_edits(draw: Any, drawn: list[Drawn]) -> list[Edit]:
    """None, or one ``add`` edit of a small vector for every request, most often
    at a tensor type a point of ``drawn`` captures (its records then edited);
    where the first point is inline, at times switched on by its signals
    (``when``: each request's edit from the token after the first it flags)."""
    if draw(st.integers(0, 2)) == 0:
        return []
    first = drawn[0].point
    when = None
    if first.execution_mode.value == "inline" and draw(st.booleans()):
        when = {"point": first.name, "action": first.probe_args.get("action", "flag")}
    position, stride = draw(st.sampled_from(EDIT_POSITIONS))
    layers = tuple(sorted(draw(st.sets(st.integers(0, LAYERS - 1), min_size=1, max_size=2))))
    tensor_type = draw(st.sampled_from(
        [entry.point.tensor_type.value for entry in drawn] * 3 + ["residual_stream"]))
    vector = [0.5 * ((index * 5) % 3 - 1) for index in range(len(WEIGHT))]
    edits = [Edit(name="steer", layers=layers, tensor_type=tensor_type, position=position,
                  stride=stride, op="add", vector=vector, when=when, coefficient=draw(
                      st.sampled_from([0.0, 0.5, 2.0])))]
    placed = draw(st.sampled_from(["none", "none", "after", "before"]))
    if placed != "none":
        # An always-on clamp at the same sites, after or before it: the two do not
        # commute, so each request's order where they meet shows in its tokens.
        clamp = Edit(name="clamp", layers=layers, tensor_type=tensor_type,
                     position="generated[*]", op="clamp", vector=vector, coefficient=0.3)
        edits = [*edits, clamp] if placed == "after" else [clamp, *edits]
    return edits


@pytest.fixture(scope="module")
def sae_folder(tmp_path_factory: Any) -> str:
    """A topk SAE of the tiny llama's width (its k of 24 features active)."""
    folder = tmp_path_factory.mktemp("sae") / "topk"
    write_sae(folder, architecture="topk", d_in=32, d_sae=24, seed=11, hook_name=None,
              config={"k": 6})
    return str(folder)


def _with_sae(points: list[ExtractionPoint], folder: str) -> list[ExtractionPoint]:
    return [dataclasses.replace(point, probe_args={**point.probe_args, "path": folder})
            if point.probe_type == "sae_probe" else point for point in points]


def _run(points: list[ExtractionPoint], *, windows: bool, records: bool, eos: int | None,
         repeat: bool, edits: list[Edit], each: bool = False) -> list[Any]:
    """``each``: every step planned request by request (the general path), the
    prefill's prompts too."""
    before = (_RowDriver.repeat_plans, _RowDriver.batch_windows, StepPlan.add_steady_tokens,
              StepPlan.add_alike_tokens)
    _RowDriver.repeat_plans = repeat
    if each:
        _RowDriver.batch_windows = False
        StepPlan.add_steady_tokens = StepPlan.add_alike_tokens = (  # type: ignore[method-assign]
            lambda self, fed: False)
    try:
        return _generate(points, windows=windows, records=records, eos=eos,
                         probes={"per_record": PerRecord}, edits=edits)
    finally:
        (_RowDriver.repeat_plans, _RowDriver.batch_windows,  # type: ignore[method-assign]
         StepPlan.add_steady_tokens, StepPlan.add_alike_tokens) = before


@st.composite
def specs_and_edits(draw: Any) -> tuple[list[Drawn], list[Edit]]:
    drawn = draw(specs())
    return drawn, draw(drawn_edits(drawn))


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=specs_and_edits(), records=st.booleans(),
       eos=st.sampled_from([None, None, None, 5, 17, 33, 60]),
       repeat=st.booleans())
def test_windows_give_what_routing_each_step_gives_on_random_specs(monkeypatch, sae_folder,
                                                                   case, records, eos, repeat):
    routed: list[int] = []  # steps per window routed
    route = delivery._Window.route

    def counted(window: Any, session: Any) -> None:
        routed.append(len(window.steps))
        route(window, session)

    monkeypatch.setattr(delivery._Window, "route", counted)
    drawn, edits = case
    watched = _run(_with_sae([entry.watching() for entry in drawn], sae_folder),
                   windows=False, records=False, eos=eos, repeat=False, edits=edits)
    scores: dict[str, list[float]] = {entry.point.name: [] for entry in drawn}
    for output in watched:
        for signal in output.signals:
            if signal.score is not None:
                scores[signal.extraction_point_name].append(signal.score)
    points = _with_sae([entry.with_threshold(scores[entry.point.name]) for entry in drawn],
                       sae_folder)
    windowed = _run(points, windows=True, records=records, eos=eos, repeat=repeat, edits=edits)
    held = list(routed)
    routed.clear()
    # (the oracle plans every step afresh, request by request, the prompts too:
    # the repeated plans, and those planned at once, are checked too)
    stepped = _run(points, windows=False, records=records, eos=eos, repeat=False, edits=edits,
                   each=True)
    assert routed == []  # (routing each step holds nothing)
    assert [_abort_view(output) for output in windowed] == [
        _abort_view(output) for output in stepped]
    for mine, theirs in zip(windowed, stepped, strict=True):
        assert mine.edits == theirs.edits
        if records:
            assert [_record_view(r) for r in mine.records] == [
                _record_view(r) for r in theirs.records]
        for result in mine.results.values():
            stats = result.stats
            assert stats.received == stats.processed and stats.dropped == 0, result
    # (what was held: recorded for the statistics hypothesis keeps, not asserted)
    hypothesis.event(f"windows held: {'some' if held else 'none'}")
    hypothesis.event(f"aborted: {any(output.abort is not None for output in stepped)}")
    hypothesis.event(f"edited: {any(output.edits for output in stepped)}")
    triggered = any(edit.when is not None for edit in edits)
    hypothesis.event(f"edit triggered: {triggered}")
    hypothesis.event(f"edit triggered, windows held: {triggered and bool(held)}")
    hypothesis.event(f"edits meeting: {len(edits) > 1}")
    hypothesis.event("records edited: " + str(records and any(
        record.edits for output in stepped for record in output.records)))
