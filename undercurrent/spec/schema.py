"""The pydantic schema of a spec file: every key, its type, its documentation.

Each field here validates one raw value and resolves it into the type the frozen
dataclasses in :mod:`undercurrent.spec.types` hold (``layers`` -> tuple,
``position`` -> :class:`PositionSelector`, enum names -> enums). Rules that tie
several fields together live in :mod:`undercurrent.spec.rules`; the loader in
:mod:`undercurrent.spec.loader` drives both and collects every problem.

The models of a point, an edit and their nested objects are derived from the
dataclass field declarations in :mod:`undercurrent.spec.types` (type, default,
documentation, and the validated type named here in :data:`SCHEMA_TYPES`); only
the older spellings of a few point keys are added here. The documentation ends
up in :func:`json_schema`, which editors use for completion and hover help.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
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
    create_model,
)
from pydantic_core import PydanticCustomError

from undercurrent.spec.declarations import field_info, nullable_keys, required_keys
from undercurrent.spec.messages import describe_value, did_you_mean
from undercurrent.spec.position import PositionError, parse_position
from undercurrent.spec.types import (
    EDIT_TENSOR_TYPES,
    Edit,
    EditTrigger,
    ExtractionPoint,
    InterventionPolicy,
    SaeFeature,
    TensorType,
)

SPEC_VERSIONS = ("1", "2")
"""Spec format versions this release reads: "2" is "1" plus ``edits``."""

EDIT_VERSIONS = ("2",)
"""Spec versions that accept the top-level ``edits`` list."""

VECTOR_FILE_SUFFIXES = (".safetensors", ".npz")
"""File types an edit's ``vector`` may name (never pickle)."""

POSITION_PATTERN = (  # ([0-9], not \d: a validator's \d may match any Unicode digit)
    r"^\s*([0-9]+|prompt\[-?[0-9]+\]([+-][0-9]+)?|generated\[[0-9]+\]([+-][0-9]+)?"
    r"|generated\[\*\]|generated\[[0-9]+:[0-9]*\])\s*$"
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


SCHEMA_TYPES: dict[str, Any] = {
    "non_empty_text": NonEmptyText,
    "layer_indices": LayerIndices,
    "position": Position,
    "positive_int": PositiveInt,
    "edit_tensor_type": EditTensorType,
    "edit_vector": EditVector,
    "finite_number": FiniteNumber,
    "probe_arguments": ProbeArguments,
    "strict_bool": StrictBool,
}
"""The validated types a field declaration may name (``spec_field(schema=...)``)."""


def _schema_model(
    cls: type,
    name: str,
    doc: str,
    *,
    nested: Mapping[type, type[BaseModel]] | None = None,
    aliases: Mapping[str, Sequence[tuple[str, Any, Any]]] | None = None,
) -> type[BaseModel]:
    """The pydantic model of a spec object, from its dataclass field declarations:
    each field's validated type (its declared ``schema`` type, else its annotation
    with nested spec objects replaced by their models; ``| None`` kept), default and
    documentation. ``aliases`` adds older spellings right after the key they stand
    for, as ``(key, annotation, Field(...))``."""
    hints = typing.get_type_hints(cls)
    nested = nested or {}
    definitions: dict[str, Any] = {}
    for declared in dataclasses.fields(cls):
        info = field_info(declared)
        hint = hints[declared.name]
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        optional = type(None) in members
        if info.schema is not None:
            annotation = SCHEMA_TYPES[info.schema]
        else:
            (annotation,) = [nested.get(member, member) for member in members
                             if member is not type(None)]
        if optional:
            annotation = annotation | None
        if declared.default_factory is not dataclasses.MISSING:
            spec = Field(default_factory=declared.default_factory, description=info.doc)
        elif declared.default is not dataclasses.MISSING:
            spec = Field(default=declared.default, description=info.doc)
        else:
            spec = Field(description=info.doc)
        definitions[declared.name] = (annotation, spec)
        for alias, alias_annotation, alias_spec in (aliases or {}).get(declared.name, ()):
            definitions[alias] = (alias_annotation, alias_spec)
    return create_model(name, __base__=_SchemaModel, __doc__=doc, **definitions)


InterventionFields = _schema_model(
    InterventionPolicy, "InterventionFields",
    """How generation waits on this point's probe. When the key is omitted, the
    router's ``default_intervention_policy`` applies.""")

ExtractionPointFields = _schema_model(
    ExtractionPoint, "ExtractionPointFields",
    """One extraction point: which tensor to capture, at which layers and token
    positions, and which probe receives it.""",
    nested={InterventionPolicy: InterventionFields},
    aliases={
        # Older spellings and aliases default to None only so the model does not
        # require them; the loader never lets None through for these keys.
        "layers": [("layer", LayerIndices, Field(
            default=None, deprecated="use 'layers'",
            description="Older spelling of ``layers``; accepted with a DeprecationWarning."))],
        "tensor_type": [("tensor", TensorType, Field(
            default=None, deprecated="use 'tensor_type'",
            description="Older spelling of ``tensor_type``; accepted with a "
                        "DeprecationWarning."))],
        "stride": [("every_n", PositiveInt, Field(
            default=None, description="Alias of ``stride``; set one or the other, not both."))],
    },
)

WhenFields = _schema_model(
    EditTrigger, "WhenFields",
    "Switch an edit on for a request when one of its extraction points signals.")

EditFields = _schema_model(
    Edit, "EditFields",
    """One live activation edit (spec version "2"): which tensor to change, at which
    layers and token positions, how, and with which vector.""",
    nested={EditTrigger: WhenFields})


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

    extraction_points: list[ExtractionPointFields]  # type: ignore[valid-type]
    """The extraction points, each with a unique name."""

    edits: list[EditFields] = Field(default_factory=list)  # type: ignore[valid-type]
    """Live activation edits (version "2" only; version "1" rejects the key)."""


# Keys that must be present on every point once older spellings are mapped.
REQUIRED_POINT_KEYS = required_keys(ExtractionPoint)

# Older or alternative spellings: key -> the key it stands for.
DEPRECATED_POINT_KEYS = {"layer": "layers", "tensor": "tensor_type"}
ALIAS_POINT_KEYS = {"every_n": "stride"}

# Optional keys whose default is None: writing ``null`` is the same as omitting them.
NULLABLE_KEYS = nullable_keys(ExtractionPoint, InterventionPolicy, Edit, EditTrigger)

REQUIRED_EDIT_KEYS = required_keys(Edit)


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


def _one_of_words(words: Sequence[str]) -> str:
    """A pattern matching exactly one of ``words``, spaces around it allowed."""
    return r"^\s*(" + "|".join(re.escape(word) for word in words) + r")\s*$"


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
    # (the loader strips spaces around the version, and reads ``edits:`` with
    # nothing under it as no edits)
    schema["properties"]["version"].update(pattern=_one_of_words(SPEC_VERSIONS),
                                           examples=list(SPEC_VERSIONS))
    edits = schema["properties"]["edits"]
    schema["properties"]["edits"] = {
        **{key: edits.pop(key) for key in ("title", "description") if key in edits},
        "anyOf": [edits, {"type": "null"}]}
    # ``edits`` belongs to version "2": a file that omits version (so "1") or says
    # "1" must not have it.
    schema["allOf"] = [
        {
            "if": {"not": {"properties": {"version": {
                "type": "string", "pattern": _one_of_words(EDIT_VERSIONS)}},
                "required": ["version"]}},
            "then": {"not": {"required": ["edits"]}},
        }
    ]
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
