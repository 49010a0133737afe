"""``TrajectoryProbe.judge_many`` runs the recurrence of many instances at once
(``_judge_lanes``: one array operation per step, or per row position where a
step meets a layer twice). The oracle is each
instance judging its own rows alone (``judge_rows``: one Python update per row,
in order): the statistics, signals, summaries and running state must be equal,
bit for bit, batch after batch, NaN and infinities included.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from undercurrent.probes import TrajectoryProbe, trajectory
from undercurrent.probes.trajectory import _judge_lanes
from undercurrent.records import BatchSignals, as_list

FLOATS = st.one_of(
    st.floats(min_value=-4.0, max_value=4.0, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0]),
)


def _probes(count: int, options: dict[str, Any]) -> list[TrajectoryProbe]:
    probes = [TrajectoryProbe(**options) for _ in range(count)]
    for probe in probes:
        probe.on_start(None)  # type: ignore[arg-type]
    return probes


def _same(left: Any, right: Any) -> bool:
    """Equal, NaN equal to NaN (floats compared exactly)."""
    if isinstance(left, float) and isinstance(right, float):
        return left == right or (math.isnan(left) and math.isnan(right))
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_same(left[k], right[k]) for k in left)
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return len(left) == len(right) and all(map(_same, left, right))
    return bool(left == right)


def _columns(signals: BatchSignals) -> tuple[Any, ...]:
    scores = [] if signals.scores is None else as_list(signals.scores)
    return (as_list(signals.actions), scores,
            {key: as_list(column) for key, column in (signals.metadata or {}).items()})


def _one_by_one(probes: list[TrajectoryProbe], values: np.ndarray, spans: list[tuple[int, int]],
                tokens: list[int], layers: list[int]) -> tuple[Any, ...]:
    actions: list[int] = []
    scores: list[float] = []
    metadata: dict[str, list[Any]] = {"value": [], "statistic": [], "layer": []}
    for probe, (start, stop) in zip(probes, spans, strict=True):
        got = probe.judge_rows(values[start:stop], tokens[start:stop], layers[start:stop])
        actions += list(got.actions)
        scores += list(got.scores or [])
        for key in metadata:
            metadata[key] += list((got.metadata or {})[key])
    return actions, scores, metadata


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    count=st.integers(1, 5),
    statistic=st.sampled_from(["ewma", "mean", "max"]),
    alpha=st.sampled_from([0.3, 1.0, 0.125]),
    threshold=st.one_of(st.none(), st.floats(-1.0, 2.0)),
    action=st.sampled_from(["flag", "abort"]),
    min_count=st.integers(1, 3),
    pattern=st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),
    again=st.booleans(),
    tokens_per_batch=st.integers(1, 3),
    batches=st.integers(1, 4),
)
def test_lanes_equal_each_instance_alone(data, count, statistic, alpha, threshold, action,
                                         min_count, pattern, again, tokens_per_batch, batches):
    assume(threshold is not None or action == "flag")  # (abort needs a threshold)
    options = {"statistic": statistic, "alpha": alpha, "threshold": threshold,
               "action": action, "min_count": min_count}
    if again:  # a token meets its first layer twice: the lanes are not met step by step
        pattern = [*pattern, pattern[0]]
    together, alone = _probes(count, options), _probes(count, options)
    width = len(pattern) * tokens_per_batch
    token = 7
    for _ in range(batches):
        values = np.array(data.draw(st.lists(FLOATS, min_size=width * count,
                                             max_size=width * count)), dtype=np.float64)
        layers = pattern * tokens_per_batch * count
        tokens = [token + step for _ in range(count) for step in range(tokens_per_batch)
                  for _ in pattern]
        token += tokens_per_batch
        spans = [(i * width, (i + 1) * width) for i in range(count)]
        lanes = _judge_lanes(together, values, spans, tokens, layers)
        assert lanes is not None  # the lane path really ran
        expected = _one_by_one(alone, values, spans, tokens, layers)
        assert _same(_columns(lanes), expected)
        for mine, theirs in zip(together, alone, strict=True):
            assert _same(mine.summary.verdict(), theirs.summary.verdict())
            assert _same({k: (r.count, r.value) for k, r in mine.running.items()},
                         {k: (r.count, r.value) for k, r in theirs.running.items()})
    for mine, theirs in zip(together, alone, strict=True):
        assert _same(mine.on_end(None), theirs.on_end(None))  # type: ignore[arg-type]


@pytest.mark.parametrize(("pattern", "by_step"), [([0, 1, 2, 3], True), ([2, 0, 2], False)])
def test_lanes_go_a_step_at_a_time_where_each_step_meets_every_lane_once(monkeypatch, pattern,
                                                                        by_step):
    """A window's rows of every layer, step after step, take one array operation
    per step (``_advance_steps``); rows meeting a lane twice in a step go a
    column at a time. Both answer what each instance alone does, bit for bit."""
    steps = []
    advance = trajectory._advance_steps
    monkeypatch.setattr(trajectory, "_advance_steps",
                        lambda *args: steps.append(args[4].shape) or advance(*args))
    options = {"statistic": "ewma", "alpha": 0.3, "threshold": 0.5}
    together, alone = _probes(3, options), _probes(3, options)
    rng = np.random.default_rng(5)
    token = 4
    for _ in range(3):  # fresh lanes first, then lanes with a running statistic
        width = len(pattern) * 5
        values = rng.random(3 * width)
        layers = pattern * 5 * 3
        tokens = [token + step for _ in range(3) for step in range(5) for _ in pattern]
        token += 5
        spans = [(i * width, (i + 1) * width) for i in range(3)]
        lanes = _judge_lanes(together, values, spans, tokens, layers)
        assert lanes is not None
        assert _same(_columns(lanes), _one_by_one(alone, values, spans, tokens, layers))
        assert any(as_list(lanes.actions))  # some rows cross: actions compared for real
    assert steps == ([(3, 5, len(pattern))] * 3 if by_step else [])
    for mine, theirs in zip(together, alone, strict=True):
        assert _same(mine.on_end(None), theirs.on_end(None))  # type: ignore[arg-type]


def test_judge_many_falls_back_to_each_instance_when_the_layers_differ():
    """An instance that saw other layers, or in another order, is not judged in
    lanes; judge_many still answers exactly what each instance alone does."""
    options = {"statistic": "ewma", "alpha": 0.5, "threshold": 0.6}
    together, alone = _probes(2, options), _probes(2, options)
    first = np.array([0.2, 0.9], dtype=np.float64)
    for probes in (together, alone):
        probes[1].judge_rows(first, [3, 3], [2, 1])  # layers met in the order 2, 1
    values = np.array([0.1, 0.7, 0.4, 0.8], dtype=np.float64)
    spans, tokens, layers = [(0, 2), (2, 4)], [4, 4, 4, 4], [1, 2, 1, 2]
    assert _judge_lanes(together, values, spans, tokens, layers) is None
    got = TrajectoryProbe.judge_many(together, values, spans, tokens, layers)
    assert got is not None
    assert _same(_columns(got), _one_by_one(alone, values, spans, tokens, layers))
    assert got.actions == [0, 1, 1, 0]  # some rows cross: the actions are compared for real


def test_lanes_refuse_instances_with_different_options():
    values = np.array([0.5, 0.5], dtype=np.float64)
    mixed = [*_probes(1, {"statistic": "ewma"}), *_probes(1, {"statistic": "max"})]
    assert _judge_lanes(mixed, values, [(0, 1), (1, 2)], [1, 1], [0, 0]) is None
    alphas = [*_probes(1, {"alpha": 0.3}), *_probes(1, {"alpha": 0.4})]
    assert _judge_lanes(alphas, values, [(0, 1), (1, 2)], [1, 1], [0, 0]) is None


def test_lanes_keep_their_state_between_calls_and_give_it_back_to_any_other_use():
    """Instances judged together keep their running statistics in one block of
    arrays from one call to the next (no lists read and written per call);
    judging one alone, a different set or order of instances, or reading an
    instance's state takes it back first. Every step answers what each
    instance alone answers, bit for bit."""
    options = {"statistic": "ewma", "alpha": 0.3, "threshold": 0.7}
    together, alone = _probes(3, options), _probes(3, options)
    rng = np.random.default_rng(11)
    token = 1

    def judge(which: list[int]) -> None:
        nonlocal token
        pattern = [4, 6]
        values = rng.random(2 * len(which) * len(pattern))
        layers = pattern * 2 * len(which)
        tokens = [token + step for _ in which for step in range(2) for _ in pattern]
        token += 2
        spans = [(i * 4, (i + 1) * 4) for i in range(len(which))]
        got = _judge_lanes([together[i] for i in which], values, spans, tokens, layers)
        assert got is not None
        expected = _one_by_one([alone[i] for i in which], values, spans, tokens, layers)
        assert _same(_columns(got), expected)

    judge([0, 1, 2])
    block = together[0]._block
    assert block is not None and all(probe._block is block for probe in together)
    judge([0, 1, 2])
    assert together[2]._block is block  # the same block, its arrays moved on in place
    assert block.counts.tolist() == [[4, 4]] * 3
    # One instance alone: it takes its state back, the others keep theirs.
    values, tokens, layers = np.array([0.9, 0.2]), [token, token], [4, 6]
    token += 1
    mine, theirs = (probes[1].judge_rows(values, tokens, layers) for probes in (together, alone))
    assert _same(_columns(mine), _columns(theirs))
    assert together[1]._block is None and together[0]._block is block
    judge([2, 0])  # another set, in another order: a new block
    assert together[2]._block is together[0]._block is not block
    judge([0, 1, 2])
    for mine, theirs in zip(together, alone, strict=True):
        assert _same({k: (r.count, r.value) for k, r in mine.running.items()},
                     {k: (r.count, r.value) for k, r in theirs.running.items()})
        assert _same(mine.summary.verdict(), theirs.summary.verdict())
    assert together[0]._block is None  # read back: the lists are its state again
    verdicts = TrajectoryProbe.end_many(together, [None] * 3)  # type: ignore[list-item]
    assert _same(verdicts, [probe.on_end(None) for probe in alone])  # type: ignore[arg-type]
    together[0].on_start(None)  # type: ignore[arg-type]
    assert together[0]._block is None and together[0].running == {}
