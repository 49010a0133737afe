"""Registering edits on a loaded model: every check that needs the model.

:func:`register_edits` holds edits to the spec's rules (for hand-built ones),
checks their layers against the backend's capabilities, checks that each ``when``
names an inline extraction point of the request, and resolves each vector to the
model's hidden size. Every problem names the edit and the field, and all of them
are reported at once, before any generation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from undercurrent.spec.check import check_edits
from undercurrent.spec.errors import SpecProblem, SpecValidationError
from undercurrent.spec.loader import parse_edit
from undercurrent.spec.types import Edit, ExtractionPoint
from undercurrent.steering.vectors import ResolvedEdit, resolve_edits


def as_edits(edits: Iterable[Any] | None) -> list[Edit]:
    """``Edit`` objects from Edits or spec-form mappings (None gives none)."""
    if edits is None:
        return []
    if isinstance(edits, Edit | Mapping):
        raise TypeError("edits must be a list of edits (Edit objects or mappings), "
                        f"got a single {type(edits).__name__}; wrap it in a list")
    if isinstance(edits, str | bytes) or not isinstance(edits, Iterable):
        raise TypeError("edits must be a list of edits (Edit objects or mappings), got "
                        f"{type(edits).__name__} ({edits!r:.40})")
    return [parse_edit(edit, index) for index, edit in enumerate(edits)]


def layer_problems(edits: Sequence[Edit], capabilities: Any) -> list[SpecProblem]:
    """Edits whose tensor type or layers the backend cannot reach."""
    problems: list[SpecProblem] = []
    for index, edit in enumerate(edits):
        valid = capabilities.valid_layers(edit.tensor_type)
        if not valid:
            note = getattr(capabilities, "notes", {}).get(edit.tensor_type.value)
            problems.append(SpecProblem(
                f"{edit.tensor_type.value!r} is not available on the {capabilities.backend} "
                f"backend for {capabilities.model_type!r}" + (f"; {note}" if note else ""),
                "tensor_type", index, edit.name,
                "edits"))
            continue
        bad = [layer for layer in edit.layers if layer not in valid]
        if bad:
            problems.append(SpecProblem(
                f"layer(s) {bad} out of range: the model has {capabilities.num_layers} decoder "
                f"layers (valid: {min(valid)}..{max(valid)})", "layers", index, edit.name,
                "edits"))
    return problems


def register_edits(edits: Sequence[Edit], points: Sequence[ExtractionPoint],
                   capabilities: Any, places: Sequence[tuple[str, int]] | None = None,
                   dtype: str | None = None) -> list[ResolvedEdit]:
    """Check ``edits`` against ``points`` and the model, and resolve their vectors.

    Raises :class:`SpecValidationError` listing every problem (naming each edit
    and field): broken spec rules, a duplicate name, a ``when`` naming an unknown
    or async point, a layer out of range, a vector that is missing or whose size
    is not the model's hidden size, a coefficient times the vector past the largest
    finite number of ``dtype`` (the model's, when given). ``places`` (see
    :func:`~undercurrent.spec.check.check_edits`) names each edit by the list the
    user wrote it in, for edits gathered from several.
    """
    if not edits:
        return []
    problems: list[SpecProblem] = []
    try:
        check_edits(edits, points, places)
    except SpecValidationError as error:
        problems += error.problems
    located = layer_problems(edits, capabilities)
    try:
        resolved = resolve_edits(edits, getattr(capabilities, "hidden_size", None), dtype)
    except SpecValidationError as error:
        located += error.problems
        resolved = []
    problems += located if places is None else placed(located, places.__getitem__)
    if problems:
        raise SpecValidationError(problems)
    return resolved


def placed(problems: Sequence[SpecProblem], place: Callable[[int], tuple[str, int]]
           ) -> list[SpecProblem]:
    """``problems`` of edits indexed in one list (``edits[i]``), each moved to
    ``place(i)``: the (list, index) where the user wrote that edit."""
    moved: list[SpecProblem] = []
    for problem in problems:
        if problem.section == "edits" and problem.point_index is not None:
            section, index = place(problem.point_index)
            problem = dataclasses.replace(problem, section=section, point_index=index)
        moved.append(problem)
    return moved
