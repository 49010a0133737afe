"""Registration-time checks: what the router re-verifies on every request.

Hand-built :class:`~undercurrent.spec.types.ExtractionPoint` objects skip the
spec parser, so the router runs the spec's own check on them, then checks what
only it knows (its default policy, its probe registry), and reports every
problem at once.
"""

from __future__ import annotations

import types
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from undercurrent.probes.base import probe_args_problem, supported_kinds
from undercurrent.probes.registry import ProbeRegistry, UnknownProbeError
from undercurrent.spec.check import check_extraction_points
from undercurrent.spec.errors import SpecProblem, SpecValidationError
from undercurrent.spec.types import (
    ExecutionMode,
    ExtractionPoint,
    InterventionMode,
    InterventionPolicy,
    OnTimeout,
    ProbeKind,
)


@dataclass(frozen=True)
class CheckedPoint:
    """A point that passed the checks, with what the router resolved for it."""

    index: int
    point: ExtractionPoint
    probe_class: type
    policy: InterventionPolicy
    queue_capacity: int | None


def point_problem(index: int, point: Any, message: str, field: str | None = None) -> SpecProblem:
    """A router problem about ``points[index]``, located the way the spec's are."""
    name = getattr(point, "name", None)
    return SpecProblem(message, field, index, name if isinstance(name, str) else None)


def default_policy_problems(policy: InterventionPolicy) -> list[str]:
    """What is wrong with a router's ``default_intervention_policy`` (the spec's own
    rules, which points that set ``intervention`` are held to)."""
    problems: list[str] = []
    if policy.mode is InterventionMode.BLOCK_UNTIL_SIGNAL:
        timeout = policy.timeout_ms
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            problems.append(
                "block_until_signal needs timeout_ms, an int >= 1 "
                f"(got {timeout!r})"
            )
    else:
        if policy.timeout_ms is not None:
            problems.append(
                f"reject takes no timeout_ms (got {policy.timeout_ms!r}); use mode "
                "block_until_signal to wait on the probe"
            )
        if policy.on_timeout is not OnTimeout.CONTINUE:
            problems.append("reject only allows on_timeout 'continue'")
    return problems


def check_request_points(
    points: Sequence[Any],
    registry: ProbeRegistry,
    default_policy: InterventionPolicy,
    default_queue_depth: int,
    probe_defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[CheckedPoint], list[SpecProblem]]:
    """Check a request's points; returns (the points that passed, every problem).

    First the spec's own rules (:func:`~undercurrent.spec.check_extraction_points`,
    so a hand-built point is refused exactly as the same point in a YAML spec
    would be, with the same messages), then what only the router knows: an
    async point inheriting a blocking ``default_policy``, and the probe
    (``probe_type`` in ``registry``, its ``probe_kind``, and its ``probe_args``
    with ``probe_defaults`` merged under them).
    """
    try:
        check_extraction_points(points)
        problems: list[SpecProblem] = []
    except SpecValidationError as error:
        problems = list(error.problems)
    refused = {problem.point_index for problem in problems}
    checked: list[CheckedPoint] = []
    for index, point in enumerate(points):
        if not isinstance(point, ExtractionPoint):
            continue  # the spec check named it
        before = len(problems)
        is_async = point.execution_mode is ExecutionMode.ASYNC
        policy = default_policy if point.intervention is None else point.intervention
        if is_async and point.intervention is None and policy.mode is not InterventionMode.REJECT:
            problems.append(point_problem(
                index, point,
                f"execution_mode 'async' cannot use intervention mode {policy.mode.value!r} "
                "(inherited from the router's default_intervention_policy); async points "
                "never hold up generation, set intervention mode 'reject' on the point",
                "intervention",
            ))
        args = merged_probe_args(probe_defaults or {}, point)
        cls, probe_faults = probe_problems(point, registry, args)
        problems += [point_problem(index, point, message, key) for key, message in probe_faults]
        if len(problems) == before and cls is not None and index not in refused:
            capacity = queue_capacity(point, default_queue_depth) if is_async else None
            checked.append(CheckedPoint(index, point, cls, policy, capacity))
    # point by point (a stable sort: the spec's problems of a point come first)
    problems.sort(key=lambda problem: -1 if problem.point_index is None else problem.point_index)
    return checked, problems


def probe_problems(
    point: ExtractionPoint, registry: ProbeRegistry, args: Mapping[str, Any]
) -> tuple[type | None, list[tuple[str, str]]]:
    """The probe class ``point.probe_type`` names, and what is wrong with the point's
    probe as (field, message) pairs: an unknown ``probe_type`` (with the closest
    known name), a ``probe_kind`` the class does not declare, or ``args`` (its
    probe_args) that the constructor does not take. Builds nothing, so
    ``undercurrent validate`` uses it as well as the router.
    """
    try:
        cls = registry.get(point.probe_type)
    except UnknownProbeError as exc:
        return None, [("probe_type", str(exc))]
    problems: list[tuple[str, str]] = []
    kinds = supported_kinds(cls)
    if point.probe_kind not in kinds:
        declared = " or ".join(kind.value for kind in kinds)
        problems.append((
            "probe_kind",
            f"probe_kind {point.probe_kind.value} does not match probe_type "
            f"{point.probe_type!r}, whose class {cls.__name__} is {declared}",
        ))
    mismatch = probe_args_problem(cls, args)
    if mismatch is not None:
        problems.append((
            "probe_args", f"probe_args for probe_type {point.probe_type!r}: {mismatch}"
        ))
    return cls, problems


def raw_probe_problems(
    raw: Mapping[str, Any], registry: ProbeRegistry, faulted: Collection[str | None] = ()
) -> list[tuple[str, str]]:
    """:func:`probe_problems` of a point given as spec data, which the spec check may
    have refused elsewhere (``faulted`` names the fields it faulted): nothing unless
    ``probe_type`` is a string it did not fault; ``probe_kind`` is checked where it
    is a valid kind it did not fault, ``probe_args`` where they are a mapping it did
    not fault. ``undercurrent validate`` and the spec editor both report a spec's
    probe problems with it, so they say what the router would.
    """
    probe_type = raw.get("probe_type")
    if not isinstance(probe_type, str) or not probe_type.strip() or "probe_type" in faulted:
        return []
    kinds = [kind for kind in ProbeKind if kind.value == raw.get("probe_kind")]
    args = raw.get("probe_args")
    if "probe_args" in faulted or not isinstance(args, Mapping):
        args = {}
    stand_in = types.SimpleNamespace(probe_type=probe_type,
                                     probe_kind=(kinds or [ProbeKind.SINGLE_SHOT])[0])
    _, faults = probe_problems(stand_in, registry, args)  # type: ignore[arg-type]
    return [(field, message) for field, message in faults
            if field != "probe_kind" or (kinds and "probe_kind" not in faulted)]


def queue_capacity(point: ExtractionPoint, default_queue_depth: int) -> int:
    """How many records an async point's queue holds: its ``queue_depth`` (else the
    router's default), but never fewer than one token's records for the point.

    Depth counts records, and one token brings one record per layer, all queued
    in one go before a worker wakes (once per engine step). A queue smaller than
    that would drop part of every token (or, under ``block``, wait inside a single
    token) however fast the probe is.
    """
    return max(point.queue_depth or default_queue_depth, len(point.layers))


def merged_probe_args(
    probe_defaults: Mapping[str, Mapping[str, Any]], point: ExtractionPoint
) -> dict[str, Any]:
    """Router-level defaults for the point's probe_type, overridden by its probe_args."""
    return {**probe_defaults.get(point.probe_type, {}), **point.probe_args}
