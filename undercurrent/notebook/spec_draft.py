"""The spec editor's model, without widgets: point drafts and the text helpers
every draft shares.

A :class:`PointDraft` holds what the user typed for one extraction point, as
plain values. :func:`draft_to_raw` turns it into spec-shaped data, writing only
the fields that apply (``stride``/``until`` for continuous positions,
``queue_depth`` for async points, ``timeout_ms``/``on_timeout`` for
``block_until_signal``); :mod:`undercurrent.notebook.draft_validation` runs the
spec loader itself on the whole draft, so the editor reports exactly what
``parse_dict`` would, attached to the point and field at fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import yaml

from undercurrent.spec import (
    ExtractionPoint,
    SpecValidationError,
    extraction_point_to_dict,
    parse_position,
)
from undercurrent.spec.position import PositionError
from undercurrent.spec.yaml_source import load_yaml_data

DEFAULT_INTERVENTION = ""
"""The intervention choice meaning "no policy in the spec: the router's default"."""


_Draft = TypeVar("_Draft", bound="PositionedDraft")


class PositionedDraft:
    """What every draft (point or edit) with a ``position`` field can say of itself."""

    position: str

    def copy(self: _Draft, **changes: Any) -> _Draft:
        """A copy with ``changes`` applied (drafts are dataclasses)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def position_problem(self) -> str | None:
        """The position parser's own message when ``position`` is invalid, else None."""
        return position_problem(self.position)

    @property
    def continuous(self) -> bool:
        """Whether the position matches many tokens (then ``stride`` applies, and a
        point's ``until``)."""
        return is_continuous(self.position)


@dataclass
class PointDraft(PositionedDraft):
    """One extraction point as edited: plain values, possibly invalid.

    ``layers_text`` is used instead of ``layers`` when the editor has no model to
    bound a multi-select (comma-separated indices). ``queue_depth`` and
    ``probe_args`` are text (empty means "not set").
    """

    name: str = "point"
    layers: tuple[int, ...] = (0,)
    layers_text: str | None = None
    tensor_type: str = "residual_stream"
    position: str = "prompt[-1]"
    stride: int = 1
    until: str = ""
    probe_type: str = "norm_probe"
    probe_kind: str = "single_shot"
    execution_mode: str = "inline"
    queue_depth: str = ""
    intervention_mode: str = DEFAULT_INTERVENTION
    timeout_ms: int = 50
    on_timeout: str = "continue"
    probe_args: str = ""

    @property
    def is_async(self) -> bool:
        """Whether queue_depth applies."""
        return self.execution_mode == "async"

    @property
    def blocks(self) -> bool:
        """Whether timeout_ms / on_timeout apply."""
        return self.intervention_mode == "block_until_signal"


def position_value(text: str) -> int | str:
    """The position as spec data: ``"7"`` -> ``7`` (an absolute index), else the text."""
    stripped = text.strip()
    # (ASCII digits only: "²" and "٣" are digits to str.isdigit, not to the loader)
    return int(stripped) if stripped.isascii() and stripped.isdigit() else text


def position_problem(text: str) -> str | None:
    """The position parser's own message when ``text`` is not a position, else None."""
    try:
        parse_position(position_value(text))
    except PositionError as error:
        return str(error)
    return None


def is_continuous(text: str) -> bool:
    """Whether the position ``text`` matches many tokens (then ``stride`` applies)."""
    try:
        return parse_position(position_value(text)).is_continuous
    except PositionError:
        return False


def raw_layers(layers: tuple[int, ...], layers_text: str | None) -> tuple[Any, str | None]:
    """``layers`` as spec data (one layer as a scalar, as the spec's own YAML writer
    writes it), read from ``layers_text`` when the editor has no model; also the
    message when that text is unusable."""
    message = None
    if layers_text is not None:
        parsed, message = parse_layers_text(layers_text)
    else:
        parsed = list(layers)
    return (parsed[0] if len(parsed) == 1 else parsed), message


def draft_from_point(point: ExtractionPoint) -> PointDraft:
    """The draft that reproduces ``point`` exactly."""
    data = extraction_point_to_dict(point)
    policy = point.intervention
    layers = data["layers"]
    return PointDraft(
        name=point.name,
        layers=tuple(layers) if isinstance(layers, list) else (layers,),
        tensor_type=point.tensor_type.value,
        position=str(data["position"]),
        stride=point.stride,
        until="" if point.until is None else point.until.value,
        probe_type=point.probe_type,
        probe_kind=point.probe_kind.value,
        execution_mode=point.execution_mode.value,
        queue_depth="" if point.queue_depth is None else str(point.queue_depth),
        intervention_mode=DEFAULT_INTERVENTION if policy is None else policy.mode.value,
        timeout_ms=(policy.timeout_ms if policy and policy.timeout_ms else 50),
        on_timeout="continue" if policy is None else policy.on_timeout.value,
        probe_args=_args_text(data.get("probe_args")),
    )


def _args_text(args: Mapping[str, Any] | None) -> str:
    if not args:
        return ""
    return yaml.safe_dump(dict(args), sort_keys=False, default_flow_style=False).strip()


def draft_to_raw(draft: PointDraft) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Spec-shaped data for one draft, plus ``(field, message)`` problems found on the way.

    Those problems are the ones the loader cannot see because the text never
    became data: unreadable layer lists, ``queue_depth`` or ``probe_args``.
    """
    problems: list[tuple[str, str]] = []
    raw: dict[str, Any] = {"name": draft.name}
    raw["layers"], message = raw_layers(draft.layers, draft.layers_text)
    if message:
        problems.append(("layers", message))
    raw["tensor_type"] = draft.tensor_type
    raw["position"] = position_value(draft.position)
    if draft.continuous:
        if draft.stride != 1:
            raw["stride"] = draft.stride
        if draft.until:
            raw["until"] = draft.until
    raw["probe_type"] = draft.probe_type
    raw["probe_kind"] = draft.probe_kind
    if draft.probe_args.strip():
        args, message = _parse_args(draft.probe_args)
        if message:
            problems.append(("probe_args", message))
        elif args:
            raw["probe_args"] = args
    if draft.execution_mode != "inline":
        raw["execution_mode"] = draft.execution_mode
    if draft.is_async and draft.queue_depth.strip():
        depth, message = parse_queue_depth(draft.queue_depth)
        if message:
            problems.append(("queue_depth", message))
        else:
            raw["queue_depth"] = depth
    if draft.intervention_mode != DEFAULT_INTERVENTION:
        policy: dict[str, Any] = {"mode": draft.intervention_mode}
        if draft.blocks:
            policy["timeout_ms"] = draft.timeout_ms
            if draft.on_timeout != "continue":
                policy["on_timeout"] = draft.on_timeout
        raw["intervention"] = policy
    return raw, problems


def parse_queue_depth(text: str) -> tuple[int | None, str | None]:
    """``"16"`` -> ``16``; also returns a message naming the field when the text is unusable."""
    stripped = text.strip()
    try:
        if not stripped.isascii():  # (int() reads "١٦" as 16; the loader does not)
            raise ValueError(stripped)
        depth = int(stripped)
    except ValueError:
        return None, (
            f"queue_depth {stripped!r} is not a whole number; give an integer >= 1, or leave "
            "it empty for the router's default (32)"
        )
    if depth < 1:
        return None, (
            f"queue_depth must be at least 1, got {depth}; leave it empty for the router's "
            "default (32)"
        )
    return depth, None


def parse_layers_text(text: str) -> tuple[list[int], str | None]:
    """``"0, 2,4"`` -> ``[0, 2, 4]``; also returns a message when the text is unusable.

    Every comma-separated entry must be an integer >= 0: an empty entry (``"1,,2"``)
    or an empty text is refused, like anything else that is not a layer index.
    """
    example = "write comma-separated layer indices (integers >= 0), e.g. '0, 2, 4'"
    if not text.strip():
        return [], f"layers is empty; {example}"
    layers: list[int] = []
    for position, part in enumerate(text.split(","), start=1):
        part = part.strip()
        if not part:
            return layers, (
                f"layers {text.strip()!r} has an empty entry at place {position}; {example}"
            )
        if not (part.isascii() and part.isdigit()):
            return layers, f"layers: {part!r} is not a layer index; {example}"
        layers.append(int(part))
    return layers, None


def read_field_yaml(text: str) -> tuple[Any, str | None]:
    """A field's YAML text read as the spec loader reads a spec file (duplicate
    keys, octal and base-60 numbers refused), so the editor accepts exactly what
    the loader would. Returns the data, or ``None`` and the loader's message."""
    try:
        return load_yaml_data(text), None
    except SpecValidationError as error:
        return None, "; ".join(problem.message for problem in error.problems)


def ascii_float(text: str) -> float:
    """``float(text)`` for a number written in ASCII digits only; raises ``ValueError``
    otherwise (``float`` reads "١" as 1.0; the spec loader does not)."""
    if not text.isascii():
        raise ValueError(text)
    return float(text)


def _parse_args(text: str) -> tuple[dict[str, Any] | None, str | None]:
    data, message = read_field_yaml(text)
    if message:
        return None, f"{message}; write one 'key: value' per line"
    if data is None:
        return None, None
    if not isinstance(data, dict):
        return None, (
            f"must be a mapping of argument names to values ('key: value' lines), got "
            f"{type(data).__name__}"
        )
    return data, None
