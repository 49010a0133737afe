"""Which layer knows? A linear probe per layer over a store, and its figure.

>>> frame = sweep_linear_probes(store, labels, point="resid")  # doctest: +SKIP
>>> sweep_figure(frame)                                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from undercurrent.analysis.fitting import fit_linear_probe
from undercurrent.store.reader import layer_indices

SWEEP_COLUMNS: tuple[str, ...] = (
    "point",
    "tensor_type",
    "layer",
    "positions",
    "accuracy",
    "auc",
    "n",
    "n_requests",
    "n_train",
    "n_test",
    "train_accuracy",
    "chance_accuracy",
)
"""Columns of :func:`sweep_linear_probes`: ``accuracy`` and ``auc`` are held out
(requests never split across train and test), ``n`` counts the layer's rows,
``chance_accuracy`` is the majority-class rate of the held-out rows."""


def sweep_linear_probes(
    store: Any,
    labels: Any,
    *,
    point: str | None = None,
    layers: Sequence[int] | None = None,
    positions: str = "all",
    tensor_type: str | None = None,
    test_size: float = 0.25,
    C: float = 1.0,
    seed: int = 0,
    max_iter: int = 2000,
) -> Any:
    """Fit one logistic-regression probe per layer and report held-out metrics.

    ``store`` is an :class:`~undercurrent.store.ActivationStore`; ``labels`` maps
    request ids or prompt indices to labels, or gives one label per prompt, or
    one per row as a pandas Series indexed like the point's rows
    (``store.select(point=...).index``), read layer by layer by the rows' labels.
    ``point`` may be omitted when the store has one; ``layers`` defaults to every
    stored layer; ``positions`` is one of ``undercurrent.store.POSITIONS``. Each
    layer's vectors are read from disk on their own (one layer in memory at a
    time), and every layer uses the same seeded split by request. Returns a frame
    with ``SWEEP_COLUMNS``, one row per layer.
    """
    import pandas as pd

    if point is None:
        present = sorted(store.held_points)
        if len(present) != 1:
            raise ValueError(f"sweep_linear_probes: the store has points {present}; "
                             "pick one with point=...")
        point = present[0]
    view = store.select(point=point, tensor_type=tensor_type, positions=positions)
    if not len(view):
        raise ValueError(f"sweep_linear_probes: no rows for point={point!r}, "
                         f"positions={positions!r} (the store has points {store.points})")
    held = sorted(int(v) for v in view.index["layer"].unique())
    chosen = held if layers is None else layer_indices(layers, "layers")
    missing = [layer for layer in chosen if layer not in held]
    if missing:
        raise ValueError(f"sweep_linear_probes: no rows of point {point!r} at layer "
                         f"{', '.join(map(str, missing))} (positions={positions!r}); it has "
                         f"layers {held}")
    rows = []
    for layer in chosen:
        fit = fit_linear_probe(view, labels, layer=layer, test_size=test_size, C=C,
                               seed=seed, max_iter=max_iter)
        metrics = fit.metrics
        layer_rows = view.index[view.index["layer"] == layer]
        rows.append({
            "point": point,
            "tensor_type": fit.tensor_type,
            "layer": layer,
            "positions": positions,
            "accuracy": metrics["test_accuracy"],
            "auc": metrics["test_auc"],
            "n": len(layer_rows),
            "n_requests": int(layer_rows["request_id"].nunique()),
            "n_train": metrics["n_train"],
            "n_test": metrics["n_test"],
            "train_accuracy": metrics["train_accuracy"],
            "chance_accuracy": metrics["chance_accuracy"],
        })
    return pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))


def sweep_figure(frame: Any, *, title: str | None = None) -> Any:
    """The "which layer knows" view of a :func:`sweep_linear_probes` frame: held-out
    accuracy and AUC per layer, chance as a dashed line, the best layer (by AUC)
    marked. Returns a plotly ``Figure``."""
    import plotly.graph_objects as go

    if frame is None or len(frame) == 0:
        raise ValueError("sweep_figure: the sweep frame is empty")
    ordered = frame.sort_values("layer")
    figure = go.Figure()
    for column, name in (("accuracy", "held-out accuracy"), ("auc", "held-out AUC")):
        figure.add_trace(go.Scatter(x=ordered["layer"], y=ordered[column], mode="lines+markers",
                                    name=name))
    figure.add_trace(go.Scatter(x=ordered["layer"], y=ordered["chance_accuracy"], mode="lines",
                                name="chance", line={"dash": "dash", "color": "grey"}))
    best = ordered.loc[ordered["auc"].fillna(-1).idxmax()]
    figure.add_annotation(x=best["layer"], y=best["auc"], text=f"best: layer {best['layer']}",
                          showarrow=True, arrowhead=2)
    point = ", ".join(sorted({str(p) for p in ordered["point"]}))
    positions = ", ".join(sorted({str(p) for p in ordered["positions"]}))
    figure.update_layout(
        title=title or f"Which layer knows? ({point}, positions: {positions})",
        xaxis={"title": "layer", "dtick": 1}, yaxis={"title": "held-out score", "range": [0, 1.02]},
        template="plotly_white", height=380)
    return figure
