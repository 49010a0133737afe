"""``Router.end_requests``: several requests ended in one call, all or nothing.
The oracle is ending each request on its own (``end_request``): the same
results, verdicts, signals and counts, and the same router totals."""

from __future__ import annotations

import pytest
from router_helpers import Recorder, point, route_rows

from undercurrent.probes import RequestContext, save_linear_weights
from undercurrent.router import RouterError

IDS = ["a", "b", "c", "d"]
NAMES = ("lin", "traj", "async", "rec")


def _points(tmp_path):
    path = save_linear_weights(tmp_path / "probe.safetensors", [0.5, -0.25, 1.0, 0.0], 0.1)
    return [
        point("lin", probe_type="linear_probe", kind="single_shot",
              probe_args={"path": str(path), "threshold": 0.5}),
        point("traj", probe_type="trajectory_probe", probe_args={"alpha": 0.5}),
        point("async", probe_type="trajectory_probe", mode="async", queue_depth=64,
              probe_args={"alpha": 0.5}),
        point("rec"),
    ]


def _registered(make_router, tmp_path, probes=None):
    router = make_router(probes=probes or {"recorder": Recorder})
    router.register_requests([RequestContext(request_id=rid, prompt="hi", prompt_len=2)
                              for rid in IDS], _points(tmp_path))
    route_rows(router, IDS, NAMES, 0.1)
    return router


def _counts(stats):
    """The counts of a result (its latency is a timing, never equal twice)."""
    return {key: value for key, value in stats.as_dict().items() if key != "mean_latency_s"}


def _view(results):
    return {rid: {name: (result.verdict, _counts(result.stats), result.error,
                         [(s.action, s.score, s.token_index) for s in result.signals])
                  for name, result in by_point.items()}
            for rid, by_point in results.items()}


def test_ending_together_gives_what_ending_each_gives(make_router, tmp_path):
    together = _registered(make_router, tmp_path)
    alone = _registered(make_router, tmp_path)
    mine = dict(zip(IDS, together.end_requests(IDS), strict=True))
    theirs = {rid: alone.end_request(rid) for rid in IDS}
    assert _view(mine) == _view(theirs)
    assert list(mine["c"]) == list(NAMES)
    # every row reached its probe, the async ones drained before their results
    assert {result.stats.processed for by_point in mine.values()
            for result in by_point.values()} == {3}
    assert together.metrics()["totals"] == alone.metrics()["totals"]
    assert together.metrics()["totals"]["received"] == len(IDS) * len(NAMES) * 3
    assert together.live_requests() == () == alone.live_requests()


def test_results_come_in_the_order_of_the_ids(make_router, tmp_path):
    router = _registered(make_router, tmp_path)
    order = ["c", "a", "d", "b"]
    assert [by_point["rec"].request_id for by_point in router.end_requests(order)] == order


@pytest.mark.parametrize("ids, message", [
    (["a", "zz"], r"no live request\(s\) \['zz'\]"),
    (["a", "b", "a"], r"request id\(s\) \['a'\] given twice"),
])
def test_an_unknown_or_repeated_id_ends_none(make_router, tmp_path, ids, message):
    router = _registered(make_router, tmp_path)
    with pytest.raises(RouterError, match=message + ".*no request was ended"):
        router.end_requests(ids)
    assert router.live_requests() == tuple(IDS)
    assert [set(by_point) for by_point in router.end_requests(IDS)] == [set(NAMES)] * 4
    with pytest.raises(RouterError, match=r"no live request\(s\) \['a'\]"):
        router.end_requests(["a"])


def test_requests_ended_by_shutdown_give_the_results_shutdown_computed(make_router, tmp_path):
    router = _registered(make_router, tmp_path)
    stored = router.shutdown()
    assert router.end_requests(["b", "a"]) == [stored["b"], stored["a"]]


class _Interrupting(Recorder):
    """A recorder whose ``on_end`` for request ``b`` is interrupted (Ctrl-C)."""

    finished_ids: list[str] = []

    def on_end(self, ctx):
        if ctx.request_id == "b":
            raise KeyboardInterrupt
        _Interrupting.finished_ids.append(ctx.request_id)
        return super().on_end(ctx)


def test_an_interrupt_part_way_ends_every_binding_left_then_propagates(make_router, tmp_path):
    _Interrupting.finished_ids = []
    router = _registered(make_router, tmp_path, probes={"recorder": _Interrupting})
    with pytest.raises(KeyboardInterrupt):
        router.end_requests(IDS)
    # the requests after the interrupted one were ended too (on_end ran), and
    # nothing is left live or uncounted
    assert _Interrupting.finished_ids == ["a", "c", "d"]
    assert router.live_requests() == ()
    totals = router.metrics()["totals"]
    assert totals["received"] == len(IDS) * len(NAMES) * 3
    assert totals["received"] == totals["processed"] + totals["dropped"]
