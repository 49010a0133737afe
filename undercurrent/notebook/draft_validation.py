"""Checking the editor's drafts with the spec's own validators.

:func:`validate_drafts` writes every point and edit draft as spec data and runs
the spec loader (``parse_dict``) on the whole document, so the editor says
exactly what loading the YAML would, attached to the point or edit and field at
fault. With a model, :class:`ModelCheck` adds what registering the spec on it
would refuse, from the same functions registration calls
(``Capabilities.problem_details`` for points, ``register_edits`` for edits).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from undercurrent.adapters.capabilities import Capabilities
from undercurrent.notebook.edit_draft import EditDraft, edit_draft_to_raw
from undercurrent.notebook.spec_draft import PointDraft, draft_to_raw
from undercurrent.probes import ProbeRegistry, default_registry
from undercurrent.router.validation import raw_probe_problems
from undercurrent.spec import ProbeSpec, SpecProblem, SpecValidationError, parse_dict
from undercurrent.steering.registration import register_edits

POINTS = "extraction_points"
EDITS = "edits"


def drafts_to_raw_spec(
    drafts: Sequence[PointDraft], edits: Sequence[EditDraft] = ()
) -> tuple[dict[str, Any], list[SpecProblem]]:
    """The whole spec as data, plus the problems of text that never became data.

    The version is "2" when there is at least one edit, else "1".
    """
    points: list[dict[str, Any]] = []
    problems: list[SpecProblem] = []
    for index, draft in enumerate(drafts):
        raw, found = draft_to_raw(draft)
        points.append(raw)
        problems += [SpecProblem(message, field, index, draft.name) for field, message in found]
    raw_spec: dict[str, Any] = {"version": "2" if edits else "1", "extraction_points": points}
    if edits:
        raw_spec["edits"] = []
        for index, edit in enumerate(edits):
            raw, found = edit_draft_to_raw(edit)
            raw_spec["edits"].append(raw)
            problems += [SpecProblem(message, field, index, edit.name, EDITS)
                         for field, message in found]
    return raw_spec, problems


class ModelCheck:
    """What registering a spec on the loaded model would refuse, as problems.

    Points: their tensor types and layers against the backend's capabilities.
    Edits: ``register_edits``, as ``ProbedModel`` runs it: layers, and each vector
    resolved against the model's hidden size. Resolving reads vector files (an
    SAE's weights, for a feature), so the answer for the last edits seen is kept:
    a change to a point does not read them again.
    """

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities
        self._last_edits: tuple[Any, list[SpecProblem]] | None = None

    def __call__(self, spec: ProbeSpec) -> list[SpecProblem]:
        problems = [
            SpecProblem(detail["msg"], str(detail["loc"][-1]), int(detail["loc"][1]),
                        spec[int(detail["loc"][1])].name)
            for detail in self.capabilities.problem_details(spec)
        ]
        return problems + self._edit_problems(spec)

    def _edit_problems(self, spec: ProbeSpec) -> list[SpecProblem]:
        if not spec.edits:
            return []
        # Keyed on the edits alone: the part of register_edits that reads the points
        # (names, ``when``) repeats the loader's checks, which this spec has passed.
        key = spec.edits
        if self._last_edits is None or self._last_edits[0] != key:
            try:
                register_edits(spec.edits, list(spec), self.capabilities)
                found: list[SpecProblem] = []
            except SpecValidationError as error:
                found = list(error.problems)
            self._last_edits = (key, found)
        return list(self._last_edits[1])


def validate_drafts(
    drafts: Sequence[PointDraft],
    edits: Sequence[EditDraft] = (),
    model_check: ModelCheck | None = None,
    registry: ProbeRegistry = default_registry,
) -> tuple[ProbeSpec | None, list[SpecProblem]]:
    """``(spec, problems)``: the spec when every draft is valid, and every problem found.

    Problems come from the drafts' text, the spec loader, ``registry`` (the probe
    registry the model's router uses: an unknown ``probe_type``, a ``probe_kind``
    the probe does not support, or a ``probe_args`` name its constructor does not
    take) and, with ``model_check``, the loaded model. Deprecation warnings from
    the loader are swallowed: the editor writes new keys.
    """
    raw_spec, problems = drafts_to_raw_spec(drafts, edits)
    # A field whose text never became data has its own message; the loader's view of
    # the placeholder left there ("an empty list") would only repeat it without a subject.
    unreadable = {(problem.section, problem.point_index, problem.field) for problem in problems}
    spec: ProbeSpec | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            spec = parse_dict(raw_spec)
        except SpecValidationError as error:
            problems += [problem for problem in error.problems
                         if (problem.section, problem.point_index, problem.field)
                         not in unreadable]
    problems += _registry_problems(raw_spec, problems, registry)
    if spec is not None and model_check is not None:
        problems += model_check(spec)
    return (spec if not problems else None), problems


def _registry_problems(raw_spec: dict[str, Any], problems: Sequence[SpecProblem],
                       registry: ProbeRegistry) -> list[SpecProblem]:
    """Each point's probe against ``registry``, as ``undercurrent validate``
    checks it: ``probe_type``, ``probe_kind`` and the names of ``probe_args``."""
    found: list[SpecProblem] = []
    for index, raw in enumerate(raw_spec[POINTS]):
        faulted = {problem.field for problem in problems
                   if problem.section == POINTS and problem.point_index == index}
        found += [SpecProblem(message, field, index, raw["name"])
                  for field, message in raw_probe_problems(raw, registry, faulted)]
    return found
