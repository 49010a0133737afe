from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("torch")
    from store_helpers import SPEC

    from undercurrent import ProbedModel

    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=SPEC)
    yield model
    model.close()
