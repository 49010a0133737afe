"""Normalise what users hand the notebook layer into flat lists of records or results.

Frames and plots accept whatever a researcher has at hand: a list of
``ActivationRecord``s, one ``GenerationOutput`` or a list of them (anything with
``.records`` / ``.results``), a ``{point name: ProbeResult}`` dict, or a list of
those. These helpers flatten all of that, in order, and find the rows of what
they hold that a fit cannot use (missing labels, non-finite activations).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from undercurrent.records import ActivationRecord, ProbeResult


def flatten_records(source: Any) -> list[ActivationRecord]:
    """Every ``ActivationRecord`` in ``source``, in order.

    Accepts a record, an iterable of records, an object with a ``records``
    attribute (a ``GenerationOutput``) or ``records()`` method (a batch), or an
    iterable of such objects.
    """
    found: list[ActivationRecord] = []
    _collect_records(source, found, where="records")
    return found


def _collect_records(source: Any, found: list[ActivationRecord], where: str) -> None:
    if source is None:
        return
    if isinstance(source, ActivationRecord):
        found.append(source)
        return
    if hasattr(source, "records") and not isinstance(source, (str, bytes, Mapping)):
        records = source.records
        if callable(records):  # a batch that builds its records on demand
            _collect_records(records(), found, where=f"{where}.records()")
        elif records is None:
            raise ValueError(
                f"{where}: {type(source).__name__} {getattr(source, 'request_id', '')!r} "
                "holds no records: generate with records=True to keep them")
        else:
            _collect_records(records, found, where=f"{where}.records")
        return
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes, Mapping)):
        for index, item in enumerate(source):
            _collect_records(item, found, where=f"{where}[{index}]")
        return
    raise TypeError(
        f"{where}: expected ActivationRecord objects (or GenerationOutputs carrying "
        f"them in .records, generated with records=True), got {type(source).__name__}"
    )


def flatten_results(source: Any) -> list[ProbeResult]:
    """Every ``ProbeResult`` in ``source``, in order.

    Accepts a result, a ``{point name: ProbeResult}`` mapping, an object with a
    ``results`` attribute (a ``GenerationOutput``), or an iterable of any of these.
    """
    found: list[ProbeResult] = []
    _collect_results(source, found, where="results")
    return found


def _collect_results(source: Any, found: list[ProbeResult], where: str) -> None:
    if source is None:
        return
    if isinstance(source, ProbeResult):
        found.append(source)
        return
    if isinstance(source, Mapping):
        for key, item in source.items():
            _collect_results(item, found, where=f"{where}[{key!r}]")
        return
    if hasattr(source, "results") and not isinstance(source, (str, bytes)):
        _collect_results(source.results, found, where=f"{where}.results")
        return
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes)):
        for index, item in enumerate(source):
            _collect_results(item, found, where=f"{where}[{index}]")
        return
    raise TypeError(
        f"{where}: expected ProbeResult objects, {{point name: ProbeResult}} dicts or "
        f"GenerationOutputs (with .results), got {type(source).__name__}"
    )


def tensor_to_numpy(tensor: Any) -> tuple[Any, str]:
    """``(numpy array, original dtype name)`` for a torch tensor or array-like.

    Torch dtypes numpy cannot hold (bfloat16, float8) are widened to float32; the
    returned name is always the original one (``"bfloat16"``), so nothing is lost
    about what the model produced. Torch is never imported here.
    """
    import numpy as np

    if hasattr(tensor, "detach"):
        detached = tensor.detach().cpu()
        dtype_name = str(detached.dtype).removeprefix("torch.")
        try:
            array = detached.numpy()
        except TypeError:
            array = detached.float().numpy()
        return array, dtype_name
    array = np.asarray(tensor)
    name = _DTYPE_NAMES.get(array.dtype)
    if name is None:  # numpy's dtype.name is slow; frames ask once per record
        name = _DTYPE_NAMES[array.dtype] = array.dtype.name
    return array, name


_DTYPE_NAMES: dict[Any, str] = {}


def missing_labels(labels: Any) -> Any:
    """A boolean numpy mask over ``labels``: True where a label is missing (None,
    NaN, or pandas' ``NA``).

    Look at the labels as given, before ``np.asarray``: numpy turns
    ``["benign", float("nan")]`` into the strings ``"benign"`` and ``"nan"``, and
    the missing label would pass for a label like any other.
    """
    import numpy as np

    if isinstance(labels, np.ndarray) and labels.ndim == 1 and labels.dtype.kind != "O":
        if labels.dtype.kind in "fc":
            return np.isnan(labels)
        return np.zeros(len(labels), dtype=bool)
    return np.fromiter((is_missing_label(value) for value in labels), dtype=bool,
                       count=len(labels))


def is_missing_label(value: Any) -> bool:
    """Whether one label is missing: None, a float NaN, or pandas' ``NA``."""
    import numpy as np

    if value is None:
        return True
    if isinstance(value, (float, np.floating)):
        return math.isnan(value)
    pandas = sys.modules.get("pandas")  # pandas' NA can only come from pandas, if loaded
    return pandas is not None and value is pandas.NA


def series_by_row(values: Any, rows: Any) -> Any:
    """What a pandas Series ``values`` gives the rows labelled ``rows`` (their
    pandas index), aligned by label as pandas aligns (``values.reindex(rows)``), in
    whatever order either holds them; None when its index does not hold each row's
    label exactly once: it then says something else (a position, a prompt).

    The one reading of a Series as per-row labels (or group ids) for every route
    into a fit: a records frame and an activation store or its views."""
    labels = values.index
    if labels.equals(rows):  # (the Series of this very frame: also with repeated labels)
        return values.to_numpy()
    if labels.is_unique and rows.is_unique and rows.isin(labels).all():
        return values.reindex(rows).to_numpy()
    return None


def reads_by_position(values: Any, own: Any, lengths: Sequence[int]) -> bool:
    """Whether a pandas Series ``values`` is read by position, as a list: its index
    is the default ``0, 1, ...`` of a Series built from a list, it is not the rows'
    own (``own``: the index of the frame, or of the store's selected rows, in any
    order) and it has as many values as a list may (``lengths``: one per selected
    row, or per frame row, or per prompt of a store). Asked before
    ``series_by_row``: that a default index happens to hold the rows' labels says
    nothing (on a part of a store, the rows' labels 0..7 lie within one label per
    prompt's 0..11).

    The one rule for every route into a fit: a records frame and an activation
    store or its views."""
    labels = values.index
    return (is_default_index(labels) and len(values) in lengths
            and not (len(labels) == len(own) and own.isin(labels).all()))


def is_default_index(labels: Any) -> bool:
    """Whether a pandas index is the default ``0, 1, ...`` of a Series built from a
    list: one that, unless it is the rows' own, says only positions."""
    import pandas as pd

    return isinstance(labels, pd.RangeIndex) and labels.start == 0 and labels.step == 1


def request_groups(requests: Any) -> Any:
    """The groups ``group_by="auto"`` splits by: ``requests`` (one request id per
    row) as an array when some request has several rows, else None (one row per
    request: a split by row already keeps each request on one side).

    The one rule for every route into a fit (a records frame, an activation
    store or one of its views), so the same rows with the same seed give the
    same held-out split whichever way they came."""
    import numpy as np

    ids = np.asarray(requests, dtype=object)
    return ids if len(np.unique(ids)) < len(ids) else None


def non_finite_rows(matrix: Any) -> Any:
    """Positions of the rows of a 2-D array holding a NaN or an infinity."""
    import numpy as np

    return np.flatnonzero(~np.isfinite(matrix).all(axis=1))
