"""Many threads, many requests, mixed inline and async points: nothing lost or double-counted."""

from __future__ import annotations

import threading

import pytest
from router_helpers import Recorder, block, point, record

from undercurrent.records import SignalAction

THREADS = 8
REQUESTS_PER_THREAD = 200
TOKENS = 6


def _points():
    return [
        point("inline", kind="single_shot"),
        point("norm", probe_type="norm_probe", kind="single_shot"),
        point("blocking", intervention=block(5000), probe_args={"abort_at": TOKENS - 1}),
        point("async_small", mode="async", queue_depth=2),
    ]


@pytest.mark.timeout(120)
def test_stress_mixed_points_exact_accounting_and_no_deadlock(make_router):
    # Half the clients share a drop_oldest router, half a block one.
    routers = [make_router(workers=2, default_overflow=policy)
               for policy in ("drop_oldest", "block")]
    failures: list[str] = []
    all_results: list[dict] = []
    lock = threading.Lock()

    def client(thread_index: int) -> None:
        router = routers[thread_index % 2]
        try:
            for i in range(REQUESTS_PER_THREAD):
                rid = f"t{thread_index}-r{i}"
                router.register_request(rid, _points())
                for token in range(TOKENS):
                    for name in ("inline", "norm", "blocking", "async_small"):
                        signal = router.route(record(rid, name, token, value=token))
                        if name == "blocking" and token == TOKENS - 1:
                            assert signal.action is SignalAction.ABORT
                results = router.end_request(rid)
                with lock:
                    all_results.append((thread_index % 2, results))
        except Exception as exc:  # surfaced below with the thread's name
            failures.append(f"thread {thread_index}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(100)
    assert not any(thread.is_alive() for thread in threads), "deadlock: client threads stuck"
    assert not failures, failures
    assert len(all_results) == THREADS * REQUESTS_PER_THREAD

    processed_total = 0
    for router_index, results in all_results:
        for name, result in results.items():
            stats = result.stats
            assert stats.received == TOKENS, name
            assert stats.received == stats.processed + stats.dropped, name
            assert stats.errors == 0 and result.error is None, (name, result.error)
            processed_total += stats.processed
            lossless = name in ("inline", "blocking") or (name == "async_small" and router_index)
            if lossless:
                assert stats.dropped == 0 and result.verdict["seen"] == list(range(TOKENS))
            if name == "async_small":
                seen = result.verdict["seen"]
                assert len(seen) == stats.processed and seen == sorted(seen)
                assert seen[-1] == TOKENS - 1  # drop_oldest never loses the newest record
            if name == "norm":
                assert result.verdict["count"] == TOKENS
                assert result.verdict["max_score"] == pytest.approx(2.0 * (TOKENS - 1))
    # Every activation a Recorder saw was counted once, and vice versa.
    recorder_seen = sum(len(probe.seen) for probe in Recorder.instances)
    norm_processed = THREADS * REQUESTS_PER_THREAD * TOKENS
    assert recorder_seen + norm_processed == processed_total
    totals = [router.metrics()["totals"] for router in routers]
    received = sum(t["received"] for t in totals)
    assert received == THREADS * REQUESTS_PER_THREAD * TOKENS * 4
    assert received == sum(t["processed"] + t["dropped"] for t in totals)
    assert totals[1]["dropped"] == 0
    assert all(router.metrics()["live_requests"] == 0 for router in routers)
    assert not any(probe.overlapped for probe in Recorder.instances)
