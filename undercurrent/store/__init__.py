"""The activation store: capture generations' activations to disk, read them back
memory-mapped, and sweep linear probes over layers.

>>> summary = model.capture(prompts, "acts/", max_new_tokens=32)   # doctest: +SKIP
>>> store = open_activations("acts/")                                # doctest: +SKIP
>>> sweep_linear_probes(store, labels, point="resid")                # doctest: +SKIP

Names are imported on first use (numpy, pandas and pyarrow come with the
``notebook`` extra). See ``docs/store.md`` for the format and scale-out.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "ActivationStore": "undercurrent.store.reader",
    "open_activations": "undercurrent.store.reader",
    "POSITIONS": "undercurrent.store.reader",
    "CaptureSummary": "undercurrent.store.capture",
    "capture_activations": "undercurrent.store.capture",
    "Reduction": "undercurrent.store.format",
    "StoreError": "undercurrent.store.format",
    "StoreOverflowWarning": "undercurrent.store.format",
    "INDEX_COLUMNS": "undercurrent.store.format",
    "OUTPUT_COLUMNS": "undercurrent.store.format",
    "sweep_linear_probes": "undercurrent.store.sweep",
    "sweep_figure": "undercurrent.store.sweep",
    "SWEEP_COLUMNS": "undercurrent.store.sweep",
}

__all__ = [
    "INDEX_COLUMNS",
    "OUTPUT_COLUMNS",
    "POSITIONS",
    "SWEEP_COLUMNS",
    "ActivationStore",
    "CaptureSummary",
    "Reduction",
    "StoreError",
    "StoreOverflowWarning",
    "capture_activations",
    "open_activations",
    "sweep_figure",
    "sweep_linear_probes",
]

if TYPE_CHECKING:  # pragma: no cover
    from undercurrent.store.capture import CaptureSummary, capture_activations
    from undercurrent.store.format import (
        INDEX_COLUMNS,
        OUTPUT_COLUMNS,
        Reduction,
        StoreError,
        StoreOverflowWarning,
    )
    from undercurrent.store.reader import POSITIONS, ActivationStore, open_activations
    from undercurrent.store.sweep import SWEEP_COLUMNS, sweep_figure, sweep_linear_probes


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'undercurrent.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
