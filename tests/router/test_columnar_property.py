"""Property: the columnar path (one ActivationBatch per point across requests) gives
the same signals, verdicts, stats and aborts as routing record by record.

Two oracles, on random specs and random activations:

- router level: each request's records of a token and point routed alone
  (``Router.route`` / ``route_batch``, as the adapters did) in one router, the
  same records as one batch per (token step, point) across every request
  (``Router.route_columns``) in another; every built-in probe and a probe written
  per record (which raises on some records), inline (``reject`` and
  ``block_until_signal``) and async with a small queue under each overflow
  policy. Everything is routed inside one ``router.step()``, so no worker drains a
  queue before the step ends and overflow drops the same vectors on both paths.
  The per-record path's scores are also checked against formulas computed here.
- session level: ``CaptureSession.deliver`` against the delivery it replaced,
  written out below (each request's tokens in order, a token's records per point
  in layer order, nothing after an aborting token), on a simulated generation.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from undercurrent.adapters.outputs import AbortInfo, TokenSignal  # noqa: E402
from undercurrent.adapters.session import CaptureGroup, CaptureSession, StepPlan  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.probes.base import ScoresRows  # noqa: E402
from undercurrent.records import (  # noqa: E402
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    ProbeSignal,
    SignalAction,
)
from undercurrent.router import Router, RouterError  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, InterventionPolicy, ProbeKind  # noqa: E402

HIDDEN = 6
WEIGHT = [0.5, -1.0, 0.25, 2.0, -0.75, 1.5]
BIAS = 0.1
PROBE_TYPES = ("linear_probe", "norm_probe", "mean_probe", "trajectory_probe", "capture",
               "per_record", "picky", "dual_position_probe")


class PerRecord(Probe):
    """A probe written per record: scores the sum, raises on every ``fail_every``-th
    token, flags or aborts at ``threshold``; its verdict is every (token, layer) seen."""

    probe_kind = (ProbeKind.TRAJECTORY, ProbeKind.SINGLE_SHOT)

    def __init__(self, *, threshold: float | None = None, action: str = "flag",
                 fail_every: int = 3) -> None:
        self.threshold, self.action, self.fail_every = threshold, action, fail_every
        self.seen: list[tuple[int, int]] = []

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        if record.token_index % self.fail_every == 0 and record.layer == 1:
            raise ValueError(f"no good at token {record.token_index}")
        self.seen.append((record.token_index, record.layer))
        score = float(np.asarray(record.tensor, dtype=np.float64).sum())
        if record.layer == 2:
            return None  # nothing to say about layer 2
        crossed = self.threshold is not None and score >= self.threshold
        return ProbeSignal(self.action if crossed else "continue", score, {"sum": score})

    def on_end(self, ctx: Any) -> Any:
        return {"seen": list(self.seen)}


class Picky(ScoresRows):
    """Written per batch: the value of a row is its sum, but computing values raises
    for any batch holding a row whose first element exceeds 1.5 (so the values
    shared by a routed batch fail, and each binding must fail alone)."""

    probe_kind = (ProbeKind.TRAJECTORY, ProbeKind.SINGLE_SHOT)

    def __init__(self, *, threshold: float | None = None, action: str = "flag") -> None:
        self.total = 0.0

    def group_key(self) -> Any:
        return ("picky",)

    def row_values(self, batch: ActivationBatch) -> Any:
        matrix = np.asarray(batch.tensor, dtype=np.float64).reshape(len(batch), -1)
        if (matrix[:, 0] > 1.5).any():
            raise ValueError("a row is too large")
        return matrix.sum(axis=1)

    def judge_rows(self, values, token_indices, layers) -> BatchSignals:
        for value in values.tolist():
            self.total += value
        return BatchSignals([0] * len(values), values.tolist(), all_scored=True)

    def on_end(self, ctx: Any) -> Any:
        return {"total": self.total}


def _probe_args(probe_type: str, threshold: float | None, action: str) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if probe_type in ("linear_probe", "trajectory_probe", "dual_position_probe"):
        args.update(weight=WEIGHT, bias=BIAS)
    if probe_type == "trajectory_probe":
        args.update(statistic="ewma", alpha=0.5)
    if probe_type not in ("capture", "picky"):
        # (abort needs a threshold: without one the built-ins refuse it)
        args.update(threshold=threshold, action=action if threshold is not None else "flag")
    return args


point_specs = st.lists(
    st.tuples(
        st.sampled_from(PROBE_TYPES),
        st.sampled_from(("inline", "inline_block", "async")),
        st.sets(st.integers(0, 3), min_size=1, max_size=4),
        st.one_of(st.none(), st.floats(-1.0, 1.0)),
        st.sampled_from(("flag", "abort")),
        st.integers(1, 6),
    ),
    min_size=1, max_size=3,
)


def _points(specs: list[tuple[Any, ...]], positions: list[str] | None = None
            ) -> list[ExtractionPoint]:
    points = []
    for index, (probe_type, mode, layers, threshold, action, depth) in enumerate(specs):
        position = positions[index] if positions else "generated[*]"
        if probe_type == "dual_position_probe" and mode == "async":
            mode = "inline"  # single_shot only, and async points must be trajectory
        blocking = mode == "inline_block"
        points.append(ExtractionPoint(
            name=f"p{index}",
            layers=tuple(sorted(layers)),
            tensor_type="residual_stream",
            position=position,
            probe_type=probe_type,
            probe_kind="single_shot" if probe_type == "dual_position_probe" else "trajectory",
            execution_mode="async" if mode == "async" else "inline",
            queue_depth=depth if mode == "async" else None,
            intervention=InterventionPolicy(mode="block_until_signal", timeout_ms=120_000)
            if blocking else None,
            probe_args=_probe_args(probe_type, threshold, action),
        ))
    return points


def _router(overflow: str) -> Router:
    return Router(probes={"per_record": PerRecord, "picky": Picky}, default_overflow=overflow,
                  workers=2)


def _approx(value: Any) -> Any:
    """Floats compared to 1e-12 (a matrix product over more rows may round differently)."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-12, abs=1e-12, nan_ok=True)
    if isinstance(value, dict):
        return {key: _approx(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_approx(item) for item in value)
    return value


def _signal_view(signal: ProbeSignal | None) -> Any:
    if signal is None:
        return None
    return (signal.action, _approx(signal.score), _approx(dict(signal.metadata)),
            signal.request_id, signal.extraction_point_name, signal.layer, signal.token_index,
            signal.generated_index)


def _result_view(result: Any) -> Any:
    stats = result.stats
    return (_approx(result.verdict), [_signal_view(s) for s in result.signals],
            (stats.received, stats.processed, stats.dropped, stats.errors, stats.timeouts),
            result.error)


def _expected_score(point: ExtractionPoint, tensor: Any) -> Any:
    """The score of one record computed here, independently of the probes."""
    x = tensor.astype(np.float64)
    kind = point.probe_type
    if kind in ("linear_probe", "dual_position_probe"):
        return 1.0 / (1.0 + math.exp(-(float(np.dot(WEIGHT, x)) + BIAS)))
    if kind == "norm_probe":
        return float(np.sqrt((x * x).sum()))
    if kind == "mean_probe":
        return float(x.mean())
    if kind == "per_record":
        return float(x.sum())
    return None


@settings(max_examples=40, deadline=None)
@given(specs=point_specs, requests=st.integers(1, 4), steps=st.integers(1, 4),
       overflow=st.sampled_from(("drop_oldest", "drop_newest", "block")),
       seed=st.integers(0, 2**31 - 1))
def test_route_columns_equals_routing_each_record(specs, requests, steps, overflow, seed):
    rng = np.random.default_rng(seed)
    if overflow == "block":
        # Workers drain a blocking queue while routing goes on, so what they take at
        # once varies; a probe written per batch that raises then fails a varying
        # number of rows. Keep picky inline there.
        specs = [("picky", "inline", *spec[2:]) if spec[:2] == ("picky", "async") else spec
                 for spec in specs]
    points = _points(specs)
    ids = [f"r{index}" for index in range(requests)]
    prompt_len = 2
    # records[step][point name] = the rows of that step, grouped by request, layers in order
    steps_rows: list[dict[str, list[ActivationRecord]]] = []
    for step in range(steps):
        token = prompt_len + step
        by_point: dict[str, list[ActivationRecord]] = {}
        for request_id in ids:
            for point in points:
                for layer in point.layers:
                    tensor = rng.normal(size=HIDDEN).astype(np.float32)
                    by_point.setdefault(point.name, []).append(ActivationRecord(
                        request_id, point.name, layer, "residual_stream", token, True, step,
                        100 + step, tensor))
        steps_rows.append(by_point)

    single, columnar = _router(overflow), _router(overflow)
    try:
        for router in (single, columnar):
            for request_id in ids:
                router.register_request(request_id, points)
        returned_single: list[Any] = []
        returned_columnar: list[Any] = []
        with single.step():
            for by_point in steps_rows:
                for point in points:
                    for request_id in ids:  # one token's layers, as the adapters routed them
                        token = [r for r in by_point[point.name] if r.request_id == request_id]
                        if len(token) == 1:
                            returned_single.append(single.route(token[0]))
                        else:
                            returned_single.extend(single.route_batch(token))
        with columnar.step():
            for by_point in steps_rows:
                for point in points:
                    rows = by_point[point.name]
                    batch = ActivationBatch(
                        np.stack([r.tensor for r in rows]),
                        request_ids=[r.request_id for r in rows],
                        point_names=[r.extraction_point_name for r in rows],
                        layers=[r.layer for r in rows], tensor_type="residual_stream",
                        token_indices=[r.token_index for r in rows],
                        is_generated=[True] * len(rows),
                        generated_indices=[r.generated_index for r in rows],
                        token_ids=[r.token_id for r in rows])
                    returned_columnar.extend(columnar.route_columns(batch).signals(batch))
        assert [_signal_view(s) for s in returned_columnar] == [
            _signal_view(s) for s in returned_single]
        for request_id in ids:
            assert single.abort_requested(request_id) == columnar.abort_requested(request_id)
        results_single = {request_id: single.end_request(request_id) for request_id in ids}
        results_columnar = {request_id: columnar.end_request(request_id) for request_id in ids}
        for request_id in ids:
            for point in points:
                one, many = results_single[request_id][point.name], results_columnar[
                    request_id][point.name]
                assert _result_view(many) == _result_view(one)
                stats = many.stats
                assert stats.received == stats.processed + stats.dropped
                assert stats.received == steps * len(point.layers)
                if point.execution_mode.value == "async" and overflow != "block":
                    # nothing drained inside the step: the queue kept its capacity in
                    # vectors (queue_depth, never fewer than one token's layers)
                    capacity = max(point.queue_depth, len(point.layers))
                    assert stats.dropped == max(0, stats.received - capacity)
        _check_scores(points, steps_rows, results_single, overflow)
    finally:
        single.shutdown()
        columnar.shutdown()


def test_route_columns_routes_only_the_given_spans_and_answers_every_row():
    point = _points([("norm_probe", "inline", {0, 1}, 0.0, "abort", 1)])[0]
    rows = [ActivationRecord(request_id, "p0", layer, "residual_stream", 5, True, 1, 9,
                             np.full(HIDDEN, 1.0 + layer, dtype=np.float32))
            for request_id in ("a", "b", "c") for layer in (0, 1)]
    batch = ActivationBatch.from_records(rows)
    with _router("drop_newest") as router:
        for request_id in ("a", "b", "c"):
            router.register_request(request_id, [point])
        signals = router.route_columns(batch, [("a", 0, 2), ("c", 4, 6)])
        assert len(signals) == 6
        located = signals.signals(batch)
        assert [s is None for s in located] == [False, False, True, True, False, False]
        assert all(s.action is SignalAction.ABORT for s in located if s is not None)
        assert [s.layer for s in located if s is not None] == [0, 1, 0, 1]
        assert router.abort_requested("a") and router.abort_requested("c")
        assert not router.abort_requested("b")
        results = {request_id: router.end_request(request_id)["p0"]
                   for request_id in ("a", "b", "c")}
    assert [results[r].stats.received for r in ("a", "b", "c")] == [2, 0, 2]
    assert results["a"].signals[1].score == pytest.approx(2.0 * math.sqrt(HIDDEN))


@pytest.mark.parametrize("kind", [list, tuple, np.array], ids=["list", "tuple", "array"])
def test_route_columns_refuses_a_batch_of_two_points(kind):
    point = _points([("norm_probe", "inline", {0, 1}, None, "flag", 1)])[0]
    rows = [ActivationRecord("a", name, 0, "residual_stream", 5, True, 1, 9,
                             np.ones(HIDDEN, dtype=np.float32)) for name in ("p0", "p0", "p1")]
    batch = ActivationBatch.from_records(rows)
    batch.point_names = kind(batch.point_names)
    with _router("drop_newest") as router:
        router.register_request("a", [point])
        with pytest.raises(RouterError, match=r"one extraction point; got \[.*'p0'.*'p1'.*\]"):
            router.route_columns(batch)
        batch.point_names = kind(["p0"] * 3)  # one point: routed
        assert len(router.route_columns(batch)) == 3
        assert router.end_request("a")["p0"].stats.received == 3


def test_a_spans_list_given_again_routes_as_of_now_not_as_first_seen():
    # route_columns keeps a spans list's routes while no request starts or ends and
    # the list is unchanged: a request ended since, or spans changed in place, are
    # routed as a first call would route them.
    point = _points([("linear_probe", "inline", {0, 1}, None, "flag", 1)])[0]

    def batch() -> ActivationBatch:
        return ActivationBatch.from_records([
            ActivationRecord(request_id, "p0", layer, "residual_stream", 5, True, 1, 9,
                             np.full(HIDDEN, 1.0 + layer, dtype=np.float32))
            for request_id in ("a", "b") for layer in (0, 1)])

    spans = [("a", 0, 2), ("b", 2, 4)]
    with _router("drop_newest") as router:
        for request_id in ("a", "b"):
            router.register_request(request_id, [point])
        for _ in range(3):
            assert len(router.route_columns(batch(), spans).signals(batch())) == 4
        ended = router.end_request("b")["p0"]
        assert ended.stats.received == ended.stats.processed == 6
        router.route_columns(batch(), spans)  # b's rows arrive after it ended
        assert router.metrics()["late_records"] == 2
        spans[:] = [("a", 0, 2)]  # the same list, changed: b's rows are left out
        router.route_columns(batch(), spans)
        assert router.metrics()["late_records"] == 2
        kept = router.end_request("a")["p0"]
    assert kept.stats.received == kept.stats.processed == 3 * 2 + 2 + 2


@pytest.mark.parametrize("probe_type", ["linear_probe", "norm_probe"])
def test_requests_whose_rules_differ_are_judged_each_by_its_own_rule(probe_type):
    # Each request gets its own threshold and action for the same point name: the
    # one-pass judgement (one rule for the whole batch) must not apply; every
    # request is judged as routing its records alone would.
    rules = {"a": (None, "flag"), "b": (0.0, "abort"), "c": (100.0, "flag"), "d": (0.0, "flag")}
    rng = np.random.default_rng(7)
    rows = [ActivationRecord(request_id, "p0", layer, "residual_stream", 5, True, 1, 9,
                             rng.normal(size=HIDDEN).astype(np.float32))
            for request_id in rules for layer in (0, 2)]
    batch = ActivationBatch.from_records(rows)
    single, columnar = _router("drop_newest"), _router("drop_newest")
    try:
        for router in (single, columnar):
            for request_id, (threshold, action) in rules.items():
                router.register_request(request_id, _points(
                    [(probe_type, "inline", {0, 2}, threshold, action, 1)]))
        alone = [signal for request_id in rules for signal in single.route_batch(
            [row for row in rows if row.request_id == request_id])]
        together = columnar.route_columns(batch).signals(batch)
        assert [_signal_view(s) for s in together] == [_signal_view(s) for s in alone]
        assert [s.action.value for s in together] == ["continue"] * 2 + ["abort"] * 2 + [
            "continue"] * 2 + ["flag"] * 2
        for request_id in rules:
            assert columnar.abort_requested(request_id) == (request_id == "b")
            one = single.end_request(request_id)["p0"]
            many = columnar.end_request(request_id)["p0"]
            assert _result_view(many) == _result_view(one)
    finally:
        single.shutdown()
        columnar.shutdown()


def test_one_pass_judgement_settles_each_request_with_its_own_rows():
    # Four requests, one rule: judged in one pass. Only the crossing request's
    # summary records a first crossing, and each result keeps its own signals.
    point = _points([("norm_probe", "inline", {0, 1}, 3.0, "abort", 1)])[0]
    scale = {"a": 0.1, "b": 2.0, "c": 0.1, "d": 0.1}
    rows = [ActivationRecord(request_id, "p0", layer, "residual_stream", 5, True, 1, 9,
                             np.full(HIDDEN, scale[request_id], dtype=np.float32))
            for request_id in scale for layer in (0, 1)]
    batch = ActivationBatch.from_records(rows)
    with _router("drop_newest") as router:
        for request_id in scale:
            router.register_request(request_id, [point])
        router.route_columns(batch)
        assert [router.abort_requested(r) for r in scale] == [False, True, False, False]
        results = {request_id: router.end_request(request_id)["p0"] for request_id in scale}
    assert results["b"].verdict["first_crossing_layer"] == 0
    assert results["b"].verdict["max_score"] == pytest.approx(2.0 * math.sqrt(HIDDEN))
    for request_id in ("a", "c", "d"):
        assert results[request_id].verdict["flagged"] is False
        assert results[request_id].verdict["max_score"] == pytest.approx(
            0.1 * math.sqrt(HIDDEN))
    assert [(s.request_id, s.layer) for s in results["c"].signals] == [("c", 0), ("c", 1)]
    assert [r.stats.processed for r in results.values()] == [2, 2, 2, 2]


def test_signals_kept_until_read_hold_the_index_columns_not_the_activations():
    from router_helpers import binding_of

    points = _points([("linear_probe", "inline", {0, 1}, None, "flag", 1),
                      ("per_record", "inline", {0, 1}, None, "flag", 1)])
    rows = [ActivationRecord("a", "p0", layer, "residual_stream", 4, True, 0, 9,
                             np.ones(HIDDEN, dtype=np.float32)) for layer in (0, 1)]
    with _router("drop_newest") as router:
        router.register_request("a", points)
        router.route_columns(ActivationBatch(
            np.stack([r.tensor for r in rows]), request_ids=["a", "a"],
            point_names=["p0", "p0"], layers=[0, 1], tensor_type="residual_stream",
            token_indices=[4, 4], is_generated=[True, True], generated_indices=[0, 0],
            token_ids=[9, 9]))
        router.route_batch([ActivationRecord(r.request_id, "p1", r.layer, r.tensor_type, 4,
                                             True, 0, 9, r.tensor) for r in rows])
        for name in ("p0", "p1"):
            unread = binding_of(router, "a", name)._unread  # (six entries per batch kept)
            assert unread and len(unread) % 6 == 0
            assert all(kept._tensor is None and not kept.cache for kept in unread[1::6])
        result = router.end_request("a")
    assert [(s.layer, s.token_index) for s in result["p0"].signals] == [(0, 4), (1, 4)]


def _check_scores(points, steps_rows, results, overflow):
    """The per-record path's inline scores agree with the formulas above."""
    for point in points:
        if point.execution_mode.value == "async" or point.probe_type in (
                "capture", "trajectory_probe", "picky"):
            continue
        for request_id, point_results in results.items():
            result = point_results[point.name]
            expected = []
            for by_point in steps_rows:
                for record in by_point[point.name]:
                    if record.request_id != request_id:
                        continue
                    if point.probe_type == "per_record" and (
                            record.layer == 2 or (record.token_index % 3 == 0
                                                  and record.layer == 1)):
                        continue  # no signal, or an error (a fallback when blocking)
                    expected.append((record.token_index, record.layer,
                                     _expected_score(point, record.tensor)))
            scored = [(s.token_index, s.layer, s.score) for s in result.signals
                      if not s.metadata.get("fallback")]
            assert [(t, layer) for t, layer, _ in scored] == [(t, layer) for t, layer, _ in
                                                             expected]
            for (_, _, got), (_, _, want) in zip(scored, expected, strict=True):
                assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


# -- session level ---------------------------------------------------------------------


class PerRecordSession(CaptureSession):
    """The delivery the columnar one replaced: each request's tokens in order, a
    token's records sorted by layer (then arrival), routed per point with
    ``route_batch``, nothing after an aborting token. Keeps what it delivered on
    the side (``kept_signals`` / ``kept_records``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept_signals: dict[str, list[TokenSignal]] = {}
        self.kept_records: dict[str, list[ActivationRecord]] = {}

    def deliver(self, batches):
        tokens: dict[tuple[str, int], list[Any]] = {}
        order = 0
        for tensor_type, targets, rows in batches:
            if isinstance(targets, CaptureGroup):
                targets = targets.targets
            for target in targets:
                tokens.setdefault((target.state.request_id, target.token_index), []).append(
                    (target.layer, order, tensor_type.value, target, rows[target.slot_index]))
                order += 1
        with self.router.step():
            for key in sorted(tokens, key=lambda key: key[1]):
                self._route_token(sorted(tokens[key], key=lambda item: item[:2]))

    def _route_token(self, captured):
        state, token_index = captured[0][3].state, captured[0][3].token_index
        if state.closed or (state.abort is not None and token_index > state.abort.token_index):
            return
        generated = token_index - state.prompt_len if token_index >= state.prompt_len else None
        records = [ActivationRecord(state.request_id, target.point.name, layer, kind,
                                    token_index, generated is not None, generated,
                                    state.token_id_at(token_index), tensor)
                   for layer, _, kind, target, tensor in captured]
        self.kept_records.setdefault(state.request_id, []).extend(records)
        by_point: dict[str, list[int]] = {}
        for index, record in enumerate(records):
            by_point.setdefault(record.extraction_point_name, []).append(index)
        signals: list[Any] = [None] * len(records)
        for indices in by_point.values():
            for index, signal in zip(indices, self.router.route_batch(
                    [records[i] for i in indices]), strict=True):
                signals[index] = signal
        for record, signal in zip(records, signals, strict=True):
            if signal is None:
                continue
            self.kept_signals.setdefault(state.request_id, []).append(TokenSignal(
                record.extraction_point_name, record.layer, token_index, generated, signal))
            if signal.action is SignalAction.ABORT and state.abort is None:
                state.abort = AbortInfo(record.extraction_point_name, record.layer,
                                        token_index, generated, signal)
                state.finish_reason = "abort"


def _simulate(session: CaptureSession, prompts: list[list[int]], steps: int,
              table: Any, deliver_as: str = "targets") -> dict[str, Any]:
    """A generation: a prefill of every prompt, then ``steps`` decode forwards, each
    row's activation read from ``table[request, layer, token]``; aborted requests
    stop being fed. ``deliver_as``: each forward hands over the plan's groups with
    torch rows (``group_torch``, as the HF hooks do) or numpy rows
    (``group_numpy``), or lists of targets (``targets``, as the vLLM channel does).
    ``shifted``: as ``group_torch``, but a decode step's token sits at slot
    ``(row, None)`` (the row's one fed token, as in the HF hooks) and the last
    decode plan is repeated one token later (``StepPlan.shifted``) while the same
    requests are fed and every one is steady, as the HF driver does."""
    states = [session.open_request(f"r{index}", "", prompt)
              for index, prompt in enumerate(prompts)]
    fed = [0] * len(states)
    steady: tuple[StepPlan, list[Any]] | None = None
    for step in range(steps + 1):
        plan = StepPlan()
        feeding = [(index, state) for index, state in enumerate(states) if state.live]
        if deliver_as == "shifted" and steady is not None and steady[1] == feeding:
            plan = steady[0].shifted(1)
            fed = [state.prompt_len + len(state.generated) for state in states]
        else:
            for index, state in feeding:
                stop = state.prompt_len + len(state.generated)
                decode = deliver_as == "shifted" and step > 0
                plan.add_window(state, fed[index], stop,
                                (lambda t, i=index: (i, None)) if decode else
                                (lambda t, i=index: (i, t)))
                fed[index] = stop
            steady = None
            if deliver_as == "shifted" and step > 0 and not plan.edits and all(
                    state.steady_from is not None and fed[index] - 1 >= state.steady_from
                    for index, state in feeding):
                steady = (plan, feeding)
        batches = []
        for (layer, tensor_type), group in sorted(plan.groups.items(),
                                                  key=lambda item: item[0][0]):
            rows = np.stack([table[row, layer, fed[row] - 1 if column is None else column]
                             for row, column in group.slots])
            if deliver_as in ("group_torch", "shifted"):
                batches.append((tensor_type, group, torch.from_numpy(rows)))
            elif deliver_as == "group_numpy":
                batches.append((tensor_type, group, rows))
            else:
                batches.append((tensor_type, group.targets, rows))
        session.deliver(batches)
        for index, state in enumerate(states):
            if state.live:
                session.add_token(state, 50 + 7 * index + step)
    return {state.request_id: session.close_request(state.request_id, "") for state in states}


positions = st.sampled_from(("generated[*]", "prompt[-1]", "prompt[0]", "prompt[1]",
                             "generated[1:]"))


@settings(max_examples=90, deadline=None)
@example(  # an abort at a prefill token with later prompt tokens in the same forward
    specs=[("norm_probe", "inline", {0, 1}, 0.0, "abort", 1),
           ("linear_probe", "inline", {0, 2}, None, "flag", 1),
           ("per_record", "async", {1}, None, "flag", 2)],
    position_list=["prompt[0]", "prompt[-1]", "generated[*]"], prompt_lens=[3, 2],
    steps=2, seed=1, deliver_as="group_torch")
@example(  # two points abort on one generated token: the lower layer is the abort
    specs=[("norm_probe", "inline", {2, 3}, 0.0, "abort", 1),
           ("mean_probe", "inline_block", {1, 3}, -5.0, "abort", 1)],
    position_list=["generated[*]", "generated[*]", "prompt[0]"], prompt_lens=[2, 4],
    steps=3, seed=2, deliver_as="group_torch")
@example(  # decode steps repeated by StepPlan.shifted, three points of three kinds
    specs=[("linear_probe", "inline", {0, 1, 3}, 0.3, "flag", 1),
           ("trajectory_probe", "async", {2}, None, "flag", 2),
           ("capture", "inline", {0, 3}, None, "flag", 1)],
    position_list=["generated[*]", "generated[1:]", "generated[*]"], prompt_lens=[3, 2, 4],
    steps=4, seed=3, deliver_as="shifted")
@example(  # requests aborting at different steps: the shifted plan is planned again
    specs=[("linear_probe", "inline", {1, 2}, 0.8, "abort", 1),
           ("norm_probe", "inline_block", {0, 2}, None, "flag", 1)],
    position_list=["generated[*]", "generated[*]", "generated[*]"], prompt_lens=[2, 3, 1],
    steps=4, seed=5, deliver_as="shifted")
@given(specs=point_specs, position_list=st.lists(positions, min_size=3, max_size=3),
       prompt_lens=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       steps=st.integers(0, 4), seed=st.integers(0, 2**31 - 1),
       deliver_as=st.sampled_from(("group_torch", "group_numpy", "targets", "shifted")))
def test_session_deliver_equals_the_per_record_delivery(specs, position_list, prompt_lens,
                                                        steps, seed, deliver_as):
    rng = np.random.default_rng(seed)
    # as in the router test: a per-batch probe that raises stays inline under block
    specs = [("picky", "inline", *spec[2:]) if spec[:2] == ("picky", "async") else spec
             for spec in specs]
    points = _points(specs, position_list)
    prompts = [[int(t) for t in rng.integers(3, 90, size=n)] for n in prompt_lens]
    table = rng.normal(size=(len(prompts), 4, 16, HIDDEN)).astype(np.float32)
    # Workers drain between steps at their own pace, so only ``block`` (which never
    # drops) makes async results deterministic across forwards.
    with _router("block") as oracle_router, _router("block") as router:
        oracle = PerRecordSession(oracle_router, points, keep_records=True)
        # Kept records take the general path: a shifted plan is delivered from its
        # kept layout only without them.
        keep = deliver_as != "shifted"
        session = CaptureSession(router, points, keep_records=keep)
        expected = _simulate(oracle, prompts, steps, table, deliver_as)
        got = _simulate(session, prompts, steps, table, deliver_as)
    for request_id, out in got.items():
        want = expected[request_id]
        assert out.finish_reason == want.finish_reason
        assert out.token_ids == want.token_ids
        assert (out.abort is None) == (want.abort is None)
        if out.abort is not None:
            assert (out.abort.extraction_point_name, out.abort.layer, out.abort.token_index,
                    out.abort.generated_index) == (
                want.abort.extraction_point_name, want.abort.layer, want.abort.token_index,
                want.abort.generated_index)
        assert [(s.extraction_point_name, s.layer, s.token_index, s.generated_index,
                 s.action, _approx(s.score)) for s in out.signals] == [
            (s.extraction_point_name, s.layer, s.token_index, s.generated_index, s.action,
             _approx(s.score)) for s in oracle.kept_signals.get(request_id, [])]
        kept = oracle.kept_records.get(request_id, []) if keep else []
        assert [r.key() + (r.is_generated, r.generated_index, r.token_id)
                for r in out.records or []] == [r.key() + (r.is_generated, r.generated_index,
                                                     r.token_id) for r in kept]
        for mine, theirs in zip(out.records or [], kept, strict=True):
            assert np.array_equal(np.asarray(mine.tensor), np.asarray(theirs.tensor))
        for name, result in out.results.items():
            assert _result_view(result) == _result_view(want.results[name])
