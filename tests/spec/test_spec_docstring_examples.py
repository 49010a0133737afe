"""The examples in the spec package's docstrings run and hold."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import undercurrent.spec

MODULES = sorted(
    f"undercurrent.spec.{path.stem}"
    for path in Path(undercurrent.spec.__file__).parent.glob("*.py")
    if path.stem != "__init__"
) + ["undercurrent.spec"]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module(module_name)
    # Examples refer to specs/ relative to the repository.
    monkeypatch.chdir(Path(undercurrent.spec.__file__).resolve().parents[2])
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
