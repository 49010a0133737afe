"""Resolved spec types: what the loaders return and what adapters and the router read.

The fields of a point, an edit and their nested objects are declared here once,
each with its documentation (:func:`~undercurrent.spec.declarations.spec_field`); the
schema, the spec form and the vLLM wire format are derived from them.

These are plain frozen dataclasses and enums; they never import torch.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from undercurrent.spec.declarations import spec_field
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

    mode: InterventionMode = spec_field(
        """``reject`` (default): generation never waits on a deadline; an inline probe
        runs to completion and an ``abort`` it returns stops the request.
        ``block_until_signal``: generation waits for the probe's signal at most
        ``timeout_ms``. Async points allow only ``reject``.""",
        always=True, default=InterventionMode.REJECT)
    timeout_ms: int | None = spec_field(
        """Milliseconds generation waits for the probe's signal (an integer >= 1).
        Required under ``block_until_signal``, not allowed under ``reject``.""",
        schema="positive_int", default=None)
    on_timeout: OnTimeout = spec_field(
        """What happens when the probe misses the deadline or raises: ``continue``
        (default) or ``abort``. Only ``block_until_signal`` may set ``abort``.""",
        default=OnTimeout.CONTINUE)

    def __post_init__(self) -> None:
        # Hand-built policies often pass plain strings; normalise at the source.
        object.__setattr__(self, "mode", _member(InterventionMode, self.mode, "mode"))
        object.__setattr__(self, "on_timeout",
                           _member(OnTimeout, self.on_timeout, "on_timeout"))
        object.__setattr__(self, "timeout_ms", _plain_int(self.timeout_ms))


_Member = TypeVar("_Member", bound=enum.Enum)


def _member(kind: type[_Member], value: Any, field: str) -> _Member:
    """``value`` as a member of ``kind``; else a ``ValueError`` naming the policy's
    ``field`` and the values it takes (the enum's own message names neither)."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in kind)
        raise ValueError(
            f"intervention {field} must be one of {allowed}, got {value!r}") from None


def _plain_int(value: Any) -> Any:
    """A numpy (or other) integer as a plain ``int``; anything else unchanged, for the
    spec check to name (a bool stays a bool: it is not a layer index)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _number(value: Any) -> float:
    """A number (numpy or torch scalars too) as a float; a string or a boolean, which
    ``float()`` would take and the spec refuses, is a ``TypeError``."""
    if isinstance(value, str | bytes | bool) or type(value).__name__ == "bool_":
        raise TypeError(f"expected a number, got {type(value).__name__} ({value!r:.40})")
    return float(value)


def _layer_tuple(layers: Any) -> tuple[Any, ...]:
    """``layers`` as a tuple of plain ints: one layer (a numpy integer too, as
    ``np.argmax`` gives) or an iterable of them; anything else for the spec check
    to name."""
    if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
        return (int(layers),)
    return tuple(_plain_int(layer) for layer in layers)


def _refuse_as_the_spec_does(obj: ExtractionPoint | Edit, error: Exception) -> NoReturn:
    """Raise the spec's own problems for a hand-built point or edit whose values
    cannot be normalised (``tensor_type="resid"``, ``op="addd"``, a vector of
    lists): what the same point or edit in spec form is refused with, located by
    its name; ``error`` itself where the spec's check finds nothing."""
    # (the loader builds these types: imported here, when one is refused)
    from undercurrent.spec.declarations import given_spec_data
    from undercurrent.spec.errors import SpecProblem, SpecValidationError
    from undercurrent.spec.loader import edit_problems, point_problems

    is_edit = isinstance(obj, Edit)
    raw = given_spec_data(obj)
    problems = (edit_problems if is_edit else point_problems)(raw)
    if not problems:
        raise error
    name = raw.get("name") if isinstance(raw.get("name"), str) else None
    raise SpecValidationError([
        SpecProblem(problem.message, problem.field, None, name,
                    "edits" if is_edit else "extraction_points")
        for problem in problems]) from None


def _frozen_mapping(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return types.MappingProxyType(copy.deepcopy(dict(data or {})))


def _fields_but_probe_args(point: ExtractionPoint) -> tuple[Any, ...]:
    return tuple(getattr(point, name) for name in _POINT_FIELDS if name != "probe_args")


def _same_value(a: Any, b: Any) -> bool:
    """Whether two ``probe_args`` values are equal as ``==`` would say, looking into
    mappings, lists and tuples, where an array (numpy, torch: anything with a
    ``shape`` and ``tolist()``) equals an array of the same shape and values. Values
    whose ``==`` has no truth value (an array and a list) are not equal."""
    if a is b:
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return len(a) == len(b) and all(
            key in b and _same_value(value, b[key]) for key, value in a.items())
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return (isinstance(a, tuple) == isinstance(b, tuple) and len(a) == len(b)
                and all(map(_same_value, a, b)))
    if _is_array(a) and _is_array(b):
        return tuple(a.shape) == tuple(b.shape) and a.tolist() == b.tolist()
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an == without a truth value: not known equal
        return False


def _is_array(value: Any) -> bool:
    return (not isinstance(value, numbers.Number | str | bytes)
            and hasattr(value, "shape") and callable(getattr(value, "tolist", None)))


@dataclass(frozen=True, kw_only=True)
class ExtractionPoint:
    """What to capture, where, and which probe receives it.

    ``layers`` is always a tuple; ``position`` is a parsed selector; ``intervention``
    is None unless the spec set one (None means "the router's default", not "no
    policy"); ``probe_args`` is read-only.
    """

    name: str = spec_field(
        "Unique within the spec; every ActivationRecord and ProbeResult carries it.",
        schema="non_empty_text", wire=True)
    layers: tuple[int, ...] = spec_field(
        """Layer index (an integer >= 0) or a non-empty list of distinct indices. One
        ActivationRecord is produced per matched layer.""",
        schema="layer_indices", wire=True, compact=True)
    tensor_type: TensorType = spec_field(
        """Which tensor to capture: ``residual_stream`` (a decoder layer's output),
        ``attn_out``, ``mlp_out``, ``kv`` (the key/value written to the cache) or
        ``final_norm`` (the model's final norm, addressed as layer N = number of
        decoder layers).""",
        wire=True)
    position: PositionSelector = spec_field(
        """Which tokens to capture: an absolute index ``N``, ``prompt[i]`` (negative i
        counts from the end of the prompt), ``generated[i]``, either with an offset
        (``prompt[-1]+1``), ``generated[*]``, ``generated[a:]`` or ``generated[a:b]``.""",
        schema="position", wire=True)
    stride: int = spec_field(
        """Keep every Nth match of a continuous position, counted from the start of the
        selector. Only valid for ``generated[*]`` and slices.""",
        schema="positive_int", wire=True, default=1)
    until: UntilKind | None = spec_field(
        """``generation_end``, ``fixed_count`` or ``stop_token``. Only valid for
        continuous positions. Validated and kept, but not enforced by the shipped
        adapters: use a bounded slice for a fixed window.""",
        default=None)
    probe_type: str = spec_field(
        "The name the probe is registered under (for example ``linear_probe``).",
        schema="non_empty_text", wire=True)
    probe_kind: ProbeKind = spec_field(
        """``single_shot`` (judges each activation alone) or ``trajectory`` (carries
        state across a request's activations).""",
        wire=True)
    probe_args: Mapping[str, Any] = spec_field(
        """Extra constructor arguments for this point's probe; they override the
        router-level defaults for the same probe_type.""",
        schema="probe_arguments", default_factory=dict)
    execution_mode: ExecutionMode = spec_field(
        """``inline`` (default): the probe runs on the generation path and may stop it.
        ``async``: off the hot path on a bounded queue; needs probe_kind
        ``trajectory``.""",
        default=ExecutionMode.INLINE)
    queue_depth: int | None = spec_field(
        """Size of this point's async queue in records, one per (token, layer) (an
        integer >= 1; the queue always holds at least one token's records, i.e. the
        number of layers). Only valid with ``execution_mode: async``; the router's
        default (32) applies when omitted.""",
        schema="positive_int", default=None)
    intervention: InterventionPolicy | None = spec_field(
        """``mode``, ``timeout_ms``, ``on_timeout``. When omitted, the router's
        ``default_intervention_policy`` applies (omitted is not the same as
        ``reject``).""",
        default=None)

    def __post_init__(self) -> None:
        # Normalise what hand-built points commonly pass (a list, an int, a str
        # enum value) so every consumer can rely on the declared types; what
        # cannot be is refused with the spec's own messages.
        try:
            self._normalise()
        except (ValueError, TypeError) as error:
            _refuse_as_the_spec_does(self, error)

    def _normalise(self) -> None:
        object.__setattr__(self, "layers", _layer_tuple(self.layers))
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
        if isinstance(self.intervention, Mapping):  # as YAML gives it
            object.__setattr__(self, "intervention", InterventionPolicy(**self.intervention))

    def __eq__(self, other: object) -> bool:
        # (written out: probe_args may hold an array, a linear probe's fitted weight,
        # whose == answers per element and whose truth value dict == then asked for)
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (_fields_but_probe_args(self) == _fields_but_probe_args(other)
                and _same_value(self.probe_args, other.probe_args))

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


_POINT_FIELDS = tuple(field.name for field in dataclasses.fields(ExtractionPoint))


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

    point: str = spec_field(
        """The extraction point whose signal switches the edit on. It must be an
        inline point of the same spec (async points only observe).""",
        schema="non_empty_text")
    action: TriggerAction = spec_field(
        """The signal action that switches the edit on: ``flag`` (default) or
        ``abort``.""",
        always=True, default=TriggerAction.FLAG)

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

    name: str = spec_field(
        """Unique across the spec's extraction points and edits; outputs and records
        name the edit with it.""",
        schema="non_empty_text")
    layers: tuple[int, ...] = spec_field(
        "Layer index (an integer >= 0) or a non-empty list of distinct indices.",
        schema="layer_indices", compact=True)
    tensor_type: TensorType = spec_field(
        """Which tensor to change: ``residual_stream`` (a decoder layer's output, so
        layer L+1 receives the edited value), ``attn_out`` or ``mlp_out``.""",
        schema="edit_tensor_type")
    position: PositionSelector = spec_field(
        """Which tokens to change, in the extraction-point grammar. ``generated[*]``
        means the generated tokens as they are fed back to the model; prompt positions
        are changed during prefill.""",
        schema="position")
    stride: int = spec_field(
        """Change every Nth match of a continuous position (``generated[*]`` and
        slices only).""",
        schema="positive_int", default=1)
    op: EditOp = spec_field(
        """``add`` (h += c*v), ``project_out`` (h -= c*(h.u)u), ``clamp`` (the
        component along u becomes c; on an SAE feature, the feature's activation
        becomes c through the SAE's encoder) or ``scale`` (the component along u is
        multiplied by c); u is the unit vector of ``vector``.""")
    vector: tuple[float, ...] | str | SaeFeature = spec_field(
        """A list of numbers (one per hidden unit), or a path to a ``.safetensors`` /
        ``.npz`` file holding one 1-D array (``undercurrent:`` names a file inside the
        package), or ``{sae: FOLDER, feature: INDEX}``: an SAE feature's decoder row
        (``clamp`` on it sets the feature's activation through the SAE's encoder). A
        linear probe file stands for its weight direction.""",
        schema="edit_vector")
    vector_key: str | None = spec_field(
        "Which array of the ``vector`` file to use when it holds several.",
        schema="non_empty_text", default=None)
    coefficient: float = spec_field(
        "The ``c`` of the op (default 1.0).", schema="finite_number", default=1.0)
    norm_match: bool = spec_field(
        """``add`` only: scale the vector to the norm of the token's own activation
        before adding (default false).""",
        schema="strict_bool", default=False)
    when: EditTrigger | None = spec_field(
        """Off for a request until ``point`` emits a signal with ``action`` for that
        request; from the next forward pass on it stays on for that request only.""",
        default=None)

    def __post_init__(self) -> None:
        try:
            self._normalise()
        except (ValueError, TypeError) as error:
            _refuse_as_the_spec_does(self, error)

    def _normalise(self) -> None:
        object.__setattr__(self, "layers", _layer_tuple(self.layers))
        object.__setattr__(self, "tensor_type", TensorType(self.tensor_type))
        object.__setattr__(self, "op", EditOp(self.op))
        if not isinstance(self.position, PositionSelector):
            object.__setattr__(self, "position", parse_position(self.position))
        vector: Any = self.vector  # a mapping from YAML is allowed in, beyond the annotation
        if isinstance(vector, Mapping):
            object.__setattr__(self, "vector", SaeFeature(**vector))
        elif not isinstance(self.vector, str | SaeFeature):
            object.__setattr__(self, "vector", tuple(map(_number, self.vector)))
        if isinstance(self.when, Mapping):
            object.__setattr__(self, "when", EditTrigger(**self.when))
        elif self.when is not None and not isinstance(self.when, EditTrigger):
            # (a bare point name would reach the trigger rules and fail there)
            raise TypeError(f"when must be an EditTrigger or a mapping, got "
                            f"{type(self.when).__name__}")
        object.__setattr__(self, "coefficient", _number(self.coefficient))

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


def _members(field: str, values: Any, kind: type) -> tuple[Any, ...]:
    """``values`` (a list of ``kind``) as a tuple; a single one, or anything else, is
    refused naming ``field`` (iterating a point would fail deep inside Python)."""
    if isinstance(values, kind):
        raise TypeError(f"ProbeSpec {field} must be a list of {kind.__name__}, got a single "
                        f"{kind.__name__}; wrap it in a list")
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"ProbeSpec {field} must be a list of {kind.__name__}, got "
                        f"{type(values).__name__} ({values!r:.40})")
    members = tuple(values)
    for index, member in enumerate(members):
        if not isinstance(member, kind):
            raise TypeError(f"ProbeSpec {field}[{index}] must be an {kind.__name__}, got "
                            f"{type(member).__name__} ({member!r:.40})")
    return members


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
        object.__setattr__(self, "extraction_points",
                           _members("extraction_points", self.extraction_points, ExtractionPoint))
        object.__setattr__(self, "edits", _members("edits", self.edits, Edit))
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
