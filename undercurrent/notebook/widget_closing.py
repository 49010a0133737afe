"""Letting a notebook object's widgets go.

ipywidgets keeps every widget it makes (its ``Widget.widgets`` registry, which
the frontend's comms need) until the widget is closed, so an object that built
a tree of widgets (``LiveView``, ``SpecEditor``) closes the whole tree when the
user is done with it; otherwise a cell that builds a new one, run again, keeps
every old one for the kernel's life.
"""

from __future__ import annotations

from typing import Any


def close_widgets(widget: Any) -> None:
    """Close ``widget`` and every widget it holds (its children, layout and style).

    Closing a widget twice (a layout several widgets share, a tree closed
    before) does nothing more.
    """
    from ipywidgets import Widget

    for name in widget.keys:
        held = getattr(widget, name, None)
        for part in held if isinstance(held, tuple) else (held,):
            if isinstance(part, Widget) and part is not widget:
                close_widgets(part)
    widget.close()
