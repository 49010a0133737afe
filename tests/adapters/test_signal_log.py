"""``SignalLog`` and ``RecordLog``: a request's inline signals and captured
records, kept as references to routed (captured) batches. A request on a
steady layout is not handed each step's signals: it follows the layout's
``Journal`` (one append per step for every request) until it is handed
signals another way or follows another journal.

The oracle is the plain log: every routed batch that would reach the request
handed to it with ``add`` at the moment it is routed. Any interleaving of
follows, journal appends, direct adds and reads (a live view reads mid-way)
must give the same ``TokenSignal`` s in the same order.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from undercurrent.adapters.delivery import Journal, PlanMatch, RecordLog, RoutedPoint, SignalLog
from undercurrent.records import ActivationBatch, BatchSignals

WIDTH = 2  # rows per request in every routed batch (two layers)
REQUESTS = 2


def _routed(token: int, codes: list[int]) -> RoutedPoint:
    """A routed batch of REQUESTS x WIDTH rows at ``token`` with these action codes."""
    count = REQUESTS * WIDTH
    batch = ActivationBatch(
        [[float(token * 10 + row)] for row in range(count)],
        request_ids=[f"r{row // WIDTH}" for row in range(count)],
        point_names=["p"] * count, layers=[0, 1] * REQUESTS, tensor_type="residual_stream",
        token_indices=[token] * count, is_generated=[True] * count,
        generated_indices=[token - 3] * count, token_ids=[None] * count)
    scores = [float(token * 10 + row) for row in range(count)]
    return RoutedPoint(batch, BatchSignals(codes, scores, all_scored=True))


def _view(log: Any) -> list[tuple[Any, ...]]:
    return [(s.extraction_point_name, s.layer, s.token_index, s.generated_index, s.action,
             s.signal.score) for s in log]


OPS = st.lists(st.one_of(
    st.tuples(st.just("follow"), st.integers(0, 2), st.integers(0, REQUESTS - 1)),
    st.tuples(st.just("append"), st.integers(0, 2),
              st.lists(st.integers(-1, 2), min_size=REQUESTS * WIDTH,
                       max_size=REQUESTS * WIDTH)),
    st.tuples(st.just("add"), st.integers(0, REQUESTS - 1),
              st.lists(st.integers(-1, 2), min_size=REQUESTS * WIDTH,
                       max_size=REQUESTS * WIDTH)),
    st.tuples(st.just("read"), st.integers(0, REQUESTS - 1), st.just(None)),
), max_size=30)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_following_a_journal_gives_what_adding_each_step_gives(ops: list[Any]) -> None:
    journals = [Journal() for _ in range(3)]
    logs = [SignalLog() for _ in range(REQUESTS)]
    oracles = [SignalLog() for _ in range(REQUESTS)]
    following: list[int | None] = [None] * REQUESTS  # the journal each oracle follows
    matches = [PlanMatch(None, None, 0, (0, 1), [0, 1], 0)  # type: ignore[arg-type]
               for _ in range(REQUESTS)]
    token = 3
    for op, first, second in ops:
        token += 1
        if op == "follow":
            request = second
            start = request * WIDTH
            logs[request].follow(journals[first], start, start + WIDTH, matches[request])
            following[request] = first
        elif op == "append":
            routed = _routed(token, second)
            journals[first].append(routed)
            for request in range(REQUESTS):
                if following[request] == first:
                    start = request * WIDTH
                    oracles[request].add([(routed, start, start + WIDTH, matches[request])])
        elif op == "add":
            request, start = first, first * WIDTH
            routed = _routed(token, second)
            logs[request].add([(routed, start, start + WIDTH, matches[request])])
            oracles[request].add([(routed, start, start + WIDTH, matches[request])])
            following[request] = None
        else:
            assert _view(logs[first]) == _view(oracles[first])
    for log, oracle in zip(logs, oracles, strict=True):
        assert _view(log) == _view(oracle)
        assert len(log) == len(oracle)


def test_a_journal_is_intact_until_a_follower_leaves_it() -> None:
    journal = Journal()
    log = SignalLog()
    match = PlanMatch(None, None, 0, (0, 1), [0, 1], 0)  # type: ignore[arg-type]
    assert not journal.intact  # nobody follows it yet: the layout makes them follow
    journal.intact = True
    log.follow(journal, 0, WIDTH, match)
    journal.append(_routed(4, [0, 1, 0, 0]))
    assert [s.layer for s in log] == [0, 1] and journal.intact  # read: still following
    journal.append(_routed(5, [1, -1, 0, 0]))
    log.add([(_routed(6, [0, 0, 0, 0]), 0, WIDTH, match)])
    assert not journal.intact and log.following is None
    assert [s.token_index for s in log] == [4, 4, 5, 6, 6]  # -1: no signal at that row


def _records(log: Any) -> list[tuple[Any, ...]]:
    return [(r.request_id, r.layer, r.token_index, r.tensor) for r in log]


RECORD_OPS = st.lists(st.one_of(
    st.tuples(st.just("follow"), st.integers(0, 1), st.integers(0, REQUESTS - 1)),
    st.tuples(st.just("append"), st.integers(0, 1), st.just(None)),
    st.tuples(st.just("add"), st.integers(0, REQUESTS - 1), st.just(None)),
    st.tuples(st.just("read"), st.integers(0, REQUESTS - 1), st.just(None)),
    st.tuples(st.just("count"), st.integers(0, REQUESTS - 1), st.just(None)),
    st.tuples(st.just("clear"), st.integers(0, REQUESTS - 1), st.just(None)),
), max_size=30)


@settings(max_examples=200, deadline=None)
@given(ops=RECORD_OPS)
def test_records_following_a_journal_are_those_added_each_step(ops: list[Any]) -> None:
    """The same for records: counting (``len``, which builds nothing), reading and
    ``clear`` (a consumer freeing memory) agree with adding (batch, row)
    references as each batch is captured."""
    journals = [Journal() for _ in range(2)]
    logs = [RecordLog() for _ in range(REQUESTS)]
    oracles = [RecordLog() for _ in range(REQUESTS)]
    following: list[int | None] = [None] * REQUESTS
    token = 3
    for op, first, second in ops:
        token += 1
        if op == "follow":
            logs[second].follow(journals[first], second * WIDTH, (second + 1) * WIDTH)
            following[second] = first
        elif op == "append":
            batch = _routed(token, [0] * (REQUESTS * WIDTH)).batch
            journals[first].append(batch)
            for request in range(REQUESTS):
                if following[request] == first:
                    oracles[request].add((batch, row) for row in
                                         range(request * WIDTH, (request + 1) * WIDTH))
        elif op == "add":
            batch = _routed(token, [0] * (REQUESTS * WIDTH)).batch
            refs = [(batch, row) for row in range(first * WIDTH, (first + 1) * WIDTH)]
            logs[first].add(refs)
            oracles[first].add(refs)
            following[first] = None
        elif op == "read":
            assert _records(logs[first]) == _records(oracles[first])
        elif op == "count":
            assert len(logs[first]) == len(oracles[first])
        else:
            logs[first].clear()
            oracles[first].clear()
    for log, oracle in zip(logs, oracles, strict=True):
        assert len(log) == len(oracle)
        assert _records(log) == _records(oracle)
