"""Where the capture sites sit on vLLM's native model classes.

One table names, per model family, the decoder-layer list, the attention and MLP
attributes of a layer and the final norm. Native vLLM decoder layers return
``(hidden, residual)``: the residual stream after the layer is their sum; a few
(GPT-2, GPT-J style) return the hidden state alone. Only the families of the
architecture table (:mod:`undercurrent.adapters.hf.architectures`) are hooked:
their layer outputs are known to read this way, where some other vLLM layers
(StableLM's, Cohere's) return a pair whose first part already holds the residual.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from undercurrent.adapters.capabilities import UnsupportedArchitectureError
from undercurrent.adapters.hf.architectures import find_architecture, supported_model_types

_LAYER_LISTS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
                "transformer.layers", "model.language_model.layers")
_ATTENTION = ("self_attn", "attn", "attention", "self_attention")
# (OPT has no MLP module: its mlp_out is the fc2 projection, as on the HF backend;
# Mixtral's is its sparse mixture-of-experts block, the HF backend's ``mlp``)
_MLP = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "fc2")
#: The module of vLLM's Transformers modeling backend (its fallback model classes).
_TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers"
_FINAL_NORMS = ("model.norm", "model.decoder.final_layer_norm", "transformer.ln_f",
                "gpt_neox.final_layer_norm", "transformer.norm_f", "model.language_model.norm")


@dataclass
class ModelLayout:
    """The modules each tensor type is captured from."""

    model_class: str
    layers: list[Any]
    attention: list[Any]
    mlp: list[Any]
    final_norm: Any | None
    kv_attention: list[Any | None]

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _resolve(root: Any, dotted: str) -> Any | None:
    node = root
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _first_attr(module: Any, names: tuple[str, ...]) -> Any | None:
    for name in names:
        child = getattr(module, name, None)
        if child is not None:
            return child
    return None


def _kv_module(attention: Any) -> Any | None:
    """vLLM's ``Attention`` layer inside an attention block: it receives the rotated
    keys and the values that it writes to the KV cache."""
    child = getattr(attention, "attn", None)
    if child is not None and type(child).__name__ == "Attention":
        return child
    return None


@functools.cache
def _family_classes() -> frozenset[str]:
    """The causal-LM class names of the architecture table's families
    (``MistralForCausalLM``, ...), as transformers names them and vLLM's native
    classes for them are named."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
                     for model_type in supported_model_types()
                     if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_family(config: Any, what: str, class_name: str | None = None) -> None:
    """Refuse a model whose ``config.model_type`` the architecture table does not
    know (``what`` names the model in the message), unless its class
    (``class_name``: vLLM's, or the config's architecture) is a table family's:
    its layers may return their output in a form the residual stream would be
    misread from. (vLLM reads a Mistral checkpoint's ``params.json`` with
    ``model_type`` "transformer", and runs Ministral 3 or InternLM3 with its
    Mistral or Llama class, whose layers are the table's.)"""
    try:
        find_architecture(config)
    except UnsupportedArchitectureError:
        if class_name is not None and class_name in _family_classes():
            return
        raise UnsupportedArchitectureError(
            f"{what} (config.model_type={getattr(config, 'model_type', None)!r}) is not a "
            "family in undercurrent's architecture table, so the vllm backend cannot tell "
            "how its decoder layers return the residual stream (vLLM's StableLM and Cohere "
            "layers, for two, return it already summed; read as the table's families would "
            "be, records would be wrong); supported model_type values: "
            f"{', '.join(sorted(supported_model_types()))}") from None


def locate(model: Any, config: Any = None) -> ModelLayout:
    """Find the capture sites on a loaded vLLM model, or raise
    :class:`~undercurrent.adapters.capabilities.UnsupportedArchitectureError` (the
    same error the Hugging Face backend raises for a model it cannot hook).
    ``config`` (default: the model's own ``config``) is the Hugging Face config
    whose ``model_type`` must be in the architecture table."""
    class_name = type(model).__name__
    if (type(model).__module__.startswith(_TRANSFORMERS_BACKEND)
            or class_name.startswith("Transformers")):
        # (it wraps the transformers model, whose layers are found below but see
        # the step's tokens flattened: their rows are not the requests' own)
        raise UnsupportedArchitectureError(
            f"vLLM runs this model through its Transformers modeling backend (class "
            f"{class_name!r}: model_impl='transformers', or no native vLLM class for the "
            "architecture); the vLLM adapter hooks vLLM's native model classes only: use "
            "backend='hf' for this model")
    config = getattr(model, "config", None) if config is None else config
    if config is not None:
        check_family(config, f"vLLM model class {class_name!r}", class_name)
    layers = next((found for path in _LAYER_LISTS
                   if (found := _resolve(model, path)) is not None), None)
    if layers is None or len(layers) == 0:
        raise UnsupportedArchitectureError(
            f"cannot find the decoder layers of vLLM model class {class_name!r} (looked for "
            f"{', '.join(_LAYER_LISTS)}); vLLM's Transformers-backend fallback models are not "
            "supported by the vLLM adapter: use backend='hf' for this model"
        )
    attention = [_first_attr(layer, _ATTENTION) for layer in layers]
    mlp = [_first_attr(layer, _MLP) for layer in layers]
    missing = [f"layer {i} has no {what} block" for i, layer in enumerate(layers)
               for what, found in (("attention", attention[i]), ("MLP", mlp[i]))
               if found is None]
    if missing:
        raise UnsupportedArchitectureError(
            f"vLLM model class {class_name!r}: " + "; ".join(missing[:4]))
    final_norm = next((found for path in _FINAL_NORMS
                       if (found := _resolve(model, path)) is not None), None)
    return ModelLayout(
        model_class=class_name,
        layers=list(layers),
        attention=attention,
        mlp=mlp,
        final_norm=final_norm,
        kv_attention=[_kv_module(block) for block in attention],
    )


def residual_stream(output: Any) -> Any:
    """The residual stream after a decoder layer, from the layer's output."""
    if isinstance(output, tuple):
        hidden = output[0]
        residual = output[1] if len(output) > 1 else None
        if residual is not None and hasattr(residual, "shape") and residual.shape == hidden.shape:
            return hidden + residual
        return hidden
    return output


def first_tensor(output: Any) -> Any:
    """A block's output tensor (vLLM norms called with a residual return a pair)."""
    return output[0] if isinstance(output, tuple) else output


def output_bias(output: Any) -> Any | None:
    """The bias an attention or MLP block returns beside its output, not yet added
    (its output projection built with ``skip_bias_add=True``, as Falcon's: the block
    returns ``(out, bias)`` and the decoder layer adds the bias later), or None.
    The block's output, as the Hugging Face backend captures it, is ``out + bias``."""
    if not (isinstance(output, tuple) and len(output) == 2):
        return None
    out, bias = output
    if bias is None or not hasattr(bias, "shape") or not hasattr(out, "shape"):
        return None
    return bias if tuple(bias.shape) == tuple(out.shape[-1:]) else None


def leaves_unreduced(block: Any) -> bool:
    """Whether an attention or MLP block's output projection (the block itself or
    a child of it) is a ``RowParallelLinear`` built with ``reduce_results=False``:
    under tensor parallelism its output is then each rank's partial sum, which
    the decoder layer all-reduces later (vLLM's Falcon with
    ``new_decoder_architecture`` or ``parallel_attn`` reduces the sum of attention
    and MLP outputs at once). A mixture-of-experts block's shared expert, a
    grandchild, is reduced inside the block and does not count."""
    return any(any(cls.__name__ == "RowParallelLinear" for cls in type(module).__mro__)
               and getattr(module, "reduce_results", True) is False
               for module in (block, *block.children()))
