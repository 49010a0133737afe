"""undercurrent: live activation probing of language models while they generate.

Importing this package is cheap: torch, transformers and vllm are imported only
when a model is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["ActivationStore", "ProbedModel", "GenerationOutput", "open_activations",
           "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from undercurrent.api import GenerationOutput, ProbedModel
    from undercurrent.store.reader import ActivationStore, open_activations


def __getattr__(name: str) -> Any:
    # Lazy: `import undercurrent` stays free of torch, numpy and pandas (test_import_light).
    if name in ("ProbedModel", "GenerationOutput", "StreamEvent"):
        from undercurrent import api

        return getattr(api, name)
    if name in ("open_activations", "ActivationStore"):
        from undercurrent.store import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'undercurrent' has no attribute {name!r}")
