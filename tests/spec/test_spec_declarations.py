"""The fields of a point and an edit are declared once (``spec_field`` in spec/types.py);
the serializer, the schema, the loader's key lists and the vLLM wire format are
derived from that declaration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from undercurrent.adapters.vllm import wire
from undercurrent.spec import (
    Edit,
    EditTrigger,
    ExtractionPoint,
    InterventionPolicy,
    ProbeSpec,
    SaeFeature,
    edit_to_dict,
    extraction_point_to_dict,
    json_schema,
    parse_dict,
    parse_yaml,
    probe_spec_to_dict,
    to_yaml,
)
from undercurrent.spec.declarations import field_info, spec_field, to_spec_data, wire_field_names
from undercurrent.spec.schema import (
    EditFields,
    ExtractionPointFields,
    _schema_model,
)
from undercurrent.steering.vectors import resolve_edit

SNAPSHOT = Path(__file__).with_name("spec_schema.json")

FULL_POINT = ExtractionPoint(
    name="full", layers=(1, 3), tensor_type="kv", position="generated[2:9]", stride=2,
    until="fixed_count", probe_type="norm_probe", probe_kind="trajectory",
    probe_args={"threshold": 0.5, "nested": {"a": [1, 2]}}, execution_mode="async",
    queue_depth=7, intervention=InterventionPolicy(mode="reject", timeout_ms=None))
FULL_EDIT = Edit(
    name="steer", layers=(2,), tensor_type="mlp_out", position="generated[*]", stride=3,
    op="add", vector="vectors/v.npz", vector_key="w", coefficient=-2.5, norm_match=True,
    when=EditTrigger("full", "abort"))


def test_the_json_schema_is_the_one_written_by_hand_before():
    # tests/spec/spec_schema.json is json_schema() of the hand-written pydantic
    # models this derivation replaced; a deliberate schema change updates it.
    assert json_schema() == json.loads(SNAPSHOT.read_text())


def test_every_declared_field_is_documented_and_has_its_schema_key():
    for cls, model in ((ExtractionPoint, ExtractionPointFields), (Edit, EditFields)):
        for declared in dataclasses.fields(cls):
            info = field_info(declared)
            assert info.doc, f"{cls.__name__}.{declared.name} has no documentation"
            assert model.model_fields[declared.name].description == info.doc


def test_a_fully_set_point_and_edit_write_every_declared_field():
    assert list(extraction_point_to_dict(FULL_POINT)) == [
        f.name for f in dataclasses.fields(ExtractionPoint)]
    assert list(edit_to_dict(FULL_EDIT)) == [f.name for f in dataclasses.fields(Edit)]
    assert extraction_point_to_dict(FULL_POINT)["intervention"] == {"mode": "reject"}
    assert edit_to_dict(FULL_EDIT)["layers"] == 2  # one layer is written as a scalar
    assert edit_to_dict(FULL_EDIT)["when"] == {"point": "full", "action": "abort"}


def test_defaults_are_left_out_and_the_spec_round_trips_through_dicts_and_yaml():
    minimal = ExtractionPoint(name="m", layers=0, tensor_type="residual_stream",
                              position="prompt[-1]", probe_type="norm_probe",
                              probe_kind="single_shot")
    assert list(extraction_point_to_dict(minimal)) == [
        "name", "layers", "tensor_type", "position", "probe_type", "probe_kind"]
    inline = dataclasses.replace(FULL_POINT, name="inline", execution_mode="inline",
                                 queue_depth=None, probe_kind="trajectory")
    sae_edit = dataclasses.replace(FULL_EDIT, name="sae", vector=SaeFeature("sae/dir", 4),
                                   vector_key=None, when=EditTrigger("inline"))
    spec = ProbeSpec(extraction_points=(FULL_POINT, inline, minimal),
                     edits=(dataclasses.replace(FULL_EDIT, when=EditTrigger("inline")),
                            sae_edit))
    assert parse_dict(probe_spec_to_dict(spec)) == spec
    assert parse_yaml(to_yaml(spec)) == spec


def test_the_wire_carries_exactly_the_fields_declared_for_it():
    assert wire_field_names(ExtractionPoint) == (
        "name", "layers", "tensor_type", "position", "stride", "probe_type", "probe_kind")
    sent = wire.point_to_wire(FULL_POINT)
    assert set(sent) == set(wire.POINT_WIRE_FIELDS)
    json.dumps(sent)  # plain data only
    rebuilt = wire.point_from_wire(sent)
    for name in wire.POINT_WIRE_FIELDS:
        assert getattr(rebuilt, name) == getattr(FULL_POINT, name), name
    assert rebuilt.probe_args == {} and rebuilt.queue_depth is None


def test_an_edit_survives_the_wire_with_its_vector_resolved():
    edit = dataclasses.replace(FULL_EDIT, vector=(3.0, 4.0), vector_key=None)
    resolved = resolve_edit(edit, hidden_size=2)
    sent = wire.edit_to_wire(resolved)
    json.dumps(sent)
    back = wire.edit_from_wire(sent)
    assert back.edit == edit and back.vector.tolist() == [3.0, 4.0]
    assert back.source == resolved.source and back.sae is None


@pytest.mark.parametrize("wired", [False, True])
def test_a_new_field_is_one_declaration(wired):
    """A field added to a point (as steering will) reaches the spec form, the
    schema with its documentation, and the wire when declared for it."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SteeredPoint(ExtractionPoint):
        gain: float = spec_field("How hard to steer.", schema="finite_number",
                                 wire=wired, default=0.0)

    base = {f.name: getattr(FULL_POINT, f.name) for f in dataclasses.fields(ExtractionPoint)}
    point = SteeredPoint(**base, gain=2.0)
    assert to_spec_data(point)["gain"] == 2.0
    assert "gain" not in to_spec_data(dataclasses.replace(point, gain=0.0))
    model = _schema_model(SteeredPoint, "SteeredPointFields", "A steered point.")
    assert model.model_fields["gain"].description == "How hard to steer."
    assert model.model_json_schema()["properties"]["gain"]["default"] == 0.0
    assert ("gain" in wire_field_names(SteeredPoint)) is wired
