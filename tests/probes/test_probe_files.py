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
