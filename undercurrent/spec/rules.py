"""Rules that tie several fields of one extraction point together.

The loader applies them to raw specs, and :func:`check_extraction_point` applies
the very same rules to a hand-built :class:`ExtractionPoint` (the router calls it
at registration, so a point that skipped the parser still cannot break them).

Rules read two things: ``given``, the keys the spec set (flattened, so
``intervention.mode``), and ``values``, the resolved value of each key that was
valid. A rule whose inputs were invalid stays silent: that field already has its
own problem, and guessing would only add noise.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from undercurrent.spec.messages import did_you_mean
from undercurrent.spec.types import (
    EditOp,
    EditTrigger,
    ExecutionMode,
    ExtractionPoint,
    InterventionMode,
    OnTimeout,
    ProbeKind,
)

_UNKNOWN = object()

_DEFAULTS: dict[str, Any] = {
    "execution_mode": ExecutionMode.INLINE,
    "intervention.mode": InterventionMode.REJECT,
    "intervention.on_timeout": OnTimeout.CONTINUE,
}


def point_rule_problems(values: Mapping[str, Any], given: Collection[str]) -> list[tuple[str, str]]:
    """Problems as ``(key, message)`` pairs, in a stable order."""

    def value(key: str) -> Any:
        if key in values:
            return values[key]
        if key in given:
            return _UNKNOWN  # set, but invalid
        return _DEFAULTS.get(key)

    problems: list[tuple[str, str]] = []
    mode = value("execution_mode")
    kind = value("probe_kind")
    if mode is ExecutionMode.ASYNC and kind is ProbeKind.SINGLE_SHOT:
        problems.append(
            (
                "execution_mode",
                "execution_mode 'async' needs probe_kind 'trajectory'; a single_shot probe "
                "has no state to carry across tokens, so run it with execution_mode 'inline'",
            )
        )
    if "queue_depth" in given and mode not in (ExecutionMode.ASYNC, _UNKNOWN):
        problems.append(
            (
                "queue_depth",
                "queue_depth only applies with execution_mode 'async'; remove it or set "
                "execution_mode: async",
            )
        )
    position = value("position")
    if position is not None and position is not _UNKNOWN and not position.is_continuous:
        for key in ("stride", "until"):
            if key in given:
                problems.append(
                    (
                        key,
                        f"{key} only applies to a continuous position (generated[*], "
                        f"generated[a:], generated[a:b]); position {position} matches a "
                        "single token",
                    )
                )
    if "intervention" in given:
        problems += _intervention_problems(value, mode, given)
    return problems


def _intervention_problems(
    value: Any, execution_mode: Any, given: Collection[str]
) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    mode = value("intervention.mode")
    if execution_mode is ExecutionMode.ASYNC and mode not in (InterventionMode.REJECT, _UNKNOWN):
        problems.append(
            (
                "intervention.mode",
                f"intervention mode {mode.value!r} is not allowed with execution_mode "
                "'async' (async points never hold up generation); use mode 'reject' or "
                "execution_mode 'inline'",
            )
        )
    if mode is InterventionMode.BLOCK_UNTIL_SIGNAL and "intervention.timeout_ms" not in given:
        problems.append(
            (
                "intervention.timeout_ms",
                "is required with mode 'block_until_signal': how many milliseconds "
                "generation may wait for the probe (an integer >= 1)",
            )
        )
    if mode is InterventionMode.REJECT:
        if "intervention.timeout_ms" in given:
            problems.append(
                (
                    "intervention.timeout_ms",
                    "is not allowed with mode 'reject' (reject never waits on a deadline); "
                    "remove it or use mode 'block_until_signal'",
                )
            )
        if value("intervention.on_timeout") is OnTimeout.ABORT:
            problems.append(
                (
                    "intervention.on_timeout",
                    "on_timeout 'abort' needs mode 'block_until_signal' (under 'reject' "
                    "there is no deadline to miss); remove it or change the mode",
                )
            )
    return problems


def edit_rule_problems(values: Mapping[str, Any], given: Collection[str]) -> list[tuple[str, str]]:
    """Problems of one edit's fields taken together, as ``(key, message)`` pairs."""
    problems: list[tuple[str, str]] = []
    position = values.get("position")
    if "stride" in given and position is not None and not position.is_continuous:
        problems.append(
            (
                "stride",
                "stride only applies to a continuous position (generated[*], generated[a:], "
                f"generated[a:b]); position {position} matches a single token",
            )
        )
    op = values.get("op")
    if values.get("norm_match") and op is not None and op is not EditOp.ADD:
        problems.append(
            (
                "norm_match",
                f"norm_match only applies to op 'add' (op {op.value!r} uses the unit "
                "direction of the vector); remove it or use op: add",
            )
        )
    vector = values.get("vector")
    if "vector_key" in given and vector is not None and not isinstance(vector, str):
        what = "a list of numbers" if isinstance(vector, tuple) else "an SAE feature"
        problems.append(
            (
                "vector_key",
                f"vector_key picks an array in a vector file, but vector is {what}; "
                "remove vector_key or give vector as a .safetensors/.npz path",
            )
        )
    return problems


def trigger_problems(
    trigger: EditTrigger,
    point_names: Collection[str],
    points: Mapping[str, ExtractionPoint],
) -> list[str]:
    """Why an edit's ``when`` cannot be served by the spec's extraction points.

    ``point_names`` are every point name the spec declares; ``points`` the points
    that resolved (a point with its own problems is not judged again here).
    """
    if trigger.point not in point_names:
        known = ", ".join(sorted(point_names)) or "none"
        return [
            f"names no extraction point: {trigger.point!r}"
            f"{did_you_mean(trigger.point, point_names)}; the spec's points are: {known}"
        ]
    point = points.get(trigger.point)
    if point is not None and point.execution_mode is ExecutionMode.ASYNC:
        return [
            f"extraction point {trigger.point!r} runs async, and async points only observe: "
            "their signals arrive off the generation path, too late to switch an edit on at "
            "a known token; make it execution_mode: inline"
        ]
    return []
