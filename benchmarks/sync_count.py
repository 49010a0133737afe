"""Host syncs on the generation path when only async probes are registered:
``python -m benchmarks.sync_count [--batch 8] [--layers all]``.

On a GPU, ``Tensor.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``, ``.to("cpu")``
and ``bool()/int()/float()`` of a tensor wait for the device. This runs an
async-only generation on CPU with those methods wrapped by counters and reports
every call made while undercurrent code is on the stack, split by thread: calls
on the generation (main) thread stall a GPU step; calls on probe worker threads
do not. A measurement, not a test. ``--offload`` sets ``ModelHooks.offload``:
the default ``always`` runs the path a GPU takes (async-only delivery on the
delivery thread) on CPU too; ``never`` shows delivery on the generation thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.models import MODEL_KEYS_HELP, load_model, model_key
from benchmarks.profile import OURS
from benchmarks.scenarios import scenario_by_name
from benchmarks.scenarios.base import make_batch
from benchmarks.worker import layers_for, prompts_for, set_threads

#: Tensor methods that copy to the host (and so wait for a device) when called.
SYNCING = ("cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__")


def _caller_in_undercurrent() -> tuple[str, str] | None:
    """``(who, "file:line(function)")`` of the innermost undercurrent frame on the
    stack, if any: ``who`` is ``"undercurrent"`` when that frame made the call itself,
    ``"engine under undercurrent"`` when torch/transformers code in between made it
    (plain ``generate()`` makes those calls too)."""
    frame = sys._getframe(2)
    direct = True
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(OURS):
            who = "undercurrent" if direct else "engine under undercurrent"
            return who, f"{path.split(OURS)[-1]}:{frame.f_lineno}({frame.f_code.co_name})"
        direct = False
        frame = frame.f_back
    return None


@contextmanager
def count_syncs() -> Iterator[Counter[tuple[str, str, str, str]]]:
    """Count syncing tensor calls made under undercurrent code, keyed by (thread kind,
    who made it, method, undercurrent frame); restores the methods on exit.

    ``.to()`` counts only with a host target and not ``non_blocking`` (see
    :func:`_to_host`): a ``.to(device)`` to the model's device is a host-to-device
    copy on a GPU, not a sync. ``.copy_()`` counts when it copies into a host tensor
    and is not ``non_blocking``: the hooks' non-blocking copies into pinned memory
    (``.to("cpu", non_blocking=True)`` on CUDA) do not sync."""
    import torch

    counts: Counter[tuple[str, str, str, str]] = Counter()
    main = threading.main_thread()
    originals = {name: getattr(torch.Tensor, name) for name in (*SYNCING, "to", "copy_")}
    labels = {"to": "to('cpu')", "copy_": "copy_ to host"}

    def wrap(name: str, original: Any) -> Any:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if (_to_host(self, args, kwargs) if name == "to" else
                    _blocking_copy_to_host(self, args, kwargs) if name == "copy_" else True):
                caller = _caller_in_undercurrent()
                if caller is not None:
                    kind = "generation thread" if threading.current_thread() is main \
                        else "worker thread"
                    label = labels.get(name, name)
                    counts[(kind, caller[0], label, caller[1])] += 1
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextmanager
def cuda_sync_log() -> Iterator[list[tuple[str, str]]]:
    """Every synchronising CUDA call torch makes (``torch.cuda.set_sync_debug_mode
    ("warn")``: the device's own count, not a list of methods), as ``(thread name,
    "file:line(function)")`` of the innermost Python frame outside torch that made it."""
    import torch

    calls: list[tuple[str, str]] = []
    lock = threading.Lock()
    # torch's own frames are skipped by its package directory (not by "/torch/" in a
    # path: an environment may live under such a folder, transformers with it)
    skipped = (os.path.dirname(torch.__file__) + os.sep, warnings.__file__)

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.startswith(skipped)]
        where = (f"{frames[-1].filename}:{frames[-1].lineno}({frames[-1].name})"
                 if frames else "?")
        with lock:
            calls.append((threading.current_thread().name, where))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _blocking_copy_to_host(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                           ) -> bool:
    blocking = not kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
    return blocking and target.device.type == "cpu"


def _to_host(tensor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` is a blocking copy to the host: not
    ``non_blocking`` (by keyword, or the first positional bool: ``to(device,
    dtype, non_blocking)``), to ``"cpu"`` named in the code, or to a
    ``torch.device("cpu")`` from a tensor off the host. (On a CPU run the model's
    own device is ``torch.device("cpu")`` too, and a ``.to(self.device)`` there is
    a host-to-device copy on a GPU: a device object counts only when the copy
    really leaves a device.)"""
    import torch

    target = kwargs.get("device", args[0] if args else None)
    positional = next((arg for arg in args[1:] if isinstance(arg, bool)), False)
    if kwargs.get("non_blocking", positional):
        return False
    if isinstance(target, str):
        return target.startswith("cpu")
    if isinstance(target, torch.device):
        return target.type == "cpu" and tensor.device.type != "cpu"
    return False


def measure(model: str = "tiny", batch_size: int = 8, layer_set: str = "all",
            max_new_tokens: int = 24,
            scenario: str = "uc_3_layers_async_trajectory",
            offload: str = "always", device: str = "cpu",
            dtype: str | None = None) -> dict[str, Any]:
    """Warm up, then count syncing calls during one async-only generation. On CUDA,
    also the device's own count of synchronising calls (``cuda_syncs``) during one
    plain ``generate()`` and during the probed one, by (thread, caller)."""
    bundle = load_model(model, device, dtype)
    batch = make_batch(bundle, prompts_for(batch_size))
    instance = scenario_by_name(scenario)()
    instance.setup(bundle, bundle.model, layers_for(bundle, layer_set))
    instance.probed.backend.hooks.offload = offload
    instance.generate(batch, max_new_tokens)
    with count_syncs() as counts:
        run = instance.generate(batch, max_new_tokens)
    result = {"scenario": scenario, "batch_size": batch_size, "layer_set": layer_set,
              "max_new_tokens": max_new_tokens, "records": run.records, "offload": offload,
              "device": device, "counts": dict(counts)}
    if device == "cuda":
        plain = scenario_by_name("plain_generate")()
        plain.setup(bundle, bundle.model, layers_for(bundle, layer_set))
        plain.generate(batch, max_new_tokens)
        syncs = {}
        for label, each in (("plain generate()", plain), ("probed", instance)):
            with cuda_sync_log() as calls:
                each.generate(batch, max_new_tokens)
            syncs[label] = Counter(calls)
        result["cuda_syncs"] = syncs
    instance.close()
    return result


def main(argv: list[str] | None = None) -> int:
    """Print the counts by thread, method and undercurrent caller."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sync_count", description=__doc__)
    parser.add_argument("--model", default="tiny", type=model_key,
                        help=MODEL_KEYS_HELP)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", default="all", choices=["3", "all"])
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--offload", default="always", choices=["auto", "always", "never"],
                        help="ModelHooks.offload (default: always, the GPU path on any device)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    set_threads(args.threads)
    result = measure(args.model, args.batch, args.layers, args.max_new_tokens,
                     offload=args.offload, device=args.device, dtype=args.dtype)
    counts = result["counts"]
    steps = args.max_new_tokens
    totals: Counter[tuple[str, str]] = Counter()
    for (kind, who, _, _), n in counts.items():
        totals[(kind, who)] += n
    print(f"async-only generate ({result['scenario']}), {args.model}, batch {args.batch}, "
          f"{args.layers} layers, {steps} new tokens, {result['records']} vectors captured, "
          f"offload={args.offload}")
    for (kind, who), n in sorted(totals.items()):
        print(f"  {kind}, made by {who}: {n} syncing calls ({n / steps:.1f} per new token)")
    print("| thread | made by | call | innermost undercurrent frame | calls | per new token |")
    print("|---|---|---|---|---|---|")
    for (kind, who, method, caller), n in sorted(counts.items(),
                                                  key=lambda kv: (kv[0][:2], -kv[1])):
        print(f"| {kind} | {who} | `{method}` | `{caller}` | {n} | {n / steps:.1f} |")
    for label, calls in result.get("cuda_syncs", {}).items():
        print(f"CUDA synchronising calls in one {label} generation ({steps} new tokens): "
              f"{sum(calls.values())}")
        for (thread, where), n in calls.most_common():
            print(f"  {n:5d}  {thread}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
