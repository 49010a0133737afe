"""``trajectory_probe``: a running statistic of a per-token value across a request."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from undercurrent.arguments import check_flag
from undercurrent.probes.arrays import float32_rows, map_rows, numpy_module
from undercurrent.probes.base import (
    Probe,
    RequestContext,
    ScoresRows,
    TellsSignals,
    shallow_copy,
    shared_key,
)
from undercurrent.probes.linear import LinearReadout, check_point_matches_file
from undercurrent.probes.scoring import (
    ScoreSummary,
    ThresholdRule,
    add_blocks,
    end_summaries,
    never_signals,
    start_summaries,
)
from undercurrent.probes.statistics import l2_norms
from undercurrent.records import (
    ACTION_CODES,
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    SignalAction,
)
from undercurrent.spec.types import ExtractionPoint, ProbeKind

STATISTICS = ("mean", "max", "ewma")
SOURCES = ("linear", "norm")
_SAME_OBJECT = operator.is_
_STATISTIC = operator.attrgetter("statistic")
_ALPHA = operator.attrgetter("alpha")
_MIN_COUNT = operator.attrgetter("min_count")
_RULE = operator.attrgetter("rule")
_HELD_VALUES, _BLOCK = operator.attrgetter("_values"), operator.attrgetter("_block")


@dataclass
class _Running:
    """One layer's running statistic."""

    count: int = 0
    value: float = 0.0


class _Lanes:
    """The running statistics of instances judged together in lanes, kept as
    arrays between calls (see :func:`_judge_lanes`): ``counts`` and ``running``
    hold one row per instance of ``probes`` (in that order), one column per
    lane (``lanes``: the layers, in the order the instances meet them). While
    an instance's ``_block`` is this object, its row here is its state and its
    own lists are stale (:meth:`TrajectoryProbe._sync` writes them back)."""

    __slots__ = ("probes", "lanes", "counts", "running")

    def __init__(self, probes: tuple[TrajectoryProbe, ...], lanes: list[int], counts: Any,
                 running: Any) -> None:
        self.probes = probes
        self.lanes = lanes
        self.counts = counts
        self.running = running

    def holds(self, probes: Sequence[TrajectoryProbe], lanes: list[int]) -> bool:
        """Whether these are exactly its instances, in its order, each still
        keeping its state here, meeting the same lanes."""
        mine = self.probes
        return (len(mine) == len(probes) and self.lanes == lanes
                and all(map(_SAME_OBJECT, mine, probes))
                and all(probe._block is self for probe in probes))

    def write_back(self, probe: TrajectoryProbe) -> None:
        """Give ``probe`` its state as its own lists again, and detach it (a
        shallow copy of one of the instances, not one itself, is only
        detached: ``on_start`` gives it its own state)."""
        for row, mine in enumerate(self.probes):
            if mine is probe:
                probe._counts = self.counts[row].tolist()
                probe._values = self.running[row].tolist()
                break
        probe._block = None


class TrajectoryProbe(TellsSignals):
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
    - ``check_metadata``: as for ``linear_probe``: when true (default) and the probe
      file names a ``layer`` or ``tensor_type``, a point that does not match it is
      refused.

    A NaN value makes its layer's statistic NaN from then on, whichever the
    statistic (a NaN statistic never reaches the threshold): a max no more
    forgets a NaN than a mean does, wherever it comes.

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
        check_metadata: bool = True,
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
        self.check_metadata = check_flag("check_metadata", check_metadata)
        self.rule = ThresholdRule.from_options(threshold, action)
        self._reset()

    def _reset(self) -> None:
        # Each layer's running statistic, as columns: layer -> column, and per
        # column its layer, count and value (lists: read and written in bulk
        # when many instances are judged together, see judge_many).
        self._slot: dict[int, int] = {}
        self._layers: list[int] = []
        self._counts: list[int] = []
        self._values: list[float] = []
        # Set while the counts and values live in a block of instances judged
        # together (_judge_lanes), which keeps them between calls: the lists
        # above are then stale until _sync.
        self._block: _Lanes | None = None
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
        key = shared_key(self)
        return self.row_values(batch) if key is None else batch.shared(key, self.row_values)

    def group_key(self) -> Any:
        if self.readout is not None:
            return ("linear_scores", self.readout.key)
        return ("statistic", "l2_norm")

    def may_abort(self) -> bool:
        return type(self) is not TrajectoryProbe or self.rule.can_abort

    @classmethod
    def signal_test(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                    ) -> Callable[[Any], bool] | None:
        """A bound, not a dry run: a running mean, max or EWMA never leaves the
        range of its starting value and the values it takes in, so no row can
        reach the threshold while the largest statistic the instances hold and
        every value asked of since (held steps included) stay below it, by a
        margin for rounding (:class:`RunningBound`). Only where every instance
        is this very class with one rule (a subclass: not told)."""
        first = probes[0]
        if not isinstance(first, TrajectoryProbe) or any(
                type(probe) is not TrajectoryProbe or probe.rule != first.rule
                for probe in probes):
            return None
        rule = first.rule
        if not rule.gives(actions):
            return never_signals
        assert rule.threshold is not None
        return RunningBound(cast("Sequence[TrajectoryProbe]", probes), rule.threshold)

    def row_values(self, batch: ActivationBatch) -> Any:
        if self.readout is not None:
            return self.readout.score_batch(batch)[0]
        return map_rows(batch, l2_norms)

    def _sync(self) -> None:
        """Take the running statistics back from a block of lanes, if one holds them."""
        if self._block is not None:
            self._block.write_back(self)

    @property
    def running(self) -> dict[int, _Running]:
        """Each layer's running statistic so far (count and value), by layer."""
        self._sync()
        return {layer: _Running(count, value) for layer, count, value
                in zip(self._layers, self._counts, self._values, strict=True)}

    def check_point(self, point: ExtractionPoint) -> None:
        """With ``check_metadata``, refuse a point whose layers or tensor type differ
        from the ``layer`` / ``tensor_type`` the probe file was fitted on."""
        if self.check_metadata and self.readout is not None:
            check_point_matches_file(self.readout.weights, point)

    def check_hidden_size(self, hidden_size: int) -> None:
        """With ``source: linear``, raise ValueError when the weight reads
        activations of another size than the model's hidden size (as
        ``linear_probe`` does)."""
        if self.readout is not None:
            self.readout.check_hidden_size(hidden_size)

    def on_start(self, ctx: RequestContext) -> None:
        if ctx is not None and ctx.extraction_point is not None:  # (direct callers)
            self.check_point(ctx.extraction_point)
        self._reset()

    @classmethod
    def start_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]) -> bool:
        """Every instance's :meth:`on_start` at once (this class's own only, on
        instances sharing their statistic, source, readout and ``check_metadata``,
        and one point, as a call's copies do): the point checked once, empty
        running statistics and a fresh summary each."""
        if cls.on_start is not TrajectoryProbe.on_start or (
                cls._reset is not TrajectoryProbe._reset):
            return False
        first = probes[0]
        assert isinstance(first, TrajectoryProbe)
        statistic, source = first.statistic, first.source
        if any(probe.statistic != statistic or probe.source != source  # type: ignore[attr-defined]
               for probe in probes):
            return False
        point = contexts[0].extraction_point
        if point is not None:
            if cls.check_point is not TrajectoryProbe.check_point or any(
                    ctx.extraction_point is not point for ctx in contexts) or any(
                    probe.readout is not first.readout  # type: ignore[attr-defined]
                    or probe.check_metadata is not first.check_metadata  # type: ignore[attr-defined]
                    for probe in probes):
                return False
            first.check_point(point)  # (raises before any instance is changed)
        for probe in probes:
            probe._slot, probe._layers = {}, []  # type: ignore[attr-defined]
            probe._counts, probe._values = [], []  # type: ignore[attr-defined]
            probe._block = None  # type: ignore[attr-defined]
        start_summaries(probes, {"statistic": statistic, "source": source})
        return True

    def copy_for_request(self) -> TrajectoryProbe | None:
        # The readout, rule and parameters are read-only; on_start (_reset) makes
        # the running statistics and the summary.
        return shallow_copy(self) if type(self) is TrajectoryProbe else None

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
        self._sync()
        statistics, crossed = [], []
        slot, counts, running = self._slot, self._counts, self._values
        rule, min_count, alpha = self.rule, self.min_count, self.alpha
        statistic = self.statistic
        for layer, value in zip(layers, values, strict=True):
            index = slot.get(layer)
            if index is None:
                index = slot[layer] = len(self._layers)
                self._layers.append(layer)
                counts.append(0)
                running.append(0.0)
            count = counts[index] = counts[index] + 1
            if count == 1:
                current = value
            elif statistic == "mean":
                current = running[index] + (value - running[index]) / count
            elif statistic == "max":  # (a NaN poisons it from then on, as a mean's)
                previous = running[index]
                current = value if value > previous or value != value else previous
            else:
                current = alpha * value + (1.0 - alpha) * running[index]
            running[index] = current
            statistics.append(current)
            crossed.append(count >= min_count and rule.crossed(current))
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
        lanes = _judge_lanes(probes, values, spans, token_indices, layers)  # type: ignore[arg-type]
        if lanes is not None:
            return lanes
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
        self._sync()
        verdict = self.summary.verdict()
        verdict["final_by_layer"] = dict(sorted(zip(self._layers, self._values, strict=True)))
        return verdict

    @classmethod
    def end_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]
                 ) -> list[Any] | None:
        """Every instance's :meth:`on_end` verdict at once (this class's own only)."""
        verdicts = end_summaries(probes) if cls.on_end is TrajectoryProbe.on_end else None
        for verdict, probe in zip(verdicts or (), probes, strict=False):
            probe._sync()  # type: ignore[attr-defined]
            verdict["final_by_layer"] = dict(sorted(zip(
                probe._layers, probe._values, strict=True)))  # type: ignore[attr-defined]
        return verdicts


def _judge_lanes(probes: Sequence[TrajectoryProbe], values: Any,
                 spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                 layers: Sequence[int]) -> BatchSignals | None:
    """:meth:`TrajectoryProbe.judge_many` with the recurrence run across the
    instances at once: one array operation per step over every lane where each
    step meets every lane once in the same order (:func:`_advance_steps`), else
    one per row position, instead of one Python update per row. Only when the
    instances share their statistic, ``alpha``, ``min_count`` and rule, their
    spans follow each other with the same layers in the same order, and each
    instance has either seen exactly these layers (in that order) or nothing
    yet; else None. Each lane (an instance's layer) gets exactly the
    arithmetic of :meth:`_advance`, element by element, so the statistics,
    signals and summaries are the same."""
    head = probes[0]
    first, last = spans[0][0], spans[-1][1]
    width, count = spans[0][1] - first, len(probes)
    if width <= 0 or last - first != width * count:
        return None
    statistic, alpha, min_count, rule = head.statistic, head.alpha, head.min_count, head.rule
    # (each span the next ``width`` rows, and every instance's options the
    # first's: compared in C, a column at a time)
    if (len(spans) != count or list(spans) != list(zip(
            range(first, last, width), range(first + width, last + 1, width), strict=True))
            or any(list(map(option, probes)).count(value) != count
                   for option, value in ((_STATISTIC, statistic), (_ALPHA, alpha),
                                         (_MIN_COUNT, min_count), (_RULE, rule)))):
        return None
    np = numpy_module()
    grid = np.asarray(layers[first:last], dtype=np.int64).reshape(count, width)
    if count > 1 and not (grid[1:] == grid[0]).all():
        return None
    pattern = grid[0].tolist()
    lanes = list(dict.fromkeys(pattern))  # each layer once, in the order _advance meets them
    block = head._block
    if block is not None and block.holds(probes, lanes):
        # Judged together last time too, and nothing else since: their state
        # is the block's arrays, as that call left them.
        counts, running = block.counts, block.running
    else:
        block = None
        if any(probe._layers and probe._layers != lanes for probe in probes):
            return None
        for probe in probes:
            probe._sync()
        empty = [0] * len(lanes)
        counts = np.array([probe._counts if probe._layers else empty for probe in probes],
                          dtype=np.int64)
        running = np.array([probe._values if probe._layers else empty for probe in probes],
                           dtype=np.float64)
    observed = np.asarray(values[first:last], dtype=np.float64).reshape(count, width)
    statistics = np.empty((count, width), dtype=np.float64)
    lane_of = {layer: lane for lane, layer in enumerate(lanes)}
    lane_at = [lane_of[layer] for layer in pattern]
    # Every instance meets the same lanes in the same order, so a column's count
    # is each instance's count before the batch plus how often the batch has met
    # that lane so far (the same for all); a count of 1 (the statistic starts
    # at the value) only at a lane's first column, for an instance new to it.
    met = [0] * len(lanes)
    met_at = []
    for lane in lane_at:
        met[lane] += 1
        met_at.append(met[lane])
    seen = counts[:, lane_at] + np.asarray(met_at, dtype=np.int64)
    fresh = (counts == 0).any(axis=0).tolist()
    keep = 1.0 - alpha
    with np.errstate(all="ignore"):  # inf and NaN flow through as in Python floats
        scaled = alpha * observed if statistic == "ewma" else observed
        steps, cycle = divmod(width, len(lanes))
        if not cycle and pattern == lanes * steps:
            # Each step meets every lane once, in the same order (a window's rows
            # of every layer, step after step): one array operation per step
            # over all lanes, each element the same arithmetic as below.
            running = _advance_steps(statistic, keep, running, fresh,
                                     observed.reshape(count, steps, len(lanes)),
                                     scaled.reshape(count, steps, len(lanes)),
                                     seen.reshape(count, steps, len(lanes)),
                                     statistics.reshape(count, steps, len(lanes)))
        else:
            state = [running[:, lane] for lane in range(len(lanes))]
            for column, lane in enumerate(lane_at):
                value = observed[:, column]
                current = _next(statistic, keep, state[lane], value, scaled[:, column],
                                seen[:, column])
                if met_at[column] == 1 and fresh[lane]:
                    current = np.where(seen[:, column] == 1, value, current)
                state[lane] = current
                statistics[:, column] = current
            running = np.stack(state, axis=1)
        if rule.threshold is not None:
            crossed = (seen >= min_count) & (statistics >= rule.threshold)
        else:
            crossed = np.zeros((count, width), dtype=bool)
    counts = counts + np.asarray(met, dtype=np.int64)
    if block is None:  # the state kept in arrays from now on, for the next call
        block = _Lanes(tuple(probes), lanes, counts, running)
        for probe in probes:
            if not probe._layers:
                probe._layers, probe._slot = list(lanes), dict(lane_of)
            probe._block = block
    block.counts, block.running = counts, running
    flat = statistics.ravel()
    summaries = [probe.summary for probe in probes]
    if not add_blocks(summaries, flat, spans, crossed.ravel(), token_indices, layers):
        hit = crossed.any(axis=1).tolist()
        for summary, (start, stop), own, any_hit, own_marks in zip(
                summaries, spans, statistics.tolist(), hit, crossed.tolist(), strict=True):
            summary.add_columns(own, token_indices[start:stop], pattern,
                                own_marks if any_hit else None)
    # (numpy columns: a signal read later takes its row's values as Python ones)
    metadata = {"value": observed.ravel(), "statistic": [statistic] * (count * width),
                "layer": pattern * count}
    return BatchSignals((crossed * ACTION_CODES[rule.action]).ravel(), flat, metadata,
                        all_scored=True)


class RunningBound:
    """Whether judging a step's values may make a running statistic of
    ``probes`` reach ``threshold``, asked of each decode step in turn
    (:meth:`TrajectoryProbe.abort_test`); it errs only towards "may abort".

    Each new statistic is a mean, max or weighted mean of the last one and a
    value, so none exceeds the largest of what the instances hold now and the
    values not yet judged. The values not yet judged are among those asked of
    since this bound was made (the steps a window holds were asked of, in
    order): their largest is kept. The bound is that largest value or the
    largest statistic held now, whichever is larger, plus 1e-9 of it (each
    EWMA step may round up by an ulp or two). NaN anywhere: "may abort".

    For norms (``source: norm``) :attr:`screen` asks the same of a step's
    captured pieces (a tensor per layer), from a bound on their norms computed
    in float32, without a batch or the values kept (None for linear scores:
    each step's are computed for the test)."""

    __slots__ = ("probes", "threshold", "seen", "screen")

    def __init__(self, probes: Sequence[TrajectoryProbe], threshold: float) -> None:
        self.probes = list(probes)
        self.threshold = threshold
        self.seen = -math.inf  # the largest value asked of so far
        self.screen: Callable[[Sequence[Any]], bool] | None = (
            self._screen if probes[0].readout is None else None)

    def __call__(self, values: Any) -> bool:
        np = numpy_module()
        if len(values):
            self._see(float(np.max(values)))
        return self._may_reach()

    def _screen(self, pieces: Sequence[Any]) -> bool:
        np = numpy_module()
        blocks = []
        for piece in pieces:
            rows = float32_rows(piece)
            if rows is None:  # (not CPU float rows: the values decide)
                return True
            blocks.append(rows)
        if not blocks:
            return self._may_reach()
        matrix = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        # Each row's sum of squares in float32, in any order, is within n
        # float32 rounding units (n: the row's length) of the exact one, and
        # n of the smallest subnormal steps where squares underflow; twice
        # that, added, bounds the float64 norm the exact path computes.
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # (inf, NaN: may)
            squares = float(np.max(np.einsum("ij,ij->i", matrix, matrix)))
        terms = 2.0 * (matrix.shape[1] + 1)
        self._see(math.sqrt(squares * (1.0 + terms * 2.0 ** -24) + terms * 2.0 ** -149))
        return self._may_reach()

    def _see(self, largest: float) -> None:
        if largest != largest or self.seen != self.seen:
            self.seen = math.nan
        elif largest > self.seen:
            self.seen = largest

    def _may_reach(self) -> bool:
        bound = max(self.seen, _held_peak(self.probes))
        if bound != bound or self.seen != self.seen:
            return True
        if bound == -math.inf:
            return False
        return not bound + 1e-9 * abs(bound) < self.threshold


def _held_peak(probes: Sequence[TrajectoryProbe]) -> float:
    """The largest running statistic the instances hold (-inf: none; NaN where
    one is), read from the block of lanes that keeps them where they share one."""
    np = numpy_module()
    block = probes[0]._block
    if block is not None and all(probe._block is block for probe in probes):
        held = block.running
    elif (block is None and not any(map(_HELD_VALUES, probes))
          and not any(map(_BLOCK, probes))):
        return -math.inf  # (nothing judged yet: a call's first window)
    else:
        held = np.concatenate([
            np.ravel(probe._block.running) if probe._block is not None
            else np.asarray(probe._values, dtype=np.float64) for probe in probes])
    return float(held.max()) if held.size else -math.inf


def _advance_steps(statistic: str, keep: float, running: Any, fresh: list[bool],
                   observed: Any, scaled: Any, seen: Any, statistics: Any) -> Any:
    """The lanes' recurrence a step at a time: ``observed``, ``scaled`` (alpha
    times the values, for ewma), ``seen`` (each value's count) and
    ``statistics`` (written through: a view of a contiguous array) are
    ``(instances, steps, lanes)`` views; ``running`` is each instance's
    statistic per lane before the first step. Returns it after the last.
    Element by element, the arithmetic of :meth:`TrajectoryProbe._advance`."""
    np = numpy_module()
    # A lane new to some instance starts at its first value there (count 1).
    starts = np.asarray(fresh, dtype=bool)
    previous = running
    for step in range(observed.shape[1]):
        value = observed[:, step]
        current = _next(statistic, keep, previous, value, scaled[:, step], seen[:, step])
        if step == 0 and starts.any():
            current = np.where((seen[:, 0] == 1) & starts, value, current)
        statistics[:, step] = current
        previous = current
    return previous


def _next(statistic: str, keep: float, previous: Any, value: Any, scaled: Any,
          seen: Any) -> Any:
    """The lanes' statistics after ``value`` (``scaled``: alpha times it, for
    ewma; ``seen``: its count), element by element what
    :meth:`TrajectoryProbe._advance` computes for one row."""
    if statistic == "mean":
        return previous + (value - previous) / seen
    if statistic == "max":  # previous unless value > it, or value is NaN
        np = numpy_module()
        return np.where((value > previous) | np.isnan(value), value, previous)
    return scaled + keep * previous  # alpha * value + (1.0 - alpha) * previous
