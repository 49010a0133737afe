"""Serializing resolved specs: plain dicts and YAML that parse back to an equal spec."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from spec_builders import TRAJECTORY, parse_point, raw_point, raw_spec
from spec_files import SPEC_FILES

from undercurrent.spec import (
    ExecutionMode,
    ExtractionPoint,
    InterventionMode,
    InterventionPolicy,
    OnTimeout,
    ProbeKind,
    ProbeSpec,
    SpecValidationError,
    TensorType,
    extraction_point_to_dict,
    load_yaml_file,
    parse_dict,
    parse_position,
    parse_yaml,
    probe_spec_to_dict,
    to_yaml,
)


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_every_example_spec_round_trips(path: Path) -> None:
    spec = load_yaml_file(path)
    assert parse_dict(probe_spec_to_dict(spec)) == spec
    assert parse_yaml(to_yaml(spec)) == spec


def test_positions_are_written_canonically() -> None:
    (point,) = parse_point(position=" prompt[-1] ")
    assert extraction_point_to_dict(point)["position"] == "prompt[-1]"
    assert extraction_point_to_dict(parse_point(position="7")[0])["position"] == 7
    assert extraction_point_to_dict(parse_point(position="prompt[-1]+1")[0])["position"] == (
        "prompt[-1]+1"
    )


def test_optional_fields_at_their_defaults_are_omitted() -> None:
    data = extraction_point_to_dict(parse_point(execution_mode="inline", probe_args={})[0])
    assert data == {
        "name": "last_prompt_token_probe",
        "layers": 12,
        "tensor_type": "residual_stream",
        "position": "prompt[-1]",
        "probe_type": "linear_probe",
        "probe_kind": "single_shot",
    }


def test_the_serializer_writes_new_key_names() -> None:
    old = raw_point(layer=[1, 2], tensor="attn_out", every_n=2, **TRAJECTORY)
    del old["layers"], old["tensor_type"]
    with pytest.warns(DeprecationWarning):
        spec = parse_dict(raw_spec(old))
    data = extraction_point_to_dict(spec[0])
    assert data["layers"] == [1, 2] and data["tensor_type"] == "attn_out" and data["stride"] == 2
    assert not {"layer", "tensor", "every_n"} & set(data)


def test_every_field_survives_the_round_trip() -> None:
    point = ExtractionPoint(
        name="everything",
        layers=(3, 1),
        tensor_type=TensorType.FINAL_NORM,
        position=parse_position("generated[2:9]"),
        stride=3,
        until="fixed_count",
        probe_type="trajectory_probe",
        probe_kind=ProbeKind.TRAJECTORY,
        probe_args={"weights": [[0.5, 1.0], [2.0, -1.0]], "label": "x", "nested": {"k": None}},
        execution_mode=ExecutionMode.INLINE,
        intervention=InterventionPolicy(
            mode=InterventionMode.BLOCK_UNTIL_SIGNAL, timeout_ms=25, on_timeout=OnTimeout.ABORT
        ),
    )
    spec = ProbeSpec((point,))
    data = probe_spec_to_dict(spec)
    assert data["extraction_points"][0]["intervention"] == {
        "mode": "block_until_signal",
        "timeout_ms": 25,
        "on_timeout": "abort",
    }
    assert parse_dict(data) == spec
    assert parse_yaml(to_yaml(spec)) == spec


def test_an_explicit_reject_policy_is_kept_distinct_from_none() -> None:
    explicit = parse_point(intervention={"mode": "reject"})
    assert extraction_point_to_dict(explicit[0])["intervention"] == {"mode": "reject"}
    assert parse_dict(probe_spec_to_dict(explicit)) == explicit
    assert "intervention" not in extraction_point_to_dict(parse_point()[0])


def test_to_yaml_is_plain_readable_yaml() -> None:
    spec = parse_point(layers=[4, 8, 12], queue_depth=8, execution_mode="async", **TRAJECTORY)
    text = to_yaml(spec)
    assert "layers: [4, 8, 12]" in text
    assert yaml.safe_load(text) == probe_spec_to_dict(spec)
    assert text.startswith("version: '1'\n")


def test_serialized_data_is_independent_of_the_spec() -> None:
    (point,) = parse_point(probe_args={"weights": [1.0, 2.0]})
    data = extraction_point_to_dict(point)
    data["probe_args"]["weights"].append(3.0)
    assert point.probe_args["weights"] == [1.0, 2.0]


def test_probe_args_yaml_cannot_represent_give_a_spec_error() -> None:
    point = dataclasses.replace(parse_point()[0], probe_args={"callback": print})
    with pytest.raises(SpecValidationError, match="probe_args"):
        to_yaml(ProbeSpec((point,)))


def test_to_yaml_refuses_a_hand_built_spec_its_loader_would_refuse() -> None:
    # (two points of one name, or version "9", were written; parse_yaml then
    # refused the saved text)
    point = parse_point().extraction_points[0]
    with pytest.raises(SpecValidationError, match=r"extraction_points\[1\] .*duplicate name"):
        to_yaml(ProbeSpec((point, point)))
    with pytest.raises(SpecValidationError, match=r"field 'version': unsupported spec "
                                                  r"version '9'; this release"):
        to_yaml(ProbeSpec((point,), version="9"))
    from undercurrent.api import load_spec

    with pytest.raises(SpecValidationError, match="unsupported spec version '9'"):
        load_spec(ProbeSpec((point,), version="9"))
    assert load_spec(ProbeSpec((point,), version="1")) == ProbeSpec((point,))


def test_tuples_in_probe_args_are_written_as_lists() -> None:
    point = dataclasses.replace(parse_point()[0], probe_args={"shape": (2, 3)})
    assert parse_yaml(to_yaml(ProbeSpec((point,))))[0].probe_args["shape"] == [2, 3]


@pytest.mark.parametrize("array", ["numpy", "torch"])
def test_a_spec_with_an_array_in_probe_args_round_trips_and_compares(array: str) -> None:
    # A fitted linear probe's weight passed as an array made == raise ("truth value
    # of an array is ambiguous", or torch's RuntimeError): dict == asked it for one.
    import numpy as np
    import torch

    make = np.arange if array == "numpy" else torch.arange
    spec = parse_dict(raw_spec(raw_point(
        probe_type="linear_probe", probe_args={"weight": make(4.0), "bias": 0.0,
                                               "nested": {"w": [make(2.0)]}})))
    assert parse_dict(probe_spec_to_dict(spec)) == spec
    (point,) = spec
    assert dataclasses.replace(point) == point
    assert dataclasses.replace(point, probe_args={**point.probe_args, "weight": make(4.0)}) == point
    for other in (make(4.0) + 1, make(5.0), make(4.0).reshape(2, 2), list(range(4))):
        changed = dataclasses.replace(point, probe_args={**point.probe_args, "weight": other})
        assert changed != point
        assert ProbeSpec((changed,)) != spec
        assert hash(changed) == hash(point)  # (probe_args are not hashed)
