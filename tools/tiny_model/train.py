"""Train the bundled tiny model: ``python -m tools.tiny_model.train [--out DIR]``.

A 4-layer Llama (hidden 128, 2 heads of 64, tied embeddings) learns the
synthetic corpus of :mod:`undercurrent.models.corpus` from scratch with plain
torch. Training is deterministic for a given seed, thread count and torch build:
seeded corpus and initialisation, a fixed batch order, deterministic algorithms
and a fixed number of CPU threads. It takes a few minutes on 2 CPU cores.

The directory it writes is what ``tiny_model_path()`` points at: float32
``model.safetensors``, ``config.json``, ``generation_config.json`` and the
tokenizer files, loadable offline with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.tiny_model.tokenizer import build_tokenizer, save_tokenizer
from undercurrent.models import tiny_model_path
from undercurrent.models.corpus import generate_examples, vocabulary

TRAIN_SEED = 20240611
"""Seeds the training corpus, the initial weights and the batch order."""


@dataclass(frozen=True)
class TrainingConfig:
    """Architecture and optimisation settings of the bundled model."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    steps: int = 1000
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    examples: int = 24_000
    seed: int = TRAIN_SEED
    threads: int = 1


def model_config(tokenizer: Any, config: TrainingConfig) -> Any:
    """The ``LlamaConfig`` of the bundled model (head dim 64, which vLLM supports)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def _make_deterministic(config: TrainingConfig) -> None:
    import torch

    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)


def _encode_corpus(tokenizer: Any, config: TrainingConfig) -> list[list[int]]:
    examples = generate_examples(config.examples, seed=config.seed)
    encoded = tokenizer([example.text for example in examples]).input_ids
    return [ids + [tokenizer.eos_token_id] for ids in encoded]


def _batch(sequences: list[list[int]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
    labels = input_ids.masked_fill(attention == 0, -100)
    return input_ids, attention, labels


def _learning_rate(step: int, config: TrainingConfig) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(out: Path, config: TrainingConfig | None = None, log_every: int = 50) -> dict[str, Any]:
    """Train the model and save it (weights, configs, tokenizer) into ``out``.

    Returns a summary: final loss, wall time, parameter count.
    """
    import random

    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    config = config or TrainingConfig()
    _make_deterministic(config)
    tokenizer = build_tokenizer(vocabulary())
    model = LlamaForCausalLM(model_config(tokenizer, config))
    model.train()
    sequences = _encode_corpus(tokenizer, config)
    order = random.Random(config.seed + 1)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
        betas=(0.9, 0.98),
    )
    started = time.perf_counter()
    losses: list[float] = []
    for step in range(config.steps):
        batch = order.sample(sequences, config.batch_size)
        input_ids, attention, labels = _batch(batch, tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, config)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == config.steps - 1):
            elapsed = time.perf_counter() - started
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {elapsed:6.1f}s", flush=True)
    elapsed = time.perf_counter() - started
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=64,
        do_sample=False,
    ).save_pretrained(str(out))
    save_tokenizer(tokenizer, out)
    summary = {
        "final_loss": sum(losses[-20:]) / min(20, len(losses)),
        "train_seconds": round(elapsed, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "config": asdict(config),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""

    parser = argparse.ArgumentParser(prog="python -m tools.tiny_model.train",
                                     description="Train the bundled tiny model.")
    parser.add_argument("--out", type=Path, default=tiny_model_path(),
                        help="directory to write the model into (default: the bundled one)")
    parser.add_argument("--steps", type=int, default=TrainingConfig.steps)
    parser.add_argument("--seed", type=int, default=TRAIN_SEED)
    args = parser.parse_args(argv)
    summary = train(args.out, TrainingConfig(steps=args.steps, seed=args.seed))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
