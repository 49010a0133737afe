"""Records, signals and results: the values that flow through the router."""

from __future__ import annotations

import collections
import dataclasses
import time

import pytest

from undercurrent.records import (
    ABORT_CODE,
    NO_SIGNAL,
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    ProbeResult,
    ProbeSignal,
    ProbeStats,
    SignalAction,
)


def test_signal_coerces_action_strings_and_scores_to_float():
    before = time.time()
    signal = ProbeSignal("abort", score=1)
    assert signal.action is SignalAction.ABORT and isinstance(signal.score, float)
    assert before <= signal.timestamp <= time.time()
    assert ProbeSignal().action is SignalAction.CONTINUE and ProbeSignal().score is None
    with pytest.raises(ValueError):
        ProbeSignal("stop")


def test_records_are_frozen_and_keyed_by_request_point_layer_token():
    record = ActivationRecord("r", "p", 3, "mlp_out", 12, True, 2, 99, [0.0])
    assert record.key() == ("r", "p", 3, 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.layer = 4  # type: ignore[misc]


def test_result_reports_flagged_and_scores_in_signal_order():
    signals = [ProbeSignal(score=0.1), ProbeSignal("flag", score=0.9), ProbeSignal()]
    stats = ProbeStats(received=3, processed=3)
    result = ProbeResult("r", "p", {"max": 0.9}, signals, stats)
    assert isinstance(result.signals, tuple)
    assert result.flagged and result.scores == [0.1, 0.9, None]
    quiet = ProbeResult("r", "p", None, [ProbeSignal()], stats)
    assert not quiet.flagged
    assert stats.as_dict() == {"received": 3, "processed": 3, "dropped": 0, "errors": 0,
                               "timeouts": 0, "mean_latency_s": 0.0}


def test_a_joined_batch_shares_the_values_of_the_batches_its_pieces_came_from():
    # The async queues join each request's slices of several routed batches; the
    # values a probe derives must still be computed once per routed batch, and
    # equal those computed on the joined rows.
    np = pytest.importorskip("numpy")
    from undercurrent.records import ActivationBatch

    def routed(seed: int) -> ActivationBatch:
        rows = np.random.default_rng(seed).normal(size=(6, 3))
        return ActivationBatch(rows, request_ids=["a", "a", "b", "b", "c", "c"],
                               point_names=["p"] * 6, layers=[0, 1] * 3,
                               tensor_type="mlp_out", token_indices=[4] * 6,
                               is_generated=[True] * 6, generated_indices=[0] * 6,
                               token_ids=[7] * 6)

    calls: list[int] = []

    def values(batch: ActivationBatch) -> tuple[object, dict[str, list[float]]]:
        calls.append(len(batch))
        sums = np.asarray(batch.tensor).sum(axis=1)
        return sums, {"first": np.asarray(batch.tensor)[:, 0].tolist()}

    first, second = routed(1), routed(2)
    joined = ActivationBatch.concat([first[2:4], second[2:4], second[4:6]])
    sums, meta = joined.shared("key", values)
    assert calls == [6, 6]  # once per routed batch, never for the joined rows
    assert sums.tolist() == pytest.approx(np.asarray(joined.tensor).sum(axis=1).tolist())
    assert meta["first"] == np.asarray(joined.tensor)[:, 0].tolist()
    assert joined[1:3].shared("key", values)[0].tolist() == pytest.approx(sums[1:3].tolist())
    assert first[0:2].shared("key", values)[0].tolist() == pytest.approx(
        np.asarray(first.tensor)[0:2].sum(axis=1).tolist())
    assert calls == [6, 6]


def test_each_row_keeps_its_capture_time_through_slices_and_joins():
    """``timestamps`` (rows captured at different times) reach each row's
    record, through a slice and a join; a batch without them stamps every row
    with its ``timestamp``, and joining batches captured at different times
    keeps each row's."""

    def batch(rows: int, stamp: float, stamps: list[float] | None = None) -> ActivationBatch:
        return ActivationBatch([[float(i)] for i in range(rows)], request_ids=["a"] * rows,
                               point_names=["p"] * rows, layers=list(range(rows)),
                               tensor_type="mlp_out", token_indices=[4] * rows,
                               is_generated=[True] * rows, generated_indices=[0] * rows,
                               token_ids=[7] * rows, timestamp=stamp, timestamps=stamps)

    window = batch(4, 10.0, [10.0, 10.0, 11.0, 12.0])
    assert [r.timestamp for r in window.records()] == [10.0, 10.0, 11.0, 12.0]
    assert [r.timestamp for r in window[1:3].records()] == [10.0, 11.0]
    assert [r.timestamp for r in window.without_cache().records()] == [10.0, 10.0, 11.0, 12.0]
    plain = batch(2, 20.0)
    assert plain.timestamps is None and plain.column_timestamps() == [20.0, 20.0]
    joined = ActivationBatch.concat([plain, batch(2, 21.0), window[2:]])
    assert [r.timestamp for r in joined.records()] == [20.0, 20.0, 21.0, 21.0, 11.0, 12.0]
    assert joined.timestamp == 20.0
    same = ActivationBatch.concat([batch(1, 5.0), batch(2, 5.0)])
    assert same.timestamps is None and [r.timestamp for r in same.records()] == [5.0] * 3


def _deferred_batch(made: list[int]):
    np = pytest.importorskip("numpy")
    from undercurrent.records import ActivationBatch, DeferredRows

    rows = np.arange(12.0).reshape(6, 2)

    def make():
        made.append(1)
        return rows.copy()

    batch = ActivationBatch(DeferredRows(make), request_ids=["a"] * 3 + ["b"] * 3,
                            point_names=["p"] * 6, layers=[0, 1, 2] * 2,
                            tensor_type="mlp_out", token_indices=[4] * 6,
                            is_generated=[True] * 6, generated_indices=[0] * 6,
                            token_ids=[7] * 6)
    return batch, rows


def test_deferred_rows_are_made_once_when_first_read_and_slices_share_them():
    made: list[int] = []
    batch, rows = _deferred_batch(made)
    first, second = batch[0:3], batch[3:6]
    assert len(first) == 3 and first.request_ids == ["a"] * 3 and made == []  # not read yet
    assert second.tensor.tolist() == rows[3:6].tolist() and made == [1]
    assert first.tensor.tolist() == rows[0:3].tolist()
    assert batch.tensor.tolist() == rows.tolist() and made == [1]  # one stack for all
    assert first.tensor.base is batch.tensor or first.tensor.base is batch.tensor.base
    assert [record.tensor.tolist() for record in second.records()] == rows[3:6].tolist()
    assert batch[1:2].tensor.tolist() == rows[1:2].tolist() and made == [1]


def test_own_rows_copy_the_rows_of_some_spans_into_a_batch_of_their_own():
    made: list[int] = []
    batch, rows = _deferred_batch(made)
    batch.records()  # (records built already are not shared: they view the batch)
    own = batch.own_rows([(1, 3), (4, 6)])
    assert made == [1] and own.layers == [1, 2, 1, 2] and own.request_ids == ["a", "a", "b", "b"]
    assert own.tensor.tolist() == rows[[1, 2, 4, 5]].tolist()
    assert own.tensor.base is None and own.root is None and own.parts is None
    assert [r.tensor.tolist() for r in own.records()] == rows[[1, 2, 4, 5]].tolist()
    assert [r.tensor.base is own.tensor for r in own.records()] == [True] * 4
    alone = batch.own_rows([(3, 6)])
    assert alone.tensor.tolist() == rows[3:6].tolist() and alone.tensor.base is None
    assert alone.own_rows([(0, 3)]) is None  # (its own rows already)
    assert batch[0:2].without_cache().own_rows([(0, 2)]) is not None  # (a view of more)
    listed = ActivationBatch([[1.0], [2.0]], request_ids=["a", "b"], point_names=["p"] * 2,
                             layers=[0, 0], tensor_type="mlp_out", token_indices=[4, 4],
                             is_generated=[True] * 2, generated_indices=[0, 0],
                             token_ids=[7, 7])
    assert listed.own_rows([(0, 1)]) is None  # (a list's rows are their own)


def test_deferred_rows_read_by_many_threads_at_once_are_made_once():
    import threading

    made: list[int] = []
    batch, rows = _deferred_batch(made)
    pieces = [batch[i:i + 1] for i in range(6)]
    barrier = threading.Barrier(6)
    seen: dict[int, list[float]] = {}

    def read(index: int) -> None:
        barrier.wait()
        seen[index] = pieces[index].tensor.tolist()[0]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert made == [1]
    assert [seen[i] for i in range(6)] == rows.tolist()


def test_signal_columns_tell_whether_any_row_got_a_signal_as_lists_or_arrays() -> None:
    import numpy as np

    for codes, expected in (([NO_SIGNAL, NO_SIGNAL], False), ([NO_SIGNAL, 1], True),
                            ([0], True), ([], False)):
        assert BatchSignals(codes).any_signal() is expected
        assert BatchSignals(tuple(codes)).any_signal() is expected
        assert BatchSignals(list(np.array(codes, dtype=np.int64))).any_signal() is expected
        assert BatchSignals(np.array(codes, dtype=np.int64)).any_signal() is expected
        assert BatchSignals(collections.deque(codes)).any_signal() is expected
    for codes, expected in (([0, 1, NO_SIGNAL], False), ([0, ABORT_CODE], True), ([], False),
                            ([ABORT_CODE], True)):
        assert BatchSignals(codes).any_abort() is expected
        assert BatchSignals(np.array(codes, dtype=np.int64)).any_abort() is expected
    # joined: list and array parts, the codes in order
    joined = BatchSignals.concat([BatchSignals.none(2), BatchSignals(np.array([1, NO_SIGNAL])),
                                  BatchSignals((NO_SIGNAL, ABORT_CODE))])
    assert joined.actions == [NO_SIGNAL, NO_SIGNAL, 1, NO_SIGNAL, NO_SIGNAL, ABORT_CODE]
    assert joined.any_signal() and joined.any_abort()
    # array columns (scores, metadata) read back as Python values, like list ones
    signals = BatchSignals(np.array([0, NO_SIGNAL]), np.array([0.25, 0.5]),
                           {"value": np.array([1.5, 2.5])}, all_scored=True).signals()
    assert signals[1] is None and signals[0] is not None
    assert type(signals[0].score) is float and signals[0].score == 0.25
    assert signals[0].metadata == {"value": 1.5} and type(signals[0].metadata["value"]) is float


def test_an_int_column_reads_as_the_list_of_its_python_ints() -> None:
    import copy
    import pickle

    import numpy as np

    from undercurrent.records import IntColumn, as_list

    column = IntColumn(np.array([7, 8, 9, 10], dtype=np.int64))
    assert len(column) == 4 and column[0] == 7 and type(column[-1]) is int
    assert list(column) == [7, 8, 9, 10] and all(type(item) is int for item in column)
    assert as_list(column) == [7, 8, 9, 10] and type(as_list(column)[0]) is int
    assert column[1:3] == [8, 9] and column[1:3] == (8, 9) and column != [8, 9]
    assert isinstance(column[1:3], IntColumn) and column[1:3] == IntColumn(np.array([8, 9]))
    assert pickle.loads(pickle.dumps(column)) == [7, 8, 9, 10]
    assert copy.deepcopy(column) == [7, 8, 9, 10]
    assert np.asarray(column).tolist() == [7, 8, 9, 10]
    tokens: list[int] = [1]
    tokens += column[2:]
    assert tokens == [1, 9, 10]
    # in a batch: records, slices and joined batches give Python ints too
    batch = ActivationBatch(np.zeros((4, 2), dtype=np.float32), request_ids=["a", "a", "b", "b"],
                            point_names=["p"] * 4, layers=[0, 1, 0, 1], tensor_type="mlp_out",
                            token_indices=column, is_generated=[True] * 4,
                            generated_indices=IntColumn(np.array([0, 0, 3, 3])),
                            token_ids=IntColumn(np.array([5, 5, 6, 6])))
    assert [record.token_index for record in batch.records()] == [7, 8, 9, 10]
    assert type(batch.records()[2].generated_index) is int
    assert batch[2:].located(0) == ("b", "p", 0, 9, 3)
    joined = ActivationBatch.concat([batch[:2], batch[2:]])
    assert joined.token_ids == [5, 5, 6, 6] and type(joined.token_ids[0]) is int


def test_results_built_without_the_frozen_init_equal_the_constructors():
    from undercurrent.adapters.outputs import GenerationOutput
    from undercurrent.probes.base import RequestContext
    from undercurrent.records import LazySequence, ProbeResult, ProbeStats, built

    stats = ProbeStats.of(5, 4, 1, 2, 0, 0.25)
    assert stats == ProbeStats(received=5, processed=4, dropped=1, errors=2, timeouts=0,
                               mean_latency_s=0.25)
    signal = ProbeSignal(score=0.5)
    result = ProbeResult.of("r", "p", {"count": 1}, (signal,), stats, None, {"k": 1})
    assert result == ProbeResult(request_id="r", extraction_point_name="p",
                                 verdict={"count": 1}, signals=[signal], stats=stats,
                                 metadata={"k": 1})
    lazy = ProbeResult.of("r", "p", None, LazySequence(lambda: [signal]), stats, "x", {})
    assert lazy.signals == (signal,) and lazy.error == "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.verdict = None  # type: ignore[misc]
    context = RequestContext.of_prompt("r", "hi", 2, "m", (4, 5))
    assert context == RequestContext(request_id="r", prompt="hi", prompt_len=2,
                                     model_name="m", prompt_token_ids=[4, 5])
    assert dict(context.metadata) == {} and context.at_point(None).prompt_len == 2
    fields = {field.name: None for field in dataclasses.fields(GenerationOutput)}
    fields.update(request_id="r", prompt="p", text="t", token_ids=(1,), prompt_len=1)
    assert built(GenerationOutput, dict(fields)) == GenerationOutput(**fields)
