"""Loading specs: the seed's minimal spec, the ProbeSpec interface, the example files."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest
from spec_builders import TRAJECTORY, parse_point, raw_point, raw_spec

from undercurrent.spec import (
    ExecutionMode,
    ExtractionPoint,
    ProbeKind,
    ProbeSpec,
    SpecDeprecationWarning,
    SpecValidationError,
    TensorType,
    UntilKind,
    load_yaml_file,
    parse_dict,
    parse_position,
    parse_yaml,
)

SPECS = Path(__file__).resolve().parents[2] / "specs"

MINIMAL_YAML = """\
version: "1"
extraction_points:
  - name: last_prompt_token_probe
    layers: 12
    tensor_type: residual_stream
    position: "prompt[-1]"
    probe_type: linear_probe
    probe_kind: single_shot
    execution_mode: inline
"""


def test_minimal_spec_resolves_every_field() -> None:
    spec = parse_yaml(MINIMAL_YAML)
    assert isinstance(spec, ProbeSpec)
    assert spec.version == "1"
    (point,) = spec
    assert isinstance(point, ExtractionPoint)
    assert point.name == "last_prompt_token_probe"
    assert point.layers == (12,)
    assert point.tensor_type is TensorType.RESIDUAL_STREAM
    assert point.position == parse_position("prompt[-1]")
    assert point.probe_type == "linear_probe"
    assert point.probe_kind is ProbeKind.SINGLE_SHOT
    assert point.execution_mode is ExecutionMode.INLINE
    # Optional fields left out take their defaults.
    assert point.stride == 1
    assert point.until is None
    assert point.queue_depth is None
    assert point.intervention is None
    assert dict(point.probe_args) == {}


def test_the_three_loaders_agree(tmp_path: Path) -> None:
    path = tmp_path / "probes.yaml"
    path.write_text(MINIMAL_YAML, encoding="utf-8")
    from_file = load_yaml_file(path)
    assert from_file == load_yaml_file(str(path))
    assert from_file == parse_yaml(MINIMAL_YAML)
    assert from_file == parse_yaml(MINIMAL_YAML.encode("utf-8"))
    import yaml

    assert from_file == parse_dict(yaml.safe_load(MINIMAL_YAML))


def test_a_utf8_byte_order_mark_is_allowed() -> None:
    assert parse_yaml(b"\xef\xbb\xbf" + MINIMAL_YAML.encode()) == parse_yaml(MINIMAL_YAML)


def test_probe_spec_iterates_points_and_offers_get_names_and_len() -> None:
    spec = parse_dict(
        raw_spec(raw_point(name="first"), raw_point(name="second", layers=[1, 2]))
    )
    assert len(spec) == 2
    assert spec.names == ("first", "second")
    assert [point.name for point in spec] == ["first", "second"]
    assert spec.get("second") is spec[1]
    assert spec.get("second").layers == (1, 2)
    assert spec.get("missing") is None
    assert spec.get("missing", spec[0]) is spec[0]


def test_version_defaults_to_1() -> None:
    assert parse_dict({"extraction_points": [raw_point()]}).version == "1"


def test_an_empty_list_of_points_is_a_valid_spec() -> None:
    spec = parse_dict({"version": "1", "extraction_points": []})
    assert len(spec) == 0 and spec.names == ()


@pytest.mark.parametrize(
    "file_name", ["classic_single_token.yaml", "continuous_trajectory.yaml",
                  "offset_dual_position.yaml", "sliced_range.yaml"]
)
def test_every_example_spec_parses(file_name: str) -> None:
    assert len(load_yaml_file(SPECS / file_name)) == 1


def test_example_continuous_trajectory_resolves_as_documented() -> None:
    point = load_yaml_file(SPECS / "continuous_trajectory.yaml").get("generation_trajectory")
    assert point is not None
    assert point.layers == (4, 8, 12)
    assert point.tensor_type is TensorType.MLP_OUT
    assert point.position.is_continuous
    assert point.stride == 2
    assert point.until is UntilKind.GENERATION_END
    assert point.probe_kind is ProbeKind.TRAJECTORY
    assert point.execution_mode is ExecutionMode.ASYNC
    assert point.queue_depth == 8


def test_example_offset_position_is_the_first_generated_token() -> None:
    point = load_yaml_file(SPECS / "offset_dual_position.yaml")[0]
    assert point.tensor_type is TensorType.ATTN_OUT
    assert point.position.target_index(prompt_len=7) == 7
    assert point.position.target_index(7) == parse_position("generated[0]").target_index(7)


def test_example_sliced_range_covers_generated_tokens_5_to_19() -> None:
    point = load_yaml_file(SPECS / "sliced_range.yaml")[0]
    assert point.tensor_type is TensorType.KV
    hits = [g for g in range(30) if point.matches(10 + g, True, 10, g)]
    assert hits == list(range(5, 20))


def test_every_n_is_an_alias_of_stride() -> None:
    with_alias = parse_point(every_n=3, **TRAJECTORY)
    assert with_alias == parse_point(stride=3, **TRAJECTORY)
    assert with_alias[0].stride == 3


def test_older_key_names_load_with_a_deprecation_warning() -> None:
    old = raw_point(layer=[3, 5], tensor="mlp_out")
    del old["layers"], old["tensor_type"]
    with pytest.warns(DeprecationWarning) as caught:
        spec = parse_dict(raw_spec(old))
    assert spec == parse_dict(raw_spec(raw_point(layers=[3, 5], tensor_type="mlp_out")))
    messages = [str(w.message) for w in caught]
    assert any("'layer'" in m and "'layers'" in m for m in messages)
    assert any("'tensor'" in m and "'tensor_type'" in m for m in messages)
    assert all(isinstance(w.message, SpecDeprecationWarning) for w in caught)


def test_deprecation_warning_names_the_file_and_points_at_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(MINIMAL_YAML.replace("layers:", "layer:"), encoding="utf-8")
    with pytest.warns(SpecDeprecationWarning) as caught:
        load_yaml_file(path)
    (warning,) = caught
    assert str(path) in str(warning.message)
    assert warning.message.problem.point_index == 0
    assert warning.message.problem.field == "layer"
    assert warning.filename == __file__


def test_new_key_names_emit_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_yaml(MINIMAL_YAML)


@pytest.mark.parametrize("key", ["until", "queue_depth", "intervention"])
def test_null_for_an_optional_key_means_not_set(key: str) -> None:
    assert parse_point(**{key: None}) == parse_point()


def test_probe_args_are_kept_and_read_only() -> None:
    source = {"weights": [0.5, -0.5], "threshold": 0.9}
    (point,) = parse_point(probe_args=source)
    assert dict(point.probe_args) == source
    assert isinstance(point.probe_args, types.MappingProxyType)
    with pytest.raises(TypeError):
        point.probe_args["threshold"] = 0.1  # type: ignore[index]
    source["threshold"] = 0.0  # the spec holds its own copy
    assert point.probe_args["threshold"] == 0.9


def test_loaded_points_are_frozen() -> None:
    (point,) = parse_point()
    with pytest.raises(AttributeError):
        point.name = "other"  # type: ignore[misc]


def test_invalid_specs_raise_spec_validation_error_a_value_error() -> None:
    with pytest.raises(SpecValidationError) as caught:
        parse_point(layers=-1)
    assert isinstance(caught.value, ValueError)
