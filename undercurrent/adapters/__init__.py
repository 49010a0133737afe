"""Engine adapters: the backend protocol, backend-neutral capture bookkeeping, and
the Hugging Face (``adapters.hf``) and vLLM (``adapters.vllm``) backends.

Nothing here imports torch, transformers or vllm at import time; each backend
imports its engine when it is loaded (:func:`backend_class`).
"""

from __future__ import annotations

from undercurrent.adapters.base import (
    Backend,
    BackendError,
    SamplingParams,
    backend_class,
    known_backends,
)
from undercurrent.adapters.capabilities import (
    Capabilities,
    CapabilityError,
    UnsupportedArchitectureError,
    check_points,
)
from undercurrent.adapters.outputs import AbortInfo, GenerationOutput, StreamEvent, TokenSignal
from undercurrent.adapters.session import CaptureSession, RequestState

__all__ = [
    "AbortInfo",
    "Backend",
    "BackendError",
    "Capabilities",
    "CapabilityError",
    "CaptureSession",
    "GenerationOutput",
    "RequestState",
    "SamplingParams",
    "StreamEvent",
    "TokenSignal",
    "UnsupportedArchitectureError",
    "backend_class",
    "check_points",
    "known_backends",
]
