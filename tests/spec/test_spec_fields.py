"""The field tables read from the schema: every key a user sets, its kind, choices,
default and documentation, checked against the schema's other outputs."""

from __future__ import annotations

from undercurrent.spec import json_schema
from undercurrent.spec.fields import REQUIRED, edit_fields, point_fields
from undercurrent.spec.schema import REQUIRED_EDIT_KEYS, REQUIRED_POINT_KEYS


def test_point_fields_are_the_keys_a_user_sets_in_declaration_order():
    assert [field.path for field in point_fields()] == [
        "name", "layers", "tensor_type", "position", "stride", "until", "probe_type",
        "probe_kind", "probe_args", "execution_mode", "queue_depth", "intervention.mode",
        "intervention.timeout_ms", "intervention.on_timeout",
    ]  # the older spellings (layer, tensor) and the alias every_n are left out


def test_edit_fields_are_every_key_of_an_edit():
    assert [field.path for field in edit_fields()] == [
        "name", "layers", "tensor_type", "position", "stride", "op", "vector", "vector_key",
        "coefficient", "norm_match", "when.point", "when.action",
    ]


def test_required_keys_are_the_loaders():
    top_level = [field for field in point_fields() if "." not in field.path]
    assert {f.path for f in top_level if f.required} == set(REQUIRED_POINT_KEYS)
    top_level = [field for field in edit_fields() if "." not in field.path]
    assert {f.path for f in top_level if f.required} == set(REQUIRED_EDIT_KEYS)
    when_point = next(f for f in edit_fields() if f.path == "when.point")
    assert when_point.required and when_point.optional  # required once `when` is given


def _schema_property(definition: str, path: str) -> dict:
    schema = json_schema()
    defs = schema["$defs"]
    nested = {"intervention": "InterventionFields", "when": "WhenFields"}
    if "." in path:
        outer, path = path.split(".")
        definition = nested[outer]
    prop = defs[definition]["properties"][path]
    options = [prop, *prop.get("anyOf", [])]
    for option in options:
        if "$ref" in option:
            return {**defs[option["$ref"].rsplit("/", 1)[1]], **prop}
    return prop


def test_choices_and_defaults_agree_with_the_json_schema():
    for definition, table in (("ExtractionPointFields", point_fields()),
                              ("EditFields", edit_fields())):
        for field in table:
            prop = _schema_property(definition, field.path)
            if field.kind == "choice":
                assert list(field.choices) == prop["enum"], field.path
            if not field.required and "default" in prop:
                assert field.default == prop["default"], field.path
            assert field.doc and field.doc == prop["description"].strip(), field.path


def test_kinds_name_the_value_each_key_holds():
    kinds = {field.path: field.kind for field in edit_fields()}
    assert kinds == {
        "name": "text", "layers": "layers", "tensor_type": "choice", "position": "position",
        "stride": "integer", "op": "choice", "vector": "vector", "vector_key": "text",
        "coefficient": "number", "norm_match": "boolean", "when.point": "text",
        "when.action": "choice",
    }
    tensor = next(f for f in edit_fields() if f.path == "tensor_type")
    assert tensor.choices == ("residual_stream", "attn_out", "mlp_out")
    probe_args = next(f for f in point_fields() if f.path == "probe_args")
    assert (probe_args.kind, probe_args.default) == ("mapping", {})
    assert REQUIRED not in [f.default for f in point_fields() if f.optional and "." not in f.path]
