"""environment.yml (conda) stays in step with pyproject.toml's hf and notebook extras.

No conda channel is reachable here, so this checks what can be checked offline:
the file parses, pins the Python and the CPU torch index, installs this checkout
with both extras, and lists every requirement of those extras as written.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ("hf", "notebook")


def _environment() -> dict:
    return yaml.safe_load((REPO / "environment.yml").read_text(encoding="utf-8"))


def _pip_lines() -> list[str]:
    for dependency in _environment()["dependencies"]:
        if isinstance(dependency, dict) and "pip" in dependency:
            return [str(line) for line in dependency["pip"]]
    raise AssertionError("environment.yml has no pip section")


def _normalise(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement).lower().replace("_", "-")


def test_environment_has_python_pip_and_the_cpu_torch_index():
    environment = _environment()
    assert environment["name"] == "undercurrent"
    plain = [d for d in environment["dependencies"] if isinstance(d, str)]
    assert any(d.startswith("python=3.") for d in plain) and "pip" in plain
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in _pip_lines()


def test_environment_installs_this_checkout_with_the_hf_and_notebook_extras():
    assert "-e .[hf,notebook]" in _pip_lines()


def test_every_requirement_of_the_extras_appears_in_the_environment():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    listed = {_normalise(line) for line in _pip_lines()}
    wanted = [(extra, requirement) for extra in EXTRAS
              for requirement in project["optional-dependencies"][extra]]
    missing = [f"{requirement} ({extra})" for extra, requirement in wanted
               if _normalise(requirement) not in listed]
    assert not missing, f"add to environment.yml's pip section: {missing}"
