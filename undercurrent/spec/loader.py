"""The three loaders: :func:`parse_dict`, :func:`parse_yaml`, :func:`load_yaml_file`.

Raw data is checked key by key against the pydantic schema in
:mod:`undercurrent.spec.schema`, then against the cross-field rules in
:mod:`undercurrent.spec.rules`. Every problem is collected; if there is any, one
:class:`SpecValidationError` lists them all. Otherwise the valid values become
the frozen dataclasses of :mod:`undercurrent.spec.types`.

Older key names (``layer``, ``tensor``) are mapped to the new ones and reported
as :class:`SpecDeprecationWarning` once the spec has been checked.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from pydantic import TypeAdapter, ValidationError

from undercurrent.paths import shipped_or_user_path
from undercurrent.spec.errors import SpecProblem, SpecValidationError
from undercurrent.spec.messages import describe_value, did_you_mean, pydantic_problem
from undercurrent.spec.rules import edit_rule_problems, point_rule_problems, trigger_problems
from undercurrent.spec.schema import (
    ALIAS_POINT_KEYS,
    DEPRECATED_POINT_KEYS,
    EDIT_FIELD_ADAPTERS,
    EDIT_VERSIONS,
    FIELD_ENUMS,
    INTERVENTION_FIELD_ADAPTERS,
    NULLABLE_KEYS,
    POINT_FIELD_ADAPTERS,
    REQUIRED_EDIT_KEYS,
    REQUIRED_POINT_KEYS,
    SPEC_VERSIONS,
    WHEN_FIELD_ADAPTERS,
    EditFields,
    ExtractionPointFields,
    InterventionFields,
    SpecDocument,
    WhenFields,
)
from undercurrent.spec.types import (
    Edit,
    EditTrigger,
    ExtractionPoint,
    InterventionPolicy,
    ProbeSpec,
)
from undercurrent.spec.yaml_source import load_yaml_data, read_spec_file

_TOP_LEVEL_KEYS = tuple(SpecDocument.model_fields)
_VERSION_1_KEYS = tuple(key for key in _TOP_LEVEL_KEYS if key != "edits")
_POINT_KEYS = tuple(ExtractionPointFields.model_fields)
_EDIT_KEYS = tuple(EditFields.model_fields)

# Nested mappings: key -> (their field adapters, the keys they require, what they build).
_NESTED: dict[str, tuple[Mapping[str, TypeAdapter[Any]], tuple[str, ...], Any]] = {
    "intervention": (INTERVENTION_FIELD_ADAPTERS, (), InterventionPolicy),
    "when": (WHEN_FIELD_ADAPTERS, ("point",), EditTrigger),
}
_NESTED_KEYS = {"intervention": tuple(InterventionFields.model_fields),
                "when": tuple(WhenFields.model_fields)}


class SpecDeprecationWarning(DeprecationWarning):
    """A spec used an older key name. ``problem`` locates it like an error would;
    ``source`` is the file it came from, when known."""

    def __init__(self, problem: SpecProblem, source: str | None = None) -> None:
        super().__init__(f"{source}: {problem}" if source else str(problem))
        self.problem = problem
        self.source = source


@dataclass
class _PointCheck:
    """What checking one raw extraction point found."""

    index: int
    name: str | None
    section: str = "extraction_points"
    problems: list[SpecProblem] = field(default_factory=list)
    deprecations: list[SpecProblem] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    given: set[str] = field(default_factory=set)
    written: dict[str, str] = field(default_factory=dict)

    def add(self, key: str | None, message: str) -> None:
        shown = self.written.get(key, key) if key is not None else None
        self.problems.append(SpecProblem(message, shown, self.index, self.name, self.section))


def _unknown_key_message(key: object, allowed: Sequence[str], where: str) -> str:
    if not isinstance(key, str):
        return f"key {describe_value(key)} is not a string; {where} keys are: {', '.join(allowed)}"
    return f"unknown key {key!r}{did_you_mean(key, allowed)}; {where} keys are: " + ", ".join(
        allowed
    )


def _check_fields(
    check: _PointCheck,
    raw: Mapping[Any, Any],
    adapters: Mapping[str, TypeAdapter[Any]],
    prefix: str,
) -> None:
    """Validate each known key of ``raw`` on its own, recording values and problems."""
    for key, value in raw.items():
        if key not in adapters:
            continue
        flat = prefix + key
        if value is None and key in NULLABLE_KEYS:
            continue  # ``null`` means "not set"
        check.given.add(flat)
        if key in _NESTED and not prefix:
            _check_nested(check, key, value)
            continue
        try:
            check.values[flat] = adapters[key].validate_python(value)
        except ValidationError as error:
            allowed = FIELD_ENUMS.get(key)
            for entry in error.errors(include_url=False):
                check.add(flat, pydantic_problem(entry, allowed))


def _check_nested(check: _PointCheck, name: str, raw: Any) -> None:
    """A nested mapping (``intervention``, ``when``): each key, then the object it builds."""
    adapters, required, build = _NESTED[name]
    keys = _NESTED_KEYS[name]
    if not isinstance(raw, Mapping):
        check.add(name, f"must be a mapping with keys {', '.join(keys)}, "
                        f"got {describe_value(raw)}")
        return
    for key in raw:
        if key not in adapters:
            shown = f"{name}.{key}" if isinstance(key, str) else name
            check.add(shown, _unknown_key_message(key, keys, name))
    before = len(check.problems)
    _check_fields(check, raw, adapters, f"{name}.")
    for key in required:
        if key not in raw:
            check.add(f"{name}.{key}", "is required but missing")
    if len(check.problems) == before and all(
        isinstance(key, str) and key in adapters for key in raw
    ):
        parts = {
            key.removeprefix(f"{name}."): value
            for key, value in check.values.items()
            if key.startswith(f"{name}.")
        }
        check.values[name] = build(**parts)


def _plain_numbers(value: Any, depth: int = 0) -> Any:
    """A field's value with numpy (or other) integers and reals as plain ``int``
    and ``float``, in the value and in a list's or a mapping's items (one level:
    ``layers``, an edit's ``vector``, ``intervention``), and a 1-D array as a
    list, as a hand-built point takes them. The caller leaves ``probe_args``
    out (a probe may want numpy values); a bool stays a bool, for its check to
    name."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if depth == 0 and isinstance(value, list | tuple):
        return [_plain_numbers(item, 1) for item in value]
    if depth == 0 and getattr(value, "ndim", None) == 1 and callable(
            getattr(value, "tolist", None)):  # (a 1-D numpy array or tensor)
        return _plain_numbers(value.tolist())
    if depth == 0 and isinstance(value, dict):
        return {key: _plain_numbers(item, 1) for key, item in value.items()}
    return value


def _check_point(raw: Mapping[Any, Any], index: int) -> _PointCheck:
    name = raw.get("name")
    check = _PointCheck(index=index, name=name if isinstance(name, str) else None)
    for key in raw:
        if key not in POINT_FIELD_ADAPTERS:
            check.add(
                key if isinstance(key, str) else None,
                _unknown_key_message(key, _POINT_KEYS, "extraction point"),
            )
    data = {key: value if key == "probe_args" else _plain_numbers(value)
            for key, value in raw.items() if key in POINT_FIELD_ADAPTERS}
    renames = {**DEPRECATED_POINT_KEYS, **ALIAS_POINT_KEYS}
    for old, new in renames.items():
        if old not in data:
            continue
        if new in data:
            check.add(old, f"{old!r} and {new!r} are both set; they mean the same, keep {new!r}")
            del data[old]
            continue
        data[new] = data.pop(old)
        check.written[new] = old
        if old in DEPRECATED_POINT_KEYS:
            check.deprecations.append(
                SpecProblem(
                    f"key {old!r} is deprecated; write {new!r} instead", old, index, check.name
                )
            )
    _check_fields(check, data, POINT_FIELD_ADAPTERS, "")
    for key in REQUIRED_POINT_KEYS:
        if key not in data:
            check.add(key, "is required but missing")
    for key, message in point_rule_problems(check.values, check.given):
        check.add(key, message)
    return check


def _check_edit(raw: Mapping[Any, Any], index: int) -> _PointCheck:
    name = raw.get("name")
    check = _PointCheck(index=index, name=name if isinstance(name, str) else None,
                        section="edits")
    for key in raw:
        if key not in EDIT_FIELD_ADAPTERS:
            check.add(key if isinstance(key, str) else None,
                      _unknown_key_message(key, _EDIT_KEYS, "edit"))
    data = {key: _plain_numbers(value) for key, value in raw.items()
            if key in EDIT_FIELD_ADAPTERS}
    _check_fields(check, data, EDIT_FIELD_ADAPTERS, "")
    for key in REQUIRED_EDIT_KEYS:
        if key not in data:
            check.add(key, "is required but missing")
    for key, message in edit_rule_problems(check.values, check.given):
        check.add(key, message)
    return check


def edit_problems(raw: Mapping[Any, Any], index: int = 0) -> list[SpecProblem]:
    """Every problem of one raw edit (a mapping) on its own, without building it
    (references to extraction points are checked with the whole spec)."""
    return _check_edit(raw, index).problems


def parse_edit(raw: Any, index: int = 0) -> Edit:
    """One edit from raw data (a mapping in spec form), checked on its own; an
    :class:`Edit` is returned as it is. References to extraction points are
    checked with the points they run next to (see ``check_edits``).

    >>> parse_edit({"name": "e", "layers": 1, "tensor_type": "residual_stream",
    ...     "position": "generated[*]", "op": "add", "vector": [1, 0]}).vector
    (1.0, 0.0)
    """
    if isinstance(raw, Edit):
        return raw
    if not isinstance(raw, Mapping):
        raise SpecValidationError([SpecProblem(
            f"an edit must be an Edit or a mapping, got {describe_value(raw)}",
            point_index=index, section="edits")])
    check = _check_edit(raw, index)
    if check.problems:
        raise SpecValidationError(check.problems)
    return _build_edit(check)


def _build_edit(check: _PointCheck) -> Edit:
    arguments = {
        key: value
        for key, value in check.values.items()
        if "." not in key and key in Edit.__dataclass_fields__
    }
    return Edit(**arguments)


def point_problems(raw: Mapping[Any, Any], index: int = 0) -> list[SpecProblem]:
    """Every problem of one raw extraction point (a mapping), without building it."""
    return _check_point(raw, index).problems


def _build_point(check: _PointCheck) -> ExtractionPoint:
    arguments = {
        key: value
        for key, value in check.values.items()
        if "." not in key and key in ExtractionPoint.__dataclass_fields__
    }
    return ExtractionPoint(**arguments)


def _is_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _unquoted_version(version: object) -> str | None:
    """The known spec version a plain YAML number stands for (``2`` or ``2.0`` ->
    ``"2"``), or ``None`` (YAML reads ``version: 2`` as an integer; a version is a
    string)."""
    if isinstance(version, float) and version.is_integer():
        version = int(version)
    if isinstance(version, int) and not isinstance(version, bool) and str(version) in (
            SPEC_VERSIONS):
        return str(version)
    return None


def version_problems(version: Any) -> list[SpecProblem]:
    """What is wrong with a spec's ``version`` (empty when this release reads it):
    what the loader refuses, for a hand-built ``ProbeSpec`` too."""
    problems: list[SpecProblem] = []
    meant = version.strip() if isinstance(version, str) else _unquoted_version(version)
    if not isinstance(version, str) and meant is not None:
        problems.append(
            SpecProblem(
                f"must be a string, got {describe_value(version)}; write version: "
                f"\"{meant}\" (quoted)",
                "version",
            )
        )
    elif not isinstance(version, str):
        # Not a known version unquoted (``version: 3``): quoting it would not help.
        known = " or ".join(f'"{known}"' for known in SPEC_VERSIONS)
        problems.append(
            SpecProblem(
                f"unsupported spec version, got {describe_value(version)}; this release of "
                f"undercurrent reads version {known}, a quoted string "
                f"(version: \"{SPEC_VERSIONS[-1]}\")",
                "version",
            )
        )
    elif version.strip() not in SPEC_VERSIONS:
        problems.append(
            SpecProblem(
                f"unsupported spec version {version!r}; this release of undercurrent reads "
                f"version {', '.join(repr(known) for known in SPEC_VERSIONS)}",
                "version",
            )
        )
    return problems


def _parse_document(data: Any) -> tuple[ProbeSpec | None, list[SpecProblem], list[SpecProblem]]:
    problems: list[SpecProblem] = []
    if not isinstance(data, Mapping):
        empty = " (the document is empty)" if data is None else ""
        problems.append(
            SpecProblem(
                "a spec must be a mapping with the keys 'version' and 'extraction_points', "
                f"got {describe_value(data)}{empty}"
            )
        )
        return None, problems, []
    version = data.get("version", "1")
    # An unquoted known version (``version: 2``) is reported once, as that version
    # quoted, and read as that version meanwhile (so its edits are checked).
    meant = version.strip() if isinstance(version, str) else _unquoted_version(version)
    with_edits = meant in EDIT_VERSIONS
    allowed = _TOP_LEVEL_KEYS if with_edits else _VERSION_1_KEYS
    for key in data:
        if key not in allowed:
            message = _unknown_key_message(key, allowed, "top-level")
            if key == "edits":
                message += ' (edits need version: "2")'
            problems.append(SpecProblem(message, key if isinstance(key, str) else None))
    problems += version_problems(version)
    raw_points: Any = data.get("extraction_points")
    if "extraction_points" not in data:
        problems.append(SpecProblem("is required but missing", "extraction_points"))
        raw_points = []
    elif not _is_list(raw_points):
        problems.append(
            SpecProblem(
                f"must be a list of extraction points, got {describe_value(raw_points)}",
                "extraction_points",
            )
        )
        raw_points = []
    points: list[ExtractionPoint] = []
    deprecations: list[SpecProblem] = []
    first_index: dict[str, int] = {}
    for index, raw in enumerate(raw_points):
        if not isinstance(raw, Mapping):
            problems.append(
                SpecProblem(
                    f"an extraction point must be a mapping, got {describe_value(raw)}",
                    point_index=index,
                )
            )
            continue
        check = _check_point(raw, index)
        if check.name is not None and "name" in check.values:
            if check.name in first_index:
                check.add(
                    "name",
                    f"duplicate name {check.name!r}: already used by "
                    f"extraction_points[{first_index[check.name]}]; names must be unique",
                )
            else:
                first_index[check.name] = index
        problems += check.problems
        deprecations += check.deprecations
        if not check.problems:
            points.append(_build_point(check))
    edits = _parse_edits(data.get("edits") if with_edits else None, first_index, points,
                         problems)
    if problems:
        return None, problems, deprecations
    return (ProbeSpec(tuple(points), version=str(version).strip(), edits=tuple(edits)),
            problems, deprecations)


def _parse_edits(raw_edits: Any, point_index: Mapping[str, int],
                 points: Sequence[ExtractionPoint], problems: list[SpecProblem]) -> list[Edit]:
    """Check and build the ``edits`` list, appending every problem to ``problems``."""
    if raw_edits is None:
        return []
    if not _is_list(raw_edits):
        problems.append(SpecProblem(f"must be a list of edits, got {describe_value(raw_edits)}",
                                    "edits"))
        return []
    built = {point.name: point for point in points}
    edits: list[Edit] = []
    first_index: dict[str, int] = {}
    for index, raw in enumerate(raw_edits):
        if not isinstance(raw, Mapping):
            problems.append(SpecProblem(f"an edit must be a mapping, got {describe_value(raw)}",
                                        point_index=index, section="edits"))
            continue
        check = _check_edit(raw, index)
        if check.name is not None and "name" in check.values:
            if check.name in point_index:
                check.add("name", f"duplicate name {check.name!r}: already used by "
                                  f"extraction_points[{point_index[check.name]}]; names must "
                                  "be unique across extraction points and edits")
            elif check.name in first_index:
                check.add("name", f"duplicate name {check.name!r}: already used by "
                                  f"edits[{first_index[check.name]}]; names must be unique")
            else:
                first_index[check.name] = index
        trigger = check.values.get("when")
        if trigger is not None:
            for message in trigger_problems(trigger, point_index, built):
                check.add("when.point", message)
        problems += check.problems
        if not check.problems:
            edits.append(_build_edit(check))
    return edits


def _warning_stacklevel() -> int:
    """Stack level of the first frame outside undercurrent (where the user called,
    through ``parse_yaml`` or ``ProbedModel(spec=...)`` alike): Python's default
    filters show a DeprecationWarning only where it points at the caller's code."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None and _in_package(frame.f_globals.get("__name__", "")):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _in_package(module: str) -> bool:
    return module == "undercurrent" or module.startswith("undercurrent.")


def parse_dict(data: Any, *, source: str | None = None) -> ProbeSpec:
    """Validate already-loaded spec data (a mapping) and resolve it into a ProbeSpec.

    Raises :class:`SpecValidationError` listing every problem. Older key names emit
    a :class:`SpecDeprecationWarning` (a DeprecationWarning).

    >>> spec = parse_dict({"extraction_points": [{"name": "p", "layers": 2,
    ...     "tensor_type": "residual_stream", "position": "prompt[-1]",
    ...     "probe_type": "norm_probe", "probe_kind": "single_shot"}]})
    >>> spec.get("p").layers
    (2,)
    """
    try:
        spec, problems, deprecations = _parse_document(data)
    except SpecValidationError:
        raise
    except RecursionError:
        problems = [SpecProblem("the spec data is nested too deeply to check")]
        spec, deprecations = None, []
    except Exception as error:  # a safety net: the loaders never leak a raw error
        problems = [SpecProblem(f"could not check the spec: {type(error).__name__}: {error}")]
        spec, deprecations = None, []
    for problem in deprecations:
        warnings.warn(SpecDeprecationWarning(problem, source), stacklevel=_warning_stacklevel())
    if spec is None:
        raise SpecValidationError(problems, source=source)
    return spec


def parse_yaml(text: str | bytes, *, source: str | None = None) -> ProbeSpec:
    """Parse a spec from YAML text (str, or UTF-8 bytes) into a ProbeSpec.

    Only safe YAML loading is used; duplicate keys, excessive nesting and alias
    bombs are rejected. Raises :class:`SpecValidationError`.
    """
    return parse_dict(load_yaml_data(text, source), source=source)


def is_yaml_text(value: str | os.PathLike[str]) -> TypeGuard[str]:
    """Whether a spec given as a string is YAML text rather than a file's path: a
    path object never is; a string is when it has several lines, or is one line
    that names no file and holds ``extraction_points:`` (flow YAML). A file
    whose name contains "extraction_points" is still a file.

    >>> is_yaml_text("{extraction_points: []}"), is_yaml_text("specs/a.yaml")
    (True, False)
    """
    if not isinstance(value, str):
        return False
    return "\n" in value or ("extraction_points" in value and ":" in value
                             and not is_file(value))


def is_file(text: str) -> bool:
    """Whether ``text`` names a file, ``~`` expanded, ``undercurrent:REL`` inside the
    package (False for a name the OS refuses outright)."""
    try:
        return shipped_or_user_path(text).is_file()
    except (OSError, ValueError):
        return False


def load_yaml_file(path: str | Path) -> ProbeSpec:
    """Load a spec from a YAML file. A missing or unreadable file raises
    :class:`SpecValidationError` naming the path.

    >>> spec = load_yaml_file("specs/classic_single_token.yaml")  # doctest: +SKIP
    """
    source = str(path)
    return parse_yaml(read_spec_file(path), source=source)
