"""One generation call's work around the model, without the model: ``python -m
benchmarks.call_cycle --batch 64`` (add ``--instructions`` to count them).

A cycle opens ``--batch`` requests of one inline linear point (every layer of
the bundled model's shape: 4 layers, 128 wide), routes one window of 23 decode
steps of rows for all of them (what a ``generate()`` call routes when its
window is judged at the end), and closes them: registering, binding and
starting the probes, the group's admission, judgement and settling, then
ending every binding and building the results and outputs. No model runs, so a
cycle takes milliseconds and its cost is the capture path's own.

Without ``--instructions`` it prints the fastest of ``--repeats`` cycles per
stage (open, route, close), in µs: wall time, so it moves with the machine's
load. ``--cold`` reads a 64 MiB array before each stage, as a model's forward
passes sweep the CPU's caches between a generation's steps and around its
start and end: the code and objects of the stage are then read from memory,
as they are in a real call (session 24 measured 3x the warm time at batch 1,
1.7x at batch 64). With ``--instructions`` it runs itself twice under valgrind's callgrind
(``--repeats`` cycles, then ``--repeats`` + 10) and prints the instructions of
one cycle (the difference over 10 cycles): exact, a few minutes, and what
session 23 found the bytecode counts (``benchmarks.bytecodes``) can mislead
about (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from typing import Any

LAYERS, WIDTH, STEPS = 4, 128, 23


def make_call(batch: int) -> Any:
    """(router, point, ids, a function routing one window's rows): the call's pieces."""
    import numpy as np
    import torch

    from undercurrent.records import ActivationBatch
    from undercurrent.router import Router
    from undercurrent.spec.types import ExtractionPoint

    point = ExtractionPoint(
        name="lin", layers=tuple(range(LAYERS)), tensor_type="residual_stream",
        position="generated[*]", probe_type="linear_probe", probe_kind="single_shot",
        probe_args={"weight": [0.1] * WIDTH, "bias": 0.0, "threshold": 0.5})
    rows = STEPS * LAYERS
    values = torch.from_numpy(np.random.default_rng(0).standard_normal(
        (batch * rows, WIDTH)).astype(np.float32))
    ids = [f"r{index}" for index in range(batch)]
    spans = [(request_id, index * rows, (index + 1) * rows)
             for index, request_id in enumerate(ids)]
    columns = {
        "request_ids": [request_id for request_id in ids for _ in range(rows)],
        "point_names": ["lin"] * (batch * rows), "tensor_type": "residual_stream",
        "layers": [layer for _ in range(batch * STEPS) for layer in range(LAYERS)],
        "token_indices": [3 + step for _ in range(batch) for step in range(STEPS)
                          for _ in range(LAYERS)],
        "generated_indices": [step for _ in range(batch) for step in range(STEPS)
                              for _ in range(LAYERS)],
        "is_generated": [True] * (batch * rows), "token_ids": [5] * (batch * rows)}
    router = Router()

    def route() -> None:
        router.route_columns(ActivationBatch(values, **columns), spans)

    return router, point, ids, route


def cycle(call: Any, clock: Any = None, sweep: Any = None) -> list[float]:
    """One cycle (open, route, close); with ``clock``, each stage's seconds;
    ``sweep`` is called before each stage, outside its time."""
    from undercurrent.adapters.session import CaptureSession

    router, point, ids, route = call
    session = CaptureSession(router, [point])
    requests = [(request_id, "p", [1, 2, 3]) for request_id in ids]
    ends = [(request_id, "t", "length") for request_id in ids]
    times = []
    for stage in (lambda: session.open_requests(requests), route,
                  lambda: session.close_requests(ends)):
        if sweep is not None:
            sweep()
        started = clock() if clock else 0.0
        stage()
        if clock:
            times.append(clock() - started)
    return times


def cache_sweep(mebibytes: int = 64) -> Any:
    """A function reading ``mebibytes`` of memory: called between stages, it
    leaves the CPU's caches holding that array, not the stage's code and data."""
    import numpy as np

    array = np.ones((mebibytes << 20) // 8)
    return array.sum


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.call_cycle",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="requests in the call")
    parser.add_argument("--repeats", type=int, default=30, help="cycles timed (or counted)")
    parser.add_argument("--instructions", action="store_true",
                        help="count one cycle's instructions under callgrind")
    parser.add_argument("--cold", action="store_true",
                        help="sweep the CPU's caches before each timed stage")
    parser.add_argument("--run", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run is not None:  # (a counted child: warm up twice, then the cycles)
        call = make_call(args.batch)
        for _ in range(2 + args.run):
            cycle(call)
        return 0
    if args.instructions:
        if shutil.which("valgrind") is None:
            print("--instructions needs valgrind on the PATH (apt-get install valgrind)",
                  file=sys.stderr)
            return 2
        counts = [_counted(args.batch, runs) for runs in (args.repeats, args.repeats + 10)]
        per_cycle = (counts[1] - counts[0]) / 10
        print(f"batch {args.batch}: {per_cycle / 1e6:.2f} M instructions per cycle, "
              f"{per_cycle / (args.batch * STEPS * LAYERS):,.0f} per routed vector")
        return 0
    if args.cold and args.instructions:
        parser.error("--cold times the stages; an instruction count does not move with it")
    call = make_call(args.batch)
    sweep = cache_sweep() if args.cold else None
    cycle(call)
    best = [min(stage) for stage in zip(*(cycle(call, time.perf_counter, sweep)
                                          for _ in range(args.repeats)), strict=True)]
    print(f"batch {args.batch}, fastest of {args.repeats} {'cold ' if args.cold else ''}cycles: "
          f"open {best[0] * 1e6:.0f} µs, route {best[1] * 1e6:.0f} µs, "
          f"close {best[2] * 1e6:.0f} µs")
    return 0


def _counted(batch: int, runs: int) -> int:
    """The instructions callgrind counts for a child running ``runs`` cycles."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         "-m", "benchmarks.call_cycle", "--batch", str(batch), "--run", str(runs)],
        capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{done.stderr[-2000:]}")
    return int(found.group(1))


if __name__ == "__main__":
    raise SystemExit(main())
