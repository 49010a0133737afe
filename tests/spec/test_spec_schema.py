"""json_schema(): documented, strict, and in agreement with the parser on real specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_builders import TRAJECTORY, raw_point, raw_spec
from spec_files import SPEC_FILES

from undercurrent.spec import json_schema

jsonschema = pytest.importorskip("jsonschema")

def schema_errors(data: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(json_schema())
    return [error.message for error in validator.iter_errors(data)]


def test_the_schema_is_a_valid_json_schema_and_serializable() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert json.loads(json.dumps(schema)) == schema


def test_every_property_is_documented() -> None:
    schema = json_schema()
    objects = [schema, *schema["$defs"].values()]
    undocumented = [
        f"{obj.get('title')}.{key}"
        for obj in objects
        for key, prop in obj.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert undocumented == []
    point = schema["$defs"]["ExtractionPointFields"]["properties"]
    assert set(point) == {
        "name", "layers", "layer", "tensor_type", "tensor", "position", "stride", "every_n",
        "until", "probe_type", "probe_kind", "probe_args", "execution_mode", "queue_depth",
        "intervention",
    }


def test_unknown_keys_are_not_allowed_anywhere() -> None:
    schema = json_schema()
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["ExtractionPointFields"]["additionalProperties"] is False
    assert schema["$defs"]["InterventionFields"]["additionalProperties"] is False


def test_older_spellings_are_marked_deprecated() -> None:
    point = json_schema()["$defs"]["ExtractionPointFields"]["properties"]
    assert point["layer"]["deprecated"] is True and point["tensor"]["deprecated"] is True
    assert not point["layers"].get("deprecated")


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_example_specs_satisfy_the_schema(path: Path) -> None:
    assert schema_errors(yaml.safe_load(path.read_text(encoding="utf-8"))) == []


@pytest.mark.parametrize(
    "point",
    [
        raw_point(layers=-1),
        raw_point(layers=[]),
        raw_point(layers=[2, 2]),
        raw_point(tensor_type="residual"),
        raw_point(position="prompt[x]"),
        raw_point(position=True),
        raw_point(name=""),
        raw_point(layres=1),
        raw_point(stride=0, **TRAJECTORY),
        raw_point(stride=2, every_n=2, **TRAJECTORY),
        raw_point(layer=3),
        raw_point(intervention={"mode": "reject", "timout_ms": 1}),
    ],
)
def test_the_schema_rejects_what_the_parser_rejects_field_by_field(point: dict[str, Any]) -> None:
    assert schema_errors(raw_spec(point)) != []


def test_the_schema_accepts_older_spellings_without_the_new_ones() -> None:
    point = raw_point(layer=3, tensor="kv")
    del point["layers"], point["tensor_type"]
    assert schema_errors(raw_spec(point)) == []


def test_the_schema_rejects_unknown_versions() -> None:
    assert schema_errors(raw_spec(version="3")) != []
    assert schema_errors(raw_spec(version=1)) != []


def test_the_schema_reads_versions_digits_and_empty_edits_as_the_loader_does() -> None:
    from undercurrent.spec import SpecValidationError, parse_dict

    for data, valid in [
        (raw_spec(version=" 2 ", edits=[]), True),
        (raw_spec(version="2", edits=None), True),
        (raw_spec(version="1", edits=None), False),
        (raw_spec(raw_point(position="prompt[\u0661]")), False),  # an Arabic-Indic 1
        (raw_spec(raw_point(position="generated[1:3]")), True),
    ]:
        try:
            parse_dict(data)
            parsed = True
        except SpecValidationError:
            parsed = False
        assert parsed is valid, data
        assert (schema_errors(data) == []) is valid, data

