"""Activation-store benchmark: ``python -m benchmarks.store [--quick] [--out FILE.json]``.

Measures, in one run:

1. **write overhead**: ``ProbedModel.capture`` at batch 32, every layer's residual
   stream at every token, against the same generation with capture only
   (``generate(records=True)`` over the same chunks, records dropped); target
   ratio <= 1.10 (medians over interleaved repeats);
2. **write throughput** of the store against the disk's own sequential write
   speed, measured in the same run on the same filesystem (plain ``write()`` of
   the same number of bytes in 8 MiB blocks, without fsync, as the store writes);
3. **read throughput** of ``store.vectors(rows)`` for one full layer against a raw
   ``numpy.memmap`` read of the same blocks (warm page cache for both);
4. **flat memory over 5,000 generations** of the bundled model: peak RSS per
   500 prompts (sampled every 20 ms), which must not grow with the prompt count.

Not a test: numbers depend on the machine (record its load next to them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WIDE = dict(vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=8, pad_token_id=0, bos_token_id=1,
            eos_token_id=None, max_position_embeddings=256)


def _wide_model() -> Any:
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "adapters"))
    from hf_models import WORDS, build_tokenizer

    from undercurrent import ProbedModel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**WIDE)).eval()
    model.generation_config.eos_token_id = None
    layers = list(range(WIDE["num_hidden_layers"]))
    spec = {"extraction_points": [{
        "name": "resid", "layers": layers, "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory"}]}
    probed = ProbedModel(model, build_tokenizer(), spec=spec, batch_size=32)
    prompts = [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(8)) for i in range(256)]
    return probed, prompts


def write_overhead(repeats: int, prompts_count: int, max_new_tokens: int) -> dict[str, Any]:
    """Capture-only vs capture-to-store at batch 32, interleaved repeats."""
    probed, prompts = _wide_model()
    prompts = prompts[:prompts_count]
    options = dict(max_new_tokens=max_new_tokens)

    def capture_only() -> float:
        started = time.perf_counter()
        for start in range(0, len(prompts), 32):
            outputs = probed.generate(prompts[start:start + 32], records=True, batch_size=32,
                                      **options)
            del outputs
        return time.perf_counter() - started

    def to_store(folder: Path) -> tuple[float, Any]:
        started = time.perf_counter()
        summary = probed.capture(prompts, folder, batch_size=32, progress=False, **options)
        return time.perf_counter() - started, summary

    capture_only()  # warm-up
    only, store, summary = [], [], None
    with tempfile.TemporaryDirectory(dir=os.environ.get("UC_BENCH_DIR")) as root:
        for repeat in range(repeats):
            only.append(capture_only())
            seconds, summary = to_store(Path(root) / f"run{repeat}")
            store.append(seconds)
        disk = sequential_write(Path(root), summary.bytes)
        reads = read_layer(Path(root) / "run0")
    probed.close()
    writer_seconds = max(statistics.median(store) - statistics.median(only), 1e-9)
    return {
        "prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": 32,
        "layers": WIDE["num_hidden_layers"], "hidden": WIDE["hidden_size"],
        "vectors": summary.vectors, "bytes": summary.bytes,
        "capture_only_s": statistics.median(only), "store_s": statistics.median(store),
        "ratio": statistics.median(store) / statistics.median(only),
        # Each store run follows its capture-only run: pairs share the machine's load.
        "ratio_pairwise_median": statistics.median(b / a for a, b in zip(only, store,
                                                                         strict=True)),
        "capture_only_runs": only, "store_runs": store,
        "store_write_mb_s": summary.bytes / writer_seconds / 1e6,
        "store_end_to_end_mb_s": summary.bytes / statistics.median(store) / 1e6,
        "disk_write_mb_s": disk,
        **reads,
    }


def sequential_write(folder: Path, size: int) -> float:
    """MB/s of plain 8 MiB ``write()`` calls of ``size`` bytes (no fsync, like the store)."""
    import numpy as np

    block = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    path = folder / "sequential.bin"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        written = 0
        while written < size:
            handle.write(block)
            written += len(block)
    seconds = time.perf_counter() - started
    path.unlink()
    return written / seconds / 1e6


def read_layer(folder: Path) -> dict[str, Any]:
    """``store.vectors`` of one full layer vs raw ``numpy.memmap`` of the same blocks."""
    import numpy as np

    from undercurrent import open_activations

    store = open_activations(folder)
    rows = store.index[store.index["layer"] == 3]
    store.vectors(rows).sum()  # warm the page cache for both readers

    def through_store() -> float:
        started = time.perf_counter()
        array = np.array(store.vectors(rows))
        assert array.shape[0] == len(rows)
        return time.perf_counter() - started

    # The same rows read straight from numpy.memmap, run by contiguous run (the
    # runs are found outside the timing: this is the floor the store can reach).
    plan = []
    for shard, meta in store._shards.items():
        info = meta["points"]["resid"]
        data = np.memmap(folder / "shards" / shard / info["file"], dtype=info["dtype"],
                         mode="r", shape=(info["rows"], *info["shape"]))
        numbers = np.sort(rows[rows["shard"] == shard]["row"].to_numpy())
        breaks = np.flatnonzero(np.diff(numbers) != 1) + 1
        plan += [(data, run[0], run[-1] + 1) for run in np.split(numbers, breaks)]

    def raw() -> float:
        started = time.perf_counter()
        array = np.concatenate([np.array(data[start:stop]) for data, start, stop in plan])
        assert array.shape[0] == len(rows)
        return time.perf_counter() - started

    store_s = statistics.median(through_store() for _ in range(5))
    raw_s = statistics.median(raw() for _ in range(5))
    nbytes = store.vectors(rows).nbytes
    return {"read_rows": len(rows), "read_bytes": int(nbytes),
            "read_store_mb_s": nbytes / store_s / 1e6, "read_raw_memmap_mb_s": nbytes / raw_s / 1e6}


def flat_memory(prompts_count: int, step: int = 500) -> dict[str, Any]:
    """Peak RSS per ``step`` prompts while capturing ``prompts_count`` generations."""
    import random

    import psutil

    from undercurrent import ProbedModel
    from undercurrent.models.corpus import make_prompt

    spec = {"extraction_points": [{
        "name": "resid", "layers": [0, 1, 2, 3], "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory"}]}
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    rng = random.Random(0)
    prompts = [make_prompt(rng, i % 2) for i in range(prompts_count)]
    process = psutil.Process()
    peaks: dict[int, int] = {}
    stop = threading.Event()
    with tempfile.TemporaryDirectory(dir=os.environ.get("UC_BENCH_DIR")) as root:
        shards = Path(root) / "store" / "shards"

        def sample() -> None:
            while not stop.wait(0.02):
                done = sum(1 for _ in shards.glob("part*")) if shards.exists() else 0
                segment = done * step
                peaks[segment] = max(peaks.get(segment, 0), process.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        baseline = process.memory_info().rss
        sampler.start()
        started = time.perf_counter()
        summary = model.capture(prompts, Path(root) / "store", max_new_tokens=16,
                                batch_size=64, shard_prompts=step, progress=False)
        seconds = time.perf_counter() - started
        stop.set()
        sampler.join()
    model.close()
    return {"prompts": prompts_count, "vectors": summary.vectors, "bytes": summary.bytes,
            "seconds": seconds, "rss_before_mib": baseline / 2**20,
            "peak_rss_mib_by_prompts_done": {k: v / 2**20 for k, v in sorted(peaks.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    write = write_overhead(repeats=1 if args.quick else 5,
                           prompts_count=32 if args.quick else 128,
                           max_new_tokens=8 if args.quick else 32)
    memory = flat_memory(500 if args.quick else 5000)
    results = {"load_average_at_start": load, "write": write, "memory": memory}
    print(json.dumps(results, indent=1))
    print(f"\nwrite at batch 32, all {write['layers']} layers: store/capture-only = "
          f"{write['ratio']:.3f} (target <= 1.10); store writes {write['store_write_mb_s']:.0f} "
          f"MB/s vs disk {write['disk_write_mb_s']:.0f} MB/s; layer read via .vectors "
          f"{write['read_store_mb_s']:.0f} MB/s vs raw memmap "
          f"{write['read_raw_memmap_mb_s']:.0f} MB/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
