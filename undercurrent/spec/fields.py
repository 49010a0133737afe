"""The fields of an extraction point and of an edit, as tables read from the schema.

The pydantic models in :mod:`undercurrent.spec.schema` declare every key once:
its type, its default and its documentation. :func:`point_fields` and
:func:`edit_fields` read them into flat tables of :class:`SpecField`, one row per
key a user sets (nested keys flattened to their YAML path, ``intervention.mode``;
older spellings and aliases left out), in declaration order. Tools that present
spec fields (the notebook's ``SpecEditor``) take their field list, choices,
defaults and help text from here instead of writing them out again.

>>> [field.path for field in edit_fields()][-2:]
['when.point', 'when.action']
>>> point_fields()[2].choices
('residual_stream', 'attn_out', 'mlp_out', 'kv', 'final_norm')
"""

from __future__ import annotations

import enum
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from undercurrent.spec.schema import (
    ALIAS_POINT_KEYS,
    DEPRECATED_POINT_KEYS,
    EditFields,
    EditTensorType,
    EditVector,
    ExtractionPointFields,
    FiniteNumber,
    LayerIndices,
    NonEmptyText,
    Position,
    PositiveInt,
    ProbeArguments,
)
from undercurrent.spec.types import EDIT_TENSOR_TYPES

REQUIRED: Any = object()
"""The ``default`` of a field the spec must set."""

# The schema's value types, and the kind of value each one holds.
_KINDS: tuple[tuple[Any, str], ...] = (
    (LayerIndices, "layers"),
    (Position, "position"),
    (NonEmptyText, "text"),
    (PositiveInt, "integer"),
    (FiniteNumber, "number"),
    (ProbeArguments, "mapping"),
    (EditVector, "vector"),
    (EditTensorType, "choice"),
)
_CHOICES: tuple[tuple[Any, tuple[str, ...]], ...] = (
    (EditTensorType, tuple(t.value for t in EDIT_TENSOR_TYPES)),
)


@dataclass(frozen=True)
class SpecField:
    """One key of an extraction point or an edit.

    ``path`` is the key's place in the YAML (``stride``, ``intervention.mode``);
    ``kind`` the value it holds: ``text``, ``integer``, ``number``, ``boolean``,
    ``choice`` (one of ``choices``), ``layers``, ``position``, ``mapping`` or
    ``vector``. ``default`` is :data:`REQUIRED` for a key the spec must set, and
    ``optional`` says that ``null``/omitted means "not set" (``until``,
    ``queue_depth``, ``when``). ``doc`` is the schema's documentation.
    """

    path: str
    kind: str
    default: Any
    optional: bool
    doc: str
    choices: tuple[str, ...] = ()

    @property
    def required(self) -> bool:
        """Whether the spec must set this key."""
        return self.default is REQUIRED


@functools.cache
def point_fields() -> tuple[SpecField, ...]:
    """The keys of an extraction point, in the order the schema declares them."""
    skipped = {*DEPRECATED_POINT_KEYS, *ALIAS_POINT_KEYS}
    return _fields(ExtractionPointFields, skipped)


@functools.cache
def edit_fields() -> tuple[SpecField, ...]:
    """The keys of an edit, in the order the schema declares them."""
    return _fields(EditFields, set())


def _fields(model: type[BaseModel], skipped: set[str], prefix: str = "",
            parent_optional: bool = False) -> tuple[SpecField, ...]:
    hints = typing.get_type_hints(model, include_extras=True)
    rows: list[SpecField] = []
    for key, info in model.model_fields.items():
        if key in skipped:
            continue
        hint, optional = _without_none(hints[key])
        if isinstance(hint, type) and issubclass(hint, BaseModel):
            rows += _fields(hint, set(), f"{prefix}{key}.", optional)
            continue
        if info.is_required():
            default = REQUIRED
        elif info.default_factory is not None:
            default = info.default_factory()  # type: ignore[call-arg]
            if isinstance(default, dict):  # read-only: the cached tables are shared
                default = types.MappingProxyType(default)
        else:
            default = info.default
        if isinstance(default, enum.Enum):
            default = default.value
        kind, choices = _kind(hint)
        rows.append(SpecField(f"{prefix}{key}", kind, default, optional or parent_optional,
                              (info.description or "").strip(), choices))
    return tuple(rows)


def _without_none(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(hint, False)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) == 1:
            return members[0], True
    return hint, False


def _kind(hint: Any) -> tuple[str, tuple[str, ...]]:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "choice", tuple(member.value for member in hint)
    if hint is bool or typing.get_args(hint)[:1] == (bool,):
        return "boolean", ()
    for declared, kind in _KINDS:
        if hint == declared:
            choices = next((found for typ, found in _CHOICES if typ == declared), ())
            return kind, choices
    raise TypeError(f"spec field type {hint!r} has no kind in undercurrent.spec.fields")
