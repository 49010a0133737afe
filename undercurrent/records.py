"""What flows through undercurrent: activation records in, probe signals and results out.

No torch import here: ``tensor`` is whatever array the adapter captured (a detached
CPU ``torch.Tensor`` from the shipped adapters, or a numpy array in tests).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _now() -> float:
    return time.time()


@dataclass(frozen=True, eq=False, init=False)
class ActivationRecord:
    """One captured activation: one (request, extraction point, layer, token).

    ``token_index`` is absolute within the request's own prompt + generated
    sequence (padding never counts); ``generated_index`` counts generated tokens
    from 0 and is None for prompt tokens. ``tensor`` is detached, on the CPU, in the
    model's dtype; its shape is ``(hidden,)`` for most tensor types and
    ``(2, num_kv_heads, head_dim)`` for ``kv``. ``edits`` names the live edits
    applied at this very site (layer, tensor type, token) before it was captured,
    so the tensor is the edited value; it is empty for an unedited activation
    (edits at earlier layers change it too, but are not listed here).
    """

    request_id: str
    extraction_point_name: str
    layer: int
    tensor_type: str
    token_index: int
    is_generated: bool
    generated_index: int | None
    token_id: int | None
    tensor: Any
    timestamp: float = field(default_factory=_now)
    edits: tuple[str, ...] = ()

    def __init__(
        self,
        request_id: str,
        extraction_point_name: str,
        layer: int,
        tensor_type: str,
        token_index: int,
        is_generated: bool,
        generated_index: int | None,
        token_id: int | None,
        tensor: Any,
        timestamp: float | None = None,
        edits: tuple[str, ...] = (),
    ) -> None:
        # One record per captured activation, built on the generation thread: one
        # dict update instead of a frozen dataclass's setattr call per field.
        self.__dict__.update(
            request_id=request_id,
            extraction_point_name=extraction_point_name,
            layer=layer,
            tensor_type=tensor_type,
            token_index=token_index,
            is_generated=is_generated,
            generated_index=generated_index,
            token_id=token_id,
            tensor=tensor,
            timestamp=_now() if timestamp is None else timestamp,
            edits=edits,
        )

    @property
    def edited(self) -> bool:
        """True when an edit changed this activation at its own site."""
        return bool(self.edits)

    def key(self) -> tuple[str, str, int, int]:
        """(request, point, layer, token): unique per record within a generation."""
        return (self.request_id, self.extraction_point_name, self.layer, self.token_index)


class SignalAction(str, enum.Enum):
    """What a probe asks of generation."""

    CONTINUE = "continue"
    FLAG = "flag"
    ABORT = "abort"


@dataclass(frozen=True, init=False)
class ProbeSignal:
    """A probe's judgement on one activation.

    ``action`` accepts the enum or its string value; ``score`` is stored as a
    float; ``metadata`` defaults to an empty dict and ``timestamp`` to now.
    """

    action: SignalAction = SignalAction.CONTINUE
    score: float | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    timestamp: float = field(default_factory=_now)

    def __init__(
        self,
        action: SignalAction | str = SignalAction.CONTINUE,
        score: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        timestamp: float | None = None,
    ) -> None:
        # Built per activation on the generation path, like ActivationRecord.
        self.__dict__.update(
            action=action if type(action) is SignalAction else SignalAction(action),
            score=None if score is None else float(score),
            metadata={} if metadata is None else metadata,
            timestamp=_now() if timestamp is None else timestamp,
        )


@dataclass(frozen=True)
class ProbeStats:
    """Accounting for one binding (one probe instance on one request and point).

    Always ``received == processed + dropped``.
    """

    received: int = 0
    processed: int = 0
    dropped: int = 0
    errors: int = 0
    timeouts: int = 0
    mean_latency_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "received": self.received,
            "processed": self.processed,
            "dropped": self.dropped,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "mean_latency_s": self.mean_latency_s,
        }


@dataclass(frozen=True)
class ProbeResult:
    """What one probe concluded about one request at one extraction point.

    ``verdict`` is whatever the probe's ``on_end`` returned; ``signals`` are the
    signals it emitted, in order; ``error`` describes the first failure, if any.
    """

    request_id: str
    extraction_point_name: str
    verdict: Any
    signals: tuple[ProbeSignal, ...]
    stats: ProbeStats
    error: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", tuple(self.signals))

    @property
    def flagged(self) -> bool:
        """True when any signal was a flag or an abort."""
        return any(s.action is not SignalAction.CONTINUE for s in self.signals)

    @property
    def scores(self) -> list[float | None]:
        return [s.score for s in self.signals]
