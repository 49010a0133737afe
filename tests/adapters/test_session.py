"""Backend-neutral bookkeeping: window matching agrees with ExtractionPoint.matches
token by token, points retire once they can match nothing more, records and
aborts. No torch needed."""

from __future__ import annotations

import itertools

import pytest

from undercurrent.adapters.session import CaptureSession, RequestState, StepPlan
from undercurrent.records import ProbeSignal, SignalAction
from undercurrent.spec.types import ExtractionPoint

POSITIONS = ["0", "3", "9", "prompt[0]", "prompt[-1]", "prompt[-3]", "prompt[2]+3",
             "prompt[-1]+1", "prompt[-2]-1", "generated[0]", "generated[2]", "generated[1]-2",
             "generated[*]", "generated[2:]", "generated[1:5]", "generated[0:1]"]


def point(position, stride=1, name="p"):
    continuous = "*" in position or ":" in position
    return ExtractionPoint(name=name, layers=(0, 2), tensor_type="mlp_out", position=position,
                           stride=stride if continuous else 1, probe_type="none",
                           probe_kind="trajectory" if continuous else "single_shot")


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("prompt_len", [1, 4])
def test_window_matching_equals_matches_token_by_token(position, stride, prompt_len):
    p = point(position, stride)
    total = prompt_len + 9
    expected = [t for t in range(total) if p.matches(
        t, t >= prompt_len, prompt_len, t - prompt_len if t >= prompt_len else None)]
    # the prefill window, then one token at a time, as a backend feeds them
    state = RequestState("r", "x", list(range(prompt_len)), [p])
    found = [t for t, _ in state.matches_in_window(0, prompt_len)]
    for t in range(prompt_len, total):
        found += [i for i, _ in state.matches_in_window(t, t + 1)]
    assert found == expected
    # uneven chunks (chunked prefill, speculative steps) give the same tokens
    state = RequestState("r", "x", list(range(prompt_len)), [p])
    found, start = [], 0
    for size in itertools.cycle([3, 1, 2]):
        if start >= total:
            break
        found += [i for i, _ in state.matches_in_window(start, min(total, start + size))]
        start += size
    assert found == expected


def test_points_retire_once_they_cannot_match():
    state = RequestState("r", "x", [1, 2, 3], [point("prompt[-1]", name="a"),
                                               point("generated[0:2]", name="b"),
                                               point("generated[*]", name="c")])
    state.matches_in_window(0, 3)
    assert {p.name for p in state._live_points} == {"b", "c"}
    state.matches_in_window(3, 4)
    state.matches_in_window(4, 5)
    assert {p.name for p in state._live_points} == {"c"}


class _Router:
    def __init__(self, abort_at):
        self.abort_at, self.routed, self.ended = abort_at, [], []

    def register_request(self, request_id, points, ctx=None):
        self.ctx = ctx

    def route_batch(self, records):  # what CaptureSession calls
        return [self.route(record) for record in records]

    def route(self, record):
        self.routed.append((record.token_index, record.layer))
        if record.token_index == self.abort_at:
            return ProbeSignal(action=SignalAction.ABORT, score=1.0)
        return ProbeSignal(score=0.0)

    def end_request(self, request_id):
        self.ended.append(request_id)
        return {}


def test_deliver_routes_in_token_then_layer_order_and_stops_after_the_aborting_token():
    router = _Router(abort_at=4)
    session = CaptureSession(router, [point("generated[*]")], keep_records=True)
    state = session.open_request("r", "x", [7, 8, 9])
    assert router.ctx.prompt_len == 3 and router.ctx.prompt_token_ids == (7, 8, 9)
    state.generated += [10, 11, 12]
    plan = StepPlan()
    plan.add_window(state, 3, 6, lambda t: (0, t))
    # hooks fire layer by layer; deliver re-sorts by token then layer
    batches = [(tensor_type, group.targets, [f"row{i}" for i in range(len(group.slots))])
               for (_, tensor_type), group in sorted(plan.groups.items(),
                                                     key=lambda item: -item[0][0])]
    session.deliver(batches)
    # the aborting token still reaches every point and layer; nothing after it does
    assert router.routed == [(3, 0), (3, 2), (4, 0), (4, 2)]
    assert state.abort.token_index == 4 and state.abort.generated_index == 1
    assert not state.live and [r.token_id for r in state.records] == [10, 10, 11, 11]
    out = session.close_request("r", "text")
    assert out.aborted and out.finish_reason == "abort" and router.ended == ["r"]
