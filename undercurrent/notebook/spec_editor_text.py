"""What the spec editor says: field labels, problem messages, and the HTML it shows.

Kept apart from the widgets: the same functions fill the live form and the static
snapshot a stored notebook keeps, and tests read them without a browser.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from undercurrent.spec import SpecProblem

LABELS: dict[str, str] = {
    "intervention_mode": "intervention.mode",
    "timeout_ms": "intervention.timeout_ms",
    "on_timeout": "intervention.on_timeout",
    "when_point": "when.point",
    "when_action": "when.action",
}
"""Field labels that differ from the field name: the key's path in the YAML."""

LAYERS_HINT = "Ctrl-click (⌘-click on a Mac) or Shift-click to pick several layers"

# Loader messages that start with a verb lean on the location for their subject.
_SUBJECTLESS = ("is ", "are ", "must ", "should ", "has ", "have ", "cannot ", "needs ", "may ",
                "names ", "holds ")

_ERROR = "color:#b00020"


def with_subject(problem: SpecProblem) -> str:
    """The problem's message, led by its field when it starts with a bare verb
    (the loader's "is an empty list" reads "layers is an empty list")."""
    message = problem.message
    if problem.field and message.startswith(_SUBJECTLESS):
        return f"{problem.field} {message}"
    return message


def describe_problem(problem: SpecProblem, names: Sequence[str]) -> str:
    """``point 'name' · field: message`` (``edit 'name' · ...`` for an edit), named as
    the user named it (``names`` are the names in the problem's section, in order)."""
    if problem.point_index is None:
        where = "spec"
    else:
        index = problem.point_index
        noun = "edit" if problem.section == "edits" else "point"
        name = problem.point_name or (names[index] if 0 <= index < len(names) else "")
        where = f"{noun} {name!r}" if name else f"{noun} {index + 1} (unnamed)"
    field = "" if problem.field is None else f" · {problem.field}"
    return f"{where}{field}: {with_subject(problem)}"


def field_messages_html(messages: Sequence[str]) -> str:
    """The messages shown next to one field, one per line."""
    return "".join(
        f'<div style="{_ERROR};font-size:90%;line-height:1.3">⚠ '
        f"{html.escape(message, quote=False)}</div>"
        for message in messages
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"


def status_html(points: int | None, problems: int, others: Sequence[str],
                edits: int = 0) -> str:
    """Under the form: ✔ and the number of points (and edits, with the version they
    need) when valid (``points`` given), else the number of problems and, one per
    line, those of the points and edits not on screen."""
    if points is not None:
        with_edits = f", {_count(edits, 'edit')} (version \"2\")" if edits else ""
        return (f'<span style="color:#1b7f3b">✔ valid spec: '
                f'{_count(points, "extraction point")}{with_edits}</span>')
    listing = "".join(
        f'<div style="margin-left:1em">{html.escape(line, quote=False)}</div>' for line in others
    )
    return (
        f'<div style="{_ERROR}">⚠ {problems} problem{"s" if problems != 1 else ""}'
        + (" (those of the point and edit on screen are shown next to their fields; "
           "others:)" if listing else "")
        + f"{listing}</div>"
    )


def yaml_html(text: str) -> str:
    """The YAML view."""
    return (
        '<pre style="background:#f6f8fa;padding:8px;border-radius:4px;margin:0;'
        'line-height:1.35;font-size:12px;white-space:pre">'
        f"{html.escape(text)}</pre>"
    )


def edits_hint_html(edits: int) -> str:
    """The line above the edits' form: what edits are, and the version they make."""
    if edits:
        text = ('<b>Edits</b>: live activation edits (the spec is version "2"); see '
                "docs/steering.md")
    else:
        text = ('<b>Edits</b>: none, so the spec is version "1". <b>Add</b> one to change '
                'activations live during generation (the spec becomes version "2").')
    return (f'<div style="margin-top:10px;padding-top:6px;border-top:1px solid #ddd">'
            f"{text}</div>")


def section_snapshot_html(title: str, names: Sequence[str],
                          rows: Sequence[tuple[str, str, Sequence[str]]]) -> str:
    """One section of the static editor (the points, or the edits): the names in its
    list, then the selected one's ``(label, value, messages)`` rows."""
    cells = []
    for label, value, messages in rows:
        shown = (f"<code>{html.escape(value)}</code>" if value.strip()
                 else '<span style="color:#999">(empty)</span>')
        notes = "".join(f'<div style="{_ERROR}">⚠ {html.escape(m, quote=False)}</div>'
                        for m in messages)
        cells.append(
            '<tr><td style="text-align:right;padding-right:8px;color:#555">'
            f'{html.escape(label)}</td><td style="text-align:left">{shown}{notes}</td></tr>'
        )
    listed = ", ".join(html.escape(name or "(unnamed)") for name in names)
    return (f"<div><b>{html.escape(title)}:</b> {listed}</div>"
            f'<table style="border-collapse:collapse">{"".join(cells)}</table>')


def form_snapshot_html(sections: Sequence[str], status: str, yaml_view: str) -> str:
    """The editor as static HTML: its sections (:func:`section_snapshot_html`), the
    status line and the YAML view."""
    return (
        '<div class="undercurrent-spec-editor-snapshot">'
        f"{''.join(sections)}{status}<div><b>YAML</b></div>{yaml_view}</div>"
    )
