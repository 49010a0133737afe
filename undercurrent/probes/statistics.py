"""``norm_probe`` and ``mean_probe``: one scalar statistic per activation.

Both flatten the tensor (``kv`` records are ``(2, num_kv_heads, head_dim)``) and
serve either probe kind. probe_args: ``threshold`` (a value at or above it
triggers ``action``; default none) and ``action`` (``flag`` default, or
``abort``). The verdict is a :class:`~undercurrent.probes.scoring.ScoreSummary`
dict plus ``statistic`` (``"l2_norm"`` or ``"mean"``).
"""

from __future__ import annotations

from typing import Any

from undercurrent.probes.arrays import as_flat_vector, numpy_module
from undercurrent.probes.base import Probe, RequestContext
from undercurrent.probes.scoring import ScoreSummary, ThresholdRule
from undercurrent.records import ActivationRecord, ProbeSignal
from undercurrent.spec.types import ProbeKind


def l2_norm(tensor: Any) -> float:
    """Euclidean norm of the flattened tensor, in float64."""
    return float(numpy_module().linalg.norm(as_flat_vector(tensor)))


def element_mean(tensor: Any) -> float:
    """Mean of all elements of the tensor, in float64."""
    return float(as_flat_vector(tensor).mean())


class _StatisticProbe(Probe):
    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)
    statistic_name = ""

    def __init__(self, *, threshold: float | None = None, action: str = "flag") -> None:
        self.rule = ThresholdRule.from_options(threshold, action)
        self.summary = ScoreSummary(self.rule.threshold)

    def statistic(self, tensor: Any) -> float:
        raise NotImplementedError

    def on_start(self, ctx: RequestContext) -> None:
        self.summary = ScoreSummary(self.rule.threshold, extra={"statistic": self.statistic_name})

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        score = self.statistic(record.tensor)
        self.summary.add(score, record, self.rule.crossed(score))
        return self.rule.signal(score)

    def on_end(self, ctx: RequestContext) -> Any:
        return self.summary.verdict()


class NormProbe(_StatisticProbe):
    """``norm_probe``: the L2 norm of each activation (flattened) is its score."""

    statistic_name = "l2_norm"

    def statistic(self, tensor: Any) -> float:
        return l2_norm(tensor)


class MeanProbe(_StatisticProbe):
    """``mean_probe``: the mean of each activation's elements is its score."""

    statistic_name = "mean"

    def statistic(self, tensor: Any) -> float:
        return element_mean(tensor)
