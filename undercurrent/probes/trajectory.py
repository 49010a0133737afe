"""``trajectory_probe``: a running statistic of a per-token value across a request."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from undercurrent.probes.arrays import batch_matrix
from undercurrent.probes.base import RequestContext, ScoresRows
from undercurrent.probes.linear import LinearReadout
from undercurrent.probes.scoring import ScoreSummary, ThresholdRule
from undercurrent.probes.statistics import l2_norms
from undercurrent.records import (
    ACTION_CODES,
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
)
from undercurrent.spec.types import ProbeKind

STATISTICS = ("mean", "max", "ewma")
SOURCES = ("linear", "norm")


@dataclass
class _Running:
    """One layer's running statistic."""

    count: int = 0
    value: float = 0.0


class TrajectoryProbe(ScoresRows):
    """``trajectory_probe``: running mean, max or EWMA of a per-token value.

    Each activation yields a value: the linear score (``source: linear``, with the
    ``linear_probe`` arguments ``path`` or ``weight``/``bias``, ``link``,
    ``class_index``) or the L2 norm (``source: norm``). The running statistic is
    kept per layer, so a point with several layers tracks each layer's trajectory
    separately. probe_args:

    - ``statistic``: ``ewma`` (default), ``mean`` or ``max``;
    - ``alpha``: EWMA weight of the newest value, 0 < alpha <= 1 (default 0.3);
      the EWMA starts at the first value;
    - ``source``: ``linear`` or ``norm`` (default: linear when weights are given,
      else norm);
    - ``threshold`` / ``action``: when the statistic is at or above the threshold
      the signal is ``action`` (``flag`` default, or ``abort``);
    - ``min_count``: the statistic only triggers once its layer has seen at least
      this many activations (default 1).

    Signals: score = the running statistic for that layer; metadata ``value`` (this
    token's own value), ``statistic``, ``layer``. Verdict: a
    :class:`~undercurrent.probes.scoring.ScoreSummary` dict over the running
    statistic (so ``max_score`` is its peak) plus ``statistic``, ``source`` and
    ``final_by_layer`` (each layer's final statistic).
    """

    probe_kind = ProbeKind.TRAJECTORY

    def __init__(
        self,
        *,
        statistic: str = "ewma",
        alpha: float = 0.3,
        source: str | None = None,
        path: str | os.PathLike[str] | None = None,
        weight: Any = None,
        bias: Any = None,
        link: str | None = None,
        class_index: int | str | None = None,
        threshold: float | None = None,
        action: str = "flag",
        min_count: int = 1,
    ) -> None:
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"alpha must be a number with 0 < alpha <= 1, got {alpha!r}")
        has_weights = path is not None or weight is not None or bias is not None
        if source is None:
            source = "linear" if has_weights else "norm"
        if source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
        if source == "norm" and has_weights:
            raise ValueError("source 'norm' takes no path/weight/bias; use source 'linear'")
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"min_count must be an int >= 1, got {min_count!r}")
        self.readout = (
            LinearReadout(path=path, weight=weight, bias=bias, link=link, class_index=class_index)
            if source == "linear"
            else None
        )
        self.statistic = statistic
        self.alpha = float(alpha)
        self.source = source
        self.min_count = min_count
        self.rule = ThresholdRule.from_options(threshold, action)
        self._reset()

    def _reset(self) -> None:
        self.running: dict[int, _Running] = {}
        self.summary = ScoreSummary(
            self.rule.threshold, extra={"statistic": self.statistic, "source": self.source}
        )

    def value(self, record: ActivationRecord) -> float:
        """This token's own value: the linear score or the norm."""
        return self.values((record,))[0]

    def values(self, records: Sequence[ActivationRecord]) -> list[float]:
        """:meth:`value` for several records, with one matrix operation."""
        return list(self.batch_values(ActivationBatch.from_records(records)).tolist())

    def batch_values(self, batch: ActivationBatch) -> Any:
        """:meth:`value` of every row of a batch (float64 array), one matrix operation."""
        return batch.shared(self.group_key(), self.row_values)

    def group_key(self) -> Any:
        if self.readout is not None:
            return ("linear_scores", self.readout.key)
        return ("statistic", "l2_norm")

    def row_values(self, batch: ActivationBatch) -> Any:
        if self.readout is not None:
            return self.readout.score_batch(batch)[0]
        return l2_norms(batch_matrix(batch))

    def _update(self, running: _Running, value: float) -> float:
        running.count += 1
        if running.count == 1:
            running.value = value
        elif self.statistic == "mean":
            running.value += (value - running.value) / running.count
        elif self.statistic == "max":
            running.value = max(running.value, value)
        else:
            running.value = self.alpha * value + (1.0 - self.alpha) * running.value
        return running.value

    def on_start(self, ctx: RequestContext) -> None:
        self._reset()

    def judge_rows(self, values: Any, token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals:
        """Each layer's running statistic, row by row (a recurrence, in order)."""
        values = values.tolist()
        layers = [int(layer) for layer in layers]
        statistics, actions = self._advance(values, token_indices, layers)
        return BatchSignals(
            actions, statistics,
            {"value": values, "statistic": [self.statistic] * len(values), "layer": layers},
            all_scored=True,
        )

    def _advance(self, values: list[float], token_indices: Sequence[int],
                 layers: list[int]) -> tuple[list[float], list[int]]:
        """Run the recurrence over rows in order and update the summary: (the
        running statistic of each row, its action code)."""
        statistics, crossed = [], []
        running_by_layer, rule, min_count = self.running, self.rule, self.min_count
        for layer, value in zip(layers, values, strict=True):
            running = running_by_layer.get(layer)
            if running is None:
                running = running_by_layer[layer] = _Running()
            statistic = self._update(running, value)
            statistics.append(statistic)
            crossed.append(running.count >= min_count and rule.crossed(statistic))
        self.summary.add_columns(statistics, token_indices, layers, crossed)
        code = ACTION_CODES[rule.action]
        return statistics, [code if hit else 0 for hit in crossed]

    @classmethod
    def judge_many(cls, probes: Sequence[ScoresRows], values: Any,
                   spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals | None:
        """Every instance's recurrence over its own rows, answered as one set of
        columns (each instance keeps its own statistic, threshold and state)."""
        if cls.judge_rows is not TrajectoryProbe.judge_rows or any(
                type(probe) is not cls for probe in probes):
            return None
        first, last = spans[0][0], spans[-1][1]
        all_values = values[first:last].tolist()
        all_layers = [int(layer) for layer in layers[first:last]]
        statistics: list[float] = []
        actions: list[int] = []
        names: list[str] = []
        for probe, (start, stop) in zip(probes, spans, strict=True):
            assert isinstance(probe, TrajectoryProbe)
            low, high = start - first, stop - first
            stats, codes = probe._advance(all_values[low:high], token_indices[start:stop],
                                          all_layers[low:high])
            statistics += stats
            actions += codes
            names += [probe.statistic] * (high - low)
        return BatchSignals(actions, statistics,
                            {"value": all_values, "statistic": names, "layer": all_layers},
                            all_scored=True)

    def on_end(self, ctx: RequestContext) -> Any:
        verdict = self.summary.verdict()
        verdict["final_by_layer"] = {layer: r.value for layer, r in sorted(self.running.items())}
        return verdict
