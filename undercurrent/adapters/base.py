"""The backend protocol every engine adapter implements, and backend lookup.

:class:`~undercurrent.api.ProbedModel` is backend-agnostic: it builds a router and
a :class:`~undercurrent.adapters.session.CaptureSession` per call and hands them
to a :class:`Backend`. A backend tokenizes, runs the engine with its hooks, feeds
the session (``open_request`` / ``StepPlan`` / ``deliver`` / ``add_token`` /
``close_request``) and returns one
:class:`~undercurrent.adapters.outputs.GenerationOutput` per prompt.

Contract (what the tests of every backend check):

- ``capabilities()`` says which tensor types are captured at which layers;
  ``check_points`` rejects anything else before generation starts.
- One record per matching (token, layer); ``token_index`` is absolute in that
  request's own prompt + generated sequence (padding never counts).
- Every prompt is its own request; an ``abort`` from an inline probe stops that
  request before its next token, the others continue.
- ``close()`` (and an exception or KeyboardInterrupt mid-generation) leaves no
  hook behind.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from undercurrent.adapters.capabilities import Capabilities
from undercurrent.adapters.outputs import GenerationOutput, StreamEvent
from undercurrent.adapters.prompts import PromptInput
from undercurrent.adapters.session import CaptureSession
from undercurrent.arguments import check_flag, check_number


class BackendError(RuntimeError):
    """A backend cannot be loaded or used (missing extra, unknown name, closed)."""


MIN_TEMPERATURE = 0.01
"""The smallest sampling temperature (above 0, greedy) that ``SamplingParams`` takes."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample, shared by every backend.

    ``temperature == 0`` is greedy decoding, a sampling one is at least
    :data:`MIN_TEMPERATURE`; ``seed`` makes sampling reproducible;
    ``stop`` strings end a request (its text ends before the stop string);
    ``capture_last_token`` runs one extra forward step so the last sampled token,
    which generation never feeds back to the model, gets activations too.
    ``prompt_only`` marks a call that only wants the prompt's forward pass
    (``ProbedModel.prompt_activations``: one token, sampled and dropped), so a
    refusal speaks of the prompt and not of ``max_new_tokens``.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    capture_last_token: bool = False
    prompt_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", stop_strings(self.stop))
        # (stored as plain Python numbers: transformers refuses a numpy float32
        # temperature or a numpy int64 top_k)
        for name, integer, optional in (("max_new_tokens", True, False),
                                        ("temperature", False, False), ("top_p", False, False),
                                        ("top_k", True, True), ("seed", True, True)):
            value = getattr(self, name)
            if not (optional and value is None):
                object.__setattr__(self, name, check_number(name, value, integer=integer))
        if self.seed is not None and not 0 <= int(self.seed) < 2**63:
            raise ValueError(f"seed must be in [0, 2**63) (torch.manual_seed's range), got "
                             f"{self.seed}")
        for flag in ("capture_last_token", "prompt_only"):
            object.__setattr__(self, flag, check_flag(flag, getattr(self, flag)))
        if self.prompt_only and (self.max_new_tokens != 1 or self.capture_last_token):
            raise ValueError("prompt_only runs the prompt's forward pass alone: it takes "
                             "max_new_tokens=1 and no capture_last_token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # (the logits divided by it overflow to inf and sampling to NaN; vLLM
            # quietly raises it to 0.01, so both backends refuse it alike)
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got "
                             f"{self.temperature}: a smaller one can overflow the logits")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` as a tuple of strings: None, a string, or a list/tuple of strings.

    Anything else is a ``TypeError`` naming the ``stop`` parameter and the accepted
    types (bytes and numbers are not iterated into characters or codes).
    """
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    accepted = "stop must be a string or a list of strings"
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"{accepted}, got {type(stop).__name__} ({stop!r:.40})")
    for index, item in enumerate(stop):
        if not isinstance(item, str):
            raise TypeError(f"{accepted}; stop[{index}] is {type(item).__name__} ({item!r:.40})")
    empty = [index for index, item in enumerate(stop) if not item]
    if empty:  # (it would match everywhere, so the matcher skips it: never silently)
        raise ValueError(f"stop strings must not be empty; stop[{empty[0]}] is ''")
    return tuple(stop)


def call_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th prompt (or batch starting there) of a call
    seeded with ``seed``: ``seed + index``, within torch's and vLLM's range."""
    return (int(seed) + index) % 2**63  # (plain ints: a numpy seed would overflow)


def check_batch_size(batch_size: Any, *, optional: bool = True) -> int | None:
    """``batch_size`` as a plain int >= 1 (None where ``optional``: the default).

    A ``TypeError`` for a bool, a float or a string, a ``ValueError`` for a value
    below 1, each naming ``batch_size`` and what it takes (prompts per
    ``generate()`` call): a bad one would lose prompts or loop forever."""
    accepted = "batch_size must be an integer >= 1 (prompts per generate() call)" + (
        " or None (the default)" if optional else "")
    if batch_size is None and optional:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise TypeError(f"{accepted}, got {type(batch_size).__name__} ({batch_size!r:.40})")
    if batch_size < 1:
        raise ValueError(f"{accepted}, got {batch_size}")
    return int(batch_size)


@runtime_checkable
class Backend(Protocol):
    """What :class:`~undercurrent.api.ProbedModel` needs from an engine adapter.

    Constructors are backend-specific (``from_pretrained(path, device=..., **kw)``
    classmethods); everything after construction goes through these methods.
    """

    name: str

    @property
    def model_name(self) -> str:
        """A name for the loaded model (path or hub id), passed to probes."""
        ...

    @property
    def dtype(self) -> str:
        """The dtype the model computes in (``"float32"``, ``"bfloat16"``, ...)."""
        ...

    def capabilities(self) -> Capabilities:
        """Tensor types and valid layer indices on the loaded model."""
        ...

    def generate(
        self,
        prompts: Sequence[PromptInput],
        request_ids: Sequence[str],
        params: SamplingParams,
        session: CaptureSession,
        *,
        batch_size: int | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (batched), one output per prompt, in order. A
        prompt is its text, or a tuple of token ids fed as they are
        (:func:`~undercurrent.adapters.prompts.tokenize_prompts`)."""
        ...

    def stream(
        self,
        prompt: PromptInput,
        request_id: str,
        params: SamplingParams,
        session: CaptureSession,
    ) -> Iterator[StreamEvent]:
        """Generate for one prompt, yielding a :class:`StreamEvent` per token and a
        final one with the complete output. Closing the iterator early stops
        generation and cleans up."""
        ...

    def close(self) -> None:
        """Release the engine's hooks (and the engine, where the backend owns it)."""
        ...


_BACKENDS: dict[str, tuple[str, str, str]] = {
    # name: (module, class, extra that provides the engine)
    "hf": ("undercurrent.adapters.hf.backend", "HFBackend", "hf"),
    "vllm": ("undercurrent.adapters.vllm.backend", "VLLMBackend", "vllm"),
}

_ENGINE_MODULES = {"hf": ("torch", "transformers"), "vllm": ("torch", "vllm")}


def known_backends() -> tuple[str, ...]:
    """Names accepted by ``ProbedModel.from_pretrained(..., backend=...)``."""
    return tuple(_BACKENDS)


def backend_class(name: str) -> Any:
    """The backend class registered under ``name``, imported on demand.

    Raises :class:`BackendError` naming the known backends for an unknown name,
    and the extra to install when the engine is missing.
    """
    try:
        module_name, class_name, extra = _BACKENDS[name]
    except KeyError:
        raise BackendError(
            f"unknown backend {name!r}; known backends: {', '.join(_BACKENDS)}"
        ) from None
    for engine in _ENGINE_MODULES.get(name, ()):
        if importlib.util.find_spec(engine) is None:
            raise BackendError(
                f"the {name!r} backend needs {engine!r}, which is not installed; "
                f"install it with: pip install 'undercurrent[{extra}]'"
            )
    module = importlib.import_module(module_name)
    return getattr(module, class_name)
