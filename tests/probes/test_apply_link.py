"""The one link function (sigmoid/softmax/identity) against scipy's, at any magnitude."""

from __future__ import annotations

import numpy as np
import pytest

from undercurrent.probes.weights import apply_link

special = pytest.importorskip("scipy.special")

LOGITS = np.array([[-800.0, -30.0, -1.5, 0.0], [0.25, 2.0, 40.0, 900.0]])


def test_sigmoid_matches_scipy_expit_without_overflow():
    with np.errstate(over="raise"):
        got = apply_link("sigmoid", LOGITS)
    np.testing.assert_allclose(got, special.expit(LOGITS), rtol=1e-12, atol=0)


def test_softmax_is_over_the_last_axis_and_matches_scipy():
    with np.errstate(over="raise"):
        got = apply_link("softmax", LOGITS)
    np.testing.assert_allclose(got, special.softmax(LOGITS, axis=-1), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(got.sum(axis=-1), 1.0)


def test_identity_and_unknown_links():
    np.testing.assert_array_equal(apply_link("identity", LOGITS), LOGITS)
    with pytest.raises(ValueError, match="link must be one of sigmoid, softmax, identity"):
        apply_link("tanh", LOGITS)


def test_sigmoid_is_the_two_sided_stable_form_bit_for_bit():
    """1 / (1 + exp(-z)) for z >= 0 and exp(z) / (1 + exp(z)) below, exactly (so
    scores do not move between releases), NaN and infinities included."""
    z = np.concatenate([LOGITS.ravel(), [np.nan, np.inf, -np.inf, -0.0, 1e-300, -1e-300],
                        np.random.default_rng(0).normal(0.0, 20.0, 1000)])
    small = np.exp(-np.abs(z))
    with np.errstate(invalid="ignore"):
        expected = np.where(z >= 0, 1.0 / (1.0 + small), small / (1.0 + small))
    np.testing.assert_array_equal(apply_link("sigmoid", z), expected)
