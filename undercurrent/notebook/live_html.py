"""The live view's HTML: progress header with the shading key, request lines, abort messages.

Pure functions of what :mod:`undercurrent.notebook.live_state` holds, so the same
text fills the live widgets and the static snapshot a stored notebook keeps.
"""

from __future__ import annotations

import html
from collections.abc import Iterable

from undercurrent.notebook.live_state import RequestTrace

SHADE = "214,39,40"
"""RGB of the token shading; the alpha grows with the score."""

ABORT_OUTLINE = "outline:2px solid #b00020;"


def shade(level: float) -> str:
    """The background of a token whose score sits at ``level`` (0..1) of the scale."""
    return f"rgba({SHADE},{0.08 + 0.8 * level:.2f})"


def key_html(scale: tuple[float, float], point: str | None) -> str:
    """What the colours mean: the scale of ``point``'s score, and the abort outline."""
    low, high = scale
    name = "" if point is None else f" of <code>{html.escape(point)}</code>"
    return (
        '<span style="color:#555">token colour = score' + name + ": "
        f'<span style="font-family:monospace">{low:g}</span> '
        f'<span style="display:inline-block;width:120px;height:0.9em;vertical-align:middle;'
        f'border-radius:3px;background:linear-gradient(to right,{shade(0)},{shade(1)})">'
        f'</span> <span style="font-family:monospace">{high:g}</span>'
        f' · <span style="{ABORT_OUTLINE}border-radius:3px;padding:0 2px">token'
        "</span> = where a probe aborted</span>"
    )


def header_html(progress: str, scale: tuple[float, float], point: str | None) -> str:
    """The progress line (``prompt 2/6 · token 17/32 · 1 aborted``) beside the key."""
    return (
        '<div style="display:flex;flex-wrap:wrap;gap:4px 24px;align-items:center;'
        'margin-bottom:4px"><b class="uc-progress">'
        f"{html.escape(progress)}</b>{key_html(scale, point)}</div>"
    )


def request_line_html(trace: RequestTrace, scale: tuple[float, float],
                      point: str | None) -> str:
    """One request: label, prompt, generated tokens shaded by ``point``'s score (hover
    shows it), the aborting token outlined, and a ✖ mark that never wraps alone."""
    low, high = scale
    abort_at = None if trace.abort is None else trace.abort.generated_index
    spans = []
    for index, piece in enumerate(trace.pieces):
        score = trace.score_of(index, point)
        # Line ends are drawn, not broken: an HTML reader turns a CR (or CR LF) into
        # a line break of its own.
        shown = html.escape(piece, quote=False).replace("\r", "␍").replace("\n", "↵")
        if score is None:
            style, title = "", f"token {index}: no score"
        else:
            level = min(max((score - low) / (high - low), 0.0), 1.0)
            style = f"background:{shade(level)};"
            title = f"token {index}: score {score:.3f}"
        if index == abort_at:
            style += ABORT_OUTLINE
            title += " (abort)"
        if index in getattr(trace, "steered", ()):
            style += "border-bottom:2px solid #1f77b4;"  # sampled under a live edit
            title += " (steered)"
        spans.append(
            f'<span class="uc-token" data-score="{"" if score is None else f"{score:.6f}"}" '
            f'title="{html.escape(title)}" style="{style}border-radius:3px">{shown}</span>'
        )
    marker = ""
    if trace.abort is not None:
        marker = ('&nbsp;<span class="uc-abort" style="color:#b00020;font-weight:bold;'
                  'white-space:nowrap">✖&nbsp;aborted</span>')
    elif not trace.finished:
        marker = ' <span style="color:#999">…</span>'
    prompt = html.escape(trace.prompt, quote=False)
    first = trace.pieces[0] if trace.pieces else ""
    # Token pieces carry their own leading spaces; the prompt's end and the first
    # piece may have none ("assistant :" + "okay"), which must not read as one word.
    gap = " " if prompt and first and not (prompt[-1].isspace() or first[0].isspace()) else ""
    return (
        f'<div class="uc-request" style="margin:4px 0;white-space:pre-wrap;'
        f'font-family:monospace"><b>{html.escape(trace.label or trace.request_id)}</b> '
        f'<span style="color:#777">{prompt}</span>{gap}{"".join(spans)}{marker}</div>'
    )


def abort_messages_html(traces: Iterable[RequestTrace]) -> str:
    """One line per aborted request: its label and which point stopped it, where."""
    lines = [
        f"<b>{html.escape(t.label or t.request_id)}</b>: "
        + html.escape(t.abort_message() or "", quote=False)
        for t in traces if t.abort is not None
    ]
    if not lines:
        return ""
    return ('<div class="uc-abort-message" style="color:#b00020">✖ ' + "<br>✖ ".join(lines)
            + "</div>")
