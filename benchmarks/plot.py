"""The overhead plot: median overhead ratio per scenario with its min–max range.

Drawn with plotly and written with kaleido (headless Chromium); where no
browser is available the PNG is drawn with Pillow instead, so the run always
leaves a picture.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any


def _write_image(figure: Any, path: Path, width: int, height: int) -> None:
    """``figure`` as a PNG at ``path``, through kaleido."""
    with warnings.catch_warnings():
        # Where kaleido's shared browser runs already in this process (a notebook
        # that drew static pictures), plotly warns that its per-call browser
        # options go unused; the picture is the same.
        warnings.filterwarnings("ignore", message="The kopts argument is ignored",
                                category=UserWarning)
        figure.write_image(str(path), width=width, height=height)


def _series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[str, float, float, float]]]:
    groups: dict[str, list[tuple[str, float, float, float]]] = {}
    for row in rows:
        ratio = row.get("overhead_ratio")
        if row.get("status") != "ok" or not ratio or ratio.get("median") is None:
            continue
        size = (f"batch {row['batch_size']}" if row["concurrency"] is None
                else f"{row['concurrency']} concurrent")
        label = f"{row['backend']} {row['model']}, {size}"
        groups.setdefault(label, []).append(
            (row["scenario"], ratio["median"], ratio["min"], ratio["max"]))
    return groups


def write_plot(rows: list[dict[str, Any]], path: Path) -> str:
    """Write the PNG; returns which renderer drew it."""
    groups = _series(rows)
    try:
        _plotly(groups, path)
        return "plotly+kaleido"
    except Exception as error:  # no Chromium for kaleido: fall back to Pillow
        _pillow(groups, path)
        return f"pillow (kaleido failed: {type(error).__name__})"


def _plotly(groups: dict[str, list[tuple[str, float, float, float]]], path: Path) -> None:
    import plotly.graph_objects as go

    figure = go.Figure()
    for label, points in groups.items():
        names = [p[0] for p in points]
        medians = [p[1] for p in points]
        figure.add_trace(go.Bar(
            name=label, x=names, y=medians,
            error_y={"type": "data", "symmetric": False,
                     "array": [p[3] - p[1] for p in points],
                     "arrayminus": [p[1] - p[2] for p in points]},
        ))
    figure.add_hline(y=1.0, line_dash="dot", annotation_text="plain generate()")
    figure.update_layout(
        barmode="group", title="Wall time relative to plain generate() (median, min–max)",
        yaxis_title="overhead ratio (x)", xaxis_tickangle=-30, template="plotly_white",
        legend={"orientation": "h", "y": -0.45},
    )
    _write_image(figure, path, 1200, 650)


def _pillow(groups: dict[str, list[tuple[str, float, float, float]]], path: Path) -> None:
    from PIL import Image, ImageDraw

    width, row_height = 1100, 18
    lines = sum(len(points) + 2 for points in groups.values()) + 2
    image = Image.new("RGB", (width, max(200, lines * row_height)), "white")
    draw = ImageDraw.Draw(image)
    top = max((p[3] for points in groups.values() for p in points), default=1.0)
    scale = (width - 420) / max(top, 1.0)
    y = 10
    draw.text((10, y), "Wall time relative to plain generate() (median, min-max)", fill="black")
    y += 2 * row_height
    for label, points in groups.items():
        draw.text((10, y), label, fill="black")
        y += row_height
        for name, median, low, high in points:
            draw.text((20, y), name[:44], fill="black")
            draw.rectangle([380, y + 3, 380 + median * scale, y + row_height - 3], fill="#4c78a8")
            draw.line([380 + low * scale, y + 9, 380 + high * scale, y + 9], fill="black")
            draw.text((390 + high * scale, y), f"{median:.2f}x", fill="black")
            y += row_height
        y += row_height
    draw.line([380 + scale, 30, 380 + scale, y], fill="red")
    image.save(path)


def _scaling_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    several = len({row.get("model") for row in rows}) > 1  # then each label names its model
    for row in rows:
        ratio = row.get("ratio_plain")
        if row.get("status") != "ok" or not ratio or ratio.get("median") is None \
                or row["mode"] in ("plain_generate", "vllm_plain_eager"):
            continue  # the baseline is the dotted line at 1
        model = f" {row['model']}" if several else ""
        label = f"{row['backend']}{model} {row['layer_set']} layers: {row['mode']}"
        series.setdefault(label, []).append((row["batch_size"], ratio["median"]))
    return {label: sorted(points) for label, points in series.items()}


def write_scaling_plot(rows: list[dict[str, Any]], path: Path) -> str:
    """Overhead (x plain, median) against batch size / concurrency, one line per
    (backend, layer set, mode); returns which renderer drew it."""
    return _line_plot(
        _scaling_series(rows), path, solid=lambda label: " all layers" in label,
        baseline=(1.0, "plain"), x_name="batch",
        title="Overhead against batch size (HF) / concurrent requests (vLLM); "
              "solid: all layers, dashed: 3 layers",
        x_title="batch size / concurrent requests", y_title="wall time x plain (median)")


def _line_plot(series: dict[str, list[tuple[int, float]]], path: Path, *,
               solid: Any, baseline: tuple[float, str], x_name: str, title: str,
               x_title: str, y_title: str) -> str:
    """One line per ``series`` label (``"...: mode"``, coloured by its mode; solid
    where ``solid(label)``, else dashed) over a log x axis, a dotted line at
    ``baseline`` (value, text); where plotly or kaleido fails, Pillow bars
    labelled ``"{x_name} {x}"``. Returns which renderer drew it."""
    try:
        import plotly.graph_objects as go

        figure = go.Figure()
        modes = sorted({label.split(": ", 1)[1] for label in series})
        palette = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2")
        ticks: set[int] = set()
        for label, points in series.items():
            mode = label.split(": ", 1)[1]
            ticks.update(p[0] for p in points)
            figure.add_trace(go.Scatter(
                x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                name=label, line={"color": palette[modes.index(mode) % len(palette)],
                                  "dash": "solid" if solid(label) else "dash"}))
        figure.add_hline(y=baseline[0], line_dash="dot", annotation_text=baseline[1])
        figure.update_layout(
            title=title, xaxis={"type": "log", "title": x_title, "tickvals": sorted(ticks)},
            yaxis_title=y_title, template="plotly_white",
        )
        _write_image(figure, path, 1100, 650)
        return "plotly+kaleido"
    except Exception as error:  # no plotly or no Chromium for kaleido
        bars = {label: [(f"{x_name} {x}", y, y, y) for x, y in points]
                for label, points in series.items()}
        _pillow(bars, path)
        return f"pillow (plotly failed: {type(error).__name__})"


def _depth_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The HF rows with every layer captured, as (layers, extra µs per vector over
    raw hooks) per batch size and mode, where the rows hold several depths."""
    members = [row for row in rows if row.get("backend") == "hf" and row.get("status") == "ok"
               and row.get("layer_set") == "all" and row.get("us_per_vector")
               and row["us_per_vector"].get("median") is not None]
    if len({len(row["capture_layers"]) for row in members}) < 2:
        return {}
    series: dict[str, list[tuple[int, float]]] = {}
    for row in members:
        label = f"batch {row['batch_size']}: {row['mode']}"
        series.setdefault(label, []).append((len(row["capture_layers"]),
                                             row["us_per_vector"]["median"]))
    return {label: sorted(points) for label, points in sorted(series.items())}


def write_depth_plot(rows: list[dict[str, Any]], path: Path) -> str | None:
    """Extra µs per captured vector over raw hooks (median) against the number of
    layers captured, one line per (batch size, mode), for a run on models of
    several depths (``--scaling-models deep4 deep12 ...``); returns which renderer
    drew it, or None (nothing written) when the rows hold one depth."""
    series = _depth_series(rows)
    if not series:
        return None
    largest = max(int(label.split(":")[0].split()[1]) for label in series)
    return _line_plot(
        series, path, solid=lambda label: label.startswith(f"batch {largest}:"),
        baseline=(0.0, "raw hooks"), x_name="layers",
        title="Extra cost per captured vector against depth (HF, every layer captured); "
              f"solid: batch {largest}, dashed: smaller batches",
        x_title="decoder layers captured", y_title="µs per vector over raw hooks (median)")
