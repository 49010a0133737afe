"""Save captured records to parquet and load them back, tensors included.

The file is a plain parquet table with the index columns of ``RECORD_COLUMNS``
(``row`` aside): ``shape`` is a list of ints, ``edits`` a list of strings,
``tensor`` the flattened values (a fixed-size list when every row has the same
size, which is the usual case, else a list) in the array's own numpy dtype, and
``dtype`` the original dtype name. A frame whose activations are an activation
store's ``project:K`` projections keeps that mark (the reduction and its matrix,
in the file's metadata), so a probe fitted on the loaded frame folds the
projection as one fitted on the store does. Loading gives a records frame again (index
columns, activations in matrices beside it), so ``load_records(save_records(...))``
round-trips values, dtypes and shapes (dtypes numpy lacks, such as bfloat16, come
back as float32 with ``dtype`` still saying ``"bfloat16"``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from undercurrent.analysis.frames import (
    ACTIVATIONS_KEY,
    RECORD_COLUMNS,
    Activations,
    _site_order,
    _typed_record_frame,
    new_activations_id,
    record_tensors,
    records_frame,
)
from undercurrent.arguments import check_flag
from undercurrent.paths import user_path
from undercurrent.records import ActivationRecord

FORMAT_NAME = "undercurrent.records/1"
# What a frame needs to be saved: the record columns but the matrix row and its
# activations' id (both rewritten on load) and edits (older frames have none).
_SAVED_COLUMNS = tuple(c for c in RECORD_COLUMNS
                       if c not in ("row", "edits", "activations_id"))
_FORMAT_KEY = b"undercurrent.format"
# {point: [reduction, base64 .npy of its (captured features, K) matrix or None]}
_PROJECTED_KEY = b"undercurrent.projected"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "saving records to parquet needs pyarrow: pip install 'undercurrent[notebook]'"
        ) from error
    return pyarrow


def save_records(records: Any, path: str | os.PathLike[str], *, tokenizer: Any = None) -> Path:
    """Write records (a list, ``GenerationOutput``s or a records frame) to parquet.

    Returns the path written. The frame's extra columns, if any, are kept.
    ``tokenizer`` fills ``token_text`` when records (not a frame) are given.
    """
    import numpy as np

    target = user_path(path, "save_records: path", what="a .parquet file")
    pa = _pyarrow()
    import pandas as pd

    frame = (records if isinstance(records, pd.DataFrame)
             else records_frame(records, tokenizer=tokenizer))
    missing = [column for column in _SAVED_COLUMNS if column not in frame.columns]
    if missing:
        raise ValueError(f"save_records: the frame lacks record columns {missing}")
    tensors = record_tensors(frame)
    plain = frame.drop(columns=[c for c in ("tensor", "shape", "row", "edits", "activations_id")
                                if c in frame.columns])
    plain.attrs = {}  # the activations are written as the tensor column below
    table = pa.Table.from_pandas(plain, preserve_index=False)
    shapes = pa.array([list(shape) for shape in frame["shape"]], type=pa.list_(pa.int64()))
    table = table.append_column("shape", shapes)
    edits = [list(e) for e in frame["edits"]] if "edits" in frame.columns else [[]] * len(frame)
    table = table.append_column("edits", pa.array(edits, type=pa.list_(pa.string())))
    table = table.append_column("tensor", _tensor_column(pa, np, tensors))
    metadata = dict(table.schema.metadata or {})
    metadata[_FORMAT_KEY] = FORMAT_NAME.encode()
    projected = _projected_points(frame)
    if projected:
        metadata[_PROJECTED_KEY] = _encode_projected(np, projected)
    table = table.replace_schema_metadata(metadata)
    pa.parquet.write_table(table, target)
    return target


def _projected_points(frame: Any) -> dict[str, tuple[str, Any]]:
    """The ``Activations.projected`` marks of the points the frame's rows hold."""
    activations = frame.attrs.get(ACTIVATIONS_KEY)
    if not isinstance(activations, Activations) or not activations.projected:
        return {}
    present = set(frame["point"].astype(str))
    return {point: mark for point, mark in activations.projected.items() if point in present}


def _encode_projected(np: Any, projected: dict[str, tuple[str, Any]]) -> bytes:
    import base64
    import io
    import json

    def encoded(matrix: Any) -> str | None:
        if matrix is None:
            return None
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(matrix), allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    return json.dumps({point: [reduction, encoded(matrix)]
                       for point, (reduction, matrix) in projected.items()}).encode()


def _decode_projected(np: Any, raw: bytes | None) -> dict[str, tuple[str, Any]]:
    import base64
    import io
    import json

    if raw is None:
        return {}
    return {point: (reduction, None if data is None else np.load(
        io.BytesIO(base64.b64decode(data)), allow_pickle=False))
        for point, (reduction, data) in json.loads(raw).items()}


def _tensor_column(pa: Any, np: Any, tensors: list[Any]) -> Any:
    present = [np.asarray(t) for t in tensors if t is not None]
    if not present:
        return pa.nulls(len(tensors), type=pa.list_(pa.float32()))
    dtype = np.result_type(*[array.dtype for array in present])
    sizes = {array.size for array in present}
    value_type = pa.from_numpy_dtype(dtype)
    if len(sizes) == 1 and len(present) == len(tensors):
        size = sizes.pop()
        flat = np.concatenate([array.reshape(-1).astype(dtype) for array in present])
        return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=value_type), size)
    values = [None if t is None else np.asarray(t).reshape(-1).astype(dtype) for t in tensors]
    return pa.array(values, type=pa.list_(value_type))


def load_records(path: str | os.PathLike[str], *, as_records: bool = False) -> Any:
    """Read a file written by :func:`save_records`.

    Returns a records frame (columns ``RECORD_COLUMNS``, activations in
    ``activation_matrix(frame)``), or with ``as_records=True`` a list of
    ``ActivationRecord`` (numpy tensors of their saved shape; a file of a store's
    ``project:K`` point is refused as records, as :func:`frame_to_records` refuses it).
    """
    import numpy as np

    check_flag("load_records: as_records", as_records)
    source = user_path(path, "load_records: path", what="a file save_records wrote")
    pa = _pyarrow()
    if not source.exists():
        raise FileNotFoundError(f"load_records: no such file {str(source)!r}")
    # (pyarrow reads a folder as one dataset of every file under it, recursively)
    if source.is_dir():
        raise IsADirectoryError(
            f"load_records: {str(source)!r} is a directory; give the file save_records "
            "wrote (a store's directory opens with open_activations)")
    if not source.is_file():
        raise ValueError(f"load_records: {str(source)!r} is not a regular file; give the "
                         "file save_records wrote")
    table = pa.parquet.read_table(source)
    metadata = table.schema.metadata or {}
    if metadata.get(_FORMAT_KEY) != FORMAT_NAME.encode():
        raise ValueError(
            f"load_records: {str(source)!r} is not an undercurrent records file "
            f"(expected parquet metadata {_FORMAT_KEY.decode()}={FORMAT_NAME!r}; "
            "write it with undercurrent.notebook.save_records)"
        )
    shapes = [tuple(shape) for shape in table.column("shape").to_pylist()]
    tensors = _read_tensors(np, table.column("tensor").combine_chunks(), shapes)
    edits = ([tuple(e or ()) for e in table.column("edits").to_pylist()]
             if "edits" in table.column_names else [()] * len(shapes))
    dropped = [c for c in ("shape", "tensor", "edits") if c in table.column_names]
    frame = table.drop_columns(dropped).to_pandas()
    frame["shape"] = shapes
    frame["edits"] = edits
    frame["row"] = 0
    frame["activations_id"] = new_activations_id()  # (_attach gives its Activations')
    frame = _typed_record_frame(frame)
    extra = [column for column in frame.columns if column not in RECORD_COLUMNS]
    frame = frame[list(RECORD_COLUMNS) + extra]
    _attach(np, frame, tensors, _decode_projected(np, metadata.get(_PROJECTED_KEY)))
    if as_records:
        return _frame_records(frame, "load_records(as_records=True)")
    return frame


def _attach(np: Any, frame: Any, tensors: list[Any],
            projected: dict[str, tuple[str, Any]]) -> None:
    """Stack the loaded tensors into the frame's activation matrices (laid out as
    :func:`records_frame` lays them out), marked with the saved frame's
    ``projected`` points, and point its ``row`` column at them."""
    if any(tensor is None for tensor in tensors):
        return  # saved from a frame built with tensors=False
    by_size: dict[int, list[int]] = {}
    for position in _site_order(frame):
        by_size.setdefault(int(tensors[position].size), []).append(position)
    rows = np.empty(len(tensors), dtype=np.int64)
    matrices = {}
    for size, members in by_size.items():
        matrices[size] = np.stack([tensors[i].reshape(-1) for i in members])
        rows[members] = np.arange(len(members))
    frame["row"] = rows
    activations = Activations(matrices, projected)
    frame["activations_id"] = activations.id
    frame.attrs[ACTIVATIONS_KEY] = activations


def _read_tensors(np: Any, column: Any, shapes: list[tuple[int, ...]]) -> list[Any]:
    import pyarrow as pa

    if pa.types.is_fixed_size_list(column.type) and column.null_count == 0:
        flat = column.flatten().to_numpy(zero_copy_only=False)
        block = flat.reshape(len(column), column.type.list_size)
        return [block[row].reshape(shape).copy() for row, shape in enumerate(shapes)]
    value_dtype = column.type.value_type.to_pandas_dtype()
    tensors: list[Any] = []
    for values, shape in zip(column.to_pylist(), shapes, strict=True):
        if values is None:
            tensors.append(None)
        else:
            tensors.append(np.asarray(values, dtype=value_dtype).reshape(shape))
    return tensors


def frame_to_records(frame: Any) -> list[ActivationRecord]:
    """``ActivationRecord``s (numpy tensors) from a records frame's rows.

    Rows of an activation store's ``project:K`` point are refused: a record holds
    a captured activation, and records carry no projection mark, so what takes
    them (``records_frame``, ``save_records``, a fit) would read the projections
    as activations. Keep such rows in a frame (``save_records`` keeps the mark).
    """
    if not hasattr(frame, "columns") or not hasattr(frame, "itertuples"):
        raise TypeError("frame_to_records takes a records frame (from records_frame or "
                        f"load_records), got {type(frame).__name__} ({frame!r:.40})")
    needed = [column for column in RECORD_COLUMNS if column in _RECORD_FIELDS]
    if "tensor" not in frame.columns and isinstance(frame.attrs.get(ACTIVATIONS_KEY),
                                                    Activations):
        needed += ["shape", "row"]  # (where each row's activation is)
    missing = [column for column in needed if column not in frame.columns]
    if missing:
        raise ValueError(f"frame_to_records: the frame lacks the column(s) {missing} a "
                         "record is built from; select rows of a records frame, keeping "
                         "its columns")
    return _frame_records(frame, "frame_to_records")


# The columns each ActivationRecord field is read from (``edits`` may be absent).
_RECORD_FIELDS = ("request", "point", "layer", "tensor_type", "token_index", "is_generated",
                  "generated_index", "token_id", "timestamp")


def _refuse_projected(frame: Any, caller: str) -> None:
    """Refuse a frame holding rows of a ``project:K`` point, naming ``caller``."""
    projected = _projected_points(frame)
    if projected:
        point, (reduction, _) = next(iter(projected.items()))
        raise ValueError(
            f"{caller}: point {point!r} holds projections of its activations "
            f"({reduction}), not activations; an ActivationRecord holds a captured "
            "activation and carries no projection mark, so a fit or a store of these "
            "records would read the projections as activations: keep the rows in a "
            "records frame (save_records and load_records keep the mark), or leave "
            f"that point's rows out (frame[frame['point'] != {point!r}])"
        )


def _frame_records(frame: Any, caller: str) -> list[ActivationRecord]:
    _refuse_projected(frame, caller)

    def optional_int(value: Any) -> int | None:
        import pandas as pd

        return None if value is None or pd.isna(value) else int(value)

    has_edits = "edits" in frame.columns
    return [
        ActivationRecord(
            request_id=row.request,
            extraction_point_name=row.point,
            layer=int(row.layer),
            tensor_type=row.tensor_type,
            token_index=int(row.token_index),
            is_generated=bool(row.is_generated),
            generated_index=optional_int(row.generated_index),
            token_id=optional_int(row.token_id),
            tensor=tensor,
            timestamp=float(row.timestamp),
            edits=tuple(row.edits) if has_edits else (),
        )
        for row, tensor in zip(frame.itertuples(index=False), record_tensors(frame),
                               strict=True)
    ]
