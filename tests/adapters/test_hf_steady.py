"""Decode steps that repeat the last plan one token later (``StepPlan.shifted``)
and are delivered from the layout kept on it: the same captures, signals and
results as planning and delivering every step afresh, and the tensors
transformers itself computes.

The HF driver repeats a decode plan while the same rows are fed and every request
is steady (each point selects every token from some index on, no edits); the
oracle is ``output_hidden_states`` of a plain ``generate()`` on the same batch,
and the same generation with the repeat switched off (every step planned and
delivered by the general path, no layout kept).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer  # noqa: E402
from test_hf_equivalence import PROMPTS, _expected, _oracle  # noqa: E402

import undercurrent.adapters.hf.backend as hf_backend  # noqa: E402
from undercurrent.adapters import CaptureSession, SamplingParams, delivery  # noqa: E402
from undercurrent.adapters.hf.backend import HFBackend  # noqa: E402
from undercurrent.adapters.session import StepPlan  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.records import ActivationRecord, ProbeSignal, SignalAction  # noqa: E402
from undercurrent.router import Router  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, ProbeKind  # noqa: E402

MAX_NEW = 8
WEIGHT = [0.05 * ((i % 7) - 3) for i in range(32)]


class Keeper(Probe):
    """Keeps every record it is given (a probe written per record)."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)
    kept: dict[str, list[ActivationRecord]] = {}
    lock = threading.Lock()

    def on_activation(self, record: ActivationRecord) -> None:
        with self.lock:
            Keeper.kept.setdefault(record.request_id, []).append(record)


def _points() -> list[ExtractionPoint]:
    return [
        ExtractionPoint(name="keep", layers=(0, 1, 2), tensor_type="residual_stream",
                        position="generated[*]", probe_type="keeper",
                        probe_kind="trajectory"),
        ExtractionPoint(name="late", layers=(2,), tensor_type="attn_out",
                        position="generated[2:]", probe_type="keeper",
                        probe_kind="trajectory"),
        ExtractionPoint(name="score", layers=(0, 2), tensor_type="residual_stream",
                        position="generated[*]", probe_type="linear_probe",
                        probe_kind="trajectory",
                        probe_args={"weight": WEIGHT, "bias": 0.0, "threshold": 0.0,
                                    "action": "flag"}),
        ExtractionPoint(name="drift", layers=(1,), tensor_type="mlp_out",
                        position="generated[*]", probe_type="trajectory_probe",
                        probe_kind="trajectory", execution_mode="async", queue_depth=64,
                        probe_args={"weight": WEIGHT, "bias": 0.0, "statistic": "ewma",
                                    "alpha": 0.5, "threshold": 0.0, "action": "flag"}),
    ]


#: Plans repeated one token later (StepPlan.shifted, or StepPlan.advanced, which
#: moves a delivered one on) in the last generation.
SHIFTS = [0]


def _count_shifts(patch: pytest.MonkeyPatch) -> None:
    SHIFTS[0] = 0
    original_shifted, original_advanced = StepPlan.shifted, StepPlan.advanced
    advancing = [False]

    def shifted(plan: StepPlan, delta: int) -> StepPlan:
        SHIFTS[0] += not advancing[0]  # (advanced() making a new one: counted there)
        return original_shifted(plan, delta)

    def advanced(plan: StepPlan, delta: int) -> StepPlan:
        SHIFTS[0] += 1
        advancing[0] = True
        try:
            return original_advanced(plan, delta)
        finally:
            advancing[0] = False

    patch.setattr(StepPlan, "shifted", shifted)
    patch.setattr(StepPlan, "advanced", advanced)


def _generate(monkeypatch: pytest.MonkeyPatch, steady: Any, *, repeat: bool,
              records: bool = False) -> tuple[list[Any], int]:
    """One generation of PROMPTS; returns its outputs and how many forwards were
    delivered from a kept layout (``steady``: the ``steady_deliveries`` fixture)."""
    Keeper.kept = {}
    steady.count = 0
    with monkeypatch.context() as patch:
        if not repeat:
            patch.setattr(hf_backend._RowDriver, "repeat_plans", False)
            patch.setattr(delivery._SteadyLayout, "of", classmethod(lambda cls, *args: None))
        _count_shifts(patch)
        backend = HFBackend(build_model("llama"), build_tokenizer())
        with Router(probes={"keeper": Keeper}, default_overflow="block") as router:
            session = CaptureSession(router, _points(), keep_records=records)
            outputs = backend.generate(PROMPTS, ["a", "b", "c"],
                                       SamplingParams(max_new_tokens=MAX_NEW), session)
    return outputs, steady.count


def test_repeated_decode_plans_capture_what_transformers_computes(monkeypatch,
                                                                 steady_deliveries):
    outputs, steady = _generate(monkeypatch, steady_deliveries, repeat=True)
    # Decode forwards feed generated tokens 0..MAX_NEW - 2; "late" selects from
    # generated 2 on, so the forwards of 0, 1 and 2 are planned, the later repeat 2's;
    # 2's plan, kept to be repeated, is delivered from its layout as well.
    assert steady == MAX_NEW - 3

    def expected_keys(output: Any) -> list[tuple[str, int, int]]:
        fed = range(output.prompt_len, output.prompt_len + MAX_NEW - 1)
        return ([("keep", layer, index) for index in fed for layer in (0, 1, 2)]
                + [("late", 2, index) for index in fed if index >= output.prompt_len + 2])

    _assert_records_of_transformers(outputs, expected_keys)
    for output in outputs:
        for record in Keeper.kept[output.request_id]:
            generated = record.token_index - output.prompt_len
            assert record.is_generated and record.generated_index == generated
            assert record.token_id == output.token_ids[generated]
            assert record.tensor_type == ("residual_stream" if record.extraction_point_name
                                          == "keep" else "attn_out")


def _assert_records_of_transformers(outputs: list[Any], expected_keys: Any) -> None:
    """Each output's tokens are plain ``generate()``'s, the records ``Keeper``
    kept for it are those of ``expected_keys(output)`` ((point, layer, token
    index) each), and each tensor is the one transformers computes."""
    out, captured, width = _oracle(build_model("llama"), build_tokenizer(), SamplingParams(
        max_new_tokens=MAX_NEW))
    for row, output in enumerate(outputs):
        assert list(output.token_ids) == out.sequences[row, width:].tolist()
        records = Keeper.kept[output.request_id]
        assert sorted((r.extraction_point_name, r.layer, r.token_index)
                      for r in records) == sorted(expected_keys(output))
        for record in records:
            want = _expected(record, row, out, captured, width, output.prompt_len)
            torch.testing.assert_close(record.tensor, want, rtol=1e-5, atol=1e-5)


def _view(output: Any) -> Any:
    signals = [(s.extraction_point_name, s.layer, s.token_index, s.generated_index,
                s.action, round(s.score, 9)) for s in output.signals]
    results = {name: (result.verdict, result.stats.received, result.stats.processed,
                      result.stats.dropped, result.stats.errors, result.error)
               for name, result in output.results.items()}
    return list(output.token_ids), output.finish_reason, signals, results


def test_repeated_decode_plans_give_what_planning_every_step_gives(monkeypatch,
                                                                   steady_deliveries):
    repeated, steady = _generate(monkeypatch, steady_deliveries, repeat=True)
    assert SHIFTS[0] == MAX_NEW - 4  # the decode forwards of generated 3.. repeat 2's
    planned, none = _generate(monkeypatch, steady_deliveries, repeat=False)
    assert steady == MAX_NEW - 3 and none == 0 and SHIFTS[0] == 0
    assert any(output.signals for output in planned)  # the linear probe flagged rows
    assert [_view(output) for output in repeated] == [_view(output) for output in planned]


def _record_view(record: ActivationRecord) -> Any:
    return (record.request_id, record.extraction_point_name, record.layer,
            record.tensor_type, record.token_index, record.generated_index,
            record.is_generated, record.token_id, record.tensor.dtype,
            record.tensor.tolist())


def test_records_kept_from_repeated_plans_are_those_of_planning_every_step(
        monkeypatch, steady_deliveries):
    """records=True takes the repeat too: each output's records (every point's,
    in order, tensors included) are the ones planning every step keeps."""
    repeated, steady = _generate(monkeypatch, steady_deliveries, repeat=True, records=True)
    planned, none = _generate(monkeypatch, steady_deliveries, repeat=False, records=True)
    assert steady == MAX_NEW - 3 and none == 0
    for mine, theirs in zip(repeated, planned, strict=True):
        assert len(mine.records) == len(theirs.records) > 0
        assert [_record_view(r) for r in mine.records] == [_record_view(r) for r in theirs.records]
    assert [_view(output) for output in repeated] == [_view(output) for output in planned]


class AbortsB(Probe):
    """Scores each record by its first value; flags from generated token 1 on, and
    aborts request ``b`` at its generated token 3 (layer 1)."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def on_activation(self, record: ActivationRecord) -> ProbeSignal:
        score = float(record.tensor[0])
        if record.request_id == "b" and record.generated_index == 3 and record.layer == 1:
            return ProbeSignal(action=SignalAction.ABORT, score=score)
        flag = record.generated_index is not None and record.generated_index >= 1
        return ProbeSignal(action=SignalAction.FLAG if flag else SignalAction.CONTINUE,
                           score=score)


def _one_point(monkeypatch: pytest.MonkeyPatch, steady: Any, *, repeat: bool,
               stream: bool = False, records: bool = False) -> tuple[list[Any], int, list[Any]]:
    """PROMPTS (the first only, when ``stream``) with one point on every layer: the
    requests follow the kept layout's journal. Returns the outputs, the forwards
    delivered from the layout, and the streamed events' signals."""
    steady.count = 0
    point = ExtractionPoint(name="watch", layers=(0, 1, 2), tensor_type="residual_stream",
                            position="generated[*]", probe_type="aborts_b",
                            probe_kind="trajectory")
    with monkeypatch.context() as patch:
        if not repeat:
            patch.setattr(hf_backend._RowDriver, "repeat_plans", False)
            patch.setattr(delivery._SteadyLayout, "of", classmethod(lambda cls, *args: None))
        _count_shifts(patch)
        backend = HFBackend(build_model("llama"), build_tokenizer())
        with Router(probes={"aborts_b": AbortsB}) as router:
            session = CaptureSession(router, [point], keep_records=records)
            params = SamplingParams(max_new_tokens=MAX_NEW)
            if not stream:
                return backend.generate(PROMPTS, ["a", "b", "c"], params, session), \
                    steady.count, []
            events = list(backend.stream(PROMPTS[0], "a", params, session))
    return [events[-1].output], steady.count, [_signal_rows(event.signals) for event in events]


def _signal_rows(signals: Any) -> list[Any]:
    return [(s.extraction_point_name, s.layer, s.token_index, s.generated_index, s.action,
             s.signal.score) for s in signals]


def test_one_point_followed_from_the_kept_layout_gives_what_planning_every_step_gives(
        monkeypatch, steady_deliveries):
    """With one point, the requests of a kept layout read their signals from one
    journal the layout appends to once a step. Request b aborts mid-way (the
    layout is then left and the others go on planned): every output, its
    signals in order, its results and accounting, equal planning every step."""
    appended: list[int] = []
    _count_journal_appends(monkeypatch, appended)
    repeated, steady, _ = _one_point(monkeypatch, steady_deliveries, repeat=True)
    assert steady > 0 and appended and SHIFTS[0] > 0  # the journal path ran
    planned, none, _ = _one_point(monkeypatch, steady_deliveries, repeat=False)
    assert none == 0 and SHIFTS[0] == 0
    by_id = {output.request_id: output for output in repeated}
    assert by_id["b"].finish_reason == "abort" and by_id["b"].aborted
    assert by_id["a"].finish_reason != "abort"
    assert any(s.action is SignalAction.FLAG for s in by_id["a"].signals)
    assert [_view(output) for output in repeated] == [_view(output) for output in planned]


def test_streamed_signals_read_mid_way_from_the_journal_are_those_of_planning(
        monkeypatch, steady_deliveries):
    """A stream reads each token's signals as it goes (the journal read while it
    is still followed): per event and in total, what planning every step gives."""
    repeated, steady, events = _one_point(monkeypatch, steady_deliveries, repeat=True,
                                          stream=True)
    planned, _, planned_events = _one_point(monkeypatch, steady_deliveries, repeat=False,
                                            stream=True)
    assert steady > 0
    assert sum(map(bool, events)) > 2  # signals arrived over several events
    assert events == planned_events
    assert [row for event in events for row in event] == _signal_rows(repeated[0].signals)
    assert [_view(output) for output in repeated] == [_view(output) for output in planned]


def _count_journal_appends(monkeypatch: pytest.MonkeyPatch, appended: list[int]) -> None:
    """Note the rows of each entry appended to any Journal (the one-point steady path)."""

    original = delivery.Journal.append

    def append(self: Any, routed: Any) -> None:
        appended.append(len(routed.batch))
        original(self, routed)

    monkeypatch.setattr(delivery.Journal, "append", append)


def test_records_of_one_point_followed_from_the_kept_layout_are_those_of_planning(
        monkeypatch, steady_deliveries):
    """records=True with one point: each request's records follow the layout's
    journal of captured batches. Counted before they are built, then built:
    every record, tensor included, is the one planning every step keeps, also
    for request b after its abort."""
    repeated, steady, _ = _one_point(monkeypatch, steady_deliveries, repeat=True, records=True)
    planned, _, _ = _one_point(monkeypatch, steady_deliveries, repeat=False, records=True)
    assert steady > 0
    assert [len(output.records) for output in repeated] == [
        len(output.records) for output in planned]
    for mine, theirs in zip(repeated, planned, strict=True):
        assert len(mine.records) > 0
        assert [_record_view(r) for r in mine.records] == [_record_view(r) for r in theirs.records]
    assert [_view(output) for output in repeated] == [_view(output) for output in planned]


def test_once_every_point_has_matched_its_tokens_no_later_step_plans_anything(monkeypatch):
    """Points on prompt tokens and a slice of generated tokens that ends: once
    the slice has ended for every request, no point is left that can match, and
    the later decode forwards plan nothing (no request is planned, no plan
    made). The records are still exactly what transformers computes."""
    Keeper.kept = {}
    planned: list[int] = []  # (each window's generated index, < 0 in the prompt)
    add_window, add_alike_windows = StepPlan.add_window, StepPlan.add_alike_windows

    def counted(plan: StepPlan, state: Any, start: int, stop: int, slot_of: Any) -> None:
        planned.append(start - state.prompt_len)
        add_window(plan, state, start, stop, slot_of)

    def counted_alike(plan: StepPlan, fed: Any) -> bool:
        done = add_alike_windows(plan, fed)
        if done:
            planned.extend(start - state.prompt_len for state, start, _, _ in fed)
        return done

    monkeypatch.setattr(StepPlan, "add_window", counted)
    monkeypatch.setattr(StepPlan, "add_alike_windows", counted_alike)
    points = [
        ExtractionPoint(name="last", layers=(0, 2), tensor_type="residual_stream",
                        position="prompt[-1]", probe_type="keeper", probe_kind="single_shot"),
        ExtractionPoint(name="first", layers=(1,), tensor_type="attn_out",
                        position="generated[0:2]", probe_type="keeper",
                        probe_kind="trajectory"),
    ]
    backend = HFBackend(build_model("llama"), build_tokenizer())
    with Router(probes={"keeper": Keeper}) as router:
        outputs = backend.generate(PROMPTS, ["a", "b", "c"],
                                   SamplingParams(max_new_tokens=MAX_NEW),
                                   CaptureSession(router, points))
    # The decode forwards of generated tokens 0 and 1 are planned at once; the one
    # of 2 (past the slice) plans each request's window (at once: they are alike)
    # and finds nothing left: the later ones plan nothing at all.
    assert [index for index in planned if index >= 0] == [2] * len(PROMPTS)
    _assert_records_of_transformers(outputs, lambda output: [
        ("first", 1, output.prompt_len), ("first", 1, output.prompt_len + 1),
        ("last", 0, output.prompt_len - 1), ("last", 2, output.prompt_len - 1)])


def test_steps_before_every_point_s_first_token_plan_nothing(monkeypatch):
    """Points whose first token comes later (a slice from generated token 4, and
    generated token 6 alone): the decode forwards feeding generated tokens 0
    to 3 plan nothing, request by request or at once, and the records are still
    exactly what transformers computes. Planning every step request by
    request (``repeat_plans`` and ``batch_windows`` False) plans each request
    at each of them."""
    points = [
        ExtractionPoint(name="slice", layers=(0, 2), tensor_type="residual_stream",
                        position="generated[4:7]", probe_type="keeper",
                        probe_kind="trajectory"),
        ExtractionPoint(name="one", layers=(1,), tensor_type="attn_out",
                        position="generated[6]", probe_type="keeper", probe_kind="single_shot"),
    ]

    def generate(repeat: bool) -> tuple[list[Any], list[int], list[bool | None]]:
        Keeper.kept = {}
        windows: list[int] = []  # (the generated index of each window planned alone)
        plans: list[bool | None] = []  # (per forward: no plan, or whether it plans any)
        add_window, plan_forward = StepPlan.add_window, hf_backend._RowDriver.plan_forward

        def counted(plan: StepPlan, state: Any, start: int, stop: int, slot_of: Any) -> None:
            windows.append(start - state.prompt_len)
            add_window(plan, state, start, stop, slot_of)

        def planned(driver: Any, width: int) -> Any:
            plan = plan_forward(driver, width)
            plans.append(None if plan is None else bool(plan))
            return plan

        with monkeypatch.context() as patch:
            patch.setattr(StepPlan, "add_window", counted)
            patch.setattr(hf_backend._RowDriver, "plan_forward", planned)
            patch.setattr(hf_backend._RowDriver, "repeat_plans", repeat)
            patch.setattr(hf_backend._RowDriver, "batch_windows", repeat)
            backend = HFBackend(build_model("llama"), build_tokenizer())
            with Router(probes={"keeper": Keeper}) as router:
                outputs = backend.generate(PROMPTS, ["a", "b", "c"],
                                           SamplingParams(max_new_tokens=MAX_NEW),
                                           CaptureSession(router, points))
        return outputs, windows, plans

    outputs, windows, plans = generate(True)
    # (forward 0 is the prefill, with nothing in the prompts to plan; forward k
    # feeds generated token k - 1: no plan made before generated token 4)
    assert plans[:8] == [False] + [None] * 4 + [True] * 3, plans
    assert not [index for index in windows if index < 4], windows
    _assert_records_of_transformers(outputs, lambda output: [
        *[("slice", layer, output.prompt_len + index) for layer in (0, 2) for index in (4, 5, 6)],
        ("one", 1, output.prompt_len + 6)])
    kept = {request: [(r.extraction_point_name, r.layer, r.token_index) for r in records]
            for request, records in Keeper.kept.items()}
    _, every, _ = generate(False)
    assert sorted(index for index in every if 0 <= index < 4) == [
        index for index in range(4) for _ in PROMPTS]
    assert {request: [(r.extraction_point_name, r.layer, r.token_index) for r in records]
            for request, records in Keeper.kept.items()} == kept
