"""Arrays for SAE features: rows kept by their nonzero entries
(:class:`SparseRows`), per-row lists kept as one flat array until read
(:class:`RaggedColumn`), each row's largest columns (:func:`top_columns`) and
products whose rows round alike whatever the batch (:func:`row_products`).

numpy is imported lazily, as in :mod:`undercurrent.probes.arrays`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from undercurrent.probes.arrays import numpy_module


class SparseRows:
    """Rows of mostly zero values, kept by their nonzero entries (compressed
    rows): ``indptr`` (one more than the rows: row ``r`` 's entries are
    ``indptr[r]:indptr[r + 1]``), and each entry's ``columns`` and ``values``,
    row by row, each row's in column order; ``width`` is the number of columns.
    A probe's row values (``ScoresRows.row_values``) may be one, or hold one:
    it is sliced (``rows[start:stop]``), joined (:meth:`join_rows`) and
    reordered (:meth:`take_rows`) as an array of its rows is, at the size of
    its entries (an SAE's activations: a few dozen of thousands of features).

    >>> import numpy as np
    >>> rows = SparseRows.from_dense(np.array([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]]))
    >>> rows.indptr.tolist(), rows.columns.tolist(), rows.values.tolist()
    ([0, 1, 3], [1, 0, 2], [2.0, 1.0, 3.0])
    >>> rows[1:].dense().tolist()
    [[1.0, 0.0, 3.0]]
    """

    __slots__ = ("indptr", "columns", "values", "width")

    def __init__(self, indptr: Any, columns: Any, values: Any, width: int) -> None:
        self.indptr = indptr
        self.columns = columns
        self.values = values
        self.width = width

    @classmethod
    def from_dense(cls, matrix: Any) -> SparseRows:
        """The nonzero entries of a 2-D numpy matrix (NaN included)."""
        np = numpy_module()
        rows, width = matrix.shape
        # (row by row, each row's columns in order; a flat index is found fastest)
        flat = np.flatnonzero(matrix)
        row_of = flat // width
        indptr = np.zeros(rows + 1, dtype=np.intp)
        np.cumsum(np.bincount(row_of, minlength=rows), out=indptr[1:])
        return cls(indptr, flat - row_of * width, matrix.reshape(-1)[flat], int(width))

    @classmethod
    def from_columns(cls, columns: Any, values: Any, width: int) -> SparseRows:
        """Rows of at most as many entries as ``columns`` (``(rows, m)``, each
        row's in increasing order) has, ``values`` at them; zeros left out."""
        np = numpy_module()
        kept = values != 0
        indptr = np.zeros(len(columns) + 1, dtype=np.intp)
        np.cumsum(kept.sum(axis=1), out=indptr[1:])
        return cls(indptr, columns[kept], values[kept], int(width))

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def __getitem__(self, rows: slice) -> SparseRows:
        """Rows ``start:stop`` (a slice of step 1), sharing the entries."""
        start, stop = _row_range(rows, len(self), "SparseRows are")
        first, last = int(self.indptr[start]), int(self.indptr[stop])
        return SparseRows(self.indptr[start:stop + 1] - first, self.columns[first:last],
                          self.values[first:last], self.width)

    @classmethod
    def join_rows(cls, pieces: Sequence[SparseRows]) -> SparseRows:
        """Consecutive rows joined into one (the inverse of slicing)."""
        np = numpy_module()
        if len(pieces) == 1:
            return pieces[0]
        counts = np.concatenate([np.diff(piece.indptr) for piece in pieces])
        indptr = np.zeros(len(counts) + 1, dtype=np.intp)
        np.cumsum(counts, out=indptr[1:])
        return cls(indptr, np.concatenate([piece.columns for piece in pieces]),
                   np.concatenate([piece.values for piece in pieces]), pieces[0].width)

    def take_rows(self, order: Any) -> SparseRows:
        """The rows in ``order`` (an integer array of row numbers)."""
        np = numpy_module()
        counts = np.diff(self.indptr)[order]
        indptr = np.zeros(len(counts) + 1, dtype=np.intp)
        np.cumsum(counts, out=indptr[1:])
        # Each new entry's place among the old ones: its row's old start plus
        # its rank within the row.
        starts = np.repeat(self.indptr[:-1][order] - indptr[:-1], counts)
        entries = starts + np.arange(int(indptr[-1]))
        return SparseRows(indptr, self.columns[entries], self.values[entries], self.width)

    def entry_rows(self) -> Any:
        """The row of each entry."""
        np = numpy_module()
        return np.repeat(np.arange(len(self)), np.diff(self.indptr))

    def dense(self) -> Any:
        """The rows as a float64 matrix (zeros where no entry is)."""
        np = numpy_module()
        matrix = np.zeros((len(self), self.width))
        matrix[self.entry_rows(), self.columns] = self.values
        return matrix


def top_columns(matrix: Any, k: int) -> Any:
    """The columns of each row's ``k`` largest entries of a float64 matrix,
    ``(rows, k)``, largest first, equal entries by lower column (a NaN counts
    as -inf). A bound at or below each row's k-th largest is found first (the
    k-th largest of the largest entries of ``2k`` blocks of columns: k blocks,
    so k entries, are at or above it), so only the few entries at or above it
    are sorted: faster than a selection over every column
    (``numpy.argpartition``) for an SAE's hundreds or thousands of features.

    >>> import numpy as np
    >>> top_columns(np.array([[1.0, 5.0, 3.0, 5.0], [0.0, -1.0, 2.0, 7.0]]), 2).tolist()
    [[1, 3], [3, 2]]
    """
    np = numpy_module()
    rows, width = matrix.shape
    k = min(k, width)
    if not rows or k < 1:
        return np.zeros((rows, max(k, 0)), dtype=np.intp)
    ranked = matrix
    missing = np.isnan(matrix)
    if missing.any():
        ranked = np.where(missing, -np.inf, matrix)
    blocks = min(2 * k, width)
    maxima = np.maximum.reduceat(ranked, np.arange(blocks) * (width // blocks), axis=1)
    bound = np.partition(maxima, blocks - k, axis=1)[:, blocks - k]
    flat = np.flatnonzero(ranked >= bound[:, None])  # (a flat index is found fastest)
    row_of = flat // width
    # By row, then largest first; the candidates are in column order, and a
    # lexicographic sort is stable: equal entries stay by lower column.
    order = np.lexsort((-ranked.reshape(-1)[flat], row_of))
    counts = np.bincount(row_of, minlength=rows)  # (k or more in every row)
    chosen = order[((np.cumsum(counts) - counts)[:, None] + np.arange(k)).reshape(-1)]
    return (flat[chosen] - row_of[chosen] * width).reshape(rows, k)


#: Rows per matrix product in :func:`row_products`.
PRODUCT_ROWS = 32


def row_products(matrix: Any, weight: Any) -> Any:
    """``matrix @ weight`` (a float64 matrix of rows, a float64 weight matrix),
    computed as products of exactly :data:`PRODUCT_ROWS` rows, the last padded
    with zero rows. A BLAS product may round a row differently with the height
    of the product it is part of (a single row goes through a matrix-vector
    product); products of one height give each row the same bits whatever
    batch or window it comes in, as :func:`~undercurrent.probes.arrays.row_dots`
    does for a vector, at BLAS speed.

    >>> import numpy as np
    >>> rows, weight = np.arange(6.0).reshape(3, 2), np.array([[1.0, 0.0, 2.0], [0.5, 1.0, 0.0]])
    >>> row_products(rows, weight).tolist() == (rows @ weight).tolist()
    True
    """
    np = numpy_module()
    count = matrix.shape[0]
    padded = count + (-count) % PRODUCT_ROWS
    if padded != count or not matrix.flags.c_contiguous:
        rows = np.zeros((padded, matrix.shape[1]))
        rows[:count] = matrix
    else:
        rows = matrix
    out = np.empty((padded, weight.shape[1]))
    for start in range(0, padded, PRODUCT_ROWS):
        np.matmul(rows[start:start + PRODUCT_ROWS], weight,
                  out=out[start:start + PRODUCT_ROWS])
    return out[:count]


class RaggedColumn:
    """A column of per-row lists (a signal's ``features`` or ``activations``)
    kept as one flat array and its row boundaries until it is read: row ``r``
    is ``values[indptr[r]:indptr[r + 1]]``. It is sliced by ranges of rows
    without a copy of the values, and read as Python lists (:meth:`tolist`,
    what :func:`~undercurrent.records.as_list` calls) only when signals are
    built from it, so a batch's signals make no Python list per row until
    someone reads them.

    >>> import numpy as np
    >>> column = RaggedColumn(np.array([0, 2, 2, 3]), np.array([5, 1, 7]))
    >>> column.tolist()
    [[5, 1], [], [7]]
    >>> column[1:].tolist(), len(column)
    ([[], [7]], 3)
    """

    __slots__ = ("indptr", "values")

    def __init__(self, indptr: Any, values: Any) -> None:
        self.indptr = indptr
        self.values = values

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def __getitem__(self, rows: slice) -> RaggedColumn:
        """Rows ``start:stop`` (a slice of step 1), sharing the values."""
        start, stop = _row_range(rows, len(self), "a RaggedColumn is")
        # (the boundaries keep their offsets into the shared values)
        return RaggedColumn(self.indptr[start:stop + 1], self.values)

    def tolist(self) -> list[list[Any]]:
        """Each row's values as a list of Python values."""
        first, last = int(self.indptr[0]), int(self.indptr[-1])
        flat = self.values[first:last].tolist()
        bounds = (self.indptr - first).tolist()
        return [flat[begin:end] for begin, end in itertools.pairwise(bounds)]


def _row_range(rows: slice, count: int, what: str) -> tuple[int, int]:
    """``rows`` (a slice of step 1) as (start, stop) within ``count`` rows,
    ``stop`` never before ``start``; ``what`` names the sliced thing in the
    error for any other step."""
    start, stop, step = rows.indices(count)
    if step != 1:
        raise ValueError(f"{what} sliced by ranges of rows")
    return start, max(start, stop)
