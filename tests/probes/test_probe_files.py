"""Probe files can be named relative to the installed package (``undercurrent:``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import undercurrent
from undercurrent.probes.weights import ProbeFileError, load_linear_weights, resolve_probe_path


def test_package_relative_path_names_the_bundled_probe_wherever_the_package_lives():
    resolved = resolve_probe_path("undercurrent:models/tiny/probe.safetensors")
    package_root = Path(undercurrent.__file__).resolve().parent
    assert resolved == package_root / "models" / "tiny" / "probe.safetensors"
    weights = load_linear_weights("undercurrent:models/tiny/probe.safetensors")
    assert weights.hidden == 128 and weights.metadata["tensor_type"] == "residual_stream"


def test_plain_paths_are_not_rewritten(tmp_path: Path):
    assert resolve_probe_path(tmp_path / "p.npz") == (tmp_path / "p.npz").resolve()


def test_a_missing_package_relative_file_is_a_clear_error():
    with pytest.raises(ProbeFileError, match="does not exist"):
        load_linear_weights("undercurrent:models/tiny/nothing.safetensors")


def test_a_bfloat16_probe_file_is_read_and_widened_to_float64(tmp_path: Path):
    """What torch users save from a bfloat16 model: numpy has no bfloat16, so the
    file is read through torch (it was refused as 'not a valid safetensors file')."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    bundled = load_linear_weights("undercurrent:models/tiny/probe.safetensors")
    tensors = {name: torch.tensor(getattr(bundled, name)).to(torch.bfloat16).contiguous()
               for name in ("weight", "bias")}
    path = tmp_path / "probe_bf16.safetensors"
    save_file(tensors, str(path), metadata=dict(bundled.metadata))
    read = load_linear_weights(path)
    assert read.weight.dtype == "float64"
    assert read.weight.tolist() == tensors["weight"].double().tolist()
    assert float(read.bias) == float(tensors["bias"])
    assert read.metadata == bundled.metadata


def test_a_probe_saved_under_home_loads_from_the_same_string(home):
    """save_linear_weights (and so fit_linear_probe(save_to=)) wrote "~/p.safetensors"
    to ./~/p.safetensors, while loading expanded "~" and looked in $HOME."""
    import numpy as np

    from undercurrent.notebook import fit_linear_probe
    from undercurrent.probes import save_linear_weights

    X = np.random.default_rng(0).normal(size=(20, 4))
    fit = fit_linear_probe(X, [0, 1] * 10, save_to="~/fit.safetensors")
    assert fit.path == home / "fit.safetensors"
    assert load_linear_weights("~/fit.safetensors").weight.shape[-1] == 4
    assert save_linear_weights("~/p.npz", np.ones(4), 0.0) == home / "p.npz"
    assert load_linear_weights("~/p.npz").weight.shape[-1] == 4
    with pytest.raises(ValueError, match="save_linear_weights: path is an empty path; give"):
        save_linear_weights("", np.ones(4), 0.0)
