"""The pydantic schema of a spec file: every key, its type, its documentation.

Each field here validates one raw value and resolves it into the type the frozen
dataclasses in :mod:`undercurrent.spec.types` hold (``layers`` -> tuple,
``position`` -> :class:`PositionSelector`, enum names -> enums). Rules that tie
several fields together live in :mod:`undercurrent.spec.rules`; the loader in
:mod:`undercurrent.spec.loader` drives both and collects every problem.

The field docstrings are the documentation: they end up in :func:`json_schema`,
which editors use for completion and hover help.
"""

from __future__ import annotations

import copy
import enum
import math
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationInfo,
    WithJsonSchema,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from undercurrent.spec.messages import describe_value, did_you_mean
from undercurrent.spec.position import PositionError, parse_position
from undercurrent.spec.types import (
    EDIT_TENSOR_TYPES,
    EditOp,
    ExecutionMode,
    InterventionMode,
    OnTimeout,
    ProbeKind,
    SaeFeature,
    TensorType,
    TriggerAction,
    UntilKind,
)

SPEC_VERSIONS = ("1", "2")
"""Spec format versions this release reads: "2" is "1" plus ``edits``."""

EDIT_VERSIONS = ("2",)
"""Spec versions that accept the top-level ``edits`` list."""

VECTOR_FILE_SUFFIXES = (".safetensors", ".npz")
"""File types an edit's ``vector`` may name (never pickle)."""

POSITION_PATTERN = (
    r"^\s*(\d+|prompt\[-?\d+\]([+-]\d+)?|generated\[\d+\]([+-]\d+)?"
    r"|generated\[\*\]|generated\[\d+:\d*\])\s*$"
)


def _fail(message: str) -> PydanticCustomError:
    return PydanticCustomError("spec_rule", message)


def _layer_indices(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
    """``layers``: one int >= 0 or a non-empty list of distinct ints >= 0 -> tuple."""
    del handler, info
    items = list(value) if isinstance(value, list | tuple) else [value]
    if isinstance(value, list | tuple) and not items:
        raise _fail("is an empty list; give at least one layer index (an integer >= 0)")
    is_list = isinstance(value, list | tuple)
    if not is_list and (isinstance(value, bool) or not isinstance(value, int)):
        raise _fail(
            "must be a layer index (an integer >= 0) or a list of them, "
            f"got {describe_value(value)}"
        )
    faults: list[str] = []
    seen: set[int] = set()
    for position, item in enumerate(items):
        where = f"item {position} " if isinstance(value, list | tuple) else ""
        if isinstance(item, bool) or not isinstance(item, int):
            faults.append(f"{where}is {describe_value(item)}; layer indices are integers >= 0")
        elif item < 0:
            faults.append(f"{where}is {item}; layer indices start at 0 (no negative indices)")
        elif item in seen:
            faults.append(f"layer {item} is listed more than once")
        else:
            seen.add(item)
    if faults:
        raise _fail("; ".join(faults))
    return tuple(items)


def _position(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
    del handler, info
    try:
        return parse_position(value)
    except PositionError as error:
        raise _fail(str(error)) from None


def _non_empty_text(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
    text = handler(value)
    if not text.strip():
        raise _fail("must not be empty")
    return text


def _probe_arguments(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
    """``probe_args``: a mapping with string keys, copied and frozen."""
    del info
    arguments = handler(value)
    try:
        return types.MappingProxyType(copy.deepcopy(arguments))
    except RecursionError:
        raise _fail("is nested too deeply to copy") from None
    except Exception as error:  # an arbitrary object the caller put there
        raise _fail(f"cannot be copied: {type(error).__name__}: {error}") from None


def _edit_tensor_type(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
    """``tensor_type`` of an edit: one of the three editable tensors -> TensorType."""
    del handler, info
    allowed = ", ".join(t.value for t in EDIT_TENSOR_TYPES)
    try:
        tensor_type = TensorType(value)
    except ValueError:
        shown = repr(value) if isinstance(value, str) else describe_value(value)
        raise _fail(f"{shown} is not allowed; expected one of: {allowed}"
                    + did_you_mean(value, [t.value for t in EDIT_TENSOR_TYPES])) from None
    if tensor_type not in EDIT_TENSOR_TYPES:
        raise _fail(f"{tensor_type.value!r} cannot be edited; an edit changes one of: {allowed}")
    return tensor_type


def _sae_feature(value: dict[Any, Any]) -> SaeFeature:
    """``vector: {sae: PATH, feature: I}`` -> SaeFeature."""
    keys = set(value)
    if keys != {"sae", "feature"}:
        missing = sorted({"sae", "feature"} - keys)
        extra = sorted(str(key) for key in keys - {"sae", "feature"})
        said = "; ".join(part for part in (
            f"lacks {', '.join(missing)}" if missing else "",
            f"has unknown key(s) {', '.join(extra)}" if extra else "") if part)
        raise _fail("a mapping here names an SAE feature as {sae: FOLDER, feature: INDEX}; "
                    f"this one {said}")
    path, feature = value["sae"], value["feature"]
    if not isinstance(path, str) or not path.strip():
        raise _fail(f"sae must be the path of an SAELens SAE folder, got {describe_value(path)}")
    if isinstance(feature, bool) or not isinstance(feature, int) or feature < 0:
        raise _fail(f"feature must be a feature index (an int >= 0), got "
                    f"{describe_value(feature)}")
    return SaeFeature(path.strip(), feature)


def _edit_vector(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
    """``vector``: a non-empty list of finite numbers -> tuple of floats, a file path,
    or ``{sae: FOLDER, feature: INDEX}`` -> SaeFeature."""
    del handler, info
    if isinstance(value, SaeFeature):
        return value
    if isinstance(value, dict):
        return _sae_feature(value)
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise _fail("must not be empty; give a list of numbers or a .safetensors/.npz path")
        if not text.endswith(VECTOR_FILE_SUFFIXES):
            raise _fail(f"file {text!r} must end in .safetensors or .npz (pickled files "
                        "are never loaded); or give the vector as a list of numbers")
        return text
    if not isinstance(value, list | tuple):
        raise _fail("must be a list of numbers, a path to a .safetensors/.npz file or "
                    f"{{sae: FOLDER, feature: INDEX}}, got {describe_value(value)}")
    if not value:
        raise _fail("is an empty list; give one number per hidden unit")
    faults = [f"item {index} is {describe_value(item)}" for index, item in enumerate(value)
              if isinstance(item, bool) or not isinstance(item, int | float)]
    if faults:
        raise _fail("; ".join(faults[:3]) + "; the vector must hold numbers only")
    numbers = tuple(float(item) for item in value)
    if not all(math.isfinite(item) for item in numbers):
        raise _fail("holds NaN or infinity; every item must be a finite number")
    if not any(numbers):
        raise _fail("is all zeros; an edit needs a direction")
    return numbers


def _finite_number(value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
    del handler, info
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(f"must be a number, got {describe_value(value)}")
    if not math.isfinite(value):
        raise _fail(f"must be a finite number, got {value!r}")
    return float(value)


LayerIndices = Annotated[
    int | list[int],
    WrapValidator(_layer_indices),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0},
                    "minItems": 1,
                    "uniqueItems": True,
                },
            ]
        }
    ),
]
Position = Annotated[
    int | str,
    WrapValidator(_position),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": POSITION_PATTERN},
            ]
        }
    ),
]
NonEmptyText = Annotated[
    StrictStr,
    WrapValidator(_non_empty_text),
    WithJsonSchema({"type": "string", "minLength": 1, "pattern": r"\S"}),
]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
EditTensorType = Annotated[
    str,
    WrapValidator(_edit_tensor_type),
    WithJsonSchema({"enum": [t.value for t in EDIT_TENSOR_TYPES]}),
]
EditVector = Annotated[
    list[float] | str | dict[str, Any],
    WrapValidator(_edit_vector),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "array", "items": {"type": "number"}, "minItems": 1},
                {"type": "string", "pattern": r"\.(safetensors|npz)\s*$"},
                {
                    "type": "object",
                    "properties": {
                        "sae": {"type": "string", "minLength": 1},
                        "feature": {"type": "integer", "minimum": 0},
                    },
                    "required": ["sae", "feature"],
                    "additionalProperties": False,
                },
            ]
        }
    ),
]
FiniteNumber = Annotated[float, WrapValidator(_finite_number), WithJsonSchema({"type": "number"})]
ProbeArguments = Annotated[dict[StrictStr, Any], WrapValidator(_probe_arguments)]


class _SchemaModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class InterventionFields(_SchemaModel):
    """How generation waits on this point's probe. When the key is omitted, the
    router's ``default_intervention_policy`` applies."""

    mode: InterventionMode = InterventionMode.REJECT
    """``reject`` (default): generation never waits on a deadline; an inline probe
    runs to completion and an ``abort`` it returns stops the request.
    ``block_until_signal``: generation waits for the probe's signal at most
    ``timeout_ms``. Async points allow only ``reject``."""

    timeout_ms: PositiveInt | None = None
    """Milliseconds generation waits for the probe's signal (an integer >= 1).
    Required under ``block_until_signal``, not allowed under ``reject``."""

    on_timeout: OnTimeout = OnTimeout.CONTINUE
    """What happens when the probe misses the deadline or raises: ``continue``
    (default) or ``abort``. Only ``block_until_signal`` may set ``abort``."""


class ExtractionPointFields(_SchemaModel):
    """One extraction point: which tensor to capture, at which layers and token
    positions, and which probe receives it."""

    name: NonEmptyText
    """Unique within the spec; every ActivationRecord and ProbeResult carries it."""

    layers: LayerIndices
    """Layer index (an integer >= 0) or a non-empty list of distinct indices. One
    ActivationRecord is produced per matched layer."""

    # Older spellings and aliases default to None only so the model does not require
    # them; the loader never lets None through for these keys.
    layer: LayerIndices = Field(default=None, deprecated="use 'layers'")  # type: ignore[assignment]
    """Older spelling of ``layers``; accepted with a DeprecationWarning."""

    tensor_type: TensorType
    """Which tensor to capture: ``residual_stream`` (a decoder layer's output),
    ``attn_out``, ``mlp_out``, ``kv`` (the key/value written to the cache) or
    ``final_norm`` (the model's final norm, addressed as layer N = number of
    decoder layers)."""

    tensor: TensorType = Field(default=None, deprecated="use 'tensor_type'")  # type: ignore[assignment]
    """Older spelling of ``tensor_type``; accepted with a DeprecationWarning."""

    position: Position
    """Which tokens to capture: an absolute index ``N``, ``prompt[i]`` (negative i
    counts from the end of the prompt), ``generated[i]``, either with an offset
    (``prompt[-1]+1``), ``generated[*]``, ``generated[a:]`` or ``generated[a:b]``."""

    stride: PositiveInt = 1
    """Keep every Nth match of a continuous position, counted from the start of the
    selector. Only valid for ``generated[*]`` and slices."""

    every_n: PositiveInt = Field(default=None)  # type: ignore[assignment]
    """Alias of ``stride``; set one or the other, not both."""

    until: UntilKind | None = None
    """``generation_end``, ``fixed_count`` or ``stop_token``. Only valid for
    continuous positions. Validated and kept, but not enforced by the shipped
    adapters: use a bounded slice for a fixed window."""

    probe_type: NonEmptyText
    """The name the probe is registered under (for example ``linear_probe``)."""

    probe_kind: ProbeKind
    """``single_shot`` (judges each activation alone) or ``trajectory`` (carries
    state across a request's activations)."""

    probe_args: ProbeArguments = Field(default_factory=dict)
    """Extra constructor arguments for this point's probe; they override the
    router-level defaults for the same probe_type."""

    execution_mode: ExecutionMode = ExecutionMode.INLINE
    """``inline`` (default): the probe runs on the generation path and may stop it.
    ``async``: off the hot path on a bounded queue; needs probe_kind
    ``trajectory``."""

    queue_depth: PositiveInt | None = None
    """Size of this point's async queue in records, one per (token, layer) (an
    integer >= 1; the queue always holds at least one token's records, i.e. the
    number of layers). Only valid with ``execution_mode: async``; the router's
    default (32) applies when omitted."""

    intervention: InterventionFields | None = None
    """``mode``, ``timeout_ms``, ``on_timeout``. When omitted, the router's
    ``default_intervention_policy`` applies (omitted is not the same as
    ``reject``)."""


class WhenFields(_SchemaModel):
    """Switch an edit on for a request when one of its extraction points signals."""

    point: NonEmptyText
    """The extraction point whose signal switches the edit on. It must be an
    inline point of the same spec (async points only observe)."""

    action: TriggerAction = TriggerAction.FLAG
    """The signal action that switches the edit on: ``flag`` (default) or
    ``abort``."""


class EditFields(_SchemaModel):
    """One live activation edit (spec version "2"): which tensor to change, at which
    layers and token positions, how, and with which vector."""

    name: NonEmptyText
    """Unique across the spec's extraction points and edits; outputs and records
    name the edit with it."""

    layers: LayerIndices
    """Layer index (an integer >= 0) or a non-empty list of distinct indices."""

    tensor_type: EditTensorType
    """Which tensor to change: ``residual_stream`` (a decoder layer's output, so
    layer L+1 receives the edited value), ``attn_out`` or ``mlp_out``."""

    position: Position
    """Which tokens to change, in the extraction-point grammar. ``generated[*]``
    means the generated tokens as they are fed back to the model; prompt positions
    are changed during prefill."""

    stride: PositiveInt = 1
    """Change every Nth match of a continuous position (``generated[*]`` and
    slices only)."""

    op: EditOp
    """``add`` (h += c*v), ``project_out`` (h -= c*(h.u)u), ``clamp`` (the
    component along u becomes c; on an SAE feature, the feature's activation
    becomes c through the SAE's encoder) or ``scale`` (the component along u is
    multiplied by c); u is the unit vector of ``vector``."""

    vector: EditVector
    """A list of numbers (one per hidden unit), or a path to a ``.safetensors`` /
    ``.npz`` file holding one 1-D array (``undercurrent:`` names a file inside the
    package), or ``{sae: FOLDER, feature: INDEX}``: an SAE feature's decoder row
    (``clamp`` on it sets the feature's activation through the SAE's encoder). A
    linear probe file stands for its weight direction."""

    vector_key: NonEmptyText | None = None
    """Which array of the ``vector`` file to use when it holds several."""

    coefficient: FiniteNumber = 1.0
    """The ``c`` of the op (default 1.0)."""

    norm_match: StrictBool = False
    """``add`` only: scale the vector to the norm of the token's own activation
    before adding (default false)."""

    when: WhenFields | None = None
    """Off for a request until ``point`` emits a signal with ``action`` for that
    request; from the next forward pass on it stays on for that request only."""


class SpecDocument(_SchemaModel):
    """An undercurrent spec: a named list of extraction points."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        frozen=True,
        title="undercurrent spec",
    )

    version: StrictStr = "1"
    """Spec format version, a string: ``"1"``, or ``"2"`` (adds ``edits``)."""

    extraction_points: list[ExtractionPointFields]
    """The extraction points, each with a unique name."""

    edits: list[EditFields] = Field(default_factory=list)
    """Live activation edits (version "2" only; version "1" rejects the key)."""


# Keys that must be present on every point once older spellings are mapped.
REQUIRED_POINT_KEYS = ("name", "layers", "tensor_type", "position", "probe_type", "probe_kind")

# Older or alternative spellings: key -> the key it stands for.
DEPRECATED_POINT_KEYS = {"layer": "layers", "tensor": "tensor_type"}
ALIAS_POINT_KEYS = {"every_n": "stride"}

# Optional keys whose default is None: writing ``null`` is the same as omitting them.
NULLABLE_KEYS = frozenset({"until", "queue_depth", "intervention", "timeout_ms", "when",
                           "vector_key"})

REQUIRED_EDIT_KEYS = ("name", "layers", "tensor_type", "position", "op", "vector")


def _field_adapters(model: type[BaseModel]) -> dict[str, TypeAdapter[Any]]:
    adapters: dict[str, TypeAdapter[Any]] = {}
    for key, info in model.model_fields.items():
        annotation: Any = info.annotation
        if info.metadata:
            annotation = Annotated[tuple([annotation, *info.metadata])]
        adapters[key] = TypeAdapter(annotation)
    return adapters


def _field_enums(*models: type[BaseModel]) -> dict[str, type[enum.Enum]]:
    found: dict[str, type[enum.Enum]] = {}
    for model in models:
        for key, info in model.model_fields.items():
            for candidate in (info.annotation, *typing.get_args(info.annotation)):
                if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
                    found[key] = candidate
    return found


FIELD_ENUMS = _field_enums(ExtractionPointFields, InterventionFields, EditFields, WhenFields)
"""Key -> the enum its values come from (for "expected one of" messages)."""

POINT_FIELD_ADAPTERS = _field_adapters(ExtractionPointFields)
INTERVENTION_FIELD_ADAPTERS = _field_adapters(InterventionFields)
EDIT_FIELD_ADAPTERS = _field_adapters(EditFields)
WHEN_FIELD_ADAPTERS = _field_adapters(WhenFields)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec file (for editors and ``undercurrent schema``).

    Every key carries its documentation; deprecated spellings are marked
    ``deprecated``; the schema also states which keys exclude each other.
    """
    schema = SpecDocument.model_json_schema()
    point = schema["$defs"]["ExtractionPointFields"]
    point["title"] = "Extraction point"
    schema["$defs"]["InterventionFields"]["title"] = "Intervention policy"
    for key in ("layer", "tensor", "every_n"):
        point["properties"][key].pop("default", None)
    point["required"] = ["name", "position", "probe_type", "probe_kind"]
    exclusive = [("layers", "layer"), ("tensor_type", "tensor"), ("stride", "every_n")]
    point["allOf"] = [
        {"anyOf": [{"required": ["layers"]}, {"required": ["layer"]}]},
        {"anyOf": [{"required": ["tensor_type"]}, {"required": ["tensor"]}]},
        *({"not": {"required": [first, second]}} for first, second in exclusive),
    ]
    schema["$defs"]["EditFields"]["title"] = "Edit"
    schema["$defs"]["WhenFields"]["title"] = "Edit trigger"
    schema["properties"]["version"]["enum"] = list(SPEC_VERSIONS)
    # ``edits`` belongs to version "2": a file that omits version (so "1") or says
    # "1" must not have it.
    schema["allOf"] = [
        {
            "if": {"not": {"properties": {"version": {"enum": list(EDIT_VERSIONS)}},
                           "required": ["version"]}},
            "then": {"not": {"required": ["edits"]}},
        }
    ]
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
