"""Turn whatever tensors an adapter captured into float64 numpy arrays.

numpy is imported lazily (it comes with the ``hf`` extra, not the core install),
and torch is never imported here: a torch tensor is recognised by its ``detach``
method and converted by torch itself (so bfloat16 works too); a batch of them
is stacked by torch first and converted once.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any


def numpy_module() -> Any:
    """The numpy module, or an ImportError saying which extra provides it."""
    try:
        import numpy
    except ImportError as exc:  # pragma: no cover - numpy ships with every extra we test
        raise ImportError(
            "the built-in probes need numpy; install it with `pip install undercurrent[hf]` "
            "or `pip install numpy`"
        ) from exc
    return numpy


def as_float_array(tensor: Any) -> Any:
    """A float64 numpy view or copy of ``tensor`` (numpy array, torch tensor, or list).

    A torch tensor of any dtype (bfloat16 too, which numpy cannot hold) and on
    any device is converted by :func:`host_float64`, so float64 values stay exact.

    >>> as_float_array([1, 2]).dtype.name
    'float64'
    """
    if hasattr(tensor, "detach"):
        return host_float64(tensor)
    np = numpy_module()
    return np.asarray(tensor, dtype=np.float64)


#: torch runs an element-wise copy of at most this many elements on the calling
#: thread, without its intra-op thread pool (``at::internal::GRAIN_SIZE``).
SERIAL_ELEMENTS = 32768


def host_float64(tensor: Any) -> Any:
    """A torch tensor (any device and dtype) as a float64 numpy array of its shape,
    converted on the calling thread alone. On the host, float32 and float64 take
    numpy's conversion; other dtypes (bfloat16, float16, integers) are copied
    (``Tensor.copy_``) into a new float64 tensor in chunks of at most
    :data:`SERIAL_ELEMENTS` values, each of which torch converts without its
    thread pool.

    On the H200 machine of benchmarks.md ("On a GPU", 16 torch threads), one
    conversion of 512 x 128 bfloat16 values took about 25 µs when timed alone,
    but 3.6 to 7 ms each inside a generation (the inline linear probe's window: 12
    of them, 43 to 83 ms of cProfile's time per generation), and ``Tensor.to``
    from pinned memory took 6 ms even alone. With one torch thread, every case
    timed there took 21 to 30 µs. Converting a side path's rows on one thread
    also leaves the other cores to the model.

    >>> import torch
    >>> host_float64(torch.tensor([[0.5, -2.0]], dtype=torch.bfloat16)).tolist()
    [[0.5, -2.0]]
    """
    torch = sys.modules["torch"]  # a tensor with ``detach`` comes from an imported torch
    source = tensor.detach()
    on_host = source.device.type == "cpu"
    if on_host and source.dtype in (torch.float32, torch.float64):
        return numpy_module().asarray(source.numpy(), dtype="float64")
    host = torch.empty(source.shape, dtype=torch.float64)
    if on_host:
        _convert_serially(host, source)
    else:
        host.copy_(source)  # (from a device: one transfer)
    return host.numpy()


def _convert_serially(host: Any, source: Any) -> None:
    """Copy the host tensor ``source`` into ``host`` (float64, contiguous, of its
    shape) in copies of at most :data:`SERIAL_ELEMENTS` values (a strided
    ``source``: whole slices of its first dimension)."""
    count = host.numel()
    if count <= SERIAL_ELEMENTS:
        host.copy_(source)
    elif source.is_contiguous():
        flat, values = host.view(-1), source.view(-1)
        for start in range(0, count, SERIAL_ELEMENTS):
            flat[start:start + SERIAL_ELEMENTS].copy_(values[start:start + SERIAL_ELEMENTS])
    else:
        step = max(1, SERIAL_ELEMENTS * len(source) // count)
        for start in range(0, len(source), step):
            host[start:start + step].copy_(source[start:start + step])


def _pieces_float64(pieces: Sequence[Any]) -> Any:
    """Host tensors whose rows follow each other as one float64 matrix, one
    flattened row each, each piece converted into its rows on this thread
    (:func:`_convert_serially`): no joined copy of the pieces is made."""
    torch = sys.modules["torch"]
    heights = [len(piece) for piece in pieces]
    width = math.prod(pieces[0].shape[1:])
    host = torch.empty((sum(heights), width), dtype=torch.float64)
    start = 0
    for piece, height in zip(pieces, heights, strict=True):
        _convert_serially(host[start:start + height], piece.detach().reshape(height, width))
        start += height
    return host.numpy()


def as_flat_vector(tensor: Any) -> Any:
    """``as_float_array`` flattened to one dimension (``kv`` records are 3-D)."""
    return as_float_array(tensor).reshape(-1)


def as_float_matrix(tensors: Sequence[Any]) -> Any:
    """The tensors, each flattened, as the rows of one float64 numpy matrix.

    Torch tensors are stacked by torch first, so a batch costs one conversion,
    not one per tensor. Every tensor must have the same number of elements.

    >>> as_float_matrix([[1, 2], [3, 4]]).shape
    (2, 2)
    """
    np = numpy_module()
    first = tensors[0]
    if hasattr(first, "detach"):
        torch = sys.modules["torch"]  # a tensor with ``detach`` comes from an imported torch
        stacked = torch.stack(list(tensors)).detach()
        if stacked.dim() != 2:  # kv records are (2, heads, head_dim)
            stacked = stacked.reshape(len(tensors), -1)
        return host_float64(stacked)
    return np.stack([as_flat_vector(tensor) for tensor in tensors])


def batch_matrix(batch: Any) -> Any:
    """The rows of an :class:`~undercurrent.records.ActivationBatch`, each flattened,
    as one float64 numpy matrix (one conversion, kept on the batch for the next
    probe that asks).

    >>> from undercurrent.records import ActivationBatch
    >>> batch = ActivationBatch([[1, 2], [3, 4]], request_ids=["r"] * 2, point_names=["p"] * 2,
    ...     layers=[0, 1], tensor_type="mlp_out", token_indices=[3, 3], is_generated=[True] * 2,
    ...     generated_indices=[0, 0], token_ids=[5, 5])
    >>> batch_matrix(batch).tolist()
    [[1.0, 2.0], [3.0, 4.0]]
    """
    cached = batch.cache.get("float64")
    if cached is not None:
        return cached
    tensor = batch.tensor
    if hasattr(tensor, "detach"):
        matrix = host_float64(tensor.reshape(len(batch), -1))
    elif hasattr(tensor, "__array__"):
        matrix = numpy_module().asarray(tensor, dtype="float64").reshape(len(batch), -1)
    else:
        matrix = as_float_matrix(list(tensor))
    batch.cache["float64"] = matrix
    return matrix


#: :func:`row_dots` sums a row's dot product in pieces of at most this many
#: values, each one BLAS dot product: OpenBLAS (numpy's wheels) spreads a dot
#: product of more than 10,000 values over its threads, whose helpers
#: busy-wait between calls; a piece this size runs on the calling thread.
DOT_WIDTH = 4096


def row_dots(matrix: Any, weight: Any) -> Any:
    """``matrix @ weight.T`` for a float matrix of rows (``n x width``) and a
    weight vector (``width``) or matrix (``k x width``): an array of ``n``
    (or ``n x k``) dot products, each summed from its own row alone, on the
    calling thread, so a row gets the same bits whatever the matrix it is in
    (its height, its other rows). One BLAS dot product per row and weight
    (``numpy.vecdot``; ``numpy.einsum`` before numpy 2), in pieces of
    :data:`DOT_WIDTH` values added in order for wider rows.

    >>> import numpy as np
    >>> row_dots(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.5, 1.0])).tolist()
    [2.5, 5.5]
    >>> row_dots(np.array([[1.0, 2.0]]), np.array([[1.0, 0.0], [0.0, 1.0]])).tolist()
    [[1.0, 2.0]]
    """
    np = numpy_module()
    vecdot = getattr(np, "vecdot", None)
    if vecdot is None:  # (numpy 1: each row's sum of products, by einsum)
        return (np.einsum("ij,j->i", matrix, weight) if weight.ndim == 1
                else np.einsum("ij,kj->ik", matrix, weight))
    rows = matrix if weight.ndim == 1 else matrix[:, None, :]
    width = matrix.shape[1]
    if width <= DOT_WIDTH:
        return vecdot(rows, weight)
    total = vecdot(rows[..., :DOT_WIDTH], weight[..., :DOT_WIDTH])
    for start in range(DOT_WIDTH, width, DOT_WIDTH):
        total += vecdot(rows[..., start:start + DOT_WIDTH], weight[..., start:start + DOT_WIDTH])
    return total


#: :func:`map_rows` converts this many rows to float64 at a time: a block stays
#: in the CPU's cache between its conversion and the computation reading it.
BLOCK_ROWS = 512


def map_rows(batch: Any, compute: Callable[[Any], Any]) -> Any:
    """``compute(batch_matrix(batch))``, computed a block of rows at a time and
    joined: no float64 matrix of more than :data:`BLOCK_ROWS` rows is made.

    ``compute`` takes a float64 matrix (one flattened row each) and returns an
    array with one entry (or one row of entries) per matrix row (or
    :class:`~undercurrent.probes.sparse.SparseRows`), each
    depending on its own row only, and the same whatever the matrix's height
    (the built-ins' norms, means and :func:`row_dots` products are). Rows an
    adapter will stack from pieces (:class:`~undercurrent.records.DeferredRows`,
    on the CPU) are read piece by piece, so they are never stacked; other rows
    are converted in blocks of :data:`BLOCK_ROWS`. A batch whose float64
    matrix is made already is computed on it whole.

    >>> from undercurrent.records import ActivationBatch
    >>> batch = ActivationBatch([[3, 4], [6, 8]], request_ids=["r"] * 2, point_names=["p"] * 2,
    ...     layers=[0, 1], tensor_type="mlp_out", token_indices=[3, 3], is_generated=[True] * 2,
    ...     generated_indices=[0, 0], token_ids=[5, 5])
    >>> map_rows(batch, lambda matrix: (matrix ** 2).sum(axis=1) ** 0.5).tolist()
    [5.0, 10.0]
    """
    cached = batch.cache.get("float64")
    if cached is not None:
        return compute(cached)
    np = numpy_module()
    pieces = batch.stacked_pieces()
    if pieces is not None and _all_on_cpu(pieces):
        # Whole pieces, as many as fill a block, one after the other: the values
        # come piece-major, and row r * len(pieces) + p of the batch is row r of
        # pieces[p].
        height = pieces[0].shape[0]
        step = max(1, BLOCK_ROWS // height)
        blocks = [compute(_float_rows(pieces[start:start + step]))
                  for start in range(0, len(pieces), step)]
        join = getattr(type(blocks[0]), "join_rows", None)
        if join is not None:  # (rows kept another way, SparseRows: joined, then reordered)
            order = np.arange(len(pieces))[None, :] * height + np.arange(height)[:, None]
            return join(blocks).take_rows(order.ravel())
        joined = np.concatenate(blocks)
        joined = joined.reshape(len(pieces), height, *joined.shape[1:]).swapaxes(0, 1)
        return joined.reshape(len(batch), *joined.shape[2:])
    if len(batch) <= BLOCK_ROWS or not _on_cpu(batch.tensor):
        return compute(batch_matrix(batch))
    tensor = batch.tensor
    blocks = [compute(_float_rows(tensor[start:start + BLOCK_ROWS]))
              for start in range(0, len(batch), BLOCK_ROWS)]
    join = getattr(type(blocks[0]), "join_rows", None)
    return join(blocks) if join is not None else np.concatenate(blocks)


def float32_rows(piece: Any) -> Any:
    """A captured piece (a torch tensor of rows on the CPU, in a float dtype) as
    a float32 numpy matrix, one flattened row each, for an abort screen
    (``ScoresRows.abort_screen``); None for anything else, or where the
    conversion to float32 would be large enough to run on torch's thread pool
    (the exact path then decides)."""
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(piece, torch.Tensor) or piece.device.type != "cpu"
            or piece.requires_grad or not len(piece) or not piece.is_floating_point()):
        return None
    if piece.dtype != torch.float32:
        if piece.numel() > SERIAL_ELEMENTS:
            return None
        piece = piece.float()
    return piece.numpy().reshape(len(piece), -1)


def float64_rows(piece: Any) -> Any:
    """A captured piece as the float64 rows the exact path reads (a float64
    tensor's own values; other float dtypes through float32, exactly), or None
    where :func:`float32_rows` gives none."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(piece, torch.Tensor) and piece.dtype == torch.float64:
        if piece.device.type != "cpu" or piece.requires_grad:
            return None
        return piece.numpy().reshape(len(piece), -1)
    rows = float32_rows(piece)
    return None if rows is None else rows.astype(numpy_module().float64)


def _all_on_cpu(tensors: Sequence[Any]) -> bool:
    """:func:`_on_cpu` for every tensor, each distinct device looked at once (the
    pieces of a window are many tensors of one device)."""
    try:
        devices = set(map(_DEVICE, tensors))  # (read in C)
    except AttributeError:  # (some are not tensors: each one looked at)
        return all(_on_cpu(tensor) for tensor in tensors)
    return all(getattr(device, "type", "cpu") == "cpu" for device in devices)


_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NUMPY = operator.methodcaller("numpy")
#: Pieces of at most this many values are joined by ``torch.cat`` before their
#: conversion, larger ones converted while numpy joins them. Counted by
#: callgrind for 512 rows of 128 values (session 24): pieces of 8 rows, 843 k
#: instructions joined by numpy against 301 k by torch; 16 rows, 497 k
#: against 250 k; 32 rows, 302 k against 532 k; 64 rows, 262 k against 473 k.
_SMALL_PIECE = 2048


def _on_cpu(tensor: Any) -> bool:
    """False for a torch tensor on an accelerator (its rows are copied to the host
    in one transfer, not a block or piece at a time)."""
    device = getattr(tensor, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


def _float_rows(rows: Any) -> Any:
    """A block of rows (a torch tensor on the CPU, a numpy array, a list of rows,
    or a list of torch tensors whose rows follow each other) as a float64
    matrix, one flattened row each."""
    np = numpy_module()
    if isinstance(rows, list) and rows and hasattr(rows[0], "detach"):
        torch = sys.modules["torch"]
        if rows[0].dtype == torch.float32 and rows[0].numel() > _SMALL_PIECE:
            # numpy converts while joining them (a tensor that needs no grad,
            # as in generate(), is read as it is: one torch call per piece)
            arrays = (list(map(_NUMPY, rows)) if not any(map(_REQUIRES_GRAD, rows)) else
                      [piece.detach().numpy() for piece in rows])
            if arrays[0].ndim != 2:
                arrays = [array.reshape(array.shape[0], -1) for array in arrays]
            return np.concatenate(arrays, dtype=np.float64)
        if rows[0].numel() > SERIAL_ELEMENTS:
            # (torch.cat would copy each such piece on torch's thread pool)
            return _pieces_float64(rows)
        # Small pieces (a window of a small batch: a piece per step and layer,
        # a row per request) joined by one torch call: cheaper than a numpy
        # view of each (see _SMALL_PIECE).
        rows = torch.cat(rows)
    if hasattr(rows, "detach"):
        rows = rows.detach()
        if rows.dtype == sys.modules["torch"].float32:
            return np.asarray(rows.numpy(), dtype=np.float64).reshape(len(rows), -1)
        return host_float64(rows.reshape(len(rows), -1))
    if isinstance(rows, list):
        return as_float_matrix(rows)
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), -1)
