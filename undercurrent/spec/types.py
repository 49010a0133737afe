"""Resolved spec types: what the loaders return and what adapters and the router read.

These are plain frozen dataclasses and enums; they never import torch.
"""

from __future__ import annotations

import copy
import enum
import numbers
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from undercurrent.spec.position import PositionSelector, parse_position


class TensorType(str, enum.Enum):
    """Which tensor an extraction point captures."""

    RESIDUAL_STREAM = "residual_stream"
    ATTN_OUT = "attn_out"
    MLP_OUT = "mlp_out"
    KV = "kv"
    FINAL_NORM = "final_norm"


class ProbeKind(str, enum.Enum):
    """``single_shot`` probes judge each activation alone; ``trajectory`` probes
    carry state across a request's activations."""

    SINGLE_SHOT = "single_shot"
    TRAJECTORY = "trajectory"


class ExecutionMode(str, enum.Enum):
    """``inline`` runs the probe on the generation path; ``async`` off it."""

    INLINE = "inline"
    ASYNC = "async"


class InterventionMode(str, enum.Enum):
    """``reject``: never hold generation on a deadline. ``block_until_signal``:
    generation waits at most ``timeout_ms`` for the probe's signal."""

    REJECT = "reject"
    BLOCK_UNTIL_SIGNAL = "block_until_signal"


class OnTimeout(str, enum.Enum):
    """What happens when a blocking probe misses its deadline (or raises)."""

    CONTINUE = "continue"
    ABORT = "abort"


class UntilKind(str, enum.Enum):
    """Validated and round-tripped; not enforced by the shipped adapters."""

    GENERATION_END = "generation_end"
    FIXED_COUNT = "fixed_count"
    STOP_TOKEN = "stop_token"


@dataclass(frozen=True)
class InterventionPolicy:
    """How generation waits on an inline probe."""

    mode: InterventionMode = InterventionMode.REJECT
    timeout_ms: int | None = None
    on_timeout: OnTimeout = OnTimeout.CONTINUE

    def __post_init__(self) -> None:
        # Hand-built policies often pass plain strings; normalise at the source.
        object.__setattr__(self, "mode", InterventionMode(self.mode))
        object.__setattr__(self, "on_timeout", OnTimeout(self.on_timeout))
        object.__setattr__(self, "timeout_ms", _plain_int(self.timeout_ms))


def _plain_int(value: Any) -> Any:
    """A numpy (or other) integer as a plain ``int``; anything else unchanged, for the
    spec check to name (a bool stays a bool: it is not a layer index)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _frozen_mapping(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return types.MappingProxyType(copy.deepcopy(dict(data or {})))


@dataclass(frozen=True, kw_only=True)
class ExtractionPoint:
    """What to capture, where, and which probe receives it.

    ``layers`` is always a tuple; ``position`` is a parsed selector; ``intervention``
    is None unless the spec set one (None means "the router's default", not "no
    policy"); ``probe_args`` is read-only.
    """

    name: str
    layers: tuple[int, ...]
    tensor_type: TensorType
    position: PositionSelector
    stride: int = 1
    until: UntilKind | None = None
    probe_type: str
    probe_kind: ProbeKind
    probe_args: Mapping[str, Any] = field(default_factory=dict)
    execution_mode: ExecutionMode = ExecutionMode.INLINE
    queue_depth: int | None = None
    intervention: InterventionPolicy | None = None

    def __post_init__(self) -> None:
        # Normalise what hand-built points commonly pass (a list, an int, a str
        # enum value) so every consumer can rely on the declared types.
        layers = self.layers
        if isinstance(layers, int):
            layers = (layers,)
        object.__setattr__(self, "layers", tuple(_plain_int(layer) for layer in layers))
        object.__setattr__(self, "stride", _plain_int(self.stride))
        object.__setattr__(self, "queue_depth", _plain_int(self.queue_depth))
        object.__setattr__(self, "tensor_type", TensorType(self.tensor_type))
        object.__setattr__(self, "probe_kind", ProbeKind(self.probe_kind))
        object.__setattr__(self, "execution_mode", ExecutionMode(self.execution_mode))
        if self.until is not None:
            object.__setattr__(self, "until", UntilKind(self.until))
        if not isinstance(self.position, PositionSelector):
            object.__setattr__(self, "position", parse_position(self.position))
        if not isinstance(self.probe_args, types.MappingProxyType):
            object.__setattr__(self, "probe_args", _frozen_mapping(self.probe_args))

    def __hash__(self) -> int:
        return hash((self.name, self.layers, self.tensor_type, self.position, self.probe_type))

    def matches(
        self,
        token_index: int,
        is_generated: bool,
        prompt_len: int,
        generated_index: int | None = None,
    ) -> bool:
        """Whether this point fires for a token: the position selector and stride.

        >>> from undercurrent.spec import parse_position
        >>> p = ExtractionPoint(name="t", layers=(0,), tensor_type="mlp_out",
        ...     position=parse_position("generated[*]"), stride=2,
        ...     probe_type="norm_probe", probe_kind="trajectory")
        >>> p.matches(token_index=12, is_generated=True, prompt_len=10, generated_index=2)
        True
        """
        return self.position.matches(
            token_index, is_generated, prompt_len, generated_index, stride=self.stride
        )


class EditOp(str, enum.Enum):
    """What an edit does to an activation ``h`` (``c`` is the coefficient, ``v`` the
    vector, ``u`` its unit direction): ``add`` ``h += c*v``; ``project_out``
    ``h -= c*(h.u)u``; ``clamp`` sets the component along ``u`` to ``c``;
    ``scale`` multiplies the component along ``u`` by ``c``."""

    ADD = "add"
    PROJECT_OUT = "project_out"
    CLAMP = "clamp"
    SCALE = "scale"


EDIT_TENSOR_TYPES = (TensorType.RESIDUAL_STREAM, TensorType.ATTN_OUT, TensorType.MLP_OUT)
"""The tensor types an edit may change."""


class TriggerAction(str, enum.Enum):
    """The signal action that switches a triggered edit on."""

    FLAG = "flag"
    ABORT = "abort"


@dataclass(frozen=True)
class EditTrigger:
    """``when:`` of an edit: off for a request until extraction point ``point``
    emits a signal with ``action`` for that request."""

    point: str
    action: TriggerAction = TriggerAction.FLAG

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", TriggerAction(self.action))


@dataclass(frozen=True)
class SaeFeature:
    """An edit vector naming one feature of a sparse autoencoder (SAELens folder
    format): ``vector: {sae: PATH, feature: I}`` in a spec.

    As a direction it is the feature's decoder row; ``clamp`` on it sets the
    feature's activation through the SAE's encoder (see ``docs/sae.md``).

    >>> SaeFeature("undercurrent:models/tiny/sae", 2)
    SaeFeature(sae='undercurrent:models/tiny/sae', feature=2)
    """

    sae: str
    feature: int


@dataclass(frozen=True, kw_only=True)
class Edit:
    """A live activation edit (spec version "2"): where, what and with which vector.

    ``vector`` is a tuple of floats, a file path (``.safetensors`` / ``.npz``;
    ``undercurrent:`` package paths work) or an :class:`SaeFeature`; it is resolved
    to a direction when the edit is registered on a model. ``when`` is None for an
    edit that is always on.

    >>> edit = Edit(name="steer", layers=2, tensor_type="residual_stream",
    ...     position="generated[*]", op="add", vector=[1.0, 0.0], coefficient=-4.0)
    >>> edit.layers, edit.op.value, edit.vector
    ((2,), 'add', (1.0, 0.0))
    """

    name: str
    layers: tuple[int, ...]
    tensor_type: TensorType
    position: PositionSelector
    stride: int = 1
    op: EditOp
    vector: tuple[float, ...] | str | SaeFeature
    vector_key: str | None = None
    coefficient: float = 1.0
    norm_match: bool = False
    when: EditTrigger | None = None

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, int):
            layers = (layers,)
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "tensor_type", TensorType(self.tensor_type))
        object.__setattr__(self, "op", EditOp(self.op))
        if not isinstance(self.position, PositionSelector):
            object.__setattr__(self, "position", parse_position(self.position))
        vector: Any = self.vector  # a mapping from YAML is allowed in, beyond the annotation
        if isinstance(vector, Mapping):
            object.__setattr__(self, "vector", SaeFeature(**vector))
        elif not isinstance(self.vector, str | SaeFeature):
            object.__setattr__(self, "vector", tuple(float(x) for x in self.vector))
        if isinstance(self.when, Mapping):
            object.__setattr__(self, "when", EditTrigger(**self.when))
        object.__setattr__(self, "coefficient", float(self.coefficient))

    @property
    def triggered(self) -> bool:
        """True when the edit waits for a probe's signal (``when`` is set)."""
        return self.when is not None

    def matches(
        self,
        token_index: int,
        is_generated: bool,
        prompt_len: int,
        generated_index: int | None = None,
    ) -> bool:
        """Whether this edit applies to a token: the position selector and stride."""
        return self.position.matches(
            token_index, is_generated, prompt_len, generated_index, stride=self.stride
        )


@dataclass(frozen=True)
class ProbeSpec:
    """A named list of extraction points: iterable, ``len()``, ``.get(name)``, ``.names``.

    ``edits`` (spec version "2") are the live activation edits; iterating a spec
    yields its extraction points only. A hand-built spec with edits is version "2".
    """

    extraction_points: tuple[ExtractionPoint, ...] = ()
    version: str = "1"
    edits: tuple[Edit, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extraction_points", tuple(self.extraction_points))
        object.__setattr__(self, "edits", tuple(self.edits))
        if self.edits and self.version == "1":
            object.__setattr__(self, "version", "2")

    def __iter__(self) -> Iterator[ExtractionPoint]:
        return iter(self.extraction_points)

    def __len__(self) -> int:
        return len(self.extraction_points)

    def __getitem__(self, index: int) -> ExtractionPoint:
        return self.extraction_points[index]

    @property
    def names(self) -> tuple[str, ...]:
        """The extraction point names, in spec order."""
        return tuple(point.name for point in self.extraction_points)

    def get(self, name: str, default: ExtractionPoint | None = None) -> ExtractionPoint | None:
        """The point called ``name``, or ``default`` when there is none."""
        for point in self.extraction_points:
            if point.name == name:
                return point
        return default

    def get_edit(self, name: str, default: Edit | None = None) -> Edit | None:
        """The edit called ``name``, or ``default`` when there is none."""
        for edit in self.edits:
            if edit.name == name:
                return edit
        return default
