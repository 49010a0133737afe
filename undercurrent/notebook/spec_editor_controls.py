"""The spec editor's controls, built from the spec's own field tables.

Each row of :func:`undercurrent.spec.fields.point_fields` and
:func:`~undercurrent.spec.fields.edit_fields` becomes one control, in the
schema's order, labelled with the key's YAML path and with the schema's
documentation of the key as its tooltip: a dropdown for a choice (the schema's
choices, "(not set)" first when the key may be left out), a multi-select (with a
model) or a text for ``layers``, a checkbox for a boolean, a bounded box for a
positive integer, a text area for a mapping, and a text field otherwise. The
editor passes the few controls whose choices come from elsewhere (the probe
registry, the spec's own points) or that offer "the router's default".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from undercurrent.notebook.spec_editor_text import LABELS
from undercurrent.spec.fields import SpecField, edit_fields, point_fields

_NAMES = {path: name for name, path in LABELS.items()}


def editor_name(path: str) -> str:
    """The editor's name of a spec key: ``intervention.mode`` -> ``intervention_mode``
    (the name of the control in ``editor.fields`` and of the draft's attribute)."""
    return _NAMES.get(path, path)


FIELDS: tuple[str, ...] = tuple(editor_name(field.path) for field in point_fields())
"""The point form's fields, in display order (``editor.fields[name]`` is the control)."""

EDIT_FIELDS: tuple[str, ...] = tuple(editor_name(field.path) for field in edit_fields())
"""The edit form's fields, in display order (``editor.edit_fields[name]`` is the control)."""

NOT_SET = ""
"""The value of a dropdown's "(not set)" choice: the key is left out of the spec."""

_PLACEHOLDERS = {
    "layers": "e.g. 0, 2, 4",
    "position": "prompt[-1], generated[*]",
    "probe_args": "key: value (YAML), e.g.\nthreshold: 0.5",
    "queue_depth": "32 (router default)",
    "vector": "0.5, -1, 2  or  path/to/vector.safetensors",
    "vector_key": "(the file's only 1-D array)",
    "coefficient": "1.0",
}


def help_text(doc: str) -> str:
    """A schema docstring as plain tooltip text (``code`` marks dropped, one line)."""
    return re.sub(r"\s+", " ", doc.replace("``", "")).strip()


def build_controls(w: Any, table: tuple[SpecField, ...], capabilities: Any,
                   given: Mapping[str, Any]) -> dict[str, Any]:
    """One control per field of ``table``, keyed by editor name, in table order;
    ``given`` supplies the controls built elsewhere."""
    controls: dict[str, Any] = {}
    for field in table:
        name = editor_name(field.path)
        control = given[name] if name in given else _control(w, field, name, capabilities)
        control.description = field.path
        control.tooltip = help_text(field.doc)
        controls[name] = control
    return controls


def _control(w: Any, field: SpecField, name: str, capabilities: Any) -> Any:
    if field.kind == "mapping":
        return w.Textarea(placeholder=_PLACEHOLDERS.get(name, ""),
                          layout=w.Layout(width="380px", height="70px"))
    wide = w.Layout(width="380px")
    if field.kind == "layers" and capabilities is not None:
        return w.SelectMultiple(rows=5, layout=wide)
    if field.kind == "choice":
        choices = list(field.choices)
        if field.path == "tensor_type" and capabilities is not None:
            supported = {t.value for t in capabilities.tensor_types}
            choices = [choice for choice in choices if choice in supported]
        if field.optional and field.default is None:
            return w.Dropdown(options=[("(not set)", NOT_SET)]
                              + [(choice, choice) for choice in choices], layout=wide)
        return w.Dropdown(options=choices, layout=wide)
    if field.kind == "boolean":
        return w.Checkbox(indent=True, layout=wide)
    if field.kind == "integer" and not field.optional:
        return w.IntText(value=1, layout=wide)
    return w.Text(placeholder=_PLACEHOLDERS.get(name, ""), layout=wide)
