"""The vLLM engine tests run in a process of their own (vLLM patches libraries and
initialises process-wide state): ``tests/vllm/test_vllm_engine_suite.py`` starts one
pytest process per engine test file with UNDERCURRENT_VLLM_ENGINE_TESTS=1. Collected
from the main suite, they are ignored.

To run one by hand::

    UNDERCURRENT_VLLM_ENGINE_TESTS=1 .venv/bin/python -m pytest tests/vllm/engine/FILE
"""

from __future__ import annotations

import os

if os.environ.get("UNDERCURRENT_VLLM_ENGINE_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]
