"""``arrays.map_rows``: a per-row computation over a batch, block by block or
piece by piece, gives exactly (bit for bit) what computing it on the batch's
whole float64 matrix gives, and rows an adapter would stack from pieces are
never stacked. The oracle is ``compute(batch_matrix(batch))`` on a copy of the
batch whose rows are stacked first."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from undercurrent.probes import LinearProbe, NormProbe, TrajectoryProbe, arrays
from undercurrent.probes.arrays import BLOCK_ROWS, batch_matrix, map_rows
from undercurrent.probes.linear import LinearReadout
from undercurrent.probes.statistics import element_means, l2_norms
from undercurrent.records import ActivationBatch, DeferredRows

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(20261202)
HIDDEN = 24
REQUESTS, PIECES = 5, 7


def _batch(tensor: Any, count: int) -> ActivationBatch:
    return ActivationBatch(tensor, request_ids=[f"r{i % REQUESTS}" for i in range(count)],
                           point_names=["p"] * count, layers=[i % 3 for i in range(count)],
                           tensor_type="residual_stream", token_indices=list(range(count)),
                           is_generated=[True] * count, generated_indices=list(range(count)),
                           token_ids=[1] * count)


def _pieces(dtype: Any, shape: tuple[int, ...] = (HIDDEN,)) -> list[Any]:
    return [torch.tensor(RNG.normal(size=(REQUESTS, *shape)), dtype=dtype)
            for _ in range(PIECES)]


def _deferred(pieces: list[Any]) -> tuple[ActivationBatch, ActivationBatch]:
    """(a batch over the pieces, stacked when first read; the same rows stacked now)."""
    rows = REQUESTS * PIECES
    stacked = torch.stack(pieces, 1).view(rows, *pieces[0].shape[1:])
    deferred = DeferredRows(lambda: torch.stack(pieces, 1).view(rows, *pieces[0].shape[1:]),
                            pieces)
    return _batch(deferred, rows), _batch(stacked, rows)


READOUT = LinearReadout(weight=RNG.normal(size=(3, HIDDEN)).tolist(), bias=[0.1, 0.0, -0.2],
                        link="identity", class_index=1)
COMPUTATIONS = {
    "norms": l2_norms,
    "means": element_means,
    "logits of 3 classes": READOUT._logits,
}


@pytest.mark.parametrize("name", sorted(COMPUTATIONS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_pieces_give_the_stacked_rows_values_without_stacking_them(name, dtype):
    compute = COMPUTATIONS[name]
    batch, stacked = _deferred(_pieces(getattr(torch, dtype)))
    values = map_rows(batch, compute)
    assert batch.stacked_pieces() is not None  # never stacked
    expected = compute(batch_matrix(stacked))
    assert values.shape == expected.shape and values.tolist() == expected.tolist()
    assert "float64" not in batch.cache  # no whole float64 matrix was made


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("height", [1, REQUESTS, 100])
def test_small_and_large_pieces_give_the_stacked_rows_values(height, grad):
    """Pieces of one row (a window of one request) or a few, joined by one torch
    call, and pieces of many rows, joined by numpy (over ``_SMALL_PIECE``
    values: 100 rows of 24), with or without a graph built on them (outside
    generate()): each row read as its values."""
    assert (100 * HIDDEN > arrays._SMALL_PIECE) and REQUESTS * HIDDEN <= arrays._SMALL_PIECE
    pieces = [torch.tensor(RNG.normal(size=(height, HIDDEN)), dtype=torch.float32,
                           requires_grad=grad) for _ in range(PIECES)]
    rows = height * PIECES
    stacked = torch.stack(pieces, 1).view(rows, HIDDEN).detach()
    batch = _batch(DeferredRows(lambda: torch.stack(pieces, 1).view(rows, HIDDEN), pieces),
                   rows)
    for name, compute in COMPUTATIONS.items():
        expected = compute(stacked.numpy().astype(np.float64))
        assert map_rows(batch, compute).tolist() == expected.tolist(), name


def test_kv_shaped_pieces_are_flattened_per_row():
    batch, stacked = _deferred(_pieces(torch.float32, (2, 3, 4)))
    assert map_rows(batch, l2_norms).tolist() == l2_norms(batch_matrix(stacked)).tolist()


@pytest.mark.parametrize("kind", ["torch", "numpy", "list"])
def test_a_tall_batch_is_converted_in_blocks_with_the_same_values(kind):
    count = 2 * BLOCK_ROWS + 37
    matrix = RNG.normal(size=(count, HIDDEN)).astype(np.float32)
    tensor: Any = {"torch": torch.from_numpy(matrix), "numpy": matrix,
                   "list": [row for row in matrix]}[kind]
    for name, compute in COMPUTATIONS.items():
        expected = compute(matrix.astype(np.float64))
        values = map_rows(_batch(tensor, count), compute)
        assert values.tolist() == expected.tolist(), name


def test_a_float64_matrix_made_already_is_used_whole():
    batch, _ = _deferred(_pieces(torch.float32))
    made = batch_matrix(batch)  # stacks the rows and keeps their matrix
    seen: list[Any] = []

    def compute(matrix: Any) -> Any:
        seen.append(matrix)
        return l2_norms(matrix)

    assert map_rows(batch, compute).tolist() == l2_norms(made).tolist()
    assert len(seen) == 1 and seen[0] is made


def test_slices_of_a_deferred_batch_share_one_computation_over_the_pieces():
    """The built-ins compute over the routed batch (``ActivationBatch.shared``):
    each request's slice reads its rows of one computation over the pieces."""
    pieces = _pieces(torch.float32)
    batch, stacked = _deferred(pieces)
    probe, oracle = TrajectoryProbe(), TrajectoryProbe()
    for start in range(0, REQUESTS * PIECES, PIECES):
        part = batch[start:start + PIECES]
        assert (probe.batch_values(part).tolist()
                == oracle.batch_values(stacked[start:start + PIECES]).tolist())
    assert batch.stacked_pieces() is not None


def test_the_built_ins_score_pieces_as_they_score_stacked_rows():
    weight = RNG.normal(size=HIDDEN)
    for probe_class, args in ((LinearProbe, {"weight": weight.tolist(), "bias": 0.3}),
                              (NormProbe, {"threshold": 4.0})):
        batch, stacked = _deferred(_pieces(torch.float32))
        mine, theirs = probe_class(**args), probe_class(**args)
        signals = mine.judge_rows(mine.row_values(batch), batch.token_indices, batch.layers)
        expected = theirs.judge_rows(theirs.row_values(stacked), stacked.token_indices,
                                     stacked.layers)
        assert list(signals.scores) == list(expected.scores)
        assert list(signals.actions) == list(expected.actions)
        assert mine.summary.verdict() == theirs.summary.verdict()


def test_a_linear_probe_of_another_width_names_the_activations_shape():
    batch, _ = _deferred(_pieces(torch.float32, (2, 5)))
    probe = LinearProbe(weight=[0.1] * HIDDEN, bias=0.0)
    with pytest.raises(ValueError, match=r"expects activations of size 24, got a tensor of "
                                         r"shape \(2, 5\) \(10 values once flattened\)"):
        probe.row_values(batch)


@pytest.mark.parametrize("scale", [1e-300, 1.0, 1e150, 1e200])
@pytest.mark.parametrize("shape", [(1, 1), (3, 128), (512, 128), (7, 1000)])
def test_l2_norms_are_numpy_s_own_norms_bit_for_bit(shape, scale):
    """``l2_norms`` skips ``numpy.linalg.norm`` 's per-call checks; the oracle is
    that function itself, overflow, underflow, NaN and infinities included."""
    matrix = RNG.standard_normal(shape) * scale
    matrix[0, 0] = np.nan if shape[0] > 3 else matrix[0, 0]
    matrix[-1, -1] = np.inf if shape[0] > 1 else matrix[-1, -1]
    with np.errstate(all="ignore"):
        got, expected = l2_norms(matrix), np.linalg.norm(matrix, axis=1)
    assert got.dtype == expected.dtype == np.float64
    assert np.array_equal(got, expected, equal_nan=True)
    assert got.tobytes() == expected.tobytes()


def _same_values(got: Any, expected: Any) -> bool:
    """Bit for bit (so -0.0 and subnormals count), NaN where NaN."""
    nan = np.isnan(expected)
    return bool((np.isnan(got) == nan).all()
                and (got[~nan].view(np.uint64) == expected[~nan].view(np.uint64)).all())


def test_host_float64_converts_every_bfloat16_and_float16_value_exactly():
    """All 65,536 bit patterns of each 16-bit type, against numpy's own reading
    of them: bfloat16 is the top half of a float32, float16 is numpy's."""
    patterns = np.arange(-2 ** 15, 2 ** 15, dtype=np.int16).reshape(256, 256)
    as_bf16 = (patterns.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    with np.errstate(invalid="ignore"):  # (signalling NaN patterns among them: kept as NaN)
        cases = {torch.bfloat16: as_bf16.astype(np.float64),
                 torch.float16: patterns.view(np.float16).astype(np.float64)}
    for dtype, expected in cases.items():
        got = arrays.host_float64(torch.from_numpy(patterns).view(dtype))
        assert got.dtype == np.float64 and got.shape == (256, 256), dtype
        assert _same_values(got, expected), dtype


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "bool"])
def test_host_float64_keeps_shape_and_values_of_other_tensors(dtype):
    source = torch.from_numpy(RNG.normal(size=(6, 2, 5)) * 100).to(getattr(torch, dtype))
    expected = source.numpy().astype(np.float64)
    assert _same_values(arrays.host_float64(source), expected)
    # a view that is not contiguous, and a tensor in a graph (outside generate())
    transposed = source.transpose(0, 2)
    assert _same_values(arrays.host_float64(transposed), expected.transpose(2, 1, 0))
    if source.is_floating_point():
        assert _same_values(arrays.host_float64(source.clone().requires_grad_()), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_float64_reads_pinned_and_cuda_bfloat16_rows():
    """Where the hooks put rows captured on a GPU (pinned host memory), and rows
    still on the device: the same values as from ordinary host memory."""
    rows = torch.from_numpy(RNG.normal(size=(512, 128))).to(torch.bfloat16)
    expected = arrays.host_float64(rows)
    assert _same_values(arrays.host_float64(rows.pin_memory()), expected)
    assert _same_values(arrays.host_float64(rows.cuda()), expected)
    batch = _batch(rows.cuda(), len(rows))
    assert _same_values(batch_matrix(batch), expected)


@contextmanager
def _counted_copies() -> Iterator[list[int]]:
    """The number of values each ``Tensor.copy_`` call copies, while inside."""
    copies: list[int] = []
    original = torch.Tensor.copy_

    def copy_(self: Any, other: Any, non_blocking: bool = False) -> Any:
        copies.append(other.numel())
        return original(self, other, non_blocking)

    torch.Tensor.copy_ = copy_
    try:
        yield copies
    finally:
        torch.Tensor.copy_ = original


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_host_float64_converts_a_large_tensor_in_serial_chunks(layout, monkeypatch):
    """Every copy stays within torch's serial size, chunk boundaries included
    (sizes that do not divide evenly), and the values are the whole tensor's."""
    monkeypatch.setattr(arrays, "SERIAL_ELEMENTS", 7)
    source = torch.from_numpy(RNG.normal(size=(5, 3, 4))).to(torch.bfloat16)
    if layout == "transposed":
        source = source.transpose(0, 1)  # (3, 5, 4), not contiguous
    with _counted_copies() as copies:
        got = arrays.host_float64(source)
    expected = source.to(torch.float32).numpy().astype(np.float64)
    assert got.shape == expected.shape and _same_values(got, expected)
    assert sum(copies) == source.numel()
    # contiguous: chunks of 7 values; strided: whole slices of the first dimension
    # (of 20 values, the fewest that can be taken: more than 7)
    assert max(copies) == (7 if layout == "contiguous" else 20) and len(copies) > 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_large_pieces_are_converted_into_their_rows_in_serial_copies(dtype, monkeypatch):
    """Pieces over torch's serial size (a window of a wide model's rows) are
    not joined by ``torch.cat``: each one is converted into its rows of the
    float64 matrix, every copy within the limit, with the stacked rows' values."""
    monkeypatch.setattr(arrays, "SERIAL_ELEMENTS", 50)
    pieces = _pieces(getattr(torch, dtype), (3, 6))  # 5 rows of 18 values: 90 > 50
    batch, stacked = _deferred(pieces)
    with _counted_copies() as copies:
        monkeypatch.setattr(torch, "cat", None)  # (would raise if called)
        values = map_rows(batch, l2_norms)
        monkeypatch.undo()
    rows = stacked.tensor
    expected = rows.reshape(len(rows), -1).to(torch.float32).numpy().astype(np.float64)
    assert values.tolist() == l2_norms(expected).tolist()
    assert sum(copies) == sum(piece.numel() for piece in pieces) and max(copies) <= 50
