"""Run the benchmarks: ``python -m benchmarks.run [--quick] [--out DIR] [--update-docs]``.

Every job runs in a fresh child process forked from a server that has torch and
transformers imported already: one timing job per model (all scenarios
interleaved), one memory job per (model, batch size, scenario), and the vLLM
jobs in processes of their own. Writes ``results.jsonl``, ``environment.json``,
``summary.md`` and ``overhead.png`` to ``--out``; the scaling set (``benchmarks.scaling``,
skipped by ``--no-scaling``, alone with ``--scaling-only``) adds ``scaling.jsonl``,
``scaling.md``, ``scaling_targets.json`` and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import scaling
from benchmarks.allocator import allocator_label
from benchmarks.environment import describe
from benchmarks.models import MODEL_KEYS_HELP, model_key
from benchmarks.plot import write_depth_plot, write_plot, write_scaling_plot
from benchmarks.report import attach_memory, capture_table, results_table, timing_rows, write_jsonl
from benchmarks.scenarios import SCENARIOS
from benchmarks.targets import evaluate, targets_table

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
QUICK_MEMORY_SCENARIOS = ("plain_generate", "raw_forward_hooks", "uc_3_layers_inline_norm")
DOCS_PLOT = "benchmarks-overhead.png"
DOCS_START, DOCS_END = "<!-- results:start -->", "<!-- results:end -->"
SCALING_PLOT = "benchmarks-scaling.png"
SCALING_START, SCALING_END = "<!-- scaling:start -->", "<!-- scaling:end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` shrinks every dimension for the CI smoke run."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke mode: tiny model, few tokens, 2 repeats, no vLLM")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"),
                        help="output directory (default benchmarks/out)")
    parser.add_argument("--models", nargs="+", type=model_key,
                        help=MODEL_KEYS_HELP)
    parser.add_argument("--batch-sizes", nargs="+", type=int)
    parser.add_argument("--scenarios", nargs="+", choices=[s.name for s in SCENARIOS])
    parser.add_argument("--repeats", type=int, help="timed repeats per scenario")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS jobs")
    parser.add_argument("--threads", type=int,
                        help="torch intra-op threads in each job (default: 1 with --quick, "
                        "else torch's default, one per core)")
    parser.add_argument("--vllm", dest="vllm", action="store_true", default=None,
                        help="run the vLLM scenarios (default: on unless --quick)")
    parser.add_argument("--no-vllm", dest="vllm", action="store_false")
    parser.add_argument("--device", default="cpu",
                        help="where the HF jobs run the model: cpu (default) or cuda; "
                        "every timed generation waits for the device before its clock stops")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="cast the HF jobs' model to this dtype (default float32)")
    parser.add_argument("--default-allocator", action="store_true",
                        help="time with glibc's default heap (page faults and all) instead "
                        "of a steady one, see benchmarks/allocator.py")
    parser.add_argument("--update-docs", action="store_true",
                        help=f"write the summary into {DOCS.name} between its result markers")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: rebuild summary, targets and plot from "
                        "--out's results.jsonl and environment.json")
    parser.add_argument("--job-timeout", type=float, default=None,
                        help="seconds before a stuck child job is killed")
    scaling_choice = parser.add_mutually_exclusive_group()
    scaling_choice.add_argument("--scaling-only", action="store_true",
                                help="run only the scaling set (batch x layers x probe mode)")
    scaling_choice.add_argument("--no-scaling", action="store_true", help="skip the scaling set")
    parser.add_argument("--scaling-batch-sizes", nargs="+", type=int,
                        help="HF batch sizes of the scaling set (default 1 8 32 64; "
                        "2 with --quick)")
    parser.add_argument("--scaling-concurrency", nargs="+", type=int,
                        help="vLLM concurrent requests of the scaling set (default 1 8 64)")
    parser.add_argument("--scaling-models", nargs="+", type=model_key,
                        help="models of the scaling set (default: the bundled tiny model; "
                        f"{MODEL_KEYS_HELP})")
    parser.add_argument("--no-scaling-hf", action="store_true",
                        help="skip the scaling set's HF jobs (with --vllm: its vLLM jobs "
                        "alone)")
    parser.add_argument("--vllm-modes", nargs="+", choices=list(scaling.MODES),
                        help="probe modes of the scaling set's vLLM jobs (default: all); "
                        "the plain engine always runs")
    parser.add_argument("--vllm-rounds", type=int, default=1,
                        help="run the scaling set's vLLM jobs this many times, each time "
                        "every job in a fresh process, plain and probed in turn (plain "
                        "first in odd-numbered rounds, last in even-numbered ones): each "
                        "probed repeat is paired with the plain repeat of its round, so "
                        "the medians span as many process pairs (default 1)")
    parser.add_argument("--no-vllm-one-engine", action="store_true",
                        help="skip the scaling set's one-engine vLLM jobs (inline linear at "
                        "the largest concurrency, plain and probed generations alternating "
                        "on the same engine in one process: benchmarks.vllm_paired), run "
                        "once per --vllm-rounds round")
    parser.add_argument("--vllm-repeats", type=int,
                        help="timed repeats per scenario in each vLLM scaling job (default: "
                        "--repeats); the vLLM target's interval is over process pairs "
                        "(--vllm-rounds), so more rounds tell more than more repeats")
    args = parser.parse_args(argv)
    quick = args.quick
    args.models = args.models or (["tiny"] if quick else ["tiny", "large"])
    args.batch_sizes = args.batch_sizes or [1, 8]
    args.scenarios = args.scenarios or [s.name for s in SCENARIOS]
    args.repeats = args.repeats or (2 if quick else 9)
    args.max_new_tokens = args.max_new_tokens or (8 if quick else 32)
    args.vllm = (not quick) if args.vllm is None else args.vllm
    # Quick mode must stay fast on a busy CI machine: one thread per job (OpenMP
    # barriers on an oversubscribed machine cost more than a tiny model's compute),
    # and peak RSS only for the largest batch and the scenarios the targets use.
    args.threads = args.threads or (1 if quick else None)
    args.memory_batch_sizes = [max(args.batch_sizes)] if quick else args.batch_sizes
    args.memory_scenarios = (
        [s for s in QUICK_MEMORY_SCENARIOS if s in args.scenarios] if quick else args.scenarios
    )
    args.job_timeout = args.job_timeout or (300.0 if quick else 1800.0)
    args.scaling_batch_sizes = args.scaling_batch_sizes or list(
        scaling.QUICK_BATCH_SIZES if quick else scaling.BATCH_SIZES)
    args.scaling_concurrency = args.scaling_concurrency or list(scaling.VLLM_CONCURRENCY)
    args.scaling_models = args.scaling_models or ["tiny"]
    args.vllm_modes = args.vllm_modes or list(scaling.MODES)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (one prefill, one decode step)")
    if args.vllm_rounds < 1:
        parser.error("--vllm-rounds must be at least 1")
    return args


class ChildRunner:
    """Runs one job per fresh child process, with a timeout and crash reporting."""

    def __init__(self, timeout: float, steady_heap: bool = True) -> None:
        self.timeout = timeout
        self.steady_heap = steady_heap
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["benchmarks.preload"])
        self.spawn = multiprocessing.get_context("spawn")

    def run(self, job: str, isolated: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Run ``job`` in a child; ``isolated`` uses a spawned (not forked) process."""
        from benchmarks.worker import child_main

        context = self.spawn if isolated else self.context
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=child_main, args=(send, job, kwargs, self.steady_heap))
        process.start()
        send.close()
        try:
            if receive.poll(self.timeout):
                outcome = receive.recv()
            else:
                process.kill()
                outcome = {"ok": False, "error": f"timed out after {self.timeout:.0f} s"}
        except EOFError:
            outcome = {"ok": False, "error": "child process died without a result"}
        process.join(30)
        if process.is_alive():
            process.kill()
        if process.exitcode not in (0, None) and outcome.get("ok"):
            outcome["exit_code"] = process.exitcode
        return outcome


def log(message: str) -> None:
    """Progress on stderr, with the time since the run started."""
    print(f"[bench {time.perf_counter() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


START = time.perf_counter()


def run_hf(args: argparse.Namespace, runner: ChildRunner) -> tuple[list[dict[str, Any]], list]:
    """Timing and memory jobs for every model; returns rows and job errors."""
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for model in args.models:
        log(f"timing {model}: {len(args.scenarios)} scenarios x batch {args.batch_sizes}, "
            f"{args.repeats} repeats")
        outcome = runner.run("timing", model_key=model, batch_sizes=args.batch_sizes,
                             scenarios=args.scenarios, repeats=args.repeats, warmup=1,
                             max_new_tokens=args.max_new_tokens, threads=args.threads,
                             device=args.device, dtype=args.dtype)
        if not outcome["ok"]:
            errors.append(f"timing job for {model} failed: {outcome['error']}")
            log(errors[-1])
            continue
        model_rows = timing_rows(outcome["result"], args.max_new_tokens)
        if not args.no_memory:
            memory = {}
            for batch in args.memory_batch_sizes:
                for scenario in args.memory_scenarios:
                    if not any(r["scenario"] == scenario and r["status"] == "ok"
                               for r in model_rows):
                        continue
                    log(f"memory {model} batch {batch} {scenario}")
                    outcome = memory[(model, batch, scenario)] = runner.run(
                        "memory", model_key=model, batch_size=batch, scenario=scenario,
                        max_new_tokens=args.max_new_tokens, threads=args.threads)
                    if not outcome["ok"]:
                        errors.append(f"memory job for {model} batch {batch} {scenario} "
                                      f"failed: {outcome['error']}")
                        log(errors[-1])
            attach_memory(model_rows, memory)
        rows += model_rows
    return rows, errors


def run_vllm(args: argparse.Namespace, runner: ChildRunner) -> tuple[list[dict[str, Any]], list]:
    """The vLLM scenarios, each in a spawned process, when the backend is there."""
    from benchmarks.vllm_jobs import (
        VLLM_CONCURRENCY,
        VLLM_SCENARIOS,
        vllm_rows,
        vllm_unavailable_reason,
    )

    reason = vllm_unavailable_reason()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for model in args.models:
        if reason is not None:
            log(f"vLLM skipped: {reason}")
            rows += vllm_rows(model, None, f"skipped: {reason}", args.max_new_tokens)
            continue
        results = {}
        for scenario in VLLM_SCENARIOS:
            log(f"vLLM {model} {scenario}: {VLLM_CONCURRENCY} concurrent requests")
            results[scenario] = runner.run(
                "vllm", isolated=True, scenario=scenario, model_key=model,
                model_root=str(args.out / "models"), repeats=args.repeats,
                max_new_tokens=args.max_new_tokens, threads=args.threads)
            if not results[scenario]["ok"]:
                errors.append(f"vLLM job {model} {scenario} failed: {results[scenario]['error']}")
        rows += vllm_rows(model, results, None, args.max_new_tokens)
    return rows, errors


def run_scaling(args: argparse.Namespace,
                runner: ChildRunner) -> tuple[list[dict[str, Any]], list[str]]:
    """The scaling set: one HF job per model (every layer set, batch and scenario
    interleaved per batch), and with ``--vllm`` one spawned job per (mode, layer set)
    plus the plain engine."""
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for model in args.scaling_models:
        if not args.no_scaling_hf:
            rows += _run_scaling_hf(args, runner, model, errors)
        if args.vllm:
            vllm, vllm_errors = _run_scaling_vllm(args, runner, model)
            rows += vllm
            errors += vllm_errors
    return rows, errors


def _run_scaling_hf(args: argparse.Namespace, runner: ChildRunner, model: str,
                    errors: list[str]) -> list[dict[str, Any]]:
    log(f"scaling {model}: batch {args.scaling_batch_sizes} x layers "
        f"{list(scaling.LAYER_SETS)} x {len(scaling.SCENARIOS)} scenarios, "
        f"{args.repeats} repeats")
    outcome = runner.run("scaling", model_key=model, batch_sizes=args.scaling_batch_sizes,
                         layer_sets=list(scaling.LAYER_SETS),
                         scenarios=list(scaling.SCENARIOS), repeats=args.repeats, warmup=1,
                         max_new_tokens=args.max_new_tokens, threads=args.threads,
                         device=args.device, dtype=args.dtype)
    if not outcome["ok"]:
        errors.append(f"scaling job for {model} failed: {outcome['error']}")
        log(errors[-1])
        return []
    return scaling.hf_rows(outcome["result"], args.max_new_tokens)


def _run_scaling_vllm(args: argparse.Namespace, runner: ChildRunner,
                      model: str) -> tuple[list[dict[str, Any]], list[str]]:
    from benchmarks.vllm_jobs import PLAIN, PROBED, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        log(f"vLLM scaling skipped: {reason}")
        return [], []
    jobs = [(scaling.VLLM_PLAIN, "-", PLAIN, None)] + [
        (mode, layer_set, PROBED, mode)
        for layer_set in scaling.LAYER_SETS for mode in args.vllm_modes]
    rounds: list[dict[tuple[str, str], dict[str, Any]]] = []
    errors = []
    # The target's reading on one engine (benchmarks.vllm_paired): per layer set,
    # one outcome per round.
    top = max(args.scaling_concurrency)
    one_engine: dict[str, list[dict[str, Any]]] = (
        {} if args.no_vllm_one_engine or "inline linear" not in args.vllm_modes
        else {layer_set: [] for layer_set in scaling.LAYER_SETS})
    for number in range(args.vllm_rounds):
        outcomes = {}
        # The plain engine first in even rounds and last in odd ones: a drift
        # along a round (a fresh process after the last one's teardown, the
        # machine's load) then weighs on plain and probed alike.
        for label, layer_set, scenario, mode in (jobs if number % 2 == 0 else jobs[::-1]):
            log(f"vLLM scaling {model} {label} ({layer_set} layers): "
                f"{args.scaling_concurrency} concurrent requests"
                + (f", round {number + 1} of {args.vllm_rounds}" if args.vllm_rounds > 1 else ""))
            outcomes[(label, layer_set)] = runner.run(
                "vllm", isolated=True, scenario=scenario, model_key=model,
                model_root=str(args.out / "models"),
                repeats=args.vllm_repeats or args.repeats,
                max_new_tokens=args.max_new_tokens, threads=args.threads,
                concurrencies=args.scaling_concurrency, mode=mode,
                layer_set="3" if layer_set == "-" else layer_set)
            if not outcomes[(label, layer_set)]["ok"]:
                errors.append(f"vLLM scaling job {model} {label} {layer_set} failed: "
                              f"{outcomes[(label, layer_set)]['error']}")
        rounds.append(outcomes)
        for layer_set in one_engine:
            log(f"vLLM scaling {model} inline linear ({layer_set} layers), one engine: "
                f"{top} concurrent requests"
                + (f", round {number + 1} of {args.vllm_rounds}" if args.vllm_rounds > 1 else ""))
            outcome = runner.run(
                "vllm_paired", isolated=True, model_key=model,
                model_root=str(args.out / "models"), mode="inline linear",
                layer_set=layer_set, concurrency=top,
                repeats=args.vllm_repeats or args.repeats,
                max_new_tokens=args.max_new_tokens, threads=args.threads)
            one_engine[layer_set].append(outcome)
            if not outcome["ok"]:
                errors.append(f"vLLM one-engine job {model} {layer_set} failed: "
                              f"{outcome['error']}")
    outcomes = scaling.pooled_rounds(rounds)
    rows = scaling.vllm_rows(model, outcomes, args.max_new_tokens)
    rows += scaling.one_engine_rows(model, top, one_engine, args.max_new_tokens)
    return rows, errors


def summary_markdown(environment: dict[str, Any], args: argparse.Namespace,
                     rows: list[dict[str, Any]], checks: list[dict[str, Any]],
                     errors: list[str], plot_renderer: str) -> str:
    """The summary: machine and versions, result tables, targets, capture table."""
    versions = ", ".join(f"{k} {v}" for k, v in environment["versions"].items())
    mode = environment.get("mode", "quick (smoke)" if args.quick else "full")
    lines = [
        "## Machine and versions",
        "",
        f"- Run: {environment['date']}, mode {mode}, commit {environment['git_commit']}",
        f"- CPU: {environment['cpu']}, {environment['cpu_count']} cores, "
        f"{environment['memory_gib']} GiB; Python {environment['python']}",
        f"- Load average at start {tuple(round(x, 2) for x in environment['load_average_start'])}"
        f", at end {tuple(round(x, 2) for x in environment['load_average_end'])}",
        f"- Versions: {versions}",
        f"- torch threads per job: {environment['torch_threads']}",
        f"- Allocator in timing jobs: {environment.get('allocator', 'glibc defaults')}",
        f"- Plot: overhead.png ({plot_renderer})",
        "",
        *busy_warning(environment),
        "## Results",
        "",
        *results_table(rows),
        "## Targets (reported, not asserted)",
        "",
        *targets_table(checks),
        "",
        "## What each scenario captured",
        "",
        *capture_table(rows),
        "",
    ]
    if errors:
        lines += ["## Job errors", "", *(f"- {e.strip().splitlines()[-1]}" for e in errors), ""]
    return "\n".join(lines)


def busy_warning(environment: dict[str, Any]) -> list[str]:
    """A warning when other processes loaded the machine during the run."""
    cores = environment.get("cpu_count") or 1
    loads = [*environment["load_average_start"][:1], *environment["load_average_end"][:1]]
    if max(loads) <= cores:
        return []
    return [
        f"**The machine was busy during this run** (1-minute load average up to "
        f"{max(loads):.1f} on {cores} cores): wall times and their spread mostly measure "
        "other processes. Read the CPU-time column, and rerun on a quiet machine for the "
        "wall-time targets.",
        "",
    ]


def update_docs(summary: str, plot: Path) -> None:
    """Replace the text between the result markers of docs/benchmarks.md (headings one
    level down, under the page's own) and copy the plot beside it."""
    shutil.copyfile(plot, DOCS.parent / DOCS_PLOT)
    summary = re.sub(r"^(#+) ", r"\1# ", summary, flags=re.MULTILINE)
    summary += f"\n![Overhead relative to plain generate()]({DOCS_PLOT})\n"
    _replace_between(DOCS_START, DOCS_END, summary)


def update_scaling_docs(summary: str, plot: Path) -> None:
    """Replace the scaling section's generated part and copy its plot beside the page."""
    shutil.copyfile(plot, DOCS.parent / SCALING_PLOT)
    summary += f"\n![Overhead against batch size]({SCALING_PLOT})\n"
    _replace_between(SCALING_START, SCALING_END, summary)


def _replace_between(start: str, end: str, summary: str) -> None:
    text = DOCS.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{DOCS} lacks the {start} / {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    DOCS.write_text(f"{head}{start}\n{summary}\n{end}{tail}")


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]],
                                               list[dict[str, Any]], list[str]]:
    """Run every job; returns the environment, the main and scaling rows, the job errors."""
    environment = describe()
    environment["torch_threads"] = args.threads or "default (one per core)"
    environment["mode"] = "quick (smoke)" if args.quick else "full"
    environment["allocator"] = allocator_label(not args.default_allocator)
    environment["device"], environment["dtype"] = args.device, args.dtype or "float32"
    runner = ChildRunner(args.job_timeout, steady_heap=not args.default_allocator)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    if not args.scaling_only:
        rows, errors = run_hf(args, runner)
        if args.vllm:
            vllm, vllm_errors = run_vllm(args, runner)
            rows += vllm
            errors += vllm_errors
    scaling_rows: list[dict[str, Any]] = []
    if not args.no_scaling:
        scaling_rows, scaling_errors = run_scaling(args, runner)
        errors += scaling_errors
    environment["load_average_end"] = os.getloadavg()
    environment["errors"] = errors
    write_jsonl(args.out / "results.jsonl", rows)
    write_jsonl(args.out / "scaling.jsonl", scaling_rows)
    (args.out / "environment.json").write_text(json.dumps(environment, indent=2) + "\n")
    return environment, rows, scaling_rows, errors


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    """Run everything and write the outputs; exit 1 when a token check failed."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        environment = json.loads((args.out / "environment.json").read_text())
        rows = _read_jsonl(args.out / "results.jsonl")
        scaling_rows = _read_jsonl(args.out / "scaling.jsonl")
        errors = environment.get("errors", [])
    else:
        environment, rows, scaling_rows, errors = measure(args)
    written = []
    if rows:
        checks = evaluate(rows)
        (args.out / "targets.json").write_text(json.dumps(checks, indent=2) + "\n")
        renderer = write_plot(rows, args.out / "overhead.png")
        summary = summary_markdown(environment, args, rows, checks, errors, renderer)
        (args.out / "summary.md").write_text(summary)
        written += ["results.jsonl", "summary.md", "overhead.png"]
        if args.update_docs:
            update_docs(summary, args.out / "overhead.png")
    if scaling_rows:
        scaling_checks = scaling.evaluate(scaling_rows)
        (args.out / "scaling_targets.json").write_text(
            json.dumps(scaling_checks, indent=2) + "\n")
        renderer = write_scaling_plot(scaling_rows, args.out / "scaling.png")
        scaling_summary = scaling.summary(environment, scaling_rows, scaling_checks,
                                          [e for e in errors if "scaling" in e], renderer)
        (args.out / "scaling.md").write_text(scaling_summary)
        written += ["scaling.jsonl", "scaling.md", "scaling.png"]
        if write_depth_plot(scaling_rows, args.out / "depth.png") is not None:
            written.append("depth.png")  # (models of several depths)
        if args.update_docs:
            update_scaling_docs(scaling_summary, args.out / "scaling.png")
    log(f"wrote {', '.join(f'{args.out}/{name}' for name in written)}")
    for error in errors:
        log(error)
    mismatched = [f"{r['scenario']} ({r.get('layer_set', '3')} layers, batch {r['batch_size']}"
                  f"{', memory job' if r.get('memory_run_tokens_match') is False else ''})"
                  for r in (*rows, *scaling_rows)
                  if r.get("tokens_match") is False or r.get("memory_run_tokens_match") is False]
    if mismatched:
        log(f"token check FAILED for: {', '.join(mismatched)}")
    return 1 if mismatched or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
