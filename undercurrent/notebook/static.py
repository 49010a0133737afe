"""Static copies of what the notebook layer shows, for readers without a kernel.

A stored notebook is read on GitHub, in an nbconvert HTML export or in a
JupyterLab that has not run it yet. None of those can draw a widget or plotly's
JSON, so every widget offers an HTML snapshot beside its live view, and plotly
figures carry a PNG made with kaleido.

``figure_png`` renders through one long-lived kaleido browser (the first
figure pays for starting it, about two seconds; later ones take a fraction of
a second). A render that fails is tried once more: a render on a heavily
loaded machine was seen to fail once and not again. When kaleido or its
browser is missing, or both tries fail, it returns None (the reason is logged
at INFO on ``undercurrent.notebook``) and the snapshot simply has no picture.

>>> from undercurrent.notebook import png_fallback   # doctest: +SKIP
>>> png_fallback()        # plotly figures now display with a PNG copy  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import logging
import threading
import warnings
from typing import Any

logger = logging.getLogger("undercurrent.notebook")
RENDER_TRIES = 2
"""Renders tried per figure before giving up on its PNG."""

_lock = threading.Lock()
_server: dict[str, bool] = {}


def _start_kaleido() -> bool:
    """Start kaleido's shared browser once per process; False when that is impossible."""
    with _lock:
        if "started" in _server:
            return _server["started"]
        try:
            import kaleido

            kaleido.start_sync_server(silence_warnings=True)
        except Exception:  # noqa: BLE001 - no kaleido or no browser: no PNG, nothing else lost
            _server["started"] = False
            return False
        _server["started"] = True
        return True


def figure_png(figure: Any, *, width: int = 900, height: int | None = None) -> bytes | None:
    """PNG bytes of a plotly figure (or FigureWidget), or None when kaleido cannot draw it."""
    if not _start_kaleido():
        return None
    import plotly.io as pio

    layout_height = getattr(figure.layout, "height", None)
    for attempt in range(1, RENDER_TRIES + 1):
        with warnings.catch_warnings():
            # plotly warns that per-call browser options are unused with a shared server.
            warnings.simplefilter("ignore")
            try:
                png = pio.to_image(figure, format="png", width=width,
                                   height=height or layout_height or 400)
            except Exception as exc:  # noqa: BLE001 - a missing picture must not break the notebook
                logger.info("undercurrent: kaleido could not draw a figure (try %d of %d): %s",
                            attempt, RENDER_TRIES, exc)
                continue
        return _palette_png(png)
    return None


def _palette_png(png: bytes) -> bytes:
    """``png`` with a 256-colour palette when Pillow is installed: a plotly chart's flat
    colours survive, and the copy stored in a notebook is a fraction of the size."""
    try:
        from PIL import Image  # optional: comes with vLLM, not with the notebook extra
    except ImportError:
        return png
    import io

    with Image.open(io.BytesIO(png)) as image:
        small = image.convert("RGB").quantize(colors=256)
        out = io.BytesIO()
        small.save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(png) else png


def png_html(png: bytes | None, alt: str) -> str:
    """An ``<img>`` holding ``png`` inline (empty text when there is no picture)."""
    if png is None:
        return ""
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{alt}" style="max-width:100%" src="data:image/png;base64,{data}">'


def png_fallback() -> None:
    """Display plotly figures with a PNG copy beside the interactive figure.

    JupyterLab keeps drawing the interactive figure; GitHub, nbconvert and other
    readers that cannot run plotly's JavaScript show the PNG. Call it once near
    the top of a notebook.
    """
    import plotly.io as pio

    if "undercurrent" not in pio.renderers:
        pio.renderers["undercurrent"] = _png_renderer()
    pio.renderers.default = "undercurrent"


def _png_renderer() -> Any:
    import plotly.graph_objects as go
    import plotly.io as pio
    from plotly.io.base_renderers import MimetypeRenderer

    class MimetypeWithPng(MimetypeRenderer):  # type: ignore[misc]
        """plotly's own mimetype bundle plus ``image/png`` from ``figure_png``."""

        def to_mimebundle(self, fig_dict: dict[str, Any]) -> dict[str, Any]:
            bundle = dict(pio.renderers["plotly_mimetype"].to_mimebundle(fig_dict))
            png = figure_png(go.Figure(fig_dict))
            if png is not None:
                bundle["image/png"] = base64.b64encode(png).decode("ascii")
            return bundle

    return MimetypeWithPng()
