"""The spec editor's model of one edit (spec version "2"), without widgets.

An :class:`EditDraft` holds what the user typed for one edit, as plain values.
:func:`edit_draft_to_raw` turns it into spec-shaped data, writing only the fields
that apply (``stride`` for continuous positions, ``vector_key`` for a vector
file, ``norm_match`` for ``op: add``, ``when.action`` when ``when.point`` is
set). Text is only turned into data here; whether that data is a valid edit is
the spec loader's call (see :mod:`undercurrent.notebook.draft_validation`).

``vector`` is one text field: comma-separated numbers (``0.5, -1, 2``), a file
path (``probe.safetensors``, ``undercurrent:models/tiny/probe.safetensors``), or
an SAE feature written as ``{sae: FOLDER, feature: INDEX}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from undercurrent.notebook.spec_draft import (
    PositionedDraft,
    ascii_float,
    position_value,
    raw_layers,
    read_field_yaml,
)
from undercurrent.spec import Edit, SaeFeature, edit_to_dict


@dataclass
class EditDraft(PositionedDraft):
    """One edit as edited: plain values, possibly invalid.

    ``layers_text`` replaces ``layers`` when the editor has no model (as for
    points). ``vector`` and ``coefficient`` are text (see the module docstring);
    an empty ``coefficient`` means the default, 1.0. ``when_point`` empty means
    the edit is always on.
    """

    name: str = "edit"
    layers: tuple[int, ...] = (0,)
    layers_text: str | None = None
    tensor_type: str = "residual_stream"
    position: str = "generated[*]"
    stride: int = 1
    op: str = "add"
    vector: str = ""
    vector_key: str = ""
    coefficient: str = "1.0"
    norm_match: bool = False
    when_point: str = ""
    when_action: str = "flag"

    @property
    def vector_is_file(self) -> bool:
        """Whether ``vector`` names a file (then ``vector_key`` applies)."""
        value, _ = parse_vector_text(self.vector)
        return isinstance(value, str) and bool(value)

    @property
    def adds(self) -> bool:
        """Whether the op is ``add`` (then ``norm_match`` applies)."""
        return self.op == "add"

    @property
    def triggered(self) -> bool:
        """Whether ``when`` is set (then ``when.action`` applies)."""
        return bool(self.when_point)


def format_vector(vector: tuple[float, ...] | str | SaeFeature) -> str:
    """An edit's vector as the editor's text; :func:`parse_vector_text` reads it back
    to an equal value (``repr`` keeps every float exact)."""
    if isinstance(vector, str):
        return vector
    if isinstance(vector, SaeFeature):
        return f"{{sae: {json.dumps(vector.sae)}, feature: {vector.feature}}}"
    return ", ".join(repr(float(item)) for item in vector)


def parse_vector_text(text: str) -> tuple[Any, str | None]:
    """The vector text as spec data: a list of floats when every comma-separated
    item is a number (``[...]`` around them is allowed), a mapping for
    ``{sae: ..., feature: ...}``, else the text as a file path. Also returns a
    message when a ``{...}`` text is not readable YAML.

    >>> parse_vector_text("0.5, -1, 2")
    ([0.5, -1.0, 2.0], None)
    >>> parse_vector_text(" undercurrent:models/tiny/probe.safetensors ")
    ('undercurrent:models/tiny/probe.safetensors', None)
    """
    stripped = text.strip()
    if stripped.startswith("{"):
        data, message = read_field_yaml(stripped)
        if message:
            return None, (f"vector {stripped!r} is not readable ({message}); write an SAE "
                          'feature as {sae: "FOLDER", feature: INDEX}')
        return data, None
    inner = stripped[1:-1] if stripped.startswith("[") and stripped.endswith("]") else stripped
    try:
        return [ascii_float(item.strip()) for item in inner.split(",")], None
    except ValueError:
        return stripped, None


def parse_coefficient_text(text: str) -> Any:
    """The coefficient as spec data: a float when the text is a number, None when it
    is empty (the default), else the text itself, for the loader to refuse by name."""
    stripped = text.strip()
    if not stripped:
        return None
    try:
        return ascii_float(stripped)
    except ValueError:
        return stripped


def draft_from_edit(edit: Edit) -> EditDraft:
    """The draft that reproduces ``edit`` exactly."""
    data = edit_to_dict(edit)
    return EditDraft(
        name=edit.name,
        layers=tuple(edit.layers),
        tensor_type=edit.tensor_type.value,
        position=str(data["position"]),
        stride=edit.stride,
        op=edit.op.value,
        vector=format_vector(edit.vector),
        vector_key=edit.vector_key or "",
        coefficient=repr(edit.coefficient),
        norm_match=edit.norm_match,
        when_point="" if edit.when is None else edit.when.point,
        when_action="flag" if edit.when is None else edit.when.action.value,
    )


def edit_draft_to_raw(draft: EditDraft) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Spec-shaped data for one edit draft, plus ``(field, message)`` problems of text
    that never became data (an unreadable layer list or ``{...}`` vector)."""
    problems: list[tuple[str, str]] = []
    raw: dict[str, Any] = {"name": draft.name}
    raw["layers"], message = raw_layers(draft.layers, draft.layers_text)
    if message:
        problems.append(("layers", message))
    raw["tensor_type"] = draft.tensor_type
    raw["position"] = position_value(draft.position)
    if draft.continuous and draft.stride != 1:
        raw["stride"] = draft.stride
    raw["op"] = draft.op
    raw["vector"], message = parse_vector_text(draft.vector)
    if message:
        problems.append(("vector", message))
    if draft.vector_is_file and draft.vector_key:
        raw["vector_key"] = draft.vector_key
    coefficient = parse_coefficient_text(draft.coefficient)
    if coefficient is not None and coefficient != 1.0:
        raw["coefficient"] = coefficient
    if draft.adds and draft.norm_match:
        raw["norm_match"] = True
    if draft.triggered:
        raw["when"] = {"point": draft.when_point, "action": draft.when_action}
    return raw, problems
