"""Checks of ``from_pretrained`` arguments shared by every backend, so a wrong model
path or dtype is reported by name here rather than from deep inside the engine."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_DTYPE_ADVICE = ("use 'auto' (the dtype in the model's config.json), 'float32', 'bfloat16', "
                 "'float16' or a floating-point torch.dtype")


def dtype_name(dtype: Any) -> str | None:
    """``dtype`` as a torch floating-point dtype name (``"float32"``), ``"auto"`` or
    None (the backend's default: the model's own dtype).

    Accepts None, ``"auto"``, a name torch knows (``"float32"``, ``"bfloat16"``,
    ``"half"``, also spelt ``"torch.float32"``) or a ``torch.dtype``; anything else
    is a ``ValueError``/``TypeError`` naming the ``dtype`` argument.
    """
    if dtype is None or dtype == "auto":
        return None if dtype is None else "auto"
    import torch

    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype; {_DTYPE_ADVICE}")
    elif isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        raise TypeError(f"dtype must be a string or a torch.dtype, got {type(dtype).__name__} "
                        f"({dtype!r:.40}); {_DTYPE_ADVICE}")
    if not resolved.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point dtype, which model weights "
                         f"need; {_DTYPE_ADVICE}")
    return str(resolved).removeprefix("torch.")


def looks_like_local_path(name: str) -> bool:
    """True when ``name`` cannot be a hub id (``owner/name`` or ``name``): absolute,
    relative with ``.``/``~``, or more than one ``/``; or is meant as a local path:
    an ``owner/name`` whose ``owner`` is a directory here (``models/llama``)."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or os.sep != "/" and os.sep in name
            or name.count("/") == 1 and os.path.isdir(name.split("/")[0]))


def check_device(device: Any) -> None:
    """Refuse a ``device`` torch does not know, or a CUDA device on a torch build
    without CUDA, naming the argument (torch's own errors name neither)."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {device!r} is not a device torch knows; use e.g. 'cpu', "
                         "'cuda' or 'cuda:1' (or leave it out)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asks for CUDA, but this torch has no CUDA "
                         "device (torch.cuda.is_available() is False); use 'cpu'")


def check_model_path(name: str) -> None:
    """Refuse a model path that does not exist and cannot be a hub id (transformers
    would answer "Repo id must be in the form ..."), or that is a file, not a
    directory (the model's config.json or weights: transformers would read it as a
    checkpoint and fail in torch's unpickler), naming it."""
    if os.path.exists(name) and not os.path.isdir(name):
        raise NotADirectoryError(
            f"model path {name!r} is a file, not a directory; pass the directory holding "
            "config.json and the weights")
    if not os.path.exists(name) and looks_like_local_path(name):
        raise FileNotFoundError(
            f"model path {name!r} does not exist; pass a directory holding config.json and "
            "the weights, a hub id such as 'owner/name', or 'undercurrent/tiny' for the "
            "bundled model")


def config_dtype(directory: str) -> str | None:
    """The dtype a model directory's ``config.json`` declares (``dtype``, or the older
    ``torch_dtype``; a multimodal config's ``text_config`` too), or None."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = section.get(key) if isinstance(section, dict) else None
            if isinstance(value, str) and value != "auto":
                return value.removeprefix("torch.")
    return None
