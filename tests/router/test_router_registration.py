"""register_request: all-or-nothing, and it re-checks what hand-built points can skip."""

from __future__ import annotations

import numpy as np
import pytest
from router_helpers import Recorder, block, point, record

from undercurrent.probes import Probe, RequestContext
from undercurrent.router import RouterError
from undercurrent.spec.types import InterventionPolicy


def test_every_problem_is_reported_at_once_and_names_its_point(make_router):
    router = make_router()
    points = [
        point("single_async", kind="single_shot", mode="async"),
        point("blocking_async", mode="async", intervention=block(50)),
        point("typo", probe_type="linaer_probe"),
        point("fine"),
        point("fine"),
    ]
    with pytest.raises(RouterError) as info:
        router.register_request("r", points)
    text = str(info.value)
    assert len(info.value.problems) == 4
    assert "[0] (name 'single_async')" in text and "needs probe_kind 'trajectory'" in text
    assert "[1] (name 'blocking_async')" in text and "'block_until_signal'" in text
    assert "[2] (name 'typo')" in text and "did you mean 'linear_probe'" in text
    assert "norm_probe" in text  # the known names are listed
    assert "[4] (name 'fine'), field 'name': duplicate name" in text


def test_nothing_is_started_or_registered_when_one_point_is_bad(make_router):
    router = make_router()
    with pytest.raises(RouterError):
        router.register_request("r", [point("good"), point("bad", probe_type="nope")])
    assert all(probe.started == 0 for probe in Recorder.instances)
    assert router.live_requests() == ()
    router.register_request("r", [point("good")])  # the id is still free
    assert router.live_requests() == ("r",)
    assert set(router.end_request("r")) == {"good"}


def test_async_point_inheriting_a_blocking_router_default_is_refused(make_router):
    router = make_router(default_intervention_policy=block(20))
    with pytest.raises(RouterError, match="inherited from the router's default") as info:
        router.register_request("r", [point("a", mode="async")])
    assert info.value.errors()[0]["loc"] == ("extraction_points", 0, "intervention")
    explicit_reject = InterventionPolicy()
    router.register_request("r", [point("a", mode="async", intervention=explicit_reject)])


def test_invalid_hand_built_interventions_are_refused(make_router):
    router = make_router()
    bad = [
        point("no_timeout", intervention=InterventionPolicy(mode="block_until_signal")),
        point("reject_timeout", intervention=InterventionPolicy(timeout_ms=5)),
        point("reject_abort", intervention=InterventionPolicy(on_timeout="abort")),
        point("inline_depth", queue_depth=4),
    ]
    with pytest.raises(RouterError) as info:
        router.register_request("r", bad)
    assert len(info.value.problems) == 4
    assert "is required with mode 'block_until_signal'" in str(info.value)
    assert "queue_depth only applies with execution_mode 'async'" in str(info.value)


def test_probe_kind_must_match_the_registered_class(make_router):
    router = make_router()
    with pytest.raises(RouterError, match="probe_kind single_shot does not match.*trajectory"):
        router.register_request("r", [point("t", probe_type="trajectory_probe",
                                            kind="single_shot")])


def test_duplicate_live_request_id_is_refused_until_it_ends(make_router):
    router = make_router()
    router.register_request("r", [point()])
    with pytest.raises(RouterError, match="already live"):
        router.register_request("r", [point()])
    router.end_request("r")
    router.register_request("r", [point()])


def test_probe_args_override_probe_defaults_for_the_same_type(make_router):
    router = make_router(probe_defaults={"norm_probe": {"threshold": 1.0, "action": "abort"},
                                         "recorder": {"tag": "from-defaults"}})
    router.register_request("r", [
        point("defaults_only", probe_type="norm_probe"),
        point("overridden", probe_type="norm_probe", probe_args={"threshold": 100.0}),
        point("rec"),
    ])
    # tensor of four 1.0s: norm 2.0
    assert router.route(record("r", "defaults_only", 0)).action.value == "abort"
    assert router.route(record("r", "overridden", 0)).action.value == "continue"
    assert Recorder.instances[-1].tag == "from-defaults"
    results = router.end_request("r")
    assert results["overridden"].verdict["threshold"] == 100.0


def test_probe_defaults_for_a_probe_type_no_one_registered_are_refused(make_router):
    # {"linear_probes": {...}} (a typo) was kept and never applied to any point.
    with pytest.raises(ValueError, match=r"^probe_defaults names an unknown probe_type "
                                         r"'linear_probes'; did you mean 'linear_probe'\? "
                                         r"Known probe types: .*recorder"):
        make_router(probe_defaults={"linear_probes": {"threshold": 0.1}})
    # a probe type of your own counts once it is registered (here through probes=)
    assert make_router(probe_defaults={"recorder": {"tag": "t"}}).probe_defaults == {
        "recorder": {"tag": "t"}}


def test_probe_constructor_errors_name_the_point(make_router):
    router = make_router()
    with pytest.raises(RouterError) as info:
        router.register_request("r", [
            point("lin", probe_type="linear_probe", kind="single_shot"),
            point("rec", probe_args={"no_such_option": 1}),
        ])
    text = str(info.value)
    assert "[0] (name 'lin'), field 'probe_args': could not build probe_type 'linear_probe'" in text
    assert "needs path" in text
    assert "[1] (name 'rec')" in text and "no_such_option" in text


def test_each_request_gets_its_own_probe_instances_with_the_context(make_router):
    seen = []

    class ContextProbe(Probe):
        probe_kind = "single_shot"

        def on_start(self, ctx):
            seen.append((ctx.request_id, ctx.prompt_len, ctx.extraction_point.name, id(self)))

        def on_activation(self, record):
            return None

    router = make_router(probes={"ctx": ContextProbe})
    for rid in ("a", "b"):
        ctx = RequestContext(request_id=rid, prompt="hi", prompt_len=2, model_name="tiny")
        router.register_request(rid, [point("x", probe_type="ctx", kind="single_shot")], ctx)
    assert [s[:3] for s in seen] == [("a", 2, "x"), ("b", 2, "x")]
    assert seen[0][3] != seen[1][3]
    with pytest.raises(RouterError, match="ctx.request_id"):
        router.register_request("c", [], RequestContext(request_id="other"))


def test_unknown_requests_and_points_are_clear_errors(make_router):
    router = make_router()
    with pytest.raises(RouterError, match="no live request 'ghost'"):
        router.route(record("ghost", "p", 0))
    router.register_request("r", [point("p")])
    with pytest.raises(RouterError, match="no extraction point named 'q'.*\\['p'\\]"):
        router.route(record("r", "q", 0))
    router.end_request("r")
    assert router.route(record("r", "p", 1)) is None  # a straggler after the end is ignored
    assert router.metrics()["late_records"] == 1
    with pytest.raises(RouterError, match="already ended"):
        router.end_request("r")


def test_router_arguments_are_validated():
    from undercurrent.router import Router

    with pytest.raises(ValueError, match="overflow policy must be one of drop_oldest"):
        Router(default_overflow="drop_random")
    with pytest.raises(ValueError, match="default_queue_depth must be an int >= 1"):
        Router(default_queue_depth=0)
    with pytest.raises(TypeError, match="probes must be None, a ProbeRegistry"):
        Router(probes=["norm_probe"])


@pytest.mark.parametrize(("policy", "error", "message"), [
    ("reject", TypeError, r"must be an InterventionPolicy, a mapping of its fields .* got str "
                          r"'reject'; for a mode alone pass \{'mode': 'reject'\}"),
    (5, TypeError, r"must be an InterventionPolicy, .* or None \(reject\), got int 5$"),
    ({"mode": "reject", "bogus": 1}, TypeError,
     r"has unknown field\(s\) 'bogus'; a mapping takes mode, timeout_ms, on_timeout"),
    ({"mode": "bogus"}, ValueError, r"intervention mode must be one of reject, .* got 'bogus'$"),
    ({"mode": "block_until_signal"}, ValueError, r"block_until_signal needs timeout_ms"),
])
def test_a_default_intervention_policy_that_is_not_a_policy_is_refused_naming_the_argument(
        policy, error, message):
    # A mode string or a number escaped as AttributeError ('str' object has no
    # attribute 'mode'), an unknown key as InterventionPolicy.__init__'s TypeError.
    from undercurrent.router import Router

    with pytest.raises(error, match=r"^default_intervention_policy.*" + message):
        Router(default_intervention_policy=policy)


def test_a_default_intervention_policy_mapping_is_taken_as_its_fields(make_router):
    router = make_router(default_intervention_policy={"mode": "block_until_signal",
                                                      "timeout_ms": 20})
    assert router.default_intervention_policy == block(20)


@pytest.mark.parametrize("stall_timeout_s", [None, "1", 0, -1.0, float("nan"), float("inf"), True])
def test_a_stall_timeout_that_is_not_a_finite_positive_number_is_refused_at_construction(
        stall_timeout_s):
    # Accepted, it killed the stall supervisor's thread at the first async record
    # (TypeError in its interval), and hung workers were never replaced.
    from undercurrent.router import Router

    with pytest.raises(ValueError, match=r"stall_timeout_s must be a finite number of seconds > 0"):
        Router(stall_timeout_s=stall_timeout_s)


@pytest.mark.parametrize("drain_timeout_s", [None, "5", [1], -1.0, float("nan"), float("inf"),
                                             True])
def test_a_drain_timeout_that_is_not_a_finite_number_of_seconds_is_refused_naming_it(
        drain_timeout_s):
    # ("5", None, [1] were a bare "'>=' not supported" TypeError, True was 1 s, inf
    # failed in the workers' join at shutdown)
    from undercurrent.router import Router

    with pytest.raises(ValueError, match=r"drain_timeout_s must be a finite number of "
                                         r"seconds >= 0, got"):
        Router(drain_timeout_s=drain_timeout_s)


def test_numpy_integers_and_seconds_are_taken_for_the_router_s_counts_and_drain_timeout(
        make_router):
    # (workers, default_queue_depth and breaker_threshold refused np.int64(2) as
    # "not an int >= 1", though stall_timeout_s and the spec take numpy numbers)
    router = make_router(workers=np.int64(2), default_queue_depth=np.int32(3),
                         breaker_threshold=np.int64(4), drain_timeout_s=np.float32(0.0))
    assert (router.workers, router.default_queue_depth, router.breaker_threshold) == (2, 3, 4)
    assert type(router.workers) is int and type(router.default_queue_depth) is int
    assert router.drain_timeout_s == 0.0 and type(router.drain_timeout_s) is float
    with pytest.raises(ValueError, match=r"workers must be an int >= 1, got 2\.0"):
        make_router(workers=2.0)


@pytest.mark.parametrize(("probe_defaults", "kind"), [(5, "int"), ("x", "str"), (["x"], "list")])
def test_probe_defaults_that_are_not_a_mapping_are_refused_naming_it(probe_defaults, kind):
    # (5 was "'int' object is not iterable", 'x' "dictionary update sequence ...")
    from undercurrent.router import Router

    with pytest.raises(TypeError, match=r"probe_defaults must be a mapping \{probe_type: "
                                        rf"\{{argument: value\}}\}} or None, got {kind}"):
        Router(probe_defaults=probe_defaults)


@pytest.mark.parametrize(("fields", "message"), [
    ({"mode": "bogus"}, "intervention mode must be one of reject, block_until_signal, "
                        "got 'bogus'"),
    ({"mode": "block_until_signal", "timeout_ms": 5, "on_timeout": "x"},
     "intervention on_timeout must be one of continue, abort, got 'x'"),
])
def test_an_unknown_intervention_mode_or_on_timeout_names_the_field_and_allowed_values(
        fields, message):
    # (a hand-built policy, and the router's default, gave the enum's own
    # "'bogus' is not a valid InterventionMode")
    from undercurrent.router import Router

    with pytest.raises(ValueError, match=f"^{message}$"):
        InterventionPolicy(**fields)
    with pytest.raises(ValueError, match=f"^default_intervention_policy: {message}$"):
        Router(default_intervention_policy=fields)


@pytest.mark.parametrize("seconds", [2, np.int64(2), np.float32(2.0)])
def test_an_int_or_numpy_stall_timeout_is_taken_as_seconds(make_router, seconds):
    router = make_router(workers=1, stall_timeout_s=seconds)
    assert router._scheduler.stall_timeout_s == 2.0
    assert type(router._scheduler.stall_timeout_s) is float
    router.register_request("r", [point("a", mode="async")])
    router.route(record("r", "a", 0))
    assert router.end_request("r")["a"].stats.processed == 1


def test_the_same_points_are_checked_again_when_the_registry_changes(make_router):
    # Registration remembers point lists that passed (by identity); a probe type
    # mapped to another class since then must be checked and built anew.
    class Other(Recorder):
        pass

    class Refusing(Recorder):
        def check_point(self, point):
            raise ValueError("not this point")

    router = make_router()
    points = [point("p")]
    router.register_request("r1", points)
    router.registry.register("recorder", Other, replace=True)
    router.register_request("r2", points)
    assert type(router._requests["r2"].bindings["p"].probe) is Other
    router.registry.register("recorder", Refusing, replace=True)
    with pytest.raises(RouterError, match="refuses it: not this point"):
        router.register_request("r3", points)
    router.registry.unregister("recorder")
    with pytest.raises(RouterError, match="recorder"):
        router.register_request("r4", points)
    assert sorted(router.live_requests()) == ["r1", "r2"]
