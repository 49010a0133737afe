"""Item 2: bad probes, end to end through ``ProbedModel`` on a tiny model.

Probes that raise in each hook, return garbage, hang or crawl: generation
completes (or aborts exactly as the intervention policy says), every other
probe's result is intact, each error lands on its own result, and timeouts fire
on time. The oracle for "generation completes unchanged" is the same prompts
generated with only the well-behaved probe attached."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from reliability_support import (  # noqa: E402
    TEST_PROBES,
    Hangs,
    check_accounting,
    live_hooks,
    point,
    prompt,
)

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.records import ProbeSignal  # noqa: E402
from undercurrent.router import Router, RouterError  # noqa: E402

PROMPTS = [prompt(1, 2, 3), prompt(4, 5), prompt(6, 7, 8, 9)]
NEW = 6


@pytest.fixture(autouse=True)
def _quiet_probe_warnings(caplog: pytest.LogCaptureFixture) -> None:
    # The router logs the first error of each probe with its traceback: expected here.
    caplog.set_level(logging.CRITICAL, logger="undercurrent.router")


@pytest.fixture(scope="module")
def baseline(tiny: tuple[Any, Any]) -> list[Any]:
    model, tokenizer = tiny
    with ProbedModel(model, tokenizer, spec=[point("good", probe_type="recorder")],
                     probes=TEST_PROBES) as pm:
        return pm.generate(PROMPTS, max_new_tokens=NEW)


def _good_is_intact(output: Any, reference: Any) -> None:
    """The well-behaved probe saw every generated token fed back, in order."""
    good = output.results["good"]
    assert good.error is None and good.stats.errors == 0 and good.stats.dropped == 0
    assert good.verdict == reference.results["good"].verdict
    assert [s.score for s in good.signals] == [float(i) for i in good.verdict["seen"]]


def _clean(pm: ProbedModel, model: Any) -> None:
    assert live_hooks(model) == 0
    assert pm.router.live_requests() == ()


def test_probes_raising_in_each_hook_never_touch_generation_or_other_results(
        tiny, baseline, figures) -> None:
    model, tokenizer = tiny
    spec = [point("good", probe_type="recorder"),
            point("on_start", probe_type="raises_on_start"),
            point("on_activation", probe_type="raises_on_activation",
                  probe_args={"from_index": 1}),
            point("on_end", probe_type="raises_on_end"),
            point("async_on_activation", probe_type="raises_on_activation",
                  execution_mode="async"),
            point("blocking_on_activation", probe_type="raises_on_activation",
                  intervention={"mode": "block_until_signal", "timeout_ms": 2000})]
    with ProbedModel(model, tokenizer, spec=spec, probes=TEST_PROBES) as pm:
        outputs = pm.generate(PROMPTS, max_new_tokens=NEW)
        _clean(pm, model)
    faults = 0
    for output, reference in zip(outputs, baseline, strict=True):
        assert output.token_ids == reference.token_ids and not output.aborted
        _good_is_intact(output, reference)
        for result in output.results.values():
            check_accounting(result)
        results = output.results
        assert results["on_start"].error.startswith("on_start: RuntimeError: broken on_start")
        assert "broken on_activation at token" in results["on_activation"].error
        # It raised from generated index 1 on: the first token's activation still counts.
        assert results["on_activation"].stats.errors == NEW - 2
        assert results["on_activation"].stats.processed == NEW - 1
        assert results["on_end"].error == "on_end: RuntimeError: broken on_end"
        assert results["on_end"].verdict is None and results["on_end"].stats.errors == 1
        assert results["async_on_activation"].stats.errors == NEW - 1
        blocking = results["blocking_on_activation"]
        assert blocking.stats.timeouts == NEW - 1  # each error falls back, reason given
        assert {s.metadata.get("reason") for s in blocking.signals} == {"error"}
        faults += sum(r.stats.errors for r in results.values())
    figures.add("bad_probes", raising_hooks_faults_injected=faults,
                raising_hooks_requests=len(PROMPTS))


@pytest.mark.parametrize("garbage", ["a string", 42, 3.5, True, {"action": "abort"},
                                     [ProbeSignal(action="abort")], object()],
                         ids=["str", "int", "float", "bool", "dict", "list", "object"])
def test_garbage_return_values_are_errors_on_that_result_never_an_abort(
        tiny, baseline, garbage) -> None:
    model, tokenizer = tiny
    spec = [point("good", probe_type="recorder"),
            point("garbage", probe_type="returns_garbage", probe_args={"value": garbage})]
    with ProbedModel(model, tokenizer, spec=spec, probes=TEST_PROBES) as pm:
        outputs = pm.generate(PROMPTS[:2], max_new_tokens=NEW)
        _clean(pm, model)
    for output, reference in zip(outputs, baseline[:2], strict=True):
        assert output.token_ids == reference.token_ids and not output.aborted
        _good_is_intact(output, reference)
        bad = output.results["garbage"]
        check_accounting(bad)
        assert bad.stats.errors == bad.stats.processed == NEW - 1
        assert f"on_activation returned {type(garbage).__name__}" in bad.error
        assert bad.signals == ()


def test_a_probe_raising_in_its_constructor_is_refused_before_generation(tiny) -> None:
    model, tokenizer = tiny
    started: list[str] = []

    class Watched(TEST_PROBES["recorder"]):  # type: ignore[misc,valid-type]
        def on_start(self, ctx: Any) -> None:
            started.append(ctx.request_id)

    spec = [point("good", probe_type="watched"), point("broken", probe_type="raises_in_init")]
    with pytest.raises(RouterError) as caught:  # refused when the ProbedModel is built
        ProbedModel(model, tokenizer, spec=spec, probes={**TEST_PROBES, "watched": Watched})
    message = str(caught.value)
    assert "'broken'" in message and "raises_in_init" in message
    assert "RuntimeError: broken constructor" in message
    assert started == []  # all or nothing: no probe was started
    assert live_hooks(model) == 0


def _timed_generate(pm: ProbedModel, prompts: list[str], new: int) -> tuple[list[Any], float]:
    started = time.perf_counter()
    outputs = pm.generate(prompts, max_new_tokens=new)
    return outputs, time.perf_counter() - started


@pytest.mark.timeout(120)
def test_a_hanging_blocking_probe_times_out_on_time_and_generation_continues(
        tiny, baseline, figures, monkeypatch) -> None:
    from undercurrent.router.binding import Binding

    model, tokenizer = tiny
    timeout_ms = 100
    granted: dict[str, float] = {}
    wait_idle = Binding.wait_idle

    def recording(self: Any, deadline: float) -> bool:
        granted[self.name] = deadline - time.monotonic()
        return wait_idle(self, deadline)

    monkeypatch.setattr(Binding, "wait_idle", recording)
    Hangs.release.clear()
    spec = [point("good", probe_type="recorder"),
            point("hangs", probe_type="hangs",
                  intervention={"mode": "block_until_signal", "timeout_ms": timeout_ms})]
    try:
        with ProbedModel(model, tokenizer, spec=spec, probes=TEST_PROBES) as pm:
            outputs, wall = _timed_generate(pm, PROMPTS[:1], NEW)
            _clean(pm, model)
    finally:
        Hangs.release.set()
    (output,) = outputs
    assert output.token_ids == baseline[0].token_ids and not output.aborted
    _good_is_intact(output, baseline[0])
    hung = output.results["hangs"]
    check_accounting(hung)
    # The first call hangs; every later activation finds the probe busy and falls back
    # after waiting its own deadline. The call still running is counted as dropped.
    assert hung.stats.timeouts == NEW - 1
    assert [s.metadata["reason"] for s in hung.signals] == ["timeout"] + ["busy"] * (NEW - 2)
    assert hung.verdict is None and "on_end was not called" in hung.error
    waits = NEW - 1
    # On time: each fed-back token waited its deadline (a lower bound, which load can
    # only lengthen); none waited for the hung probe itself (the later ones fell back
    # as "busy", above), and ending the request granted it only the short grace (1 s),
    # not the router's drain timeout.
    assert wall >= waits * timeout_ms / 1000
    assert granted["hangs"] <= 1.0, granted
    figures.add("bad_probes", hanging_blocking_timeout_ms=timeout_ms,
                hanging_blocking_wall_s=round(wall, 3),
                hanging_blocking_expected_min_s=round(waits * timeout_ms / 1000 + 1.0, 3))


def test_a_hanging_blocking_probe_with_on_timeout_abort_aborts_at_the_first_token(
        tiny, baseline) -> None:
    model, tokenizer = tiny
    Hangs.release.clear()
    spec = [point("good", probe_type="recorder"),
            point("hangs", probe_type="hangs", intervention={
                "mode": "block_until_signal", "timeout_ms": 50, "on_timeout": "abort"})]
    try:
        with ProbedModel(model, tokenizer, spec=spec, probes=TEST_PROBES) as pm:
            outputs = pm.generate(PROMPTS[:2], max_new_tokens=NEW)
            _clean(pm, model)
    finally:
        Hangs.release.set()
    for output, reference in zip(outputs, baseline[:2], strict=True):
        assert output.aborted and output.finish_reason == "abort"
        assert output.abort.extraction_point_name == "hangs"
        assert output.abort.signal.metadata["reason"] == "timeout"
        # Stopped before its next token: only the first generated token exists.
        assert output.token_ids == reference.token_ids[:1]
        assert output.results["good"].verdict["seen"] == [len(output.prompt_token_ids)]
        for result in output.results.values():
            check_accounting(result)


@pytest.mark.timeout(120)
def test_a_hanging_async_probe_is_cut_at_the_drain_timeout_and_others_are_intact(
        tiny, baseline, figures) -> None:
    model, tokenizer = tiny
    drain_s = 0.5
    Hangs.release.clear()
    router = Router(TEST_PROBES, drain_timeout_s=drain_s)
    spec = [point("good", probe_type="recorder"),
            point("good_async", probe_type="recorder", execution_mode="async"),
            point("hangs", probe_type="hangs", execution_mode="async")]
    try:
        with ProbedModel(model, tokenizer, spec=spec, router=router) as pm:
            outputs, wall = _timed_generate(pm, PROMPTS[:1], NEW)
            _clean(pm, model)
    finally:
        Hangs.release.set()
        router.shutdown(wait=False)
    (output,) = outputs
    assert output.token_ids == baseline[0].token_ids
    _good_is_intact(output, baseline[0])
    # The async twin of the good probe is served by other workers: all its records.
    assert output.results["good_async"].verdict == baseline[0].results["good"].verdict
    hung = output.results["hangs"]
    check_accounting(hung)
    assert hung.stats.processed == 0 and hung.stats.dropped == NEW - 1
    assert "drain timed out after 0.5s" in hung.error and hung.verdict is None
    assert drain_s <= wall < drain_s + 5.0, wall
    figures.add("bad_probes", hanging_async_drain_timeout_s=drain_s,
                hanging_async_generate_wall_s=round(wall, 3))


@pytest.mark.timeout(120)
def test_a_very_slow_async_probe_never_slows_generation_and_drops_only_by_policy(
        tiny, baseline, figures) -> None:
    model, tokenizer = tiny
    new = 12
    fast = [point("good", probe_type="recorder")]
    with ProbedModel(model, tokenizer, spec=fast, probes=TEST_PROBES) as pm:
        _, plain_wall = _timed_generate(pm, PROMPTS, new)
    slow_s = 0.25
    spec = [*fast, point("slow", probe_type="sleeps", probe_args={"seconds": slow_s},
                         execution_mode="async", queue_depth=2)]
    router = Router(TEST_PROBES, drain_timeout_s=30)
    with ProbedModel(model, tokenizer, spec=spec, router=router) as pm:
        outputs, wall = _timed_generate(pm, PROMPTS, new)
        _clean(pm, model)
    router.shutdown()
    dropped = 0
    for output in outputs:
        assert output.results["good"].stats.dropped == 0
        slow = output.results["slow"]
        check_accounting(slow)
        assert slow.error is None and slow.stats.received == new - 1
        # drop_oldest keeps the newest records: the last activation is always processed.
        assert slow.verdict["seen"][-1] == len(output.prompt_token_ids) + new - 2
        dropped += slow.stats.dropped
    assert dropped > 0
    # Generation itself never waited on the slow probe; only draining 2 queued records
    # per request (at slow_s each, on shared workers) is added at the end.
    processed = sum(o.results["slow"].stats.processed for o in outputs)
    assert wall < plain_wall + processed * slow_s + 3.0
    figures.add("bad_probes", slow_async_s_per_record=slow_s, slow_async_dropped=dropped,
                slow_async_processed=processed, slow_async_wall_s=round(wall, 3),
                plain_wall_s=round(plain_wall, 3))
