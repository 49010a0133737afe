"""Spec version "2": the ``edits`` list, its rules, round trip, schema and CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from undercurrent.cli import main
from undercurrent.spec import (
    Edit,
    EditOp,
    EditTrigger,
    ProbeSpec,
    SpecValidationError,
    TensorType,
    TriggerAction,
    check_edits,
    json_schema,
    parse_dict,
    parse_yaml,
    probe_spec_to_dict,
    to_yaml,
)

GUARD = {
    "name": "guard", "layers": 3, "tensor_type": "residual_stream",
    "position": "generated[*]", "probe_type": "linear_probe", "probe_kind": "single_shot",
}
OBSERVER = {**GUARD, "name": "observer", "probe_type": "trajectory_probe",
            "probe_kind": "trajectory", "execution_mode": "async"}


def raw_edit(**changes: Any) -> dict[str, Any]:
    edit: dict[str, Any] = {
        "name": "steer", "layers": 1, "tensor_type": "residual_stream",
        "position": "generated[*]", "op": "add", "vector": [1.0, 0.0, -2.0],
    }
    edit.update(changes)
    return {key: value for key, value in edit.items() if value is not DROP}


DROP = object()


def spec_with(*edits: dict[str, Any], version: str = "2",
              points: tuple[dict[str, Any], ...] = (GUARD, OBSERVER)) -> dict[str, Any]:
    return {"version": version, "extraction_points": list(points), "edits": list(edits)}


def problems(data: Any) -> list[tuple[str, int | None, str | None, str | None, str]]:
    with pytest.raises(SpecValidationError) as caught:
        parse_dict(data)
    return [(p.section, p.point_index, p.point_name, p.field, p.message)
            for p in caught.value.problems]


def test_a_version_2_spec_resolves_edits_into_frozen_edit_objects() -> None:
    spec = parse_dict(spec_with(raw_edit(coefficient=-3, when={"point": "guard"}),
                                raw_edit(name="file", vector="undercurrent:x.npz",
                                         vector_key="w", op="project_out", stride=2,
                                         layers=[0, 2], tensor_type="mlp_out")))
    assert spec.version == "2" and len(spec) == 2 and len(spec.edits) == 2
    steer = spec.get_edit("steer")
    assert steer == Edit(name="steer", layers=(1,), tensor_type=TensorType.RESIDUAL_STREAM,
                         position="generated[*]", op=EditOp.ADD, vector=(1.0, 0.0, -2.0),
                         coefficient=-3.0, when=EditTrigger("guard", TriggerAction.FLAG))
    assert steer.triggered and steer.matches(12, True, 10, 2)
    with pytest.raises(AttributeError):
        steer.coefficient = 1.0  # type: ignore[misc]
    other = spec.get_edit("file")
    assert other.vector == "undercurrent:x.npz" and other.stride == 2 and other.layers == (0, 2)
    assert list(spec) == list(spec.extraction_points)  # iteration stays points only


def test_version_1_stays_the_seed_format_and_rejects_edits_as_an_unknown_key() -> None:
    (problem,) = problems(spec_with(raw_edit(), version="1"))
    assert problem[3] == "edits" and "unknown key 'edits'" in problem[4]
    assert 'version: "2"' in problem[4]
    no_version = spec_with(raw_edit())
    del no_version["version"]
    assert problems(no_version)[0][3] == "edits"
    assert parse_dict({"version": "2", "extraction_points": [GUARD]}).edits == ()


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"tensor_type": "kv"}, "tensor_type", "cannot be edited"),
    ({"tensor_type": "residual"}, "tensor_type", "did you mean 'residual_stream'"),
    ({"op": "subtract"}, "op", "expected one of: add, project_out, clamp, scale"),
    ({"vector": []}, "vector", "empty"),
    ({"vector": [0, 0]}, "vector", "all zeros"),
    ({"vector": [1, "x"]}, "vector", "item 1"),
    ({"vector": [1, True]}, "vector", "item 1"),
    ({"vector": [1, float("nan")]}, "vector", "finite"),
    ({"vector": "steer.pt"}, "vector", ".safetensors or .npz"),
    ({"vector": 3}, "vector", "list of numbers"),
    ({"vector_key": "w"}, "vector_key", "list of numbers"),
    ({"coefficient": "big"}, "coefficient", "must be a number"),
    ({"coefficient": float("inf")}, "coefficient", "finite"),
    ({"norm_match": "yes"}, "norm_match", "true or false"),
    ({"norm_match": True, "op": "clamp"}, "norm_match", "only applies to op 'add'"),
    ({"position": "prompt[-1]", "stride": 2}, "stride", "continuous position"),
    ({"position": "somewhere"}, "position", "generated[*]"),
    ({"layers": -1}, "layers", "start at 0"),
    ({"layers": DROP}, "layers", "required"),
    ({"vectr": [1.0]}, "vectr", "did you mean 'vector'"),
    ({"name": "guard"}, "name", "unique across extraction points and edits"),
    ({"when": {"point": "gaurd"}}, "when.point", "did you mean 'guard'"),
    ({"when": {"point": "observer"}}, "when.point", "async"),
    ({"when": {"point": "guard", "action": "continue"}}, "when.action", "flag, abort"),
    ({"when": {"action": "flag"}}, "when.point", "required"),
    ({"when": {"point": "guard", "on": 1}}, "when.on", "unknown key"),
    ({"when": "guard"}, "when", "must be a mapping"),
])
def test_every_problem_names_the_edit_and_the_field(changes: dict[str, Any], field: str,
                                                    words: str) -> None:
    found = problems(spec_with(raw_edit(), raw_edit(**{"name": "second", **changes})))
    assert any(section == "edits" and index == 1 and field_ == field and words in message
               for section, index, _, field_, message in found), found
    assert all(section == "edits" and index == 1 for section, index, *_ in found), found


def test_the_message_locates_the_edit_by_index_and_name() -> None:
    with pytest.raises(SpecValidationError) as caught:
        parse_dict(spec_with(raw_edit(op="nudge")))
    assert "edits[0] (name 'steer'), field 'op'" in str(caught.value)


def test_duplicate_edit_names_and_a_non_list_edits_are_refused() -> None:
    found = problems(spec_with(raw_edit(), raw_edit()))
    assert found[0][:4] == ("edits", 1, "steer", "name") and "edits[0]" in found[0][4]
    assert problems({"version": "2", "extraction_points": [GUARD], "edits": {"a": 1}})[0][3] \
        == "edits"


def test_round_trip_through_dict_and_yaml_is_lossless() -> None:
    spec = parse_dict(spec_with(
        raw_edit(coefficient=-0.1, norm_match=True, when={"point": "guard", "action": "abort"}),
        raw_edit(name="b", op="clamp", vector="undercurrent:models/tiny/probe.safetensors",
                 vector_key="weight", position="generated[2:9]", stride=3, coefficient=0)))
    assert parse_dict(probe_spec_to_dict(spec)) == spec
    assert parse_yaml(to_yaml(spec)) == spec
    text = to_yaml(spec)
    assert 'version: \'2\'' in text and "edits:" in text


def test_a_hand_built_spec_with_edits_is_version_2() -> None:
    edit = Edit(name="e", layers=0, tensor_type="mlp_out", position="prompt[-1]", op="scale",
                vector=[1, 2])
    spec = ProbeSpec((), edits=(edit,))
    assert spec.version == "2" and parse_dict(probe_spec_to_dict(spec)) == spec


def test_check_edits_holds_hand_built_edits_to_the_spec_rules() -> None:
    point = parse_dict(spec_with()).extraction_points
    good = Edit(name="e", layers=1, tensor_type="residual_stream", position="generated[*]",
                op="add", vector=[1.0], when=EditTrigger("guard"))
    check_edits([good], point)
    bad = Edit(name="guard", layers=1, tensor_type="kv", position="prompt[-1]", op="clamp",
               vector=[1.0], norm_match=True, stride=2, when=EditTrigger("observer"))
    with pytest.raises(SpecValidationError) as caught:
        check_edits([bad, good, good], point)
    fields = [(p.point_index, p.field) for p in caught.value.problems]
    assert (0, "tensor_type") in fields and (0, "norm_match") in fields
    assert (0, "stride") in fields and (0, "name") in fields and (0, "when.point") in fields
    assert (2, "name") in fields and not any(index == 1 for index, _ in fields)


def test_a_point_name_as_when_is_refused_as_the_spec_form_is() -> None:
    # Edit(when="guard") was built, then check_edits, generate() and stream() failed
    # with "'str' object has no attribute 'point'" deep in the trigger rules.
    with pytest.raises(SpecValidationError) as caught:
        Edit(name="steer", layers=1, tensor_type="residual_stream", position="generated[*]",
             op="add", vector=[1.0, 0.0, -2.0], when="guard")
    assert [(p.point_name, p.field, p.message) for p in caught.value.problems] == [
        (name, field, message) for _, _, name, field, message
        in problems(spec_with(raw_edit(when="guard")))]
    assert caught.value.problems[0].field == "when"


@pytest.mark.parametrize("field, value, message", [
    ("coefficient", "2", "must be a number, got a string ('2')"),
    ("coefficient", True, "must be a number, got a boolean (true)"),
    ("vector", ["1", "0", "2"], "item 0 is a string ('1')"),
    ("vector", [True, False, True], "item 0 is a boolean (true)"),
])
def test_a_hand_built_edit_is_refused_what_its_spec_form_is(field: str, value: Any,
                                                            message: str) -> None:
    # (float() took "2" and True: the hand-built edit ran where the spec refused it)
    for build in (lambda: Edit(**{**raw_edit(), field: value}),
                  lambda: parse_dict(spec_with(raw_edit(**{field: value})))):
        with pytest.raises(SpecValidationError, match=f"field '{field}': .*{re.escape(message)}"):
            build()
    numpy = pytest.importorskip("numpy")
    edit = Edit(**raw_edit(vector=numpy.array([1, 0, 2], dtype=numpy.float32),
                           coefficient=numpy.float64(0.5)))
    assert edit.vector == (1.0, 0.0, 2.0) and edit.coefficient == 0.5


jsonschema = pytest.importorskip("jsonschema")


def schema_errors(data: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(json_schema())
    return [error.message for error in validator.iter_errors(data)]


def test_the_json_schema_documents_edits_and_agrees_with_the_parser() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    edit = schema["$defs"]["EditFields"]
    assert edit["additionalProperties"] is False
    assert all(prop.get("description") for prop in edit["properties"].values())
    assert set(edit["required"]) == {"name", "layers", "tensor_type", "position", "op",
                                     "vector"}
    good = spec_with(raw_edit(when={"point": "guard"}), raw_edit(name="f", vector="a.npz"))
    assert schema_errors(good) == []
    for bad in (spec_with(raw_edit(), version="1"), spec_with(raw_edit(tensor_type="kv")),
                spec_with(raw_edit(op="nudge")), spec_with(raw_edit(vector="a.pt")),
                spec_with(raw_edit(when={"point": "g", "action": "continue"}))):
        assert schema_errors(bad) != [], bad
        with pytest.raises(SpecValidationError):
            parse_dict(bad)


def test_cli_validate_and_schema_cover_edits(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(to_yaml(parse_dict(spec_with(raw_edit()))))
    bad = tmp_path / "bad.yaml"
    bad.write_text(to_yaml(parse_dict(spec_with())).replace("edits: []", "")
                   + "edits:\n  - {name: e, layers: 0, tensor_type: kv, position: 0, "
                     "op: add, vector: [1]}\n")
    assert main(["validate", str(good)]) == 0
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "edits[0] (name 'e'), field 'tensor_type'" in out
    assert main(["schema"]) == 0
    assert "EditFields" in json.loads(capsys.readouterr().out)["$defs"]
