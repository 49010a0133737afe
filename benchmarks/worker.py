"""Jobs that run inside a fresh child process: one timing job per model, one memory job
per (model, batch size, scenario).

Timing interleaves every scenario in each round (rotating the order between
rounds) so drifting machine load hits all of them alike; overhead ratios are
paired per round. Memory needs a process of its own per scenario, since freed
memory that the allocator keeps would otherwise hide the next scenario's growth.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import time
import traceback
from typing import Any

from benchmarks.allocator import steady_allocator
from benchmarks.measure import (
    FirstForwardClock,
    GenerationRun,
    current_rss_bytes,
    peak_rss_bytes,
    reset_peak_rss,
)
from benchmarks.models import PROMPTS, ModelBundle, load_model, synchronize
from benchmarks.scenarios import Batch, Scenario, scenario_by_name
from benchmarks.scenarios.base import make_batch

MIB = 1024 * 1024


def prompts_for(batch_size: int) -> list[str]:
    """The first ``batch_size`` fixed prompts (cycled when more are asked for)."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]


def _timed(scenario: Scenario, clock: FirstForwardClock, batch: Batch,
           max_new_tokens: int) -> tuple[GenerationRun, float, float, float | None]:
    synchronize(scenario.model)  # on CUDA: nothing of the last run still queued
    cpu_start = time.process_time()
    start = clock.start()
    run = scenario.generate(batch, max_new_tokens)
    synchronize(scenario.model)
    wall = time.perf_counter() - start
    return run, wall, time.process_time() - cpu_start, clock.time_to_first_token


def _sample(run: GenerationRun, wall: float, cpu: float, ttft: float | None) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "ttft_s": ttft,
        "new_tokens": sum(len(ids) for ids in run.token_ids),
        "records": run.records,
        "captured_bytes": run.captured_bytes,
        "notes": run.notes,
    }


def _prepare(names: list[str], bundle: ModelBundle, layers: tuple[int, ...] | None = None,
             ) -> tuple[dict[str, Any], dict[str, str]]:
    """Set up every runnable scenario capturing ``layers`` (default: the bundle's three);
    returns {name: (scenario, clock)} and {name: reason}. Every model gets one clock
    (its only hook outside the scenarios'); :func:`_release` removes them."""
    ready: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    runnable: list[tuple[str, Any, Any]] = []
    for name in names:
        scenario = scenario_by_name(name)()
        reason = scenario.unavailable_reason()
        if reason is not None:
            skipped[name] = f"skipped: {reason}"
            continue
        # (copied before any setup or clock touches the shared model: a copy made
        # later would carry their hooks)
        model = copy.deepcopy(bundle.model) if scenario.own_model else bundle.model
        runnable.append((name, scenario, model))
    clocks: dict[int, FirstForwardClock] = {}
    for name, scenario, model in runnable:
        try:
            scenario.setup(bundle, model, layers or bundle.three_layers)
        except Exception as error:  # a broken alternative must not sink the run
            skipped[name] = f"error in setup: {type(error).__name__}: {error}"
            continue
        if id(model) not in clocks:
            clocks[id(model)] = FirstForwardClock(model)
        ready[name] = (scenario, clocks[id(model)])
    return ready, skipped


def _release(ready: dict[str, Any]) -> None:
    """Close the scenarios and remove their clocks' hooks."""
    clocks = {id(clock): clock for _scenario, clock in ready.values()}
    for scenario, _clock in ready.values():
        scenario.close()
    for clock in clocks.values():
        clock.close()


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads (None keeps torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def _time_cases(ready: dict[str, Any], skipped: dict[str, str], scenarios: list[str],
                batch: Batch, warmup: int, repeats: int,
                max_new_tokens: int) -> list[dict[str, Any]]:
    """``warmup`` + ``repeats`` interleaved rounds of every ready scenario on ``batch``
    (rotating the order each round); one case per scenario. A scenario whose runs
    generate different tokens is an error."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in ready}
    tokens: dict[str, list[list[int]]] = {}
    failed: dict[str, str] = {}
    order = list(ready)
    for round_index in range(warmup + repeats):
        shift = round_index % len(order) if order else 0
        for name in order[shift:] + order[:shift]:
            if name in failed:
                continue
            scenario, clock = ready[name]
            try:
                run, wall, cpu, ttft = _timed(scenario, clock, batch, max_new_tokens)
            except Exception as error:
                failed[name] = f"error: {type(error).__name__}: {error}"
                continue
            # (greedy: every run must give the first run's tokens, which the
            # report compares with the baseline's)
            first = tokens.setdefault(name, run.token_ids)
            if run.token_ids != first:
                failed[name] = (f"error: round {round_index} (warm-up rounds included) "
                                "generated other tokens than the scenario's first run")
                continue
            if round_index >= warmup:
                sample = _sample(run, wall, cpu, ttft)
                sample["round"] = round_index - warmup
                samples[name].append(sample)
    cases: list[dict[str, Any]] = []
    for name in scenarios:
        case: dict[str, Any] = {"scenario": name, "batch_size": batch.size,
                                "prompt_length": batch.prompt_length}
        if name in skipped or name in failed:
            case["status"] = "skipped" if name in skipped else "error"
            case["reason"] = skipped.get(name) or failed[name]
        else:
            case.update(status="ok", samples=samples[name], token_ids=tokens.get(name))
        cases.append(case)
    return cases


def _model_facts(bundle: ModelBundle) -> dict[str, Any]:
    import torch

    device = next(bundle.model.parameters()).device
    accelerator = ({"cuda_device": torch.cuda.get_device_name(device),
                    "torch_cuda": torch.version.cuda} if device.type == "cuda" else {})
    return {
        **accelerator,
        "model_description": bundle.description,
        "num_layers": bundle.num_layers,
        "layers": list(bundle.three_layers),
        "hidden_size": bundle.model.config.hidden_size,
        "parameters": sum(p.numel() for p in bundle.model.parameters()),
        "device": str(device),
        "dtype": str(next(bundle.model.parameters()).dtype).removeprefix("torch."),
    }


def timing_job(model_key: str, batch_sizes: list[int], scenarios: list[str], repeats: int,
               warmup: int, max_new_tokens: int, threads: int | None = None,
               device: str = "cpu", dtype: str | None = None) -> dict[str, Any]:
    """Time every scenario on one model: ``warmup`` + ``repeats`` interleaved rounds."""
    set_threads(threads)
    bundle = load_model(model_key, device, dtype)
    ready, skipped = _prepare(scenarios, bundle)
    cases: list[dict[str, Any]] = []
    for batch_size in batch_sizes:
        batch = make_batch(bundle, prompts_for(batch_size))
        cases += _time_cases(ready, skipped, scenarios, batch, warmup, repeats, max_new_tokens)
    _release(ready)
    return {"model": model_key, **_model_facts(bundle), "cases": cases}


def scaling_job(model_key: str, batch_sizes: list[int], layer_sets: list[str],
                scenarios: list[str], repeats: int, warmup: int, max_new_tokens: int,
                threads: int | None = None, device: str = "cpu",
                dtype: str | None = None) -> dict[str, Any]:
    """The scaling set: for each layer set (``"3"`` or ``"all"``) set every scenario up
    on those layers, then time it at every batch size (interleaved rounds)."""
    set_threads(threads)
    bundle = load_model(model_key, device, dtype)
    cases: list[dict[str, Any]] = []
    for layer_set in layer_sets:
        layers = layers_for(bundle, layer_set)
        ready, skipped = _prepare(scenarios, bundle, layers)
        for batch_size in batch_sizes:
            batch = make_batch(bundle, prompts_for(batch_size))
            for case in _time_cases(ready, skipped, scenarios, batch, warmup, repeats,
                                    max_new_tokens):
                case.update(layer_set=layer_set, capture_layers=list(layers))
                cases.append(case)
        _release(ready)
    return {"model": model_key, **_model_facts(bundle), "cases": cases}


def layers_for(bundle: ModelBundle, layer_set: str) -> tuple[int, ...]:
    """The decoder layers of a layer set: ``"3"`` (first, middle, last) or ``"all"``."""
    if layer_set == "all":
        return tuple(range(bundle.num_layers))
    if layer_set == "3":
        return bundle.three_layers
    raise ValueError(f"unknown layer set {layer_set!r}; expected '3' or 'all'")


def _release_free_memory() -> None:
    gc.collect()
    try:  # hand freed heap back to the kernel so RSS starts from what is live
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def memory_job(model_key: str, batch_size: int, scenario: str, max_new_tokens: int,
               threads: int | None = None) -> dict[str, Any]:
    """Peak RSS of one scenario in this (fresh) process, and its growth while generating."""
    set_threads(threads)
    bundle = load_model(model_key)
    instance = scenario_by_name(scenario)()
    reason = instance.unavailable_reason()
    if reason is not None:
        return {"status": "skipped", "reason": f"skipped: {reason}"}
    instance.setup(bundle, bundle.model, bundle.three_layers)
    batch = make_batch(bundle, prompts_for(batch_size))
    instance.generate(batch, max_new_tokens)  # warm-up: one-time allocations are not growth
    _release_free_memory()
    setup_peak = peak_rss_bytes()
    reset_ok = reset_peak_rss()
    before = current_rss_bytes()
    run = instance.generate(batch, max_new_tokens)
    peak = peak_rss_bytes()
    instance.close()
    return {
        "status": "ok",
        "rss_before_mb": before / MIB,
        "peak_rss_mb": max(peak, setup_peak) / MIB,
        "rss_growth_mb": (peak - before) / MIB if reset_ok else None,
        "captured_mb": run.captured_bytes / MIB,
        "token_ids": run.token_ids,
    }


def child_main(connection: Any, job: str, kwargs: dict[str, Any],
               steady_heap: bool = False) -> None:
    """Entry point of a child process: run ``job`` and send its result (or traceback).
    ``steady_heap``: a timing job runs on a heap that keeps what it frees
    (:func:`benchmarks.allocator.steady_allocator`); a peak-RSS job never does."""
    jobs = {"timing": timing_job, "memory": memory_job, "scaling": scaling_job}
    try:
        if steady_heap and job != "memory":
            steady_allocator()
        if job == "vllm":
            from benchmarks.vllm_jobs import vllm_job

            result = vllm_job(**kwargs)
        elif job == "vllm_paired":
            from benchmarks.vllm_paired import paired_job

            result = paired_job(**kwargs)
        else:
            result = jobs[job](**kwargs)
        connection.send({"ok": True, "result": result})
    except BaseException:
        connection.send({"ok": False, "error": traceback.format_exc()})
    finally:
        connection.close()
