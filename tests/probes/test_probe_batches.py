"""Probe.on_activations: scoring a batch gives what scoring one record at a time gives.

Every built-in overrides ``on_activations`` with one matrix operation per batch;
these tests feed the same records through both paths, on fresh instances, and
compare every signal and the verdict, for every tensor flavour the adapters hand
over (float32 and bfloat16 torch tensors, numpy arrays, ``kv``-shaped tensors).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from probe_helpers import activation
from sae_helpers import write_sae

from undercurrent.probes import (
    CaptureProbe,
    DualPositionProbe,
    LinearProbe,
    MeanProbe,
    NormProbe,
    Probe,
    RequestContext,
    SaeProbe,
    TrajectoryProbe,
    load_sae,
    save_linear_weights,
)
from undercurrent.probes.arrays import as_float_matrix
from undercurrent.probes.base import scores_records_at_once
from undercurrent.records import ProbeSignal, SignalAction
from undercurrent.spec.types import ProbeKind

CTX = RequestContext("r")
HIDDEN = 12  # a kv tensor of shape (2, 3, 2) flattens to 12 values
KV_SHAPE = (2, 3, 2)
TOKENS, LAYERS = 4, 3
BATCH_SIZES = (3, 1, 3, 1, 3, 1)  # mixed sizes, crossing token boundaries; 12 records in all

RNG = np.random.default_rng(20261129)
VALUES = RNG.normal(size=(TOKENS * LAYERS, HIDDEN))
W1 = RNG.normal(size=HIDDEN) * 0.5
B1 = 0.1
W3 = RNG.normal(size=(3, HIDDEN)) * 0.5
B3 = np.array([0.2, -0.1, 0.0])


def _labelled_file(tmp_path):
    return save_linear_weights(tmp_path / "labelled.safetensors", W3, B3,
                               label_names=["low", "mid", "high"])


def _sae_probe(tmp_path, architecture: str, **probe_args: Any) -> SaeProbe:
    """An SAE over the HIDDEN values, its threshold at the median score of VALUES."""
    folder = tmp_path / f"sae_{architecture}"
    write_sae(folder, architecture=architecture, d_in=HIDDEN, d_sae=16, seed=5)
    acts = load_sae(folder).encode(VALUES)
    watched = probe_args.get("features")
    scores = acts[:, watched].max(axis=1) if watched else acts.max(axis=1)
    return SaeProbe(path=folder, threshold=float(np.median(scores)), **probe_args)


# Each factory builds a fresh, configured probe; thresholds sit inside the range of
# the scores so that both continue and flag/abort signals are compared.
PROBES: dict[str, Callable[[Any], Probe]] = {
    "norm_probe": lambda tmp: NormProbe(threshold=3.4),
    "mean_probe": lambda tmp: MeanProbe(threshold=0.05, action="abort"),
    "linear_binary_sigmoid": lambda tmp: LinearProbe(weight=W1, bias=B1, threshold=0.5),
    "linear_binary_identity": lambda tmp: LinearProbe(weight=W1, bias=B1, link="identity",
                                                      threshold=0.0),
    "linear_multiclass_softmax": lambda tmp: LinearProbe(weight=W3, bias=B3, link="softmax",
                                                         class_index=2, threshold=0.34),
    "linear_multiclass_sigmoid": lambda tmp: LinearProbe(weight=W3, bias=B3, link="sigmoid",
                                                         class_index=1, threshold=0.5),
    "linear_multiclass_labelled": lambda tmp: LinearProbe(path=_labelled_file(tmp),
                                                          class_index="high", threshold=0.34),
    "trajectory_norm_mean": lambda tmp: TrajectoryProbe(statistic="mean", threshold=3.4),
    "trajectory_norm_max": lambda tmp: TrajectoryProbe(statistic="max", threshold=4.0,
                                                       min_count=2),
    "trajectory_norm_ewma": lambda tmp: TrajectoryProbe(statistic="ewma", alpha=0.4,
                                                        threshold=3.4, action="abort"),
    "trajectory_linear_mean": lambda tmp: TrajectoryProbe(statistic="mean", weight=W1,
                                                          bias=B1, threshold=0.5),
    "trajectory_linear_max": lambda tmp: TrajectoryProbe(statistic="max", weight=W1, bias=B1,
                                                         threshold=0.7),
    "trajectory_linear_ewma": lambda tmp: TrajectoryProbe(statistic="ewma", alpha=0.6,
                                                          weight=W1, bias=B1, threshold=0.5),
    "trajectory_linear_softmax": lambda tmp: TrajectoryProbe(statistic="ewma", weight=W3,
                                                             bias=B3, class_index=0,
                                                             threshold=0.3),
    "dual_position_binary": lambda tmp: DualPositionProbe(weight=W1, bias=B1, threshold=0.5,
                                                          action="abort"),
    "dual_position_multiclass": lambda tmp: DualPositionProbe(weight=W3, bias=B3, class_index=0,
                                                              threshold=0.3, read_offset=2),
    "dual_position_labelled": lambda tmp: DualPositionProbe(path=_labelled_file(tmp),
                                                            class_index="mid", threshold=0.3),
    "sae_standard_watched": lambda tmp: _sae_probe(tmp, "standard", features=[0, 3, 7]),
    "sae_jumprelu_top_k": lambda tmp: _sae_probe(tmp, "jumprelu", top_k=4, action="abort"),
    "sae_topk_top_k": lambda tmp: _sae_probe(tmp, "topk", top_k=2),
}


def _tensors(flavour: str) -> list[Any]:
    """The shared VALUES as the tensors an adapter would capture."""
    if flavour == "numpy_float32":
        return [row.astype(np.float32) for row in VALUES]
    if flavour == "numpy_float64_kv":
        return [row.reshape(KV_SHAPE) for row in VALUES]
    torch = pytest.importorskip("torch")
    rows = [torch.tensor(row, dtype=torch.float32) for row in VALUES]
    if flavour == "torch_float32":
        return rows
    if flavour == "torch_bfloat16":
        return [row.to(torch.bfloat16) for row in rows]
    if flavour == "torch_float32_kv":
        return [row.reshape(KV_SHAPE) for row in rows]
    if flavour == "torch_bfloat16_kv":
        return [row.to(torch.bfloat16).reshape(KV_SHAPE) for row in rows]
    raise AssertionError(flavour)


FLAVOURS = ["numpy_float32", "numpy_float64_kv", "torch_float32", "torch_bfloat16",
            "torch_float32_kv", "torch_bfloat16_kv"]


def _records(flavour: str):
    tensors = _tensors(flavour)
    # token-major, layer-minor: the order the adapters route a point's records in
    return [activation(tensors[t * LAYERS + layer], token=5 + t, layer=layer)
            for t in range(TOKENS) for layer in range(LAYERS)]


def _batches(records):
    start = 0
    for size in BATCH_SIZES:
        yield records[start:start + size]
        start += size
    assert start == len(records)


def assert_same(actual: Any, expected: Any, where: str = "value") -> None:
    """Equal, with floats compared to 1e-12 (a batch is one matrix product, not n)."""
    if isinstance(expected, float) and not isinstance(expected, bool):
        assert isinstance(actual, float), f"{where}: {actual!r} is not a float"
        assert actual == pytest.approx(expected, rel=0, abs=1e-12), where
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


def assert_same_signals(actual, expected) -> None:
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert isinstance(a, ProbeSignal) and isinstance(e, ProbeSignal)
        assert a.action is e.action, f"signal {index}"
        assert_same(a.score, e.score, f"signal {index} score")
        assert_same(dict(a.metadata), dict(e.metadata), f"signal {index} metadata")


def _one_by_one(probe: Probe, records):
    probe.on_start(CTX)
    signals = [probe.on_activation(record) for record in records]
    return signals, probe.on_end(CTX)


def _in_batches(probe: Probe, records):
    probe.on_start(CTX)
    signals = []
    for batch in _batches(records):
        got = probe.on_activations(batch)
        assert len(got) == len(batch)
        signals.extend(got)
    return signals, probe.on_end(CTX)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("name", sorted(PROBES))
def test_scoring_in_batches_gives_the_same_signals_and_verdict_as_one_by_one(
        name, flavour, tmp_path):
    records = _records(flavour)
    expected_signals, expected_verdict = _one_by_one(PROBES[name](tmp_path), records)
    signals, verdict = _in_batches(PROBES[name](tmp_path), records)
    assert_same_signals(signals, expected_signals)
    assert_same(verdict, expected_verdict, "verdict")


@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_thresholds_used_above_split_the_records_so_actions_are_really_compared(
        name, tmp_path):
    signals, verdict = _one_by_one(PROBES[name](tmp_path), _records("numpy_float32"))
    actions = {signal.action for signal in signals}
    assert SignalAction.CONTINUE in actions
    assert actions & {SignalAction.FLAG, SignalAction.ABORT}
    assert verdict["count"] == TOKENS * LAYERS and verdict["flagged"] is True


def test_one_batch_of_every_record_equals_one_by_one_for_a_per_layer_trajectory():
    records = _records("numpy_float32")
    expected, expected_verdict = _one_by_one(TrajectoryProbe(statistic="ewma"), records)
    probe = TrajectoryProbe(statistic="ewma")
    probe.on_start(CTX)
    signals = probe.on_activations(records)
    assert_same_signals(signals, expected)
    assert_same(probe.on_end(CTX), expected_verdict, "verdict")
    # the per-layer running statistic really is per layer (not one over the batch)
    assert sorted(expected_verdict["final_by_layer"]) == list(range(LAYERS))
    assert len(set(expected_verdict["final_by_layer"].values())) == LAYERS


def test_batch_scores_match_a_plain_oracle_for_bfloat16_kv_tensors():
    torch = pytest.importorskip("torch")
    tensors = [torch.tensor(row, dtype=torch.float32).to(torch.bfloat16).reshape(KV_SHAPE)
               for row in VALUES[:3]]
    probe = LinearProbe(weight=W1, bias=B1, link="identity")
    signals = probe.on_activations([activation(t, token=i) for i, t in enumerate(tensors)])
    expected = [float(W1 @ t.float().numpy().astype(np.float64).ravel() + B1) for t in tensors]
    assert [s.score for s in signals] == pytest.approx(expected, rel=0, abs=1e-12)
    norms = NormProbe().on_activations([activation(t) for t in tensors])
    assert [s.score for s in norms] == pytest.approx(
        [float(np.linalg.norm(t.float().numpy().astype(np.float64))) for t in tensors],
        rel=0, abs=1e-12)


@pytest.mark.parametrize("cls", [NormProbe, MeanProbe, LinearProbe, TrajectoryProbe,
                                 DualPositionProbe])
def test_every_builtin_scores_batches_natively_so_the_router_hands_it_whole_batches(cls):
    assert cls.on_activations is not Probe.on_activations
    probe = cls() if cls in (NormProbe, MeanProbe, TrajectoryProbe) else cls(weight=W1, bias=B1)
    assert scores_records_at_once(probe)


def test_the_default_on_activations_calls_on_activation_once_per_record_in_order():
    class Echo(Probe):
        def __init__(self):
            self.calls = []

        def on_activation(self, record):
            self.calls.append((record.token_index, record.layer))
            if record.layer == 1:
                return None
            return ProbeSignal(score=record.token_index * 10 + record.layer)

    probe = Echo()
    assert not scores_records_at_once(probe)
    records = [activation(np.zeros(2), token=t, layer=layer)
               for t in (3, 4) for layer in (0, 1, 2)]
    signals = probe.on_activations(records)
    assert probe.calls == [(3, 0), (3, 1), (3, 2), (4, 0), (4, 1), (4, 2)]
    assert [None if s is None else s.score for s in signals] == [30.0, None, 32.0,
                                                                 40.0, None, 42.0]
    assert probe.on_activations([]) == []


def test_as_float_matrix_stacks_numpy_vectors_and_lists_as_float64_rows():
    rows = [row.astype(np.float32) for row in VALUES[:3]]
    matrix = as_float_matrix(rows)
    assert isinstance(matrix, np.ndarray)
    assert matrix.shape == (3, HIDDEN) and matrix.dtype == np.float64
    np.testing.assert_array_equal(matrix, np.stack(rows).astype(np.float64))
    from_lists = as_float_matrix([[1, 2], [3, 4], [5, 6]])
    assert from_lists.dtype == np.float64 and from_lists.tolist() == [[1, 2], [3, 4], [5, 6]]
    single = as_float_matrix([VALUES[0]])
    assert single.shape == (1, HIDDEN)


def test_as_float_matrix_flattens_numpy_kv_tensors_row_by_row():
    kv = [row.reshape(KV_SHAPE) for row in VALUES[:2]]
    matrix = as_float_matrix(kv)
    assert matrix.shape == (2, HIDDEN) and matrix.dtype == np.float64
    np.testing.assert_array_equal(matrix, VALUES[:2])


def test_as_float_matrix_turns_torch_float32_bfloat16_and_kv_tensors_into_float64_numpy():
    torch = pytest.importorskip("torch")
    rows = [torch.tensor(row, dtype=torch.float32) for row in VALUES[:3]]
    matrix = as_float_matrix(rows)
    assert isinstance(matrix, np.ndarray)
    assert matrix.shape == (3, HIDDEN) and matrix.dtype == np.float64
    np.testing.assert_array_equal(matrix, VALUES[:3].astype(np.float32).astype(np.float64))

    halves = [row.to(torch.bfloat16) for row in rows]
    matrix = as_float_matrix(halves)
    assert matrix.shape == (3, HIDDEN) and matrix.dtype == np.float64
    np.testing.assert_array_equal(matrix, torch.stack(halves).float().numpy().astype(np.float64))
    assert not np.array_equal(matrix, VALUES[:3])  # really rounded to bfloat16

    kv = [row.reshape(KV_SHAPE) for row in rows]
    matrix = as_float_matrix(kv)
    assert matrix.shape == (3, HIDDEN) and matrix.dtype == np.float64
    np.testing.assert_array_equal(matrix[1], kv[1].numpy().astype(np.float64).ravel())

    kv_half = [row.to(torch.bfloat16) for row in kv]
    assert as_float_matrix(kv_half).shape == (3, HIDDEN)


class _JudgedOneByOne(LinearProbe):
    """The per-activation path of ``LinearProbe``: a subclass that overrides ``judge``
    makes ``on_activations`` call it per record (the code before the one-pass path)."""

    def judge(self, record, score, meta):
        return super().judge(record, score, meta)


@pytest.mark.parametrize("name", sorted(n for n in PROBES if n.startswith("linear_")))
def test_linear_probe_one_pass_judging_equals_judge_per_activation(name, tmp_path):
    records = _records("numpy_float32")
    probe = PROBES[name](tmp_path)
    oracle = _JudgedOneByOne.__new__(_JudgedOneByOne)
    oracle.__dict__.update(PROBES[name](tmp_path).__dict__)
    signals, verdict = _in_batches(probe, records)
    expected, expected_verdict = _in_batches(oracle, records)
    assert [s.action for s in signals] == [s.action for s in expected]
    assert [s.score for s in signals] == [s.score for s in expected]  # exactly equal
    assert [dict(s.metadata) for s in signals] == [dict(s.metadata) for s in expected]
    assert verdict == expected_verdict


def test_score_summary_add_many_equals_add_in_order_with_gaps_and_ties():
    from undercurrent.probes.scoring import ScoreSummary, ThresholdRule

    scores = [0.3, None, 0.9, 0.1, 0.9, None, 0.30000000000000004, 1e-17]
    records = [activation(np.zeros(2), token=t, layer=t % 2) for t in range(len(scores))]
    rule = ThresholdRule(threshold=0.85)
    crossed = [s is not None and rule.crossed(s) for s in scores]
    one_by_one, many = ScoreSummary(0.85), ScoreSummary(0.85)
    for score, record, hit in zip(scores, records, crossed, strict=True):
        one_by_one.add(score, record, hit)
    many.add_many(scores[:3], records[:3], crossed[:3])
    many.add_many(scores[3:], records[3:], crossed[3:])
    assert many.verdict() == one_by_one.verdict()
    assert (many.total, many.scored) == (one_by_one.total, one_by_one.scored)
    assert many.verdict()["first_crossing_token_index"] == 2
    present = [s for s in scores if s is not None]
    signals = rule.signals(present, [{"i": i} for i in range(len(present))])
    for signal, score, index in zip(signals, present, range(len(present)), strict=True):
        single = rule.signal(score, {"i": index})
        assert (signal.action, signal.score, signal.metadata) == \
            (single.action, single.score, single.metadata)


def test_a_context_at_a_point_is_what_replacing_its_point_gives():
    """``RequestContext.at_point`` (what the router binds each probe with):
    equal to ``dataclasses.replace``, the original context unchanged."""
    import dataclasses

    from undercurrent.spec.types import ExtractionPoint

    point = ExtractionPoint(name="p", layers=(1,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="norm_probe",
                            probe_kind="single_shot")
    ctx = RequestContext("r", prompt="hi", prompt_len=2, model_name="m",
                         prompt_token_ids=[4, 5], metadata={"temperature": 0.0})
    bound = ctx.at_point(point)
    assert bound == dataclasses.replace(ctx, extraction_point=point)
    assert bound.extraction_point is point and ctx.extraction_point is None
    assert bound.prompt_token_ids == (4, 5) and dict(bound.metadata) == {"temperature": 0.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        bound.prompt = "changed"  # type: ignore[misc]


def test_whether_a_class_scores_batches_follows_a_patch_made_after_it_was_asked(monkeypatch):
    """``scores_batches`` keeps its answer per class, and a class patched later
    (a method added or removed) is answered anew."""
    from undercurrent.probes.base import scores_batches

    class PerRecord(Probe):
        probe_kind = ProbeKind.SINGLE_SHOT

        def on_activation(self, record):
            return None

    probe = PerRecord()
    assert scores_batches(probe) is False
    monkeypatch.setattr(PerRecord, "on_batch", lambda self, batch: None, raising=False)
    monkeypatch.delattr(PerRecord, "on_activation")
    assert scores_batches(probe) is True
    monkeypatch.undo()
    assert scores_batches(probe) is False


def test_a_probe_class_defined_again_lets_its_old_definitions_go():
    """A notebook cell that defines a probe class and runs it, run again: what is
    kept per class (whether it scores batches or shares its values, the problems
    of its probe_args) holds no class, so every old definition is freed, its
    methods' ``super()`` cells included."""
    from undercurrent.router import Router
    from undercurrent.spec.types import ExtractionPoint

    point = ExtractionPoint(name="p", layers=(0,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="halved",
                            probe_kind="single_shot", execution_mode="inline",
                            probe_args={"threshold": 1.0e9})
    defined = []
    for _ in range(3):  # (the cell, run three times)
        class Halved(NormProbe):
            def row_values(self, batch):
                return super().row_values(batch) / 2

            def on_batch(self, batch):
                return super().on_batch(batch)

        with Router(probes={"halved": Halved}) as router:
            router.register_request("r", [point])
            router.route_batch([activation(VALUES[t], token=t) for t in range(3)])
            result = router.end_request("r")["p"]
            assert (result.stats.processed, result.error) == (3, None)
        defined.append(weakref.ref(Halved))
        del Halved, router, result
    gc.collect()
    assert [ref() for ref in defined] == [None, None, None]


@pytest.mark.parametrize("base", [NormProbe, CaptureProbe])
@pytest.mark.parametrize(("mode", "layers"), [("inline", (0,)), ("inline", (0, 1)),
                                              ("async", (0, 1))])
def test_a_builtin_s_subclass_with_its_own_on_activation_gets_every_record(base, mode, layers):
    # The override is served per record however many records a routed batch holds
    # (several layers, an async worker's turn), never the built-in's own scoring.
    from undercurrent.router import Router
    from undercurrent.spec.types import ExtractionPoint

    seen: list[tuple[int, int]] = []

    class Flagger(base):  # type: ignore[valid-type,misc]
        def on_activation(self, record):
            seen.append((record.token_index, record.layer))
            return ProbeSignal(SignalAction.FLAG, score=-float(record.token_index))

    assert not scores_records_at_once(Flagger())
    router = Router(probes={"flagger": Flagger})
    point = ExtractionPoint(name="p", layers=layers, tensor_type="residual_stream",
                            position="generated[*]", probe_type="flagger",
                            probe_kind="trajectory", execution_mode=mode)
    try:
        router.register_request("r", [point], RequestContext("r"))
        for token in range(3):
            router.route_batch([activation(np.ones(4), token=token, layer=layer)
                                for layer in layers])
        result = router.end_request("r")["p"]
    finally:
        router.shutdown()
    expected = [(token, layer) for token in range(3) for layer in layers]
    assert seen == expected
    assert [(s.action, s.score) for s in result.signals] == [
        (SignalAction.FLAG, -float(token)) for token, _ in expected]
    assert result.stats.received == result.stats.processed == len(expected)
