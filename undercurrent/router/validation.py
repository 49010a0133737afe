"""Registration-time checks: what the router re-verifies on every request.

Hand-built :class:`~undercurrent.spec.types.ExtractionPoint` objects skip the
spec parser, so the router checks again everything that would let a point
misbehave at run time, and reports every problem at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from undercurrent.probes.base import probe_args_problem, supported_kinds
from undercurrent.probes.registry import ProbeRegistry, UnknownProbeError
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


def where(index: int, point: Any) -> str:
    """How messages name a point: ``extraction point 'name' (index i)``."""
    name = getattr(point, "name", None)
    return f"extraction point {name!r} (index {index})" if name else f"extraction point {index}"


def normalise_policy(policy: InterventionPolicy) -> InterventionPolicy:
    """The same policy with enum fields (hand-built ones may hold plain strings).

    Raises ValueError naming the allowed values for an unknown mode or on_timeout.
    """
    try:
        mode = InterventionMode(policy.mode)
    except ValueError:
        allowed = ", ".join(m.value for m in InterventionMode)
        raise ValueError(
            f"intervention mode must be one of {allowed}, got {policy.mode!r}"
        ) from None
    try:
        on_timeout = OnTimeout(policy.on_timeout)
    except ValueError:
        allowed = ", ".join(o.value for o in OnTimeout)
        raise ValueError(
            f"intervention on_timeout must be one of {allowed}, got {policy.on_timeout!r}"
        ) from None
    return InterventionPolicy(mode=mode, timeout_ms=policy.timeout_ms, on_timeout=on_timeout)


def _policy_problems(label: str, policy: InterventionPolicy, inherited: bool) -> list[str]:
    origin = " (inherited from the router's default_intervention_policy)" if inherited else ""
    problems: list[str] = []
    if policy.mode is InterventionMode.BLOCK_UNTIL_SIGNAL:
        timeout = policy.timeout_ms
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            problems.append(
                f"{label}: intervention block_until_signal{origin} needs timeout_ms, an int "
                f">= 1 (got {timeout!r})"
            )
    else:
        if policy.timeout_ms is not None:
            problems.append(
                f"{label}: intervention reject{origin} takes no timeout_ms "
                f"(got {policy.timeout_ms!r}); use mode block_until_signal to wait on the probe"
            )
        if policy.on_timeout is not OnTimeout.CONTINUE:
            problems.append(
                f"{label}: intervention reject{origin} only allows on_timeout 'continue'"
            )
    return problems


def check_points(
    points: Iterable[Any],
    registry: ProbeRegistry,
    default_policy: InterventionPolicy,
    default_queue_depth: int,
    probe_defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[CheckedPoint], list[str]]:
    """Check a request's points; returns (the points that passed, every problem).

    ``probe_defaults`` (the router's) are merged under each point's probe_args
    before those are checked against the probe's constructor.
    """
    checked: list[CheckedPoint] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for index, point in enumerate(points):
        label = where(index, point)
        if not isinstance(point, ExtractionPoint):
            problems.append(
                f"{label}: expected an ExtractionPoint, got {type(point).__name__}"
            )
            continue
        before = len(problems)
        if point.name in seen:
            problems.append(f"{label}: duplicate name, also used by index {seen[point.name]}")
        seen.setdefault(point.name, index)
        is_async = point.execution_mode is ExecutionMode.ASYNC
        if is_async and point.probe_kind is ProbeKind.SINGLE_SHOT:
            problems.append(
                f"{label}: execution_mode async needs probe_kind trajectory; a single_shot "
                "probe has no state to carry off the hot path (use execution_mode inline)"
            )
        inherited = point.intervention is None
        try:
            policy = (
                default_policy
                if point.intervention is None
                else normalise_policy(point.intervention)
            )
        except ValueError as exc:
            problems.append(f"{label}: {exc}")
            policy = InterventionPolicy()
        problems += _policy_problems(label, policy, inherited)
        if is_async and policy.mode is not InterventionMode.REJECT:
            origin = " (inherited from the router's default)" if inherited else ""
            problems.append(
                f"{label}: execution_mode async cannot use intervention "
                f"{policy.mode.value}{origin}; async points never hold up generation, "
                "set intervention mode reject"
            )
        depth = point.queue_depth
        if depth is not None:
            if not is_async:
                problems.append(f"{label}: queue_depth is only valid with execution_mode async")
            elif isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
                problems.append(f"{label}: queue_depth must be an int >= 1, got {depth!r}")
        args = merged_probe_args(probe_defaults or {}, point)
        cls, probe_faults = probe_problems(point, registry, args)
        problems += [f"{label}: {message}" for _, message in probe_faults]
        if len(problems) == before and cls is not None:
            capacity = queue_capacity(point, default_queue_depth) if is_async else None
            checked.append(CheckedPoint(index, point, cls, policy, capacity))
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
