"""Point vLLM at a model directory it can load, in the model's own dtype.

vLLM's ``dtype="auto"`` does not mean the checkpoint's dtype: it runs float32
checkpoints in half precision (bfloat16 on vLLM's CPU build), so tokens and
activations differ from transformers'. :func:`engine_dtype` resolves "auto" to the
dtype in the model's ``config.json`` before vLLM sees it.

vLLM loads every ``*.safetensors`` file of a directory that has no
``model.safetensors.index.json``, so a probe saved next to the model (undercurrent's
``linear_probe`` files are safetensors, and the bundled model ships one) breaks the
load with "no module or parameter named 'bias'". When a directory holds such extra
files, vLLM gets a temporary directory of links to everything else.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from undercurrent.adapters.arguments import config_dtype, dtype_name

_SHARD = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def extra_safetensors(directory: Path) -> list[Path]:
    """Safetensors files vLLM would wrongly load as weights (none when an index says
    which files hold the weights, or when the weights are not ``model*.safetensors``)."""
    if not directory.is_dir() or (directory / "model.safetensors.index.json").exists():
        return []
    files = sorted(directory.glob("*.safetensors"))
    weights = [path for path in files if _SHARD.match(path.name)]
    if not weights:
        return []
    return [path for path in files if path not in weights]


def loadable_directory(path: str) -> tuple[str, str | None]:
    """``(directory to give vLLM, temporary directory to remove later or None)``."""
    directory = Path(path)
    extras = extra_safetensors(directory)
    if not extras:
        return path, None
    staging = Path(tempfile.mkdtemp(prefix="undercurrent-vllm-model-"))
    skipped = {extra.name for extra in extras}
    for entry in directory.iterdir():
        if entry.name not in skipped:
            (staging / entry.name).symlink_to(entry.resolve())
    return str(staging), str(staging)


def remove_staging(staging: str | None) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def engine_dtype(path: str, dtype: Any) -> str:
    """The dtype to give vLLM: ``dtype`` when one is named (``"bfloat16"`` runs a
    float32 model in half precision, faster on CPU, records off by ~2e-2 relative), else
    the dtype the model's ``config.json`` declares, else vLLM's own ``"auto"``."""
    name = dtype_name(dtype)
    if name not in (None, "auto"):
        return name
    return config_dtype(path) or "auto"
