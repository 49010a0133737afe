"""``sae_probe`` on the columnar path: its rows encoded once for every request
of a routed batch, kept by their active features (``SparseRows``), judged in
one pass (``judge_many``), and screened before a guard's step is encoded
(``SaeScreen``). The oracles: a dense matrix and a full stable sort built here,
each probe judging its own rows alone (``judge_rows``), and the exact scores
of the encoded rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sae_helpers import write_sae

from undercurrent.probes import RequestContext
from undercurrent.probes.arrays import map_rows
from undercurrent.probes.sae import SaeProbe, SaeScreen
from undercurrent.probes.sae_files import load_sae
from undercurrent.probes.sparse import (
    PRODUCT_ROWS,
    RaggedColumn,
    SparseRows,
    row_products,
    top_columns,
)
from undercurrent.records import ActivationBatch, BatchSignals, DeferredRows, as_list

torch = pytest.importorskip("torch")

D_IN, D_SAE = 8, 24
ARCHITECTURES = ["standard", "jumprelu", "topk"]


def _sae(tmp_path: Any, architecture: str, **config: Any) -> Any:
    folder = tmp_path / f"sae_{architecture}"
    write_sae(folder, architecture=architecture, d_in=D_IN, d_sae=D_SAE, seed=7,
              hook_name=None, config={"k": 5, **config} if architecture == "topk" else config)
    return folder


def _batch(tensor: Any, count: int, requests: int = 4) -> ActivationBatch:
    return ActivationBatch(tensor, request_ids=[f"r{i % requests}" for i in range(count)],
                           point_names=["p"] * count, layers=[i % 3 for i in range(count)],
                           tensor_type="residual_stream",
                           token_indices=[10 + i for i in range(count)],
                           is_generated=[True] * count, generated_indices=list(range(count)),
                           token_ids=[1] * count)


# -- SparseRows ----------------------------------------------------------------------
matrices = st.integers(0, 9).flatmap(lambda rows: st.integers(1, 7).flatmap(
    lambda width: st.lists(st.sampled_from([0.0, 0.0, 0.0, 1.5, -2.0, 3.25, float("nan")]),
                           min_size=rows * width, max_size=rows * width).map(
        lambda values: np.array(values, dtype=np.float64).reshape(rows, width))))


@settings(max_examples=80, deadline=None)
@given(matrix=matrices, data=st.data())
def test_sparse_rows_slice_join_and_reorder_as_the_dense_rows_do(matrix, data):
    rows = SparseRows.from_dense(matrix)
    assert len(rows) == len(matrix) and rows.width == matrix.shape[1]
    np.testing.assert_array_equal(rows.dense(), matrix)
    start = data.draw(st.integers(0, len(matrix)))
    stop = data.draw(st.integers(start, len(matrix)))
    np.testing.assert_array_equal(rows[start:stop].dense(), matrix[start:stop])
    joined = SparseRows.join_rows([rows[:start], rows[start:stop], rows[stop:]])
    np.testing.assert_array_equal(joined.dense(), matrix)
    order = np.array(data.draw(st.permutations(range(len(matrix)))), dtype=np.intp)
    np.testing.assert_array_equal(rows.take_rows(order).dense(), matrix[order])
    # each row's entries in column order, zeros left out
    for row in range(len(matrix)):
        entries = rows.columns[rows.indptr[row]:rows.indptr[row + 1]].tolist()
        assert entries == np.flatnonzero(matrix[row]).tolist()


@settings(max_examples=150, deadline=None)
@given(matrix=st.integers(1, 8).flatmap(lambda rows: st.integers(1, 40).flatmap(
    lambda width: st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, float("-inf"),
                                            float("inf"), float("nan")]),
                           min_size=rows * width, max_size=rows * width).map(
        lambda values: np.array(values).reshape(rows, width)))), data=st.data())
def test_top_columns_are_a_full_stable_sort_s_first_k(matrix, data):
    """Largest first, equal entries by lower column, NaN as -inf: what sorting
    every column gives (many ties drawn on purpose)."""
    k = data.draw(st.integers(1, matrix.shape[1]))
    ranked = np.where(np.isnan(matrix), -np.inf, matrix)
    expected = np.argsort(-ranked, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(top_columns(matrix, k), expected)


def test_row_products_give_each_row_the_same_bits_in_any_batch():
    """A BLAS product rounds a row differently with the height of the product it
    is in (one row: a matrix-vector product); row_products does not."""
    rng = np.random.default_rng(3)
    rows, weight = rng.normal(size=(3 * PRODUCT_ROWS + 5, 96)), rng.normal(size=(96, 200))
    whole = row_products(rows, weight)
    np.testing.assert_allclose(whole, rows @ weight, rtol=1e-12, atol=1e-12)
    for start, stop in [(0, 1), (7, 8), (3, 8), (5, 5 + PRODUCT_ROWS + 3), (40, len(rows))]:
        assert row_products(rows[start:stop], weight).tolist() == whole[start:stop].tolist()
    # (non-contiguous rows too)
    assert row_products(rows[::2], weight).tolist() == whole[::2].tolist()


# -- encoding -------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_sparse_encoding_is_the_dense_one_bit_for_bit(tmp_path, architecture):
    sae = load_sae(_sae(tmp_path, architecture))
    matrix = np.random.default_rng(1).normal(size=(150, D_IN)) * 2
    sparse = sae.encode_sparse(matrix)
    dense = sae.encode(matrix)
    assert (dense > 0).any() and (dense == 0).any()
    assert sparse.dense().tolist() == dense.tolist()
    assert len(sae.encode_sparse(matrix[:0])) == 0
    # one row alone, or in another block, encodes to the same bits
    for row in (0, 63, 64, 149):
        alone = sae.encode_sparse(matrix[row:row + 1]).dense()
        assert alone.tolist() == dense[row:row + 1].tolist()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_pieces_are_encoded_to_the_stacked_rows_activations(tmp_path, architecture):
    """map_rows over pieces a window stacks (each a row per request): the same
    rows, in the stacked order, as encoding the stacked matrix."""
    probe = SaeProbe(path=_sae(tmp_path, architecture), top_k=3)
    rng = np.random.default_rng(2)
    pieces = [torch.tensor(rng.normal(size=(4, D_IN)) * 2, dtype=torch.float32)
              for _ in range(9)]
    rows = 4 * len(pieces)
    stacked = torch.stack(pieces, 1).view(rows, D_IN)
    batch = _batch(DeferredRows(lambda: torch.stack(pieces, 1).view(rows, D_IN), pieces), rows)
    values = map_rows(batch, probe.sae.encode_sparse)
    assert batch.stacked_pieces() is not None  # never stacked
    expected = probe.sae.encode(stacked.numpy().astype(np.float64))
    assert values.dense().tolist() == expected.tolist()


# -- judging in one pass ---------------------------------------------------------------
def _nan_free(value: Any) -> Any:
    """NaN as a string (NaN is not equal to itself), in lists and dicts too."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, dict):
        return {key: _nan_free(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_nan_free(item) for item in value]
    return value


def _signals_view(signals: Any) -> Any:
    return [(s.action, _nan_free(s.score), _nan_free(dict(s.metadata)))
            for s in signals.signals()]


@pytest.mark.parametrize("args", [{"top_k": 3, "threshold": 2.0},
                                  {"features": [1, 5, 9], "threshold": 1.0, "action": "abort"},
                                  {"top_k": 4, "threshold": -1.0}],
                         ids=["top_k", "watched", "threshold_below_zero"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_judging_many_at_once_is_each_judging_its_own_rows(tmp_path, architecture, args):
    """judge_many over every request's rows gives each probe the signals and
    the state (so the verdict) judge_rows on its own rows gives, bit for bit;
    and the values of a routed batch are each request's own rows' values."""
    folder = _sae(tmp_path, architecture)
    rng = np.random.default_rng(4)
    spans = [(0, 5), (5, 11), (11, 11), (11, 20)]
    count = spans[-1][1]
    tensor = torch.tensor(rng.normal(size=(count, D_IN)) * 2, dtype=torch.float32)
    tensor[6] = torch.nan  # (a row of NaN: no feature active, or NaN)
    batch = _batch(tensor, count)
    first = SaeProbe(path=folder, **args)
    together = [first] + [first.copy_for_request() for _ in spans[1:]]
    alone = [SaeProbe(path=folder, **args) for _ in spans]
    for probe in together + alone:
        probe.on_start(RequestContext("r", prompt_len=10))
    values = first.row_values(batch)
    for _ in range(2):  # (twice: the second pass adds to the first's state)
        joined = SaeProbe.judge_many(together, values, spans, batch.token_indices,
                                     batch.layers)
        assert joined is not None
        mine = _signals_view(joined)
        theirs = []
        for probe, (start, stop) in zip(alone, spans, strict=True):
            if start == stop:  # (no rows: nothing to judge)
                continue
            own = probe.row_values(batch[start:stop])
            np.testing.assert_array_equal(own[0].dense(), values[0][start:stop].dense())
            theirs += _signals_view(probe.judge_rows(own, batch.token_indices[start:stop],
                                                     batch.layers[start:stop]))
        assert mine == theirs
    for mine_probe, their_probe in zip(together, alone, strict=True):
        assert _nan_free(mine_probe.on_end(None)) == _nan_free(their_probe.on_end(None))


def _loop_verdict_features(dense: Any, tokens: list[int], layers: list[int],
                           features: list[int], threshold: float | None) -> list[dict]:
    """The verdict's feature rows computed by hand: one activation at a time,
    in row order, as a researcher's loop over a request's rows would."""
    found = []
    for feature in features:
        peak, total = 0.0, 0.0
        first_active = first_crossing = (None, None)
        for row, value in enumerate(dense[:, feature].tolist()):
            peak = value if value != value or peak != peak else max(peak, value)
            total += value
            if value > 0 and first_active[0] is None:
                first_active = (tokens[row], layers[row])
            if (threshold is not None and value >= threshold
                    and first_crossing[0] is None):
                first_crossing = (tokens[row], layers[row])
        found.append({"feature": feature, "max": peak, "mean": total / len(dense),
                      "first_crossing_token_index": first_crossing[0],
                      "first_crossing_layer": first_crossing[1],
                      "first_active_token_index": first_active[0],
                      "first_active_layer": first_active[1]})
    return found


@pytest.mark.parametrize("args", [{"top_k": 3, "threshold": 2.0},
                                  {"features": [1, 5, 9], "threshold": 1.0},
                                  {"top_k": 4, "threshold": -1.0}, {"top_k": 24}],
                         ids=["top_k", "watched", "threshold_below_zero", "every_feature"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_many_requests_judged_together_end_as_a_loop_over_each_one_s_rows(
        tmp_path, architecture, args):
    """Every request's peaks, means and first activations (and crossings), added
    up for all requests at once over two batches, are what a loop over each
    request's own rows gives by hand; and ending them together (end_many) gives
    each the verdict its own on_end gives."""
    folder = _sae(tmp_path, architecture)
    rng = np.random.default_rng(11)
    spans = [(0, 4), (4, 9), (9, 9), (9, 16)]
    count = spans[-1][1]
    probes = [SaeProbe(path=folder, **args) for _ in spans]
    for probe in probes:
        probe.on_start(RequestContext("r", prompt_len=10))
    passes = []
    for step in range(2):
        tensor = torch.tensor(rng.normal(size=(count, D_IN)) * 2, dtype=torch.float32)
        batch = _batch(tensor, count)
        batch.token_indices = [10 * step + i for i in range(count)]
        signals = SaeProbe.judge_many(probes, probes[0].row_values(batch), spans,
                                      batch.token_indices, batch.layers)
        assert signals is not None
        passes.append((tensor.double().numpy(), batch.token_indices, batch.layers))
    verdicts = SaeProbe.end_many(probes, [None] * len(probes))
    assert verdicts == [probe.on_end(None) for probe in probes]
    seen = [probe for probe in probes if probe._rows]  # (ranked at once: every one has rows)
    assert SaeProbe.end_many(seen, [None] * len(seen)) == [probe.on_end(None) for probe in seen]
    sae = probes[0].sae
    threshold = args.get("threshold")
    for (start, stop), verdict in zip(spans, verdicts, strict=True):
        if start == stop:
            assert verdict["features"] == ([] if "top_k" in args else [
                {"feature": f, "max": None, "mean": None,
                 "first_crossing_token_index": None, "first_crossing_layer": None,
                 "first_active_token_index": None, "first_active_layer": None}
                for f in args["features"]])
            continue
        dense = np.concatenate([sae.encode(rows[start:stop]) for rows, _, _ in passes])
        tokens = [t for _, toks, _ in passes for t in toks[start:stop]]
        layers = [la for _, _, lays in passes for la in lays[start:stop]]
        chosen = [row["feature"] for row in verdict["features"]]
        if "top_k" in args:
            peaks = dense.max(axis=0)
            expected = [int(f) for f in np.argsort(-peaks, kind="stable")[:args["top_k"]]
                        if peaks[f] > 0]
            assert chosen == expected
        assert verdict["features"] == _loop_verdict_features(dense, tokens, layers, chosen,
                                                             threshold)


def test_a_ragged_column_reads_as_its_rows_lists_and_slices_without_copying():
    column = RaggedColumn(np.array([0, 2, 2, 5]), np.array([3.5, 1.0, 9.0, 8.0, 7.0]))
    assert len(column) == 3 and as_list(column) == [[3.5, 1.0], [], [9.0, 8.0, 7.0]]
    assert column[1:].tolist() == [[], [9.0, 8.0, 7.0]] and column[2:2].tolist() == []
    assert column[1:3].values is column.values  # (the values are shared)
    with pytest.raises(ValueError, match="ranges of rows"):
        column[::2]
    # A signal reads its row's list, as Python values.
    signals = BatchSignals([0, 0, 0], [1.0, 2.0, 3.0], {"features": column},
                           all_scored=True).signals()
    assert [s.metadata["features"] for s in signals] == [[3.5, 1.0], [], [9.0, 8.0, 7.0]]
    assert type(signals[0].metadata["features"][0]) is float


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_abort_test_is_what_judging_says(tmp_path, architecture):
    folder = _sae(tmp_path, architecture)
    probes = [SaeProbe(path=folder, features=[2, 3], threshold=1.5, action="abort")]
    test = SaeProbe.abort_test(probes)
    assert test is not None
    rng = np.random.default_rng(5)
    seen = set()
    for trial in range(40):
        batch = _batch(torch.tensor(rng.normal(size=(6, D_IN)) * (trial / 10),
                                    dtype=torch.float32), 6)
        values = probes[0].row_values(batch)
        probe = SaeProbe(path=folder, features=[2, 3], threshold=1.5, action="abort")
        probe.on_start(RequestContext("r", prompt_len=10))
        signals = probe.judge_rows(values, batch.token_indices, batch.layers).signals()
        aborts = any(s.action.value == "abort" for s in signals)
        assert test(values) is aborts
        seen.add(aborts)
    assert seen == {True, False}
    flags = [SaeProbe(path=folder, features=[2], threshold=1.5)]
    assert SaeProbe.abort_test(flags)(values) is False  # type: ignore[misc]
    mixed = [probes[0], SaeProbe(path=folder, features=[2], threshold=1.5, action="abort")]
    assert SaeProbe.abort_test(mixed) is None  # (not judged alike)


# -- the screen -----------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(architecture=st.sampled_from(ARCHITECTURES), scale=st.floats(0.1, 4.0),
       quantile=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(["float32", "bfloat16", "float64"]), rescale=st.booleans())
def test_the_screen_never_clears_a_step_that_would_abort(tmp_path_factory, architecture, scale,
                                                         quantile, seed, dtype, rescale):
    """False only where no watched activation reaches the threshold (drawn
    among, and just beside, the scores the rows give), whatever the dtype."""
    config = {"rescale_acts_by_decoder_norm": rescale} if architecture == "topk" else {}
    folder = _sae(tmp_path_factory.mktemp("sae"), architecture, **config)
    rng = np.random.default_rng(seed)
    pieces = [torch.tensor(rng.normal(size=(4, D_IN)) * scale).to(getattr(torch, dtype))
              for _ in range(3)]
    rows = torch.cat(pieces).to(torch.float64).numpy()
    probe = SaeProbe(path=folder, features=[0, 4])
    scores = np.sort(probe._scores(probe.sae.encode_sparse(rows)))
    threshold = float(scores[round(quantile * (len(scores) - 1))])
    for edge in (threshold, np.nextafter(threshold, np.inf), np.nextafter(threshold, -np.inf)):
        if edge <= 0:
            continue
        may = SaeScreen(probe.sae, [0, 4], float(edge))(pieces)
        if not may:
            assert not (scores >= edge).any()
    # far above every score: cleared (else the screen would never help)
    assert SaeScreen(probe.sae, [0, 4], float(scores.max()) * 2 + 10)(pieces) is False


def test_the_screen_sends_what_it_cannot_read_to_the_exact_path(tmp_path):
    screen = SaeScreen(load_sae(_sae(tmp_path, "standard")), [1], 1e9)
    assert screen([torch.zeros(3, D_IN)]) is False
    assert screen([torch.zeros(3, D_IN + 1)]) is True  # (another width: the exact path says)
    assert screen([torch.full((3, D_IN), float("nan"))]) is True
    assert screen([np.zeros((3, D_IN))]) is True  # (not a torch tensor)
    assert screen([]) is True


def test_only_a_guard_on_watched_features_is_screened(tmp_path):
    folder = _sae(tmp_path, "standard")
    guard = SaeProbe(path=folder, features=[1], threshold=2.0, action="abort")
    assert isinstance(SaeProbe.abort_screen([guard]), SaeScreen)
    assert SaeProbe.abort_screen([SaeProbe(path=folder, top_k=2, threshold=2.0,
                                           action="abort")]) is None
    assert SaeProbe.abort_screen([SaeProbe(path=folder, features=[1], threshold=2.0)]) is None
