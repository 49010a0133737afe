"""Static copies for readers without a kernel: PNGs of plotly figures, the PNG renderer."""

from __future__ import annotations

import base64
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from undercurrent.notebook import png_fallback, static


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="kaleido needs Chromium")
def test_figure_png_draws_the_figure_at_the_size_asked():
    import struct

    png = static.figure_png(go.Figure(go.Scatter(x=[0, 1], y=[1, 0])), width=640, height=300)
    assert png is not None and png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert (width, height) == (640, 300)


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="kaleido needs Chromium")
def test_a_render_that_fails_is_tried_once_more(monkeypatch, caplog):
    """A render that fails (one did under heavy load) is drawn again, and the
    failure is logged."""
    real, calls = pio.to_image, []

    def flaky(*args, **kwargs):
        calls.append(kwargs["width"])
        if len(calls) == 1:
            raise TimeoutError("Page load timeout")
        return real(*args, **kwargs)

    monkeypatch.setattr(pio, "to_image", flaky)
    with caplog.at_level("INFO", logger="undercurrent.notebook"):
        png = static.figure_png(go.Figure(go.Bar(x=["a"], y=[1])), width=320, height=200)
    assert calls == [320, 320]
    assert png is not None and png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(try 1 of 2): Page load timeout" in caplog.text


def test_a_figure_no_try_can_draw_has_no_png(monkeypatch):
    calls = []
    monkeypatch.setattr(static, "_start_kaleido", lambda: True)
    monkeypatch.setattr(pio, "to_image", lambda *a, **k: calls.append(1) or 1 / 0)
    assert static.figure_png(go.Figure(), width=100) is None
    assert len(calls) == static.RENDER_TRIES == 2


def test_png_fallback_adds_a_png_beside_plotlys_own_bundle(monkeypatch):
    drawn = []
    monkeypatch.setattr(static, "figure_png", lambda figure, **kw: drawn.append(figure) or b"PNG")
    previous = pio.renderers.default
    try:
        png_fallback()
        assert pio.renderers.default == "undercurrent"
        figure = go.Figure(go.Bar(x=["a"], y=[1]))
        bundle = pio.renderers["undercurrent"].to_mimebundle(figure.to_dict())
    finally:
        pio.renderers.default = previous
    assert set(bundle) == {"application/vnd.plotly.v1+json", "image/png"}
    assert base64.b64decode(bundle["image/png"]) == b"PNG"
    assert list(drawn[0].data[0].x) == ["a"]


def test_png_html_is_empty_without_a_picture():
    assert static.png_html(None, alt="x") == ""
    assert static.png_html(b"PNG", alt="x").startswith('<img alt="x"')
