"""linear_probe: scores against a hand-computed oracle, and the probe file format."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from probe_helpers import activation
from safetensors.numpy import save_file

from undercurrent.probes import (
    LINEAR_PROBE_FORMAT,
    LinearProbe,
    ProbeFileError,
    RequestContext,
    get_probe,
    load_linear_weights,
    save_linear_weights,
)
from undercurrent.records import SignalAction
from undercurrent.spec.types import ExtractionPoint

RNG = np.random.default_rng(0)
W = RNG.normal(size=8)
B = 0.3
XS = RNG.normal(size=(5, 8)).astype(np.float32)


def oracle_sigmoid(x) -> float:
    z = sum(float(w) * float(v) for w, v in zip(W, x, strict=True)) + B
    return 1.0 / (1.0 + math.exp(-z))


def _write_safetensors(path, arrays, metadata=None):
    save_file({k: np.asarray(v) for k, v in arrays.items()}, str(path), metadata=metadata)


def test_inline_weights_give_the_sigmoid_of_the_affine_map():
    probe = get_probe("linear_probe")(weight=W.tolist(), bias=B)
    for i, x in enumerate(XS):
        signal = probe.on_activation(activation(x, token=i))
        assert signal.score == pytest.approx(oracle_sigmoid(x), abs=1e-9)
        assert signal.action is SignalAction.CONTINUE  # no threshold: scores only


def test_safetensors_file_written_by_hand_is_loaded_with_its_metadata(tmp_path):
    path = tmp_path / "probe.safetensors"
    _write_safetensors(path, {"weight": W.astype(np.float32), "bias": np.array(B, np.float32)},
                       {"format": LINEAR_PROBE_FORMAT, "threshold": "0.5", "link": "sigmoid"})
    probe = LinearProbe(path=str(path), action="abort")
    probe.on_start(RequestContext("r"))
    expected = [oracle_sigmoid(x) for x in XS]
    signals = [probe.on_activation(activation(x, token=i)) for i, x in enumerate(XS)]
    assert [s.score for s in signals] == pytest.approx(expected, abs=1e-6)
    assert [s.action is SignalAction.ABORT for s in signals] == [e >= 0.5 for e in expected]
    verdict = probe.on_end(RequestContext("r"))
    assert verdict["max_score"] == pytest.approx(max(expected), abs=1e-6)
    assert verdict["flagged"] == any(e >= 0.5 for e in expected)
    first = next(i for i, e in enumerate(expected) if e >= 0.5)
    assert verdict["first_crossing_token_index"] == first
    assert verdict["threshold"] == 0.5 and verdict["link"] == "sigmoid"


def test_npz_with_string_metadata_and_explicit_args_override_the_file(tmp_path):
    path = tmp_path / "probe.npz"
    np.savez(path, weight=W, bias=np.array([B]), format=np.array(LINEAR_PROBE_FORMAT),
             link=np.array("identity"), threshold=np.array("100"))
    from_file = LinearProbe(path=path)
    overridden = LinearProbe(path=path, link="sigmoid", threshold=0.0)
    x = XS[0]
    logit = float(W @ x.astype(np.float64) + B)
    assert from_file.on_activation(activation(x)).score == pytest.approx(logit)
    assert from_file.rule.threshold == 100.0
    signal = overridden.on_activation(activation(x))
    assert signal.score == pytest.approx(oracle_sigmoid(x)) and signal.action is SignalAction.FLAG


def test_softmax_multiclass_scores_the_chosen_class_by_index_or_label(tmp_path):
    weight = RNG.normal(size=(3, 8))
    bias = np.array([0.1, -0.2, 0.05])
    path = save_linear_weights(tmp_path / "m.safetensors", weight, bias,
                               label_names=["low", "mid", "high"])
    x = XS[1].astype(np.float64)
    logits = weight @ x + bias
    probabilities = np.exp(logits) / np.exp(logits).sum()
    by_label = LinearProbe(path=path, class_index="high").on_activation(activation(XS[1]))
    by_index = LinearProbe(path=path, class_index=0).on_activation(activation(XS[1]))
    assert by_label.score == pytest.approx(probabilities[2], abs=1e-6)
    assert by_index.score == pytest.approx(probabilities[0], abs=1e-6)
    assert by_label.metadata["top_label"] == ["low", "mid", "high"][int(np.argmax(logits))]
    with pytest.raises(ValueError, match="3-class probe needs class_index"):
        LinearProbe(path=path)
    with pytest.raises(ValueError, match="'huge' is not a label name.*low, mid, high"):
        LinearProbe(path=path, class_index="huge")


@pytest.mark.parametrize("mode", ["inline", "async"])
def test_points_with_the_same_weights_and_other_label_names_each_name_their_own(
        tmp_path, mode):
    # Two files of equal weights, labelled apart, on the same rows of a generation:
    # the values one point computes are not the other's (its labels are its file's).
    pytest.importorskip("transformers")
    from undercurrent import ProbedModel
    from undercurrent.spec import ProbeSpec

    rng = np.random.default_rng(3)
    weight, bias = rng.normal(size=(3, 128)) * 0.05, rng.normal(size=3)
    names = {"abc": ["a", "b", "c"], "xyz": ["x", "y", "z"]}
    points = tuple(ExtractionPoint(
        name=name, layers=(1, 2), tensor_type="residual_stream", position="generated[*]",
        probe_type="linear_probe", probe_kind="trajectory", execution_mode=mode,
        probe_args={"path": str(save_linear_weights(tmp_path / f"{name}.safetensors",
                                                    weight, bias, label_names=labels)),
                    "class_index": labels[1]})
        for name, labels in names.items())
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=ProbeSpec(points))
    try:
        (output,) = model.generate(["the cat"], max_new_tokens=5, records=True)
    finally:
        model.close()
    for name, labels in names.items():
        records = [r for r in output.records if r.extraction_point_name == name]
        signals = output.results[name].signals
        assert len(signals) == len(records) == 8
        for signal, record in zip(signals, records, strict=True):
            logits = weight @ record.tensor.float().numpy().astype(np.float64) + bias
            assert signal.metadata["label"] == labels[1]
            assert signal.metadata["top_label"] == labels[int(np.argmax(logits))]


def test_two_class_softmax_defaults_to_the_second_class():
    weight = np.stack([np.zeros(8), W])
    probe = LinearProbe(weight=weight, bias=[0.0, B])
    # softmax over (0, z) is sigmoid(z): an independent check of the 2-class default
    assert probe.on_activation(activation(XS[2])).score == pytest.approx(oracle_sigmoid(XS[2]))


def test_torch_bfloat16_and_kv_shaped_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    probe = LinearProbe(weight=W, bias=B)
    x = torch.tensor(XS[0]).to(torch.bfloat16)
    expected = oracle_sigmoid(x.float().numpy())
    assert probe.on_activation(activation(x)).score == pytest.approx(expected, abs=1e-6)
    kv = np.arange(8, dtype=np.float32).reshape(2, 2, 2)  # (2, num_kv_heads, head_dim)
    assert probe.on_activation(activation(kv)).score == pytest.approx(oracle_sigmoid(kv.ravel()))


def test_inline_bfloat16_tensor_weights_score_with_their_exact_values():
    # the weights were refused: "weight and bias must be numeric arrays (Got unsupported
    # ScalarType BFloat16)"
    torch = pytest.importorskip("torch")
    weight = torch.tensor(W).to(torch.bfloat16)
    probe = get_probe("linear_probe")(weight=weight, bias=torch.tensor(B).to(torch.bfloat16))
    exact = get_probe("linear_probe")(weight=weight.double().numpy(),
                                      bias=float(torch.tensor(B).to(torch.bfloat16)))
    for x in XS:
        assert probe.on_activation(activation(x)).score == exact.on_activation(activation(x)).score


def test_activation_of_the_wrong_size_is_an_error_naming_the_file(tmp_path):
    path = save_linear_weights(tmp_path / "p.npz", W, B)
    probe = LinearProbe(path=path)
    with pytest.raises(ValueError, match=r"p\.npz.*expects activations of size 8.*\(4,\)"):
        probe.on_activation(activation(np.zeros(4)))


@pytest.mark.parametrize(
    ("writer", "message"),
    [
        (lambda p: p.write_bytes(b"not a safetensors file at all"), "not a valid safetensors"),
        (lambda p: _write_safetensors(p, {"weight": W}), "missing array.*bias"),
        (lambda p: _write_safetensors(p, {"weight": W, "bias": np.zeros(3)}), "bias shape"),
        (lambda p: _write_safetensors(p, {"weight": W, "bias": np.array(B)},
                                      {"format": "someone.else/2"}), "declares format"),
        (lambda p: _write_safetensors(p, {"weight": W, "bias": np.array(B),
                                          "mean": np.zeros(8)}), "fold it into weight"),
    ],
)
def test_a_file_that_is_not_what_it_claims_is_refused_naming_the_path(tmp_path, writer, message):
    path = tmp_path / "bad.safetensors"
    writer(path)
    with pytest.raises(ProbeFileError, match=message) as info:
        load_linear_weights(path)
    assert "bad.safetensors" in str(info.value)


def test_pickles_and_unknown_suffixes_are_never_loaded(tmp_path):
    pickled = tmp_path / "p.npz"
    np.savez(pickled, weight=np.array([object()], dtype=object), bias=np.array(0.0))
    with pytest.raises(ProbeFileError, match="not a valid .npz"):
        load_linear_weights(pickled)
    with pytest.raises(ProbeFileError, match="unsupported suffix '.pt'"):
        load_linear_weights(tmp_path / "p.pt")
    with pytest.raises(ProbeFileError, match="does not exist"):
        load_linear_weights(tmp_path / "missing.safetensors")


def test_save_then_load_round_trips_arrays_and_metadata(tmp_path):
    for suffix in (".safetensors", ".npz"):
        path = save_linear_weights(tmp_path / f"p{suffix}", W, B, link="sigmoid", threshold=0.7,
                                   layer=3, tensor_type="mlp_out", label_names=["no", "yes"])
        loaded = load_linear_weights(path)
        # the format stores float32
        np.testing.assert_array_equal(loaded.weight, np.asarray(W, dtype=np.float32))
        assert float(loaded.bias) == float(np.float32(B)) and loaded.bias.shape == ()
        assert loaded.metadata["format"] == LINEAR_PROBE_FORMAT
        assert loaded.metadata["layer"] == "3" and loaded.label_names == ("no", "yes")
        assert json.loads(loaded.metadata["label_names"]) == ["no", "yes"]


@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), "high", True])
def test_a_threshold_no_probe_could_load_is_refused_at_save_and_no_file_written(
        tmp_path, threshold):
    # A NaN or infinite threshold was written, then every load of the file refused it.
    target = tmp_path / "p.safetensors"
    with pytest.raises(ValueError, match=rf"^threshold of the probe to save at "
                                         rf"'{tmp_path}/p.safetensors' must be a"):
        save_linear_weights(target, W, B, threshold=threshold)
    assert not target.exists()
    assert "threshold" not in load_linear_weights(save_linear_weights(target, W, B)).metadata


def test_a_file_with_an_unusable_threshold_is_named_at_load(tmp_path):
    # (a file written before the save-time check, or by hand)
    path = tmp_path / "old.safetensors"
    _write_safetensors(path, {"weight": W.astype(np.float32), "bias": np.array(B, np.float32)},
                       {"format": LINEAR_PROBE_FORMAT, "threshold": "nan"})
    with pytest.raises(ValueError, match=rf"^linear probe file '{path}': its threshold metadata "
                                         r"is unusable \(threshold must be a finite number, "
                                         r"got 'nan'.*pass threshold=\.\.\. in probe_args"):
        LinearProbe(path=str(path))
    assert LinearProbe(path=str(path), threshold=0.5).rule.threshold == 0.5


def test_label_names_are_a_list_with_one_name_per_class(tmp_path):
    # (label_names="ab" was stored as the two names 'a' and 'b')
    with pytest.raises(TypeError, match=r"label_names must be a list of class names, got str"):
        save_linear_weights(tmp_path / "p.safetensors", W, B, label_names="ab")
    with pytest.raises(ValueError, match=r"label_names has 3 name\(s\) .* a binary probe "
                                         r"\(one weight row\) has two"):
        save_linear_weights(tmp_path / "p.safetensors", W, B, label_names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"label_names has 2 name\(s\) .* the weight has 3 "
                                         r"class rows"):
        save_linear_weights(tmp_path / "p.safetensors", np.ones((3, 8)), np.zeros(3),
                            label_names=["a", "b"])
    assert not (tmp_path / "p.safetensors").exists()


def test_a_file_fitted_on_another_layer_fails_on_start_unless_told_otherwise(tmp_path):
    path = save_linear_weights(tmp_path / "p.safetensors", W, B, layer=3,
                               tensor_type="residual_stream")
    point = ExtractionPoint(name="x", layers=(5,), tensor_type="residual_stream",
                            position="prompt[-1]", probe_type="linear_probe",
                            probe_kind="single_shot")
    ctx = RequestContext("r", extraction_point=point)
    with pytest.raises(ValueError, match="fitted on layer 3.*captures layers \\[5\\]"):
        LinearProbe(path=path).on_start(ctx)
    LinearProbe(path=path, check_metadata=False).on_start(ctx)
    with pytest.raises(TypeError, match=r"check_metadata must be True or False, got str"):
        LinearProbe(path=path, check_metadata="no")  # ("no" would check)


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="needs path .* or both weight and bias"):
        LinearProbe(weight=W)
    with pytest.raises(ValueError, match="link must be one of sigmoid, softmax, identity"):
        LinearProbe(weight=W, bias=B, link="tanh")
    with pytest.raises(ValueError, match="softmax' needs a \\(classes, hidden\\) weight"):
        LinearProbe(weight=W, bias=B, link="softmax")
    with pytest.raises(ValueError, match="action must be 'flag' or 'abort'"):
        LinearProbe(weight=W, bias=B, action="continue")
    with pytest.raises(ValueError, match="must be finite"):
        LinearProbe(weight=[float("nan")] * 8, bias=B)


@pytest.mark.parametrize("classes", [None, 3])
@pytest.mark.parametrize("hidden", [128, 9001])  # (9001: summed in three pieces)
def test_a_row_scores_the_same_bits_in_a_matrix_of_any_height(classes, hidden):
    """The readout's product is summed row by row on the calling thread
    (one dot product per row, no threaded BLAS product): a row's score does
    not depend on the rows scored with it, so a window of steps scores
    exactly what each step does."""
    from undercurrent.probes.linear import LinearReadout

    rng = np.random.default_rng(3)
    shape = (hidden,) if classes is None else (classes, hidden)
    readout = LinearReadout(weight=rng.normal(size=shape).tolist(),
                            bias=(0.1 if classes is None else [0.1] * classes),
                            link="identity", class_index=None if classes is None else 2)
    matrix = rng.normal(size=(700, hidden))
    whole, _ = readout.score_matrix(matrix)
    for start, stop in [(0, 1), (5, 6), (0, 64), (13, 400), (699, 700)]:
        part, _ = readout.score_matrix(matrix[start:stop])
        assert part.tolist() == whole[start:stop].tolist()
    # And each equals its own dot product to within rounding.
    weight = np.asarray(readout.weights.weight)
    expected = (matrix @ weight.T + 0.1) if classes is None else (matrix @ weight.T + 0.1)[:, 2]
    assert np.allclose(whole, expected, rtol=1e-12, atol=1e-12)
