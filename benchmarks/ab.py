"""Two versions of undercurrent timed against each other in alternating
processes: ``python -m benchmarks.ab --base 1e277aa --batch 64``.

On a shared machine the speed of a process drifts: two timing runs minutes
apart differ by more than a change of a few percent. This compares the working
tree's undercurrent with the one of git revision ``--base`` under the same
harness (this checkout's ``benchmarks``, its scenarios and prompts): ``--rounds``
rounds of one process per version in turn (the base first), each process
warming up, then timing plain ``generate()``, raw forward hooks and the
scenario interleaved ``--repeats`` times on a steady heap (one torch thread).
For each version it prints the median, over every repeat of its processes, of
the scenario's time less the raw hooks' of the same repeat per captured
vector, the spread of its processes' medians, and its fastest scenario run
against its fastest plain run. The base's package is read from a temporary
git worktree, removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.instructions import add_generation_arguments
from benchmarks.models import MODEL_KEYS_HELP, model_key

ROOT = Path(__file__).resolve().parent.parent
PLAIN, RAW = "plain_generate", "raw_forward_hooks"


def time_interleaved(scenario: str, *, batch: int, layers: str, tokens: int,
                     repeats: int, threads: int | None = 1,
                     model: str = "tiny") -> dict[str, Any]:
    """One process's timings: plain ``generate()``, raw hooks and ``scenario``,
    each warmed up, then timed in turn ``repeats`` times (seconds per
    generation), with the scenario's captured vectors and where undercurrent
    was imported from. ``threads``: torch's threads (None: left as they are);
    ``model``: the benchmark model's key (:func:`benchmarks.models.load_model`)."""
    from benchmarks.allocator import steady_allocator

    steady_allocator()
    import undercurrent
    from benchmarks.models import load_model
    from benchmarks.scenarios import scenario_by_name
    from benchmarks.scenarios.base import make_batch
    from benchmarks.worker import layers_for, prompts_for, set_threads

    set_threads(threads)

    bundle = load_model(model)
    chosen = layers_for(bundle, layers)
    prompts = make_batch(bundle, prompts_for(batch))
    names = [PLAIN, RAW, scenario]
    made = {}
    for name in names:
        made[name] = scenario_by_name(name)()
        made[name].setup(bundle, bundle.model, chosen)
    times: dict[str, list[float]] = {name: [] for name in names}
    vectors = 0
    try:
        for name in names:
            for _ in range(3):
                made[name].generate(prompts, tokens)
        for _ in range(repeats):
            for name in names:
                started = time.perf_counter()
                run = made[name].generate(prompts, tokens)
                times[name].append(time.perf_counter() - started)
                if name == scenario:
                    vectors = run.records
    finally:
        for instance in made.values():
            instance.close()
    return {"times": times, "vectors": vectors, "scenario": scenario,
            "package": str(Path(undercurrent.__file__).resolve().parent)}


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """One version's processes (:func:`time_interleaved` results) in a few
    numbers: ``extra_us`` (the median paired extra µs per vector over raw
    hooks, over every repeat), ``low_us`` / ``high_us`` (the least and most of
    the processes' own medians), ``x_plain`` (fastest scenario run over fastest
    plain run) and ``processes``. A process whose scenario captured no vector
    (``uc_empty_spec``) has no cost per vector: with none that captured,
    ``extra_us``, ``low_us`` and ``high_us`` are None, ``x_plain`` still
    compares."""
    paired: list[float] = []
    medians: list[float] = []
    fastest = {PLAIN: float("inf"), "scenario": float("inf")}
    for run in runs:
        times, vectors = run["times"], run["vectors"]
        fastest[PLAIN] = min(fastest[PLAIN], *times[PLAIN])
        fastest["scenario"] = min(fastest["scenario"], *times[run["scenario"]])
        if not vectors:
            continue
        mine = [(probed - raw) / vectors * 1e6
                for probed, raw in zip(times[run["scenario"]], times[RAW], strict=True)]
        paired += mine
        medians.append(statistics.median(mine))
    return {"extra_us": statistics.median(paired) if paired else None,
            "low_us": min(medians, default=None), "high_us": max(medians, default=None),
            "x_plain": fastest["scenario"] / fastest[PLAIN], "processes": len(runs)}


def _run_process(package_root: Path, args: argparse.Namespace, scenario: str,
                 lib: Path) -> dict[str, Any]:
    """:func:`time_interleaved` in a fresh process that imports undercurrent from
    ``package_root`` (through ``lib``, a folder of its own holding a link to the
    package) and this checkout's benchmarks; run from ``lib``'s folder, which
    holds neither (the current folder comes first on Python's path)."""
    if not lib.exists():
        lib.mkdir()
        (lib / "undercurrent").symlink_to(package_root / "undercurrent", target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(lib), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    command = [sys.executable, "-c",
               "import json, sys; from benchmarks.ab import time_interleaved; "
               "json.dump(time_interleaved(*sys.argv[1:2], batch=int(sys.argv[2]), "
               "layers=sys.argv[3], tokens=int(sys.argv[4]), repeats=int(sys.argv[5]), "
               "model=sys.argv[6]), sys.stdout)",
               scenario, str(args.batch), args.layers, str(args.max_new_tokens), str(args.repeats),
               args.model]
    done = subprocess.run(command, env=env, cwd=lib.parent, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"a timing process failed (exit {done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    expected = (package_root / "undercurrent").resolve()
    if Path(result["package"]) != expected:
        raise RuntimeError(f"the timing process imported undercurrent from {result['package']}, "
                           f"not {expected}")
    return result


def compare(args: argparse.Namespace) -> dict[str, dict[str, float | None]]:
    """Time both versions in alternating processes; returns :func:`summarise` of
    each (``base`` and ``working tree``)."""
    scenario = (args.scenario or ["uc_inline_linear"])[0]
    with tempfile.TemporaryDirectory(prefix="undercurrent-ab-") as scratch:
        base_root = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                        str(base_root), args.base], check=True)
        try:
            runs: dict[str, list[dict[str, Any]]] = {"base": [], "working tree": []}
            for _ in range(args.rounds):
                runs["base"].append(_run_process(base_root, args, scenario,
                                                 Path(scratch) / "lib-base"))
                runs["working tree"].append(_run_process(ROOT, args, scenario,
                                                         Path(scratch) / "lib-tree"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base_root)], check=False)
    return {label: summarise(found) for label, found in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab",
                                     description=__doc__.split("\n\n")[0])
    add_generation_arguments(parser)
    parser.add_argument("--base", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per version, run in turn (default 3)")
    parser.add_argument("--repeats", type=int, default=15,
                        help="interleaved timed generations per scenario and process")
    parser.add_argument("--model", default="tiny", type=model_key, help=MODEL_KEYS_HELP)
    args = parser.parse_args(argv)
    summaries = compare(args)
    scenario = (args.scenario or ["uc_inline_linear"])[0]
    print(f"{args.model}, batch {args.batch}, {args.layers} layers, {args.max_new_tokens} "
          f"new tokens, {scenario}: {args.rounds} process(es) per version in turn, {args.repeats} "
          "interleaved repeats each")
    print("| version | extra µs per vector over raw hooks (median of the paired repeats) "
          "| the processes' medians | fastest run x fastest plain |")
    print("|---|---|---|---|")
    for label, summary in summaries.items():
        name = f"`{args.base}`" if label == "base" else label
        spread = ("—" if summary["low_us"] is None
                  else f"{summary['low_us']:.2f}–{summary['high_us']:.2f}")
        extra = "—" if summary["extra_us"] is None else f"{summary['extra_us']:.2f}"
        print(f"| {name} | {extra} | {spread} | {summary['x_plain']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
