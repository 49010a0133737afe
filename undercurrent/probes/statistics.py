"""``norm_probe`` and ``mean_probe``: one scalar statistic per activation.

Both flatten the tensor (``kv`` records are ``(2, num_kv_heads, head_dim)``) and
serve either probe kind. probe_args: ``threshold`` (a value at or above it
triggers ``action``; default none) and ``action`` (``flag`` default, or
``abort``). The verdict is a :class:`~undercurrent.probes.scoring.ScoreSummary`
dict plus ``statistic`` (``"l2_norm"`` or ``"mean"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from undercurrent.probes.arrays import as_float_matrix, float32_rows, map_rows, numpy_module
from undercurrent.probes.base import (
    Probe,
    RequestContext,
    ScoresRows,
    TellsSignals,
    shallow_copy,
)
from undercurrent.probes.scoring import (
    ScoreSummary,
    ThresholdRule,
    end_summaries,
    judge_summaries,
    start_summaries,
    threshold_signal_test,
)
from undercurrent.records import ActivationBatch, BatchSignals, SignalAction
from undercurrent.spec.types import ProbeKind


def l2_norms(matrix: Any) -> Any:
    """Euclidean norm of each row of a float64 matrix: what ``numpy.linalg.norm(matrix,
    axis=1)`` computes for real rows (the square root of each row's sum of squares,
    summed by ``add.reduce``), without its checks and copies per call."""
    np = numpy_module()
    return np.sqrt(np.add.reduce(matrix * matrix, axis=1))


def l2_norm(tensor: Any) -> float:
    """Euclidean norm of the flattened tensor, in float64."""
    return float(l2_norms(as_float_matrix([tensor]))[0])


def element_means(matrix: Any) -> Any:
    """Mean of each row of a float64 matrix."""
    return matrix.mean(axis=1)


def element_mean(tensor: Any) -> float:
    """Mean of all elements of the tensor, in float64."""
    return float(element_means(as_float_matrix([tensor]))[0])


class _StatisticProbe(TellsSignals):
    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)
    statistic_name = ""

    def __init__(self, *, threshold: float | None = None, action: str = "flag") -> None:
        self.rule = ThresholdRule.from_options(threshold, action)
        self.summary = ScoreSummary(self.rule.threshold)

    def statistics(self, matrix: Any) -> Any:
        """One score per row of a float64 matrix (one flattened activation per row)."""
        raise NotImplementedError

    def on_start(self, ctx: RequestContext) -> None:
        self.summary = ScoreSummary(self.rule.threshold, extra={"statistic": self.statistic_name})

    @classmethod
    def start_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]) -> bool:
        """Every instance's :meth:`on_start` at once (this class's own only)."""
        if cls.on_start is not _StatisticProbe.on_start:
            return False
        start_summaries(probes, {"statistic": cls.statistic_name})
        return True

    def copy_for_request(self) -> _StatisticProbe | None:
        # The rule is read-only; on_start makes the summary.
        return (shallow_copy(self)
                if type(self) in (NormProbe, MeanProbe) else None)

    def group_key(self) -> Any:
        return ("statistic", self.statistic_name)

    def may_abort(self) -> bool:
        return type(self) not in (NormProbe, MeanProbe) or self.rule.can_abort

    @classmethod
    def signal_test(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                    ) -> Callable[[Any], bool] | None:
        # A signal is a statistic at or above the threshold (a subclass: not told).
        if any(type(probe) not in (NormProbe, MeanProbe) for probe in probes):
            return None
        return threshold_signal_test(probes, actions)

    @classmethod
    def signal_screen(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                      ) -> Callable[[Sequence[Any]], bool] | None:
        # Where signal_test tells, the statistic in float32 on the captured
        # pieces, against the threshold less what float32 may miss.
        test = cls.signal_test(probes, actions)
        if test is None or not isinstance(probes[0], _StatisticProbe):
            return None
        rule = probes[0].rule
        if not rule.gives(actions) or rule.threshold is None or not math.isfinite(rule.threshold):
            return None
        return StatisticScreen(type(probes[0]) is NormProbe, rule.threshold)

    def row_values(self, batch: ActivationBatch) -> Any:
        """One statistic per row of the batch's matrix."""
        return map_rows(batch, self.statistics)

    def judge_rows(self, values: Any, token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals:
        return self.summary.batch_signals(self.rule, values, token_indices, layers)

    @classmethod
    def judge_many(cls, probes: Sequence[ScoresRows], values: Any,
                   spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals | None:
        """Every request's rows judged in one pass, when all ``probes`` are this
        very class with one rule."""
        if cls.judge_rows is not _StatisticProbe.judge_rows:
            return None
        return judge_summaries(probes, values, spans, token_indices, layers)

    def on_end(self, ctx: RequestContext) -> Any:
        return self.summary.verdict()

    @classmethod
    def end_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]
                 ) -> list[Any] | None:
        """Every instance's :meth:`on_end` verdict at once (this class's own only)."""
        return end_summaries(probes) if cls.on_end is _StatisticProbe.on_end else None


class NormProbe(_StatisticProbe):
    """``norm_probe``: the L2 norm of each activation (flattened) is its score."""

    statistic_name = "l2_norm"

    def statistics(self, matrix: Any) -> Any:
        return l2_norms(matrix)


class MeanProbe(_StatisticProbe):
    """``mean_probe``: the mean of each activation's elements is its score."""

    statistic_name = "mean"

    def statistics(self, matrix: Any) -> Any:
        return element_means(matrix)


class StatisticScreen:
    """Whether some row of a step may reach a ``norm_probe`` (``norm``) or
    ``mean_probe`` abort threshold, computed cheaply: the statistic in
    float32 on the captured pieces (numpy, on this thread), against the
    threshold less what float32 may miss. True ("may abort": the step's
    exact statistics then decide) within that margin of the threshold or
    above it, where a value is not finite, or where the pieces are not CPU
    float tensors; False only where no exact statistic reaches it.

    The margins, for rows of ``n`` values, ``u = 2^-24``: a float32 sum of
    squares (terms of one sign) is within ``(n + 2) u`` of the exact one,
    relative, less the squares below float32's normal range (at most ``n *
    2^-126`` in all), so the exact norm is at most the float32 norm times ``1
    + (n + 2) u``, plus ``sqrt(n) * 2^-63``; a float32 mean is within ``(n +
    2) u * max |x|`` of the exact one. Each margin is taken four times over,
    with ``1e-12 * (1 + |threshold|)`` for the float64 statistic."""

    __slots__ = ("norm", "threshold", "slack")

    def __init__(self, norm: bool, threshold: float) -> None:
        self.norm = norm
        self.threshold = threshold
        self.slack = 1e-12 * (1.0 + abs(threshold))

    def __call__(self, pieces: Sequence[Any]) -> bool:
        with numpy_module().errstate(all="ignore"):  # (NaN and overflow are answered)
            return self._may_reach(pieces)

    def _may_reach(self, pieces: Sequence[Any]) -> bool:
        np = numpy_module()
        threshold, unit = self.threshold, 2.0 ** -24
        for piece in pieces:
            rows = float32_rows(piece)
            if rows is None:
                return True  # (the exact path decides)
            width = rows.shape[1]
            if self.norm:
                top = float(np.sqrt(np.einsum("ij,ij->i", rows, rows).max()))
                if not math.isfinite(top):
                    return True  # (NaN, infinity, or squares past float32's range)
                bound = top * (1.0 + 4.0 * (width + 2) * unit) + math.sqrt(width) * 2.0 ** -61
            else:
                top = float(rows.mean(axis=1).max())
                low, high = float(rows.min()), float(rows.max())
                if not (math.isfinite(top) and math.isfinite(low) and math.isfinite(high)):
                    return True
                bound = top + 4.0 * (width + 2) * unit * max(high, -low)
            if bound + self.slack >= threshold:
                return True
        return False
