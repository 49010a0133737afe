"""Where one generation's overhead goes, stage by stage, without a profiler:
``python -m benchmarks.stage_timers --batch 64 --scenario uc_inline_linear``.

Wraps the capture path's stages (planning, the forward hooks, delivery, routing,
registering and ending requests, the async workers' calls) with timers, runs the
scenario (after warm-ups) and the plain baseline interleaved, and prints each
stage's total per generation and per captured vector, its calls and its time
per call (medians over ``--repeats`` runs), the garbage collector's time, and
the time spent around ``model.generate()``. It also times the model's inner
forwards (its decoder: the layers and the hooks on them) in the probed and
the plain runs alike, and prints them and the rest of each generation side by
side: where the two differ says whether the overhead is in the forwards or in
the Python work before, between and after them. cProfile (``benchmarks.profile``) counts calls
exactly but inflates Python-heavy code; these timers add one wrapper call per
stage call instead. Stages nest (delivery contains routing), so totals do not
add up. ``--thread-time`` measures each stage in its thread's CPU time, which
leaves out waiting for the interpreter lock (useful with async workers).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.allocator import steady_allocator
from benchmarks.measure import per_vector
from benchmarks.models import MODEL_KEYS_HELP, load_model, model_key
from benchmarks.scenarios import scenario_by_name
from benchmarks.scenarios.base import make_batch
from benchmarks.worker import layers_for, prompts_for, set_threads

#: (module, class or None, function, label): the stages timed, in the order a
#: generation reaches them; a label's indent says which stage above holds it.
STAGES = (
    ("transformers.generation.utils", "GenerationMixin", "generate",
     "model.generate() (the model, the hooks and the callbacks)"),
    ("undercurrent.adapters.session", "CaptureSession", "open_requests", "register requests"),
    ("undercurrent.router.router", "Router", "register_requests",
     "  with the router (probes bound and started)"),
    ("undercurrent.adapters.hf.backend", "_RowDriver", "plan_forward", "plan a forward"),
    ("undercurrent.adapters.session", "StepPlan", "shifted",
     "  the last plan, one token later"),
    ("undercurrent.adapters.hf.backend", "_RowDriver", "after_forward",
     "deliver a forward (all below)"),
    ("undercurrent.adapters.delivery", "_Window", "take", "  hold a steady step as it comes"),
    ("undercurrent.router.router", "Router", "window_room",
     "    room left in the async queues (a window that may grow)"),
    ("undercurrent.adapters.hf.backend", "_RowDriver", "after_token", "read sampled tokens"),
    ("undercurrent.adapters.session", "CaptureSession", "close_request", "end requests"),
    ("undercurrent.adapters.session", "CaptureSession", "close_requests", "end requests"),
    ("undercurrent.adapters.delivery", "_Window", "route", "  route the window held back"),
    ("undercurrent.router.router", "Router", "route_columns", "  route a point's batch"),
    ("undercurrent.probes.linear", "LinearReadout", "_score_whole",
     "    linear scores (the rows as float64, one product)"),
    ("undercurrent.probes.trajectory", "TrajectoryProbe", "row_values",
     "    trajectory: the rows' values (norms or scores)"),
    ("undercurrent.probes.trajectory", "TrajectoryProbe", "judge_many",
     "    trajectory: running statistics and summaries (judge_many)"),
    ("undercurrent.router.binding", "Binding", "admit_together",
     "    admit a group's bindings"),
    ("undercurrent.probes.scoring", "ScoreSummary", "batch_signals_many",
     "    thresholds and summaries (judge_many)"),
    ("undercurrent.router.binding", "Binding", "finish_together",
     "    settle a group's bindings"),
    ("undercurrent.router.binding", "Binding", "enqueue_together", "    queue (async)"),
    ("undercurrent.router.binding", "Binding", "enqueue_batch", "    queue (async)"),
    ("undercurrent.router.router", "Router", "end_requests",
     "  end them in the router (verdicts, results)"),
    ("undercurrent.router.scheduler", "AsyncScheduler", "_run_group", "workers: judge together"),
    ("undercurrent.router.binding", "Binding", "take_together",
     "  take the group's queued rows (every binding at once)"),
    ("undercurrent.router.binding", "Binding", "take_queued_rows",
     "  take each binding's queued rows (where not at once)"),
    ("undercurrent.router.scheduler", None, "_judge_taken",
     "  the turn's values and judgements (in the trajectory stages above)"),
    ("undercurrent.router.binding", "Binding", "finish_ranges_together",
     "    settle the group's bindings (at once)"),
    ("undercurrent.router.binding", "Binding", "finish_ranges",
     "    settle each binding (where not at once)"),
    ("undercurrent.router.scheduler", "AsyncScheduler", "_run_batch", "workers: judge one"),
)


@contextlib.contextmanager
def timed_stages(totals: collections.Counter[str],
                 clock: Callable[[], float] = time.perf_counter,
                 calls: collections.Counter[str] | None = None,
                 stages: tuple[tuple[str, str | None, str, str], ...] = STAGES
                 ) -> Iterator[None]:
    """Inside the block, every stage (of :data:`STAGES`, or ``stages`` in that
    form) adds its time to ``totals[label]`` (and one to ``calls[label]``, when
    given); the original functions are back afterwards."""
    counted = calls if calls is not None else collections.Counter()
    restore: list[tuple[Any, str, Any]] = []
    try:
        for module_name, owner, name, label in stages:
            target: Any = importlib.import_module(module_name)
            if owner is not None:
                target = getattr(target, owner)
            original = vars(target).get(name)  # None: inherited, deleted again after
            function = getattr(target, name)

            @functools.wraps(function)
            def timed(*args: Any, _function: Any = function, _label: str = label,
                      **kwargs: Any) -> Any:
                started = clock()
                try:
                    return _function(*args, **kwargs)
                finally:
                    totals[_label] += clock() - started
                    counted[_label] += 1

            restore.append((target, name, original))
            setattr(target, name, staticmethod(timed)
                    if isinstance(original, staticmethod) else timed)
        yield
    finally:
        for target, name, original in reversed(restore):
            if original is None:
                delattr(target, name)
            else:
                setattr(target, name, original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stage_timers",
                                     description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--scenario", default="uc_inline_linear")
    parser.add_argument("--layers", default="all", choices=["3", "all"])
    parser.add_argument("--model", default="tiny", type=model_key,
                        help=MODEL_KEYS_HELP)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--thread-time", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="the model's dtype (default: float32)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1; 0: torch's default)")
    parser.add_argument("--default-allocator", action="store_true",
                        help="glibc's default heap instead of a steady one "
                        "(benchmarks/allocator.py)")
    args = parser.parse_args(argv)
    if not args.default_allocator:
        steady_allocator()
    set_threads(args.threads or None)
    totals: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    with timed_stages(totals, time.thread_time if args.thread_time else time.perf_counter,
                      calls):
        return _measure(args, totals, calls)


@contextlib.contextmanager
def collector_time() -> Iterator[list[Any]]:
    """Inside the block, the garbage collector's seconds and collections add up
    in the list yielded (``[seconds, collections]``; reset it to start over)."""
    collected: list[Any] = [0.0, 0]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collected[0] += time.perf_counter() - started[0]
            collected[1] += 1

    gc.callbacks.append(on_gc)
    try:
        yield collected
    finally:
        gc.callbacks.remove(on_gc)


@contextlib.contextmanager
def timed_forwards(model: Any, clock: Callable[[], float] = time.perf_counter
                   ) -> Iterator[list[Any]]:
    """Inside the block, the seconds and calls of ``model`` 's inner forwards
    (``model.base_model``, its decoder, when it has one; else ``model``'s own)
    add up in the list yielded (``[seconds, forwards]``; reset it to start
    over). Timed by a forward pre-hook and a forward hook on that module,
    removed afterwards; the decoder's own hooks (the capture's, on its
    layers) run inside what is timed."""
    inner = getattr(model, "base_model", None)
    module = inner if inner is not None else model
    timed: list[Any] = [0.0, 0]
    started = [0.0]

    def before(module: Any, args: Any) -> None:
        started[0] = clock()

    def after(module: Any, args: Any, output: Any) -> None:
        timed[0] += clock() - started[0]
        timed[1] += 1

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield timed
    finally:
        for handle in handles:
            handle.remove()


def _measure(args: argparse.Namespace, totals: collections.Counter[str],
             calls: collections.Counter[str]) -> int:
    with collector_time() as collected:
        return _run(args, totals, calls, collected)


def _run(args: argparse.Namespace, totals: collections.Counter[str],
         calls: collections.Counter[str], collected: list[Any]) -> int:
    bundle = load_model(args.model, args.device, args.dtype)
    layers = layers_for(bundle, args.layers)
    batch = make_batch(bundle, prompts_for(args.batch))
    probed = scenario_by_name(args.scenario)()
    probed.setup(bundle, bundle.model, layers)
    plain = scenario_by_name("plain_generate")()
    plain.setup(bundle, bundle.model, layers)
    for _ in range(2):
        probed.generate(batch, args.max_new_tokens)
        plain.generate(batch, args.max_new_tokens)
    walls, plains, runs, vectors = [], [], [], 0
    forwards: list[tuple[float, float]] = []  # (probed, plain) inner forwards' seconds
    gc_label = "garbage collection"
    with timed_forwards(bundle.model) as inner:  # (wall time, as the generations')
        for _ in range(args.repeats):
            totals.clear()
            calls.clear()
            collected[:] = [0.0, 0]
            inner[:] = [0.0, 0]
            wall = time.perf_counter()
            run = probed.generate(batch, args.max_new_tokens)
            walls.append(time.perf_counter() - wall)
            vectors = run.records or 0
            kept = {label: (seconds, calls[label]) for label, seconds in totals.items()}
            kept[gc_label] = (collected[0], collected[1])
            inside = totals.get(STAGES[0][3])
            if inside:
                kept["around model.generate() (registering, ending, held windows, texts)"] = (
                    walls[-1] - inside, 1)
            runs.append(kept)
            probed_inner = inner[0]
            inner[:] = [0.0, 0]
            wall = time.perf_counter()
            plain.generate(batch, args.max_new_tokens)
            plains.append(time.perf_counter() - wall)
            forwards.append((probed_inner, inner[0]))
    probed.close()
    plain.close()
    best, best_plain = statistics.median(walls), statistics.median(plains)
    where = ("" if args.device == "cpu" and args.dtype is None
             else f", on {args.device} in {args.dtype or 'float32'}")
    print(f"{args.scenario}{where}, batch {args.batch}, {args.layers} layers, medians of "
          f"{args.repeats} runs: {best * 1e3:.1f} ms, plain generate() {best_plain * 1e3:.1f} ms, "
          f"{vectors} vectors, {per_vector((best - best_plain) * 1e6, vectors, '.1f')} "
          "µs per vector over plain")
    print("| ms per generation | µs per vector | calls | µs per call | stage |")
    print("|---|---|---|---|---|")
    labels = list(dict.fromkeys(label for *_, label in STAGES))
    labels += [label for label in runs[0] if label not in labels]
    for label in labels:
        seconds = statistics.median(run.get(label, (0.0, 0))[0] for run in runs)
        count = statistics.median(run.get(label, (0.0, 0))[1] for run in runs)
        if seconds:
            print(f"| {seconds * 1e3:.2f} | {per_vector(seconds * 1e6, vectors, '.2f')} "
                  f"| {count:g} | {seconds / max(count, 1) * 1e6:.1f} | {label} |")
    probed_in = statistics.median(probed for probed, _ in forwards)
    plain_in = statistics.median(plain for _, plain in forwards)
    probed_out = statistics.median(wall - probed for wall, (probed, _) in zip(walls, forwards,
                                                                             strict=True))
    plain_out = statistics.median(wall - plain for wall, (_, plain) in zip(plains, forwards,
                                                                          strict=True))
    print(f"the model's inner forwards (its decoder, hooks included): probed {probed_in * 1e3:.2f}"
          f" ms, plain {plain_in * 1e3:.2f} ms; the rest of a generation: probed "
          f"{probed_out * 1e3:.2f} ms, plain {plain_out * 1e3:.2f} ms (medians, wall time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
