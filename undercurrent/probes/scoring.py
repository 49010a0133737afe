"""Shared by the built-in probes: thresholds to signals, and score summaries.

Every built-in turns a per-activation score into a signal the same way
(:class:`ThresholdRule`) and summarises a request the same way
(:class:`ScoreSummary`), so their verdicts share one documented shape.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from undercurrent.probes.arrays import numpy_module
from undercurrent.records import (
    ACTION_CODES,
    ActivationRecord,
    BatchSignals,
    ProbeSignal,
    SignalAction,
)

_ACTIONS_ON_CROSSING = (SignalAction.FLAG, SignalAction.ABORT)


def parse_action(value: Any, *, option: str = "action") -> SignalAction:
    """``"flag"`` or ``"abort"`` (string or enum) -> SignalAction, else ValueError."""
    try:
        action = SignalAction(value)
    except ValueError:
        action = None
    if action not in _ACTIONS_ON_CROSSING:
        raise ValueError(f"{option} must be 'flag' or 'abort', got {value!r}")
    assert action is not None
    return action


def parse_threshold(value: Any, *, option: str = "threshold") -> float | None:
    """None, or a finite float. Numeric strings are accepted: file metadata holds
    text, and YAML 1.1 reads ``1e-3`` (no dot) as a string. A boolean is refused
    (YAML reads ``yes`` as True, which float() would take as 1.0)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{option} must be a number, got the boolean {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{option} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{option} must be a finite number, got {value!r} (a threshold "
                         "of inf is never reached, -inf always is)")
    return number


@functools.lru_cache(maxsize=256)
def _rule(threshold: float | None, action: SignalAction) -> ThresholdRule:
    return ThresholdRule(threshold, action)


@dataclass(frozen=True)
class ThresholdRule:
    """``score >= threshold`` -> ``action`` (flag or abort); otherwise continue.

    With no threshold every signal is ``continue`` and only carries the score.
    """

    threshold: float | None = None
    action: SignalAction = SignalAction.FLAG

    @classmethod
    def from_options(cls, threshold: Any = None, action: Any = "flag", *,
                     scores_only: bool = True) -> ThresholdRule:
        """Validate the ``threshold``/``action`` probe_args. Equal rules are one
        object (the probes of many requests then compare theirs by identity).
        ``scores_only``: the probe acts only on a score at the threshold, so
        ``action: abort`` without a threshold (which would never abort) is refused;
        a probe that also acts on a True (``@probe``'s) passes False."""
        threshold, action = parse_threshold(threshold), parse_action(action)
        if scores_only and threshold is None and action is SignalAction.ABORT:
            raise ValueError("action 'abort' needs a threshold: without one no score "
                             "ever aborts (give probe_args threshold: ...)")
        return _rule(threshold, action) if cls is ThresholdRule else cls(threshold, action)

    @property
    def can_abort(self) -> bool:
        """Whether a score can give ``abort`` (a threshold, and ``action: abort``)."""
        return self.threshold is not None and self.action is SignalAction.ABORT

    def gives(self, actions: frozenset[SignalAction]) -> bool:
        """Whether a score can give one of ``actions`` (a threshold, and its
        action among them)."""
        return self.threshold is not None and self.action in actions

    def crossed(self, score: float) -> bool:
        """Whether ``score`` is at or above the threshold."""
        return self.threshold is not None and score >= self.threshold

    def signal(self, score: float, metadata: Mapping[str, Any] | None = None) -> ProbeSignal:
        """The signal for one score."""
        action = self.action if self.crossed(score) else SignalAction.CONTINUE
        return ProbeSignal(action=action, score=score, metadata=dict(metadata or {}))

    def signals(self, scores: Sequence[float],
                metadata: Sequence[Mapping[str, Any]]) -> list[ProbeSignal]:
        """:meth:`signal` for each (score, metadata) pair, in one pass: the same
        signals, without a rule call per score (the batch path of the built-ins)."""
        threshold, action, keep_going = self.threshold, self.action, SignalAction.CONTINUE
        if threshold is None:
            return [ProbeSignal(keep_going, score, dict(meta))
                    for score, meta in zip(scores, metadata, strict=True)]
        return [ProbeSignal(action if score >= threshold else keep_going, score, dict(meta))
                for score, meta in zip(scores, metadata, strict=True)]


@dataclass
class ScoreSummary:
    """Running summary of a request's scores, the verdict of most built-ins.

    :meth:`verdict` returns a dict with ``count`` (activations seen),
    ``max_score``, ``min_score``, ``mean_score``, ``last_score`` (None when no
    activation had a score), ``flagged`` (some activation crossed: flagged or
    aborted), ``first_crossing_token_index`` and ``first_crossing_layer`` (None
    when nothing crossed), and ``threshold``.
    """

    threshold: float | None = None
    count: int = 0
    scored: int = 0
    total: float = 0.0
    max_score: float | None = None
    min_score: float | None = None
    last_score: float | None = None
    first_crossing: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, score: float | None, record: ActivationRecord, crossed: bool) -> bool:
        """Add one activation's score; returns True when it is the first crossing."""
        self.count += 1
        if score is not None:
            self.scored += 1
            self.total += score
            self.last_score = score
            self.max_score = score if self.max_score is None else max(self.max_score, score)
            self.min_score = score if self.min_score is None else min(self.min_score, score)
        if crossed and self.first_crossing is None:
            self.first_crossing = (record.token_index, record.layer)
            return True
        return False

    def add_many(self, scores: Sequence[float | None], records: Sequence[ActivationRecord],
                 crossed: Sequence[bool]) -> None:
        """:meth:`add` for each (score, record, crossed) in order, in one pass: the
        same totals (summed in the same order), extremes and first crossing."""
        self.add_columns(scores, [r.token_index for r in records], [r.layer for r in records],
                         crossed)

    def add_columns(self, scores: Sequence[float | None], token_indices: Sequence[int],
                    layers: Sequence[int], crossed: Sequence[bool] | None) -> None:
        """:meth:`add_many` from columns (a batch's ``token_indices`` and ``layers``;
        ``crossed`` None when nothing crossed)."""
        self.count += len(scores)
        total, scored = self.total, self.scored
        high, low, last = self.max_score, self.min_score, self.last_score
        for score in scores:
            if score is None:
                continue
            scored += 1
            total += score
            last = score
            # max(a, b) keeps a unless b > a; min(a, b) keeps a unless b < a.
            if high is None or score > high:
                high = score
            if low is None or score < low:
                low = score
        self.total, self.scored = total, scored
        self.max_score, self.min_score, self.last_score = high, low, last
        if self.first_crossing is None and crossed is not None and any(crossed):
            index = list(crossed).index(True)
            self.first_crossing = (int(token_indices[index]), int(layers[index]))

    def batch_signals(self, rule: ThresholdRule, scores: Any, token_indices: Sequence[int],
                      layers: Sequence[int],
                      metadata: Mapping[str, Sequence[Any]] | None = None) -> BatchSignals:
        """The batch path of :meth:`ThresholdRule.signal` + :meth:`add`: one row per
        score of a float64 numpy array (every row scored), summary updated."""
        return ScoreSummary.batch_signals_many([self], rule, scores, [(0, len(scores))],
                                               token_indices, layers, metadata)

    @staticmethod
    def batch_signals_many(summaries: Sequence[ScoreSummary], rule: ThresholdRule, scores: Any,
                           spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                           layers: Sequence[int],
                           metadata: Mapping[str, Sequence[Any]] | None = None
                           ) -> BatchSignals:
        """:meth:`batch_signals` for many summaries in one pass: ``summaries[i]``
        takes rows ``spans[i]`` of ``scores`` (a float64 numpy array over a whole
        routed batch). Returns the signals of rows ``spans[0][0]:spans[-1][1]``
        (contiguous spans, in order); each summary ends as :meth:`batch_signals`
        on its own rows would leave it."""
        first, last = spans[0][0], spans[-1][1]
        block = scores[first:last]
        count = len(block)
        crossed: Any = None
        if rule.threshold is None:  # (an array, as below: checked at once by the router)
            actions: Any = numpy_module().full(count, ACTION_CODES[SignalAction.CONTINUE])
        else:
            crossed = block >= rule.threshold
            actions = crossed * ACTION_CODES[rule.action]
        values: Any = block  # the scores column: the array itself unless a list was needed
        if not add_blocks(summaries, block, spans, crossed, token_indices, layers):
            values = block.tolist()
            crossings = [] if crossed is None else crossed.nonzero()[0].tolist()
            if crossings:
                _add_crossed(summaries, values, first, spans, token_indices, layers, crossings)
            else:  # nothing to place
                for summary, (start, stop) in zip(summaries, spans, strict=True):
                    summary.add_columns(values[start - first:stop - first],
                                        token_indices[start:stop], layers[start:stop], None)
        if metadata is not None and (first, last) != (0, len(scores)):
            metadata = {key: column[first:last] for key, column in metadata.items()}
        return BatchSignals(actions, values, metadata, all_scored=True)

    def verdict(self) -> dict[str, Any]:
        """The summary as a plain dict (see the class docstring for the keys)."""
        crossing = self.first_crossing
        result: dict[str, Any] = {
            "count": self.count,
            "max_score": self.max_score,
            "min_score": self.min_score,
            "mean_score": self.total / self.scored if self.scored else None,
            "last_score": self.last_score,
            "flagged": crossing is not None,
            "first_crossing_token_index": crossing[0] if crossing else None,
            "first_crossing_layer": crossing[1] if crossing else None,
            "threshold": self.threshold,
        }
        result.update(self.extra)
        return result


def summary_verdicts(summaries: Sequence[ScoreSummary]) -> list[dict[str, Any]]:
    """:meth:`ScoreSummary.verdict` of each summary (the same dicts, keys in the
    same order), without a call per summary: a call's verdicts at once."""
    verdicts = []
    for summary in summaries:
        crossing, scored = summary.first_crossing, summary.scored
        verdict = {
            "count": summary.count,
            "max_score": summary.max_score,
            "min_score": summary.min_score,
            "mean_score": summary.total / scored if scored else None,
            "last_score": summary.last_score,
            "flagged": crossing is not None,
            "first_crossing_token_index": crossing[0] if crossing else None,
            "first_crossing_layer": crossing[1] if crossing else None,
            "threshold": summary.threshold,
        }
        if summary.extra:
            verdict.update(summary.extra)
        verdicts.append(verdict)
    return verdicts


def start_summaries(probes: Sequence[Any], extra: Mapping[str, Any] | None = None) -> None:
    """The ``on_start`` of built-ins whose per-request state is one fresh summary
    of their rule's threshold (``extra``: its extra verdict entries), for every
    instance at once (their class's ``start_many``)."""
    for probe in probes:
        probe.summary = ScoreSummary(probe.rule.threshold, extra=dict(extra or {}))


def end_summaries(probes: Sequence[Any]) -> list[dict[str, Any]] | None:
    """Each instance's ``summary.verdict()``, made in one loop (their class's
    ``end_many``); None when some summary is not a plain
    :class:`ScoreSummary` (it may give its verdict its own way)."""
    summaries = [probe.summary for probe in probes]
    if any(type(summary) is not ScoreSummary for summary in summaries):
        return None
    return summary_verdicts(summaries)


def add_blocks(summaries: Sequence[ScoreSummary], block: Any,
               spans: Sequence[tuple[int, int]], crossed: Any,
               token_indices: Sequence[int], layers: Sequence[int]) -> bool:
    """:meth:`ScoreSummary.add_columns` for each summary's span of ``block`` (a
    float64 array: the contiguous spans' rows; ``crossed``: a bool array of the
    rows at or over the threshold, or None), as a few array operations over all
    the summaries at once. It leaves each summary as the loop would: the totals
    are added in the same order (``add.accumulate`` adds left to right, from
    the summary's own total), the extremes are the same floats, and the first
    crossing is the first row crossed. False, with nothing added, unless every
    span has one length and no score is NaN or zero: there, which of two
    equal-comparing scores (``0.0`` and ``-0.0``) or a NaN the loop keeps
    depends on the order."""
    width = spans[0][1] - spans[0][0]
    if width == 0 or len(block) != width * len(summaries) or not block.all():
        return False  # (``all``: no zero; every span has one length: checked below)
    if any(stop - start != width for start, stop in spans):
        return False
    np = numpy_module()
    if np.isnan(block).any():
        return False
    rows = block.reshape(len(summaries), width)
    running = np.empty((len(summaries), width + 1))
    running[:, 0] = [summary.total for summary in summaries]
    running[:, 1:] = rows
    with np.errstate(all="ignore"):  # inf - inf, an overflow: what the loop gives, unwarned
        totals = np.add.accumulate(running, axis=1)[:, -1].tolist()
    highs, lows = rows.max(axis=1).tolist(), rows.min(axis=1).tolist()
    lasts = rows[:, -1].tolist()
    for summary, total, high, low, last in zip(summaries, totals, highs, lows, lasts,
                                               strict=True):
        summary.count += width
        summary.scored += width
        summary.total = total
        summary.last_score = last
        # The loop keeps the old extreme unless a score beats it (a NaN is kept).
        if summary.max_score is None or high > summary.max_score:
            summary.max_score = high
        if summary.min_score is None or low < summary.min_score:
            summary.min_score = low
    if crossed is not None and crossed.any():
        marks = crossed.reshape(len(summaries), width)
        firsts = marks.argmax(axis=1).tolist()
        for index in marks.any(axis=1).nonzero()[0].tolist():
            summary = summaries[index]
            if summary.first_crossing is None:
                row = spans[index][0] + firsts[index]
                summary.first_crossing = (int(token_indices[row]), int(layers[row]))
    return True


def _add_crossed(summaries: Sequence[ScoreSummary], values: list[float], first: int,
                 spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                 layers: Sequence[int], crossings: list[int]) -> None:
    """:meth:`ScoreSummary.add_columns` for each summary's span of ``values``
    (row ``r`` of the batch is ``values[r - first]``), with the rows that
    crossed (``crossings``: ascending, relative to ``first``) marked."""
    at = 0  # the next crossing not yet placed
    for summary, (start, stop) in zip(summaries, spans, strict=True):
        low, high = start - first, stop - first
        span_crossed = None
        while at < len(crossings) and crossings[at] < low:
            at += 1
        if at < len(crossings) and crossings[at] < high:
            span_crossed = [False] * (high - low)
            for row in crossings[at:]:
                if row >= high:
                    break
                span_crossed[row - low] = True
        summary.add_columns(values[low:high], token_indices[start:stop], layers[start:stop],
                            span_crossed)


def judge_summaries(probes: Sequence[Any], scores: Any, spans: Sequence[tuple[int, int]],
                    token_indices: Sequence[int], layers: Sequence[int],
                    metadata: Mapping[str, Sequence[Any]] | None = None) -> BatchSignals | None:
    """The ``judge_many`` of a built-in that keeps a ``rule`` and a ``summary``:
    :meth:`ScoreSummary.batch_signals_many` over the instances' summaries when
    they are all of one class with one rule, else None (each judges its own)."""
    rule, kind = probes[0].rule, type(probes[0])
    # (one class, and rules each the first or equal to it: counted in C)
    if set(map(type, probes)) != {kind} or list(map(_RULE, probes)).count(rule) != len(probes):
        return None
    return ScoreSummary.batch_signals_many(list(map(_SUMMARY, probes)), rule, scores,
                                           spans, token_indices, layers, metadata)


def threshold_signal_test(probes: Sequence[Any], actions: frozenset[SignalAction]
                          ) -> Callable[[Any], bool] | None:
    """The ``signal_test`` of a built-in that keeps a ``rule`` and judges each
    row by its score alone: whether some score of a float64 array reaches the
    threshold of a rule whose crossing gives one of ``actions``. None unless
    the instances are all of one class with one rule, as
    :func:`judge_summaries` needs."""
    rule, kind = probes[0].rule, type(probes[0])
    if set(map(type, probes)) != {kind} or list(map(_RULE, probes)).count(rule) != len(probes):
        return None
    if not rule.gives(actions):
        return never_signals
    threshold = rule.threshold

    def reaches(scores: Any) -> bool:
        return bool((scores >= threshold).any())

    return reaches


def never_signals(values: Any) -> bool:
    """The ``signal_test`` of probes whose rule gives none of the actions asked
    (no step can), and its screen (the router clears every step with it,
    computing no value)."""
    return False


_RULE = operator.attrgetter("rule")
_SUMMARY = operator.attrgetter("summary")
