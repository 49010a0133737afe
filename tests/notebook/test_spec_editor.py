"""SpecEditor: set widget values as a user would, check the YAML, the errors and the spec."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
import yaml
from spec_files import SPEC_FILES

from undercurrent.adapters.capabilities import Capabilities
from undercurrent.notebook import SpecEditor
from undercurrent.spec import SpecValidationError, load_yaml_file, parse_dict, parse_yaml

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _shown(editor: SpecEditor, field: str) -> bool:
    return editor.rows[field].layout.display != "none"


def test_new_editor_with_a_model_starts_valid_on_its_last_layer():
    editor = SpecEditor(model=4)
    assert editor.valid
    point = editor.spec[0]
    assert point.layers == (3,) and point.tensor_type.value == "residual_stream"
    assert parse_yaml(editor.to_yaml()) == editor.spec


def test_changing_a_field_changes_the_yaml_view_and_the_spec():
    editor = SpecEditor(model=4)
    before = editor.yaml_view.value
    editor.fields["name"].value = "harm_watch"
    editor.fields["layers"].value = (1, 2)
    editor.fields["tensor_type"].value = "mlp_out"
    assert editor.yaml_view.value != before
    assert "harm_watch" in editor.yaml_view.value
    data = yaml.safe_load(editor.to_yaml())
    assert data["extraction_points"][0] == {
        "name": "harm_watch", "layers": [1, 2], "tensor_type": "mlp_out",
        "position": "prompt[-1]", "probe_type": "norm_probe", "probe_kind": "single_shot",
    }


def test_invalid_position_shows_the_parsers_message_next_to_the_field_and_never_raises():
    editor = SpecEditor(model=4)
    editor.fields["position"].value = "generated[*"
    assert "is not valid; expected an int N" in editor.errors["position"].value
    assert "generated[*]" in editor.errors["position"].value  # the accepted forms
    assert not editor.valid
    assert "not valid yet" in editor.yaml_view.value
    with pytest.raises(SpecValidationError, match="position"):
        _ = editor.spec
    editor.fields["position"].value = "generated[*]"
    assert editor.errors["position"].value == "" and editor.valid


@pytest.mark.parametrize("text", ["\u00b2", "\u0663", "\uff15"])
def test_a_position_of_other_digits_is_the_parsers_message_not_an_exception(text):
    # "²" passed str.isdigit and then int() raised out of the handler, leaving the
    # editor valid with the previous spec; "٣" became position 3.
    editor = SpecEditor(model=4)
    editor.fields["position"].value = text
    assert f"position {text!r} is not valid" in editor.errors["position"].value
    assert not editor.valid


def test_large_stride_and_timeout_survive_an_edit_and_bad_ones_get_the_loaders_message():
    # The controls were bounded (stride <= 1e6, timeout_ms <= 3.6e6): editing any
    # other field rewrote a loaded spec's larger values, and 0 became 1, silently.
    text = """version: "1"
extraction_points:
- {name: p, layers: [1, 2], tensor_type: residual_stream, position: "generated[*]",
   stride: 2000000, probe_type: norm_probe, probe_kind: trajectory,
   intervention: {mode: block_until_signal, timeout_ms: 5000000, on_timeout: abort}}
"""
    editor = SpecEditor.from_spec(text, model=4)
    editor.fields["name"].value = "q"
    (point,) = editor.spec
    assert (point.name, point.stride, point.intervention.timeout_ms) == ("q", 2_000_000,
                                                                         5_000_000)
    editor.fields["stride"].value = 0
    assert "stride must be >= 1, got 0" in editor.field_problems()["stride"][0]
    editor.fields["stride"].value = 3
    editor.fields["timeout_ms"].value = 0
    assert not editor.valid
    assert editor.field_problems()["timeout_ms"] == ["intervention.timeout_ms must be >= 1, got 0"]


def test_stride_and_until_appear_only_for_continuous_positions_and_vanish_from_the_yaml():
    editor = SpecEditor(model=4)
    assert not _shown(editor, "stride") and not _shown(editor, "until")
    editor.fields["position"].value = "generated[2:]"
    assert _shown(editor, "stride") and _shown(editor, "until")
    editor.fields["stride"].value = 3
    editor.fields["until"].value = "generation_end"
    assert editor.spec[0].stride == 3 and editor.spec[0].until.value == "generation_end"
    editor.fields["position"].value = "prompt[-1]"
    assert not _shown(editor, "stride")
    assert editor.valid and editor.spec[0].stride == 1 and editor.spec[0].until is None


def test_queue_depth_only_for_async_and_the_async_rules_show_on_their_fields():
    editor = SpecEditor(model=4)
    assert not _shown(editor, "queue_depth")
    editor.fields["execution_mode"].value = "async"
    assert _shown(editor, "queue_depth")
    assert "needs probe_kind 'trajectory'" in editor.errors["execution_mode"].value
    editor.fields["probe_kind"].value = "trajectory"
    editor.fields["queue_depth"].value = "eight"
    assert "not a whole number" in editor.errors["queue_depth"].value
    editor.fields["queue_depth"].value = "8"
    assert editor.valid and editor.spec[0].queue_depth == 8


def test_timeout_fields_only_under_block_until_signal():
    editor = SpecEditor(model=4)
    assert not _shown(editor, "timeout_ms") and not _shown(editor, "on_timeout")
    editor.fields["intervention_mode"].value = "reject"
    assert not _shown(editor, "timeout_ms")
    assert editor.spec[0].intervention.mode.value == "reject"
    editor.fields["intervention_mode"].value = "block_until_signal"
    assert _shown(editor, "timeout_ms") and _shown(editor, "on_timeout")
    editor.fields["timeout_ms"].value = 25
    editor.fields["on_timeout"].value = "abort"
    policy = editor.spec[0].intervention
    assert (policy.timeout_ms, policy.on_timeout.value) == (25, "abort")
    editor.fields["intervention_mode"].value = ""
    assert editor.spec[0].intervention is None


def test_block_until_signal_on_an_async_point_is_reported_on_the_intervention_field():
    editor = SpecEditor(model=4)
    editor.fields["probe_kind"].value = "trajectory"
    editor.fields["execution_mode"].value = "async"
    editor.fields["intervention_mode"].value = "block_until_signal"
    assert "not allowed with execution_mode 'async'" in editor.errors["intervention_mode"].value


def test_layer_picker_is_bounded_by_the_model_and_final_norm_sits_at_layer_n():
    editor = SpecEditor(model=3)
    assert [value for _, value in editor.fields["layers"].options] == [0, 1, 2]
    editor.fields["tensor_type"].value = "final_norm"
    labels = dict((v, k) for k, v in editor.fields["layers"].options)
    assert labels == {3: "3 (final norm)"}
    # The invalid selection moved to the one valid layer: the spec stays valid.
    assert editor.fields["layers"].value == (3,)
    assert editor.valid and editor.spec[0].layers == (3,)
    editor.fields["tensor_type"].value = "mlp_out"
    assert editor.fields["layers"].value == (2,) and editor.valid


def test_switching_tensor_type_keeps_the_layers_the_new_type_allows():
    caps = Capabilities.standard("hf", "llama", 4)
    editor = SpecEditor(model=caps)
    editor.fields["layers"].value = (1, 3)
    editor.fields["tensor_type"].value = "attn_out"
    assert editor.fields["layers"].value == (1, 3) and editor.valid


def test_tensor_types_offered_are_the_backends():
    caps = Capabilities.standard("hf", "llama", 2, tensor_types=("residual_stream", "mlp_out"))
    editor = SpecEditor(model=caps)
    assert list(editor.fields["tensor_type"].options) == ["residual_stream", "mlp_out"]


def test_without_a_model_layers_are_typed_and_checked():
    editor = SpecEditor()
    editor.fields["layers"].value = "0, 2,5"
    assert editor.spec[0].layers == (0, 2, 5)
    editor.fields["layers"].value = "0, two"
    assert "'two' is not a layer index" in editor.errors["layers"].value
    editor.fields["layers"].value = ""
    assert "layers is empty" in editor.errors["layers"].value


@pytest.mark.parametrize(("text", "expected"), [
    ("banana", "layers: 'banana' is not a layer index"),
    ("1,,2", "layers '1,,2' has an empty entry at place 2"),
    ("1,", "layers '1,' has an empty entry at place 2"),
    # digits to str.isdigit, but not layer indices to the loader (int("²") raised before)
    ("1, \u00b2", "layers: '\u00b2' is not a layer index"),
    ("\u0663", "layers: '\u0663' is not a layer index"),
])
def test_unreadable_layer_text_gets_one_message_with_its_subject(text, expected):
    editor = SpecEditor()
    editor.fields["layers"].value = text
    messages = editor.field_problems()["layers"]
    assert len(messages) == 1 and messages[0].startswith(expected)
    assert not editor.valid


def test_an_empty_layer_selection_is_reported_with_its_subject():
    editor = SpecEditor(model=4)
    editor.fields["layers"].value = ()
    assert editor.field_problems()["layers"][0].startswith("layers is an empty list")


@pytest.mark.parametrize(("text", "expected"), [
    ("-3", "queue_depth must be at least 1, got -3"),
    ("0", "queue_depth must be at least 1, got 0"),
    ("eight", "queue_depth 'eight' is not a whole number"),
    ("\u0661\u0666", "queue_depth '\u0661\u0666' is not a whole number"),  # (int() reads 16)
])
def test_queue_depth_messages_say_what_is_wrong(text, expected):
    editor = SpecEditor(model=4)
    editor.fields["probe_kind"].value = "trajectory"
    editor.fields["execution_mode"].value = "async"
    editor.fields["queue_depth"].value = text
    assert editor.field_problems()["queue_depth"][0].startswith(expected)


def test_other_points_problems_are_listed_by_name_one_per_line():
    editor = SpecEditor(model=4)
    editor.fields["name"].value = "watch"
    editor.fields["position"].value = "generated[oops]"
    editor.fields["layers"].value = ()
    editor.add_point()
    status = editor.status.value
    assert "extraction_points[" not in status
    assert status.count("<div style=\"margin-left:1em\">point 'watch' · ") == 2
    assert "point 'watch' · layers: layers is an empty list" in status


def test_labels_are_the_yaml_keys_and_layers_have_a_multi_select_hint():
    editor = SpecEditor(model=4)
    labels = {field: control.description for field, control in editor.fields.items()}
    assert labels["execution_mode"] == "execution_mode"
    assert labels["intervention_mode"] == "intervention.mode"
    assert labels["timeout_ms"] == "intervention.timeout_ms"
    assert labels["on_timeout"] == "intervention.on_timeout"
    assert all(label == field for field, label in labels.items()
               if field not in ("intervention_mode", "timeout_ms", "on_timeout"))
    assert "Shift-click" in editor.rows["layers"].children[1].children[0].value


def test_yaml_keeps_its_style_when_the_spec_becomes_invalid():
    editor = SpecEditor(model=4)
    editor.fields["probe_type"].value = "linear_probe"
    editor.fields["probe_args"].value = "path: probe.safetensors\nweight: [0.5, 1.5]"
    assert editor.valid, editor.problems
    valid = yaml_lines(editor)
    editor.fields["position"].value = "generated[oops]"
    invalid = yaml_lines(editor)
    assert invalid[0].startswith("# not valid yet")
    changed = [(a, b) for a, b in zip(valid, invalid[1:], strict=True) if a != b]
    assert changed == [("  position: prompt[-1]", "  position: generated[oops]")]


def yaml_lines(editor: SpecEditor) -> list[str]:
    import html as html_module
    import re

    text = re.sub(r"<[^>]+>", "", editor.yaml_view.value)
    return html_module.unescape(text).strip().splitlines()


def test_probe_types_come_from_the_registry_and_kinds_are_checked_against_the_probe():
    from undercurrent.probes import list_probes

    editor = SpecEditor(model=2)
    assert tuple(editor.fields["probe_type"].options) == list_probes()
    editor.fields["probe_type"].value = "trajectory_probe"
    assert ("probe_kind single_shot does not match probe_type 'trajectory_probe'"
            in editor.errors["probe_kind"].value)
    editor.fields["probe_kind"].value = "trajectory"
    assert editor.valid


def _validate_problems(path: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple]:
    from undercurrent.cli import main

    assert main(["validate", "--format", "json", str(path)]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    return [(p["field"], p["message"]) for p in report["problems"]]


@pytest.mark.parametrize("model", [None, 4])
def test_a_probe_arg_the_probe_does_not_take_gets_the_message_undercurrent_validate_gives(
        model, tmp_path, capsys):
    editor = SpecEditor(model=model)
    editor.fields["name"].value = "guard"
    editor.fields["probe_type"].value = "norm_probe"
    editor.fields["probe_args"].value = "threshold: 30.0"
    assert editor.valid, editor.problems
    path = tmp_path / "typo.yaml"
    path.write_text(editor.to_yaml().replace("threshold:", "threshhold:"), encoding="utf-8")
    expected = _validate_problems(path, capsys)
    assert expected == [("probe_args", "probe_args for probe_type 'norm_probe': unknown "
                         "probe_arg 'threshhold' (did you mean 'threshold'?); NormProbe takes "
                         "action, threshold")]
    editor.fields["probe_args"].value = "threshhold: 30.0"
    assert not editor.valid
    assert [(p.field, p.message) for p in editor.problems] == expected
    assert expected[0][1] in html.unescape(editor.errors["probe_args"].value)
    loaded = SpecEditor.from_spec(path, model=model)
    assert [(p.field, p.message) for p in loaded.problems] == expected
    with pytest.raises(SpecValidationError, match="unknown probe_arg 'threshhold'"):
        _ = loaded.spec


def test_probe_args_are_yaml_and_bad_yaml_is_shown():
    editor = SpecEditor(model=2)
    editor.fields["probe_args"].value = "threshold: 3.5\naction: flag"
    assert dict(editor.spec[0].probe_args) == {"threshold": 3.5, "action": "flag"}
    editor.fields["probe_args"].value = "threshold: [1"
    assert "YAML error at line 1" in editor.errors["probe_args"].value
    editor.fields["probe_args"].value = "- 1"
    assert "must be a mapping" in editor.errors["probe_args"].value


def _file_message(probe_args: str) -> str:
    """What the spec loader says of ``probe_args`` written into a spec file."""
    text = ('version: "1"\nextraction_points:\n  - name: p\n    layers: 0\n'
            '    tensor_type: residual_stream\n    position: "generated[*]"\n'
            "    probe_type: capture\n    probe_kind: trajectory\n    probe_args:\n"
            + "".join(f"      {line}\n" for line in probe_args.splitlines()))
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml(text)
    (problem,) = caught.value.problems
    return problem.message


@pytest.mark.parametrize(
    ("probe_args", "refused"),
    [
        ("threshold: 0.5\nthreshold: 0.9", "found duplicate key 'threshold'"),
        ("features: [010]", "leading zero, which YAML 1.1 reads as the octal number 8"),
        ("every: 1:30", "base-60 number in YAML 1.1 (it reads as 90)"),
    ],
)
def test_probe_args_the_loader_refuses_in_a_file_are_refused_with_its_message(
        probe_args, refused):
    editor = SpecEditor(model=2)
    editor.fields["probe_type"].value = "capture"
    editor.fields["probe_kind"].value = "trajectory"
    editor.fields["probe_args"].value = probe_args
    assert not editor.valid
    assert refused in _file_message(probe_args)
    assert refused in html.unescape(editor.errors["probe_args"].value)
    with pytest.raises(SpecValidationError, match="field 'probe_args'"):
        _ = editor.spec


def test_add_duplicate_remove_and_duplicate_names():
    editor = SpecEditor(model=2)
    editor.fields["name"].value = "a"
    editor.duplicate_point()
    assert [label for label, _ in editor.point_list.options] == ["a", "a_copy"]
    assert editor.current == 1
    editor.fields["name"].value = "a"
    assert "duplicate name 'a'" in editor.errors["name"].value
    assert editor.point_list.options[1][0].startswith("⚠")
    editor.remove_point()
    assert editor.valid and editor.spec.names == ("a",)
    editor.add_button.click()
    assert editor.spec.names == ("a", "point_1")
    editor.select("a")
    assert editor.fields["name"].value == "a"


def test_selecting_a_point_loads_its_values_into_the_form():
    editor = SpecEditor(model=4)
    editor.fields["position"].value = "generated[*]"
    editor.add_point()
    assert editor.fields["position"].value == "prompt[-1]"
    editor.point_list.value = 0
    assert editor.fields["position"].value == "generated[*]"


def test_a_spec_or_a_selection_of_the_wrong_kind_is_refused_naming_what_it_takes():
    # (SpecEditor(5) failed deep in the serialiser, select(99) with a bare IndexError)
    with pytest.raises(TypeError, match=r"SpecEditor\(spec\) takes a ProbeSpec or None, got "
                                        r"int \(5\); .* use SpecEditor.from_spec"):
        SpecEditor(5)
    editor = SpecEditor(model=4)
    editor.add_point()
    with pytest.raises(IndexError, match=r"no point at index 99; there are 2 points "
                                         r"\(indices 0..1\)"):
        editor.select(99)
    with pytest.raises(IndexError, match="no edit at index 0; there are 0 edits"):
        editor.select_edit(0)
    with pytest.raises(TypeError, match=r"select takes a point index or name, got float"):
        editor.select(1.0)
    editor.select(0)
    assert editor.point_list.value == 0
    # field_problems of an index with no point or edit is refused as select() refuses
    # it (it returned {}, "no problems")
    with pytest.raises(IndexError, match=r"no point at index 99; there are 2 points"):
        editor.field_problems(99)
    with pytest.raises(IndexError, match="no edit at index 0; there are 0 edits"):
        editor.edit_field_problems(0)
    with pytest.raises(TypeError, match=r"field_problems takes a point index or name, got "
                                        r"float"):
        editor.field_problems(1.0)
    assert editor.field_problems(1) == {} and editor.edit_field_problems() == {}
    # from_spec takes a spec dict as load_spec does; None is refused naming what it takes
    # (both were pathlib's "expected str, bytes or os.PathLike object")
    data = {"version": "1", "extraction_points": [{
        "name": "p", "layers": 1, "tensor_type": "residual_stream", "position": "prompt[-1]",
        "probe_type": "norm_probe", "probe_kind": "single_shot"}]}
    assert SpecEditor.from_spec(data).spec == parse_dict(data)
    with pytest.raises(TypeError, match=r"from_spec takes a ProbeSpec, a spec dict, a YAML "
                                        r"file path or YAML text, got NoneType"):
        SpecEditor.from_spec(None)
    editor.close()


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_from_spec_round_trips_every_example_spec(path):
    original = load_yaml_file(path)
    editor = SpecEditor.from_spec(path)
    assert editor.valid, editor.problems
    assert editor.spec == original
    assert SpecEditor.from_spec(original).spec == original


def test_with_a_model_layers_keep_the_loaded_order_when_another_field_changes():
    # An edit's layers order its applied edits: a rename and back, with the layer
    # picker of a model, exports the spec it loaded; a new selection is ascending.
    text = """
version: "2"
extraction_points:
  - {name: g, layers: [3, 1], tensor_type: residual_stream, position: "generated[*]",
     probe_type: norm_probe, probe_kind: single_shot}
edits:
  - {name: e, layers: [2, 0], tensor_type: residual_stream, position: "generated[*]",
     op: add, vector: "undercurrent:models/tiny/probe.safetensors"}
"""
    original = parse_yaml(text)
    editor = SpecEditor.from_spec(text, model=4)
    for fields in (editor.fields, editor.edit_fields):
        name = fields["name"].value
        fields["name"].value = name + "2"
        fields["name"].value = name
    assert parse_yaml(editor.to_yaml()) == original
    editor.fields["layers"].value = (1, 2, 3)
    assert editor.spec[0].layers == (1, 2, 3)


def test_from_spec_refuses_probe_args_yaml_cannot_write_as_to_yaml_does():
    import numpy as np

    from undercurrent.spec import ExtractionPoint, ProbeSpec, to_yaml

    point = ExtractionPoint(name="a", layers=1, tensor_type="residual_stream",
                            position="prompt[-1]", probe_type="linear_probe",
                            probe_kind="single_shot", probe_args={"threshold": np.float32(0.5)})
    spec = ProbeSpec([point])
    with pytest.raises(SpecValidationError) as written:
        to_yaml(spec)
    with pytest.raises(SpecValidationError) as loaded:
        SpecEditor.from_spec(spec)
    assert str(loaded.value) == str(written.value)
    assert "extraction_points[0] (name 'a'), field 'probe_args'" in str(loaded.value)


def test_from_spec_reports_model_problems_for_a_loaded_spec():
    editor = SpecEditor.from_spec(SPECS / "continuous_trajectory.yaml", model=4)
    assert not editor.valid
    assert "out of range" in editor.errors["layers"].value


def test_save_writes_yaml_the_loader_reads_back(tmp_path):
    editor = SpecEditor(model=4)
    editor.fields["name"].value = "saved"
    path = editor.save(tmp_path / "spec.yaml")
    assert load_yaml_file(path) == editor.spec


def test_save_button_reports_an_invalid_spec_instead_of_raising(tmp_path):
    editor = SpecEditor(model=4)
    editor.fields["name"].value = ""
    editor.save_path.value = str(tmp_path / "x.yaml")
    editor.save_button.click()
    assert "not saved" in editor.save_message.value
    assert not (tmp_path / "x.yaml").exists()
    editor.fields["name"].value = "ok"
    editor.save_button.click()
    assert "saved to" in editor.save_message.value and (tmp_path / "x.yaml").exists()


def test_save_gives_the_absolute_path_and_the_message_goes_when_the_spec_changes(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    editor = SpecEditor(model=4)
    editor.save_path.value = "spec.yaml"
    editor.save_button.click()
    assert f"saved to <code>{tmp_path / 'spec.yaml'}</code>" in editor.save_message.value
    assert editor.save(Path("again.yaml")) == tmp_path / "again.yaml"
    editor.fields["position"].value = "generated[oops]"
    assert editor.save_message.value == ""


def test_editor_displays_as_a_widget_with_a_static_snapshot_of_form_and_yaml():
    editor = SpecEditor(model=2)
    editor.fields["name"].value = "harm_watch"
    bundle = editor._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "name: harm_watch" in bundle["text/plain"] and "VBox" not in bundle["text/plain"]
    snapshot = bundle["text/html"]
    assert "<code>harm_watch</code>" in snapshot and "name: harm_watch" in snapshot
    assert "queue_depth" not in snapshot  # hidden fields stay hidden
    assert "<code>(router default)</code>" in snapshot  # a dropdown's label, not its value
    assert "(empty)" in snapshot  # probe_args
    assert "✔ valid spec" in snapshot


def test_close_lets_every_widget_of_the_editor_go_and_keeps_its_spec_and_snapshot(tmp_path):
    """ipywidgets keeps each widget until it is closed: an editor (a few hundred
    widgets) that a cell built again stayed for the kernel's life, with no close()."""
    import gc
    import weakref

    from ipywidgets.widgets.widget import _instances

    before = set(_instances)
    editor = SpecEditor(model=4)
    editor.add_point()
    editor.fields["name"].value = "harm_watch"
    assert len(set(_instances) - before) > 200
    text, snapshot = editor.to_yaml(), editor.snapshot_html()
    editor.close()
    editor.close()
    assert set(_instances) - before == set()  # none left open, none orphaned
    assert editor.to_yaml() == text and editor.snapshot_html() == snapshot
    assert editor.save(tmp_path / "spec.yaml").read_text() == text
    bundle = editor._repr_mimebundle_()  # (no widget: the snapshot alone)
    assert bundle == {"text/html": snapshot, "text/plain": editor.to_yaml()}
    released = weakref.ref(editor)
    del editor
    gc.collect()
    assert released() is None


def test_with_a_probed_model_probe_types_are_checked_against_the_registry_its_router_uses():
    from undercurrent.api import ProbedModel
    from undercurrent.probes import NormProbe, ProbeRegistry
    from undercurrent.router import RouterError

    spec_text = ('version: "1"\nextraction_points:\n  - name: guard\n    layers: [1]\n'
                 '    tensor_type: residual_stream\n    position: "generated[*]"\n'
                 '    probe_type: {probe}\n    probe_kind: single_shot\n')
    custom = spec_text.format(probe="custom_norm")
    # probes={...} adds to the default registry: a probe only this model knows is offered
    # and accepted, as registering the spec on the model accepts it.
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=custom,
                                     probes={"custom_norm": NormProbe}) as added:
        editor = SpecEditor.from_spec(custom, model=added)
        assert "custom_norm" in editor.fields["probe_type"].options
        assert editor.valid, editor.problems
    # A registry of its own: a default-registry probe it lacks is refused, with the
    # registry's message, as ProbedModel refuses it.
    registry = ProbeRegistry({"custom_norm": NormProbe})
    with ProbedModel.from_pretrained("undercurrent/tiny", probes=registry) as own:
        editor = SpecEditor(model=own)
        assert tuple(editor.fields["probe_type"].options) == ("custom_norm",)
        assert editor.fields["probe_type"].value == "custom_norm" and editor.valid
        refused = SpecEditor.from_spec(spec_text.format(probe="norm_probe"), model=own)
        assert [p.field for p in refused.problems] == ["probe_type"]
        assert "unknown probe_type 'norm_probe'" in refused.problems[0].message
    with pytest.raises(RouterError, match="unknown probe_type 'norm_probe'"):
        ProbedModel.from_pretrained("undercurrent/tiny", probes=registry,
                                    spec=spec_text.format(probe="norm_probe"))


def test_a_spec_saved_under_home_loads_from_the_same_string(home):
    """SpecEditor.save expanded "~"; load_spec and SpecEditor.from_spec did not ("is
    not a file", "cannot read spec file '~/s.yaml': no such file")."""
    from undercurrent.api import load_spec

    editor = SpecEditor()
    editor.add_point()
    try:
        assert editor.save("~/s.yaml") == home / "s.yaml"
    finally:
        editor.close()
    spec = load_yaml_file(home / "s.yaml")
    assert load_spec("~/s.yaml") == spec and load_yaml_file("~/s.yaml") == spec
    assert SpecEditor.from_spec("~/s.yaml").spec == spec
