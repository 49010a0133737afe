"""Wording of spec problems: value descriptions, did-you-mean, pydantic errors.

Pydantic's own messages ("Input should be a valid integer") say nothing about
YAML or about what would be right, so each error type is reworded here.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable, Mapping
from typing import Any

_YAML_BOOLEAN_HINT = (
    " (YAML reads yes/no/on/off/true/false as booleans; quote the value to make it a string)"
)


def describe_value(value: object) -> str:
    """A short, YAML-flavoured description of a value: ``a string ('abc')``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, enum.Enum):
        return f"{value.value!r}"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({shown!r})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'layers'?)`` when a choice is close to ``word``, else ``""``."""
    if not isinstance(word, str):
        return ""
    options = list(choices)
    by_folded = {choice.lower(): choice for choice in options}
    close = difflib.get_close_matches(word.lower(), list(by_folded), n=1, cutoff=0.6)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


def enum_problem(value: object, allowed: type[enum.Enum]) -> str:
    """``'residual' is not allowed; expected one of: ...`` with a did-you-mean."""
    names = [str(member.value) for member in allowed]
    shown = repr(value) if isinstance(value, str) else describe_value(value)
    return f"{shown} is not allowed; expected one of: {', '.join(names)}" + did_you_mean(
        value, names
    )


def pydantic_problem(error: Mapping[str, Any], allowed: type[enum.Enum] | None) -> str:
    """Reword one entry of ``ValidationError.errors()`` for a spec author."""
    kind = error.get("type", "")
    value = error.get("input")
    context = error.get("ctx") or {}
    inner = [str(part) for part in error.get("loc", ()) if part != "[key]"]
    prefix = f"key {inner[0]!r}: " if inner else ""
    if kind == "enum" and allowed is not None:
        return enum_problem(value, allowed)
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{prefix}must be an integer, got {describe_value(value)}"
    if kind == "greater_than_equal":
        return f"{prefix}must be >= {context.get('ge')}, got {value!r}"
    if kind in ("string_type", "str_type"):
        hint = _YAML_BOOLEAN_HINT if isinstance(value, bool) else ""
        if "[key]" in error.get("loc", ()):
            return f"keys must be strings, got {describe_value(value)}{hint}"
        return f"{prefix}must be a string, got {describe_value(value)}{hint}"
    if kind in ("bool_type", "bool_parsing"):
        return f"{prefix}must be true or false, got {describe_value(value)}"
    if kind == "dict_type":
        return f"{prefix}must be a mapping, got {describe_value(value)}"
    if kind in ("spec_rule", "value_error"):
        return str(context.get("error", error.get("msg", "")))
    if kind == "missing":
        return f"{prefix}is required"
    return f"{prefix}{error.get('msg', 'is invalid')}"
