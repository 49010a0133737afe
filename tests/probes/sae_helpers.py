"""SAE folders in SAELens's on-disk layout, written by hand (no SAELens needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file


def write_sae(folder: Path, *, architecture: str = "standard", d_in: int = 4, d_sae: int = 6,
              seed: int = 0, hook_name: str | None = "blocks.3.hook_resid_post",
              config: dict[str, Any] | None = None,
              arrays: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``cfg.json`` and ``sae_weights.safetensors``; returns the float32 arrays."""
    rng = np.random.default_rng(seed)
    weights = {
        "W_enc": rng.normal(size=(d_in, d_sae)),
        "b_enc": rng.normal(size=d_sae) * 0.1,
        "W_dec": rng.normal(size=(d_sae, d_in)),
        "b_dec": rng.normal(size=d_in) * 0.1,
    }
    if architecture == "jumprelu":
        weights["threshold"] = rng.uniform(0.0, 0.5, size=d_sae)
    weights.update(arrays or {})
    weights = {name: np.asarray(value, dtype=np.float32) for name, value in weights.items()}
    cfg: dict[str, Any] = {
        "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
        "apply_b_dec_to_input": True, "normalize_activations": "none",
        "reshape_activations": "none", "architecture": architecture,
        "metadata": {"sae_lens_version": "6.54.12", "hook_name": hook_name},
    }
    if architecture == "topk":
        cfg.update(k=2, rescale_acts_by_decoder_norm=False)
    cfg.update(config or {})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(weights, str(folder / "sae_weights.safetensors"))
    return {name: value.astype(np.float64) for name, value in weights.items()}
