"""A quick before/after check of the capture path's cost per vector, for a loaded
machine: ``python -m benchmarks.quick_scaling --repeats 5``.

One process loads the bundled model (``--model large``: the large random
Llama), sets up plain ``generate()``, raw forward hooks and the scaling
scenarios (inline linear, async trajectory, the same trajectory probe inline,
capture only) on every layer
(``--layers 3``: three), warms each up, then times them interleaved,
``--repeats`` rounds per batch size, with ``--threads`` torch threads (1). It
keeps the minimum wall time and the minimum process CPU time of each (the least
disturbed run; CPU time also counts async workers), and prints x plain and the
extra µs per captured vector over raw hooks. Run it once per checkout
(``PYTHONPATH`` picks the code) and compare; the full scaling table
(``python -m benchmarks.run --scaling-only``) reports medians instead.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.allocator import steady_allocator
from benchmarks.measure import per_vector
from benchmarks.models import MODEL_KEYS_HELP, load_model, model_key
from benchmarks.scenarios import scenario_by_name
from benchmarks.scenarios.base import make_batch
from benchmarks.worker import layers_for, prompts_for, set_threads

BASELINES = ("plain_generate", "raw_forward_hooks")
PROBED = {"uc_inline_linear": "inline linear", "uc_3_layers_async_trajectory": "async trajectory",
          "uc_inline_trajectory": "inline trajectory", "uc_3_layers_capture_only": "capture only"}


def measure(size: int, repeats: int, tokens: int, bundle: object,
            layers: tuple[int, ...]) -> dict[str, tuple[float, float, int]]:
    """(min wall s, min CPU s, captured vectors) per scenario at batch ``size``."""
    batch = make_batch(bundle, prompts_for(size))
    scenarios = {}
    for name in (*BASELINES, *PROBED):
        scenario = scenario_by_name(name)()
        scenario.setup(bundle, bundle.model, layers)  # type: ignore[attr-defined]
        scenario.generate(batch, tokens)  # warm-up
        scenarios[name] = scenario
    best = {name: (float("inf"), float("inf"), 0) for name in scenarios}
    for _ in range(repeats):
        for name, scenario in scenarios.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run = scenario.generate(batch, tokens)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            low_wall, low_cpu, _ = best[name]
            best[name] = (min(low_wall, wall), min(low_cpu, cpu), run.records or 0)
    for scenario in scenarios.values():
        scenario.close()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quick_scaling",
                                     description=__doc__)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--layers", default="all", choices=["3", "all"])
    parser.add_argument("--model", default="tiny", type=model_key,
                        help=MODEL_KEYS_HELP)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--default-allocator", action="store_true",
                        help="glibc's default heap instead of a steady one "
                        "(benchmarks/allocator.py)")
    args = parser.parse_args(argv)
    if not args.default_allocator:
        steady_allocator()
    set_threads(args.threads)
    bundle = load_model(args.model)
    layers = layers_for(bundle, args.layers)
    print("| batch | scenario | x plain (wall) | x plain (CPU) | extra µs/vector over raw "
          "hooks (wall) | (CPU) |")
    print("|---|---|---|---|---|---|")
    for size in args.batch_sizes:
        best = measure(size, args.repeats, args.max_new_tokens, bundle, layers)
        plain, raw = best["plain_generate"], best["raw_forward_hooks"]
        for name, label in PROBED.items():
            wall, cpu, vectors = best[name]
            print(f"| {size} | {label} | {wall / plain[0]:.2f} | {cpu / plain[1]:.2f} | "
                  f"{per_vector((wall - raw[0]) * 1e6, vectors, '.1f')} | "
                  f"{per_vector((cpu - raw[1]) * 1e6, vectors, '.1f')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
