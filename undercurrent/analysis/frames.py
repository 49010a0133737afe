"""Tidy pandas frames over records, signals and results.

Every frame is long format (one row per record, per signal, or per result) with
the stable column names listed in ``RECORD_COLUMNS``, ``SIGNAL_COLUMNS`` and
``RESULT_COLUMNS``; new columns may be appended in later versions, existing ones
are never renamed. See ``docs/notebook.md`` for what each column holds.

A records frame holds index columns only; the activations themselves are 2-D
numpy matrices kept beside it (``frame.attrs["activations"]``, an
:class:`Activations`), with the ``row`` column pointing into them, and
:func:`activation_matrix` hands them out without copying where it can.

>>> frame = records_frame(output.records, tokenizer=model.backend.tokenizer)  # doctest: +SKIP
>>> X = activation_matrix(frame, layer=2)      # (rows, features), no copy  # doctest: +SKIP
"""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from undercurrent.analysis._inputs import (
    flatten_records,
    flatten_results,
    tensor_to_numpy,
)
from undercurrent.arguments import check_flag
from undercurrent.records import ActivationRecord, ProbeResult, SignalAction

RECORD_COLUMNS: tuple[str, ...] = (
    "request",
    "point",
    "layer",
    "tensor_type",
    "token_index",
    "is_generated",
    "generated_index",
    "token_id",
    "token_text",
    "timestamp",
    "dtype",
    "shape",
    "edits",
    "row",
    "activations_id",
)
"""Columns of :func:`records_frame`, in order.

``request`` (request id), ``point`` (extraction point name), ``layer``,
``tensor_type``, ``token_index`` (absolute in prompt + generated),
``is_generated``, ``generated_index`` (nullable; <NA> for prompt tokens),
``token_id`` (nullable), ``token_text`` (the decoded token when a tokenizer was
given, else None), ``timestamp`` (seconds since the epoch), ``dtype`` (the
captured tensor's original dtype name, e.g. ``"bfloat16"``), ``shape`` (tuple),
``edits`` (tuple of the live edits applied at this site, empty when none),
``row`` (the record's row in the activation matrix of its size, see
:class:`Activations`), ``activations_id`` (the ``id`` of the :class:`Activations`
holding that matrix: rows of several records frames joined with ``pd.concat``
carry several, and the frame's activations hold only one frame's rows, so
:func:`activation_matrix` refuses the others). The activations are no column:
:func:`activation_matrix` gives them as one ``(rows, features)`` array (earlier
versions had a ``tensor`` column of arrays, which :func:`activation_matrix` still
reads).
"""

ACTIVATIONS_KEY = "activations"
"""The ``DataFrame.attrs`` key of a records frame's :class:`Activations`."""


class Activations:
    """The activations behind a records frame: one C-contiguous 2-D numpy matrix per
    row size (``features``: a record's tensor flattened; hidden-size rows and ``kv``
    rows live in separate matrices), rows grouped by (point, layer, tensor type) and
    in record order within a group, so one site's rows are one contiguous block.
    Dtypes numpy lacks (bfloat16) are stored as float32.

    It rides in ``frame.attrs["activations"]``, which pandas carries by reference
    through row selections, column selections, sorting, ``copy`` and ``concat`` of
    the same frame; ``merge`` drops ``attrs``: merge other frames onto a records
    frame's columns, then ``merged.attrs.update(frame.attrs)``. ``id`` is the
    frame's ``activations_id`` column: a row whose id is another one belongs to
    another frame's activations (as after ``pd.concat`` of two records frames)
    and is refused.

    ``projected`` maps each point whose rows are projections of the captured
    activations (an activation store's ``project:K`` reduction) to ``(reduction,
    (captured features, K) matrix, or None when the store cannot rebuild it)``:
    the mark rides with the matrices, so a fit on the frame folds the projection
    as a fit on the store does, and a frame that lost it has no activations to fit.
    """

    def __init__(self, matrices: Mapping[int, Any],
                 projected: Mapping[str, tuple[str, Any]] | None = None) -> None:
        self.matrices: dict[int, Any] = dict(matrices)
        self.projected: dict[str, tuple[str, Any]] = dict(projected or {})
        self.id = new_activations_id()

    def matrix(self, features: int) -> Any:
        """The matrix of rows with ``features`` values."""
        return self.matrices[features]

    def __deepcopy__(self, memo: Any) -> Activations:
        # pandas deep-copies attrs on every operation: share the matrices instead.
        return self

    def __repr__(self) -> str:
        shapes = ", ".join(f"{m.shape[0]}x{m.shape[1]} {m.dtype}" for m in self.matrices.values())
        return f"Activations({shapes})"


def new_activations_id() -> int:
    """A fresh ``activations_id``: random, not counted, so a frame pickled in one
    process never shares its id with one built in another."""
    return secrets.randbits(63)


SIGNAL_COLUMNS: tuple[str, ...] = (
    "request",
    "point",
    "signal_index",
    "layer",
    "token_index",
    "generated_index",
    "action",
    "score",
    "flagged",
    "timestamp",
    "metadata",
)
"""Columns of :func:`signals_frame`, in order.

``signal_index`` counts a result's signals from 0 in emission order; ``layer``,
``token_index`` and ``generated_index`` say which activation the signal judged:
from the ``GenerationOutput``'s located signals (inline points) or from the
signal's metadata keys of the same names (nullable when neither knows); ``action`` is
``"continue"``, ``"flag"`` or ``"abort"``; ``score`` is a float (NaN when the probe
gave none); ``flagged`` is True for flag and abort; ``metadata`` is the signal's
metadata as a dict.
"""

RESULT_COLUMNS: tuple[str, ...] = (
    "request",
    "point",
    "verdict",
    "flagged",
    "aborted",
    "n_signals",
    "n_flags",
    "max_score",
    "mean_score",
    "last_score",
    "error",
    "received",
    "processed",
    "dropped",
    "errors",
    "timeouts",
    "mean_latency_s",
)
"""Columns of :func:`results_frame`, in order.

``verdict`` is whatever the probe's ``on_end`` returned; ``flagged`` is True when
any signal flagged or aborted; ``aborted`` when any signal asked to abort;
``n_signals``/``n_flags`` count signals and non-continue signals;
``max_score``/``mean_score``/``last_score`` summarise the signals' scores, a NaN score
counting as no score like None (NaN when there are none); ``error`` is the probe's
error or None; the last six columns are the binding's ``ProbeStats``.
"""

# Signal metadata keys that locate a signal on the token axis.
_LOCATION_KEYS = ("layer", "token_index", "generated_index")


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "undercurrent's notebook frames need pandas: pip install 'undercurrent[notebook]'"
        ) from error
    return pd


def records_frame(records: Any, *, tokenizer: Any = None, tensors: bool = True) -> Any:
    """One row per ``ActivationRecord``, with the columns in ``RECORD_COLUMNS``, and
    the activations as 2-D matrices beside it (``frame.attrs["activations"]``, read
    with :func:`activation_matrix`).

    ``records`` is a list of records, a ``GenerationOutput`` generated with
    ``records=True``, a list of them, or anything with a ``records()`` method
    returning records. ``tokenizer`` (anything with ``decode(list_of_ids)``) fills
    ``token_text``. ``tensors=False`` builds the index columns alone (a lighter
    frame; :func:`activation_matrix` then refuses it).

    >>> frame = records_frame(outputs)                       # doctest: +SKIP
    >>> X = activation_matrix(frame, point="resid", layer=2)  # doctest: +SKIP
    """
    import numpy as np

    check_flag("records_frame: tensors", tensors)
    pd = _pandas()
    flat = flatten_records(records)
    decode = _token_decoder(tokenizer, "records_frame")
    arrays: list[Any] = []
    columns: dict[str, list[Any]] = {name: [] for name in RECORD_COLUMNS}
    for record in flat:
        array, dtype_name = tensor_to_numpy(record.tensor)
        arrays.append(array)
        _add_record(columns, record, decode, dtype_name, array.shape)
    frame = _typed_record_frame(pd.DataFrame(columns, columns=list(RECORD_COLUMNS)))
    order = _site_order(frame)
    positions = np.empty(len(flat), dtype=np.int64)
    matrices: dict[int, Any] = {}
    if tensors:
        by_size: dict[int, list[int]] = {}
        for index in order:
            by_size.setdefault(int(arrays[index].size), []).append(index)
        for size, members in by_size.items():
            matrices[size] = np.stack([arrays[i].reshape(-1) for i in members])
            positions[members] = np.arange(len(members))
    else:
        positions[order] = np.arange(len(order))
    frame["row"] = positions
    if tensors:
        activations = Activations(matrices)
        frame["activations_id"] = activations.id
        frame.attrs[ACTIVATIONS_KEY] = activations
    else:
        frame["activations_id"] = new_activations_id()
    return frame


def _site_order(frame: Any) -> list[int]:
    """Frame positions grouped by (point, layer, tensor type) in first-seen order,
    record order within a group: the order of the activation matrices' rows."""
    groups: dict[tuple[Any, Any, Any], list[int]] = {}
    sites = zip(frame["point"].tolist(), frame["layer"].tolist(),
                frame["tensor_type"].tolist(), strict=True)
    for position, site in enumerate(sites):
        groups.setdefault(site, []).append(position)
    return [position for members in groups.values() for position in members]


def _add_record(
    columns: dict[str, list[Any]], record: ActivationRecord, decode: Any, dtype_name: str,
    shape: tuple[int, ...],
) -> None:
    """Append one record's index values to the frame's column lists."""
    columns["request"].append(record.request_id)
    columns["point"].append(record.extraction_point_name)
    columns["layer"].append(record.layer)
    columns["tensor_type"].append(str(getattr(record.tensor_type, "value", record.tensor_type)))
    columns["token_index"].append(record.token_index)
    columns["is_generated"].append(record.is_generated)
    columns["generated_index"].append(record.generated_index)
    columns["token_id"].append(record.token_id)
    columns["token_text"].append(decode(record.token_id))
    columns["timestamp"].append(record.timestamp)
    columns["dtype"].append(dtype_name)
    columns["shape"].append(tuple(shape))
    columns["edits"].append(tuple(record.edits))
    columns["row"].append(0)
    columns["activations_id"].append(0)


def _typed_record_frame(frame: Any) -> Any:
    """Give the record columns their documented dtypes (nullable ints where needed),
    the same for an empty frame as for a full one (pandas would make an empty
    column float64, and a column of decoded texts ``str``)."""
    types = {
        "request": "object",
        "point": "object",
        "layer": "int64",
        "tensor_type": "object",
        "token_index": "int64",
        "is_generated": "bool",
        "generated_index": "Int64",
        "token_id": "Int64",
        "token_text": "object",
        "timestamp": "float64",
        "dtype": "object",
        "shape": "object",
        "edits": "object",
        "row": "int64",
        "activations_id": "int64",
    }
    return frame.astype({k: v for k, v in types.items() if k in frame.columns})


def _token_decoder(tokenizer: Any, caller: str) -> Any:
    if tokenizer is None:
        return lambda token_id: None
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"{caller}: tokenizer must have a decode(list_of_ids) method (a "
                        f"model's backend.tokenizer), or be None; got "
                        f"{type(tokenizer).__name__} ({tokenizer!r:.40})")
    cache: dict[int, str] = {}

    def decode(token_id: int | None) -> str | None:
        if token_id is None:
            return None
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([int(token_id)])
        return cache[token_id]

    return decode


def signals_frame(results: Any) -> Any:
    """One row per ``ProbeSignal``, with the columns in ``SIGNAL_COLUMNS``.

    ``results`` is a ``GenerationOutput`` or a list of them, a ``{point name:
    ProbeResult}`` dict, a list of those, or a list of ``ProbeResult``s. Each
    signal says where it was emitted (its ``layer``, ``token_index`` and
    ``generated_index``); a signal built by hand without them falls back to
    the same keys in its metadata (Python or numpy numbers; NaN counts as missing).
    """
    pd = _pandas()
    rows: list[dict[str, Any]] = []
    for result in flatten_results(results):
        for index, signal in enumerate(result.signals):
            metadata = dict(signal.metadata)
            row: dict[str, Any] = {
                "request": result.request_id,
                "point": result.extraction_point_name,
                "signal_index": index,
            }
            located = getattr(signal, "token_index", None) is not None
            for key in _LOCATION_KEYS:
                value = getattr(signal, key, None) if located else metadata.get(key)
                row[key] = _location(value)
            row.update(
                action=SignalAction(signal.action).value,
                score=_score(signal.score),
                flagged=signal.action is not SignalAction.CONTINUE,
                timestamp=signal.timestamp,
                metadata=metadata,
            )
            rows.append(row)
    frame = pd.DataFrame(rows, columns=list(SIGNAL_COLUMNS))
    return frame.astype(
        {
            "request": "object",
            "point": "object",
            "signal_index": "int64",
            "layer": "Int64",
            "token_index": "Int64",
            "generated_index": "Int64",
            "action": "object",
            "score": "float64",
            "flagged": "bool",
            "timestamp": "float64",
        }
    )


def _location(value: Any) -> int | None:
    """A location from a signal or its metadata as an int: Python or numpy numbers
    count; None, NaN (and infinity) and anything else are missing."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return int(number) if math.isfinite(number) else None


def results_frame(results: Any) -> Any:
    """One row per ``ProbeResult``, with the columns in ``RESULT_COLUMNS``.

    ``max_score``, ``mean_score`` and ``last_score`` are over the signals that have
    a score: a NaN score counts as no score, like None, so they do not depend on
    where a NaN falls, and are NaN only when no signal has a score.
    """
    pd = _pandas()
    rows = [_result_row(result) for result in flatten_results(results)]
    frame = pd.DataFrame(rows, columns=list(RESULT_COLUMNS))
    return frame.astype(
        {
            "request": "object",
            "point": "object",
            "flagged": "bool",
            "aborted": "bool",
            "n_signals": "int64",
            "n_flags": "int64",
            "max_score": "float64",
            "mean_score": "float64",
            "last_score": "float64",
            "received": "int64",
            "processed": "int64",
            "dropped": "int64",
            "errors": "int64",
            "timeouts": "int64",
            "mean_latency_s": "float64",
        }
    )


def _score(score: float | None) -> float:
    """A signal's score as a float, NaN when it has none."""
    return math.nan if score is None else float(score)


def _result_row(result: ProbeResult) -> dict[str, Any]:
    # NaN is "no score", like None: max() would otherwise depend on where it falls.
    scores = [score for score in (_score(s.score) for s in result.signals)
              if not math.isnan(score)]
    actions = [SignalAction(s.action) for s in result.signals]
    stats = result.stats
    return {
        "request": result.request_id,
        "point": result.extraction_point_name,
        "verdict": result.verdict,
        "flagged": any(action is not SignalAction.CONTINUE for action in actions),
        "aborted": any(action is SignalAction.ABORT for action in actions),
        "n_signals": len(actions),
        "n_flags": sum(action is not SignalAction.CONTINUE for action in actions),
        "max_score": max(scores) if scores else math.nan,
        "mean_score": sum(scores) / len(scores) if scores else math.nan,
        "last_score": scores[-1] if scores else math.nan,
        "error": result.error,
        "received": stats.received,
        "processed": stats.processed,
        "dropped": stats.dropped,
        "errors": stats.errors,
        "timeouts": stats.timeouts,
        "mean_latency_s": stats.mean_latency_s,
    }


def activation_matrix(
    frame: Any,
    *,
    point: str | None = None,
    layer: int | None = None,
    tensor_type: str | None = None,
    dtype: str | None = "float32",
) -> Any:
    """The activations of a records frame's rows as one ``(rows, features)`` numpy
    array.

    Rows follow the frame's order (after the optional ``point``/``layer``/
    ``tensor_type`` filters); each tensor is flattened, so ``kv`` records give
    ``2 * heads * head_dim`` features. ``dtype`` (None: as stored) converts.

    No copy is made when the selected rows are one contiguous block of the stored
    matrix (a frame holding one point, layer and tensor type, or a frame filtered
    to one) and ``dtype`` is the stored one (``float32`` for float32 and bfloat16
    models): the result is then a read-only view of the frame's matrix. Other
    selections are gathered (one copy).

    The rows of an activation store's ``project:K`` point are its K projected
    features, as the frame holds them; the array carries no mark of the
    projection (the frame's activations do, ``Activations.projected``), so a
    probe fitted on the array is over the projections: fit on the frame or the
    store, which fold the projection.

    ``frame`` may also be anything :func:`records_frame` takes, or a frame with a
    ``tensor`` column of arrays (earlier versions, the activation store).
    Raises ``ValueError`` when nothing is left or the rows' sizes differ.
    """
    pd = _pandas()
    if not isinstance(frame, pd.DataFrame):
        frame = records_frame(frame)
    selected = _selected_rows(frame, "activation_matrix", point=point, layer=layer,
                              tensor_type=tensor_type)
    check_activations(frame, "activation_matrix")
    if "tensor" in selected.columns:
        return _stack_tensor_column(selected, dtype)
    return _matrix_rows(frame.attrs[ACTIVATIONS_KEY], selected, dtype, "activation_matrix")


def check_activations(frame: Any, caller: str) -> None:
    """Refuse a records frame that carries no activations (built with
    ``tensors=False``, or one that lost ``DataFrame.attrs`` in a merge), naming
    ``caller`` and how to keep them."""
    if "tensor" in frame.columns:
        return
    if not isinstance(frame.attrs.get(ACTIVATIONS_KEY), Activations) or "row" not in frame.columns:
        raise ValueError(
            f"{caller}: this frame carries no activations (built with "
            "tensors=False, or it lost DataFrame.attrs: after a merge onto a records "
            f"frame's columns, merged.attrs.update(frame.attrs); {_ONE_FRAME})"
        )


_ONE_FRAME = (
    "rows of several records frames joined with pd.concat cannot share one frame's "
    "activations: build one frame of all the records, records_frame(outputs_1 + "
    "outputs_2) (for a store, store.records_frame(rows) with every row wanted), or "
    "concatenate each frame's activation_matrix(...)")


def _refuse_foreign_rows(activations: Activations, selected: Any, caller: str) -> None:
    """Refuse rows whose ``activations_id`` is not ``activations``' own: their
    ``row`` numbers point into another frame's matrices, so these would hand out
    the wrong activations without a word."""
    if "activations_id" not in selected.columns:  # (a frame of an earlier version)
        return
    ids = selected["activations_id"].to_numpy()
    foreign = ids != activations.id
    if foreign.any():
        raise ValueError(
            f"{caller}: {int(foreign.sum())} of the {len(ids)} rows come from another "
            f"records frame than the activations this frame carries (the rows are of "
            f"{len(set(ids.tolist()))} records frames, by their activations_id, as after "
            f"pd.concat of records frames, whose attrs hold one frame's activations); "
            f"{_ONE_FRAME}"
        )


def select_one_site(
    frame: Any,
    caller: str,
    *,
    point: str | None = None,
    layer: int | None = None,
    tensor_type: str | None = None,
) -> Any:
    """The rows of a records frame matching the filters, refused (naming
    ``caller``) when none match or when they still mix points, layers or tensor
    types: a fit or a projection reads activations of one space, and rows of two
    layers of the same size would be mixed without a word."""
    selected = _selected_rows(frame, caller, point=point, layer=layer, tensor_type=tensor_type)
    for column, chosen in (("layer", layer), ("point", point), ("tensor_type", tensor_type)):
        values = sorted(selected[column].unique().tolist())
        if len(values) > 1:
            # (unasked, or asked for with a list of several: select_rows keeps any)
            rows = "the frame mixes" if chosen is None else f"{column}={chosen!r} selects"
            raise ValueError(
                f"{caller}: {rows} {column}s {values}, and {caller} reads one; "
                f"pass {column}=... (e.g. {column}={values[0]!r})"
            )
    return selected


def _selected_rows(frame: Any, caller: str, *, point: str | None, layer: int | None,
                   tensor_type: str | None) -> Any:
    selected = select_rows(frame, point=point, layer=layer, tensor_type=tensor_type)
    if selected.empty:
        raise ValueError(
            f"{caller}: no records left after filtering (point={point!r}, "
            f"layer={layer!r}, tensor_type={tensor_type!r}); the frame has points "
            f"{sorted(frame['point'].unique().tolist())} and layers "
            f"{sorted(frame['layer'].unique().tolist())}"
        )
    return selected


def _matrix_rows(activations: Activations, selected: Any, dtype: str | None,
                 caller: str) -> Any:
    """The selected rows of the stored matrix: a read-only view when they are one
    contiguous block in order and no conversion is asked for, else a copy."""
    import numpy as np

    _refuse_foreign_rows(activations, selected, caller)
    sizes = {math.prod(shape) for shape in set(selected["shape"].tolist())}
    if len(sizes) > 1:
        raise ValueError(
            f"activation_matrix: rows have different sizes {sorted(sizes)}; filter to one "
            "point, layer and tensor type first (e.g. activation_matrix(frame, layer=2))"
        )
    matrix = activations.matrix(sizes.pop())
    rows = selected["row"].to_numpy(dtype=np.int64)
    first = int(rows[0])
    if int(rows[-1]) - first == len(rows) - 1 and (np.diff(rows) == 1).all():
        block = matrix[first:first + len(rows)].view()
        if dtype is None or block.dtype == np.dtype(dtype):
            block.flags.writeable = False  # the frame's own activations
            return block
        return block.astype(dtype)
    return matrix[rows] if dtype is None else matrix[rows].astype(dtype, copy=False)


def _stack_tensor_column(selected: Any, dtype: str | None) -> Any:
    """A frame with a ``tensor`` column of arrays (earlier versions, the store)."""
    import numpy as np

    arrays = []
    for position, tensor in enumerate(selected["tensor"]):
        if tensor is None:
            raise ValueError(
                f"activation_matrix: row {position} has no tensor (was the frame built "
                "with tensors=False?)"
            )
        arrays.append(np.asarray(tensor, dtype=dtype).reshape(-1))
    sizes = {array.shape[0] for array in arrays}
    if len(sizes) > 1:
        raise ValueError(
            f"activation_matrix: rows have different sizes {sorted(sizes)}; filter to one "
            "point, layer and tensor type first (e.g. activation_matrix(frame, layer=2))"
        )
    return np.stack(arrays)


def record_tensors(frame: Any) -> list[Any]:
    """Each row's activation as a numpy array of its ``shape``: read-only views into
    the frame's matrices (or the arrays of a frame with a ``tensor`` column); None
    for every row of a frame built with ``tensors=False``."""

    if "tensor" in frame.columns:
        return list(frame["tensor"])
    activations = frame.attrs.get(ACTIVATIONS_KEY)
    if not isinstance(activations, Activations):
        return [None] * len(frame)
    _refuse_foreign_rows(activations, frame, "record_tensors")
    found = []
    for row, shape in zip(frame["row"].tolist(), frame["shape"].tolist(), strict=True):
        view = activations.matrix(math.prod(shape))[row].reshape(shape)
        view.flags.writeable = False
        found.append(view)
    return found


def select_rows(
    frame: Any,
    *,
    point: str | None = None,
    layer: int | Sequence[int] | None = None,
    tensor_type: str | Sequence[str] | None = None,
    request: str | Sequence[str] | None = None,
) -> Any:
    """The rows of a frame matching every filter given (None means any); a list
    (tuple, set or array) of values keeps the rows matching any of them
    (``layer=[2, 3]`` keeps both layers).

    >>> two_layers = select_rows(frame, point="resid", layer=[2, 3])  # doctest: +SKIP
    """
    mask = None
    for column, wanted in (
        ("point", point),
        ("layer", layer),
        ("tensor_type", tensor_type),
        ("request", request),
    ):
        if wanted is None:
            continue
        if column not in frame.columns:
            raise ValueError(f"cannot filter on {column!r}: the frame has no such column")
        if getattr(wanted, "ndim", None) == 0:  # (a numpy or torch scalar: its value)
            wanted = cast(Any, wanted).item()
        if isinstance(wanted, str | bytes) or not isinstance(wanted, Iterable):
            condition = frame[column] == wanted
        else:
            condition = frame[column].isin(list(wanted))
        mask = condition if mask is None else mask & condition
    return frame if mask is None else frame[mask]


def frame_column(frame: Any, name: Any, argument: str) -> Any:
    """Column ``name`` of ``frame``; a ``ValueError`` naming ``argument`` and the
    frame's columns when it has none (not pandas' bare ``KeyError``)."""
    if not isinstance(name, str) or name not in frame.columns:
        raise ValueError(f"{argument}={name!r} names no column of the frame; its columns "
                         f"are {[str(column) for column in frame.columns]}")
    return frame[name]


def label_rows(frame: Any, labels: Mapping[str, Any] | Any, *, by: str = "request") -> Any:
    """Per-row labels for a frame from per-request (or per-``by``) labels.

    ``labels`` maps each value of column ``by`` to its label. Raises ``KeyError``
    naming the values that have no label.
    """
    if not isinstance(labels, Mapping):
        return labels
    keys = frame_column(frame, by, "label_rows: by").tolist()
    missing = sorted({str(key) for key in keys if key not in labels})
    if missing:
        raise KeyError(
            f"label_rows: no label for {by} value(s) {missing[:5]}"
            + (" ..." if len(missing) > 5 else "")
        )
    return [labels[key] for key in keys]


FEATURE_COLUMNS: tuple[str, ...] = (
    "request",
    "point",
    "layer",
    "token",
    "feature",
    "activation",
    "generated_index",
    "token_text",
)
"""Columns of :func:`features_frame`, in order.

``token`` is the absolute token index (prompt + generated) of the activation the
SAE read; ``feature`` the SAE feature id; ``activation`` its value (float64);
``generated_index`` is nullable (<NA> for prompt tokens); ``token_text`` is the
decoded token when a tokenizer was given and the results came as
``GenerationOutput``s (which hold the token ids), else None.
"""


def features_frame(results: Any, *, tokenizer: Any = None) -> Any:
    """One row per (activation, reported SAE feature): ``sae_probe``'s signals in
    long format, with the columns in ``FEATURE_COLUMNS``.

    ``results`` is anything :func:`signals_frame` accepts. Each ``sae_probe``
    signal contributes its ``features`` / ``activations`` (all watched features, or
    the active ones among the top ``top_k``); other probes' signals are skipped.

    >>> frame = features_frame(outputs, tokenizer=model.backend.tokenizer)  # doctest: +SKIP
    >>> frame.pivot_table("activation", "feature", "token")           # doctest: +SKIP
    """
    pd = _pandas()
    signals = signals_frame(results)
    token_ids = _token_ids_by_request(results)
    decode = _token_decoder(tokenizer, "features_frame")
    rows: list[dict[str, Any]] = []
    for signal in signals.itertuples(index=False):
        metadata = signal.metadata
        features = metadata.get("features")
        activations = metadata.get("activations")
        if features is None or activations is None:
            continue
        token = None if pd.isna(signal.token_index) else int(signal.token_index)
        generated = None if pd.isna(signal.generated_index) else int(signal.generated_index)
        ids = token_ids.get(signal.request)
        text = decode(ids[token]) if ids is not None and token is not None and token < len(
            ids) else None
        for feature, value in zip(features, activations, strict=True):
            rows.append({
                "request": signal.request,
                "point": signal.point,
                "layer": None if pd.isna(signal.layer) else int(signal.layer),
                "token": token,
                "feature": int(feature),
                "activation": float(value),
                "generated_index": generated,
                "token_text": text,
            })
    frame = pd.DataFrame(rows, columns=list(FEATURE_COLUMNS))
    return frame.astype({
        "request": "object",
        "point": "object",
        "layer": "Int64",
        "token": "Int64",
        "feature": "int64",
        "activation": "float64",
        "generated_index": "Int64",
        "token_text": "object",
    })


def _token_ids_by_request(results: Any) -> dict[str, list[int]]:
    """``{request id: prompt + generated token ids}`` for the GenerationOutputs in
    ``results`` (a ``ProbeResult`` alone does not know its tokens)."""
    found: dict[str, list[int]] = {}
    # (nested lists and tuples walked as the results are: flatten_results)
    pending = [results]
    while pending:
        item = pending.pop()
        if hasattr(item, "token_ids") and hasattr(item, "prompt_token_ids"):
            found[item.request_id] = [*item.prompt_token_ids, *item.token_ids]
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return found
