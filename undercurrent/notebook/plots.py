"""Plotly views of probe scores and activations. Every function returns a figure.

Figures are plain ``plotly.graph_objects.Figure`` objects: show them, save them
with ``write_html(..., include_plotlyjs=True)`` for an offline page, or export a
PNG with kaleido. Nothing here reaches the network.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from undercurrent.analysis._inputs import is_missing_label
from undercurrent.analysis.fitting import frame_labels
from undercurrent.analysis.frames import (
    activation_matrix,
    check_activations,
    features_frame,
    label_rows,
    record_tensors,
    records_frame,
    results_frame,
    select_one_site,
    select_rows,
    signals_frame,
)
from undercurrent.arguments import check_number
from undercurrent.records import ActivationRecord
from undercurrent.spec.messages import did_you_mean

NO_LABEL = "(no label)"
"""The group ``projection_figure`` draws rows without a label (None or NaN) in."""

ValueFunction = Callable[[Any], float]


def _graph_objects() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "undercurrent's plots need plotly: pip install 'undercurrent[notebook]'"
        ) from error
    return go


def _as_frame(data: Any, convert: Callable[[Any], Any]) -> Any:
    import pandas as pd

    return data if isinstance(data, pd.DataFrame) else convert(data)


def trajectory_figure(
    signals: Any,
    *,
    x: str = "generated_index",
    threshold: float | None = None,
    requests: str | list[str] | None = None,
    points: str | list[str] | None = None,
    names: Mapping[str, str] | None = None,
    color_by: str | Mapping[str, Any] | None = None,
    title: str = "Probe score per token",
) -> Any:
    """Score per token: one line per (request, point, layer).

    ``signals`` is a signals frame or anything :func:`signals_frame` accepts
    (``GenerationOutput``s are best: their inline signals carry token indices).
    ``x`` is the frame column on the token axis; rows where it is missing fall
    back to ``signal_index`` (``x`` may be ``"generated_index"``, ``"token_index"``,
    ``"signal_index"``, ``"timestamp"`` or a numeric column of your own). Flags are
    drawn as open circles, aborts as red crosses; one without a score (the probe
    gave none) sits on the line's last score before it and says "no score" on
    hover. ``threshold`` adds a dashed line. ``requests`` and ``points`` (a list,
    or one name) keep those requests and points only; a name the frame does not
    hold is refused, naming the ones it does.

    ``names`` (``{request: name}``) names the lines in the legend and on hover.
    ``color_by`` (a frame column, or ``{request: label}``) gives every line of a
    label one colour and the legend one entry per label, which reads better than
    a colour per request once there are more than a few.
    """
    go = _graph_objects()
    frame = _as_frame(signals, signals_frame)
    if x not in frame.columns:
        raise ValueError(
            f"trajectory_figure: x={x!r} is not a column of the signals frame; x is one "
            f"of {', '.join(repr(axis) for axis in _TOKEN_AXES)} or a numeric column you "
            f"added (the frame has {list(frame.columns)})"
        )
    _check_names("trajectory_figure", names)
    if threshold is not None:
        check_number("trajectory_figure: threshold", threshold, finite=True)
    for column, wanted in (("request", requests), ("point", points)):
        if wanted is not None:
            frame = frame[frame[column].isin(_known_values(frame, column, wanted))]
    # (row labels of one position each: frames joined with pd.concat repeat them)
    frame = frame.reset_index(drop=True)
    groups = _groups(frame, color_by)
    palette = _palette(groups)
    figure = go.Figure()
    keys = ["request", "point", "layer"]
    several = frame[["point", "layer"]].drop_duplicates().shape[0] > 1
    for (request, point, layer), group in frame.groupby(keys, sort=False, dropna=False):
        positions = group[x].astype("Float64").fillna(group["signal_index"].astype("Float64"))
        xs = positions.astype(float).tolist()
        scores = group["score"].tolist()
        scored = group["score"].notna().tolist()
        shown = str((names or {}).get(request, request))
        name = shown
        if several or groups is None:
            name += f" · {point}" + ("" if _missing(layer) else f" · L{int(layer)}")
        name = _as_text(name)
        style: dict[str, Any] = {"name": name, "legendgroup": name}
        if groups is not None:
            key = groups[group.index[0]]
            style = {"name": _as_text(key), "legendgroup": str(key),
                     "showlegend": key not in palette.shown,
                     "line": {"color": palette.colour[key]},
                     "marker": {"color": palette.colour[key]}}
            palette.shown.add(key)
        if any(scored):
            figure.add_trace(
                go.Scatter(
                    x=[position for position, has in zip(xs, scored, strict=True) if has],
                    y=[score for score, has in zip(scores, scored, strict=True) if has],
                    mode="lines+markers",
                    hovertemplate=f"{name}<br>{x}=%{{x}}<br>score=%{{y:.3f}}<extra></extra>",
                    **style,
                )
            )
        heights = _marker_heights(group["score"], threshold)
        for action, symbol, color in (("flag", "circle-open", "orange"), ("abort", "x", "red")):
            hits = [i for i, taken in enumerate((group["action"] == action).tolist()) if taken]
            if hits:
                figure.add_trace(
                    go.Scatter(
                        x=[xs[i] for i in hits],
                        y=[heights[i] for i in hits],
                        text=[f"score={scores[i]:.3f}" if scored[i] else "no score"
                              for i in hits],
                        mode="markers",
                        marker={"symbol": symbol, "size": 14, "color": color,
                                "line": {"width": 2, "color": color}},
                        name=f"{name} {action}",
                        legendgroup=style["legendgroup"],
                        showlegend=False,
                        hovertemplate=f"{action}<br>%{{text}}<extra></extra>",
                    )
                )
    if threshold is not None:
        figure.add_hline(y=threshold, line_dash="dash", line_color="grey",
                         annotation_text=f"threshold {threshold:g}")
    legend = "request · point · layer" if groups is None else (
        color_by if isinstance(color_by, str) else "label")
    figure.update_layout(title=title, xaxis_title=x.replace("_", " "), yaxis_title="score",
                         template="plotly_white", legend_title=legend)
    return figure


_TOKEN_AXES = ("generated_index", "token_index", "signal_index", "timestamp")
"""The signals frame's columns ``trajectory_figure`` can put on its x axis."""


def _marker_heights(scores: Any, threshold: float | None) -> list[float]:
    """Where each signal's flag or abort marker sits: at its score, or, for a signal
    the probe gave no score, at the line's last score before it (the first score
    after it when none came before; the threshold, else 0, when the line has none)."""
    fallback = 0.0 if threshold is None else float(threshold)
    return [float(height) for height in scores.ffill().bfill().fillna(fallback).tolist()]


class _Palette:
    def __init__(self, keys: list[Any]) -> None:
        import plotly.colors

        colours = plotly.colors.qualitative.Plotly
        self.colour = {key: colours[i % len(colours)] for i, key in enumerate(keys)}
        self.shown: set[Any] = set()


def _known_values(frame: Any, column: str, wanted: Any) -> list[Any]:
    """``wanted`` (one value, or a list of them) as a list, every one of which the
    frame's ``column`` holds: a typo would draw an empty figure without a word."""
    argument = f"trajectory_figure: {column}s"
    values = [wanted] if isinstance(wanted, str) else wanted
    if not isinstance(values, Iterable) or isinstance(values, bytes | Mapping):
        raise TypeError(f"{argument} must be a list of {column} names (or one name), got "
                        f"{type(wanted).__name__} ({wanted!r:.40})")
    values = list(values)
    present = frame[column].unique().tolist()
    unknown = [value for value in values if value not in present]
    if unknown:
        raise ValueError(f"{argument}: no signals of {column} {unknown[0]!r}"
                         f"{did_you_mean(str(unknown[0]), [str(v) for v in present])}; the "
                         f"{column}s with signals are {sorted(map(str, present))[:10]}")
    return values


def _check_names(caller: str, names: Any) -> None:
    """``names`` is None or a mapping ``{request: name}`` (a list would fail on .get)."""
    if names is not None and not isinstance(names, Mapping):
        raise TypeError(f"{caller}: names must be a mapping {{request: name}}, got "
                        f"{type(names).__name__} ({names!r:.40})")


def _groups(frame: Any, color_by: str | Mapping[str, Any] | None) -> Any:
    """The group of each row (a Series aligned with ``frame``), or None."""
    if color_by is None:
        return None
    if isinstance(color_by, str):
        if color_by not in frame.columns:
            raise ValueError(
                f"trajectory_figure: color_by={color_by!r} is not a column; columns are "
                f"{list(frame.columns)}"
            )
        return frame[color_by]
    if not isinstance(color_by, Mapping):
        raise TypeError("trajectory_figure: color_by must be a frame column, a "
                        "{request: label} mapping or None, got "
                        f"{type(color_by).__name__} ({color_by!r:.40})")
    missing = sorted(set(frame["request"]) - set(color_by))
    if missing:
        raise ValueError(f"trajectory_figure: color_by has no group for requests {missing[:5]}")
    return frame["request"].map(color_by)


def _palette(groups: Any) -> _Palette:
    keys = [] if groups is None else sorted(set(groups.tolist()), key=str)
    return _Palette(keys)


def _as_text(value: Any) -> str:
    """``value`` shown as written: plotly reads trace names and hover text as HTML
    (a label ``<i>L1</i>`` would be set in italics, a ``<`` could swallow the rest)."""
    return html.escape(str(value), quote=False)


def _missing(value: Any) -> bool:
    import pandas as pd

    return value is None or bool(pd.isna(value))


def heatmap_figure(
    records: Any,
    *,
    request: str | None = None,
    point: str | None = None,
    value: str | ValueFunction = "norm",
    names: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Any:
    """Layer x token heatmap of one request's activations (``names`` maps request ids
    to the names shown in the title, e.g. ``{"req-…": "p1 (harmful)"}``).

    ``records`` is a records frame or anything :func:`records_frame` accepts;
    ``request`` defaults to the first one in the frame. ``value`` turns each
    activation into one number: ``"norm"`` (L2 norm), ``"mean"``, or any function
    of the numpy array, e.g. a fitted probe's score
    ``lambda a: fit.predict_proba(a[None])[0, 1]``. Token texts label the x axis
    when the frame has them.

    A request captured at several points (or tensor types) gets one row per
    (point, layer), labelled ``"resid L1"``, ``"mlp L1"``, grouped by point; the
    rows share one colour scale, so pass ``point=`` to draw one point alone. Two
    records for the same cell (point, layer, tensor type and token) are refused.
    """
    import numpy as np

    go = _graph_objects()
    _check_names("heatmap_figure", names)
    if request is not None and not isinstance(request, str):
        raise TypeError(f"heatmap_figure draws one request: request must be a request id "
                        f"(a string), got {type(request).__name__} ({request!r:.40}); draw "
                        "each request in a figure of its own")
    frame = _as_frame(records, records_frame)
    if frame.empty:
        raise ValueError("heatmap_figure: no records to draw")
    if request is None:
        request = frame["request"].iloc[0]
    selected = select_rows(frame, request=request, point=point)
    if selected.empty:
        raise ValueError(
            f"heatmap_figure: no records for request={request!r}, point={point!r}; "
            f"requests are {sorted(frame['request'].unique().tolist())[:10]}"
        )
    check_activations(selected, "heatmap_figure")  # (not a heatmap of NaN)
    compute = _value_function(value)
    tokens = {token: i for i, token in enumerate(sorted(selected["token_index"].unique()))}
    sites = _heatmap_sites(selected)
    grid = np.full((len(sites), len(tokens)), np.nan)
    filled = np.zeros(grid.shape, dtype=bool)
    for row, tensor in zip(selected.itertuples(index=False), record_tensors(selected),
                           strict=True):
        cell = (sites[(row.point, row.layer, row.tensor_type)], tokens[row.token_index])
        if filled[cell]:
            raise ValueError(
                f"heatmap_figure: request {request!r} has more than one record for point "
                f"{row.point!r}, layer {row.layer}, {row.tensor_type}, token "
                f"{row.token_index}; is the frame two runs with the same request ids?"
            )
        filled[cell] = True
        grid[cell] = compute(tensor)
    labels = _token_labels(selected, list(tokens))
    label = value if isinstance(value, str) else getattr(value, "__name__", "value")
    axis = "layer" if len({(point, kind) for point, _, kind in sites}) == 1 else "point · layer"
    figure = go.Figure(
        go.Heatmap(
            z=grid,
            x=labels,
            y=_site_labels(list(sites)),
            colorscale="Viridis",
            colorbar={"title": label},
            hovertemplate=f"token %{{x}}<br>{axis} %{{y}}<br>{label}=%{{z:.3f}}<extra></extra>",
        )
    )
    figure.update_layout(
        title=title or f"{label} by layer and token ({(names or {}).get(request, request)})",
        xaxis_title="token",
        yaxis_title=axis,
        template="plotly_white",
    )
    figure.update_xaxes(type="category")
    return figure


def _heatmap_sites(frame: Any) -> dict[tuple[Any, int, Any], int]:
    """``{(point, layer, tensor type): heatmap row}``: points in the frame's order,
    layers ascending within a point."""
    points = {point: i for i, point in enumerate(dict.fromkeys(frame["point"]))}
    kinds = {kind: i for i, kind in enumerate(dict.fromkeys(frame["tensor_type"]))}
    found = set(zip(frame["point"], frame["layer"].astype(int), frame["tensor_type"],
                    strict=True))
    ordered = sorted(found, key=lambda site: (points[site[0]], site[1], kinds[site[2]]))
    return {site: row for row, site in enumerate(ordered)}


def _site_labels(sites: list[tuple[Any, int, Any]]) -> list[str]:
    """Row labels: ``"L1"`` for one point, ``"resid L1"`` for several, with the tensor
    type added where one point holds several."""
    several_points = len({point for point, _, _ in sites}) > 1
    mixed_kinds = len({(point, kind) for point, _, kind in sites}) > len(
        {point for point, _, _ in sites})
    return [
        (f"{point} " if several_points or mixed_kinds else "") + f"L{layer}"
        + (f" {kind}" if mixed_kinds else "")
        for point, layer, kind in sites
    ]


def _value_function(value: str | ValueFunction) -> ValueFunction:
    import numpy as np

    if callable(value):
        return lambda tensor: float(value(np.asarray(tensor, dtype=np.float64)))
    if value == "norm":
        return lambda tensor: float(np.linalg.norm(np.asarray(tensor, dtype=np.float64)))
    if value == "mean":
        return lambda tensor: float(np.asarray(tensor, dtype=np.float64).mean())
    raise ValueError(f"heatmap_figure: value must be 'norm', 'mean' or a function, got {value!r}")


def _token_labels(frame: Any, tokens: list[int]) -> list[str]:
    texts: dict[int, str] = {}
    for row in frame.itertuples(index=False):
        if row.token_text is not None and row.token_index not in texts:
            texts[row.token_index] = str(row.token_text)
    marker = {
        int(row.token_index): "*" if row.is_generated else ""
        for row in frame.itertuples(index=False)
    }
    return [
        f"{index}{marker.get(index, '')} {texts[index]!r}" if index in texts else f"{index}"
        for index in tokens
    ]


def projection_figure(
    data: Any,
    labels: Any = None,
    *,
    layer: int | None = None,
    point: str | None = None,
    tensor_type: str | None = None,
    names: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Any:
    """PCA of activations to 2-D, coloured by label.

    ``data`` is a records frame (filtered by ``layer``/``point``/``tensor_type``),
    records, or an ``(n, features)`` array; ``labels`` is one label per row, a
    frame column name, or ``{request: label}``, read as ``fit_linear_probe``
    reads them: per-row labels are of the frame or of the rows left after the
    filters, and a pandas Series is aligned with the rows by its index. Rows
    without a label (None or NaN), which a fit refuses, are drawn as a group of
    their own, ``"(no label)"``. ``names``
    (``{request: name}``) names each point's request on hover. Axis titles give
    each component's share of the variance. A frame whose rows (after the filters)
    mix points, layers or tensor types is refused, as ``fit_linear_probe`` refuses
    it: one PCA over two layers' activations mixes two spaces.
    """
    import numpy as np
    import pandas as pd
    from sklearn.decomposition import PCA

    go = _graph_objects()
    _check_names("projection_figure", names)
    hover: list[str] | None = None
    if isinstance(data, pd.DataFrame) or hasattr(data, "records") or _is_record_list(data):
        whole = _as_frame(data, records_frame)
        frame = select_one_site(whole, "projection_figure",
                                point=point, layer=layer, tensor_type=tensor_type)
        matrix = activation_matrix(frame, dtype="float64")
        if labels is not None:  # (read as fit_linear_probe reads them: one rule for both)
            labels = frame_labels(whole, frame, labels, "projection_figure", "labels",
                                  unlabelled="keep")
        shown = names or {}
        hover = [f"{shown.get(r.request, r.request)} · token {r.token_index}"
                 for r in frame.itertuples(index=False)]
    else:
        matrix = np.asarray(data, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] < 2:
        raise ValueError(
            f"projection_figure: need at least two rows of activations, got shape {matrix.shape}"
        )
    pca = PCA(n_components=2, random_state=0)
    coords = pca.fit_transform(matrix)
    labels_list = ["all"] * len(coords) if labels is None else [
        NO_LABEL if is_missing_label(value) else str(value) for value in labels]
    if len(labels_list) != len(coords):
        raise ValueError(
            f"projection_figure: {len(coords)} rows but {len(labels_list)} labels"
        )
    figure = go.Figure()
    # (unlabelled rows are drawn too, as a group of their own, last)
    for label in sorted(set(labels_list), key=lambda name: (name == NO_LABEL, name)):
        rows = [i for i, value in enumerate(labels_list) if value == label]
        figure.add_trace(
            go.Scatter(
                x=coords[rows, 0],
                y=coords[rows, 1],
                mode="markers",
                name=_as_text(label),
                text=None if hover is None else [_as_text(hover[i]) for i in rows],
                hovertemplate="%{text}<extra>" + _as_text(label) + "</extra>" if hover
                else None,
                marker={"size": 7, "opacity": 0.8},
            )
        )
    share = pca.explained_variance_ratio_
    figure.update_layout(
        title=title or "PCA of activations" + ("" if layer is None else f" (layer {layer})"),
        xaxis_title=f"PC1 ({share[0]:.0%} of variance)",
        yaxis_title=f"PC2 ({share[1]:.0%} of variance)",
        template="plotly_white",
        legend_title="label",
    )
    return figure


def _is_record_list(data: Any) -> bool:
    return isinstance(data, (list, tuple)) and bool(data) and (
        isinstance(data[0], ActivationRecord) or hasattr(data[0], "records")
    )


def verdict_figure(results: Any, *, title: str = "Verdicts per extraction point") -> Any:
    """Per point, how many requests ended clean, flagged, aborted or with a probe error.

    ``results`` is a results frame or anything :func:`results_frame` accepts.
    Each request counts once per point, in the first matching category of
    error, aborted, flagged, clean.
    """
    go = _graph_objects()
    frame = _as_frame(results, results_frame)
    categories = (
        ("error", "#7f7f7f"),
        ("aborted", "#d62728"),
        ("flagged", "#ff7f0e"),
        ("clean", "#2ca02c"),
    )
    points = list(dict.fromkeys(frame["point"].tolist()))
    outcome = [_outcome(row) for row in frame.itertuples(index=False)]
    figure = go.Figure()
    for name, color in categories:
        counts = [
            sum(1 for p, o in zip(frame["point"], outcome, strict=True) if p == point and o == name)
            for point in points
        ]
        figure.add_trace(go.Bar(x=points, y=counts, name=name, marker_color=color,
                                hovertemplate="%{x}: %{y} " + name + "<extra></extra>"))
    figure.update_layout(barmode="stack", title=title, xaxis_title="extraction point",
                         yaxis_title="requests", template="plotly_white")
    return figure


def _outcome(row: Any) -> str:
    if row.error is not None and not _missing(row.error):
        return "error"
    if row.aborted:
        return "aborted"
    if row.flagged:
        return "flagged"
    return "clean"


def _features_input(features: Any) -> Any:
    return _as_frame(features, features_frame)


def feature_heatmap_figure(
    features: Any,
    *,
    request: str | None = None,
    point: str | None = None,
    layer: int | None = None,
    feature_ids: list[int] | None = None,
    top: int = 20,
    title: str | None = None,
) -> Any:
    """Feature x token heatmap of one request's SAE feature activations.

    ``features`` is a :func:`~undercurrent.analysis.frames.features_frame` or
    anything it accepts (``GenerationOutput``s from a run with ``sae_probe``).
    ``request`` defaults to the first in the frame, ``layer`` to the lowest of the
    selection. Rows are ``feature_ids`` or the ``top`` features by peak activation
    in that request. A feature the probe did not report at a token (outside that
    token's ``top_k``) is left blank, not drawn as 0.
    """
    import numpy as np

    go = _graph_objects()
    frame = _features_input(features)
    if frame.empty:
        raise ValueError("feature_heatmap_figure: no SAE features to draw (was sae_probe run?)")
    if request is None:
        request = frame["request"].iloc[0]
    selected = select_rows(frame, request=request, point=point)
    if layer is None and not selected.empty:
        layer = int(selected["layer"].min())
    selected = selected[selected["layer"] == layer] if layer is not None else selected
    if selected.empty:
        raise ValueError(
            f"feature_heatmap_figure: nothing for request={request!r}, point={point!r}, "
            f"layer={layer!r}; requests are {sorted(frame['request'].unique().tolist())[:10]}"
        )
    if feature_ids is None:
        peaks = selected.groupby("feature")["activation"].max().sort_values(ascending=False)
        feature_ids = [int(f) for f in peaks.index[:top]]
    tokens = sorted(int(t) for t in selected["token"].dropna().unique())
    grid = np.full((len(feature_ids), len(tokens)), np.nan)
    for row in selected.itertuples(index=False):
        if row.feature in feature_ids and not _missing(row.token):
            grid[feature_ids.index(row.feature), tokens.index(int(row.token))] = row.activation
    texts = {int(r.token): r.token_text for r in selected.itertuples(index=False)
             if not _missing(r.token)}
    labels = [f"{t}:{texts[t]}" if texts.get(t) else str(t) for t in tokens]
    figure = go.Figure(go.Heatmap(
        z=grid, x=labels, y=[f"f{feature}" for feature in feature_ids],
        colorscale="Viridis", colorbar={"title": "activation"},
        hovertemplate="token %{x}<br>feature %{y}<br>activation=%{z:.3f}<extra></extra>",
    ))
    figure.update_layout(
        title=title or f"SAE features by token ({request}, layer {layer})",
        xaxis_title="token", yaxis_title="feature", template="plotly_white",
    )
    figure.update_xaxes(type="category")
    figure.update_yaxes(type="category", autorange="reversed")
    return figure


def top_features_by_label_figure(
    features: Any,
    labels: Mapping[str, Any],
    *,
    top: int = 8,
    title: str = "Top SAE features by label",
) -> Any:
    """Bar view: for each label, its ``top`` features by mean per-request peak.

    Each request is summarised by every feature's peak activation over its tokens
    (0 where the probe never reported the feature); the bars are the mean of those
    peaks over the requests with each label (``labels`` maps request id to label),
    for the union of every label's top features, one bar group per feature.
    Raises ``KeyError`` naming requests that have no label.
    """
    go = _graph_objects()
    frame = _features_input(features)
    if frame.empty:
        raise ValueError("top_features_by_label_figure: no SAE features (was sae_probe run?)")
    table = mean_peaks_by_label(frame, labels)
    chosen: list[int] = []
    for label in table.columns:
        for feature in table[label].sort_values(ascending=False).index[:top]:
            if int(feature) not in chosen:
                chosen.append(int(feature))
    figure = go.Figure([
        go.Bar(name=_as_text(label), x=[f"f{f}" for f in chosen],
               y=[float(table.loc[f, label]) for f in chosen],
               hovertemplate="feature %{x}<br>mean peak=%{y:.3f}<extra>" + _as_text(label)
               + "</extra>")
        for label in table.columns
    ])
    figure.update_layout(
        title=title, barmode="group", xaxis_title="feature",
        yaxis_title="mean peak activation per request", template="plotly_white",
    )
    figure.update_xaxes(type="category")
    return figure


def mean_peaks_by_label(features: Any, labels: Mapping[str, Any]) -> Any:
    """``feature x label`` table: the mean, over each label's requests, of the
    feature's peak activation in the request (0 where it was never reported)."""
    frame = _features_input(features)
    peaks = frame.pivot_table(index="request", columns="feature", values="activation",
                              aggfunc="max", fill_value=0.0)
    peaks["__label__"] = label_rows(peaks.reset_index(), labels, by="request")
    return peaks.groupby("__label__").mean().T.rename_axis(index="feature", columns="label")
