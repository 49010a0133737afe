"""Records, signals and results: the values that flow through the router."""

from __future__ import annotations

import dataclasses
import time

import pytest

from undercurrent.records import (
    ActivationRecord,
    ProbeResult,
    ProbeSignal,
    ProbeStats,
    SignalAction,
)


def test_signal_coerces_action_strings_and_scores_to_float():
    before = time.time()
    signal = ProbeSignal("abort", score=1)
    assert signal.action is SignalAction.ABORT and isinstance(signal.score, float)
    assert before <= signal.timestamp <= time.time()
    assert ProbeSignal().action is SignalAction.CONTINUE and ProbeSignal().score is None
    with pytest.raises(ValueError):
        ProbeSignal("stop")


def test_records_are_frozen_and_keyed_by_request_point_layer_token():
    record = ActivationRecord("r", "p", 3, "mlp_out", 12, True, 2, 99, [0.0])
    assert record.key() == ("r", "p", 3, 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.layer = 4  # type: ignore[misc]


def test_result_reports_flagged_and_scores_in_signal_order():
    signals = [ProbeSignal(score=0.1), ProbeSignal("flag", score=0.9), ProbeSignal()]
    stats = ProbeStats(received=3, processed=3)
    result = ProbeResult("r", "p", {"max": 0.9}, signals, stats)
    assert isinstance(result.signals, tuple)
    assert result.flagged and result.scores == [0.1, 0.9, None]
    quiet = ProbeResult("r", "p", None, [ProbeSignal()], stats)
    assert not quiet.flagged
    assert stats.as_dict() == {"received": 3, "processed": 3, "dropped": 0, "errors": 0,
                               "timeouts": 0, "mean_latency_s": 0.0}
