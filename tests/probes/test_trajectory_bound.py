"""``TrajectoryProbe.abort_test`` (``RunningBound``): asked of each decode step in
turn, the steps it clears are held and judged later, in order. The oracle is
the probes' own judgement: whenever the bound cleared a run of steps, judging
them (after the state the probes held when they were asked) gives no row
``abort``; and its screen's bound on a step's norms is never below the norms
the exact path computes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from undercurrent.probes import TrajectoryProbe
from undercurrent.probes.statistics import l2_norms

torch = pytest.importorskip("torch")

REQUESTS, LAYERS = 3, 2
VALUES = st.one_of(st.floats(min_value=-3.0, max_value=3.0, allow_nan=False),
                   st.sampled_from([0.0, 1.0, 2.5, 2.5000000001, math.nan, math.inf]))


def _probes(options: dict[str, Any]) -> list[TrajectoryProbe]:
    probes = [TrajectoryProbe(source="norm", **options) for _ in range(REQUESTS)]
    for probe in probes:
        probe.on_start(None)  # type: ignore[arg-type]
    return probes


def _judge(probes: list[TrajectoryProbe], steps: list[list[float]]) -> list[int]:
    """Every request's rows of ``steps`` (each step: a value per request and
    layer, request after request) judged together, as a window routes them:
    each request's rows of every step in turn. The action codes, in that order."""
    rows = [(request, step, layer) for request in range(REQUESTS)
            for step in range(len(steps)) for layer in range(LAYERS)]
    values = np.array([steps[step][request * LAYERS + layer] for request, step, layer in rows])
    spans = [(request * len(steps) * LAYERS, (request + 1) * len(steps) * LAYERS)
             for request in range(REQUESTS)]
    tokens = [10 + step for _, step, _ in rows]
    layers = [layer for _, _, layer in rows]
    signals = TrajectoryProbe.judge_many(probes, values, spans, tokens, layers)
    assert signals is not None
    return list(signals.actions)


@settings(max_examples=200, deadline=None)
@given(statistic=st.sampled_from(["ewma", "mean", "max"]),
       alpha=st.sampled_from([0.1, 0.3, 1.0]), threshold=st.sampled_from([0.5, 2.5, 1e9]),
       steps=st.lists(st.lists(VALUES, min_size=REQUESTS * LAYERS,
                               max_size=REQUESTS * LAYERS), min_size=1, max_size=12))
def test_the_steps_it_clears_never_abort_when_judged(statistic, alpha, threshold, steps):
    probes = _probes({"statistic": statistic, "alpha": alpha, "threshold": threshold,
                      "action": "abort"})
    bound = TrajectoryProbe.abort_test(probes)
    assert bound is not None and bound.screen is not None
    held: list[list[float]] = []
    for step in steps:
        if bound(np.array(step)):  # may abort: the held steps, then this one, judged now
            if held:
                assert all(code == 0 for code in _judge(probes, held))
            held = []
            _judge(probes, [step])
        else:
            held.append(step)
    if held:
        assert all(code == 0 for code in _judge(probes, held))


def test_it_clears_a_step_only_while_every_statistic_stays_below():
    probes = _probes({"statistic": "max", "threshold": 2.0, "action": "abort"})
    bound = TrajectoryProbe.abort_test(probes)
    assert bound(np.array([1.0] * 6)) is False
    assert bound(np.array([1.0, 1.9, 0.0, 0.0, 0.0, 0.0])) is False
    assert bound(np.array([2.0] + [0.0] * 5)) is True  # (reaches it)
    assert bound(np.array([0.0] * 6)) is True  # (the step before is not judged yet)
    # Judged: the probes hold 2.0 now, so a fresh bound says "may abort" too.
    _judge(probes, [[1.0] * 6, [2.0] + [0.0] * 5])
    assert TrajectoryProbe.abort_test(probes)(np.array([0.0] * 6)) is True
    assert TrajectoryProbe.abort_test(_probes({"statistic": "max", "threshold": 2.0,
                                                "action": "abort"}))(
        np.array([math.nan] + [0.0] * 5)) is True
    flags = _probes({"threshold": 2.0})  # (flag only: never aborts)
    assert TrajectoryProbe.abort_test(flags)(np.array([9.0] * 6)) is False


@settings(max_examples=100, deadline=None)
@given(width=st.sampled_from([1, 7, 128, 1000]),
       scale=st.sampled_from([0.0, 1e-30, 1e-20, 1.0, 1e3, 1e15]),
       seed=st.integers(0, 2**16))
def test_its_screen_bounds_the_norms_the_exact_path_computes(width, scale, seed):
    rng = np.random.default_rng(seed)
    pieces = [torch.tensor(rng.normal(size=(REQUESTS, width)) * scale, dtype=torch.float32)
              for _ in range(LAYERS)]
    exact = max(float(np.max(l2_norms(piece.numpy().astype(np.float64))))
                for piece in pieces)
    probes = _probes({"statistic": "max", "threshold": exact * 2 + 1.0, "action": "abort"})
    bound = TrajectoryProbe.abort_test(probes)
    assert bound.screen(pieces) is False
    assert bound.seen >= exact
    # At the exact largest norm as the threshold, the screen cannot clear it.
    at = TrajectoryProbe.abort_test(_probes({"statistic": "max", "threshold": exact,
                                              "action": "abort"}))
    assert at.screen(pieces) is True
    # What it cannot read (no float rows) goes to the exact path.
    assert bound.screen([torch.ones(REQUESTS, width, dtype=torch.int64)]) is True
