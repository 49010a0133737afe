"""Property tests: whatever the input, the loaders either return a ProbeSpec or raise
SpecValidationError; and every valid spec survives serialization unchanged."""

from __future__ import annotations

import warnings
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from undercurrent.spec import (
    ProbeSpec,
    SpecValidationError,
    parse_dict,
    parse_yaml,
    probe_spec_to_dict,
    to_yaml,
)
from undercurrent.spec.schema import ExtractionPointFields, InterventionFields

FAST = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SAFETY_NET = "could not check the spec"  # the loaders' catch-all: a bug if it ever fires

POINT_KEYS = list(ExtractionPointFields.model_fields)
SPEC_WORDS = [
    *POINT_KEYS,
    *InterventionFields.model_fields,
    "version",
    "extraction_points",
    "residual_stream", "kv", "mlp_out", "single_shot", "trajectory", "async", "inline",
    "reject", "block_until_signal", "abort", "continue", "generation_end",
    "prompt[-1]", "generated[*]", "generated[3:]", "generated[2:9]", "prompt[-1]+1", "1",
]


def outcome(load: Any, data: Any) -> ProbeSpec | SpecValidationError:
    """Run a loader, allowing only its two documented outcomes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return load(data)  # type: ignore[no-any-return]
        except SpecValidationError as error:
            assert SAFETY_NET not in str(error), str(error)
            return error


# --- anything in, only the two outcomes out ---------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=40),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(SPEC_WORDS),
)
any_data = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.one_of(st.sampled_from(SPEC_WORDS), st.text(max_size=8)), children,
                        max_size=6),
    ),
    max_leaves=20,
)
spec_shaped = st.fixed_dictionaries(
    {"extraction_points": st.lists(
        st.dictionaries(st.sampled_from(SPEC_WORDS), any_data, max_size=12), max_size=4
    )},
    optional={"version": any_data, "extras": any_data},
)


@FAST
@given(any_data)
def test_parse_dict_on_random_data_returns_a_spec_or_a_spec_error(data: Any) -> None:
    outcome(parse_dict, data)


@FAST
@given(spec_shaped)
def test_parse_dict_on_random_spec_shaped_data_returns_a_spec_or_a_spec_error(data: Any) -> None:
    result = outcome(parse_dict, data)
    if isinstance(result, SpecValidationError):
        assert result.problems and all(problem.message for problem in result.problems)


@FAST
@given(st.text(max_size=200))
def test_parse_yaml_on_random_text_returns_a_spec_or_a_spec_error(text: str) -> None:
    outcome(parse_yaml, text)


@FAST
@given(st.binary(max_size=200))
def test_parse_yaml_on_random_bytes_returns_a_spec_or_a_spec_error(data: bytes) -> None:
    outcome(parse_yaml, data)


@FAST
@given(
    spec_shaped,
    st.lists(
        st.tuples(st.integers(min_value=0), st.sampled_from(list(":-[]{}&*!|>'\"\t\n #%@,?")))
    ),
)
def test_parse_yaml_on_damaged_yaml_returns_a_spec_or_a_spec_error(
    data: Any, damage: list[tuple[int, str]]
) -> None:
    text = yaml.safe_dump(data, allow_unicode=True)
    for position, character in damage:
        cut = position % (len(text) + 1)
        text = text[:cut] + character + text[cut:]
    outcome(parse_yaml, text)


# --- valid specs round-trip -------------------------------------------------------------

PADDING = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def positions(draw: st.DrawFn, continuous: bool) -> Any:
    small = st.integers(min_value=0, max_value=50)
    if continuous:
        start = draw(small)
        form = draw(st.sampled_from(["[*]", "[a:]", "[a:b]"]))
        text = {
            "[*]": "generated[*]",
            "[a:]": f"generated[{start}:]",
            "[a:b]": f"generated[{start}:{start + draw(st.integers(1, 50))}]",
        }[form]
    else:
        form = draw(st.sampled_from(["int", "str", "prompt", "generated"]))
        offset = draw(st.integers(-5, 5))
        suffix = f"{offset:+d}" if offset and draw(st.booleans()) else ""
        if form == "int":
            return draw(small)
        prompt_index = draw(st.integers(-20, 20))
        if suffix and 0 <= prompt_index < -offset:
            prompt_index = -offset  # (prompt[i]-k with i < k is before token 0: refused)
        text = {
            "str": str(draw(small)),
            "prompt": f"prompt[{prompt_index}]{suffix}",
            "generated": f"generated[{draw(small)}]{suffix}",
        }[form]
    return draw(PADDING) + text + draw(PADDING)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=10)),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=15,
)
names = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20).filter(
    str.strip
)


@st.composite
def valid_points(draw: st.DrawFn) -> dict[str, Any]:
    asynchronous = draw(st.booleans())
    continuous = draw(st.booleans())
    layer_list = draw(st.lists(st.integers(0, 80), min_size=1, max_size=4, unique=True))
    point: dict[str, Any] = {
        "name": draw(names),
        "tensor_type": draw(st.sampled_from(
            ["residual_stream", "attn_out", "mlp_out", "kv", "final_norm"])),
        "position": draw(positions(continuous)),
        "probe_type": draw(names),
        "probe_kind": "trajectory" if asynchronous else draw(
            st.sampled_from(["single_shot", "trajectory"])),
    }
    point["layers"] = layer_list[0] if len(layer_list) == 1 and draw(st.booleans()) else layer_list
    if draw(st.booleans()):  # the older spellings, now and then
        point["layer"] = point.pop("layers")
    if draw(st.booleans()):
        point["tensor"] = point.pop("tensor_type")
    if continuous and draw(st.booleans()):
        point[draw(st.sampled_from(["stride", "every_n"]))] = draw(st.integers(1, 9))
    if continuous and draw(st.booleans()):
        point["until"] = draw(st.sampled_from(["generation_end", "fixed_count", "stop_token"]))
    if asynchronous or draw(st.booleans()):
        point["execution_mode"] = "async" if asynchronous else "inline"
    if asynchronous and draw(st.booleans()):
        point["queue_depth"] = draw(st.integers(1, 1000))
    if draw(st.booleans()):
        point["probe_args"] = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
    choice = draw(st.sampled_from(["none", "reject", "block"]))
    if choice == "reject" or (choice == "block" and asynchronous):
        point["intervention"] = draw(st.sampled_from(
            [{}, {"mode": "reject"}, {"on_timeout": "continue"}, {"mode": "reject",
                                                                 "on_timeout": "continue"}]))
    elif choice == "block":
        point["intervention"] = {"mode": "block_until_signal",
                                 "timeout_ms": draw(st.integers(1, 10**6))}
        if draw(st.booleans()):
            point["intervention"]["on_timeout"] = draw(st.sampled_from(["continue", "abort"]))
    return point


@st.composite
def valid_specs(draw: st.DrawFn) -> dict[str, Any]:
    points = draw(st.lists(valid_points(), max_size=4, unique_by=lambda p: p["name"]))
    spec: dict[str, Any] = {"extraction_points": points}
    if draw(st.booleans()):
        spec["version"] = "1"
    return spec


@FAST
@given(valid_specs())
def test_valid_specs_round_trip_through_dicts_and_yaml(raw: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        spec = parse_dict(raw)
        assert parse_yaml(yaml.safe_dump(raw)) == spec
    assert len(spec) == len(raw["extraction_points"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the serializer writes only current key names
        assert parse_dict(probe_spec_to_dict(spec)) == spec
        assert parse_yaml(to_yaml(spec)) == spec
