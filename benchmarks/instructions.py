"""Instructions per captured vector, counted by valgrind: ``python -m
benchmarks.instructions --scenario uc_inline_linear --batch 64``.

Wall and CPU times on a shared machine move by 5-20% from run to run, which
hides a change of a few percent. An instruction count does not move: this
runs the chosen scenarios and the raw-hooks baseline in one process under
valgrind's callgrind tool (needs ``valgrind`` on the PATH, e.g. ``apt-get
install valgrind``), counts the instructions of one generation of each (after
two warm-up generations, counting switched on with ``callgrind_control``
around it), and prints each scenario's instructions per captured vector over
the baseline. ``--by-function N`` also lists the N functions whose counts grew
most over the baseline: C functions (the interpreter's loop for all Python
code, numpy's and torch's kernels, BLAS, the allocator), which say what kind
of work the extra instructions are.

Not counted: an idle BLAS helper thread's busy-wait (OpenBLAS's
``exec_blas_async_wait`` and ``blas_thread_server``), whose count depends on
how valgrind, which runs one thread at a time, schedules the threads. Every
thread's other instructions are counted (async workers included). It takes
minutes: valgrind runs Python about 30x slower. An instruction is not a unit
of time (a cache miss costs many), so this complements the timed tables and
does not replace them.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.measure import per_vector
from benchmarks.models import MODEL_KEYS_HELP, model_key

#: Functions whose count is a helper thread waiting, not work (see the docstring).
SPINNING = ("exec_blas_async_wait", "blas_thread_server")
BASELINE = "raw_forward_hooks"


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The options naming what a counting tool generates: the scenarios, the
    batch, the layers and the new tokens (see also ``benchmarks.bytecodes``)."""
    parser.add_argument("--scenario", action="append",
                        help="a scenario to count (repeat for several; default uc_inline_linear)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", default="all", choices=["3", "all"])
    parser.add_argument("--max-new-tokens", type=int, default=24)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions",
                                     description=__doc__.split("\n\n")[0])
    add_generation_arguments(parser)
    parser.add_argument("--model", default="tiny", type=model_key,
                        help=MODEL_KEYS_HELP)
    parser.add_argument("--by-function", type=int, default=0, metavar="N",
                        help="also list, per scenario, the N functions (C level: the "
                             "interpreter, numpy, torch, BLAS...) whose counts grew most "
                             "over the baseline")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep callgrind's dumps in DIR (for callgrind_annotate "
                             "--tree=caller: who called a function that grew)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the counted process's dump dir
    args = parser.parse_args(argv)
    scenarios = args.scenario or ["uc_inline_linear"]
    if args.child:
        return _child(args, scenarios)
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            print(f"benchmarks.instructions needs {tool} on the PATH (apt-get install valgrind)",
                  file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="uc-callgrind-") as folder:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={folder}/callgrind.%p", sys.executable, "-m",
                   "benchmarks.instructions", "--child", folder, "--batch", str(args.batch),
                   "--layers", args.layers, "--model", args.model,
                   "--max-new-tokens", str(args.max_new_tokens)]
        for name in scenarios:
            command += ["--scenario", name]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout, done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        vectors = {name: int(count) for name, count in (
            line.split()[1:3] for line in done.stdout.splitlines()
            if line.startswith("vectors "))}
        found = {name: _instructions(path) for name, path in _dumps(Path(folder)).items()}
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name, path in _dumps(Path(folder)).items():
                shutil.copyfile(path, args.keep / f"callgrind.{name}")
    print(f"{args.model}, batch {args.batch}, {args.layers} layers, "
          f"{args.max_new_tokens} new tokens: instructions of one generation "
          "(BLAS helper threads' busy-wait not counted)")
    print("\n".join(instruction_tables(found, vectors, scenarios, args.by_function)))
    return 0


def instruction_tables(found: dict[str, tuple[int, collections.Counter[str]]],
                       vectors: dict[str, int], scenarios: list[str],
                       by_function: int = 0) -> list[str]:
    """Markdown lines: each scenario's instructions (``found``: :func:`_instructions`
    of each dump, the baseline's included), its captured ``vectors`` and its
    instructions over the baseline's per vector ("—" for a scenario that captured
    none); with ``by_function``, the functions that grew most per scenario."""
    base = found[BASELINE][0]
    lines = ["| scenario | instructions (M) | captured vectors | over raw hooks per vector |",
             "|---|---|---|---|",
             f"| {BASELINE} | {base / 1e6:.1f} | — | — |"]
    for name in scenarios:
        count = vectors.get(name, 0)
        lines.append(f"| {name} | {found[name][0] / 1e6:.1f} | {count} | "
                     f"{per_vector(found[name][0] - base, count, ',.0f')} |")
    for name in scenarios if by_function else ():
        count = vectors.get(name, 0)
        ours, theirs = found[name][1], found[BASELINE][1]
        grown = sorted(ours.keys() | theirs.keys(),
                       key=lambda function: theirs[function] - ours[function])
        lines += [f"\n{name}: the {by_function} functions that grew most over {BASELINE}",
                  "| function | instructions over the baseline (M) | per captured vector |",
                  "|---|---|---|"]
        for function in grown[:by_function]:
            extra = ours[function] - theirs[function]
            lines.append(f"| {function} | {extra / 1e6:.2f} | "
                         f"{per_vector(extra, count, ',.0f')} |")
    return lines


def _dumps(folder: Path) -> dict[str, Path]:
    """The dumps the child asked for, by the scenario named in each one's trigger."""
    found = {}
    for path in folder.glob("callgrind.*.*"):
        text = path.read_text(errors="replace")
        match = re.search(r"^desc: Trigger: dump (\S+)", text, re.MULTILINE)
        if match:
            found[match.group(1)] = path
    return found


def _instructions(path: Path) -> tuple[int, collections.Counter[str]]:
    """Instructions in a dump, the busy-waiting functions left out, and the
    instructions of each function (its name and object file)."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", str(path)],
                         capture_output=True, text=True, check=True).stdout
    total = 0
    by_function: collections.Counter[str] = collections.Counter()
    for line in out.splitlines():
        match = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.*)", line)
        if not match:
            continue
        count = int(match.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in line:
            total = count
        else:
            by_function[match.group(2)] += count
    spinning = [name for name in by_function if any(spin in name for spin in SPINNING)]
    total -= sum(by_function.pop(name) for name in spinning)
    return total, by_function


def _child(args: argparse.Namespace, scenarios: list[str]) -> int:
    from benchmarks.models import load_model
    from benchmarks.scenarios import scenario_by_name
    from benchmarks.scenarios.base import make_batch
    from benchmarks.worker import layers_for, prompts_for, set_threads

    set_threads(1)
    bundle = load_model(args.model)
    layers = layers_for(bundle, args.layers)
    batch = make_batch(bundle, prompts_for(args.batch))
    pid = str(os.getpid())

    def control(*flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, pid], check=True, capture_output=True)

    for name in (BASELINE, *scenarios):
        scenario = scenario_by_name(name)()
        scenario.setup(bundle, bundle.model, layers)
        for _ in range(2):
            scenario.generate(batch, args.max_new_tokens)
        gc.collect()
        control("--zero")
        control("--instr=on")
        run = scenario.generate(batch, args.max_new_tokens)
        control("--instr=off")
        control("--dump=" + name)
        scenario.close()
        print("vectors", name, run.records or 0, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
