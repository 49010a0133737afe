"""What Python's garbage collector does per generation of a scenario:
``python -m benchmarks.collector --scenario uc_inline_linear --batch 64``.

The timed tables report medians, and a full collection falls on few
generations, so they leave it out. This runs the scenario (after warm-ups)
``--generations`` times and counts, with ``gc.callbacks``, the young
collections (first and second generation) and their time, and the objects
each second-generation collection moves to the oldest generation (those
alive in the young generations when it starts, less those it frees). Python
runs a full collection once the objects moved since the last one pass a
quarter of those it holds (CPython 3.8 to 3.13), and a full collection
walks every one: this times one at the end, and prints how often one is
due at the rate measured and what that costs per generation averaged over a
long run. ``gc.freeze()`` (``--freeze``, after loading the model) takes
every object alive then out of the collector's reach; compare both.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.models import MODEL_KEYS_HELP, load_model, model_key


@dataclass
class Collections:
    """What the collector did over ``generations`` calls."""

    generations: int
    young: list[int]  # collections of generation 0 and of generation 1
    young_s: list[float]  # their seconds
    moved: int  # objects moved to the oldest generation
    held: int  # objects the collector tracked at the end
    full_s: float  # one full collection, at the end

    @property
    def full_every(self) -> float:
        """Generations between full collections at the rate measured
        (``inf`` when nothing is moved)."""
        if not self.moved:
            return float("inf")
        return self.held / 4 / (self.moved / self.generations)

    def per_generation(self) -> dict[str, float]:
        """The counts and milliseconds per generation."""
        count = self.generations
        return {"young": self.young[0] / count, "second": self.young[1] / count,
                "young_ms": sum(self.young_s) / count * 1e3,
                "moved": self.moved / count,
                "full_ms_per_generation": self.full_s * 1e3 / self.full_every}


def count_collections(generate: Callable[[], Any], generations: int) -> Collections:
    """Call ``generate`` ``generations`` times and count what the collector did
    meanwhile (see the module docstring)."""
    young, young_s, moved = [0, 0], [0.0, 0.0], [0]
    started = [0.0, 0]

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if generation > 1:
            return
        if phase == "start":
            started[1] = (len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
                          if generation == 1 else 0)
            started[0] = time.perf_counter()
            return
        young[generation] += 1
        young_s[generation] += time.perf_counter() - started[0]
        if generation == 1:  # (the survivors move on)
            moved[0] += started[1] - info["collected"]

    gc.collect()
    gc.callbacks.append(on_collection)
    try:
        for _ in range(generations):
            generate()
    finally:
        gc.callbacks.remove(on_collection)
    held = len(gc.get_objects())
    begun = time.perf_counter()
    gc.collect()
    return Collections(generations, young, young_s, moved[0], held,
                       time.perf_counter() - begun)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collector",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="uc_inline_linear")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", default="all", choices=["3", "all"])
    parser.add_argument("--generations", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--model", default="tiny", type=model_key, help=MODEL_KEYS_HELP)
    parser.add_argument("--freeze", action="store_true",
                        help="gc.freeze() once the model is loaded and warmed up")
    args = parser.parse_args(argv)
    from benchmarks.allocator import steady_allocator
    from benchmarks.scenarios import scenario_by_name
    from benchmarks.scenarios.base import make_batch
    from benchmarks.worker import layers_for, prompts_for, set_threads

    steady_allocator()
    set_threads(1)
    bundle = load_model(args.model)
    scenario = scenario_by_name(args.scenario)()
    scenario.setup(bundle, bundle.model, layers_for(bundle, args.layers))
    batch = make_batch(bundle, prompts_for(args.batch))
    try:
        for _ in range(3):
            scenario.generate(batch, args.max_new_tokens)
        if args.freeze:
            gc.collect()
            gc.freeze()
        found = count_collections(lambda: scenario.generate(batch, args.max_new_tokens),
                                  args.generations)
    finally:
        scenario.close()
        if args.freeze:
            gc.unfreeze()
    each = found.per_generation()
    print(f"{args.scenario}, batch {args.batch}, {args.layers} layers, {args.generations} "
          f"generations{', gc.freeze() first' if args.freeze else ''}: per generation "
          f"{each['young']:.2f} first- and {each['second']:.2f} second-generation collections "
          f"({each['young_ms']:.2f} ms), {each['moved']:.0f} objects moved to the oldest; "
          f"a full collection of {found.held} objects took {found.full_s * 1e3:.1f} ms, due "
          f"every {found.full_every:.0f} generations: {each['full_ms_per_generation']:.2f} ms "
          "per generation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
