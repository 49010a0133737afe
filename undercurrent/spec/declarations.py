"""The one declaration of a spec object's fields, and what is derived from it.

Each field of :class:`~undercurrent.spec.ExtractionPoint`, :class:`~undercurrent.spec.Edit`
and their nested objects is declared once, in :mod:`undercurrent.spec.types`, with
:func:`spec_field`: its name, type and default (the dataclass field), its
documentation, the validated type the spec file gives it, and whether the vLLM
workers need it. Iterating ``dataclasses.fields`` then gives

- the spec form (:func:`to_spec_data`: what ``extraction_point_to_dict``,
  ``edit_to_dict`` and ``to_yaml`` write),
- the pydantic schema and the JSON Schema (:mod:`undercurrent.spec.schema`),
- the required and nullable keys the loader checks,
- the vLLM wire format of a point (:func:`wire_field_names`).

So adding a field to a point or an edit is one :func:`spec_field` line (plus its
rules, if it has any).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
from collections.abc import Mapping
from dataclasses import MISSING
from typing import Any

from undercurrent.spec.position import PositionSelector, format_position

_KEY = "undercurrent.spec"


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """What one field declares beyond its dataclass type and default.

    ``doc`` documents the key (the JSON Schema's description); ``schema`` names
    the validated type of :mod:`undercurrent.spec.schema` a spec file's value goes
    through (None: the field's own annotation, e.g. an enum or a nested object);
    ``wire`` marks the fields a vLLM worker needs to match tokens; ``always``
    writes the field even at its default; ``compact`` writes a one-item tuple as
    its item (``layers: 3``).
    """

    doc: str = ""
    schema: str | None = None
    wire: bool = False
    always: bool = False
    compact: bool = False


_PLAIN = FieldInfo()


def spec_field(
    doc: str,
    *,
    schema: str | None = None,
    wire: bool = False,
    always: bool = False,
    compact: bool = False,
    default: Any = MISSING,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field carrying its :class:`FieldInfo` (no default: required)."""
    info = FieldInfo(inspect.cleandoc(doc), schema, wire, always, compact)
    metadata = {_KEY: info}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_info(field: dataclasses.Field[Any]) -> FieldInfo:
    """The :class:`FieldInfo` of a field (an empty one for a plain dataclass field)."""
    info = field.metadata.get(_KEY, _PLAIN)
    assert isinstance(info, FieldInfo)
    return info


def has_default(field: dataclasses.Field[Any]) -> bool:
    """Whether the field may be omitted."""
    return field.default is not MISSING or field.default_factory is not MISSING


def default_of(field: dataclasses.Field[Any]) -> Any:
    """The field's default value (a fresh one from a factory)."""
    if field.default_factory is not MISSING:
        return field.default_factory()
    return field.default


def required_keys(cls: type) -> tuple[str, ...]:
    """Keys every spec object of ``cls`` must give, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls) if not has_default(f))


def nullable_keys(*classes: type) -> frozenset[str]:
    """Keys whose default is None: writing ``null`` is the same as omitting them."""
    return frozenset(f.name for cls in classes for f in dataclasses.fields(cls)
                     if has_default(f) and default_of(f) is None)


def wire_field_names(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` that cross to a vLLM worker."""
    return tuple(f.name for f in dataclasses.fields(cls) if field_info(f).wire)


def to_spec_data(obj: Any) -> dict[str, Any]:
    """A spec object (a dataclass declared with :func:`spec_field`) as plain data in
    spec form: fields in declaration order, those at their default left out (unless
    declared ``always``), enums as their values, positions spelled canonically,
    nested objects as mappings."""
    data: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        info = field_info(field)
        value = getattr(obj, field.name)
        if not info.always and has_default(field) and _is_default(value, default_of(field)):
            continue
        if info.compact and isinstance(value, tuple) and len(value) == 1:
            data[field.name] = plain_data(value[0])
        else:
            data[field.name] = plain_data(value)
    return data


def given_spec_data(obj: Any) -> dict[str, Any]:
    """:func:`to_spec_data` of an object whose values may not be normalised yet
    (a hand-built point being refused): each field in spec form where it can
    be, as given where it cannot (a string that names no enum value, a nested
    list), for the spec's check to name."""
    data: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if has_default(field) and _is_default(value, default_of(field)):
            continue
        try:
            data[field.name] = plain_data(value)
        except Exception:  # noqa: BLE001 - shown as given, for the check to name
            data[field.name] = value
    return data


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is the field's default, and may be left out: equal to it,
    and not a bool standing in for a number default, nor a float for an int one
    (``stride=True``, ``1.0`` or ``coefficient=True`` is written, for the spec's
    check to refuse, as in YAML)."""
    if value != default or isinstance(value, bool) != isinstance(default, bool):
        return False
    if isinstance(default, int) and not isinstance(default, bool):
        return not isinstance(value, float)
    return True


def plain_data(value: Any) -> Any:
    """One field value in spec form (plain ints, floats, strings, lists, dicts)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, PositionSelector):
        return format_position(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_spec_data(value)
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value))
    if isinstance(value, tuple | list):
        return [plain_data(item) for item in value]
    return value

