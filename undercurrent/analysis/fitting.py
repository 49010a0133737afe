"""Fit a linear probe on captured activations and save it where ``linear_probe`` loads it.

This closes the notebook loop: capture -> label -> fit -> run live. The fit is
scikit-learn's ``StandardScaler`` + L2-regularised ``LogisticRegression`` with a
held-out split; the standardisation is folded into the saved weight and bias,
so the file holds one plain affine map over raw activations.

Saved format (``undercurrent.linear_probe/1``), ``.safetensors`` or ``.npz``:

- arrays ``weight``: ``(hidden,)`` float32 for two classes, ``(classes, hidden)``
  for more; ``bias``: ``()`` or ``(classes,)`` float32;
- string metadata (safetensors metadata, or 0-d string arrays in ``.npz``):
  ``format``, ``link`` (``sigmoid`` for two classes, scoring the second label of
  ``label_names``, the ``positive`` one;
  ``softmax`` for more), ``threshold``, ``layer`` and ``tensor_type`` (when
  known), ``label_names`` (a JSON list, in the model's class order) and
  ``metrics`` (JSON of the fit's metrics); ``folded_reduction`` (e.g.
  ``project:64``) for a fit on a store's projected vectors, whose projection the
  saved weight includes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undercurrent.analysis._inputs import (
    is_default_index,
    missing_labels,
    non_finite_rows,
    reads_by_position,
    request_groups,
    series_by_row,
)
from undercurrent.analysis.frames import (
    ACTIVATIONS_KEY,
    Activations,
    activation_matrix,
    frame_column,
    label_rows,
    records_frame,
    select_one_site,
)
from undercurrent.arguments import check_number
from undercurrent.probes.arrays import as_float_array
from undercurrent.probes.scoring import parse_threshold
from undercurrent.probes.weights import apply_link, save_linear_weights
from undercurrent.records import ActivationRecord


@dataclass(frozen=True)
class LinearProbeFit:
    """A fitted linear probe, in raw activation space (or a store's projected one,
    below).

    ``weight``/``bias`` already include the standardisation, so
    ``sigmoid(weight @ x + bias)`` (two classes) or ``softmax(weight @ x + bias)``
    is the probability of ``label_names[1]`` (the ``positive`` label; or of each label). ``metrics``
    holds ``train_accuracy``, ``test_accuracy``, ``test_auc``, ``chance_accuracy``
    (majority-class rate on the held-out rows), ``n_train``, ``n_test``,
    ``n_features``, ``n_classes`` and ``split`` (``"request"`` or ``"row"``).

    A fit on an activation store (a view, or its ``records_frame``) whose point
    was captured with a ``project:K`` reduction is over the K projected features
    (``weight``, ``predict`` and the metrics read stored vectors); ``projected``
    says so (e.g. ``"project:64"``) and ``projection`` is the ``(captured
    features, K)`` matrix. The saved file and ``probe_args`` fold it in
    (:meth:`raw_weights`), so the probe scores the captured activations exactly
    as the fit scored their projections.
    """

    weight: Any
    bias: Any
    link: str
    classes: tuple[Any, ...]
    label_names: tuple[str, ...]
    threshold: float
    layer: int | None
    tensor_type: str | None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    path: Path | None = None
    projected: str | None = None
    projection: Any = None

    def raw_weights(self) -> tuple[Any, Any]:
        """``(weight, bias)`` over the captured activations (float32): the fit's own,
        or for a fit on projected vectors, the projection folded in (``x @ P`` is
        what the fit read, so ``w . (x @ P) = (P @ w) . x``; the bias is unchanged).
        A projection that cannot be rebuilt (a store of an earlier version) is a
        ``ValueError``: such a probe reads no captured activation."""
        import numpy as np

        if self.projected is None:
            return self.weight, self.bias
        if self.projection is None:
            raise ValueError(
                f"this probe was fitted on vectors stored with the reduction "
                f"{self.projected!r}, whose projection matrix the store could not rebuild "
                "(the store does not record the captured vectors' size: written by an "
                "earlier version), so it cannot score captured activations; capture the "
                "store again and refit")
        matrix = np.asarray(self.projection, dtype=np.float64)
        weight = np.asarray(self.weight, dtype=np.float64) @ matrix.T
        return weight.astype(np.float32), self.bias

    def decision_function(self, X: Any) -> Any:
        """The logits ``X @ weight.T + bias``: ``(n,)`` for two classes, else ``(n, classes)``.

        ``X`` is an ``(n, features)`` matrix, or one row ``(features,)``, taken as a
        matrix of one row (every method then returns results for one row)."""
        import numpy as np

        matrix = as_float_array(X)
        if matrix.ndim == 1:
            matrix = matrix[None, :]
        features = self.weight.shape[-1]
        if matrix.ndim != 2 or matrix.shape[1] != features:
            raise ValueError(f"X must be (rows, {features}) activations, or one row of "
                             f"{features}, for this probe; got shape {matrix.shape}")
        return matrix @ np.asarray(self.weight, dtype=np.float64).T + np.asarray(
            self.bias, dtype=np.float64
        )

    def predict_proba(self, X: Any) -> Any:
        """Class probabilities ``(n, classes)``, as scikit-learn's ``predict_proba``."""
        import numpy as np

        logits = self.decision_function(X)
        if self.link == "sigmoid":
            positive = apply_link("sigmoid", logits)
            return np.stack([1.0 - positive, positive], axis=1)
        return apply_link("softmax", logits)

    def predict(self, X: Any) -> Any:
        """The most probable class label for each row."""
        import numpy as np

        return np.asarray(self.classes, dtype=object)[self.predict_proba(X).argmax(axis=1)]

    def probe_args(self, **overrides: Any) -> dict[str, Any]:
        """``probe_args`` for a ``linear_probe`` extraction point using this fit.

        Points at the saved file when there is one, else carries the weights inline.
        ``overrides`` (e.g. ``action="abort"``) are added last.
        """
        args: dict[str, Any]
        if self.path is not None:
            args = {"path": str(self.path)}
        else:
            weight, bias = self.raw_weights()
            args = {"weight": weight.tolist(), "bias": bias.tolist(), "link": self.link}
        args["threshold"] = self.threshold
        args.update(overrides)
        return args

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the probe as ``.safetensors`` or ``.npz`` (chosen by the suffix)."""
        return save_linear_probe(self, path)


def fit_linear_probe(
    data: Any,
    y: Any = None,
    *,
    layer: int | None = None,
    point: str | None = None,
    tensor_type: str | None = None,
    test_size: float = 0.25,
    C: float = 1.0,
    seed: int = 0,
    save_to: str | os.PathLike[str] | None = None,
    threshold: float = 0.5,
    group_by: str | Sequence[Any] | None = "auto",
    max_iter: int = 2000,
    class_weight: str | Mapping[Any, float] | None = None,
    positive: Any = None,
) -> LinearProbeFit:
    """Fit a logistic-regression probe on activations and (optionally) save it.

    ``data`` is a records frame (from ``records_frame``/``load_records``), records
    or ``GenerationOutput``s, or an ``(n, features)`` array. ``y`` gives the labels:
    an array-like (one per row, of the frame or of the rows left after filtering),
    the name of a frame column, or a mapping from request id to label (each row
    takes its request's label). A pandas Series with a frame is aligned with its
    rows by its index, as pandas aligns (one with the default index ``0, 1, ...``
    that is not the rows' own is read by position); one whose index misses a
    selected row is refused.

    ``data`` may also be an activation store (``undercurrent.open_activations``,
    or a ``store.select(...)`` view): only the chosen point and layer are read
    from disk, and ``y`` may also map prompt indices to labels or give one label
    per prompt.

    Frames are filtered by ``point``/``layer``/``tensor_type``; a frame with several
    layers needs ``layer``. The held-out split keeps every request on one side
    (``group_by="auto"`` groups rows by request when some request has several rows,
    and splits rows when each has one; a store and its ``records_frame`` alike),
    so held-out accuracy measures unseen generations, not neighbouring tokens of
    seen ones; pass ``group_by=None`` to split rows, or a column name or
    a sequence of group ids. ``C`` is the inverse L2 strength; ``test_size=0``
    trains on everything (held-out metrics are then NaN). ``seed`` (0 to
    2**32 - 1, or None) seeds the split and the solver; ``class_weight`` is None,
    ``"balanced"`` or ``{label: weight}`` with finite weights > 0.

    With two labels the probe's score is the probability of ``positive`` (default:
    the second label in sorted order, e.g. ``"harmful"`` of
    ``{"benign", "harmful"}``, ``1`` of ``{0, 1}``); ``label_names[1]`` of the fit
    and of the saved file is that label. A ``positive`` that is not among the labels
    is a ``ValueError`` listing them; with more than two labels (softmax, one score
    per label) it is refused.

    >>> fit = fit_linear_probe(frame, {"r0": "benign", "r1": "harmful"},
    ...                        layer=2, save_to="probe.safetensors")  # doctest: +SKIP
    >>> fit.metrics["test_accuracy"]                                  # doctest: +SKIP
    """
    import numpy as np

    checked_threshold = parse_threshold(threshold, option="fit_linear_probe: threshold")
    if checked_threshold is None:
        raise ValueError("fit_linear_probe: threshold must be a number (the score at which "
                         "the saved probe acts; default 0.5), got None")
    check_number("fit_linear_probe: test_size", test_size)
    if seed is not None:
        seed = check_number("fit_linear_probe: seed", seed, integer=True)
        if not 0 <= seed < 2**32:
            raise ValueError("fit_linear_probe: seed must be an integer from 0 to 2**32 - 1 "
                             f"(or None), got {seed}")
    class_weight = _checked_class_weight(class_weight)
    X, labels, groups, layer, tensor_type, projected = _design(
        data, y, layer, point, tensor_type, group_by)
    if len(X) != len(labels):
        raise ValueError(
            f"fit_linear_probe: {len(X)} activation rows but {len(labels)} labels; give one "
            "label per row (or a {request: label} mapping)"
        )
    classes = _sorted_classes(labels)
    if len(classes) < 2:
        raise ValueError(
            f"fit_linear_probe: need at least two distinct labels, got only {classes!r}"
        )
    classes = _order_positive_last(classes, positive)
    train_rows, test_rows = _split(labels, groups, test_size, seed)
    trained = _sorted_classes(labels[train_rows])
    if len(trained) < len(classes):
        # Checked here: scikit-learn's own message says nothing of the split.
        held_out = [c for c in classes if c not in trained]
        raise ValueError(
            f"fit_linear_probe: the training split lacks some labels ({held_out} only held "
            f"out; training has {trained}, all labels {classes}); "
            "lower test_size or add data (test_size=0 trains on every row)"
        )
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(X[train_rows])
    model = LogisticRegression(
        C=C, max_iter=max_iter, random_state=seed, class_weight=class_weight
    )
    model.fit(scaler.transform(X[train_rows]), labels[train_rows])
    scale = scaler.scale_
    weight = model.coef_ / scale
    bias = model.intercept_ - (model.coef_ * (scaler.mean_ / scale)).sum(axis=1)
    binary = len(model.classes_) == 2
    fitted_classes = model.classes_.tolist()
    if binary:
        weight, bias = weight[0], bias[0]
        if fitted_classes[1] != classes[1]:
            # scikit-learn scores its second class; sigmoid(-z) = 1 - sigmoid(z)
            # scores the other one.
            weight, bias = -weight, -bias
            fitted_classes.reverse()
    fit = LinearProbeFit(
        weight=weight.astype(np.float32),
        bias=np.asarray(bias, dtype=np.float32),
        link="sigmoid" if binary else "softmax",
        classes=tuple(fitted_classes),
        label_names=tuple(str(c) for c in fitted_classes),
        threshold=checked_threshold,
        layer=layer,
        tensor_type=tensor_type,
        metrics={},
        projected=None if projected is None else projected[0],
        projection=None if projected is None else projected[1],
    )
    metrics = _metrics(fit, X, labels, train_rows, test_rows, groups is not None)
    fit = dataclasses.replace(fit, metrics=metrics)
    if save_to is not None:
        path = save_linear_probe(fit, save_to)
        fit = dataclasses.replace(fit, path=path)
    return fit


def _checked_class_weight(class_weight: Any) -> Any:
    """``class_weight`` as scikit-learn takes it: None, ``"balanced"``, or a
    ``{label: weight}`` dict of finite weights > 0 (a weight of 0 or less was a
    ZeroDivisionError from inside scikit-learn, a NaN fitted a meaningless probe)."""
    if class_weight is None or (isinstance(class_weight, str) and class_weight == "balanced"):
        return class_weight
    if not isinstance(class_weight, Mapping):
        raise TypeError("fit_linear_probe: class_weight must be None, 'balanced' or a "
                        f"{{label: weight}} mapping, got {type(class_weight).__name__} "
                        f"({class_weight!r:.40})")
    weights = {}
    for label, weight in class_weight.items():
        name = f"fit_linear_probe: class_weight[{label!r}]"
        if hasattr(weight, "item") and getattr(weight, "ndim", None) == 0:
            weight = weight.item()  # (a 0-d array or tensor: a ratio of counts, say)
        number = check_number(name, weight)
        if not (math.isfinite(number) and number > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {weight!r}")
        weights[label] = number
    return weights


def _design(
    data: Any,
    y: Any,
    layer: int | None,
    point: str | None,
    tensor_type: str | None,
    group_by: Any,
    caller: str = "fit_linear_probe",
) -> tuple[Any, Any, Any, int | None, str | None, tuple[str, Any] | None]:
    """``(X, labels, groups, layer, tensor_type, projected)`` from whatever the
    caller passed; ``projected`` is None, or for a point a store captured with a
    ``project:K`` reduction (read from the store, a view or its ``records_frame``,
    whose activations carry the mark) ``(reduction, projection matrix or None
    when the store cannot rebuild it)``.

    Refuses rows a fit cannot use, naming them: missing labels (None or NaN) and
    activations holding NaN or infinity. ``caller`` names the public function in
    messages.
    """
    import numpy as np

    projected: tuple[str, Any] | None = None
    if hasattr(data, "probe_design"):
        # An ActivationStore: read one point and layer from disk, split by request.
        store = data
        data, y, group_by, layer, tensor_type, stored_point = store.probe_design(
            y, point=point, layer=layer, tensor_type=tensor_type, group_by=group_by,
            caller=caller)
        point = None
        projected = store.projected(stored_point)
    y = _label_values(caller, y)
    frame = _as_frame(data)
    if frame is None:
        X = as_float_array(data)
        if X.ndim != 2:
            raise ValueError(
                f"{caller}: an activation array must be 2-D (rows, features), got "
                f"shape {X.shape}; use activation_matrix(frame) to build one"
            )
        if y is None or isinstance(y, (str, Mapping)):
            raise ValueError(
                f"{caller}: with an array, y must be one label per row "
                "(column names and {request: label} mappings need a records frame)"
            )
        if isinstance(group_by, str) and group_by != "auto":
            raise ValueError(
                f"{caller}: with an array, group_by must be one group id per row "
                f"(a column name such as {group_by!r} needs a records frame)"
            )
        groups = None if group_by is None or isinstance(group_by, str) else _groups(
            caller, group_by, len(X))

        def where(rows: Any) -> str:
            names = None if groups is None else groups.tolist()  # plain 'r1', not np.str_
            return _first_few([
                f"row {row}" + ("" if names is None else f" (group {names[row]!r})")
                for row in rows[:_NAMED_ROWS + 1]
            ])

        _refuse_unlabelled(caller, missing_labels(y), where)
        _refuse_non_finite(caller, X, where)
        return X, np.asarray(y), groups, layer, tensor_type, projected

    selected = select_one_site(frame, caller, point=point, layer=layer,
                               tensor_type=tensor_type)
    layer = int(selected["layer"].iloc[0])
    tensor_type = str(selected["tensor_type"].iloc[0])
    X = activation_matrix(selected, dtype="float64")
    # (a store's records_frame marks a project:K point on its activations)
    activations = selected.attrs.get(ACTIVATIONS_KEY)
    if isinstance(activations, Activations):
        projected = activations.projected.get(str(selected["point"].iloc[0]))
    labels = frame_labels(frame, selected, y, caller)
    _refuse_non_finite(caller, X, lambda rows: _first_few([
        f"request {request!r} token_index {token} layer {row_layer}"
        for request, token, row_layer in selected[["request", "token_index", "layer"]]
        .iloc[rows[:_NAMED_ROWS + 1]].itertuples(index=False)
    ], separator="; "))
    # (a sequence of group ids is compared with no string: an array would compare
    # element by element)
    if isinstance(group_by, str) and group_by == "auto":
        groups = request_groups(selected["request"].to_numpy())
    elif group_by is None:
        groups = None
    elif isinstance(group_by, str):
        groups = frame_column(selected, group_by, f"{caller}: group_by").to_numpy()
    else:
        aligned = _series_rows(group_by, frame, selected, caller, "group_by") if _is_series(
            group_by) else None
        groups = _groups(caller, group_by if aligned is None else aligned, len(X))
    return X, labels, groups, layer, tensor_type, projected


def _label_values(caller: str, y: Any) -> Any:
    """``y`` as given when it is None, a column name or a mapping; per-row labels as
    a sequence (an iterator is read once), refused naming ``y`` when they are a
    single value or not one label per row (a 2-D array)."""
    import numpy as np

    if y is None or isinstance(y, str | Mapping):
        return y
    accepted = ("y must be one label per row (a list or 1-D array), a column name or "
                "{request: label}")
    if isinstance(y, bytes) or not isinstance(y, Iterable):
        raise TypeError(f"{caller}: {accepted}; got {type(y).__name__} ({y!r:.40})")
    if not hasattr(y, "__len__"):
        y = list(y)
    shape = np.asarray(y, dtype=object).shape  # (ragged rows stay 1-D, refused later)
    if len(shape) != 1:
        raise ValueError(f"{caller}: {accepted}; got {len(shape)}-D labels (shape "
                         f"{shape}); flatten a column of labels first (y.ravel())")
    return y


def _groups(caller: str, group_by: Any, rows: int) -> Any:
    """``group_by`` 's group ids as an array, one per row of the design."""
    import numpy as np

    groups = np.asarray(group_by)
    if groups.shape != (rows,):
        raise ValueError(
            f"{caller}: group_by gives {groups.size} group id(s) (shape {groups.shape}) "
            f"for {rows} row(s); give one per row, a column name, \"auto\" or None"
        )
    return groups


def _refuse_unlabelled(caller: str, missing: Any, where: Any) -> None:
    """Raise when any label is missing; ``where(row positions)`` says where."""
    import numpy as np

    rows = np.flatnonzero(missing)
    if len(rows):
        raise ValueError(
            f"{caller}: {len(rows)} {'row has' if len(rows) == 1 else 'rows have'} no label "
            f"(None or NaN): {where(rows)}; label every row that is fitted, or drop the "
            "unlabelled ones first"
        )


def _refuse_non_finite(caller: str, X: Any, where: Any) -> None:
    """Raise when an activation row holds NaN or infinity; ``where(row positions)`` says where."""
    rows = non_finite_rows(X)
    if len(rows):
        raise ValueError(
            f"{caller}: {len(rows)} activation {'row' if len(rows) == 1 else 'rows'} of "
            f"{len(X)} {'holds' if len(rows) == 1 else 'hold'} NaN or infinity: "
            f"{where(rows)}; drop those rows (or fix the capture) first"
        )


_NAMED_ROWS = 5
"""How many offending rows (or requests) an error message names."""


def _first_few(places: list[str], separator: str = ", ") -> str:
    """The first ``_NAMED_ROWS`` of ``places`` joined, with `` ...`` when there are more."""
    more = " ..." if len(places) > _NAMED_ROWS else ""
    return separator.join(places[:_NAMED_ROWS]) + more


def _as_frame(data: Any) -> Any:
    """A records frame for frame-like input, None for plain arrays."""
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - notebook extra missing
        pd = None
    if pd is not None and isinstance(data, pd.DataFrame):
        return data
    if hasattr(data, "records") or (
        isinstance(data, (list, tuple)) and data
        and (isinstance(data[0], ActivationRecord) or hasattr(data[0], "records"))
    ):
        return records_frame(data)
    return None


def frame_labels(frame: Any, selected: Any, y: Any, caller: str, argument: str = "y", *,
                 unlabelled: str = "refuse") -> Any:
    """One label per selected row, from per-row labels, a column or ``{request: label}``.

    ``selected`` is ``frame`` filtered to the rows used. Per-row labels are labels
    of either: a pandas Series is aligned with the rows by its index (as pandas
    aligns), a list or array by position. Rows whose label is missing (None or
    NaN) are refused, naming their requests; ``unlabelled="keep"`` gives them
    None instead (an object array: a plot draws them, a fit could not).
    ``fit_linear_probe`` and ``projection_figure`` both read their labels here
    (``argument`` names the parameter in messages).
    """
    import numpy as np

    if y is None:
        raise ValueError(
            f"{caller}: give labels {argument} (per row, a column name, or "
            "{request: label})"
        )
    if isinstance(y, str):
        given = frame_column(selected, y, f"{caller}: {argument}").to_numpy()
        missing = missing_labels(given)
    elif isinstance(y, Mapping):
        given = label_rows(selected, y)
        missing = missing_labels(given)
    elif _is_series(y) and (aligned := _series_rows(y, frame, selected, caller)) is not None:
        given, missing = aligned, missing_labels(aligned)
    elif len(y) == len(selected):
        given, missing = y, missing_labels(y)
    elif len(y) == len(frame):
        rows = frame.index.get_indexer(selected.index)
        given, missing = np.asarray(y)[rows], missing_labels(y)[rows]
    else:
        raise ValueError(
            f"{caller}: {len(y)} labels, but the frame has {len(frame)} rows and "
            f"{len(selected)} after filtering; give one label per row"
        )

    def where(rows: Any) -> str:
        requests = sorted({str(request) for request in selected["request"].iloc[rows]})
        more = " ..." if len(requests) > _NAMED_ROWS else ""
        return f"request(s) {requests[:_NAMED_ROWS]}{more}"

    if unlabelled == "keep":
        kept = np.array(given, dtype=object)  # (a copy: given may be a read-only view)
        kept[np.asarray(missing, dtype=bool)] = None
        return kept
    _refuse_unlabelled(caller, missing, where)
    return np.asarray(given)


def _is_series(values: Any) -> bool:
    """Whether ``values`` is a pandas Series (pandas is not imported to ask)."""
    return hasattr(values, "reindex") and hasattr(values, "index") and hasattr(values, "name")


def _series_rows(y: Any, frame: Any, selected: Any, caller: str,
                 what: str = "labels") -> Any:
    """The values a pandas Series ``y`` (the ``what``) gives the ``selected`` rows
    of ``frame``, aligned by its index as pandas aligns (so a frame sorted after the
    Series was built from it still gets each row's own value), or None for a Series
    with the default index (0, 1, ...) that is not the frame's own: that one is
    read by position, as a list (see ``reads_by_position``).

    An index that does not cover every selected row, or that repeats a value, is
    refused: read by position, it would give rows other rows' values, silently."""
    labels, rows = y.index, selected.index
    if reads_by_position(y, frame.index, (len(frame), len(selected))):
        return None
    aligned = series_by_row(y, rows)
    if aligned is not None or is_default_index(labels):
        return aligned

    def shown(index: Any) -> str:
        return f"{index[:3].tolist()}{' ...' if len(index) > 3 else ''}"

    if not labels.is_unique:
        problem = (f"repeats index value(s) "
                   f"{labels[labels.duplicated()].unique()[:5].tolist()}")
    elif not rows.is_unique:
        problem = (f"cannot say which of the frame's rows it labels: the frame's index "
                   f"repeats value(s) {rows[rows.duplicated()].unique()[:5].tolist()}")
    else:
        problem = (f"has no value for {int((~rows.isin(labels)).sum())} of the "
                   f"{len(rows)} selected rows (their index: {shown(rows[~rows.isin(labels)])})")
    raise ValueError(
        f"{caller}: the {what} Series (index {shown(labels)}, {len(labels)} values) "
        f"{problem}; a Series is aligned with the frame's rows by its index, as pandas "
        "aligns: build it from the frame (a column, or e.g. frame['request'].map(...)), "
        "give a column name (or for labels {request: label}), or pass a list or array "
        "(series.to_numpy()) to read it by position"
    )


def _sorted_classes(labels: Any) -> list[Any]:
    return sorted(set(labels.tolist()), key=lambda value: (str(type(value)), value))


def _order_positive_last(classes: list[Any], positive: Any) -> list[Any]:
    """``classes`` with ``positive`` (the label a two-class score means) last."""
    if positive is None:
        return classes
    if positive not in classes:
        raise ValueError(f"fit_linear_probe: positive={positive!r} is not among the labels "
                         f"{classes!r}; pass one of them")
    if len(classes) != 2:
        raise ValueError(f"fit_linear_probe: positive= chooses what a two-label probe scores, "
                         f"but there are {len(classes)} labels {classes!r} (softmax gives one "
                         "score per label); drop positive=")
    return [c for c in classes if c != positive] + [positive]


def _split(labels: Any, groups: Any, test_size: float, seed: int) -> tuple[Any, Any]:
    """Train and held-out row indices; stratified, and by group when groups are given."""
    import numpy as np

    rows = np.arange(len(labels))
    if not 0 <= test_size < 1:
        raise ValueError(f"fit_linear_probe: test_size must be in [0, 1), got {test_size}")
    if test_size == 0:
        return rows, rows[:0]
    if groups is None:
        from sklearn.model_selection import train_test_split

        _, counts = np.unique(labels, return_counts=True)
        stratify = labels if counts.min() >= 2 else None
        train, test = train_test_split(
            rows, test_size=test_size, random_state=seed, stratify=stratify
        )
        return np.sort(train), np.sort(test)
    names, group_of = np.unique(groups, return_inverse=True)
    n_groups = len(names)
    if n_groups < 2:
        raise ValueError(
            "fit_linear_probe: a held-out split by request needs at least two requests; "
            "pass test_size=0 or group_by=None"
        )
    # Whole groups held out, test_size of them to the nearest group (at least
    # one, never all), stratified: each label's groups (a group's label: its
    # most frequent) give their share, by largest remainder, drawn at random.
    wanted = min(max(1, round(test_size * n_groups)), n_groups - 1)
    classes, label_of = np.unique(labels, return_inverse=True)
    counts = np.zeros((n_groups, len(classes)), dtype=np.int64)
    np.add.at(counts, (group_of, label_of), 1)
    group_label = counts.argmax(axis=1)
    rng = np.random.default_rng(seed)
    members = [rng.permutation(np.flatnonzero(group_label == c)) for c in range(len(classes))]
    exact = np.array([wanted * len(each) / n_groups for each in members])
    share = np.floor(exact).astype(np.int64)
    left = wanted - int(share.sum())
    # (the largest remainders first; ties in a random order)
    order = sorted(range(len(members)), key=lambda c: (-(exact[c] - share[c]), rng.random()))
    for c in order[:left]:
        share[c] += 1
    held = np.concatenate([each[:n] for each, n in zip(members, share, strict=True)])
    test = rows[np.isin(group_of, held)]
    return np.setdiff1d(rows, test), test


def _metrics(
    fit: LinearProbeFit, X: Any, labels: Any, train: Any, test: Any, grouped: bool
) -> dict[str, Any]:
    import numpy as np

    def accuracy(rows: Any) -> float:
        if len(rows) == 0:
            return math.nan
        return float(np.mean(fit.predict(X[rows]) == labels[rows]))

    test_auc = math.nan
    chance = math.nan
    if len(test):
        from sklearn.metrics import roc_auc_score

        present = set(labels[test].tolist())
        chance = max(np.mean(labels[test] == value) for value in present)
        if len(present) == len(fit.classes):
            proba = fit.predict_proba(X[test])
            if fit.link == "sigmoid":
                positive = labels[test] == fit.classes[1]
                test_auc = float(roc_auc_score(positive, proba[:, 1]))
            else:
                test_auc = float(
                    roc_auc_score(labels[test], proba, multi_class="ovr", labels=list(fit.classes))
                )
    return {
        "train_accuracy": accuracy(train),
        "test_accuracy": accuracy(test),
        "test_auc": test_auc,
        "chance_accuracy": float(chance),
        "n_train": int(len(train)),
        "n_test": int(len(test)),
        "n_features": int(X.shape[1]),
        "n_classes": len(fit.classes),
        "split": "request" if grouped else "row",
    }


def save_linear_probe(fit: LinearProbeFit, path: str | os.PathLike[str]) -> Path:
    """Write ``fit`` in the ``undercurrent.linear_probe/1`` format; returns the path.

    A fit on projected vectors is saved over the captured activations (its
    projection folded in, see :meth:`LinearProbeFit.raw_weights`), with the
    folded reduction in the metadata (``folded_reduction``)."""
    weight, bias = fit.raw_weights()
    metadata = {"metrics": json.dumps(_json_safe(fit.metrics))}
    if fit.projected is not None:
        metadata["folded_reduction"] = fit.projected
    return save_linear_weights(
        path,
        weight,
        bias,
        link=fit.link,
        threshold=float(fit.threshold),
        layer=None if fit.layer is None else int(fit.layer),
        tensor_type=None if fit.tensor_type is None else str(fit.tensor_type),
        label_names=list(fit.label_names),
        metadata=metadata,
    )


def _json_safe(metrics: Mapping[str, Any]) -> dict[str, Any]:
    safe: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, float) and math.isnan(value):
            safe[key] = None
        elif hasattr(value, "item"):
            safe[key] = value.item()
        else:
            safe[key] = value
    return safe
