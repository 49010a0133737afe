"""Resolved points in Python: the seed's matches() examples, stride, None semantics, and
the rule checks hand-built points get."""

from __future__ import annotations

import dataclasses

import pytest

from undercurrent.spec import (
    ExecutionMode,
    ExtractionPoint,
    InterventionMode,
    InterventionPolicy,
    OnTimeout,
    ProbeKind,
    SpecValidationError,
    TensorType,
    check_extraction_points,
    parse_position,
)


def trajectory_point(position: str = "generated[*]", stride: int = 2) -> ExtractionPoint:
    return ExtractionPoint(
        name="generation_trajectory",
        layers=(4, 8, 12),
        tensor_type=TensorType.MLP_OUT,
        position=parse_position(position),
        stride=stride,
        until=None,
        probe_type="trajectory_probe",
        probe_kind=ProbeKind.TRAJECTORY,
        execution_mode=ExecutionMode.ASYNC,
        queue_depth=8,
    )


def test_seed_example_stride_2_over_generated_tokens() -> None:
    point = trajectory_point()
    # Prompt of 10 tokens; generated tokens 0, 2, 4, ... match because of stride=2.
    assert point.matches(token_index=10, is_generated=True, prompt_len=10, generated_index=0)
    assert not point.matches(token_index=11, is_generated=True, prompt_len=10, generated_index=1)
    assert point.matches(token_index=12, is_generated=True, prompt_len=10, generated_index=2)
    assert not point.matches(token_index=3, is_generated=False, prompt_len=10)


def test_stride_counts_from_the_start_of_the_selector() -> None:
    point = trajectory_point("generated[5:]", stride=2)
    hits = [g for g in range(15) if point.matches(20 + g, True, 20, g)]
    assert hits == [5, 7, 9, 11, 13]


def test_stride_inside_a_bounded_slice() -> None:
    point = trajectory_point("generated[3:10]", stride=3)
    assert [g for g in range(20) if point.matches(5 + g, True, 5, g)] == [3, 6, 9]


@pytest.mark.parametrize(
    "position,prompt_len,expected",
    [
        ("prompt[-1]", 10, 9),
        ("prompt[0]", 10, 0),
        ("prompt[-1]+1", 10, 10),
        ("generated[0]", 10, 10),
        ("generated[2]-1", 10, 11),
        ("4", 10, 4),
    ],
)
def test_single_token_positions_match_exactly_one_token(
    position: str, prompt_len: int, expected: int
) -> None:
    point = trajectory_point(position, stride=1)
    hits = []
    for index in range(prompt_len + 5):
        generated = index >= prompt_len
        generated_index = index - prompt_len if generated else None
        if point.matches(index, generated, prompt_len, generated_index):
            hits.append(index)
    assert hits == [expected]


def test_intervention_is_none_unless_set_meaning_the_routers_default() -> None:
    assert trajectory_point().intervention is None
    explicit = InterventionPolicy()
    assert explicit.mode is InterventionMode.REJECT and explicit != None  # noqa: E711


def test_hand_built_points_normalise_common_inputs() -> None:
    point = ExtractionPoint(
        name="p", layers=3, tensor_type="kv", position=" prompt[-1] ",  # type: ignore[arg-type]
        probe_type="x", probe_kind="single_shot",  # type: ignore[arg-type]
    )
    assert point.layers == (3,)
    assert point.tensor_type is TensorType.KV
    assert point.position == parse_position("prompt[-1]")


def test_check_accepts_valid_hand_built_points() -> None:
    window = dataclasses.replace(trajectory_point("generated[1:4]", 1), name="window")
    assert check_extraction_points([trajectory_point(), window]) is None


def test_check_rejects_async_single_shot_built_by_hand() -> None:
    point = ExtractionPoint(
        name="bypass", layers=(0,), tensor_type="mlp_out", position="prompt[-1]",  # type: ignore[arg-type]
        probe_type="x", probe_kind="single_shot", execution_mode="async",  # type: ignore[arg-type]
    )
    with pytest.raises(SpecValidationError) as caught:
        check_extraction_points([point])
    assert [(p.point_index, p.point_name, p.field) for p in caught.value.problems] == [
        (0, "bypass", "execution_mode")
    ]


def test_check_rejects_a_blocking_intervention_on_an_async_point() -> None:
    point = dataclasses.replace(
        trajectory_point(), intervention=InterventionPolicy(InterventionMode.BLOCK_UNTIL_SIGNAL, 10)
    )
    with pytest.raises(SpecValidationError, match="intervention.mode"):
        check_extraction_points([point])


@pytest.mark.parametrize("stride,shown", [(True, "a boolean (true)"), (1.0, "a number (1.0)")])
def test_a_hand_built_stride_equal_to_the_default_but_not_an_int_is_refused_as_in_yaml(
        stride: object, shown: str) -> None:
    point = dataclasses.replace(trajectory_point(), stride=stride)
    with pytest.raises(SpecValidationError) as caught:
        check_extraction_points([point])
    assert [(p.field, shown in p.message) for p in caught.value.problems] == [("stride", True)]
    assert check_extraction_points([dataclasses.replace(trajectory_point(), stride=1)]) is None


@pytest.mark.parametrize("given,field,fragment", [
    ({"tensor_type": "resid"}, "tensor_type", "expected one of: residual_stream"),
    ({"probe_kind": "x"}, "probe_kind", "expected one of: single_shot, trajectory"),
    ({"execution_mode": "asink"}, "execution_mode", "did you mean 'async'?"),
    ({"position": "gen[*]"}, "position", "'generated[*]'"),
])
def test_a_hand_built_point_that_cannot_be_normalised_is_refused_naming_it_and_the_field(
        given: dict[str, str], field: str, fragment: str) -> None:
    raw = {**dict(name="p", layers=(1,), tensor_type="kv", position="generated[*]",
                  probe_type="x", probe_kind="trajectory"), **given}
    with pytest.raises(SpecValidationError) as caught:
        ExtractionPoint(**raw)  # type: ignore[arg-type]
    assert [(p.point_name, p.field) for p in caught.value.problems] == [("p", field)]
    assert f"extraction point 'p', field '{field}': " in str(caught.value)
    assert fragment in str(caught.value)


def test_every_problem_of_a_hand_built_edit_is_named_as_in_spec_form() -> None:
    from undercurrent.spec import Edit
    with pytest.raises(SpecValidationError) as caught:
        Edit(name="w", layers=2, tensor_type="residual_stream", position="generated[*]",  # type: ignore[arg-type]
             op="addd", vector=[[1.0] * 4])  # type: ignore[arg-type]
    assert [(p.section, p.point_name, p.field) for p in caught.value.problems] == [
        ("edits", "w", "op"), ("edits", "w", "vector")]
    assert "edit 'w', field 'vector': item 0 is a list" in str(caught.value)
    assert "did you mean 'add'?" in str(caught.value)


def test_parse_dict_takes_numpy_numbers_as_a_hand_built_point_does() -> None:
    np = pytest.importorskip("numpy")
    from undercurrent.spec import parse_dict
    raw = dict(name="a", layers=[np.int64(3), np.int32(5)], tensor_type="kv",
               position=np.int64(2), probe_type="x", probe_kind="trajectory",
               probe_args={"w": np.float32(1.5)})
    spread = dict(raw, name="b", layers=np.array([1, 2]), position="generated[*]",
                  stride=np.int64(2), execution_mode="async", queue_depth=np.int16(4))
    first, second = parse_dict({"extraction_points": [raw, spread]})
    assert first.layers == (3, 5) and first.position == parse_position(2)
    assert all(type(layer) is int for layer in first.layers + second.layers)
    assert second.layers == (1, 2) and second.stride == 2 and second.queue_depth == 4
    assert type(second.stride) is int and type(second.queue_depth) is int
    assert type(first.probe_args["w"]) is np.float32  # (probe_args pass through as given)
    assert first == ExtractionPoint(name="a", layers=(np.int64(3), np.int32(5)),
                                    tensor_type="kv", position=2, probe_type="x",  # type: ignore[arg-type]
                                    probe_kind="trajectory", probe_args={"w": np.float32(1.5)})  # type: ignore[arg-type]
    with pytest.raises(SpecValidationError, match="item 0 is a bool"):
        parse_dict({"extraction_points": [dict(raw, layers=[np.bool_(True)])]})


def test_a_hand_built_point_takes_one_numpy_layer_position_and_a_policy_mapping() -> None:
    # What a notebook hands over: np.argmax's layer and position, and the
    # intervention as YAML writes it; the same point as the loader builds.
    np = pytest.importorskip("numpy")
    from undercurrent.spec import Edit, parse_dict

    best = np.int64(2)
    policy = {"mode": "block_until_signal", "timeout_ms": 50, "on_timeout": "abort"}
    point = ExtractionPoint(name="a", layers=best, tensor_type="kv", position=best,  # type: ignore[arg-type]
                            probe_type="x", probe_kind="single_shot",  # type: ignore[arg-type]
                            intervention=policy)  # type: ignore[arg-type]
    (loaded,) = parse_dict({"extraction_points": [dict(
        name="a", layers=2, tensor_type="kv", position=2, probe_type="x",
        probe_kind="single_shot", intervention=policy)]})
    assert point == loaded and type(point.layers[0]) is int
    assert point.intervention.on_timeout is OnTimeout.ABORT
    assert check_extraction_points([point]) is None
    edit = Edit(name="e", layers=best, tensor_type="residual_stream",  # type: ignore[arg-type]
                position="generated[*]", op="add", vector=(1.0,))  # type: ignore[arg-type]
    assert edit.layers == (2,) and type(edit.layers[0]) is int
    with pytest.raises(SpecValidationError, match="intervention"):
        ExtractionPoint(name="a", layers=1, tensor_type="kv", position=0,  # type: ignore[arg-type]
                        probe_type="x", probe_kind="single_shot",  # type: ignore[arg-type]
                        intervention={"mode": "reject", "timout_ms": 5})  # type: ignore[arg-type]


def test_check_rejects_bad_values_and_duplicate_names() -> None:
    bad = dataclasses.replace(trajectory_point(), layers=(-1,), stride=0)
    with pytest.raises(SpecValidationError) as caught:
        check_extraction_points([trajectory_point(), bad])
    fields = [(p.point_index, p.field) for p in caught.value.problems]
    assert (1, "layers") in fields and (1, "stride") in fields and (1, "name") in fields


def test_check_rejects_things_that_are_not_points() -> None:
    with pytest.raises(SpecValidationError, match="expected an ExtractionPoint"):
        check_extraction_points(["generation_trajectory"])  # type: ignore[list-item]


@pytest.mark.parametrize("position", [
    "prompt[-1]", "prompt[-1]+1", "prompt[-2]+1", "prompt[-2]+2", "prompt[-1]+3", "prompt[-3]-2",
    "prompt[0]", "prompt[0]+2", "prompt[2]-1", "prompt[2]-2", "generated[0]", "generated[0]-1",
    "generated[2]-5", "generated[1]-1", "generated[*]", "generated[2:5]", "7"])
def test_can_select_prompt_is_whether_some_prompt_length_selects_a_prompt_token(position):
    # The oracle: the token the selector picks, over prompt lengths long enough for
    # every offset above (a prompt[-1]+1 point is generated[0] for every prompt).
    selector = parse_position(position)
    picks = [selector.target_index(length) for length in range(1, 40)]
    reads_prompt = any(pick is not None and pick < length
                       for length, pick in zip(range(1, 40), picks, strict=True))
    assert selector.can_select_prompt == reads_prompt
