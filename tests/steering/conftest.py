"""Shared fixtures of the steering tests: the bundled model, prompts of different
lengths, and the hand-written forward hooks the edits are checked against."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def tiny():
    """The bundled model in a ProbedModel with no spec (float32, CPU)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from undercurrent import ProbedModel

    probed = ProbedModel.from_pretrained("undercurrent/tiny")
    yield probed
    probed.close()
