"""Rejected combinations and field rules: each names the point and the field at fault."""

from __future__ import annotations

from typing import Any

import pytest
from spec_builders import (
    DROP,
    TRAJECTORY,
    fields_at_fault,
    parse_point,
    problems_of,
    raw_point,
    raw_spec,
)

from undercurrent.spec import (
    InterventionMode,
    InterventionPolicy,
    OnTimeout,
    SpecValidationError,
    parse_dict,
    parse_yaml,
)

ASYNC_TRAJECTORY = {**TRAJECTORY, "execution_mode": "async"}
BLOCKING = {"mode": "block_until_signal", "timeout_ms": 50}


def only_problem(**changes: Any) -> tuple[int | None, str | None, str]:
    """The single problem of the minimal point with ``changes``."""
    problems = problems_of(raw_spec(raw_point(**changes)))
    assert len(problems) == 1, problems
    return problems[0]


# --- the seed's rejected combinations ---------------------------------------------------


def test_async_with_single_shot_is_rejected() -> None:
    index, field, message = only_problem(execution_mode="async", probe_kind="single_shot")
    assert (index, field) == (0, "execution_mode")
    assert "single_shot" in message and "trajectory" in message


def test_async_with_trajectory_is_accepted() -> None:
    (point,) = parse_point(**ASYNC_TRAJECTORY)
    assert point.execution_mode.value == "async"


def test_queue_depth_without_async_is_rejected() -> None:
    _, field, message = only_problem(queue_depth=8, **TRAJECTORY)
    assert field == "queue_depth" and "async" in message
    _, field, _ = only_problem(queue_depth=8, execution_mode=DROP, **TRAJECTORY)
    assert field == "queue_depth"


def test_queue_depth_with_async_is_accepted() -> None:
    assert parse_point(queue_depth=8, **ASYNC_TRAJECTORY)[0].queue_depth == 8


@pytest.mark.parametrize("position", [5, "5", "prompt[3]", "prompt[-1]", "generated[2]",
                                      "prompt[-1]+1", "generated[0]-1"])
@pytest.mark.parametrize("key,value", [("stride", 2), ("every_n", 2), ("until", "generation_end")])
def test_stride_or_until_on_a_single_token_position_is_rejected(
    position: object, key: str, value: object
) -> None:
    _, field, message = only_problem(position=position, **{key: value})
    assert field == key
    assert "continuous" in message


def test_an_explicit_stride_of_1_on_a_single_token_position_is_still_rejected() -> None:
    assert only_problem(stride=1)[1] == "stride"


@pytest.mark.parametrize("position", ["generated[*]", "generated[5:]", "generated[5:20]"])
def test_stride_and_until_on_continuous_positions_are_accepted(position: str) -> None:
    (point,) = parse_point(position=position, stride=3, until="stop_token", probe_kind="trajectory")
    assert point.stride == 3 and point.until.value == "stop_token"


def test_async_with_a_blocking_intervention_is_rejected() -> None:
    _, field, message = only_problem(intervention=BLOCKING, **ASYNC_TRAJECTORY)
    assert field == "intervention.mode"
    assert "async" in message and "reject" in message


def test_async_with_a_reject_intervention_is_accepted() -> None:
    (point,) = parse_point(intervention={"mode": "reject"}, **ASYNC_TRAJECTORY)
    assert point.intervention == InterventionPolicy(mode=InterventionMode.REJECT)


def test_block_until_signal_requires_timeout_ms() -> None:
    _, field, message = only_problem(intervention={"mode": "block_until_signal"})
    assert field == "intervention.timeout_ms" and "required" in message


@pytest.mark.parametrize("timeout", [0, -5])
def test_block_until_signal_rejects_timeout_below_1(timeout: int) -> None:
    _, field, message = only_problem(intervention={**BLOCKING, "timeout_ms": timeout})
    assert field == "intervention.timeout_ms" and ">= 1" in message


@pytest.mark.parametrize("timeout", [True, 1.5, "50"])
def test_timeout_ms_must_be_an_integer(timeout: object) -> None:
    _, field, message = only_problem(intervention={**BLOCKING, "timeout_ms": timeout})
    assert field == "intervention.timeout_ms" and "integer" in message


def test_block_until_signal_with_timeout_and_abort_is_accepted() -> None:
    (point,) = parse_point(intervention={**BLOCKING, "on_timeout": "abort"})
    assert point.intervention == InterventionPolicy(
        mode=InterventionMode.BLOCK_UNTIL_SIGNAL, timeout_ms=50, on_timeout=OnTimeout.ABORT
    )


def test_reject_forbids_timeout_ms() -> None:
    _, field, _ = only_problem(intervention={"mode": "reject", "timeout_ms": 10})
    assert field == "intervention.timeout_ms"
    # ``reject`` is the default mode, so leaving it out changes nothing.
    assert only_problem(intervention={"timeout_ms": 10})[1] == "intervention.timeout_ms"


def test_reject_forbids_a_non_default_on_timeout() -> None:
    _, field, message = only_problem(intervention={"mode": "reject", "on_timeout": "abort"})
    assert field == "intervention.on_timeout" and "block_until_signal" in message


def test_reject_allows_the_default_on_timeout_spelled_out() -> None:
    (point,) = parse_point(intervention={"mode": "reject", "on_timeout": "continue"})
    assert point.intervention == InterventionPolicy()


def test_an_empty_intervention_mapping_is_an_explicit_reject_policy() -> None:
    (point,) = parse_point(intervention={})
    assert point.intervention == InterventionPolicy(mode=InterventionMode.REJECT)


def test_intervention_must_be_a_mapping() -> None:
    _, field, message = only_problem(intervention="block_until_signal")
    assert field == "intervention" and "mapping" in message


# --- field rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers,fragment",
    [
        ([], "empty"),
        (-1, "negative"),
        ([0, -3], "negative"),
        (1.5, "integer"),
        ("12", "integer"),
        (True, "boolean"),
        ([1, False], "boolean"),
        ([4, 4], "more than once"),
        (None, "null"),
        ({"a": 1}, "mapping"),
    ],
)
def test_layers_must_be_integers_at_least_0(layers: object, fragment: str) -> None:
    _, field, message = only_problem(layers=layers)
    assert field == "layers"
    assert fragment in message


def test_layers_accepts_one_index_or_a_list_kept_in_order() -> None:
    assert parse_point(layers=0)[0].layers == (0,)
    assert parse_point(layers=[12, 0, 5])[0].layers == (12, 0, 5)


@pytest.mark.parametrize("key", ["stride", "every_n", "queue_depth"])
@pytest.mark.parametrize("value", [0, -1])
def test_stride_and_queue_depth_must_be_at_least_1(key: str, value: int) -> None:
    _, field, message = only_problem(**{key: value}, **ASYNC_TRAJECTORY)
    assert field == key and ">= 1" in message


@pytest.mark.parametrize("key", ["name", "probe_type"])
@pytest.mark.parametrize("value", ["", "   "])
def test_name_and_probe_type_must_not_be_empty(key: str, value: str) -> None:
    _, field, message = only_problem(**{key: value})
    assert field == key and "empty" in message


@pytest.mark.parametrize("key", ["name", "probe_type"])
def test_name_and_probe_type_must_be_strings(key: str) -> None:
    _, field, message = only_problem(**{key: 42})
    assert field == key and "string" in message


def test_a_yaml_boolean_where_a_string_belongs_gets_a_quoting_hint() -> None:
    text = "extraction_points:\n  - {name: no, layers: 1, tensor_type: kv, position: 0,\n"
    text += "     probe_type: x, probe_kind: single_shot}\n"
    with pytest.raises(SpecValidationError, match="quote the value"):
        parse_yaml(text)


@pytest.mark.parametrize(
    "key", ["name", "layers", "tensor_type", "position", "probe_type", "probe_kind"]
)
def test_required_fields(key: str) -> None:
    _, field, message = only_problem(**{key: DROP})
    assert field == key and "required" in message


def test_duplicate_names_are_rejected_at_the_second_use() -> None:
    data = raw_spec(raw_point(name="a"), raw_point(name="b"), raw_point(name="a"))
    message = "duplicate name 'a': already used by extraction_points[0]; names must be unique"
    assert problems_of(data) == [(2, "name", message)]


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("tensor_type", "residual", "residual_stream, attn_out, mlp_out, kv, final_norm"),
        ("probe_kind", "trajectory_probe", "single_shot, trajectory"),
        ("execution_mode", "sync", "inline, async"),
        ("until", "end", "generation_end, fixed_count, stop_token"),
    ],
)
def test_enum_errors_list_the_allowed_values(key: str, value: str, allowed: str) -> None:
    problems = problems_of(raw_spec(raw_point(**{**TRAJECTORY, key: value})))
    assert [(field, allowed in message) for _, field, message in problems] == [(key, True)]


def test_enum_errors_suggest_the_closest_value() -> None:
    _, _, message = only_problem(tensor_type="residual_steam")
    assert "did you mean 'residual_stream'?" in message
    _, _, message = only_problem(intervention={"mode": "block", "timeout_ms": 5})
    assert "block_until_signal" in message


def test_enum_values_are_case_sensitive() -> None:
    assert only_problem(tensor_type="MLP_OUT")[1] == "tensor_type"


@pytest.mark.parametrize(
    "position",
    ["prompt[]", "generated[-1]", "generated[5:5]", "generated[6:2]", "prompt[1] +1",
     "last", -1, 2.0, [1], "generated[*]+1", "prompt[1:3]", None,
     # digits of other scripts (Arabic-Indic, full-width) are not positions
     "\u0661\u0662", "\uff15", "prompt[\u0661]", "generated[0:\u0665]"],
)
def test_positions_outside_the_grammar_list_the_accepted_forms(position: object) -> None:
    _, field, message = only_problem(position=position)
    assert field == "position"
    assert "generated[a:b]" in message and "prompt[i]" in message


@pytest.mark.parametrize("position", ["prompt[0]-1", "prompt[2]-3", "prompt[1]-9"])
def test_a_prompt_position_shifted_before_token_0_is_rejected(position: str) -> None:
    # prompt[i]-k with 0 <= i < k is before token 0 for every prompt length: a point
    # there would capture nothing, an edit change nothing.
    _, field, message = only_problem(position=position)
    assert field == "position" and "before token 0 for every prompt" in message
    assert parse_point(position="prompt[2]-2").extraction_points[0].position.target_index(5) == 0
    assert parse_point(position="prompt[-1]-3").extraction_points[0].position.target_index(5) == 1


@pytest.mark.parametrize("word", ["yes", "no", "true", "off"])
def test_yaml_booleans_are_not_positions(word: str) -> None:
    text = "extraction_points:\n  - {name: p, layers: 1, tensor_type: kv, probe_type: x,\n"
    text += f"     probe_kind: single_shot, position: {word}}}\n"
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml(text)
    assert [p.field for p in caught.value.problems] == ["position"]
    assert "boolean" in caught.value.problems[0].message


def test_whitespace_around_a_position_is_ignored_but_not_inside() -> None:
    assert parse_point(position="  prompt[-1] ") == parse_point(position="prompt[-1]")
    assert only_problem(position="prompt[ -1]")[1] == "position"


# --- keys -------------------------------------------------------------------------------


def test_unknown_point_keys_are_rejected_with_did_you_mean() -> None:
    _, field, message = only_problem(layres=3)
    assert field == "layres"
    assert "did you mean 'layers'?" in message


def test_unknown_top_level_keys_are_rejected_with_did_you_mean() -> None:
    problems = problems_of(raw_spec(extraction_point=[]))
    assert problems[0][:2] == (None, "extraction_point")
    assert "did you mean 'extraction_points'?" in problems[0][2]


def test_unknown_intervention_keys_are_rejected_with_did_you_mean() -> None:
    _, field, message = only_problem(intervention={**BLOCKING, "timeout": 5})
    assert field == "intervention.timeout"
    assert "did you mean 'timeout_ms'?" in message


def test_non_string_keys_are_rejected() -> None:
    problems = problems_of(raw_spec(raw_point(**{}) | {7: "x"}))
    assert len(problems) == 1 and "not a string" in problems[0][2]


@pytest.mark.parametrize("old,new", [("layer", "layers"), ("tensor", "tensor_type"),
                                     ("every_n", "stride")])
def test_old_or_alias_key_together_with_the_new_one_is_an_error(old: str, new: str) -> None:
    values = {"layer": 1, "tensor": "kv", "every_n": 2}
    changes = {old: values[old], **TRAJECTORY}
    if new == "stride":
        changes[new] = 2
    problems = problems_of(raw_spec(raw_point(**changes)))
    assert [(field, new in message) for _, field, message in problems] == [(old, True)]


def test_problems_found_through_an_old_key_name_that_key() -> None:
    point = raw_point(layer=-1, layers=DROP)
    with pytest.warns(DeprecationWarning):
        assert fields_at_fault(raw_spec(point)) == ["layer"]


# --- version ----------------------------------------------------------------------------


def test_an_unknown_version_is_rejected_naming_the_known_ones() -> None:
    problems = problems_of(raw_spec(version="3"))
    assert problems == [(None, "version", problems[0][2])]
    assert "'3'" in problems[0][2] and "'1'" in problems[0][2] and "'2'" in problems[0][2]


def test_version_must_be_a_string() -> None:
    ((_, field, message),) = problems_of(raw_spec(version=1))
    assert field == "version" and 'version: "1"' in message


def test_an_unquoted_version_1_0_is_told_to_quote_the_1_it_means() -> None:
    # (it was called unsupported, and pointed at version "2", the edits format)
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml("version: 1.0\nextraction_points: []\n")
    assert [(p.field, p.message) for p in caught.value.problems] == [
        ("version", 'must be a string, got a number (1.0); write version: "1" (quoted)')]


@pytest.mark.parametrize("with_edit", [True, False])
def test_an_unquoted_version_2_is_one_problem_saying_to_quote_that_2(with_edit: bool) -> None:
    edits = ("edits:\n  - {name: e, layers: 1, tensor_type: residual_stream,"
             " position: 'generated[*]', op: add, vector: [1.0, 0.0]}\n")
    text = "version: 2\nextraction_points: []\n" + (edits if with_edit else "")
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml(text)
    assert [(p.field, p.message) for p in caught.value.problems] == [
        ("version", 'must be a string, got an integer (2); write version: "2" (quoted)')]


@pytest.mark.parametrize(("text", "shown"), [
    ("3", "an integer (3)"), ("0", "an integer (0)"), ("1.5", "a number (1.5)"),
    ("", "null")])
def test_an_unquoted_unknown_version_is_unsupported_naming_the_known_ones_quoted(
        text: str, shown: str) -> None:
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml(f"version: {text}\nextraction_points: []\n")
    assert [(p.field, p.message) for p in caught.value.problems] == [
        ("version", f"unsupported spec version, got {shown}; this release of undercurrent "
                    'reads version "1" or "2", a quoted string (version: "2")')]


def test_an_unquoted_version_2_still_has_its_edits_checked() -> None:
    text = ("version: 2\nextraction_points: []\nedits:\n  - {name: e, layers: 1,"
            " tensor_type: residual_stream, position: 'generated[*]', op: shift, vector: [1.0]}\n")
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml(text)
    assert [(p.section, p.field) for p in caught.value.problems] == [
        ("extraction_points", "version"), ("edits", "op")]


# --- all problems at once ---------------------------------------------------------------


def test_all_problems_are_reported_at_once_with_a_count() -> None:
    data = raw_spec(
        raw_point(name="a", layers=-1, tensor_type="residual"),
        raw_point(name="b", execution_mode="async", queue_depth=0),
        "not a point",
        version="9",
    )
    with pytest.raises(SpecValidationError) as caught:
        parse_dict(data)
    error = caught.value
    located = [(p.point_index, p.point_name, p.field) for p in error.problems]
    assert located == [
        (None, None, "version"),
        (0, "a", "layers"),
        (0, "a", "tensor_type"),
        (1, "b", "queue_depth"),
        (1, "b", "execution_mode"),
        (2, None, None),
    ]
    text = str(error)
    assert text.startswith("invalid spec: 6 problems")
    assert "extraction_points[0] (name 'a'), field 'layers'" in text
    assert "extraction_points[1] (name 'b'), field 'queue_depth'" in text


def test_the_source_file_is_named_in_the_message(tmp_path: Any) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("extraction_points: 5\n", encoding="utf-8")
    from undercurrent.spec import load_yaml_file

    with pytest.raises(SpecValidationError, match=str(path)) as caught:
        load_yaml_file(path)
    assert caught.value.source == str(path)
