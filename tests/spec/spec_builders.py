"""Small builders shared by the spec tests: valid raw points and specs to vary."""

from __future__ import annotations

from typing import Any

from undercurrent.spec import ProbeSpec, SpecValidationError, parse_dict


def raw_point(**changes: Any) -> dict[str, Any]:
    """The seed's minimal extraction point as raw data, with ``changes`` applied.

    A change whose value is ``DROP`` removes that key.
    """
    point: dict[str, Any] = {
        "name": "last_prompt_token_probe",
        "layers": 12,
        "tensor_type": "residual_stream",
        "position": "prompt[-1]",
        "probe_type": "linear_probe",
        "probe_kind": "single_shot",
        "execution_mode": "inline",
    }
    for key, value in changes.items():
        if value is DROP:
            point.pop(key, None)
        else:
            point[key] = value
    return point


DROP = object()

TRAJECTORY = {"position": "generated[*]", "probe_kind": "trajectory"}
"""Changes that make :func:`raw_point` a continuous trajectory point."""


def raw_spec(*points: dict[str, Any], **top: Any) -> dict[str, Any]:
    """A raw spec with ``points`` (the minimal point when none are given)."""
    return {"version": "1", "extraction_points": list(points) or [raw_point()], **top}


def parse_point(**changes: Any) -> ProbeSpec:
    """Parse a one-point spec built from :func:`raw_point` with ``changes``."""
    return parse_dict(raw_spec(raw_point(**changes)))


def problems_of(data: Any) -> list[tuple[int | None, str | None, str]]:
    """``(point index, field, message)`` for each problem ``parse_dict(data)`` raises."""
    try:
        parse_dict(data)
    except SpecValidationError as error:
        return [(p.point_index, p.field, p.message) for p in error.problems]
    raise AssertionError("expected SpecValidationError, but the spec parsed")


def fields_at_fault(data: Any) -> list[str | None]:
    """Just the fields named by the problems ``parse_dict(data)`` raises."""
    return [field for _, field, _ in problems_of(data)]
