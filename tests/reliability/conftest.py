"""Fixtures of the reliability suite.

``figures`` collects the numbers each test measured (inputs tried, faults
injected, records lost, time and memory). With ``UNDERCURRENT_RELIABILITY_REPORT=PATH``
they are written there as JSON at the end of the session; ``docs/reliability.md``
quotes such a run.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("UNDERCURRENT_VLLM_ENGINE_TESTS") != "1":
    # Engine tests run in a process of their own (test_vllm_reliability.py starts it):
    # vLLM patches libraries and initialises process-wide state.
    collect_ignore = ["vllm_engine_reliability.py"]

_FIGURES: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_reaches_python() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt here, as in a terminal or a notebook.

    A shell starts a background job (``cmd &``, ``nohup``) with SIGINT ignored, and
    Python then never installs its handler: a simulated or real Ctrl-C would do
    nothing and the interruption tests could not interrupt anything. They test
    what a user's Ctrl-C does, so they get the handler a user has.
    """
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def ctrl_c_not_lost_in_gc_callbacks(no_gc_callbacks: None) -> None:
    """Every test here may send a Ctrl-C at a random moment: none is lost in a
    garbage-collector callback (see ``no_gc_callbacks``)."""


class Figures:
    """``figures.add("item", key=value, ...)``: numbers for the report."""

    def add(self, item: str, **values: Any) -> None:
        bucket = _FIGURES.setdefault(item, {})
        for key, value in values.items():
            if isinstance(value, (int, float)) and isinstance(bucket.get(key), (int, float)):
                bucket[key] = bucket[key] + value if key.endswith("_count") else value
            else:
                bucket[key] = value


@pytest.fixture(scope="session")
def figures() -> Iterator[Figures]:
    yield Figures()
    target = os.environ.get("UNDERCURRENT_RELIABILITY_REPORT")
    if target:
        path = Path(target)
        existing = json.loads(path.read_text()) if path.exists() else {}
        for item, values in _FIGURES.items():
            existing.setdefault(item, {}).update(values)
        path.write_text(json.dumps(existing, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def tiny() -> tuple[Any, Any]:
    """The seeded tiny random Llama and its tokenizer (built once per session)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from reliability_support import tiny_model, tiny_tokenizer

    return tiny_model(), tiny_tokenizer()
