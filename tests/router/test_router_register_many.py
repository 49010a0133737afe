"""``Router.register_requests``: several requests with the same points registered
at once, all or nothing, each probe built once and copied for the other
requests when its class copies (the built-ins). The oracle is registering each
request on its own (``register_request``): the same results, every request
with probe instances and state of its own."""

from __future__ import annotations

import numpy as np
import pytest
from router_helpers import Recorder, point, record

from undercurrent.probes import LinearProbe, Probe, RequestContext, save_linear_weights
from undercurrent.probes import weights as weights_module
from undercurrent.records import ActivationBatch
from undercurrent.router import RouterError

IDS = ["a", "b", "c", "d"]
WEIGHT = [0.5, -0.25, 1.0, 0.0]


def _contexts(ids=IDS):
    return [RequestContext(request_id=rid, prompt="hi", prompt_len=2, model_name="tiny")
            for rid in ids]


def _points(tmp_path):
    path = save_linear_weights(tmp_path / "probe.safetensors", WEIGHT, 0.1)
    return [
        point("lin", probe_type="linear_probe", kind="single_shot",
              probe_args={"path": str(path), "threshold": 0.5}),
        point("traj", probe_type="trajectory_probe", probe_args={"alpha": 0.5}),
        point("norm", probe_type="norm_probe", kind="single_shot"),
        point("rec"),
    ]


def _route_and_end(router, ids):
    """Route different rows to each request (values by request and token), end all."""
    for token in range(3):
        records = [record(rid, name, token, value=0.1 * (index + 1) * (token + 1))
                   for index, rid in enumerate(ids) for name in ("lin", "traj", "norm", "rec")]
        for name in ("lin", "traj", "norm", "rec"):
            mine = [r for r in records if r.extraction_point_name == name]
            batch = ActivationBatch.from_records(mine)
            router.route_columns(batch, [(rid, i, i + 1) for i, rid in enumerate(ids)])
    return {rid: router.end_request(rid) for rid in ids}


def _view(results):
    return {rid: {name: (result.verdict, result.stats.received, result.stats.processed,
                         result.stats.dropped, result.stats.errors, result.error,
                         [(s.action, s.score, s.token_index) for s in result.signals])
                  for name, result in by_point.items()}
            for rid, by_point in results.items()}


def test_registering_together_gives_what_registering_each_gives(make_router, tmp_path):
    points = _points(tmp_path)
    together = make_router(probes={"recorder": Recorder})
    together.register_requests(_contexts(), points)
    alone = make_router(probes={"recorder": Recorder})
    for ctx in _contexts():
        alone.register_request(ctx.request_id, points, ctx)
    mine, theirs = _route_and_end(together, IDS), _route_and_end(alone, IDS)
    assert _view(mine) == _view(theirs)
    # every request judged its own rows: the verdicts differ between requests
    assert len({str(mine[rid]["traj"].verdict) for rid in IDS}) == len(IDS)
    assert len({mine[rid]["lin"].verdict["max_score"] for rid in IDS}) == len(IDS)


def test_the_built_ins_are_built_once_and_copied_with_state_of_their_own(
        make_router, tmp_path, monkeypatch):
    """A probe file is read once per call; each request's probe is an instance
    of its own, started with its own context and summary."""
    reads: list[str] = []
    original = weights_module.load_linear_weights

    def counting(path, *args, **kwargs):
        reads.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(weights_module, "load_linear_weights", counting)
    monkeypatch.setattr("undercurrent.probes.linear.load_linear_weights", counting)
    router = make_router()
    router.register_requests(_contexts(), _points(tmp_path))
    assert len(reads) == 1
    bindings = [router._requests[rid].bindings for rid in IDS]
    for name in ("lin", "traj", "norm"):
        probes = [by_name[name].probe for by_name in bindings]
        assert len({id(probe) for probe in probes}) == len(IDS)
        assert len({id(probe.summary) for probe in probes}) == len(IDS)
        assert all(type(probe) is type(probes[0]) for probe in probes)
    assert [by_name["lin"].request_id for by_name in bindings] == IDS
    recorders = [by_name["rec"].probe for by_name in bindings]  # a user class: built each time
    assert len(Recorder.instances) >= len(IDS) and len({id(p) for p in recorders}) == len(IDS)


def test_a_subclass_of_a_built_in_is_built_for_each_request(make_router):
    """Only the built-in classes themselves copy: a subclass may keep state its
    own way, so each request gets it from its constructor."""
    built: list[int] = []

    class Counted(LinearProbe):
        def __init__(self, **kwargs):
            built.append(1)
            super().__init__(**kwargs)
            self.seen: list[float] = []

    router = make_router(probes={"counted": Counted})
    lin = point("lin", probe_type="counted", kind="single_shot",
                probe_args={"weight": WEIGHT, "bias": 0.0})
    router.register_requests(_contexts(), [lin])
    assert len(built) == len(IDS)
    probes = [router._requests[rid].bindings["lin"].probe for rid in IDS]
    assert len({id(probe.seen) for probe in probes}) == len(IDS)


def test_nothing_is_registered_when_one_request_is_refused(make_router, tmp_path):
    started: list[str] = []

    class Starts(Probe):
        probe_kind = "single_shot"

        def on_start(self, ctx):
            started.append(ctx.request_id)

        def on_activation(self, record):
            return None

    router = make_router(probes={"starts": Starts})
    points = [point("s", probe_type="starts", kind="single_shot")]
    router.register_request("c", points)
    with pytest.raises(RouterError, match=r"cannot register requests 'a', 'b', 'c' and 1 more: "
                                          r"request id\(s\) \['c'\] already live"):
        router.register_requests(_contexts(), points)
    with pytest.raises(RouterError, match=r"request id\(s\) \['b'\] given more than once"):
        router.register_requests(_contexts(["a", "b", "b"]), points)
    bad = [point("s", probe_type="starts", kind="single_shot"),
           point("lin", probe_type="linear_probe", kind="single_shot")]
    with pytest.raises(RouterError) as info:
        router.register_requests(_contexts(["a", "b"]), bad)
    assert "[1] (name 'lin'), field 'probe_args': could not build" in str(info.value)
    assert router.live_requests() == ("c",) and started == ["c"]
    router.shutdown()
    with pytest.raises(RouterError, match="the router is shut down"):
        router.register_requests(_contexts(["x", "y"]), points)


def test_the_single_request_messages_are_unchanged(make_router):
    router = make_router()
    router.register_request("a", [point()])
    with pytest.raises(RouterError, match=r"^cannot register request 'a': a request with this "
                                          r"id is already live$"):
        router.register_request("a", [point()])
    with pytest.raises(RouterError, match=r"^cannot register request 'a': a request with this "
                                          r"id is already live$"):
        router.register_requests(_contexts(["a"]), [point()])
    assert np.array_equal(router.live_requests(), ("a",))


def test_each_binding_holds_what_its_constructor_gives(make_router, tmp_path):
    """The bindings of the requests after the first are made from the first's in
    one pass per point: each holds what ``Binding(...)`` makes from the same
    arguments, with a lock and a queue of its own."""
    from undercurrent.router.binding import Binding

    router = make_router(probes={"recorder": Recorder})
    points = [*_points(tmp_path), point("later", mode="async", queue_depth=4)]
    router.register_requests(_contexts(), points)
    checked = {item.point.name: item for item in router._check_points(points)[0]}
    firsts = router._requests[IDS[0]].bindings
    for rid in IDS[1:]:
        for name, binding in router._requests[rid].bindings.items():
            item = checked[name]
            made = Binding(point=item.point, probe=binding.probe, probe_type=item.point.probe_type,
                           ctx=binding._ctx, policy=item.policy,
                           queue_capacity=item.queue_capacity, overflow=router.default_overflow,
                           breaker_threshold=router.breaker_threshold, owner=router)
            mine, theirs = vars(binding), vars(made)
            assert mine.keys() == theirs.keys()
            for key in mine:
                if key == "_mutex":
                    assert type(mine[key]) is type(theirs[key])
                else:
                    assert mine[key] == theirs[key], (rid, name, key)
            assert binding._ctx.request_id == rid and binding._ctx.extraction_point is item.point
            assert mine["_mutex"] is not vars(firsts[name])["_mutex"]
            assert mine["_signals"] == mine["_unread"] == ()  # (lists of its own once kept)
            if binding.is_async:
                assert mine["_queue"] is not vars(firsts[name])["_queue"]
    assert len({id(router._requests[rid].bindings["lin"].group) for rid in IDS}) == 1


def test_a_probe_built_again_that_fails_for_a_later_request_refuses_them_all(make_router):
    """A class that does not copy is built again for each request: one that
    fails for the third request refuses the call, and no probe has started."""
    made: list[int] = []
    started: list[str] = []

    class ThirdFails(Probe):
        probe_kind = "single_shot"

        def __init__(self):
            made.append(1)
            if len(made) == 3:
                raise RuntimeError("out of handles")

        def on_start(self, ctx):
            started.append(ctx.request_id)

        def on_activation(self, record):
            return None

    router = make_router(probes={"third_fails": ThirdFails})
    with pytest.raises(RouterError, match="could not build probe_type 'third_fails'.*"
                                          "out of handles"):
        router.register_requests(_contexts(), [point("t", probe_type="third_fails",
                                                     kind="single_shot")])
    assert router.live_requests() == () and started == []


class _Counts(Probe):
    probe_kind = "single_shot"

    def on_start(self, ctx):
        self.seen = 0

    def on_activation(self, record):
        self.seen += 1


class _CopiesItself(_Counts):
    def copy_for_request(self):
        return self


class _CopiesToJunk(_Counts):
    def copy_for_request(self):
        return 42


class _CopyRaises(_Counts):
    def copy_for_request(self):
        raise RuntimeError("no copy today")


@pytest.mark.parametrize("probe_class, wrong", [
    (_CopiesItself, "it returned the instance itself, so every request would share one probe"),
    (_CopiesToJunk, "it returned int 42; it must return a new _CopiesToJunk, or None"),
    (_CopyRaises, "it raised RuntimeError: no copy today"),
], ids=["itself", "not-a-probe", "raises"])
def test_a_copy_for_request_that_gives_no_new_instance_refuses_the_call(make_router,
                                                                        probe_class, wrong):
    """Requests that would share one probe instance (and its state), or get
    something that is no probe, are refused, naming the point, the probe type
    and copy_for_request; nothing is registered or started."""
    router = make_router(probes={"copies": probe_class})
    message = f"name 't'.*copy_for_request of probe_type 'copies' \\({probe_class.__name__}\\)"
    with pytest.raises(RouterError, match=message) as refused:
        router.register_requests(_contexts(), [point("t", probe_type="copies",
                                                     kind="single_shot")])
    assert wrong in str(refused.value)
    assert router.live_requests() == ()


def test_a_copy_of_the_probe_class_defined_again_is_a_copy(make_router):
    """A notebook cell re-run defines the probe class again after the model was
    built: a ``copy_for_request`` naming its class globally builds the new
    class's instance. That is a copy (every multi-request call was refused)."""
    cell = ("class Scaled(_Counts):\n"
            "    def copy_for_request(self):\n"
            "        return Scaled()\n")
    namespace = {"_Counts": _Counts, "__name__": __name__}
    exec(cell, namespace)
    router = make_router(probes={"scaled": namespace["Scaled"]})
    exec(cell, namespace)  # the cell, run again
    router.register_requests(_contexts(), [point("t", probe_type="scaled",
                                                 kind="single_shot")])
    assert sorted(router.live_requests()) == IDS
    results = [router.end_request(rid)["t"] for rid in IDS]
    assert [(result.error, result.stats.errors) for result in results] == [(None, 0)] * 4


def test_a_copy_of_a_class_of_the_same_name_from_another_module_is_refused_naming_both(
        make_router):
    """Only the probe class defined again (same module, same qualified name) counts
    as its class: one of the same name from another module is refused, and the
    message names each class with its module, not 'it returned P; it must return
    a new P'."""
    cell = "class Scaled(_Counts):\n    pass\n"
    elsewhere = {"_Counts": _Counts, "__name__": "other_probes"}
    exec(cell, elsewhere)

    class Scaled(_Counts):
        def copy_for_request(self):
            return elsewhere["Scaled"]()

    router = make_router(probes={"scaled": Scaled})
    with pytest.raises(RouterError) as refused:
        router.register_requests(_contexts(), [point("t", probe_type="scaled",
                                                     kind="single_shot")])
    assert "it returned other_probes.Scaled <other_probes.Scaled object" in str(refused.value)
    assert (f"it must return a new {__name__}.{Scaled.__qualname__}, or None"
            in str(refused.value))
    assert router.live_requests() == ()


def test_copies_for_request_that_are_one_instance_are_refused(make_router):
    """Copies that are new but the same one for two requests share its state."""
    shared: list[_Counts] = []

    class OneCopy(_Counts):
        def copy_for_request(self):
            if not shared:
                shared.append(OneCopy())
            return shared[0]

    router = make_router(probes={"one": OneCopy})
    with pytest.raises(RouterError, match="it returned one instance for several requests"):
        router.register_requests(_contexts(), [point("t", probe_type="one",
                                                     kind="single_shot")])


@pytest.mark.parametrize("name", ["lin", "traj", "rec", "later"],
                         ids=["grouped", "grouped-trajectory", "each-inline", "async"])
def test_routes_found_at_once_are_the_routes_found_request_by_request(
        make_router, tmp_path, monkeypatch, name):
    """``Router._find_routes`` looks a batch's routes up in C when every
    request's binding is in one group or none is: the same routes as looking at
    each request in turn."""
    from undercurrent.router.binding import Binding

    router = make_router(probes={"recorder": Recorder})
    points = [*_points(tmp_path), point("later", probe_type="trajectory_probe", mode="async")]
    router.register_requests(_contexts(), points)
    spans = [(rid, 2 * i, 2 * i + 2) for i, rid in enumerate(IDS)]

    def view(routes):
        return ([(getattr(request, "request_id", request), binding, start, stop)
                 for request, binding, start, stop in routes.each],
                {key: list(members) for key, members in routes.grouped.items()})

    fast = router._find_routes(spans, name)
    with monkeypatch.context() as patched:
        patched.setattr(Binding, "shared_group", staticmethod(lambda bindings: (False, None)))
        general = router._find_routes(spans, name)
    assert view(fast) == view(general)
    grouped = name in ("lin", "traj")
    assert (len(fast.each), len(fast.grouped)) == ((0, 1) if grouped else (4, 0))
    router.end_request("c")  # a request gone: looked at request by request
    assert view(router._find_routes(spans, "lin"))[0] == [("c", None, 4, 6)]
