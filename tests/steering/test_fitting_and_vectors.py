"""Steering vectors: difference of means fitted on captured frames, the direction of
a linear probe file, vector files, and the closed loop on the bundled model."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pandas")

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.demo import DEMO_REQUESTS  # noqa: E402
from undercurrent.models.corpus import chat_prompt  # noqa: E402
from undercurrent.notebook import records_frame, signals_frame  # noqa: E402
from undercurrent.probes.weights import load_linear_weights  # noqa: E402
from undercurrent.spec import Edit, SpecValidationError  # noqa: E402
from undercurrent.steering import (  # noqa: E402
    edits_frame,
    fit_steering_vector,
    probe_direction,
    register_vector_source,
    resolve_edit,
    unregister_vector_source,
)

PROBE = "undercurrent:models/tiny/probe.safetensors"
PROMPTS = [chat_prompt(request) for request, _ in DEMO_REQUESTS]
LABELS = [label for _, label in DEMO_REQUESTS]
CAPTURE = {"name": "resid3", "layers": 3, "tensor_type": "residual_stream",
           "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "single_shot"}


def vector_edit(vector, **fields) -> Edit:
    base = {"name": "v", "layers": 3, "tensor_type": "residual_stream",
            "position": "generated[*]", "op": "add", "vector": vector}
    return Edit(**{**base, **fields})


def test_difference_of_means_on_an_array_and_its_options() -> None:
    X = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    sv = fit_steering_vector(X, ["harmful", "harmful", "benign", "benign"])
    assert sv.vector.tolist() == [2.0, -3.0] and sv.positive == "harmful"
    assert sv.counts == {"harmful": 2, "benign": 2}
    flipped = fit_steering_vector(X, [1, 1, 0, 0], positive=0, normalize=True)
    np.testing.assert_allclose(flipped.vector, np.array([-2.0, 3.0]) / np.sqrt(13))
    with pytest.raises(ValueError, match="exactly two"):
        fit_steering_vector(X, [0, 1, 2, 2])
    with pytest.raises(ValueError, match="one label per row"):
        fit_steering_vector(X, [0, 1])


def test_normalize_must_be_a_bool_and_a_refused_save_makes_no_folder(tmp_path) -> None:
    # (normalize="no" was taken as True; save("newdir/x.txt") made newdir first)
    X = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    with pytest.raises(TypeError, match=r"fit_steering_vector: normalize must be True or "
                                        r"False, got str \('no'\)"):
        fit_steering_vector(X, [1, 1, 0, 0], normalize="no")
    with pytest.raises(TypeError, match=r"probe_direction: normalize must be True or False"):
        probe_direction(PROBE, normalize="no")
    assert np.linalg.norm(probe_direction(PROBE, normalize=np.bool_(False))) > 1.0 + 1e-6
    target = tmp_path / "newdir" / "x.txt"
    with pytest.raises(ValueError, match="use a .safetensors or .npz suffix"):
        fit_steering_vector(X, [1, 1, 0, 0]).save(target)
    assert not target.parent.exists()
    saved = fit_steering_vector(X, [1, 1, 0, 0]).save(tmp_path / "newdir" / "x.npz")
    assert np.load(saved)["vector"].tolist() == [2.0, -3.0]


def test_a_bfloat16_tensor_gives_the_difference_of_its_values_means() -> None:
    # numpy refused the tensor ("Got unsupported ScalarType BFloat16")
    X = torch.tensor([[1.0, 0.5], [3.0, 0.0], [0.0, 2.0], [0.25, 4.0]], dtype=torch.bfloat16)
    sv = fit_steering_vector(X, [1, 1, 0, 0])
    assert sv.vector.dtype == np.float64 and sv.vector.tolist() == [1.875, -2.75]


def test_an_edit_takes_a_numpy_layer_and_names_a_wrong_op() -> None:
    # edit() failed with "'numpy.int64' object is not iterable" on the layer
    # np.argmax gives, and a misspelled op with a bare enum ValueError.
    X = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    best = np.argmax([0.1, 0.5, 0.9, 0.2])
    assert fit_steering_vector(X, [1, 1, 0, 0], layer=best).edit("e").layers == (2,)
    sv = fit_steering_vector(X, [1, 1, 0, 0], layer=1)
    assert sv.edit("e", layers=np.int64(3)).layers == (3,)
    assert sv.edit("e", layers=range(2)).layers == (0, 1)
    with pytest.raises(SpecValidationError, match=r"name 'e'\), field 'op': 'addd' is not "
                                                  r"allowed; .*did you mean 'add'"):
        sv.edit("e", op="addd")
    with pytest.raises(SpecValidationError, match=r"field 'layers': must be a layer index"):
        sv.edit("e", layers=2.5)


@pytest.fixture(scope="module")
def captured():
    probed = ProbedModel.from_pretrained("undercurrent/tiny",
                                         spec={"extraction_points": [CAPTURE]})
    outputs = probed.generate(PROMPTS, max_new_tokens=16, records=True)
    yield probed, outputs
    probed.close()


def test_fit_from_captured_frames_then_steer_moves_the_same_site_by_exactly_c_v(captured):
    probed, outputs = captured
    frame = records_frame(outputs)
    labels = {output.request_id: label for output, label in zip(outputs, LABELS, strict=True)}
    sv = fit_steering_vector(frame, labels, normalize=False)
    # Oracle: the class means computed here from the records themselves.
    rows = {"harmful": [], "benign": []}
    for output, label in zip(outputs, LABELS, strict=True):
        rows[label] += [r.tensor.double().numpy() for r in output.records]
    expected = np.mean(rows["harmful"], axis=0) - np.mean(rows["benign"], axis=0)
    np.testing.assert_allclose(sv.vector, expected, rtol=1e-6, atol=1e-6)
    assert sv.layer == 3 and sv.tensor_type == "residual_stream"
    unit = fit_steering_vector(frame, labels, normalize=True)
    assert unit.norm == pytest.approx(1.0)

    steered = probed.generate(PROMPTS, max_new_tokens=16, records=True,
                              edits=[sv.edit("away", coefficient=-2.0)])
    for plain, edited in zip(outputs, steered, strict=True):
        # Generated token 0 is fed with the same past, so the only change at layer 3
        # is the edit itself.
        before = plain.records[0].tensor.double().numpy()
        after = edited.records[0].tensor.double().numpy()
        np.testing.assert_allclose(after - before, -2.0 * sv.vector, atol=1e-4)
        assert edited.records[0].edits == ("away",)
    # The projection on the fitted direction drops for every request.
    direction = unit.vector
    for plain, edited in zip(outputs, steered, strict=True):
        mean_plain = np.mean([r.tensor.double().numpy() @ direction for r in plain.records])
        mean_edited = np.mean([r.tensor.double().numpy() @ direction for r in edited.records])
        assert mean_edited < mean_plain - 1.0


def test_a_linear_probe_file_means_its_weight_direction_end_to_end(tiny_guard) -> None:
    weights = load_linear_weights(PROBE)
    resolved = resolve_edit(vector_edit(PROBE), hidden_size=128)
    np.testing.assert_array_equal(resolved.vector, weights.weight)
    np.testing.assert_allclose(probe_direction(PROBE), resolved.unit)
    # Projecting the probe's own direction out where the guard reads leaves it only
    # its bias: every score on an edited token is sigmoid(bias).
    outputs = tiny_guard.generate(PROMPTS[:2], max_new_tokens=12,
                                  edits=[vector_edit(PROBE, op="project_out")])
    bias_only = 1.0 / (1.0 + np.exp(-float(weights.bias)))
    for output in outputs:
        scores = [s.score for s in output.signals]
        assert scores and all(s == pytest.approx(bias_only, abs=1e-5) for s in scores)
        assert output.edited_tokens == tuple(range(len(output.token_ids) - 1))


@pytest.fixture(scope="module")
def tiny_guard():
    guard = {**CAPTURE, "name": "harm_guard", "probe_type": "linear_probe",
             "probe_args": {"path": PROBE, "action": "flag"}}
    probed = ProbedModel.from_pretrained("undercurrent/tiny",
                                         spec={"extraction_points": [guard]})
    yield probed
    probed.close()


def test_vector_files_keys_and_errors(tmp_path) -> None:
    sv = fit_steering_vector(np.eye(4)[:2] * 3, [1, 0])
    for suffix in (".safetensors", ".npz"):
        path = sv.save(tmp_path / f"dir{suffix}")
        resolved = resolve_edit(vector_edit(str(path)), hidden_size=4)
        np.testing.assert_array_equal(resolved.vector, sv.vector.astype(np.float32))
    np.savez(tmp_path / "two.npz", a=np.ones(4), b=np.arange(4.0) + 1)
    picked = resolve_edit(vector_edit(str(tmp_path / "two.npz"), vector_key="b"), 4)
    assert picked.vector.tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(SpecValidationError, match="field 'vector'.*vector_key"):
        resolve_edit(vector_edit(str(tmp_path / "two.npz")), 4)
    with pytest.raises(SpecValidationError, match="vector_key 'c' is not in"):
        resolve_edit(vector_edit(str(tmp_path / "two.npz"), vector_key="c"), 4)
    with pytest.raises(SpecValidationError, match=r"edits\[0\] \(name 'v'\), field 'vector'.*"
                                                  "does not exist"):
        resolve_edit(vector_edit(str(tmp_path / "missing.npz")), 4)


def test_a_vector_file_of_strings_or_without_a_1d_array_is_refused_saying_so(tmp_path) -> None:
    # (strings were a bare numpy "could not convert string to float"; a 2-D array
    # alone read "holds 0 1-D arrays (v); name one with vector_key", and vector_key='v'
    # was then refused for its shape)
    np.savez(tmp_path / "text.npz", v=np.array(["a"] * 4))
    with pytest.raises(SpecValidationError, match=r"edits\[0\] \(name 'v'\), field 'vector': "
                                                  r".*text\.npz gives values that are not "
                                                  r"numbers \(str32: could not convert"):
        resolve_edit(vector_edit(str(tmp_path / "text.npz")), 4)
    np.savez(tmp_path / "flat.npz", m=np.ones((2, 4)), t=np.ones((1, 2, 4)))
    with pytest.raises(SpecValidationError, match=r"flat\.npz' holds no 1-D array \(m \(2, "
                                                  r"4\), t \(1, 2, 4\)\); an edit's vector "
                                                  r"file holds a 1-D array of the model's "
                                                  r"hidden size"):
        resolve_edit(vector_edit(str(tmp_path / "flat.npz")), 4)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_a_linear_probe_file_with_a_weight_row_per_class_is_read_as_a_probe(tmp_path, rows):
    # The bias was the file's one 1-D array, so it was taken for the vector: a binary
    # probe saved with sklearn's shapes ((1, H) and (1,)) was refused for its bias's
    # size, and a 4-class probe on a hidden-4 model steered along its bias silently.
    from undercurrent.probes.weights import save_linear_weights

    path = tmp_path / "probe.safetensors"
    weight = np.arange(1.0, 4.0 * rows + 1).reshape(rows, 4)
    save_linear_weights(path, weight, np.full(rows, 0.5))
    if rows == 1:
        resolved = resolve_edit(vector_edit(str(path)), hidden_size=4)
        assert resolved.vector.tolist() == probe_direction(path, normalize=False).tolist()
        assert resolved.vector.tolist() == [1.0, 2.0, 3.0, 4.0]
        return
    with pytest.raises(SpecValidationError, match=rf"is a {rows}-class linear probe; its "
                                                  "weight has one row per class"):
        resolve_edit(vector_edit(str(path)), hidden_size=4)


def test_a_bfloat16_vector_file_is_read_beside_float32_arrays(tmp_path) -> None:
    """A vector saved from a bfloat16 model: numpy has no bfloat16, so the file is read
    through torch and widened (it was refused as 'not a valid safetensors file')."""
    from safetensors.torch import save_file

    vector = torch.tensor([0.1, -2.5, 3.0, 1e-3]).to(torch.bfloat16)
    path = tmp_path / "steer_bf16.safetensors"
    save_file({"steer": vector, "other": torch.ones(4)}, str(path))
    resolved = resolve_edit(vector_edit(str(path), vector_key="steer"), hidden_size=4)
    assert resolved.vector.tolist() == vector.double().tolist()


def test_a_new_vector_source_plugs_in_before_the_built_in_ones() -> None:
    def feature_rows(edit):
        if isinstance(edit.vector, str) and edit.vector.startswith("features:"):
            return np.arange(4.0) + 1.0
        return None

    register_vector_source("features", feature_rows)
    try:
        resolved = resolve_edit(vector_edit("features:dictionary.npz", vector_key="row 7"), 4)
        assert resolved.source == "features" and resolved.vector.tolist() == [1, 2, 3, 4]
        assert resolve_edit(vector_edit([1.0, 0, 0, 0]), 4).source == "list"
    finally:
        unregister_vector_source("features")


def test_a_vector_source_is_checked_at_registration_and_named_when_it_fails(
        tiny_guard) -> None:
    # A string was registered, then every edit failed with "'str' object is not
    # callable"; a source's own bug did not say which source it was.
    with pytest.raises(TypeError, match=r"^register_vector_source\('mine', source\): source "
                                        r"must be a function .*got str"):
        register_vector_source("mine", "not a function")
    with pytest.raises(TypeError, match="name must be a non-empty string, got int"):
        register_vector_source(3, lambda edit: None)

    def broken(edit):
        return edit.vector["row"]  # a TypeError on a list

    def refusing(edit):
        raise ValueError("row 9 is not in the table")

    register_vector_source("broken", broken)
    try:
        with pytest.raises(RuntimeError, match=r"^vector source 'broken' "
                                               r"\(register_vector_source\) raised TypeError "
                                               r"resolving edit 'v': ") as caught:
            tiny_guard.generate(PROMPTS[:1], max_new_tokens=2,
                                edits=[vector_edit([1.0] * 128)])
        assert isinstance(caught.value.__cause__, TypeError)
        register_vector_source("broken", refusing)
        with pytest.raises(SpecValidationError, match=r"name 'v'\), field 'vector': row 9 is "
                                                      r"not in the table \(vector source "
                                                      r"'broken'\)"):
            tiny_guard.generate(PROMPTS[:1], max_new_tokens=2,
                                edits=[vector_edit([1.0] * 128)])
    finally:
        unregister_vector_source("broken")
    assert tiny_guard.generate(PROMPTS[:1], max_new_tokens=2,
                               edits=[vector_edit([1.0] * 128)])[0].edited_tokens


def test_edits_frame_joins_signals_and_records(tiny_guard) -> None:
    outputs = tiny_guard.generate(PROMPTS[:2], max_new_tokens=8, records=True,
                                  prompt_edits=[[vector_edit(PROBE, coefficient=-1.0)], None])
    frame = edits_frame(outputs)
    assert set(frame["request"]) == {outputs[0].request_id}
    joined = signals_frame(outputs).merge(frame, on=["request", "token_index"], how="left")
    steered = joined[joined["edit"].notna()]
    assert len(steered) == len(outputs[0].edits) and (steered["edit"] == "v").all()
    records = records_frame(outputs).merge(frame, on=["request", "token_index", "layer",
                                                      "tensor_type"], how="left")
    assert records["edit"].notna().sum() == len(outputs[0].edits)


def test_the_bundled_guard_switches_steering_on_instead_of_aborting() -> None:
    """Closed loop on the bundled model: the guard flags (not aborts) and switches on
    an edit against its own harm direction, from the next pass, for that request."""
    guard = {**CAPTURE, "name": "harm_guard", "probe_type": "linear_probe",
             "probe_args": {"path": PROBE, "action": "flag"}}
    away = {"name": "away_from_harm", "layers": 2, "tensor_type": "residual_stream",
            "position": "generated[*]", "op": "add", "vector": PROBE, "coefficient": -10.0,
            "when": {"point": "harm_guard", "action": "flag"}}
    spec = {"version": "2", "extraction_points": [guard], "edits": [away]}
    unsteered = {"version": "1", "extraction_points": [guard]}
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as probed, \
            ProbedModel.from_pretrained("undercurrent/tiny", spec=unsteered) as plain:
        steered = probed.generate(PROMPTS, max_new_tokens=40)
        reference = plain.generate(PROMPTS, max_new_tokens=40)
    for output, before, label in zip(steered, reference, LABELS, strict=True):
        assert not output.aborted
        if label == "benign":
            assert output.edits == () and output.token_ids == before.token_ids
            continue
        first_flag = min(s.generated_index for s in output.signals
                         if s.action.value == "flag")
        assert output.edited_tokens[0] == first_flag + 1
        assert output.steered_tokens[0] == first_flag + 2
        assert output.token_ids[:first_flag + 2] == before.token_ids[:first_flag + 2]
        assert output.text != before.text
        assert output.text.endswith(("have a nice day", "have a nice"))
        # The guard reads layer 3, above the edit: the edit removes the very direction
        # it scores, so its live scores collapse once the edit is on.
        after = [s.score for s in output.signals if s.generated_index > first_flag + 1]
        assert max(after) < 0.05


def test_non_finite_activations_and_missing_labels_are_refused_not_averaged() -> None:
    X = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    with_nan = X.copy()
    with_nan[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"^fit_steering_vector: 1 activation row of 4 holds "
                       r"NaN or infinity: row 2; "):
        fit_steering_vector(with_nan, [1, 1, 0, 0], normalize=True)
    with pytest.raises(ValueError, match=r"^fit_steering_vector: 1 row has no label \(None or "
                       r"NaN\): row 3; "):
        fit_steering_vector(X, ["harmful", "harmful", "benign", None])
    from undercurrent.records import ActivationRecord

    records = [ActivationRecord(f"r{r}", "pt", 0, "residual_stream", 5 + t, True, t, 7,
                                torch.full((2,), float(r))) for r in range(4) for t in range(2)]
    labels = {"r0": "benign", "r1": float("nan"), "r2": "harmful", "r3": "harmful"}
    with pytest.raises(ValueError, match=r"^fit_steering_vector: 2 rows have no label .*"
                       r"request\(s\) \['r1'\]"):
        fit_steering_vector(records_frame(records), labels)


def test_a_vector_saved_under_home_is_written_there(home):
    """SteeringVector.save("~/v.safetensors") wrote ./~/v.safetensors, which an
    edit's vector: "~/v.safetensors" (read with "~" expanded) does not name."""
    from undercurrent.probes.weights import read_array_file
    from undercurrent.steering import SteeringVector

    vector = SteeringVector(vector=np.ones(4), positive=None, negative=None, layer=1,
                            tensor_type="residual_stream")
    assert vector.save("~/v.safetensors") == home / "v.safetensors"
    arrays, _ = read_array_file("~/v.safetensors")
    np.testing.assert_array_equal(arrays["vector"], np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError, match="SteeringVector.save: path is an empty path; give"):
        vector.save("")
