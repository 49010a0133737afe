"""``import undercurrent`` and its light modules never import torch, transformers or vllm."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm")
LIGHT_MODULES = [
    "undercurrent",
    "undercurrent.spec",
    "undercurrent.cli",
    "undercurrent.records",
    "undercurrent.probes",
    "undercurrent.router",
]


def heavy_modules_after_importing(module: str) -> list[str]:
    script = (
        f"import json, sys, {module}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_importing_a_light_module_pulls_in_no_engine(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    assert heavy_modules_after_importing(module) == []


def test_the_spec_api_is_usable_without_engines() -> None:
    script = (
        "import sys\n"
        "from undercurrent.spec import parse_yaml, to_yaml, json_schema\n"
        "spec = parse_yaml(open('specs/continuous_trajectory.yaml').read())\n"
        "assert parse_yaml(to_yaml(spec)) == spec and json_schema()\n"
        f"assert not [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, cwd=root
    )
    assert result.returncode == 0, result.stderr
