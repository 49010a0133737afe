"""One validator: whatever ``check_extraction_points`` refuses, ``Router.register_request``,
``Router.check`` and ``ProbedModel`` (points given as a list) refuse too, with the very
same messages; what it accepts they accept. All four errors share ``ProblemsError``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from undercurrent.adapters.capabilities import Capabilities, CapabilityError, check_points
from undercurrent.errors import ProblemsError
from undercurrent.router import Router, RouterError
from undercurrent.spec import (
    ExtractionPoint,
    InterventionPolicy,
    SpecValidationError,
    check_extraction_points,
)


def _point(name: str = "p", **fields) -> ExtractionPoint:
    values = {"layers": (0,), "tensor_type": "residual_stream", "position": "generated[*]",
              "probe_type": "norm_probe", "probe_kind": "trajectory", **fields}
    return ExtractionPoint(name=name, **values)


BAD = {
    "stride on a single-token position": [_point(position="prompt[-1]", stride=3)],
    "until on a single-token position": [_point(position="generated[2]", until="stop_token")],
    "async single_shot": [_point(execution_mode="async", probe_kind="single_shot")],
    "queue_depth without async": [_point(queue_depth=4)],
    "queue_depth 0": [_point(execution_mode="async", queue_depth=0)],
    "stride 0": [_point(stride=0)],
    "negative layer": [_point(layers=(-1,))],
    "no layers": [_point(layers=())],
    "empty name": [_point("")],
    "block without timeout": [_point(intervention=InterventionPolicy(mode="block_until_signal"))],
    "block with timeout 0": [
        _point(intervention=InterventionPolicy(mode="block_until_signal", timeout_ms=0))
    ],
    "reject with timeout": [_point(intervention=InterventionPolicy(timeout_ms=5))],
    "reject with abort": [_point(intervention=InterventionPolicy(on_timeout="abort"))],
    "async blocking": [
        _point(execution_mode="async",
               intervention=InterventionPolicy(mode="block_until_signal", timeout_ms=5))
    ],
    "duplicate names": [_point("same"), _point("same", layers=(1,))],
    "several at once": [_point("a", position="prompt[-1]", stride=2), _point("b"),
                        _point("c", execution_mode="async", probe_kind="single_shot",
                               queue_depth=0)],
}


def spec_messages(points: list[ExtractionPoint]) -> list[str] | None:
    """What check_extraction_points says (None when it accepts the points)."""
    try:
        check_extraction_points(points)
    except SpecValidationError as error:
        assert error.errors() == [p.detail() for p in error.problems]
        return [str(problem) for problem in error.problems]
    return None


def router_messages(router: Router, points: list[ExtractionPoint]) -> list[str] | None:
    """What register_request and check say (None when both accept the points)."""
    try:
        router.check(points)
    except RouterError as checked:
        with pytest.raises(RouterError) as registered:
            router.register_request("r", points)
        assert registered.value.problems == checked.problems
        assert [d["msg"] for d in registered.value.errors()] == [
            d["msg"] for d in _spec_details(points)
        ]
        assert router.live_requests() == ()
        return checked.problems
    router.register_request("r", points)
    assert set(router.end_request("r")) == {point.name for point in points}
    return None


def _spec_details(points):
    try:
        check_extraction_points(points)
    except SpecValidationError as error:
        return error.errors()
    return []


@pytest.fixture(scope="module")
def router():
    with Router(workers=1) as built:
        yield built


@pytest.mark.parametrize("case", list(BAD))
def test_the_router_refuses_every_bad_point_with_the_spec_messages(router, case):
    points = BAD[case]
    expected = spec_messages(points)
    assert expected, f"{case}: check_extraction_points accepted it"
    assert router_messages(router, points) == expected


def test_the_issue_example_is_refused_by_the_router_naming_the_field(router):
    points = [_point(position="prompt[-1]", stride=3)]
    with pytest.raises(RouterError) as refused:
        router.register_request("r", points)
    (detail,) = refused.value.errors()
    assert detail["loc"] == ("extraction_points", 0, "stride")
    assert detail["msg"].startswith("stride only applies to a continuous position")
    assert detail["type"] == "router"


def test_router_problems_come_point_by_point(router):
    points = [_point("a", probe_type="nrom_probe"), _point("b", stride=0)]
    with pytest.raises(RouterError) as refused:
        router.check(points)
    assert [d["loc"][:2] for d in refused.value.errors()] == [
        ("extraction_points", 0), ("extraction_points", 1)
    ]
    assert "did you mean 'norm_probe'" in refused.value.problems[0]


_policies = st.one_of(
    st.none(),
    st.builds(InterventionPolicy,
              mode=st.sampled_from(["reject", "block_until_signal"]),
              timeout_ms=st.sampled_from([None, 0, 5]),
              on_timeout=st.sampled_from(["continue", "abort"])),
)
_points = st.builds(
    _point,
    st.sampled_from(["a", "b"]),
    layers=st.sampled_from([(0,), (0, 1), (-1,), ()]),
    position=st.sampled_from(["prompt[-1]", "generated[*]", "generated[2:]", "generated[1]"]),
    stride=st.integers(0, 3),
    until=st.sampled_from([None, "generation_end", "stop_token"]),
    probe_kind=st.sampled_from(["single_shot", "trajectory"]),
    execution_mode=st.sampled_from(["inline", "async"]),
    queue_depth=st.sampled_from([None, 0, 2]),
    intervention=_policies,
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(points=st.lists(_points, min_size=1, max_size=3))
def test_router_and_spec_check_agree_on_any_points(router, points):
    assert router_messages(router, points) == spec_messages(points)


# -- ProbedModel: the list is checked when the model is built -------------------------

class _Backend:
    """The least a ProbedModel needs before it generates (no engine involved)."""

    name = "stub"
    model_name = "stub"

    def capabilities(self) -> Capabilities:
        return Capabilities.standard("stub", "stub", num_layers=4)

    def generate(self, *args, **kwargs):
        raise AssertionError("never reached")

    stream = generate

    def close(self) -> None:
        pass


@pytest.mark.parametrize("case", list(BAD))
def test_probed_model_refuses_a_list_of_bad_points_with_the_spec_messages(case):
    from undercurrent.api import ProbedModel

    points = BAD[case]
    with pytest.raises(SpecValidationError) as refused:
        ProbedModel(_Backend(), spec=points)
    assert [str(p) for p in refused.value.problems] == spec_messages(points)


def test_numpy_integer_layers_are_plain_layer_indices():
    np = pytest.importorskip("numpy")
    point = _point(layers=(np.int64(3), np.int32(0)), stride=np.int64(2),
                   execution_mode="async", queue_depth=np.int16(4))
    assert point.layers == (3, 0) and all(type(layer) is int for layer in point.layers)
    assert type(point.stride) is int and type(point.queue_depth) is int
    assert spec_messages([point]) is None
    policy = InterventionPolicy(mode="block_until_signal", timeout_ms=np.int64(5))
    assert type(policy.timeout_ms) is int
    assert spec_messages([_point(intervention=policy)]) is None
    assert _point(layers=(True,)).layers == (True,)  # still refused by the check
    assert spec_messages([_point(layers=(True,))])


def test_probed_model_accepts_the_points_the_spec_check_accepts():
    from undercurrent.api import ProbedModel

    with ProbedModel(_Backend(), spec=[_point("a"), _point("b", layers=(3,))]) as model:
        assert model.spec.names == ("a", "b")


def test_every_refusal_is_a_problems_error_with_pydantic_shaped_errors():
    caps = Capabilities.standard("stub", "stub", num_layers=2)
    with pytest.raises(CapabilityError) as capability:
        check_points(caps, [_point(layers=(7,))])
    errors = [SpecValidationError("bad"), RouterError("refused", ["one", "two"]),
              capability.value]
    for error in errors:
        assert isinstance(error, ProblemsError) and isinstance(error, ValueError)
        details = error.errors()
        assert details and all(set(d) == {"loc", "msg", "type"} for d in details)
    assert [d["msg"] for d in errors[1].errors()] == ["one", "two"]
    (located,) = capability.value.errors()
    assert "layer(s) [7] out of range" in located["msg"]
    assert located["loc"] == ("extraction_points", 0, "layers")
    assert located["type"] == "capability"
