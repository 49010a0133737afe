"""Read a store's ``index.parquet`` files into one compact pandas frame.

The index has a row per stored vector, so its in-memory form decides what
opening a large store costs. Read naively (``pd.read_parquet`` and object
strings) it took about 1 KB of RAM per row, several times the vectors of a
float16 store: a Python string per row for ``request_id``,
``extraction_point_name`` and ``tensor_type``, and a numpy array per row for
``edits``. Here the strings are pandas' Arrow-backed ``str`` columns (the
characters in one buffer, no Python object per row; they sort, compare and
concatenate as strings do) and ``edits`` an object column whose rows share one
tuple per distinct set of names, and a filter on point, layer and
tensor type is applied in Arrow, shard by shard, before anything reaches
pandas, so ``store.select(point=..., layer=...)`` never builds the rows it
drops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from undercurrent.store.format import INDEX_COLUMNS, INDEX_SCHEMA, arrow_schema

STRING_COLUMNS = ("request_id", "extraction_point_name", "tensor_type", "shard")
"""String columns of the index, read as pandas' Arrow-backed ``str``."""

NULLABLE_COLUMNS = ("generated_index", "token_id")
"""Integer columns of the index read as pandas' nullable ``Int64``."""

_EDIT_SEPARATOR = "\x00"  # (joins a row's edit names into one dictionary key)

RowFilter = Callable[[Any], Any]
"""A filter over one shard's Arrow index table: its boolean mask of rows to keep."""


def index_filter(point: Any, layers: Sequence[int] | None, tensor_type: Any) -> RowFilter | None:
    """The Arrow form of ``select(point=, layer=, tensor_type=)``'s filters, or None
    when there is nothing to filter or a value is not one Arrow can compare (a
    point that is no string: the caller then filters the whole index in pandas,
    as before)."""
    if point is None and layers is None and tensor_type is None:
        return None
    if not all(value is None or isinstance(value, str) for value in (point, tensor_type)):
        return None

    def keep(table: Any) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        mask = pc.equal(table["layer"], table["layer"])  # (all true: never null)
        if point is not None:
            mask = pc.and_(mask, pc.equal(table["extraction_point_name"], point))
        if layers is not None:
            mask = pc.and_(mask, pc.is_in(table["layer"],
                                          value_set=pa.array(layers, type=pa.int64())))
        if tensor_type is not None:
            mask = pc.and_(mask, pc.equal(table["tensor_type"], tensor_type))
        return mask

    return keep


def read_index(paths: Sequence[Path], keep: RowFilter | None = None) -> Any:
    """The ``index.parquet`` files at ``paths`` as one frame (``INDEX_COLUMNS``).

    With ``keep``, only the rows it passes are converted, and they keep the labels
    they have in the whole index (their positions in it), so a filtered read
    equals the same filter on the whole index. Columns a store of an earlier
    version lacks (``edits``) read as missing (no edits)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema(INDEX_SCHEMA)
    tables, labels, start = [], [], 0
    for path in paths:
        table = _conformed(pq.read_table(path), schema)
        positions = np.arange(start, start + table.num_rows)
        start += table.num_rows
        if keep is not None:
            mask = keep(table)
            table = table.filter(mask)
            positions = positions[np.asarray(mask, dtype=bool)]
        tables.append(table)
        labels.append(positions)
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    rows = np.concatenate(labels) if labels else np.arange(0)
    return _frame(table, rows if keep is not None else None)


def _conformed(table: Any, schema: Any) -> Any:
    """``table`` with exactly ``schema``'s columns, in order and types (a missing
    column as nulls)."""
    import pyarrow as pa

    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(table.num_rows, type=field.type))
    return table.select(list(schema.names)).cast(schema)


def _frame(table: Any, labels: Any) -> Any:
    """The pandas frame of an Arrow index table; ``labels`` its row labels (None:
    ``0, 1, ...``)."""
    import pandas as pd
    import pyarrow as pa

    columns: dict[str, Any] = {}
    for name in INDEX_COLUMNS:
        column = table.column(name)
        if name == "edits":
            columns[name] = _edit_names(column)
        elif name in STRING_COLUMNS:
            columns[name] = _strings(pd, column.combine_chunks())
        elif name in NULLABLE_COLUMNS:
            columns[name] = column.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get).array
        else:
            columns[name] = column.to_numpy()
    index = pd.RangeIndex(table.num_rows) if labels is None else pd.Index(labels)
    return pd.DataFrame(columns, index=index)


def _strings(pd: Any, array: Any) -> Any:
    """An Arrow string column as a pandas array that keeps the strings in Arrow
    (no object per row): pandas' ``str`` (Arrow-backed from pandas 3; before,
    numpy's, an object column in a frame: ``string[pyarrow]`` there)."""
    strings = pd.array(array, dtype="str")
    if not isinstance(strings.dtype, pd.StringDtype):  # (pandas 2: numpy's str)
        strings = pd.array(array, dtype="string[pyarrow]")
    return strings


def _edit_names(column: Any) -> Any:
    """The ``edits`` column (a list of names per row) as an object array of
    tuples, ``()`` where none (or not recorded): rows with the same names share
    one tuple (no object made per row)."""
    import numpy as np
    import pyarrow.compute as pc

    joined = pc.fill_null(pc.binary_join(column, _EDIT_SEPARATOR), "")
    encoded = joined.combine_chunks().dictionary_encode()
    names = np.empty(len(encoded.dictionary), dtype=object)
    names[:] = [tuple(key.split(_EDIT_SEPARATOR)) if key else ()
                for key in encoded.dictionary.to_pylist()]
    return names[encoded.indices.to_numpy(zero_copy_only=False)]


def stored_values(paths: Sequence[Path], column: str) -> list[Any]:
    """The distinct values of one index column over the files at ``paths``,
    reading that column alone."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    found: set[Any] = set()
    for path in paths:
        found.update(pc.unique(pq.read_table(path, columns=[column])[column]).to_pylist())
    return sorted(found)
