"""A probe that refuses its point refuses the registration; a probe whose
``on_start`` fails never judges, and never signals, anything for that request."""

from __future__ import annotations

from typing import Any

import pytest
from router_helpers import Recorder, block, point, record

from undercurrent.probes import Probe
from undercurrent.records import ProbeSignal, SignalAction
from undercurrent.router import RouterError
from undercurrent.spec.types import ProbeKind

BUNDLED_PROBE = "undercurrent:models/tiny/probe.safetensors"  # fitted on layer 3


class BrokenStart(Probe):
    """``on_start`` raises; every activation would be an abort; counts its calls."""

    probe_kind = (ProbeKind.TRAJECTORY, ProbeKind.SINGLE_SHOT)
    calls: list[str] = []

    def on_start(self, ctx: Any) -> None:
        BrokenStart.calls.append("on_start")
        raise RuntimeError("weights missing")

    def on_activation(self, record: Any) -> ProbeSignal | None:
        BrokenStart.calls.append("on_activation")
        return ProbeSignal(action=SignalAction.ABORT, score=1.0)

    def on_end(self, ctx: Any) -> Any:
        BrokenStart.calls.append("on_end")
        return {"judged": True}


class Refusing(Probe):
    """Refuses every point in ``check_point``."""

    probe_kind = ProbeKind.SINGLE_SHOT
    started = 0

    def check_point(self, point: Any) -> None:
        raise ValueError(f"cannot serve {point.name!r}: wrong layer")

    def on_start(self, ctx: Any) -> None:
        Refusing.started += 1

    def on_activation(self, record: Any) -> ProbeSignal | None:
        return ProbeSignal(action=SignalAction.ABORT)


@pytest.fixture(autouse=True)
def _reset():
    BrokenStart.calls.clear()
    Refusing.started = 0


@pytest.mark.parametrize("setup", [
    {"mode": "inline"},
    {"mode": "inline", "intervention": block(2000, "abort")},
    {"mode": "async"},
], ids=["inline_reject", "inline_block_until_signal", "async"])
def test_a_probe_whose_on_start_failed_gets_no_record_and_emits_no_signal(make_router, setup):
    router = make_router(probes={"broken": BrokenStart})
    router.register_request("r", [point("p", probe_type="broken", **setup)])
    routed = [router.route(record("r", "p", t)) for t in range(3)]
    routed += router.route_batch([record("r", "p", 3, layer=0), record("r", "p", 3, layer=1)])
    assert routed == [None] * 5
    assert not router.abort_requested("r")
    result = router.end_request("r")["p"]
    assert BrokenStart.calls == ["on_start"]  # never asked to judge, nor to conclude
    assert result.signals == () and not result.flagged and result.verdict is None
    stats = result.stats
    assert (stats.received, stats.processed, stats.dropped, stats.errors) == (5, 0, 5, 1)
    assert result.error.startswith("on_start: RuntimeError: weights missing")
    assert "got no activations" in result.error
    assert "RuntimeError: weights missing" in result.metadata["traceback"]


def test_a_failed_on_start_leaves_the_requests_other_probes_running(make_router):
    router = make_router(probes={"broken": BrokenStart, "recorder": Recorder})
    router.register_request("r", [point("bad", probe_type="broken"), point("good")])
    for t in range(3):
        router.route(record("r", "bad", t))
        router.route(record("r", "good", t))
    results = router.end_request("r")
    assert results["good"].verdict == {"seen": [0, 1, 2]} and results["good"].error is None
    assert results["bad"].stats.dropped == 3


def test_a_probe_that_refuses_its_point_refuses_the_registration(make_router):
    router = make_router(probes={"refusing": Refusing})
    with pytest.raises(RouterError, match="\\[0\\] \\(name 'p'\\): probe_type 'refusing' refuses "
                                          "it: cannot serve 'p': wrong layer"):
        router.register_request("r", [point("p", probe_type="refusing", kind="single_shot")])
    assert router.live_requests() == () and Refusing.started == 0
    with pytest.raises(RouterError, match="cannot serve 'p'"):
        router.check([point("p", probe_type="refusing", kind="single_shot")])


def _guard(layers: tuple[int, ...], **extra: Any):
    return point("guard", probe_type="linear_probe", kind="single_shot", layers=layers,
                 probe_args={"path": BUNDLED_PROBE, "action": "abort", **extra})


def test_the_bundled_layer_3_probe_on_layer_1_is_refused_at_registration(make_router):
    router = make_router(probes={})
    message = ("was fitted on layer 3, but extraction point 'guard' captures layers [1]; "
               "fix the spec or pass check_metadata: false")
    with pytest.raises(RouterError) as refused:
        router.register_request("r", [_guard((1,))])
    assert message in str(refused.value) and router.live_requests() == ()
    with pytest.raises(RouterError) as checked:
        router.check([_guard((1,))])
    assert message in str(checked.value)
    router.check([_guard((3,))])
    router.check([_guard((1,), check_metadata=False)])


def test_check_reports_unknown_probe_types_and_probe_args_without_registering(make_router):
    router = make_router(probes={})
    points = [
        point("a", probe_type="nrom_probe"),
        point("b", probe_type="norm_probe", probe_args={"treshold": 2.0}),
        point("c", probe_type="norm_probe", probe_args={"threshold": 2.0}),
    ]
    with pytest.raises(RouterError) as refused:
        router.check(points)
    assert refused.value.problems == [
        "extraction_points[0] (name 'a'), field 'probe_type': unknown probe_type "
        "'nrom_probe'; did you mean 'norm_probe'? Known probe types: "
        + ", ".join(router.registry.names()),
        "extraction_points[1] (name 'b'), field 'probe_args': probe_args for probe_type "
        "'norm_probe': unknown probe_arg 'treshold' (did you mean 'threshold'?); NormProbe "
        "takes action, threshold",
    ]
    assert router.live_requests() == ()
