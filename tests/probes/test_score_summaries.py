"""ScoreSummary.batch_signals_many: many requests' summaries updated from one
array of scores leave each summary as adding its scores one at a time does.

The oracle is :meth:`ScoreSummary.add`, the per-record path, fed the same
scores in the same order. Totals are compared exactly: adding a span's scores
in any other order (numpy's pairwise ``sum``, say) rounds differently, and the
scores drawn here spread over many magnitudes so that it shows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from undercurrent.probes.scoring import ScoreSummary, ThresholdRule, summary_verdicts
from undercurrent.records import ACTION_CODES, ActivationRecord, SignalAction, as_list

#: Scores with many magnitudes (so that the order of additions shows in the
#: total), zeros of both signs, infinities and NaN (which the array path hands
#: back to the loop, or must treat as the loop does).
SCORES = st.one_of(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=64),
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-300, 3.0, 3.0]),
)


def _record(token_index: int, layer: int) -> ActivationRecord:
    return ActivationRecord(
        request_id="r", extraction_point_name="p", layer=layer, token_index=token_index,
        tensor_type="residual_stream", tensor=[0.0], is_generated=True,
        generated_index=token_index, token_id=1)


def _state(summary: ScoreSummary) -> tuple[Any, ...]:
    """Every field, floats by their bits (NaN equal to NaN, -0.0 apart from 0.0)."""
    def bits(value: float | None) -> Any:
        return None if value is None else float(value).hex()

    return (summary.count, summary.scored, bits(summary.total), bits(summary.max_score),
            bits(summary.min_score), bits(summary.last_score), summary.first_crossing)


def _one_at_a_time(summary: ScoreSummary, scores: list[float], tokens: list[int],
                   layers: list[int], rule: ThresholdRule) -> None:
    for score, token, layer in zip(scores, tokens, layers, strict=True):
        summary.add(score, _record(token, layer), rule.crossed(score))


def _earlier(draw: Any) -> ScoreSummary:
    """A summary that has seen some scores already (or none), one of which may
    have crossed (at token -1)."""
    summary = ScoreSummary()
    for score in draw(st.lists(SCORES, max_size=3)):
        summary.add(score, _record(-1, 0), draw(st.booleans()))
    return summary


@st.composite
def _cases(draw: Any) -> tuple[list[list[float]], list[ScoreSummary], float | None]:
    requests = draw(st.integers(min_value=1, max_value=6))
    equal = draw(st.booleans())
    width = draw(st.integers(min_value=1, max_value=12))
    spans = [draw(st.lists(SCORES, min_size=width if equal else 1,
                           max_size=width if equal else 12))
             for _ in range(requests)]
    threshold = draw(st.one_of(st.none(), st.floats(min_value=-1e6, max_value=1e6)))
    return spans, [_earlier(draw) for _ in range(requests)], threshold


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_many_summaries_at_once_equal_each_summary_fed_one_score_at_a_time(
        case: tuple[list[list[float]], list[ScoreSummary], float | None]) -> None:
    per_request, earlier, threshold = case
    rule = ThresholdRule.from_options(threshold)
    scores = [score for span in per_request for score in span]
    tokens = list(range(len(scores)))
    layers = [index % 3 for index in tokens]
    spans, start = [], 0
    for span in per_request:
        spans.append((start, start + len(span)))
        start += len(span)

    expected = [ScoreSummary(**{**vars(s), "extra": {}}) for s in earlier]
    for summary, (first, last) in zip(expected, spans, strict=True):
        _one_at_a_time(summary, scores[first:last], tokens[first:last], layers[first:last],
                       rule)
    got = [ScoreSummary(**{**vars(s), "extra": {}}) for s in earlier]
    signals = ScoreSummary.batch_signals_many(got, rule, np.array(scores, dtype=np.float64),
                                              spans, tokens, layers)

    assert [_state(s) for s in got] == [_state(s) for s in expected]
    assert [float(x).hex() for x in as_list(signals.scores)] == [x.hex() for x in scores]
    assert as_list(signals.actions) == [
        ACTION_CODES[rule.action if rule.crossed(score) else SignalAction.CONTINUE]
        for score in scores]


def test_equal_spans_sum_in_the_loops_order_not_pairwise() -> None:
    """A span whose pairwise sum rounds differently from the left-to-right sum:
    the summary's total is the left-to-right one."""
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(4, 64)) * 10.0 ** rng.integers(-8, 8, size=(4, 64))
    summaries = [ScoreSummary(total=0.1) for _ in range(4)]
    ScoreSummary.batch_signals_many(summaries, ThresholdRule(), rows.ravel(),
                                    [(64 * i, 64 * (i + 1)) for i in range(4)],
                                    list(range(256)), [0] * 256)
    left_to_right = []
    for row in rows.tolist():
        total = 0.1
        for value in row:
            total += value
        left_to_right.append(total)
    pairwise = [0.1 + float(row.sum()) for row in rows]
    assert [s.total for s in summaries] == left_to_right
    assert left_to_right != pairwise  # the case tells the two orders apart


def test_zeros_of_both_signs_keep_the_sign_the_loop_keeps() -> None:
    """``0.0`` and ``-0.0`` compare equal: the loop keeps the first it saw as
    the extreme, where numpy's ``max`` and ``min`` may give the other."""
    per_request = [[0.0, -0.0, -1.0], [-0.0, 0.0, -1.0], [1.0, 0.0, -0.0], [1.0, -0.0, 0.0]]
    scores = [score for span in per_request for score in span]
    spans = [(3 * i, 3 * (i + 1)) for i in range(len(per_request))]
    tokens, layers = list(range(len(scores))), [0] * len(scores)
    rule = ThresholdRule()
    expected = [ScoreSummary() for _ in per_request]
    for summary, (first, last) in zip(expected, spans, strict=True):
        _one_at_a_time(summary, scores[first:last], tokens[first:last], layers[first:last],
                       rule)
    got = [ScoreSummary() for _ in per_request]
    ScoreSummary.batch_signals_many(got, rule, np.array(scores), spans, tokens, layers)
    assert [_state(s) for s in got] == [_state(s) for s in expected]


@st.composite
def _summaries(draw: Any) -> list[ScoreSummary]:
    found = [_earlier(draw) for _ in range(draw(st.integers(min_value=0, max_value=6)))]
    for summary in found:
        summary.threshold = draw(st.one_of(st.none(), st.floats(allow_nan=False)))
        if draw(st.booleans()):
            summary.extra = {"statistic": "mean"}
    return found


@settings(max_examples=200, deadline=None)
@given(_summaries())
def test_a_calls_verdicts_made_at_once_are_each_summarys_verdict(
        summaries: list[ScoreSummary]) -> None:
    """``summary_verdicts`` (a call's requests ended together) gives each
    summary's ``verdict()``: the same keys in the same order, the same values
    (NaN included, compared by their text)."""
    got = summary_verdicts(summaries)
    assert [repr(list(verdict.items())) for verdict in got] == [
        repr(list(summary.verdict().items())) for summary in summaries]


@settings(max_examples=200, deadline=None)
@given(scores=st.lists(SCORES, min_size=1, max_size=24),
       threshold=st.one_of(st.none(), st.sampled_from([0.0, 3.0, -1e6, 1e300])),
       action=st.sampled_from(["flag", "abort"]), requests=st.integers(1, 4))
def test_an_abort_test_tells_what_judging_the_values_gives(scores, threshold, action,
                                                          requests) -> None:
    """``abort_test`` (linear and norm probes): whether judging the values would
    abort some row, told without judging, is what judging them gives."""
    assume(threshold is not None or action == "flag")  # (abort needs a threshold)
    from undercurrent.probes.linear import LinearProbe
    from undercurrent.probes.statistics import NormProbe

    column = np.asarray(scores * requests, dtype=np.float64)
    width = len(scores)
    spans = [(index * width, (index + 1) * width) for index in range(requests)]
    tokens, layers = list(range(len(column))), [0] * len(column)
    linear = [LinearProbe(weight=[1.0], bias=0.0, threshold=threshold, action=action)
              for _ in range(requests)]
    norms = [NormProbe(threshold=threshold, action=action) for _ in range(requests)]
    told = LinearProbe.abort_test(linear)
    assert told is not None and NormProbe.abort_test(norms) is not None
    judged = LinearProbe.judge_many(linear, (column, {"logit": column}), spans, tokens, layers)
    assert judged is not None
    assert told((column, {"logit": column})) is judged.any_abort()
    assert NormProbe.abort_test(norms)(column) is judged.any_abort()


def test_no_abort_test_for_instances_judged_otherwise() -> None:
    """None where the instances differ in class or rule, or are a subclass (it
    may judge its own way): their steps are routed as they come."""
    from undercurrent.probes.linear import LinearProbe
    from undercurrent.probes.statistics import MeanProbe, NormProbe

    class Mine(LinearProbe):
        pass

    def linear(threshold: float, cls: type = LinearProbe) -> Any:
        return cls(weight=[1.0], bias=0.0, threshold=threshold, action="abort")

    assert LinearProbe.abort_test([linear(1.0), linear(1.0)]) is not None
    assert LinearProbe.abort_test([linear(1.0), linear(2.0)]) is None
    assert LinearProbe.abort_test([linear(1.0, Mine)]) is None
    assert NormProbe.abort_test([NormProbe(threshold=1.0), MeanProbe(threshold=1.0)]) is None
    flags = LinearProbe.abort_test([LinearProbe(weight=[1.0], bias=0.0, threshold=0.0)])
    assert flags is not None and flags((np.asarray([5.0]), {})) is False
