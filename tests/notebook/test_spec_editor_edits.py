"""SpecEditor's edits section: drive the widgets as a user would, then hold what the
editor exports and what it says to the spec loader's and registration's own answers."""

from __future__ import annotations

import html
import random
from pathlib import Path

import pytest
import yaml
from spec_files import SHIPPED, SPEC_FILES

from undercurrent import ProbedModel
from undercurrent.adapters.capabilities import Capabilities
from undercurrent.notebook import SpecEditor
from undercurrent.spec import (
    Edit,
    EditTrigger,
    SaeFeature,
    SpecValidationError,
    load_yaml_file,
    parse_yaml,
)

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "specs"
POINT = """\
  - name: guard
    layers: 1
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: norm_probe
    probe_kind: single_shot
"""


def _loader_message(edit_yaml: str, field: str, points: str = POINT) -> str:
    """What the spec loader says about ``field`` of the one edit in a hand-written file."""
    text = f'version: "2"\nextraction_points:\n{points}edits:\n{edit_yaml}'
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml(text)
    found = [p for p in caught.value.problems if p.section == "edits" and p.field == field]
    assert len(found) == 1, caught.value.problems
    return found[0].message


def _edit_error(editor: SpecEditor, field: str) -> str:
    return html.unescape(editor.edit_errors[field].value)


def _with_guard(model: object = 4) -> SpecEditor:
    """An editor whose one point is the inline ``guard`` at layer 1, and one new edit."""
    editor = SpecEditor(model=model)
    editor.fields["name"].value = "guard"
    editor.fields["layers"].value = (1,)
    editor.fields["position"].value = "generated[*]"
    editor.add_edit()
    return editor


def test_an_edit_built_in_the_form_exports_yaml_the_loader_reads_as_that_edit():
    editor = _with_guard()
    f = editor.edit_fields
    f["name"].value = "away"
    f["layers"].value = (2, 3)
    f["tensor_type"].value = "mlp_out"
    f["position"].value = "generated[2:]"
    f["stride"].value = 2
    f["op"].value = "add"
    f["vector"].value = "0.5, -1, 2"
    f["coefficient"].value = "-3.5"
    f["norm_match"].value = True
    f["when_point"].value = "guard"
    f["when_action"].value = "abort"
    assert editor.valid, editor.problems
    spec = parse_yaml(editor.to_yaml())
    assert spec.version == "2"
    assert spec.edits == (Edit(
        name="away", layers=(2, 3), tensor_type="mlp_out", position="generated[2:]", stride=2,
        op="add", vector=(0.5, -1.0, 2.0), coefficient=-3.5, norm_match=True,
        when=EditTrigger("guard", "abort"),
    ),)
    assert spec == editor.spec
    assert yaml.safe_load(editor.to_yaml())["edits"][0]["when"] == {"point": "guard",
                                                                     "action": "abort"}


def test_vector_text_is_a_file_path_or_an_sae_feature_and_vector_key_only_for_files():
    editor = _with_guard()
    f = editor.edit_fields
    f["vector"].value = "1, 2"
    assert editor.edit_rows["vector_key"].layout.display == "none"
    f["vector"].value = "undercurrent:models/tiny/probe.safetensors"
    assert editor.edit_rows["vector_key"].layout.display != "none"
    f["vector_key"].value = "weight"
    f["op"].value = "project_out"
    edit = parse_yaml(editor.to_yaml()).edits[0]
    assert (edit.vector, edit.vector_key, edit.op.value) == (
        "undercurrent:models/tiny/probe.safetensors", "weight", "project_out")
    f["vector"].value = '{sae: "undercurrent:models/tiny/sae", feature: 2}'
    f["op"].value = "clamp"
    edit = parse_yaml(editor.to_yaml()).edits[0]
    assert edit.vector == SaeFeature("undercurrent:models/tiny/sae", 2)
    assert edit.vector_key is None  # hidden, so not written


@pytest.mark.parametrize(
    ("vector", "refused"),
    [
        ("{sae: x, feature: 010}", "leading zero, which YAML 1.1 reads as the octal number 8"),
        ("{sae: x, sae: y, feature: 1}", "found duplicate key 'sae'"),
    ],
)
def test_an_sae_feature_the_loader_refuses_in_a_file_is_refused_with_its_message(
        vector, refused):
    editor = _with_guard()
    editor.edit_fields["vector"].value = vector
    assert not editor.valid
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml('version: "2"\nextraction_points: []\nedits:\n  - {name: e, layers: 1, '
                   f"tensor_type: residual_stream, position: 'generated[*]', vector: {vector}}}\n")
    (problem,) = caught.value.problems
    # (the same words; the line and column differ: the form's text is a one-line document)
    assert refused in problem.message
    assert refused in _edit_error(editor, "vector")


def test_fields_appear_only_when_they_apply():
    editor = _with_guard()
    shown = {field: row.layout.display != "none" for field, row in editor.edit_rows.items()}
    assert shown["norm_match"] and not shown["when_action"] and not shown["vector_key"]
    assert shown["stride"]  # generated[*] is continuous
    editor.edit_fields["op"].value = "scale"
    editor.edit_fields["position"].value = "prompt[-1]"
    editor.edit_fields["when_point"].value = "guard"
    shown = {field: row.layout.display != "none" for field, row in editor.edit_rows.items()}
    assert not shown["norm_match"] and not shown["stride"] and shown["when_action"]


@pytest.mark.parametrize(
    ("field", "value", "edit_yaml"),
    [
        ("coefficient", "abc",
         "  - {name: e, layers: 1, tensor_type: residual_stream, position: 'generated[*]',"
         " op: add, vector: [1.0], coefficient: abc}\n"),
        ("vector", "", "  - {name: e, layers: 1, tensor_type: residual_stream,"
                       " position: 'generated[*]', op: add, vector: ''}\n"),
        ("vector", "1, nan", "  - {name: e, layers: 1, tensor_type: residual_stream,"
                             " position: 'generated[*]', op: add, vector: [1, .nan]}\n"),
        ("vector", "steer.pt", "  - {name: e, layers: 1, tensor_type: residual_stream,"
                               " position: 'generated[*]', op: add, vector: steer.pt}\n"),
        # Arabic-Indic digits: float() reads "١" as 1.0, the loader reads text
        ("coefficient", "\u0661", "  - {name: e, layers: 1, tensor_type: residual_stream,"
                                   " position: 'generated[*]', op: add, vector: [1.0],"
                                   " coefficient: \u0661}\n"),
        ("vector", "\u0661, \u0662", "  - {name: e, layers: 1, tensor_type: residual_stream,"
                                      " position: 'generated[*]', op: add,"
                                      " vector: '\u0661, \u0662'}\n"),
        ("position", "generated[-1]",
         "  - {name: e, layers: 1, tensor_type: residual_stream, position: 'generated[-1]',"
         " op: add, vector: [1.0]}\n"),
    ],
)
def test_a_bad_field_shows_the_loaders_message_next_to_it(field, value, edit_yaml):
    editor = _with_guard()
    editor.edit_fields["name"].value = "e"
    editor.edit_fields["vector"].value = "1"
    assert editor.valid, editor.problems
    editor.edit_fields[field].value = value
    assert not editor.valid
    assert _loader_message(edit_yaml, field) in _edit_error(editor, field)
    with pytest.raises(SpecValidationError, match=r"edits\[0\] \(name 'e'\)"):
        _ = editor.spec


def test_an_unknown_op_shows_the_loaders_message_on_op():
    editor = _with_guard()
    editor.edit_fields["name"].value = "e"
    editor.edit_fields["vector"].value = "1"
    editor.edit_drafts[0] = editor.edit_drafts[0].copy(op="shift")  # not in the dropdown
    editor.select_edit(0)
    assert editor.edit_fields["op"].value == "shift"
    expected = _loader_message(
        "  - {name: e, layers: 1, tensor_type: residual_stream, position: 'generated[*]',"
        " op: shift, vector: [1.0]}\n", "op")
    assert "expected one of: add, project_out, clamp, scale" in expected
    assert expected in _edit_error(editor, "op")


def test_when_naming_an_unknown_point_shows_the_loaders_message_on_when_point():
    editor = _with_guard()
    editor.edit_fields["name"].value = "e"
    editor.edit_fields["vector"].value = "1"
    editor.edit_fields["when_point"].value = "guard"
    assert editor.valid
    editor.fields["name"].value = "watch"  # the point the edit names is gone
    expected = _loader_message(
        "  - {name: e, layers: 1, tensor_type: residual_stream, position: 'generated[*]',"
        " op: add, vector: [1.0], when: {point: guard}}\n", "when.point",
        points=POINT.replace("name: guard", "name: watch"))
    assert expected in _edit_error(editor, "when_point")
    assert "⚠ when.point names no extraction point" in _edit_error(editor, "when_point")
    assert editor.edit_fields["when_point"].value == "guard"  # kept, so the user sees it
    assert editor.edit_list.options[0][0].startswith("⚠ ")
    assert not editor.point_list.options[0][0].startswith("⚠ ")  # the point is fine


def test_when_offers_the_inline_points_and_an_async_trigger_gets_the_loaders_message():
    editor = _with_guard()
    editor.add_point()
    editor.fields["name"].value = "observer"
    editor.fields["position"].value = "generated[*]"
    editor.fields["probe_type"].value = "trajectory_probe"
    editor.fields["probe_kind"].value = "trajectory"
    editor.fields["execution_mode"].value = "async"
    offered = [value for _, value in editor.edit_fields["when_point"].options]
    assert offered == ["", "guard"]
    editor.fields["execution_mode"].value = "inline"
    editor.edit_fields["vector"].value = "1"
    editor.edit_fields["when_point"].value = "observer"
    editor.select(1)
    editor.fields["execution_mode"].value = "async"
    message = _edit_error(editor, "when_point")
    assert "runs async" in message and "make it execution_mode: inline" in message


def test_after_its_trigger_is_renamed_picking_the_new_name_from_the_dropdown_repairs_the_edit():
    editor = _with_guard()
    editor.edit_fields["vector"].value = "1"
    editor.edit_fields["when_point"].value = "guard"
    editor.fields["name"].value = "watch"
    dropdown = editor.edit_fields["when_point"]
    # Every choice is shown by its name, the stale one kept so the user sees it.
    assert dropdown.options == (("(always on)", ""), ("watch", "watch"), ("guard", "guard"))
    assert not editor.valid
    dropdown.index = 1  # what the browser sends: the index of "watch"
    assert editor.edit_drafts[0].when_point == "watch"
    assert editor.valid, editor.problems
    assert yaml.safe_load(editor.to_yaml())["edits"][0]["when"] == {"point": "watch",
                                                                     "action": "flag"}
    assert dropdown.options == (("(always on)", ""), ("watch", "watch"))


@pytest.mark.parametrize("breakage", ["removed", "made async"])
def test_after_its_trigger_is_removed_or_made_async_always_on_can_be_picked(breakage):
    editor = _with_guard()
    editor.edit_fields["vector"].value = "1"
    editor.edit_fields["when_point"].value = "guard"
    if breakage == "removed":
        editor.add_point()
        editor.select("guard")
        editor.remove_point()
    else:
        editor.fields["probe_type"].value = "trajectory_probe"
        editor.fields["probe_kind"].value = "trajectory"
        editor.fields["execution_mode"].value = "async"
    dropdown = editor.edit_fields["when_point"]
    assert dropdown.options[-1] == ("guard", "guard")
    assert not editor.valid
    dropdown.index = 0  # "(always on)"
    assert editor.edit_drafts[0].when_point == ""
    assert editor.valid, editor.problems
    assert "when" not in yaml.safe_load(editor.to_yaml())["edits"][0]


def test_a_version_1_spec_gaining_an_edit_becomes_version_2_and_back():
    original = load_yaml_file(SPECS / "classic_single_token.yaml")
    assert original.version == "1"
    editor = SpecEditor.from_spec(original)
    assert 'version "1"' in editor.edits_hint.value
    editor.add_edit()
    editor.edit_fields["vector"].value = "1, 0"
    assert editor.spec.version == "2" and yaml.safe_load(editor.to_yaml())["version"] == "2"
    assert 'version "2"' in editor.edits_hint.value and 'version "2"' in editor.status.value
    assert parse_yaml(editor.to_yaml()) == editor.spec
    # The same document marked version "1" is what the loader refuses:
    data = yaml.safe_load(editor.to_yaml())
    data["version"] = "1"
    with pytest.raises(SpecValidationError, match='edits need version: "2"'):
        parse_yaml(yaml.safe_dump(data))
    editor.remove_edit()
    assert editor.spec == original and editor.spec.version == "1"


def test_names_are_unique_across_points_and_edits():
    editor = _with_guard()
    editor.edit_fields["vector"].value = "1"
    editor.add_edit()
    editor.edit_fields["vector"].value = "1"
    names = [d.name for d in (*editor.drafts, *editor.edit_drafts)]
    assert len(set(names)) == len(names)
    editor.duplicate_edit()
    assert editor.edit_drafts[-1].name.endswith("_copy")
    assert editor.valid
    editor.edit_fields["name"].value = "guard"
    assert "names must be unique across extraction points and edits" in _edit_error(
        editor, "name")


def test_with_a_model_layers_are_bounded_and_out_of_range_layers_are_reported():
    spec = load_yaml_file(SHIPPED / "demo_steer.yaml")
    editor = SpecEditor.from_spec(spec, model=Capabilities.standard("hf", "llama", 2))
    assert not editor.valid
    assert "out of range" in _edit_error(editor, "layers")
    assert [value for _, value in editor.edit_fields["layers"].options] == [0, 1, 2]
    offered = editor.edit_fields["tensor_type"].options
    assert list(offered) == ["residual_stream", "attn_out", "mlp_out"]


@pytest.fixture(scope="module")
def tiny_model():
    with ProbedModel.from_pretrained("undercurrent/tiny") as model:
        yield model


def test_with_the_bundled_model_a_vector_of_the_wrong_size_gets_registrations_message(
        tiny_model):
    editor = SpecEditor.from_spec(SHIPPED / "demo_steer.yaml", model=tiny_model)
    assert editor.valid, editor.problems  # the probe file's direction has the hidden size
    editor.edit_fields["vector"].value = "1, 2, 3"
    assert not editor.valid
    data = yaml.safe_load((SHIPPED / "demo_steer.yaml").read_text())
    data["edits"][0]["vector"] = [1, 2, 3]
    with pytest.raises(SpecValidationError) as caught:
        ProbedModel.from_pretrained("undercurrent/tiny", spec=data)
    expected = [p.message for p in caught.value.problems if p.field == "vector"]
    assert expected and expected[0] in _edit_error(editor, "vector")
    assert "hidden size is 128" in _edit_error(editor, "vector")
    editor.edit_fields["vector"].value = ", ".join(["0.5"] * 128)
    assert editor.valid, editor.problems


def _example_specs_with_edits() -> list[Path]:
    return [path for path in SPEC_FILES if load_yaml_file(path).edits]


@pytest.mark.parametrize("path", _example_specs_with_edits(), ids=lambda p: p.name)
def test_example_specs_with_edits_round_trip_exactly(path, tmp_path):
    name = path.name
    original = load_yaml_file(path)
    editor = SpecEditor.from_spec(path)
    assert editor.valid, editor.problems
    assert editor.spec == original
    assert parse_yaml(editor.to_yaml()) == original
    assert load_yaml_file(editor.save(tmp_path / name)) == original


def test_every_edit_field_round_trips_and_touching_the_controls_changes_nothing():
    rng = random.Random(6)
    direction = [rng.uniform(-1, 1) / 3 for _ in range(64)]  # floats with long decimals
    text = f"""\
version: "2"
extraction_points:
{POINT}  - name: observer
    layers: 2
    tensor_type: mlp_out
    position: "generated[*]"
    probe_type: trajectory_probe
    probe_kind: trajectory
    execution_mode: async
edits:
  - name: steer
    layers: [1, 3]
    tensor_type: residual_stream
    position: "generated[1:]"
    stride: 3
    op: add
    vector: {direction}
    coefficient: -8.25
    norm_match: true
    when: {{point: guard, action: abort}}
  - name: from_file
    layers: 0
    tensor_type: attn_out
    position: "prompt[-1]"
    op: project_out
    vector: "undercurrent:models/tiny/probe.safetensors"
    vector_key: weight
  - name: feature
    layers: 3
    tensor_type: residual_stream
    position: 5
    op: clamp
    vector: {{sae: "undercurrent:models/tiny/sae", feature: 2}}
    coefficient: 0.0
"""
    original = parse_yaml(text)
    editor = SpecEditor.from_spec(text)
    assert editor.spec == original
    for index in range(len(original.edits)):
        editor.select_edit(index)
        for control in editor.edit_fields.values():
            control.value = control.value  # a no-op change, as a click that changes nothing
        editor.edit_fields["vector"].value = " " + editor.edit_fields["vector"].value + " "
    assert editor.valid, editor.problems
    assert editor.spec == original
    assert parse_yaml(editor.to_yaml()) == original
    assert editor.spec.edits[0].vector == tuple(direction)  # every float exact


def test_the_static_snapshot_shows_the_selected_edit():
    editor = SpecEditor.from_spec(SHIPPED / "demo_steer.yaml")
    snapshot = editor._repr_mimebundle_()["text/html"]
    assert "<b>edits:</b> away_from_harm" in snapshot
    assert "<code>when.point</code>" not in snapshot and ">when.point</td>" in snapshot
    assert "<code>harm_guard</code>" in snapshot and "<code>-10.0</code>" in snapshot
    assert "1 edit (version" in snapshot
    plain = SpecEditor(model=2)._repr_mimebundle_()["text/html"]
    assert "<b>edits:</b>" not in plain


def test_a_spec_of_edits_only_stays_without_points():
    text = """\
version: "2"
extraction_points: []
edits:
  - {name: e, layers: 0, tensor_type: mlp_out, position: 0, op: scale, vector: [1, 1]}
"""
    editor = SpecEditor.from_spec(text)
    assert editor.drafts == [] and editor.spec == parse_yaml(text)
    assert all(row.layout.display == "none" for row in editor.rows.values())


def test_vectors_are_resolved_again_only_when_the_edits_change():
    from undercurrent.steering import register_vector_source, unregister_vector_source

    reads: list[str] = []

    def counting_source(edit):
        if edit.vector != "counted.npz":
            return None
        reads.append(edit.name)
        return [1.0, 0.0]

    register_vector_source("counted", counting_source)
    try:
        editor = _with_guard(Capabilities.standard("hf", "llama", 4, hidden_size=2))
        editor.edit_fields["vector"].value = "counted.npz"
        assert editor.valid, editor.problems
        before = len(reads)
        assert before >= 1
        for name in ("g", "gu", "guard"):
            editor.fields["name"].value = name  # a point changes, the edits do not
        assert len(reads) == before
        editor.edit_fields["coefficient"].value = "2"
        assert len(reads) == before + 1 and editor.valid
    finally:
        unregister_vector_source("counted")
