"""The Hugging Face transformers backend: forward hooks located through one
architecture table, live capture during ``model.generate()``.

``architectures`` has no torch import; ``backend``/``hooks`` import torch.
"""

from __future__ import annotations

from undercurrent.adapters.hf.architectures import (
    ARCHITECTURES,
    ArchitectureEntry,
    UnsupportedArchitectureError,
    find_architecture,
)

__all__ = [
    "ARCHITECTURES",
    "ArchitectureEntry",
    "UnsupportedArchitectureError",
    "find_architecture",
]
