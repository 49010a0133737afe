"""The bundled tiny model: a small Llama trained on a synthetic corpus, with its probe.

``tiny_model_path()`` is the directory holding the weights, configs, tokenizer
and the trained linear probe (``probe.safetensors``). Importing this module
does not import torch.
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL_NAME = "undercurrent/tiny"
"""Short name that ``ProbedModel.from_pretrained`` resolves to ``tiny_model_path()``."""


def tiny_model_path() -> Path:
    """Directory of the bundled tiny model (package data, no download needed).

    >>> (tiny_model_path() / "config.json").name
    'config.json'
    """
    return Path(__file__).resolve().parent / "tiny"


def resolve_model_path(name_or_path: str) -> str:
    """``"undercurrent/tiny"`` / ``"tiny"`` -> the bundled model's directory; any other
    name or path is returned unchanged."""
    if name_or_path in (TINY_MODEL_NAME, "tiny", "undercurrent-tiny"):
        return str(tiny_model_path())
    return name_or_path


def model_name_for(path: str) -> str:
    """The name a model loaded from ``path`` goes by: ``"undercurrent/tiny"`` for
    the bundled model's directory however it is spelt (so a store captured from
    it by name, by path or as a loaded model is one model's), else ``path``.

    >>> model_name_for(str(tiny_model_path())), model_name_for("org/model")
    ('undercurrent/tiny', 'org/model')
    """
    if path and os.path.realpath(path) == str(tiny_model_path()):
        return TINY_MODEL_NAME
    return path


def tiny_probe_path() -> Path:
    """The bundled model's trained linear probe (``linear_probe`` format)."""
    return tiny_model_path() / "probe.safetensors"

