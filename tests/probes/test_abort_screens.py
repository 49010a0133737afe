"""``abort_screen`` (linear, norm and mean probes): a float32 test of a step's
captured pieces that may only err towards "may abort". The oracle is the
exact path: the rows' float64 scores (``LinearReadout.score_matrix``, the
statistics of ``NormProbe`` and ``MeanProbe``) and ``abort_test`` on them.
Thresholds are drawn at a row's exact score, one float64 step either side of
it, and anywhere, so that a screen clearing a step that reaches its threshold
by the last bit would fail.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from undercurrent.probes.linear import LinearProbe  # noqa: E402
from undercurrent.probes.statistics import MeanProbe, NormProbe  # noqa: E402

VALUES = st.one_of(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=32),
    st.sampled_from([0.0, -0.0, 1e-30, 3.0, 1e-25, 2e19]),
)
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf])
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _matrix(pieces: list[Any]) -> Any:
    """The pieces' rows as the exact path reads them (float64)."""
    return np.concatenate([piece.to(torch.float64).numpy().reshape(len(piece), -1)
                           for piece in pieces])


def _draw_pieces(draw: Any, width: int, rows: int, layers: int) -> list[Any]:
    """A step's pieces: ``layers`` tensors of ``rows`` rows of ``width`` values,
    of one drawn dtype, NaN and infinities among the values in some steps."""
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    values = st.one_of(VALUES, SPECIAL) if draw(st.booleans()) else VALUES
    return [torch.tensor(draw(st.lists(values, min_size=rows * width, max_size=rows * width)),
                         dtype=dtype).reshape(rows, width) for _ in range(layers)]


def _near_a_score(draw: Any, scores: list[float], anywhere: Any) -> float:
    """A threshold at one of the finite ``scores``, one float64 step below or
    above it, or drawn from ``anywhere``."""
    finite = [score for score in scores if math.isfinite(score)]
    where = draw(st.sampled_from(["a score", "below one", "above one", "anywhere"]))
    if where == "anywhere" or not finite:
        return float(draw(anywhere))
    score = draw(st.sampled_from(finite))
    return float({"a score": score, "below one": np.nextafter(score, -math.inf),
                  "above one": np.nextafter(score, math.inf)}[where])


def _exact_abort(weight: list[float], bias: float, link: str, threshold: float,
                 pieces: list[Any]) -> bool:
    """Whether judging the pieces' rows aborts, by the exact path (float64)."""
    probe = LinearProbe(weight=weight, bias=bias, link=link, threshold=threshold, action="abort")
    test = LinearProbe.abort_test([probe])
    assert test is not None
    return test(probe.readout.score_matrix(_matrix(pieces)))


@st.composite
def cases(draw: Any) -> tuple[list[float], float, str, float, list[Any]]:
    hidden = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 3))
    weight = draw(st.lists(st.floats(-10, 10, allow_nan=False, width=64),
                           min_size=hidden, max_size=hidden))
    bias = draw(st.floats(-5, 5, allow_nan=False, width=64))
    link = draw(st.sampled_from(["sigmoid", "identity"]))
    pieces = _draw_pieces(draw, hidden, rows, layers)
    plain = LinearProbe(weight=weight, bias=bias, link=link)
    scores = plain.readout.score_matrix(_matrix(pieces))[0].tolist()
    anywhere = (st.one_of(st.floats(0.0, 1.0, exclude_min=True),
                          st.sampled_from([1.0, 1.01, 0.5])) if link == "sigmoid"
                else st.floats(-1e4, 1e4, allow_nan=False))
    return weight, bias, link, _near_a_score(draw, scores, anywhere), pieces


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # (the oracle's NaN)
@settings(max_examples=400, deadline=None)
@given(cases())
def test_the_screen_clears_only_steps_that_cannot_abort(case) -> None:
    weight, bias, link, threshold, pieces = case
    assume(math.isfinite(threshold) and (link == "identity" or threshold > 0.0))
    probe = LinearProbe(weight=weight, bias=bias, link=link, threshold=threshold, action="abort")
    screen = LinearProbe.abort_screen([probe])
    assert screen is not None
    if not screen(pieces):
        assert not _exact_abort(weight, bias, link, threshold, pieces)


def test_the_screen_clears_steps_far_from_the_threshold_and_no_others() -> None:
    """The screen is of use (it clears steps well below the threshold) and says
    "may abort" for a step that reaches it, for rows with a NaN or infinity,
    for rows of another width or kind; there is none for a probe that only
    flags, a softmax readout or a threshold every sigmoid reaches, and a
    sigmoid threshold above 1 is never reached."""
    weight = [0.5, -0.25, 1.0]
    low = torch.tensor([[0.1, 0.2, -0.3], [0.0, 0.0, 0.0]])
    high = torch.tensor([[0.1, 0.2, -0.3], [5.0, 0.0, 5.0]])  # logit 7.5: sigmoid 0.9994

    def screen(threshold: float, **args: Any) -> Any:
        probe = LinearProbe(weight=weight, bias=0.0, threshold=threshold, action="abort",
                            **args)
        return LinearProbe.abort_screen([probe])

    guard = screen(0.9)
    assert guard is not None
    assert guard([low, low]) is False
    assert guard([low, high]) is True
    assert _exact_abort(weight, 0.0, "sigmoid", 0.9, [low, high])
    assert guard([torch.tensor([[math.nan, 0.0, 0.0]])]) is True
    assert guard([torch.tensor([[math.inf, 0.0, 0.0]])]) is True
    assert guard([torch.zeros(2, 4)]) is True  # (another width: the exact path says so)
    assert guard([torch.zeros(2, 3, dtype=torch.int64)]) is True
    assert guard([np.zeros((2, 3), dtype=np.float32)]) is True  # (not a tensor)
    assert guard([low.to(torch.bfloat16)]) is False
    assert screen(1.01)([high * 1e30]) is False
    assert screen(0.9, link="identity")([low]) is False
    assert screen(0.0) is None  # (every sigmoid reaches it)
    flags = LinearProbe(weight=weight, bias=0.0, threshold=0.9, action="flag")
    assert LinearProbe.abort_screen([flags]) is None
    classes = LinearProbe(weight=[weight, weight], bias=[0.0, 0.0], link="softmax",
                          class_index=0, threshold=0.9, action="abort")
    assert LinearProbe.abort_screen([classes]) is None

    class Mine(LinearProbe):
        pass

    assert Mine.abort_screen([Mine(weight=weight, bias=0.0, threshold=0.9,
                                   action="abort")]) is None


@st.composite
def statistic_cases(draw: Any) -> tuple[type, float, list[Any]]:
    kind = draw(st.sampled_from([NormProbe, MeanProbe]))
    width = draw(st.integers(1, 40))
    pieces = _draw_pieces(draw, width, draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    scores = kind().statistics(_matrix(pieces)).tolist()
    anywhere = st.one_of(st.floats(-1e4, 1e4, allow_nan=False),
                         st.sampled_from([0.0, 1e-30, 1e-20]))
    return kind, _near_a_score(draw, scores, anywhere), pieces


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # (the oracle's NaN)
@settings(max_examples=400, deadline=None)
@given(statistic_cases())
def test_a_statistic_s_screen_clears_only_steps_that_cannot_abort(case) -> None:
    kind, threshold, pieces = case
    probe = kind(threshold=threshold, action="abort")
    screen = kind.abort_screen([probe])
    assert screen is not None
    if not screen(pieces):
        test = kind.abort_test([probe])
        assert test is not None
        assert not test(probe.statistics(_matrix(pieces)))


def test_a_statistic_s_screen_clears_steps_far_from_the_threshold_and_no_others() -> None:
    low = torch.tensor([[0.1, 0.2, -0.3], [0.0, 0.0, 0.0]])
    high = torch.tensor([[3.0, 4.0, 0.0]])  # norm 5, mean 7/3
    norm = NormProbe.abort_screen([NormProbe(threshold=5.0, action="abort")])
    mean = MeanProbe.abort_screen([MeanProbe(threshold=7 / 3, action="abort")])
    assert norm is not None and mean is not None
    assert norm([low, low]) is False and mean([low, low]) is False
    assert norm([low, high]) is True and mean([low, high]) is True
    assert norm([torch.tensor([[math.nan, 0.0]])]) is True
    assert mean([torch.tensor([[-math.inf, 0.0]])]) is True
    assert norm([torch.full((1, 2), 1e20)]) is True  # (squares past float32's range)
    assert norm([low.to(torch.bfloat16)]) is False
    assert NormProbe.abort_screen([NormProbe(threshold=5.0)]) is None  # (flags only)
    assert NormProbe.abort_screen([NormProbe(threshold=5.0, action="abort"),
                                   MeanProbe(threshold=5.0, action="abort")]) is None
