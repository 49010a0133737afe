"""Fixtures for the notebook-layer tests."""

from __future__ import annotations

import pytest
from nb_builders import make_records

from undercurrent.records import ActivationRecord


@pytest.fixture
def records() -> list[ActivationRecord]:
    """Two requests, layers 0 and 1, three prompt and four generated tokens each."""
    return make_records()
