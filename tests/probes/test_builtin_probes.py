"""trajectory_probe, dual_position_probe, norm_probe, mean_probe against plain-Python oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
from probe_helpers import activation

from undercurrent.probes import (
    DualPositionProbe,
    MeanProbe,
    NormProbe,
    RequestContext,
    TrajectoryProbe,
    get_probe,
    list_probes,
)
from undercurrent.probes.trajectory import _judge_lanes
from undercurrent.records import SignalAction
from undercurrent.spec.types import ProbeKind

CTX = RequestContext("r")
VALUES = [0.5, 2.0, 1.0, 4.0, 0.0, 3.0]


def test_every_builtin_is_registered_by_default():
    assert {"linear_probe", "trajectory_probe", "dual_position_probe", "norm_probe",
            "mean_probe"} <= set(list_probes())
    assert get_probe("trajectory_probe").supported_kinds() == (ProbeKind.TRAJECTORY,)
    assert get_probe("dual_position_probe").supported_kinds() == (ProbeKind.SINGLE_SHOT,)


def _norm_vector(norm: float) -> np.ndarray:
    return np.array([norm * 0.6, norm * 0.8, 0.0], dtype=np.float32)  # |v| == norm


def _run(probe, values, layer=0):
    probe.on_start(CTX)
    return [probe.on_activation(activation(_norm_vector(v), token=10 + i, layer=layer))
            for i, v in enumerate(values)]


def _oracle(statistic, values, alpha=0.3):
    out, running = [], None
    for n, v in enumerate(values, start=1):
        if running is None:
            running = v
        elif statistic == "mean":
            running = sum(values[:n]) / n
        elif statistic == "max":
            running = max(running, v)
        else:
            running = alpha * v + (1 - alpha) * running
        out.append(running)
    return out


@pytest.mark.parametrize("statistic", ["mean", "max", "ewma"])
def test_trajectory_statistic_of_the_norm_matches_a_plain_loop(statistic):
    probe = TrajectoryProbe(statistic=statistic, alpha=0.3)
    signals = _run(probe, VALUES)
    assert [s.score for s in signals] == pytest.approx(_oracle(statistic, VALUES), abs=1e-5)
    assert [s.metadata["value"] for s in signals] == pytest.approx(VALUES, abs=1e-5)
    verdict = probe.on_end(CTX)
    assert verdict["statistic"] == statistic and verdict["source"] == "norm"
    assert verdict["max_score"] == pytest.approx(max(_oracle(statistic, VALUES)), abs=1e-5)
    assert verdict["final_by_layer"][0] == pytest.approx(_oracle(statistic, VALUES)[-1], abs=1e-5)


def test_trajectory_aborts_from_the_first_crossing_and_respects_min_count():
    probe = TrajectoryProbe(statistic="max", threshold=2.0, action="abort", min_count=3)
    signals = _run(probe, VALUES)
    # max: 0.5, 2.0, 2.0, 4.0, ... -> crosses at token 11, but only counts from the 3rd value
    assert [s.action for s in signals] == [SignalAction.CONTINUE] * 2 + [SignalAction.ABORT] * 4
    verdict = probe.on_end(CTX)
    assert verdict["flagged"] and verdict["first_crossing_token_index"] == 12


@pytest.mark.parametrize("statistic", ["mean", "max", "ewma"])
@pytest.mark.parametrize("values", [[1.0, math.nan, 100.0], [math.nan, 1.0, 100.0]])
def test_a_nan_value_makes_the_statistic_nan_from_then_on_wherever_it_comes(statistic, values):
    """Every statistic, record by record and many instances at once (the lanes): from
    the NaN on the statistic is NaN and never reaches the threshold (a max forgot a
    NaN after a number, and ignored every value after a NaN first)."""
    nan_from = next(i for i, value in enumerate(values) if math.isnan(value))
    options = {"statistic": statistic, "threshold": 5.0, "action": "abort"}
    alone = _run(TrajectoryProbe(**options), values)
    probes = [TrajectoryProbe(**options) for _ in range(2)]
    for probe in probes:
        probe.on_start(CTX)
    rows = np.array(values * 2)
    together = _judge_lanes(probes, rows, [(0, 3), (3, 6)], [10, 11, 12] * 2, [0] * 6)
    assert together is not None  # (the lanes ran: the array path)
    runs = [([s.score for s in alone], [s.action for s in alone])]
    runs += [(list(together.scores)[start:start + 3], list(together.actions)[start:start + 3])
             for start in (0, 3)]
    for scores, actions in runs:
        assert all(math.isnan(score) for score in scores[nan_from:])
        assert not any(math.isnan(score) for score in scores[:nan_from])
        assert all(action in (0, SignalAction.CONTINUE) for action in actions)


def test_trajectory_keeps_one_running_statistic_per_layer():
    probe = TrajectoryProbe(statistic="mean")
    probe.on_start(CTX)
    for i, (a, b) in enumerate(zip(VALUES, reversed(VALUES), strict=True)):
        probe.on_activation(activation(_norm_vector(a), token=i, layer=4))
        probe.on_activation(activation(_norm_vector(b), token=i, layer=8))
    verdict = probe.on_end(CTX)
    mean = sum(VALUES) / len(VALUES)
    assert verdict["final_by_layer"] == {4: pytest.approx(mean), 8: pytest.approx(mean)}
    assert verdict["count"] == 2 * len(VALUES)


def test_trajectory_of_a_linear_score():
    weight, bias = np.array([1.0, -1.0, 0.5]), -0.25
    probe = TrajectoryProbe(statistic="ewma", alpha=0.5, weight=weight, bias=bias)
    signals = _run(probe, VALUES)
    scores = [1 / (1 + math.exp(-(float(weight @ _norm_vector(v).astype(float)) + bias)))
              for v in VALUES]
    assert [s.metadata["value"] for s in signals] == pytest.approx(scores, abs=1e-6)
    assert [s.score for s in signals] == pytest.approx(_oracle("ewma", scores, 0.5), abs=1e-6)
    assert probe.on_end(CTX)["source"] == "linear"


def test_trajectory_arguments_are_checked():
    with pytest.raises(ValueError, match="statistic must be one of mean, max, ewma"):
        TrajectoryProbe(statistic="median")
    with pytest.raises(ValueError, match="alpha must be"):
        TrajectoryProbe(alpha=0)
    with pytest.raises(ValueError, match="source 'norm' takes no path"):
        TrajectoryProbe(source="norm", weight=[1.0], bias=0.0)
    with pytest.raises(ValueError, match="needs path"):
        TrajectoryProbe(source="linear")


def test_norm_and_mean_probes_flatten_kv_tensors_and_threshold():
    kv = np.arange(12, dtype=np.float32).reshape(2, 3, 2)  # (2, num_kv_heads, head_dim)
    norm = NormProbe(threshold=20.0)
    norm.on_start(CTX)
    signal = norm.on_activation(activation(kv))
    assert signal.score == pytest.approx(math.sqrt(sum(i * i for i in range(12))))
    assert signal.action is SignalAction.FLAG
    mean = MeanProbe(threshold=6.0, action="abort")
    mean.on_start(CTX)
    assert mean.on_activation(activation(kv)).score == pytest.approx(5.5)
    assert mean.on_activation(activation(kv)).action is SignalAction.CONTINUE
    high = mean.on_activation(activation(kv + 1, token=3))
    assert high.action is SignalAction.ABORT
    verdict = mean.on_end(CTX)
    assert verdict == {
        "count": 3, "max_score": 6.5, "min_score": 5.5, "mean_score": pytest.approx(17.5 / 3),
        "last_score": 6.5, "flagged": True, "first_crossing_token_index": 3,
        "first_crossing_layer": 0, "threshold": 6.0, "statistic": "mean",
    }


def test_norm_probe_on_a_torch_bfloat16_tensor():
    torch = pytest.importorskip("torch")
    tensor = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    assert NormProbe().on_activation(activation(tensor)).score == 5.0


def test_dual_position_probe_reports_on_the_previous_token():
    weight = np.array([[1.0, 0.0], [0.0, 1.0]])
    probe = DualPositionProbe(weight=weight, bias=[0.0, 0.0], class_index=1)
    probe.on_start(CTX)
    signal = probe.on_activation(activation(np.array([0.0, 2.0]), token=7, layer=6))
    expected = math.exp(2.0) / (1 + math.exp(2.0))
    assert signal.score == pytest.approx(expected)
    assert signal.metadata["about_token_index"] == 6
    verdict = probe.on_end(CTX)
    assert verdict["readings"] == [{"read_at_token_index": 7, "about_token_index": 6, "layer": 6,
                                    "score": pytest.approx(expected), "class_index": 1}]
    with pytest.raises(ValueError, match="read_offset must be an int >= 1"):
        DualPositionProbe(weight=weight, bias=[0.0, 0.0], read_offset=0)


def test_a_probe_instance_resets_between_on_start_calls():
    probe = NormProbe()
    _run(probe, [1.0, 2.0])
    assert probe.on_end(CTX)["count"] == 2
    _run(probe, [5.0])
    assert probe.on_end(CTX)["count"] == 1
