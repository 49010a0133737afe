"""The one architecture table: where each model family keeps its decoder layers,
their attention and MLP blocks, and the final norm.

Paths are attribute paths: ``layers`` and ``final_norm`` from the ``*ForCausalLM``
module, ``attention`` and ``mlp`` from one decoder layer. Entries are looked up by
``config.model_type``, so ``inspect-model`` can answer from a config alone.
No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from undercurrent.adapters.capabilities import UnsupportedArchitectureError

__all__ = ["ARCHITECTURES", "ArchitectureEntry", "UnsupportedArchitectureError",
           "config_dimensions", "find_architecture", "resolve_path", "supported_model_types",
           "text_config"]

@dataclass(frozen=True)
class ArchitectureEntry:
    """Where one family keeps its capture sites.

    ``mlp_out`` is the output of the ``mlp`` module (before any post-norm, dropout
    or residual add); ``attn_out`` likewise for ``attention``.
    """

    family: str
    model_types: tuple[str, ...]
    layers: str
    attention: str
    mlp: str
    final_norm: str
    notes: str = ""


PARALLEL_BLOCKS = "parallel attention and MLP"
"""The note of a family whose layers run attention and MLP side by side."""


_LLAMA_LIKE = dict(layers="model.layers", attention="self_attn", mlp="mlp",
                   final_norm="model.norm")

ARCHITECTURES: tuple[ArchitectureEntry, ...] = (
    ArchitectureEntry("Llama", ("llama",), **_LLAMA_LIKE),
    ArchitectureEntry("Mistral", ("mistral",), **_LLAMA_LIKE),
    ArchitectureEntry("Mixtral", ("mixtral",), **_LLAMA_LIKE,
                      notes="mlp is the sparse mixture-of-experts block"),
    ArchitectureEntry("Qwen2", ("qwen2",), **_LLAMA_LIKE),
    ArchitectureEntry("Qwen2-MoE", ("qwen2_moe",), **_LLAMA_LIKE,
                      notes="mlp is the sparse mixture-of-experts block (with shared expert)"),
    ArchitectureEntry("Qwen3", ("qwen3",), **_LLAMA_LIKE),
    ArchitectureEntry("Qwen3-MoE", ("qwen3_moe",), **_LLAMA_LIKE,
                      notes="mlp is the sparse mixture-of-experts block"),
    ArchitectureEntry("Gemma", ("gemma",), **_LLAMA_LIKE),
    ArchitectureEntry("Gemma2", ("gemma2",), **_LLAMA_LIKE,
                      notes="attn_out/mlp_out are taken before the post-attention/"
                            "post-feedforward norms"),
    ArchitectureEntry("Gemma3 (text)", ("gemma3_text",), **_LLAMA_LIKE,
                      notes="attn_out/mlp_out are taken before the post-attention/"
                            "post-feedforward norms; kv on sliding-window layers only "
                            "for tokens still inside the window"),
    ArchitectureEntry("Phi-3", ("phi3",), **_LLAMA_LIKE),
    ArchitectureEntry("Granite", ("granite",), **_LLAMA_LIKE,
                      notes="attn_out/mlp_out are before the residual multiplier"),
    ArchitectureEntry("OLMo2", ("olmo2",), **_LLAMA_LIKE),
    ArchitectureEntry("Phi", ("phi",), layers="model.layers", attention="self_attn", mlp="mlp",
                      final_norm="model.final_layernorm",
                      notes=PARALLEL_BLOCKS),
    ArchitectureEntry("GPT-2", ("gpt2",), layers="transformer.h", attention="attn", mlp="mlp",
                      final_norm="transformer.ln_f"),
    ArchitectureEntry("GPT-NeoX", ("gpt_neox",), layers="gpt_neox.layers",
                      attention="attention", mlp="mlp",
                      final_norm="gpt_neox.final_layer_norm"),
    ArchitectureEntry("GPT-J", ("gptj",), layers="transformer.h", attention="attn", mlp="mlp",
                      final_norm="transformer.ln_f", notes=PARALLEL_BLOCKS),
    ArchitectureEntry("OPT", ("opt",), layers="model.decoder.layers", attention="self_attn",
                      mlp="fc2", final_norm="model.decoder.final_layer_norm",
                      notes="no MLP module: mlp_out is the fc2 projection (before dropout "
                            "and the residual add); needs do_layer_norm_before=True"),
    ArchitectureEntry("Falcon", ("falcon",), layers="transformer.h",
                      attention="self_attention", mlp="mlp", final_norm="transformer.ln_f"),
)

_BY_MODEL_TYPE = {model_type: entry for entry in ARCHITECTURES for model_type in entry.model_types}


def supported_model_types() -> tuple[str, ...]:
    """Every ``config.model_type`` the table knows."""
    return tuple(_BY_MODEL_TYPE)


def text_config(config: Any) -> Any:
    """The language-model part of a config (multimodal configs nest it)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def find_architecture(model_or_config: Any) -> ArchitectureEntry:
    """The table entry for a model (or its config), by ``config.model_type``.

    Raises :class:`UnsupportedArchitectureError` naming the model class, the
    model_type looked for and the supported ones.
    """
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    entry = _BY_MODEL_TYPE.get(model_type or "")
    if entry is None:
        text_type = getattr(text_config(config), "model_type", None)
        entry = _BY_MODEL_TYPE.get(text_type or "")
    if entry is None:
        what = type(model_or_config).__name__
        raise UnsupportedArchitectureError(
            f"unknown architecture: {what} (config.model_type={model_type!r}) is not in "
            f"undercurrent's architecture table; supported model_type values: "
            f"{', '.join(sorted(_BY_MODEL_TYPE))}. Add an ArchitectureEntry to "
            "undercurrent/adapters/hf/architectures.py naming its layers, attention, mlp "
            "and final norm"
        )
    return entry


_TEXT_MODEL_CLASSES = {"gemma3": "Gemma3ForCausalLM.from_pretrained(path)"}
"""The text-only class to load, by a multimodal wrapper's ``model_type``."""


def check_hookable_layout(model: Any, entry: ArchitectureEntry) -> None:
    """Refuse, naming what is wrong, a model of a known family whose layout the
    table's entry does not describe: a multimodal wrapper around a known language
    model, and post-LN OPT (``do_layer_norm_before=False``, as ``opt-350m``), which
    has no final norm to capture and puts each norm after its block."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in entry.model_types:  # (found through the text config)
        text_type = getattr(text_config(config), "model_type", None)
        text_class = _TEXT_MODEL_CLASSES.get(str(model_type), "its *ForCausalLM class")
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} is a multimodal wrapper (config.model_type="
            f"{model_type!r}) around a {text_type!r} language model; the hf backend hooks "
            f"a language model alone: load the text model with {text_class} "
            "(AutoModelForCausalLM gives the wrapper for this checkpoint)")
    if model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}: post-LN OPT (config.do_layer_norm_before=False, as "
            "facebook/opt-350m) is not supported: its layers normalise after each block and "
            "it has no final norm, so the table's capture sites do not exist; the pre-LN OPT "
            "checkpoints (opt-125m, opt-1.3b and larger) are")
    if model_type == "opt" and getattr(config, "_remove_final_layer_norm", False):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}: OPT without its final layer norm "
            "(config._remove_final_layer_norm=True) is not supported: the table captures "
            "the final norm at model.decoder.final_layer_norm")


def runs_in_parallel(entry: ArchitectureEntry, config: Any) -> bool:
    """Whether this model's layers run attention and MLP in parallel: fixed for a
    family (GPT-J, Phi), read from the config where it is a setting (GPT-NeoX's
    ``use_parallel_residual``, Falcon's ``parallel_attn`` or its new decoder)."""
    if "gpt_neox" in entry.model_types:
        return bool(getattr(config, "use_parallel_residual", True))
    if "falcon" in entry.model_types:
        return bool(getattr(config, "parallel_attn", True)
                    or getattr(config, "new_decoder_architecture", False))
    return PARALLEL_BLOCKS in entry.notes


def resolve_path(root: Any, path: str, *, model: Any, what: str) -> Any:
    """Follow a dotted attribute path, with an error naming what was looked for."""
    current = root
    for part in path.split("."):
        nxt = getattr(current, part, None)
        if nxt is None:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__}: the architecture table says the {what} is at "
                f"{path!r}, but {type(current).__name__} has no (non-None) attribute {part!r}"
            )
        current = nxt
    return current


def config_dimensions(config: Any) -> dict[str, int | None]:
    """Layer count, hidden size, KV heads and head dim read from a config."""
    config = text_config(config)

    def first(*names: str) -> Any:
        for name in names:
            value = getattr(config, name, None)
            if value is not None:
                return value
        return None

    num_layers = first("num_hidden_layers", "n_layer", "num_layers")
    hidden = first("hidden_size", "n_embd", "d_model")
    heads = first("num_attention_heads", "n_head")
    kv_heads = first("num_key_value_heads", "num_kv_heads")
    if getattr(config, "model_type", "") == "falcon":
        if not getattr(config, "new_decoder_architecture", False):
            kv_heads = 1 if getattr(config, "multi_query", True) else heads
    if kv_heads is None:
        kv_heads = heads
    head_dim = first("head_dim")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    return {"num_layers": num_layers, "hidden_size": hidden, "num_kv_heads": kv_heads,
            "head_dim": head_dim}
