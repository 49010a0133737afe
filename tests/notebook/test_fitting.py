"""fit_linear_probe: scikit-learn's fit, folded into one affine map, saved in the agreed format."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from nb_builders import make_records
from safetensors import safe_open
from safetensors.numpy import load_file
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from undercurrent.analysis import activation_matrix
from undercurrent.notebook import fit_linear_probe, records_frame
from undercurrent.probes.weights import LINEAR_PROBE_FORMAT


def _blobs(n: int = 300, hidden: int = 12, classes: int = 2, seed: int = 1):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=n)
    centres = rng.normal(scale=1.5, size=(classes, hidden))
    # Features on very different scales and offsets, so the folded standardisation matters.
    X = (centres[labels] + rng.normal(size=(n, hidden))) * np.linspace(0.1, 30, hidden) + 7.0
    return X, labels


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def test_saved_safetensors_reproduces_sklearns_pipeline_probabilities(tmp_path):
    X, y = _blobs()
    fit = fit_linear_probe(X, y, test_size=0, save_to=tmp_path / "probe.safetensors")
    oracle = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
    oracle.fit(X, y)
    arrays = load_file(str(tmp_path / "probe.safetensors"))
    assert arrays["weight"].shape == (12,) and arrays["weight"].dtype == np.float32
    assert arrays["bias"].shape == () and arrays["bias"].dtype == np.float32
    from_file = _sigmoid(X @ arrays["weight"].astype(np.float64) + float(arrays["bias"]))
    np.testing.assert_allclose(from_file, oracle.predict_proba(X)[:, 1], atol=2e-4)
    np.testing.assert_allclose(fit.predict_proba(X), oracle.predict_proba(X), atol=2e-4)


def test_safetensors_metadata_follows_the_agreed_format(tmp_path):
    X, y = _blobs()
    labels = np.array(["benign", "harmful"])[y]
    fit_linear_probe(
        X, labels, threshold=0.7, layer=3, tensor_type="residual_stream",
        save_to=tmp_path / "p.safetensors",
    )
    with safe_open(str(tmp_path / "p.safetensors"), framework="numpy") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == LINEAR_PROBE_FORMAT
    assert metadata["link"] == "sigmoid"
    assert float(metadata["threshold"]) == 0.7
    assert metadata["layer"] == "3"
    assert metadata["tensor_type"] == "residual_stream"
    assert json.loads(metadata["label_names"]) == ["benign", "harmful"]
    assert json.loads(metadata["metrics"])["n_test"] == 75


def test_multiclass_npz_holds_softmax_weights_matching_sklearn(tmp_path):
    X, y = _blobs(classes=3)
    fit_linear_probe(X, y, test_size=0, C=0.5, save_to=tmp_path / "p.npz")
    oracle = make_pipeline(StandardScaler(), LogisticRegression(C=0.5, max_iter=2000)).fit(X, y)
    saved = np.load(tmp_path / "p.npz", allow_pickle=False)
    assert saved["weight"].shape == (3, 12) and saved["bias"].shape == (3,)
    assert str(saved["format"]) == LINEAR_PROBE_FORMAT and str(saved["link"]) == "softmax"
    logits = X @ saved["weight"].astype(np.float64).T + saved["bias"]
    softmax = np.exp(logits - logits.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_allclose(softmax, oracle.predict_proba(X), atol=2e-4)


def test_metrics_report_train_and_held_out_quality():
    X, y = _blobs(n=400)
    metrics = fit_linear_probe(X, y).metrics
    assert metrics["n_train"] == 300 and metrics["n_test"] == 100
    assert metrics["test_accuracy"] > 0.9 and metrics["test_auc"] > 0.95
    assert metrics["chance_accuracy"] < 0.7
    assert metrics["split"] == "row"


def test_random_labels_give_chance_held_out_accuracy():
    X, _ = _blobs(n=400)
    y = np.random.default_rng(5).integers(0, 2, size=400)
    metrics = fit_linear_probe(X, y, seed=3).metrics
    assert 0.3 < metrics["test_accuracy"] < 0.7


def _copied_token_records(requests: int, tokens: int, hidden: int, seed: int):
    """Each request repeats one random vector with tiny noise: rows of a request are near-twins."""
    rng = np.random.default_rng(seed)
    template = make_records(requests=requests, layers=(2,), prompt_len=0, generated=tokens,
                            hidden=hidden)
    centres = rng.normal(size=(requests, hidden))
    out = []
    for record in template:
        r = int(record.request_id.removeprefix("req"))
        noise = rng.normal(scale=0.01, size=hidden)
        out.append(replace(record, tensor=(centres[r] + noise).astype(np.float32)))
    labels = {f"req{r}": int(rng.integers(0, 2)) for r in range(requests)}
    return out, labels


def test_frame_split_keeps_each_request_on_one_side_so_leakage_cannot_inflate_accuracy():
    records, labels = _copied_token_records(requests=60, tokens=8, hidden=40, seed=2)
    frame = records_frame(records)
    by_request = fit_linear_probe(frame, labels, C=100.0).metrics
    by_row = fit_linear_probe(frame, labels, C=100.0, group_by=None).metrics
    assert by_request["split"] == "request" and by_row["split"] == "row"
    # Labels are random per request: only leaked twins of training rows can be "predicted".
    assert by_row["test_accuracy"] > 0.95
    assert by_request["test_accuracy"] < 0.8


def test_frame_input_records_layer_and_tensor_type_and_needs_a_layer_choice(tmp_path):
    records = make_records(requests=8, layers=(0, 1), hidden=4)
    labels = {f"req{r}": r % 2 for r in range(8)}
    frame = records_frame(records)
    with pytest.raises(ValueError, match=r"mixes layers \[0, 1\].*layer=0"):
        fit_linear_probe(frame, labels)
    fit = fit_linear_probe(frame, labels, layer=1)
    assert (fit.layer, fit.tensor_type) == (1, "residual_stream")
    assert fit.metrics["n_train"] + fit.metrics["n_test"] == 8 * 7


def test_labels_may_be_a_column_or_one_per_row_of_the_unfiltered_frame():
    records = make_records(requests=6, layers=(0, 1), hidden=4)
    frame = records_frame(records)
    frame["label"] = frame["request"].map(lambda r: int(r[-1]) % 2)
    by_column = fit_linear_probe(frame, "label", layer=0)
    by_array = fit_linear_probe(frame, frame["label"].to_numpy(), layer=0)
    np.testing.assert_array_equal(by_column.weight, by_array.weight)


def test_a_labels_series_is_aligned_with_the_frames_rows_by_its_index():
    # A Series built from the frame, then the frame re-sorted: its labels were read by
    # position, giving half the rows another row's label, silently.
    from undercurrent.steering import fit_steering_vector

    frame = records_frame(make_records(requests=8, layers=(0, 1), hidden=4))
    frame["label"] = frame["request"].map(lambda r: int(r[-1]) % 2)
    series = frame["request"].map(lambda r: int(r[-1]) % 2)
    resorted = frame.sort_values(["token_index", "request"], kind="stable")
    by_column = fit_linear_probe(resorted, "label", layer=1)
    np.testing.assert_array_equal(fit_linear_probe(resorted, series, layer=1).weight,
                                  by_column.weight)
    np.testing.assert_array_equal(fit_steering_vector(resorted, series, layer=1).vector,
                                  fit_steering_vector(resorted, "label", layer=1).vector)
    # group ids too; a Series with the default index that is not the rows' own, as a list
    np.testing.assert_array_equal(fit_linear_probe(
        resorted, "label", layer=1, group_by=frame["request"]).weight, by_column.weight)
    layer_one = resorted[resorted["layer"] == 1]
    default_index = layer_one["label"].reset_index(drop=True)
    np.testing.assert_array_equal(fit_linear_probe(layer_one, default_index).weight,
                                  by_column.weight)
    with pytest.raises(ValueError, match=r"^fit_linear_probe: the labels Series \(index "
                       r"\[1000, 1001, 1002\] \.\.\., 112 values\) has no value for 56 of the "
                       r"56 selected rows .*pass a list or array \(series.to_numpy\(\)\)"):
        fit_linear_probe(resorted, series.set_axis(series.index + 1000), layer=1)
    with pytest.raises(ValueError, match=r"the labels Series .* has no value for 7 of the "
                       r"56 selected rows"):
        fit_linear_probe(resorted, series[series.index % 16 != 9], layer=1)
    with pytest.raises(ValueError, match=r"^fit_steering_vector: the labels Series .* repeats "
                       r"index value\(s\) \[0\]"):
        fit_steering_vector(resorted, series.rename(index={1: 0}), layer=1)


def test_bad_inputs_say_what_is_wrong():
    X, y = _blobs(n=40)
    with pytest.raises(ValueError, match="40 activation rows but 39 labels"):
        fit_linear_probe(X, y[:39])
    with pytest.raises(ValueError, match="at least two distinct labels"):
        fit_linear_probe(X, np.zeros(40))
    with pytest.raises(ValueError, match=r"suffix must be one of \.safetensors, \.npz"):
        fit_linear_probe(X, y, save_to="probe.pt")
    with pytest.raises(ValueError, match="2-D"):
        fit_linear_probe(X[0], y)


def test_labels_and_options_of_the_wrong_kind_are_refused_naming_the_argument():
    # (each failed inside Python, numpy or pandas: len() of an int, a KeyError, ...)
    X, y = _blobs(n=40)
    frame = records_frame(make_records(requests=8, layers=(0,), hidden=4))
    labels = {f"req{r}": r % 2 for r in range(8)}
    with pytest.raises(TypeError, match=r"y must be one label per row .* got int \(5\)"):
        fit_linear_probe(X, 5)
    with pytest.raises(ValueError, match=r"got 2-D labels \(shape \(40, 1\)\); flatten"):
        fit_linear_probe(X, y[:, None])
    with pytest.raises(TypeError, match=r"test_size must be a number, got str \('0.2'\)"):
        fit_linear_probe(X, y, test_size="0.2")
    with pytest.raises(TypeError, match=r"seed must be an integer, got str \('a'\)"):
        fit_linear_probe(X, y, seed="a")
    with pytest.raises(ValueError, match=r"group_by='prompt' names no column of the frame; "
                                         r"its columns are \['request', 'point'"):
        fit_linear_probe(frame, labels, group_by="prompt")
    # labels from a generator are read once, as the list they make
    from_generator = fit_linear_probe(X, (label for label in y))
    np.testing.assert_array_equal(from_generator.weight, fit_linear_probe(X, y).weight)


def test_a_seed_or_class_weight_scikit_learn_cannot_use_is_refused_naming_it():
    # (seed=-1 was refused in scikit-learn's words about train_test_split's
    # random_state; class_weight={0: -1.0} a bare ZeroDivisionError; a NaN weight
    # fitted a meaningless probe)
    X, y = _blobs(n=40)
    for seed in (-1, 2**32, np.int64(-5)):
        with pytest.raises(ValueError, match=r"fit_linear_probe: seed must be an integer "
                                             r"from 0 to 2\*\*32 - 1 \(or None\), got -?\d+$"):
            fit_linear_probe(X, y, seed=seed)
    for weight in (-1.0, 0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"fit_linear_probe: class_weight\[0\] must be "
                                             r"a finite number > 0, got"):
            fit_linear_probe(X, y, class_weight={0: weight, 1: 1.0})
    with pytest.raises(TypeError, match=r"class_weight\[1\] must be a number, got str"):
        fit_linear_probe(X, y, class_weight={0: 1.0, 1: "2"})
    with pytest.raises(TypeError, match=r"class_weight must be None, 'balanced' or a "
                                        r"\{label: weight\} mapping, got list"):
        fit_linear_probe(X, y, class_weight=[1.0, 2.0])
    weighted = fit_linear_probe(X, y, seed=np.int64(2**32 - 1), class_weight={0: np.float32(2)})
    assert weighted.weight.tolist() == fit_linear_probe(
        X, y, seed=2**32 - 1, class_weight={0: 2.0}).weight.tolist()
    # (a 0-d array, a ratio of counts, is a number too, as scikit-learn takes it)
    assert weighted.weight.tolist() == fit_linear_probe(
        X, y, seed=2**32 - 1, class_weight={0: np.array(2.0)}).weight.tolist()
    assert fit_linear_probe(X, y, seed=None, class_weight="balanced").classes == (0, 1)


def test_predict_takes_one_row_as_a_matrix_of_one_row():
    X, y = _blobs(n=80)
    fit = fit_linear_probe(X, y)
    assert fit.predict(X[3]).tolist() == fit.predict(X[3:4]).tolist()
    np.testing.assert_array_equal(fit.predict_proba(X[3]), fit.predict_proba(X[3:4]))
    with pytest.raises(ValueError, match=r"X must be \(rows, 12\) activations, or one row of "
                                         r"12, for this probe; got shape \(1, 5\)"):
        fit.predict(X[3, :5])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_a_torch_tensor_of_any_float_dtype_fits_like_its_float64_values(dtype):
    # a bfloat16 tensor failed in numpy ("Got unsupported ScalarType BFloat16")
    torch = pytest.importorskip("torch")
    X, y = _blobs(n=80)
    tensor = torch.tensor(X).to(getattr(torch, dtype))
    values = tensor.double().numpy()
    fit = fit_linear_probe(tensor, y)
    np.testing.assert_array_equal(fit.weight, fit_linear_probe(values, y).weight)
    np.testing.assert_array_equal(fit.predict_proba(tensor), fit.predict_proba(values))


def test_probe_args_point_at_the_saved_file(tmp_path):
    X, y = _blobs(n=80)
    fit = fit_linear_probe(X, y, save_to=tmp_path / "p.safetensors", threshold=0.8)
    assert fit.probe_args(action="abort") == {
        "path": str(tmp_path / "p.safetensors"), "threshold": 0.8, "action": "abort",
    }
    assert not math.isnan(fit.metrics["test_auc"])


@pytest.mark.parametrize(("threshold", "message"), [
    (float("nan"), "must be a finite number, got nan"),
    (float("inf"), "must be a finite number, got inf"),
    (None, r"must be a number \(the score at which the saved probe acts; default 0\.5\), "
           "got None"),
])
def test_a_threshold_the_probe_could_not_load_is_refused_before_fitting(
        tmp_path, threshold, message):
    # threshold=nan was fitted and saved to a file no linear_probe could load.
    X, y = _blobs(n=80)
    with pytest.raises(ValueError, match=rf"^fit_linear_probe: threshold {message}"):
        fit_linear_probe(X, y, threshold=threshold, save_to=tmp_path / "p.safetensors")
    assert not (tmp_path / "p.safetensors").exists()


def _probe_scores(path, X, **args):
    """Scores of the registered ``linear_probe`` (loaded from ``path``) on each row of X."""
    from undercurrent.probes import get_probe
    from undercurrent.records import ActivationRecord

    probe = get_probe("linear_probe")(path=str(path), **args)
    scores = []
    for index, row in enumerate(X.astype(np.float32)):
        record = ActivationRecord("r", "p", 0, "residual_stream", index, True, index, 1, row)
        scores.append(probe.on_activation(record).score)
    return np.array(scores)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_registered_linear_probe_loads_the_file_and_matches_sklearn(tmp_path, suffix):
    X, y = _blobs()
    labels = np.array(["safe", "unsafe"])[y]
    fit_linear_probe(X, labels, test_size=0, save_to=tmp_path / f"p{suffix}")
    oracle = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(X, labels)
    np.testing.assert_allclose(
        _probe_scores(tmp_path / f"p{suffix}", X), oracle.predict_proba(X)[:, 1], atol=1e-3
    )


def test_registered_linear_probe_reads_a_multiclass_fit_by_label_name(tmp_path):
    X, y = _blobs(classes=3)
    labels = np.array(["low", "mid", "high"])[y]
    fit_linear_probe(X, labels, test_size=0, save_to=tmp_path / "p.safetensors")
    oracle = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(X, labels)
    column = list(oracle.classes_).index("mid")
    scores = _probe_scores(tmp_path / "p.safetensors", X, class_index="mid")
    np.testing.assert_allclose(scores, oracle.predict_proba(X)[:, column], atol=1e-3)


def test_generation_outputs_can_be_passed_directly():
    from types import SimpleNamespace

    records = make_records(requests=8, layers=(1,), hidden=4)
    outputs = [SimpleNamespace(records=[r for r in records if r.request_id == f"req{i}"])
               for i in range(8)]
    labels = {f"req{i}": i % 2 for i in range(8)}
    direct = fit_linear_probe(outputs, labels, test_size=0)
    via_frame = fit_linear_probe(records_frame(records), labels, test_size=0)
    np.testing.assert_array_equal(direct.weight, via_frame.weight)
    assert direct.layer == 1


def test_a_training_split_without_one_of_the_labels_is_refused_before_scikit_learn_fits():
    # Five requests, one of them labelled 1: holding out four of them (test_size
    # 0.8: the lone 1 has the largest share of the four) leaves the training split
    # a single class.
    frame = records_frame(make_records(requests=5, layers=(0,), prompt_len=0, hidden=8))
    labels = {"req0": 1, "req1": 0, "req2": 0, "req3": 0, "req4": 0}
    with pytest.raises(ValueError, match=r"^fit_linear_probe: the training split lacks some "
                       r"labels \(\[1\] only held out; .*lower test_size or add data"):
        fit_linear_probe(frame, labels, test_size=0.8)
    assert fit_linear_probe(frame, labels, test_size=0).metrics["n_train"] == 20


def test_non_finite_activations_are_refused_naming_the_rows():
    X, y = _blobs(n=40)
    X[3, 1], X[7, 0] = np.inf, np.nan
    with pytest.raises(ValueError, match=r"^fit_linear_probe: 2 activation rows of 40 hold NaN "
                       r"or infinity: row 3, row 7; "):
        fit_linear_probe(X, y)


def test_non_finite_activations_in_a_frame_name_request_token_and_layer():
    records = make_records(requests=8, layers=(0,), prompt_len=0, hidden=4)
    records[5] = replace(records[5], tensor=np.full(4, np.nan, dtype=np.float32))
    labels = {f"req{r}": r % 2 for r in range(8)}
    with pytest.raises(ValueError, match=r"1 activation row of 32 holds NaN or infinity: "
                       r"request 'req1' token_index 1 layer 0; "):
        fit_linear_probe(records_frame(records), labels)


def test_missing_labels_are_refused_naming_the_requests_or_rows():
    frame = records_frame(make_records(requests=6, layers=(0,), prompt_len=0, hidden=4))
    none_label = {"req0": 0, "req1": None, "req2": 1, "req3": 0, "req4": 1, "req5": None}
    with pytest.raises(ValueError, match=r"^fit_linear_probe: 8 rows have no label \(None or "
                       r"NaN\): request\(s\) \['req1', 'req5'\]; "):
        fit_linear_probe(frame, none_label)
    nan_label = {f"req{r}": ["benign", "harmful"][r % 2] for r in range(6)} | {"req3": math.nan}
    with pytest.raises(ValueError, match=r"no label \(None or NaN\): request\(s\) \['req3'\]"):
        fit_linear_probe(frame, nan_label)
    frame["label"] = frame["request"].map({f"req{r}": float(r % 2) for r in range(5)})
    with pytest.raises(ValueError, match=r"4 rows have no label .*: request\(s\) \['req5'\]"):
        fit_linear_probe(frame, "label")
    X, y = _blobs(n=40)
    per_row = y.astype(float)
    per_row[[2, 9]] = np.nan
    with pytest.raises(ValueError, match=r"2 rows have no label \(None or NaN\): row 2, row 9"):
        fit_linear_probe(X, per_row)
    # Requests the frame does not hold may be unlabelled: their labels are never read.
    assert fit_linear_probe(frame, {**nan_label, "req3": "benign", "other": None}, test_size=0)


@pytest.mark.parametrize("test_size, held, ones", [
    (0.15, 3, 1), (0.25, 5, 1), (0.4, 8, 2), (0.65, 13, 3), (0.85, 17, 4), (0.99, 19, 5),
    (0.01, 1, 0)])
@pytest.mark.parametrize("seed", [0, 3])
def test_a_split_by_request_holds_out_the_share_of_requests_test_size_asks(
        test_size, held, ones, seed):
    # Whole requests on each side: test_size of them to the nearest request (at
    # least one, never all), each label giving its share (5 of the 20 are 1s; the
    # largest remainder takes the odd one).
    frame = records_frame(make_records(requests=20, layers=(0,), prompt_len=0, hidden=8))
    labels = {f"req{i}": int(i % 4 == 0) for i in range(20)}
    import undercurrent.analysis.fitting as fitting

    y = np.array([labels[request] for request in frame["request"]])
    train, test = fitting._split(y, frame["request"].to_numpy(), test_size, seed)
    held_out = set(frame["request"].to_numpy()[test])
    assert len(held_out) == held and not held_out & set(frame["request"].to_numpy()[train])
    assert sum(labels[request] for request in held_out) == ones
    assert len(test) == held * 4 and len(train) == (20 - held) * 4


@pytest.mark.parametrize("kind", ["list", "array", "series"])
def test_group_ids_may_be_a_list_an_array_or_a_series(kind):
    frame = records_frame(make_records(requests=12, layers=(0,), prompt_len=0, hidden=8))
    labels = {f"req{i}": i % 2 for i in range(12)}
    given = {"list": frame["request"].tolist(), "array": frame["request"].to_numpy(),
             "series": frame["request"]}[kind]
    fit = fit_linear_probe(frame, labels, group_by=given)
    auto = fit_linear_probe(frame, labels)
    np.testing.assert_array_equal(fit.weight, auto.weight)
    X = activation_matrix(frame)
    y = [labels[request] for request in frame["request"]]
    on_array = fit_linear_probe(X, y, group_by=given)
    np.testing.assert_array_equal(on_array.weight, auto.weight)
    with pytest.raises(ValueError, match=r"group_by gives 3 group id\(s\) \(shape \(3,\)\) "
                                         r"for 48 row\(s\)"):
        fit_linear_probe(X, y, group_by=np.array(["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"with an array, group_by must be one group id per "
                                         r"row \(a column name such as 'request' needs"):
        fit_linear_probe(X, y, group_by="request")
