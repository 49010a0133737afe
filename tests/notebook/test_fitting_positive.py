"""fit_linear_probe(positive=LABEL): the probe's score is the probability of LABEL,
checked against scikit-learn's own fit and through the registered linear_probe."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from test_fitting import _blobs, _probe_scores

from undercurrent.notebook import fit_linear_probe


@pytest.mark.parametrize("positive", ["benign", "harmful", None])
def test_the_score_is_the_probability_of_the_positive_label(tmp_path, positive):
    X, y = _blobs()
    labels = np.array(["benign", "harmful"])[y]
    fit = fit_linear_probe(X, labels, test_size=0, positive=positive,
                           save_to=tmp_path / "p.safetensors")
    chosen = positive or "harmful"  # default: the second label in sorted order
    oracle = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(X, labels)
    expected = oracle.predict_proba(X)[:, list(oracle.classes_).index(chosen)]
    assert fit.label_names[1] == chosen and fit.classes[1] == chosen
    np.testing.assert_allclose(fit.predict_proba(X)[:, 1], expected, atol=2e-4)
    np.testing.assert_allclose(_probe_scores(tmp_path / "p.safetensors", X), expected, atol=1e-3)
    assert list(fit.predict(X)) == list(oracle.predict(X))
    with safe_open(str(tmp_path / "p.safetensors"), framework="numpy") as handle:
        assert handle.metadata()["label_names"].endswith(f'"{chosen}"]')


def test_held_out_metrics_do_not_depend_on_which_label_is_positive():
    X, y = _blobs(seed=4)
    first = fit_linear_probe(X, y, positive=0).metrics
    second = fit_linear_probe(X, y, positive=1).metrics
    for key in ("train_accuracy", "test_accuracy", "test_auc"):
        assert first[key] == pytest.approx(second[key], abs=1e-9), key


def test_integer_labels_take_a_positive_label_too():
    X, y = _blobs()
    fit = fit_linear_probe(X, y, test_size=0, positive=0)
    oracle = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(X, y)
    np.testing.assert_allclose(fit.predict_proba(X)[:, 1], oracle.predict_proba(X)[:, 0],
                               atol=2e-4)


def test_a_positive_label_not_among_the_labels_is_refused():
    X, y = _blobs()
    labels = np.array(["benign", "harmful"])[y]
    with pytest.raises(ValueError, match=r"positive='harmfull' is not among the labels "
                                         r"\['benign', 'harmful'\]"):
        fit_linear_probe(X, labels, positive="harmfull")
    X3, y3 = _blobs(classes=3)
    with pytest.raises(ValueError, match="positive= chooses what a two-label probe scores"):
        fit_linear_probe(X3, y3, positive=1)
