"""Item 4 (HF backend): interruption mid-generation. A KeyboardInterrupt or an
exception from a probe, from the main thread at a random moment, from a streaming
consumer or from a result callback: it reaches the caller at once, every hook is
removed, the router holds no live request and its accounting balances, and the
same ``ProbedModel`` then generates exactly what it generated before.

Every Ctrl-C trial must land inside the call it targets, on any machine: the
probe that schedules it holds generation until it has been sent (see
``CtrlCSoon``). The vLLM backend's interruption tests run in their own process:
``vllm_engine_reliability.py``, started by ``test_vllm_reliability.py``."""

from __future__ import annotations

import gc
import logging
import random
import sys
import threading
import time
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from reliability_support import (  # noqa: E402
    TEST_PROBES,
    Interrupts,
    interrupted_by_ctrl_c,
    live_hooks,
    point,
    prompt,
    record_idle_waits,
)

from undercurrent import ProbedModel  # noqa: E402

PROMPTS = [prompt(1, 2, 3), prompt(4, 5), prompt(6, 7, 8, 9)]
NEW = 12
SPEC = [point("inline", probe_type="recorder"),
        point("async", probe_type="recorder", execution_mode="async"),
        point("blocking", probe_type="recorder", layers=(1,),
              intervention={"mode": "block_until_signal", "timeout_ms": 5000}),
        point("interrupts", probe_type="interrupts", probe_args={"at": 3})]


@pytest.fixture(autouse=True)
def _disarmed(caplog: pytest.LogCaptureFixture) -> Any:
    caplog.set_level(logging.CRITICAL, logger="undercurrent.router")
    Interrupts.armed.clear()
    yield
    Interrupts.armed.clear()


@pytest.fixture(scope="module")
def probed(tiny: tuple[Any, Any]) -> Any:
    model, tokenizer = tiny
    with ProbedModel(model, tokenizer, spec=SPEC, probes=TEST_PROBES) as pm:
        yield pm


@pytest.fixture(scope="module")
def baseline(tiny: tuple[Any, Any]) -> list[Any]:
    """A fresh ProbedModel's outputs for the same prompts (the oracle)."""
    model, tokenizer = tiny
    with ProbedModel(model, tokenizer, spec=SPEC, probes=TEST_PROBES) as pm:
        return pm.generate(PROMPTS, max_new_tokens=NEW)


def _verdicts(outputs: list[Any]) -> list[dict[str, Any]]:
    return [{name: result.verdict for name, result in output.results.items()}
            for output in outputs]


def assert_clean_and_healthy(pm: Any, baseline: list[Any]) -> None:
    """No hook, no live request, balanced totals, and the next generation equals the
    oracle's tokens and every probe's verdict."""
    assert live_hooks(pm.backend.model) == 0
    assert pm.router.live_requests() == ()
    totals = pm.router.metrics()["totals"]
    assert totals["received"] == totals["processed"] + totals["dropped"], totals
    assert not [t for t in threading.enumerate() if t.name.startswith("undercurrent-stream")]
    again = pm.generate(PROMPTS, max_new_tokens=NEW)
    assert [o.token_ids for o in again] == [o.token_ids for o in baseline]
    assert _verdicts(again) == _verdicts(baseline)


def test_a_ctrl_c_raised_in_a_gc_callback_is_lost_so_none_runs_in_these_tests(monkeypatch):
    # What CPython does with an exception from a garbage-collector callback: it
    # is reported as unraisable and dropped, and the collection returns. A
    # simulated Ctrl-C landing there (hypothesis installs a callback once a
    # property test has run) would never reach the generation it targets.
    assert gc.callbacks == []  # (conftest: ctrl_c_not_lost_in_gc_callbacks)
    lost: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: lost.append(raised.exc_type))

    def interrupt(phase: str, info: dict[str, Any]) -> None:
        raise KeyboardInterrupt

    gc.callbacks.append(interrupt)
    try:
        gc.collect()  # returns: neither KeyboardInterrupt reaches this frame
    finally:
        gc.callbacks.remove(interrupt)
    assert lost == [KeyboardInterrupt, KeyboardInterrupt]  # (the collection's start and stop)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("error", ["keyboard", "exit"])
def test_an_interrupt_raised_by_an_inline_probe_reaches_the_caller_at_once(
        tiny, probed, baseline, error, figures, monkeypatch) -> None:
    expected = KeyboardInterrupt if error == "keyboard" else SystemExit
    model, tokenizer = tiny
    idle = record_idle_waits(monkeypatch)
    Interrupts.armed.set()
    with ProbedModel(model, tokenizer, spec=[*SPEC[:3], point(
            "interrupts", probe_type="interrupts", probe_args={"at": 3, "error": error})],
                     router=probed.router) as pm:
        started = time.perf_counter()
        with pytest.raises(expected):
            pm.generate(PROMPTS, max_new_tokens=NEW)
        elapsed = time.perf_counter() - started
    # Before the fix the interrupted call left a binding marked busy, and ending the
    # requests waited for it until the router's drain timeout gave up.
    assert idle and all(idle), idle
    assert_clean_and_healthy(probed, baseline)
    figures.add("interruption", **{f"probe_{error}_to_caller_s": round(elapsed, 3)})


@pytest.mark.timeout(120)
def test_an_interrupt_ends_every_request_without_waiting_for_async_queues(tiny) -> None:
    # An async probe that never returns on its own, and a drain timeout far past
    # the test's: the interrupt reaches the caller without draining (each request
    # waited for the whole timeout in turn), with every request ended and every
    # record counted, and the model is clean for the next call.
    from reliability_support import Hangs

    from undercurrent.router import Router

    model, tokenizer = tiny
    router = Router(probes=TEST_PROBES, drain_timeout_s=3600.0)
    spec = [point("hung", probe_type="hangs", execution_mode="async"),
            point("interrupts", probe_type="interrupts", probe_args={"at": 3})]
    Hangs.release.clear()
    Interrupts.armed.set()
    try:
        with ProbedModel(model, tokenizer, spec=spec, router=router) as pm:
            with pytest.raises(KeyboardInterrupt):
                pm.generate(PROMPTS, max_new_tokens=NEW)
            assert router.live_requests() == () and live_hooks(model) == 0
            totals = router.metrics()["totals"]
            assert totals["dropped"] > 0
            assert totals["received"] == totals["processed"] + totals["dropped"]
    finally:
        Hangs.release.set()
        router.shutdown()


@pytest.mark.timeout(120)
def test_close_from_another_thread_waits_for_the_running_generation(tiny, baseline) -> None:
    # close() while generate() runs in another thread removed the hooks mid-way:
    # the call returned normally with every probe's records cut short. It now
    # waits for the call to end; the outputs equal a fresh model's.
    model, tokenizer = tiny
    pm, reached, release, progress = _gated(model, tokenizer)
    done: dict[str, Any] = {}
    generating = threading.Thread(target=lambda: done.update(
        outputs=pm.generate(PROMPTS, max_new_tokens=NEW, batch_size=1)))  # (every batch)
    generating.start()
    reached.wait()
    closing = threading.Thread(target=lambda: (pm.close(), progress.set()))
    closing.start()
    progress.wait()  # (close() returned, or waits for the call)
    release.set()
    generating.join()
    closing.join()
    assert live_hooks(model) == 0
    assert [o.token_ids for o in done["outputs"]] == [o.token_ids for o in baseline]
    kept = ("inline", "async", "blocking")
    assert [{name: v[name] for name in kept} for v in _verdicts(done["outputs"])] == [
        {name: v[name] for name in kept} for v in _verdicts(baseline)]


def _gated(model: Any, tokenizer: Any) -> tuple[ProbedModel, threading.Event,
                                                 threading.Event, threading.Event]:
    """A ProbedModel of ``SPEC[:3]`` and a ``gate`` point whose probe, at generated
    token 2, sets ``reached`` and waits for ``release``; ``progress`` is set once
    close() waits for its generation."""
    from reliability_support import Recorder

    reached, release, progress = threading.Event(), threading.Event(), threading.Event()

    class Gate(Recorder):
        def on_activation(self, record: Any) -> Any:
            if record.generated_index == 2 and not reached.is_set():
                reached.set()
                release.wait()
            return super().on_activation(record)

    class TellsItWaits(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            progress.set()  # (close() is waiting for the generation)
            return super().wait(timeout)

    pm = ProbedModel(model, tokenizer, spec=[*SPEC[:3], point("gate", probe_type="gate")],
                     probes={**TEST_PROBES, "gate": Gate})
    pm.backend._idle = TellsItWaits()
    return pm, reached, release, progress


def _closing_probe(holder: dict[str, Any]) -> type:
    """A probe that closes ``holder["pm"]`` at generated token 1."""
    from reliability_support import Recorder

    class Closes(Recorder):
        def on_activation(self, record: Any) -> Any:
            if record.generated_index == 1:
                holder["pm"].close()
            return super().on_activation(record)

    return Closes


@pytest.mark.timeout(120)  # (a hang guard)
def test_close_from_inside_the_model_s_own_generation_is_refused(tiny) -> None:
    # (waiting there would wait for itself)
    model, tokenizer = tiny
    holder: dict[str, Any] = {}
    Closes = _closing_probe(holder)
    with ProbedModel(model, tokenizer, spec=[point("closes", probe_type="closes")],
                     probes={"closes": Closes}) as pm:
        holder["pm"] = pm
        # (with a finished stream held, not read to its end, too: as on vLLM, where
        # close() took it for a stream suspended on this thread and waited for good)
        held = pm.stream(PROMPTS[0], max_new_tokens=4)
        for held_stream in (None, held):
            if held_stream is not None:
                assert next(event for event in held_stream if event.finished).output
            (output,) = pm.generate(PROMPTS[:1], max_new_tokens=4)
            assert "close() was called from inside this model's own generation" in str(
                output.results["closes"].error)
    assert live_hooks(model) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", [
    {"execution_mode": "async"},
    {"intervention": {"mode": "block_until_signal", "timeout_ms": 60_000}}])
def test_close_from_a_probe_on_the_router_s_threads_is_refused_while_generating(
        tiny, where) -> None:
    # An async probe (on a worker thread) or a blocking one (on its helper thread)
    # that closed the model mid-generation was not refused: close() waited for the
    # generation, which waited for that probe (the drain at the request's end, or
    # the blocking timeout), and the probe's results were lost.
    model, tokenizer = tiny
    holder: dict[str, Any] = {}
    Closes = _closing_probe(holder)
    with ProbedModel(model, tokenizer, spec=[point("closes", probe_type="closes", **where)],
                     probes={"closes": Closes}) as pm:
        holder["pm"] = pm
        (output,) = pm.generate(PROMPTS[:1], max_new_tokens=4)
        result = output.results["closes"]
        assert "close() was called from a probe's thread" in str(result.error)
        assert result.stats.received == result.stats.processed == 3  # (one per token fed)
        assert not pm._closed  # (refused: the model still generates)
        again = pm.generate(PROMPTS[:1], max_new_tokens=4)[0]
        assert again.token_ids == output.token_ids
    assert live_hooks(model) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", [
    {"execution_mode": "async"},
    {"intervention": {"mode": "block_until_signal", "timeout_ms": 60_000}}])
def test_close_from_another_model_s_probe_thread_waits_for_the_generation(tiny, where) -> None:
    # A probe of model A (on an async worker, or a blocking probe's helper) closing
    # model B while B generates was refused as if B's generation could wait for it,
    # but B never waits for A's probes: close() waits for B's call, as from any
    # other thread, and B's outputs are whole.
    import copy

    from reliability_support import Recorder

    model, tokenizer = tiny
    other = copy.deepcopy(model)
    pm_b, reached, release, progress = _gated(other, tokenizer)
    closed: dict[str, Any] = {}

    class ClosesB(Recorder):
        def on_activation(self, record: Any) -> Any:
            if not closed:
                closed["at"] = record.generated_index
                try:
                    pm_b.close()
                except Exception as error:  # noqa: BLE001 - the test reads it
                    closed["error"] = error
                finally:
                    progress.set()
            return super().on_activation(record)

    with ProbedModel(other, tokenizer, spec=SPEC[:3], probes=TEST_PROBES) as fresh:
        baseline = fresh.generate(PROMPTS[:1], max_new_tokens=NEW)
    pm_a = ProbedModel(model, tokenizer, probes={**TEST_PROBES, "closes_b": ClosesB},
                       spec=[point("closes_b", probe_type="closes_b", **where)])
    done: dict[str, Any] = {}
    generating_b = threading.Thread(target=lambda: done.update(
        b=pm_b.generate(PROMPTS[:1], max_new_tokens=NEW)))
    generating_b.start()
    reached.wait()
    generating_a = threading.Thread(target=lambda: done.update(
        a=pm_a.generate(PROMPTS[:1], max_new_tokens=3)))
    generating_a.start()
    progress.wait()  # (close() waits for B's call, or was refused)
    release.set()
    generating_b.join()
    generating_a.join()
    pm_a.close()
    assert "error" not in closed, closed.get("error")
    assert pm_b._closed and live_hooks(other) == 0
    assert done["a"][0].results["closes_b"].error is None
    assert [o.token_ids for o in done["b"]] == [o.token_ids for o in baseline]
    assert done["b"][0].results["inline"].verdict == baseline[0].results["inline"].verdict


@pytest.mark.timeout(600)
def test_ctrl_c_at_random_moments_always_leaves_a_clean_reusable_model(tiny, probed, baseline,
                                                                       figures) -> None:
    model, tokenizer = tiny
    spec = [*SPEC[:3], point("ctrl_c", probe_type="ctrl_c_soon")]
    with ProbedModel(model, tokenizer, spec=spec, probes=TEST_PROBES) as pm:
        reference = pm.generate(PROMPTS, max_new_tokens=NEW)
        assert [o.token_ids for o in reference] == [o.token_ids for o in baseline]
        rng = random.Random(2024)
        landed = 0
        trials = 12
        for _ in range(trials):
            at = rng.randrange(0, NEW - 3)
            landed += interrupted_by_ctrl_c(
                lambda: pm.generate(PROMPTS, max_new_tokens=NEW),
                at, rng.uniform(0.0, 0.002), fence=rng.randrange(at + 1, NEW - 1))
            assert live_hooks(model) == 0 and pm.router.live_requests() == ()
            totals = pm.router.metrics()["totals"]
            assert totals["received"] == totals["processed"] + totals["dropped"], totals
            again = pm.generate(PROMPTS, max_new_tokens=NEW)
            assert [o.token_ids for o in again] == [o.token_ids for o in baseline]
            assert [o.results["inline"].verdict for o in again] == [
                o.results["inline"].verdict for o in baseline]
    # The fence holds generation until the Ctrl-C has been sent: every one lands.
    assert landed == trials, f"only {landed} of {trials} interrupts hit a generation"
    assert_clean_and_healthy(probed, baseline)
    figures.add("interruption", random_ctrl_c_trials=trials, random_ctrl_c_mid_generation=landed)


def _consume(pm: Any, how: str) -> list[int]:
    """Iterate a stream and stop after three tokens in the way ``how`` says. The
    stream is referenced by the loop alone, as in ``for event in pm.stream(...)``."""
    seen: list[int] = []
    if how == "close":
        stream = pm.stream(PROMPTS[0], max_new_tokens=NEW)
        for event in stream:
            seen.append(event.token_id)
            if len(seen) == 3:
                stream.close()
        return seen
    for event in pm.stream(PROMPTS[0], max_new_tokens=NEW):
        seen.append(event.token_id)
        if len(seen) == 3 and how != "all":
            if how == "RuntimeError":
                raise RuntimeError("consumer failed")
            if how == "KeyboardInterrupt":
                raise KeyboardInterrupt
            break  # "break": the generator is dropped with the loop
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["RuntimeError", "KeyboardInterrupt", "close", "break"])
def test_a_streaming_consumer_that_fails_or_stops_early_leaves_nothing_behind(
        probed, baseline, how) -> None:
    if how in ("RuntimeError", "KeyboardInterrupt"):
        with pytest.raises((RuntimeError, KeyboardInterrupt)):
            _consume(probed, how)
    else:
        assert _consume(probed, how) == list(baseline[0].token_ids[:3])
    assert_clean_and_healthy(probed, baseline)
    events = list(probed.stream(PROMPTS[0], max_new_tokens=NEW))
    assert [e.token_id for e in events[:-1]] == list(baseline[0].token_ids)
    assert events[-1].finished and events[-1].output.token_ids == baseline[0].token_ids


@pytest.mark.timeout(120)
def test_a_stream_collected_on_its_own_generation_thread_cleans_up(tiny, monkeypatch) -> None:
    # A stream dropped inside a reference cycle is finalised by whichever thread the
    # collector runs on: on its own worker (a probe allocating), its cleanup joined
    # that very thread ("cannot join current thread") and left its entry behind.
    from reliability_support import Recorder

    from undercurrent.adapters.hf import backend

    model, tokenizer = tiny
    dropped = threading.Event()
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    class Collects(Recorder):
        def on_activation(self, record: Any) -> Any:
            if record.generated_index == 3:
                dropped.wait()
                gc.collect()  # (what an automatic collection on this thread does)
            return super().on_activation(record)

    with ProbedModel(model, tokenizer, spec=[point("collects", probe_type="collects")],
                     probes={"collects": Collects}) as pm:
        gc.disable()
        try:
            stream = pm.stream(PROMPTS[0], max_new_tokens=NEW)
            next(stream)
            ((_, worker),) = backend._LIVE_STREAMS
            cycle: list[Any] = [stream]
            cycle.append(cycle)
            del stream, cycle
            dropped.set()
            worker.join()
        finally:
            gc.enable()
        assert unraisable == []
        assert backend._LIVE_STREAMS == set()
        assert len(pm.generate(PROMPTS[:1], max_new_tokens=NEW)[0].token_ids) == NEW


@pytest.mark.timeout(360)
def test_ctrl_c_while_consuming_a_stream_leaves_nothing_behind(tiny, probed, baseline,
                                                               figures) -> None:
    model, tokenizer = tiny
    spec = [*SPEC[:3], point("ctrl_c", probe_type="ctrl_c_soon")]
    rng = random.Random(7)
    trials, landed = 6, 0
    with ProbedModel(model, tokenizer, spec=spec, probes=TEST_PROBES) as pm:
        for _ in range(trials):
            at = rng.randrange(0, NEW - 3)
            landed += interrupted_by_ctrl_c(lambda: _consume(pm, "all"), at,
                                            rng.uniform(0.0, 0.002),
                                            fence=rng.randrange(at + 1, NEW - 1))
            assert live_hooks(model) == 0 and pm.router.live_requests() == ()
            assert not [t for t in threading.enumerate()
                        if t.name.startswith("undercurrent-stream")]
            events = list(pm.stream(PROMPTS[0], max_new_tokens=NEW))
            assert events[-1].output.token_ids == baseline[0].token_ids
    assert landed == trials, f"only {landed} of {trials} interrupts hit a stream"
    assert_clean_and_healthy(probed, baseline)
    figures.add("interruption", stream_ctrl_c_trials=trials, stream_ctrl_c_mid_stream=landed)


@pytest.mark.timeout(180)
def test_a_failing_result_callback_propagates_and_ends_every_request(tiny, probed,
                                                                    baseline) -> None:
    calls = []

    def on_result(result: Any) -> None:
        calls.append(result.request_id)
        raise RuntimeError("callback failed")

    model, tokenizer = tiny
    with ProbedModel(model, tokenizer, spec=SPEC, router=probed.router,
                     on_result=on_result) as pm:
        with pytest.raises(RuntimeError, match="callback failed"):
            pm.generate(PROMPTS, max_new_tokens=NEW)
    assert len(calls) == 1
    # Before the fix the other two requests of the batch stayed live in the router.
    assert_clean_and_healthy(probed, baseline)
