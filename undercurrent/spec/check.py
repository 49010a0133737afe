"""Checking hand-built extraction points against the spec's rules.

Points built in Python skip the parser. :func:`check_extraction_points` holds them
to exactly the rules a YAML spec is held to (it runs the parser's own checks on
their serialized form); the router calls it when a request is registered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from undercurrent.spec.errors import SpecProblem, SpecValidationError
from undercurrent.spec.loader import edit_problems, point_problems
from undercurrent.spec.rules import trigger_problems
from undercurrent.spec.serialize import edit_to_dict, extraction_point_to_dict
from undercurrent.spec.types import Edit, ExtractionPoint


def extraction_point_problems(point: ExtractionPoint, index: int = 0) -> list[SpecProblem]:
    """Every rule ``point`` breaks (empty when it is valid)."""
    return point_problems(extraction_point_to_dict(point), index)


def check_extraction_points(points: Iterable[ExtractionPoint]) -> None:
    """Raise :class:`SpecValidationError` listing every problem of ``points``,
    including duplicate names; return None when they are all valid.

    >>> from undercurrent.spec import ExtractionPoint
    >>> bad = ExtractionPoint(name="p", layers=(0,), tensor_type="mlp_out",
    ...     position="prompt[-1]", probe_type="norm_probe", probe_kind="single_shot",
    ...     execution_mode="async")
    >>> check_extraction_points([bad])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    undercurrent.spec.errors.SpecValidationError: invalid spec: extraction_points[0] ...
    """
    problems: list[SpecProblem] = []
    first_index: dict[str, int] = {}
    for index, point in enumerate(points):
        if not isinstance(point, ExtractionPoint):
            problems.append(
                SpecProblem(
                    f"expected an ExtractionPoint, got {type(point).__name__}", point_index=index
                )
            )
            continue
        problems += extraction_point_problems(point, index)
        if point.name in first_index:
            problems.append(
                SpecProblem(
                    f"duplicate name {point.name!r}: already used by "
                    f"extraction_points[{first_index[point.name]}]; names must be unique",
                    "name",
                    index,
                    point.name,
                )
            )
        else:
            first_index.setdefault(point.name, index)
    if problems:
        raise SpecValidationError(problems)


def check_edits(edits: Iterable[Edit], points: Iterable[ExtractionPoint] = (),
                places: Sequence[tuple[str, int]] | None = None) -> None:
    """Raise :class:`SpecValidationError` listing every problem of hand-built ``edits``
    next to ``points``: each edit's own rules, names unique across points and edits,
    and each ``when`` naming an inline point among ``points``.

    ``places`` says where the user wrote each edit, as (list, index) pairs (by
    default ``("edits", i)``): edits gathered from several lists (the spec's, a
    call's ``edits=``, one prompt's ``prompt_edits`` entry) are named in the
    problems, a duplicate's first use included, by the list they came from.

    >>> from undercurrent.spec import Edit
    >>> edit = Edit(name="e", layers=(0,), tensor_type="mlp_out", position="prompt[-1]",
    ...     op="add", vector=[1.0], when={"point": "guard"})
    >>> check_edits([edit])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    undercurrent.spec.errors.SpecValidationError: invalid spec: edits[0] (name 'e'), ...
    """
    by_name = {point.name: point for point in points}
    problems: list[SpecProblem] = []
    first_place: dict[str, tuple[str, int]] = {}
    for index, edit in enumerate(edits):
        section, place = ("edits", index) if places is None else places[index]
        if not isinstance(edit, Edit):
            problems.append(SpecProblem(f"expected an Edit, got {type(edit).__name__}",
                                        point_index=place, section=section))
            continue
        problems += [dataclasses.replace(problem, section=section)
                     for problem in edit_problems(edit_to_dict(edit), place)]
        found: list[tuple[str, str]] = []
        if edit.name in by_name:
            found.append(("name", f"duplicate name {edit.name!r}: an extraction point has it "
                                  "too; names must be unique across extraction points and edits"))
        elif edit.name in first_place:
            first_section, first_index = first_place[edit.name]
            found.append(("name", f"duplicate name {edit.name!r}: already used by "
                                  f"{first_section}[{first_index}]; names must be unique"))
        else:
            first_place[edit.name] = (section, place)
        if edit.when is not None:
            found += [("when.point", message)
                      for message in trigger_problems(edit.when, by_name, by_name)]
        problems += [SpecProblem(message, field, place, edit.name, section)
                     for field, message in found]
    if problems:
        raise SpecValidationError(problems)
