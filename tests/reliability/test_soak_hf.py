"""Item 5 (HF backend): a soak of many concurrent requests for a bounded time.

Three generation threads, each with its own copy of the tiny model, send batches
of prompts (every prompt its own request) with inline, blocking and async points;
two threads share one router whose async queues ``block`` when full, the third
uses a router that drops the oldest record. Checked on every result, every batch:
``received == processed + dropped``; no drop except on the one binding whose
policy allows it; every probe that may not drop saw exactly the tokens it should
(records lost = 0, by content, not only by count). At the end: no deadlock (every
thread finished), no live request, no leaked thread, and resident memory flat.

``UNDERCURRENT_SOAK_SECONDS`` sets the duration (default 15 s in ``make test``)."""

from __future__ import annotations

import copy
import gc
import logging
import random
import threading
import time
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from reliability_support import (  # noqa: E402
    TEST_PROBES,
    SoakLedger,
    check_soak_output,
    live_hooks,
    point,
    prompt,
    soak_seconds,
)

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.router import Router  # noqa: E402

SOAK_S = soak_seconds(15.0)
SPEC = [
    point("inline", probe_type="recorder"),
    point("inline_prompt", probe_type="recorder", position="prompt[-1]", layers=(0, 1)),
    point("blocking", probe_type="recorder", layers=(1,),
          intervention={"mode": "block_until_signal", "timeout_ms": 10_000}),
    point("async", probe_type="recorder", execution_mode="async", queue_depth=256),
    point("async_kv", probe_type="recorder", execution_mode="async", tensor_type="kv",
          position="generated[0:8]", queue_depth=256),
    # The only binding allowed to drop (under the drop_oldest router): a slow probe
    # on a two-record queue.
    point("async_slow", probe_type="sleeps", probe_args={"seconds": 0.004},
          execution_mode="async", queue_depth=2),
]
MAY_DROP = {"async_slow"}


def _worker(pm: Any, seed: int, deadline: float, ledger: SoakLedger, drop_policy: str) -> None:
    rng = random.Random(seed)
    try:
        while time.monotonic() < deadline:
            prompts = [prompt(*(rng.randrange(60) for _ in range(rng.randint(1, 12))))
                       for _ in range(rng.randint(2, 8))]
            sampling = rng.random() < 0.5
            outputs = pm.generate(prompts, max_new_tokens=rng.randint(2, 14),
                                  temperature=0.8 if sampling else 0.0,
                                  seed=rng.randrange(1000) if sampling else None)
            for output in outputs:
                check_soak_output(output, ledger, drop_policy, MAY_DROP)
            with ledger.lock:
                ledger.requests += len(outputs)
    except BaseException as error:  # noqa: BLE001 - reported by the test
        with ledger.lock:
            ledger.failures.append(f"thread {seed}: {type(error).__name__}: {error}")


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.timeout(int(SOAK_S) + 180)
def test_soak_hf_batched_concurrent_requests(tiny, figures, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="undercurrent")
    model, tokenizer = tiny
    threads_before = {t.ident for t in threading.enumerate()}
    blocking = Router(TEST_PROBES, default_overflow="block")
    dropping = Router(TEST_PROBES, default_overflow="drop_oldest")
    plans = [(blocking, "block", 1), (blocking, "block", 2), (dropping, "drop_oldest", 3)]
    models = [ProbedModel(copy.deepcopy(model), tokenizer, spec=SPEC, router=router,
                          batch_size=8) for router, _, _ in plans]
    ledger = SoakLedger()
    # Warm up (allocator pools, lazy imports), then measure from a steady state.
    for pm in models:
        pm.generate([prompt(1, 2), prompt(3)], max_new_tokens=4)
    # A busy machine may drop records in the warm-up too: the ledger counts from here.
    dropped_before = {id(router): router.metrics()["totals"]["dropped"]
                      for router in (blocking, dropping)}
    rss_start = _rss_mb()
    samples = [(0.0, rss_start)]
    started = time.monotonic()
    deadline = started + SOAK_S
    workers = [threading.Thread(target=_worker, args=(pm, seed, deadline, ledger, policy),
                                name=f"soak-{seed}")
               for pm, (_, policy, seed) in zip(models, plans, strict=True)]
    for worker in workers:
        worker.start()
    # Sample memory while the soak runs (the test's timeout catches a stuck thread).
    period = min(1.0, max(0.05, SOAK_S / 20))
    while alive := [worker for worker in workers if worker.is_alive()]:
        alive[0].join(period)
        samples.append((round(time.monotonic() - started, 1), _rss_mb()))
    elapsed = time.monotonic() - started
    rss_end = _rss_mb()

    assert ledger.failures == [], "\n".join(ledger.failures[:20])
    assert ledger.requests > 0
    for router in (blocking, dropping):
        assert router.live_requests() == ()
        totals = router.metrics()["totals"]
        assert totals["received"] == totals["processed"] + totals["dropped"]
    assert sum(ledger.dropped[name] for name in MAY_DROP) == sum(
        router.metrics()["totals"]["dropped"] - dropped_before[id(router)]
        for router in (blocking, dropping))
    assert blocking.metrics()["totals"]["dropped"] == 0
    for pm in models:
        assert live_hooks(pm.backend.model) == 0
        pm.close()
    blocking.shutdown()
    dropping.shutdown()
    # Every thread started since (router workers, blocking helpers) must end: join
    # each (a generous bound against a hang), then none may be left running.
    started_since = [t for t in threading.enumerate() if t.ident not in threads_before]
    for thread in started_since:
        thread.join(60)
    leaked = [t.name for t in started_since if t.is_alive()]
    assert leaked == [], leaked
    # Flat memory: the second half of the soak grows by less than a few MB (the first
    # half can still fill allocator pools); the whole soak stays bounded.
    middle = next(rss for t, rss in samples if t >= elapsed / 2) if len(samples) > 2 else (
        rss_start)
    growth_second_half = rss_end - middle
    assert growth_second_half < 24, samples
    assert rss_end - rss_start < 96, samples
    records = sum(ledger.records.values())
    figures.add("soak_hf", seconds=round(elapsed, 1), generation_threads=len(workers),
                requests=ledger.requests, records_routed=records,
                records_per_s=round(records / elapsed), dropped_by_policy=dict(
                    (k, v) for k, v in ledger.dropped.items() if v),
                records_lost=0, rss_start_mb=round(rss_start, 1),
                rss_end_mb=round(rss_end, 1),
                rss_growth_second_half_mb=round(growth_second_half, 1))
