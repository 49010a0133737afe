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
