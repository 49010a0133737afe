"""``Router.may_abort`` and ``CaptureSession.may_abort``: whether a probe may stop
one of some requests before it ends. The vLLM backend asks it to let the engine
report each request only once it finishes."""

from __future__ import annotations

import pytest
from router_helpers import Recorder, block, point

from undercurrent.adapters.session import CaptureSession
from undercurrent.probes import RequestContext, probe, save_linear_weights
from undercurrent.records import ProbeSignal


@probe(register=False)
def silent(record):
    """A probe written per record: it does not say whether it may abort."""
    return ProbeSignal(action="continue", score=0.0)


def _linear(tmp_path, action):
    path = save_linear_weights(tmp_path / f"{action}.safetensors", [0.5, -0.25], 0.1)
    return point("lin", probe_type="linear_probe", kind="single_shot",
                 probe_args={"path": str(path), "threshold": 0.5, "action": action})


CASES = {
    "inline linear probe that flags": (lambda tmp: _linear(tmp, "flag"), False),
    "inline linear probe that aborts": (lambda tmp: _linear(tmp, "abort"), True),
    "inline trajectory probe with no threshold": (
        lambda tmp: point("traj", probe_type="trajectory_probe"), False),
    "async trajectory probe that aborts": (
        lambda tmp: point("traj", probe_type="trajectory_probe", mode="async",
                          probe_args={"threshold": 0.5, "action": "abort"}), False),
    "probe written per record": (
        lambda tmp: point("rec", probe_type="silent", kind="single_shot"), True),
    "recorder": (lambda tmp: point("rec"), True),
    "flagging probe, waited for, continue on a timeout": (
        lambda tmp: point("traj", probe_type="trajectory_probe", intervention=block(50)),
        False),
    "flagging probe, waited for, abort on a timeout": (
        lambda tmp: point("traj", probe_type="trajectory_probe",
                          intervention=block(50, "abort")), True),
}


@pytest.mark.parametrize("case", CASES)
def test_may_abort_says_whether_a_probe_may_stop_a_request(make_router, tmp_path, case):
    build, expected = CASES[case]
    router = make_router(probes={"recorder": Recorder, "silent": silent})
    contexts = [RequestContext(request_id=rid, prompt="hi", prompt_len=2) for rid in "ab"]
    router.register_requests(contexts, [build(tmp_path)])
    assert router.may_abort(["a", "b"]) is expected
    assert router.may_abort(["b"]) is expected
    assert router.may_abort([]) is False
    assert router.may_abort(["not live"]) is False
    router.end_requests(["a", "b"])
    assert router.may_abort(["a", "b"]) is False  # ended: no binding left


def test_one_request_that_may_be_stopped_is_enough(make_router, tmp_path):
    router = make_router()
    router.register_request("quiet", [_linear(tmp_path, "flag")])
    router.register_request("loud", [_linear(tmp_path, "abort")])
    assert router.may_abort(["quiet"]) is False
    assert router.may_abort(["quiet", "loud"]) is True


class _Plain:
    """A router with no ``may_abort``: only what the session protocol needs."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    def register_request(self, request_id, points, ctx=None):
        self.registered.append(request_id)

    def route_columns(self, batch, spans=None):
        raise AssertionError("nothing is routed here")

    def end_request(self, request_id):
        return {}


def test_a_session_asks_its_router_about_its_registered_requests(make_router, tmp_path):
    assert CaptureSession(None, []).may_abort(["a"]) is False  # no router: no probe
    router = make_router()
    session = CaptureSession(router, [_linear(tmp_path, "abort")])
    session.open_requests([("a", "hi", [1, 2])])
    assert session.may_abort(["a"]) is True
    assert session.may_abort(["other"]) is False  # not one of its requests
    quiet = CaptureSession(router, [_linear(tmp_path, "flag")])
    quiet.open_requests([("b", "hi", [1, 2])])
    assert quiet.may_abort(["b"]) is False
    plain = _Plain()
    unknown = CaptureSession(plain, [point("rec")])
    unknown.open_requests([("c", "hi", [1, 2])])
    assert plain.registered == ["c"]
    assert unknown.may_abort(["c"]) is True  # a router that cannot tell: taken to say yes
    assert unknown.may_abort([]) is False
