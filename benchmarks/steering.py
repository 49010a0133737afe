"""What a live edit costs: plain generation, a raw forward hook doing the same
addition, and undercurrent's ``add`` edit on ``generated[*]``, on HF and vLLM.

    python -m benchmarks.steering                 # HF and vLLM, the larger random Llama
    python -m benchmarks.steering --backend hf --model tiny --repeats 3
    python -m benchmarks.steering --backend hf --model tiny --batch 64

Each scenario generates the same 8 prompts (``--batch N``: N prompts, the 8 in
turn; greedy, fixed length); the median of ``--repeats`` timed runs (after one
warm-up) is reported, in interleaved order. The HF raw hook and the edit
produce the same tokens (checked). On vLLM the raw hook adds to every row of
every step (it cannot tell prompt rows from generated ones without the
scheduler's bookkeeping), so its tokens differ: it measures the cost of the
addition, not the same result. The anchor is vllm-lens's +18% for a steering
vector (its GPU figure); these are CPU figures on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.models import LARGE_LLAMA, PROMPTS, bundled_model, random_llama

COEFFICIENT = 2.0


def _median_times(scenarios: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    for run in scenarios.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in scenarios}
    for _ in range(repeats):
        for name, run in scenarios.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _vector(hidden: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(hidden, generator=generator)


def _edit(layer: int, vector: Any) -> Any:
    from undercurrent.spec import Edit

    return Edit(name="steer", layers=layer, tensor_type="residual_stream",
                position="generated[*]", op="add", vector=vector.tolist(),
                coefficient=COEFFICIENT)


def _prompts(batch: int | None) -> list[str]:
    """``batch`` prompts, :data:`PROMPTS` in turn (all of them once: None)."""
    count = len(PROMPTS) if batch is None else batch
    return [PROMPTS[index % len(PROMPTS)] for index in range(count)]


def hf_costs(bundle: Any, new_tokens: int, repeats: int,
             batch: int | None = None) -> dict[str, float]:
    """Seconds per generate() call: plain, raw hook, undercurrent edit."""
    import torch

    from undercurrent import ProbedModel

    model = bundle.model
    layer = bundle.num_layers // 2
    vector = _vector(model.config.hidden_size)
    prompts = _prompts(batch)
    probed = ProbedModel(model, bundle.tokenizer, batch_size=len(prompts))
    edit = _edit(layer, vector)

    def add_on_decode(module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] != 1:
            return None
        edited = hidden + COEFFICIENT * vector
        return (edited, *output[1:]) if isinstance(output, tuple) else edited

    def plain() -> Any:
        return probed.generate(prompts, max_new_tokens=new_tokens)

    def raw() -> Any:
        handle = model.model.layers[layer].register_forward_hook(add_on_decode)
        try:
            return plain()
        finally:
            handle.remove()

    def steered() -> Any:
        return probed.generate(prompts, max_new_tokens=new_tokens, edits=[edit])

    with torch.no_grad():
        same = [o.token_ids for o in raw()] == [o.token_ids for o in steered()]
        if not same:
            raise AssertionError("the raw hook and the edit generated different tokens")
        return _median_times({"plain": plain, "raw hook": raw, "undercurrent edit": steered},
                             repeats)


def vllm_costs(bundle: Any, new_tokens: int, repeats: int,
               batch: int | None = None) -> dict[str, float]:
    """Seconds per generate() call on an in-process vLLM engine (CPU build)."""
    from undercurrent import ProbedModel
    from undercurrent.adapters.vllm.backend import VLLMBackend

    layer = bundle.num_layers // 2
    vector = _vector(bundle.model.config.hidden_size)
    with tempfile.TemporaryDirectory() as directory:
        bundle.model.save_pretrained(directory)
        bundle.tokenizer.save_pretrained(directory)
        backend = VLLMBackend.from_pretrained(
            directory, dtype="float32",
            max_model_len=min(512, bundle.model.config.max_position_embeddings))
    probed = ProbedModel(backend)
    edit = _edit(layer, vector)
    prompts = _prompts(batch)

    # The in-process engine runs the worker in this process, so the hook reads this
    # switch directly: installing it once keeps RPCs out of the timed runs.
    switch = {"on": False}

    def install(worker: Any) -> None:
        import torch

        model = worker.model_runner.get_model()
        added = COEFFICIENT * torch.as_tensor(vector, dtype=torch.float32)

        def hook(module: Any, args: Any, output: Any) -> None:
            if switch["on"]:
                output[0].add_(added)

        model.model.layers[layer].register_forward_hook(hook)

    backend.engine.collective_rpc(install)

    def plain() -> Any:
        return probed.generate(prompts, max_new_tokens=new_tokens)

    def raw() -> Any:
        switch["on"] = True
        try:
            return plain()
        finally:
            switch["on"] = False

    def steered() -> Any:
        return probed.generate(prompts, max_new_tokens=new_tokens, edits=[edit])

    try:
        if [o.token_ids for o in raw()] == [o.token_ids for o in plain()]:
            raise AssertionError("the raw hook did not change the tokens: it did not run")
        return _median_times({"plain": plain, "raw hook": raw, "undercurrent edit": steered},
                             repeats)
    finally:
        probed.close()


def _report(title: str, costs: dict[str, float]) -> None:
    base = costs["plain"]
    print(title)
    for name, seconds in costs.items():
        overhead = 100 * (seconds / base - 1)
        print(f"  {name:18} {seconds * 1000:8.1f} ms   {overhead:+6.1f}% vs plain")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("hf", "vllm", "both"), default="both")
    parser.add_argument("--model", choices=("tiny", "large"), default="large")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None,
                        help=f"prompts per call (default: the {len(PROMPTS)} prompts once)")
    args = parser.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")

    def bundle() -> Any:
        if args.model == "tiny":
            return bundled_model()
        return random_llama("large", LARGE_LLAMA, "random Llama, hidden 1024, 8 layers")

    count = len(_prompts(args.batch))
    shown = f"{args.model} model, {count} prompts x {args.new_tokens} new tokens"
    if args.backend in ("hf", "both"):
        _report(f"HF ({shown})", hf_costs(bundle(), args.new_tokens, args.repeats, args.batch))
    if args.backend in ("vllm", "both"):
        _report(f"vLLM ({shown})",
                vllm_costs(bundle(), args.new_tokens, args.repeats, args.batch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
