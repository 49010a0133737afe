"""The models, tokenizer and prompts every benchmark scenario runs on.

The models, by key: ``tiny``, the bundled tiny model (or, before it exists, a
tiny random Llama of the same kind); ``large``, a larger random-init Llama where
compute dominates; and ``deep<N>`` (``deep48``), a random-init Llama of the
bundled model's widths with ``N`` decoder layers, for measuring the capture's
cost against depth. All are deterministic: the same seed gives the same weights
in every process, so scenarios run in separate processes generate the same
tokens.
"""

from __future__ import annotations

import argparse
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_SEED = 1234

#: Fixed prompts; all the same length in characters so a batch needs no padding
#: with the character tokenizer (padding numerics would blur the token check).
PROMPTS: tuple[str, ...] = (
    "The river carried the old boat far downstream",
    "A quiet probe listens to every layer it reads",
    "Seven small lanterns glowed along the harbour",
    "She wrote the numbers down and checked the sum",
    "Under the bridge the current ran cold and fast",
    "Every token passes through the residual flows",
    "The committee met at noon to weigh the answer",
    "Bright sparks rose from the forge into the sky",
)

LARGE_LLAMA = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}
TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
#: The ``deep<N>`` models: the bundled model's widths (so the bundled probe file
#: reads their rows), ``N`` decoder layers.
DEEP_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
#: The depths a ``deep<N>`` key may ask for.
DEEP_LAYERS = range(1, 257)
_DEEP_KEY = re.compile(r"deep([0-9]+)")
MODEL_KEYS_HELP = "tiny, large, or deep<N> (the bundled model's widths, N layers: deep48)"


@dataclass
class ModelBundle:
    """A loaded model with its tokenizer and the facts scenarios need."""

    key: str
    description: str
    model: Any
    tokenizer: Any
    num_layers: int

    @property
    def three_layers(self) -> tuple[int, ...]:
        """Three evenly spread decoder layers (first, middle, last)."""
        n = self.num_layers
        return tuple(sorted({0, n // 2, n - 1}))


def character_tokenizer() -> Any:
    """A character-level fast tokenizer built in code (no hub, no files).

    Every printable ASCII character is one token, plus ``<pad>``, ``<unk>`` and an
    ``<eos>`` that is deliberately not declared as EOS (benchmarks generate fixed
    lengths); it is enough to drive a random-init model with real strings.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {token: index for index, token in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.padding_side = "left"
    return tokenizer


def fixed_length(model: Any, tokenizer: Any) -> None:
    """Take EOS away from the model and the tokenizer, so every scenario (whatever
    it reads EOS from) generates exactly ``max_new_tokens``: equal work per scenario
    and equal-length outputs for the token check, as vLLM's ``ignore_eos`` does."""
    tokenizer.eos_token = None
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tokenizer.pad_token_id


def random_llama(key: str, sizes: dict[str, int], description: str) -> ModelBundle:
    """Build a random-init Llama (seeded, eval mode, float32) of the given sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = character_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        # No eos: every scenario generates exactly max_new_tokens per prompt.
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
        **sizes,
    )
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(config).eval()
    fixed_length(model, tokenizer)
    return ModelBundle(key, description, model, tokenizer, config.num_hidden_layers)


def bundled_model() -> ModelBundle:
    """The bundled tiny model, or a tiny random Llama while it does not exist yet."""
    try:
        from undercurrent.models import tiny_model_path

        path = tiny_model_path()
        available = (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    except ImportError:
        available = False
    if not available:  # the bundled model is optional until its issue lands
        return random_llama(
            "tiny", TINY_LLAMA, "tiny random Llama (bundled model not available)"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    fixed_length(model, tokenizer)
    layers = model.config.num_hidden_layers
    return ModelBundle("tiny", f"bundled tiny model ({path.name})", model, tokenizer, layers)


def model_directory(key: str, root: Path) -> Path:
    """A directory vLLM can load for ``key``: the model of :func:`load_model` (EOS
    taken away, as for every HF scenario) and its tokenizer, saved under ``root / key``.

    The bundled model is saved again rather than loaded from the package, so vLLM
    (plain and probed alike) generates exactly ``max_new_tokens`` per request."""
    target = root / key
    if not (target / "config.json").is_file():
        bundle = load_model(key)
        bundle.model.save_pretrained(target)
        bundle.tokenizer.save_pretrained(target)
    return target


def model_key(text: str) -> str:
    """``text`` if it names a benchmark model (``tiny``, ``large``, ``deep<N>``),
    else :class:`argparse.ArgumentTypeError` saying what may be given (the
    ``type`` of the tools' ``--model`` options)."""
    if text in ("tiny", "large"):
        return text
    deep = _DEEP_KEY.fullmatch(text)
    if deep is None:
        raise argparse.ArgumentTypeError(f"unknown benchmark model {text!r}; expected "
                                         f"{MODEL_KEYS_HELP}")
    if int(deep.group(1)) not in DEEP_LAYERS:
        raise argparse.ArgumentTypeError(
            f"benchmark model {text!r}: a deep model has {DEEP_LAYERS.start} to "
            f"{DEEP_LAYERS.stop - 1} layers")
    return text


def load_model(key: str, device: str = "cpu", dtype: str | None = None) -> ModelBundle:
    """Load a benchmark model by key: ``tiny``, ``large`` or ``deep<N>``, built (seeded, float32)
    on the CPU and then moved to ``device`` (``"cpu"``, ``"cuda"``) and cast to
    ``dtype`` (a torch dtype name; None keeps float32). Every scenario of a job
    shares these weights, so all of them run on the same device in the same dtype."""
    if key == "tiny":
        bundle = bundled_model()
    elif key == "large":
        bundle = random_llama(
            "large",
            LARGE_LLAMA,
            "random-init Llama, hidden 1024, 8 layers, 16 heads (8 KV), MLP 2816",
        )
    else:
        try:
            model_key(key)
        except argparse.ArgumentTypeError as error:
            raise ValueError(str(error)) from None
        layers = int(key[len("deep"):])
        bundle = random_llama(
            key, {**DEEP_LLAMA, "num_hidden_layers": layers},
            f"random-init Llama of the bundled model's widths (hidden 128), {layers} layers",
        )
    if device == "cpu" and dtype in (None, "float32"):
        return bundle
    import torch

    torch_dtype = None if dtype is None else getattr(torch, dtype, None)
    if dtype is not None and not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {dtype!r} for the benchmark model")
    bundle.model.to(device=device, dtype=torch_dtype)
    bundle.description += f", on {device}" + (f" in {dtype}" if dtype else "")
    return bundle


def synchronize(model: Any) -> None:
    """Wait for the model's device to finish queued work (a no-op off CUDA): a timed
    generation ends when its last kernel has run, not when it was queued."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
