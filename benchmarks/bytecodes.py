"""Python bytecodes of one generation, counted exactly: ``python -m
benchmarks.bytecodes --scenario uc_inline_linear --batch 64``.

A count of what the interpreter executes, not a time: it does not move with
the machine's load, and it takes a minute where ``benchmarks.instructions``
(valgrind) takes twenty. It runs raw hooks and each scenario in one process,
warms each up, then counts the bytecodes of one generation of each with
``sys.settrace`` opcode events (the calling thread only: async workers are not
counted; use ``benchmarks.instructions`` for them). It prints each scenario's
bytecodes over raw hooks, then:

- ``--phases``: the bytecodes inside each stage of the capture path (a stage's
  count includes what it calls; stages nest, so they do not add up);
- ``--by-function N``: the N functions whose counts changed most over raw
  hooks, with their calls per generation (a function called once per request
  shows 64 calls at batch 64).

What a bytecode costs varies (a call or an object made costs many
instructions, a local read few), so it ranks Python's work; it does not weigh
numpy's or torch's kernels at all.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from benchmarks.instructions import add_generation_arguments
from benchmarks.models import load_model
from benchmarks.scenarios import scenario_by_name
from benchmarks.scenarios.base import make_batch
from benchmarks.worker import layers_for, prompts_for, set_threads

BASELINE = "raw_forward_hooks"

#: (function name, label): the stages ``--phases`` counts (matched by name).
PHASES = (
    ("open_requests", "open the requests (states, contexts, registering)"),
    ("register_requests", "  register them with the router (probes bound)"),
    ("plan_forward", "plan the forwards"),
    ("hook", "the forward hooks (gather, hand over)"),
    ("after_forward", "deliver each forward (hold or route)"),
    ("after_token", "read the sampled tokens"),
    ("close_requests", "close the requests"),
    ("flush_window", "  route the window held back"),
    ("judge_group", "    judge a group of requests' rows"),
    ("end_requests", "  end them in the router (verdicts, results)"),
)

Key = tuple[str, int, str]  # (file, first line, function)


class Counter:
    """Bytecodes per function and calls per function of the calling thread while
    on; with ``phases``, bytecodes inside each named function (inclusive)."""

    def __init__(self, phases: tuple[str, ...] = ()) -> None:
        self.ops: collections.Counter[Key] = collections.Counter()
        self.calls: collections.Counter[Key] = collections.Counter()
        self.inside: collections.Counter[str] = collections.Counter()
        self._phases = frozenset(phases)

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        code = frame.f_code
        key = (code.co_filename, code.co_firstlineno, code.co_name)
        if event == "call":
            self.calls[key] += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            self.ops[key] += 1
            if self._phases:
                seen: set[str] = set()
                caller: FrameType | None = frame
                while caller is not None:
                    name = caller.f_code.co_name
                    if name in self._phases and name not in seen:
                        self.inside[name] += 1
                        seen.add(name)
                    caller = caller.f_back
        return self._trace

    def run(self, call: Callable[[], Any]) -> None:
        sys.settrace(self._trace)
        try:
            call()
        finally:
            sys.settrace(None)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _short(path: str) -> str:
    for marker in ("site-packages/", "/undercurrent/", "/benchmarks/", "python3.11/"):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return (marker.strip("/") + "/" + tail) if marker.startswith("/") else tail
    return path


def count(scenarios: list[str], *, batch: int, layers: str, tokens: int,
          phases: bool) -> dict[str, Counter]:
    """One generation of raw hooks and of each scenario, counted (after warm-ups)."""
    bundle = load_model("tiny")
    chosen = layers_for(bundle, layers)
    prompts = make_batch(bundle, prompts_for(batch))
    counted: dict[str, Counter] = {}
    for name in (BASELINE, *scenarios):
        scenario = scenario_by_name(name)()
        scenario.setup(bundle, bundle.model, chosen)
        try:
            for _ in range(3):
                scenario.generate(prompts, tokens)
            counter = Counter(tuple(name for name, _ in PHASES) if phases else ())
            counter.run(lambda scenario=scenario: scenario.generate(prompts, tokens))
            counted[name] = counter
        finally:
            scenario.close()
    return counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bytecodes",
                                     description=__doc__.split("\n\n")[0])
    add_generation_arguments(parser)
    parser.add_argument("--phases", action="store_true",
                        help="also count the bytecodes inside each stage of the capture path")
    parser.add_argument("--by-function", type=int, default=0, metavar="N",
                        help="also list the N functions whose counts changed most over raw hooks")
    args = parser.parse_args(argv)
    scenarios = args.scenario or ["uc_inline_linear"]
    set_threads(1)  # (as the timed jobs: torch's own threads run no Python)
    counted = count(scenarios, batch=args.batch, layers=args.layers,
                    tokens=args.max_new_tokens, phases=args.phases)
    base = counted[BASELINE]
    print(f"tiny, batch {args.batch}, {args.layers} layers, {args.max_new_tokens} new tokens: "
          "Python bytecodes of one generation (the generation thread)")
    print("| scenario | bytecodes | over raw hooks |")
    print("|---|---|---|")
    for name, counter in counted.items():
        extra = "—" if name == BASELINE else f"{counter.total - base.total:,}"
        print(f"| {name} | {counter.total:,} | {extra} |")
    for name in scenarios:
        counter = counted[name]
        if args.phases:
            print(f"\n{name}: bytecodes inside each stage (inclusive; stages nest)")
            print("| stage | bytecodes |")
            print("|---|---|")
            for function, label in PHASES:
                print(f"| {label} (`{function}`) | {counter.inside[function]:,} |")
        if args.by_function:
            keys = set(counter.ops) | set(base.ops)
            change = {key: counter.ops[key] - base.ops[key] for key in keys}
            print(f"\n{name}: the {args.by_function} functions whose counts changed most")
            print("| bytecodes over raw hooks | calls (raw hooks → this) | function |")
            print("|---|---|---|")
            for key in sorted(keys, key=lambda key: -abs(change[key]))[:args.by_function]:
                path, line, function = key
                print(f"| {change[key]:,} | {base.calls[key]} → {counter.calls[key]} | "
                      f"`{_short(path)}:{line} {function}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
