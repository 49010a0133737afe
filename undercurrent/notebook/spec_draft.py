"""The spec editor's model, without widgets: point drafts and their validation.

A :class:`PointDraft` holds what the user typed for one extraction point, as
plain values. :func:`drafts_to_raw` turns drafts into spec-shaped data,
writing only the fields that apply (``stride``/``until`` for continuous
positions, ``queue_depth`` for async points, ``timeout_ms``/``on_timeout`` for
``block_until_signal``), and :func:`validate_drafts` runs the spec loader itself
on it, so the editor reports exactly what ``parse_dict`` would, attached to the
point and field at fault.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from undercurrent.spec import (
    ExtractionPoint,
    ProbeSpec,
    SpecProblem,
    SpecValidationError,
    extraction_point_to_dict,
    parse_dict,
    parse_position,
)
from undercurrent.spec.position import PositionError

DEFAULT_INTERVENTION = ""
"""The intervention choice meaning "no policy in the spec: the router's default"."""


@dataclass
class PointDraft:
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

    def copy(self, **changes: Any) -> PointDraft:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def position_problem(self) -> str | None:
        """The position parser's own message when ``position`` is invalid, else None."""
        try:
            parse_position(_position_value(self.position))
        except PositionError as error:
            return str(error)
        return None

    @property
    def continuous(self) -> bool:
        """Whether the position matches many tokens (then stride/until apply)."""
        try:
            return parse_position(_position_value(self.position)).is_continuous
        except PositionError:
            return False

    @property
    def is_async(self) -> bool:
        """Whether queue_depth applies."""
        return self.execution_mode == "async"

    @property
    def blocks(self) -> bool:
        """Whether timeout_ms / on_timeout apply."""
        return self.intervention_mode == "block_until_signal"


def _position_value(text: str) -> int | str:
    stripped = text.strip()
    return int(stripped) if stripped.isdigit() else text


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
    if draft.layers_text is not None:
        layers, message = parse_layers_text(draft.layers_text)
        if message:
            problems.append(("layers", message))
    else:
        layers = list(draft.layers)
    # One layer is written as a scalar, as the spec's own YAML writer does.
    raw["layers"] = layers[0] if len(layers) == 1 else layers
    raw["tensor_type"] = draft.tensor_type
    raw["position"] = _position_value(draft.position)
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
        if not part.isdigit():
            return layers, f"layers: {part!r} is not a layer index; {example}"
        layers.append(int(part))
    return layers, None


def _parse_args(text: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return None, f"not valid YAML ({first}); write one 'key: value' per line"
    if data is None:
        return None, None
    if not isinstance(data, dict):
        return None, (
            f"must be a mapping of argument names to values ('key: value' lines), got "
            f"{type(data).__name__}"
        )
    return data, None


def drafts_to_raw_spec(drafts: Sequence[PointDraft]) -> tuple[dict[str, Any], list[SpecProblem]]:
    """The whole spec as data, plus the problems ``draft_to_raw`` found per point."""
    points: list[dict[str, Any]] = []
    problems: list[SpecProblem] = []
    for index, draft in enumerate(drafts):
        raw, found = draft_to_raw(draft)
        points.append(raw)
        problems += [SpecProblem(message, field, index, draft.name) for field, message in found]
    return {"version": "1", "extraction_points": points}, problems


def validate_drafts(
    drafts: Sequence[PointDraft], capabilities: Any = None
) -> tuple[ProbeSpec | None, list[SpecProblem]]:
    """``(spec, problems)``: the spec when every draft is valid, and every problem found.

    Problems come from the drafts' text, the spec loader, the probe registry (an
    unknown ``probe_type``, or a ``probe_kind`` the probe does not support) and,
    when ``capabilities`` is given, the loaded model's tensor types and layers.
    Deprecation warnings from the loader are swallowed: the editor writes new keys.
    """
    raw_spec, problems = drafts_to_raw_spec(drafts)
    # A field whose text never became data has its own message; the loader's view of
    # the placeholder left there ("an empty list") would only repeat it without a subject.
    unreadable = {(problem.point_index, problem.field) for problem in problems}
    spec: ProbeSpec | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            spec = parse_dict(raw_spec)
        except SpecValidationError as error:
            problems += [problem for problem in error.problems
                         if (problem.point_index, problem.field) not in unreadable]
    problems += _registry_problems(drafts)
    if spec is not None and capabilities is not None:
        problems += _capability_problems(spec, capabilities)
    return (spec if not problems else None), problems


def _registry_problems(drafts: Sequence[PointDraft]) -> list[SpecProblem]:
    try:
        from undercurrent.probes import get_probe, list_probes, supported_kinds
    except ImportError:  # pragma: no cover - probes package missing
        return []
    known = list_probes()
    found: list[SpecProblem] = []
    for index, draft in enumerate(drafts):
        if not draft.probe_type or draft.probe_type not in known:
            if draft.probe_type:
                found.append(SpecProblem(
                    f"no probe registered as {draft.probe_type!r}; registered: "
                    f"{', '.join(known)}", "probe_type", index, draft.name,
                ))
            continue
        kinds = [kind.value for kind in supported_kinds(get_probe(draft.probe_type))]
        if draft.probe_kind in ("single_shot", "trajectory") and draft.probe_kind not in kinds:
            found.append(SpecProblem(
                f"{draft.probe_type!r} does not run as {draft.probe_kind!r}; it supports "
                f"{', '.join(kinds)}", "probe_kind", index, draft.name,
            ))
    return found


def _capability_problems(spec: ProbeSpec, capabilities: Any) -> list[SpecProblem]:
    found: list[SpecProblem] = []
    for index, point in enumerate(spec):
        valid = tuple(capabilities.valid_layers(point.tensor_type))
        if not valid:
            supported = ", ".join(t.value for t in capabilities.tensor_types)
            found.append(SpecProblem(
                f"the loaded model's backend does not capture {point.tensor_type.value!r} "
                f"(it captures: {supported})", "tensor_type", index, point.name,
            ))
            continue
        bad = [layer for layer in point.layers if layer not in valid]
        if bad:
            found.append(SpecProblem(
                f"layer(s) {bad} out of range for {point.tensor_type.value} on the loaded model "
                f"(valid: {valid[0]}..{valid[-1]})", "layers", index, point.name,
            ))
    return found
