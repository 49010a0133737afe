"""Where a scenario's time goes: ``python -m benchmarks.profile --model large --batch 8
--scenario uc_3_layers_inline_norm``.

Runs one scenario under cProfile (after a warm-up) and splits the main thread's
time into the model's own work and undercurrent's: the callbacks that torch and
transformers call into undercurrent (forward hooks, among them the one after
each forward that routes its records, stopping criterion) plus what
``ProbedModel.generate`` does around ``model.generate``.
Async probe workers run on other threads and are not in this profile; the
timing table's CPU-time column counts them.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
from typing import Any

import undercurrent
from benchmarks.measure import per_vector
from benchmarks.models import MODEL_KEYS_HELP, load_model, model_key
from benchmarks.scenarios import ON_REQUEST, SCALING_ONLY, SCENARIOS, scenario_by_name
from benchmarks.scenarios.base import make_batch
from benchmarks.worker import layers_for, prompts_for, set_threads

#: undercurrent's package directory: a file is "ours" when its path starts with it
#: (a bare "/undercurrent/" would also match a checkout or venv of that name).
OURS = os.path.dirname(os.path.abspath(undercurrent.__file__)) + os.sep
ENGINE = ("/torch/", "/transformers/")


def undercurrent_share(stats: pstats.Stats) -> dict[str, Any]:
    """Seconds spent in undercurrent code entered from torch/transformers, by function,
    and around ``model.generate`` inside ``ProbedModel.generate``."""
    callbacks: dict[str, float] = {}
    around = 0.0
    generate_total = model_generate = 0.0
    for (path, line, name), (_, _, _, cumulative, callers) in stats.stats.items():
        if OURS in path:
            for (caller_path, _, _), (_, _, _, caller_cumulative) in callers.items():
                if any(part in caller_path for part in ENGINE):
                    label = f"{path.split(OURS)[-1]}:{line}({name})"
                    callbacks[label] = callbacks.get(label, 0.0) + caller_cumulative
            if path.endswith("undercurrent/api.py") and name == "generate":
                generate_total = max(generate_total, cumulative)
        if path.endswith("transformers/generation/utils.py") and name == "generate":
            model_generate = max(model_generate, cumulative)
    if generate_total:
        around = generate_total - model_generate
    return {"callbacks_s": sum(callbacks.values()), "around_generate_s": around,
            "by_callback": dict(sorted(callbacks.items(), key=lambda kv: -kv[1]))}


def call_counts(stats: pstats.Stats) -> dict[str, int]:
    """Function calls in a profile: all of them, calls of undercurrent's own functions,
    and every call made from undercurrent code (to itself, torch, numpy, builtins)."""
    total = ours = from_ours = 0
    for (path, _, _), (_, calls, _, _, callers) in stats.stats.items():
        total += calls
        if OURS in path:
            ours += calls
        from_ours += sum(counts[1] for (caller_path, _, _), counts in callers.items()
                         if OURS in caller_path)
    return {"total": total, "undercurrent_functions": ours, "from_undercurrent": from_ours}


def top_cumulative(stats: pstats.Stats, top: int) -> list[tuple[float, int, str]]:
    """undercurrent's functions by cumulative time: (seconds, calls, label)."""
    rows = [(cumulative, calls, f"{path.split(OURS)[-1]}:{line}({name})")
            for (path, line, name), (_, calls, _, cumulative, _) in stats.stats.items()
            if OURS in path]
    return sorted(rows, reverse=True)[:top]


def profile_scenario(name: str, bundle: Any, batch: Any, layers: tuple[int, ...],
                     max_new_tokens: int) -> tuple[pstats.Stats, Any]:
    """Set ``name`` up on ``layers``, warm it up, and profile one generation."""
    scenario = scenario_by_name(name)()
    scenario.setup(bundle, bundle.model, layers)
    scenario.generate(batch, max_new_tokens)
    profiler = cProfile.Profile()
    profiler.enable()
    run = scenario.generate(batch, max_new_tokens)
    profiler.disable()
    scenario.close()
    return pstats.Stats(profiler), run


def main(argv: list[str] | None = None) -> int:
    """Profile one scenario and print undercurrent's share, the calls per captured
    vector over a baseline, and the top functions."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    parser.add_argument("--model", default="large", type=model_key,
                        help=MODEL_KEYS_HELP)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--scenario", default="uc_3_layers_inline_norm",
                        choices=[s.name for s in (*SCENARIOS, *SCALING_ONLY, *ON_REQUEST)])
    parser.add_argument("--layers", default="3", choices=["3", "all"],
                        help="capture the three default layers or every layer")
    parser.add_argument("--baseline", default="raw_forward_hooks",
                        choices=[s.name for s in SCENARIOS],
                        help="scenario whose calls are subtracted for the per-vector count")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    set_threads(args.threads)
    bundle = load_model(args.model, args.device, args.dtype)
    batch = make_batch(bundle, prompts_for(args.batch))
    layers = layers_for(bundle, args.layers)
    base_stats, _ = profile_scenario(args.baseline, bundle, batch, layers, args.max_new_tokens)
    stats, run = profile_scenario(args.scenario, bundle, batch, layers, args.max_new_tokens)
    total = max(row[3] for row in stats.stats.values())
    share = undercurrent_share(stats)
    ours = share["callbacks_s"] + share["around_generate_s"]
    print(f"{args.scenario} on {bundle.description}, batch {args.batch}, {args.layers} layers, "
          f"{args.max_new_tokens} tokens: {total:.3f} s profiled (main thread)")
    print(f"  undercurrent: {ours:.3f} s ({ours / total:.1%}): callbacks from torch/transformers "
          f"{share['callbacks_s']:.3f} s, around model.generate {share['around_generate_s']:.3f} s")
    for label, seconds in list(share["by_callback"].items())[:8]:
        print(f"    {seconds:8.4f} s  {label}")
    counts, base = call_counts(stats), call_counts(base_stats)
    vectors = run.records or 0
    print(f"  captured vectors: {vectors}; Python function calls per captured vector "
          f"(main thread): {per_vector(counts['total'] - base['total'], vectors, '.1f')} over "
          f"{args.baseline}, {per_vector(counts['undercurrent_functions'], vectors, '.1f')} of "
          f"undercurrent's own functions, "
          f"{per_vector(counts['from_undercurrent'], vectors, '.1f')} made from undercurrent "
          "code")
    print("  undercurrent functions by cumulative time (s, calls, calls per vector):")
    for seconds, calls, label in top_cumulative(stats, args.top):
        print(f"    {seconds:8.4f} s {calls:8d} {per_vector(calls, vectors, '7.2f'):>7}  {label}")
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
