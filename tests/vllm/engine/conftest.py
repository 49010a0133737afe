"""The vLLM engine tests run in a process of their own (vLLM patches libraries and
initialises process-wide state): ``tests/vllm/test_vllm_engine_suite.py`` starts one
pytest process per engine test file with UNDERCURRENT_VLLM_ENGINE_TESTS=1. Collected
from the main suite, they are ignored.

To run one by hand::

    UNDERCURRENT_VLLM_ENGINE_TESTS=1 .venv/bin/python -m pytest tests/vllm/engine/FILE
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("UNDERCURRENT_VLLM_ENGINE_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]


# Shared by every engine test file (each file starts its own engine).
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vllm_engine_helpers import model_for_tests

    return model_for_tests(tmp_path_factory)


@pytest.fixture(scope="module")
def num_layers(model_dir):
    import json
    from pathlib import Path

    return int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])
