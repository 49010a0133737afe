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
