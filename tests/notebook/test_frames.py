"""Frames: one row per record / signal / result, with the documented columns and values."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from nb_builders import make_records, make_result

from undercurrent.notebook import (
    RECORD_COLUMNS,
    RESULT_COLUMNS,
    SIGNAL_COLUMNS,
    activation_matrix,
    frame_to_records,
    record_tensors,
    records_frame,
    results_frame,
    select_rows,
    signals_frame,
)


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return f"<{ids[0]}>"


def test_records_frame_has_one_row_per_record_with_documented_columns(records):
    frame = records_frame(records)
    assert tuple(frame.columns) == RECORD_COLUMNS
    assert len(frame) == len(records)
    tensors = record_tensors(frame)
    for row, record, tensor in zip(frame.itertuples(index=False), records, tensors, strict=True):
        assert row.request == record.request_id
        assert row.point == record.extraction_point_name
        assert row.layer == record.layer
        assert row.token_index == record.token_index
        assert row.is_generated == record.is_generated
        assert row.edits == ()
        np.testing.assert_array_equal(tensor, record.tensor)
        assert row.shape == (6,)
        assert row.dtype == "float32"


def test_records_frame_has_no_column_of_arrays(records):
    frame = records_frame(records)
    for column in frame.columns:
        assert not any(isinstance(value, np.ndarray) for value in frame[column]), column
    assert frame["row"].dtype == np.int64


def test_records_frame_prompt_tokens_have_missing_generated_index(records):
    frame = records_frame(records)
    prompt = frame[~frame["is_generated"]]
    generated = frame[frame["is_generated"]]
    assert prompt["generated_index"].isna().all()
    assert generated["generated_index"].notna().all()
    assert (generated["token_index"] - generated["generated_index"] == 3).all()


def test_records_frame_decodes_each_distinct_token_once():
    tokenizer = CountingTokenizer()
    frame = records_frame(make_records(requests=2, layers=(0, 1)), tokenizer=tokenizer)
    assert frame["token_text"].iloc[0] == "<10>"
    assert tokenizer.calls == frame["token_id"].nunique()


def test_records_frame_accepts_generation_outputs_and_lists_of_them(records):
    outputs = [SimpleNamespace(records=records[:5]), SimpleNamespace(records=records[5:])]
    assert len(records_frame(outputs)) == len(records)
    assert len(records_frame(outputs[0])) == 5
    # An output generated without records=True holds none: said, not an empty frame
    # that a later step refuses for another reason.
    unkept = [outputs[0], SimpleNamespace(request_id="req7", records=None)]
    with pytest.raises(ValueError, match=r"records\[1\].*'req7'.*records=True"):
        records_frame(unkept)
    with pytest.raises(ValueError, match="records=True"):
        activation_matrix(unkept)


def test_records_frame_rejects_results_with_a_message_naming_the_input():
    with pytest.raises(TypeError, match=r"records\[0\].*ActivationRecord"):
        records_frame([3])


def test_records_frame_keeps_torch_bfloat16_dtype_name():
    torch = pytest.importorskip("torch")
    record = make_records(requests=1, layers=(0,), prompt_len=1, generated=0)[0]
    tensor = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    frame = records_frame([_with_tensor(record, tensor)])
    assert frame["dtype"].iloc[0] == "bfloat16"
    np.testing.assert_array_equal(activation_matrix(frame, dtype=None),
                                  np.array([[1.5, -2.25]], np.float32))


def _with_tensor(record, tensor):
    from dataclasses import replace

    return replace(record, tensor=tensor)


def test_activation_matrix_stacks_the_selected_layer_in_frame_order(records):
    frame = records_frame(records)
    matrix = activation_matrix(frame, layer=1)
    expected = np.stack([r.tensor for r in records if r.layer == 1])
    np.testing.assert_array_equal(matrix, expected)
    assert matrix.dtype == np.float32


def test_activation_matrix_of_one_site_is_a_read_only_view_shared_by_every_call(records):
    frame = records_frame(records)
    layer1 = activation_matrix(frame, layer=1)
    again = activation_matrix(select_rows(frame, layer=1))
    assert np.shares_memory(layer1, again)
    assert np.shares_memory(layer1, activation_matrix(frame[frame["layer"] == 1].copy()))
    assert not layer1.flags.writeable
    single = records_frame([r for r in records if r.layer == 0])
    whole = activation_matrix(single)
    assert np.shares_memory(whole, activation_matrix(single, layer=0))
    np.testing.assert_array_equal(whole, np.stack([r.tensor for r in records if r.layer == 0]))


def test_activation_matrix_copies_when_it_must(records):
    frame = records_frame(records)
    layer1 = activation_matrix(frame, layer=1)
    # Another dtype, or rows that are no block of the matrix, are copies.
    wide = activation_matrix(frame, layer=1, dtype="float64")
    assert wide.dtype == np.float64 and not np.shares_memory(wide, layer1)
    np.testing.assert_array_equal(wide, layer1)
    mixed = activation_matrix(frame)
    np.testing.assert_array_equal(mixed, np.stack([r.tensor for r in records]))
    assert not np.shares_memory(mixed, layer1)
    reversed_rows = activation_matrix(frame.iloc[::-1], layer=1)
    np.testing.assert_array_equal(reversed_rows, layer1[::-1])


def test_records_frame_takes_a_batch_with_a_records_method(records):
    batch = SimpleNamespace(records=lambda: records[:4])
    frame = records_frame(batch)
    assert len(frame) == 4
    np.testing.assert_array_equal(activation_matrix(frame, layer=0),
                                  np.stack([r.tensor for r in records[:4] if r.layer == 0]))


def test_activations_travel_with_row_selections_but_not_merges(records):
    frame = records_frame(records)
    sorted_frame = frame.sort_values(["layer", "token_index"], ascending=False)
    expected = [records[i].tensor for i in sorted_frame.index if records[i].layer == 0]
    np.testing.assert_array_equal(activation_matrix(sorted_frame, layer=0), np.stack(expected))
    labels = pd.DataFrame({"request": ["req0", "req1"], "label": [0, 1]})
    merged = frame.merge(labels, on="request")
    with pytest.raises(ValueError, match=r"merged.attrs.update\(frame.attrs\)"):
        activation_matrix(merged, layer=0)
    merged.attrs.update(frame.attrs)
    np.testing.assert_array_equal(activation_matrix(merged, layer=0),
                                  activation_matrix(frame, layer=0))


def test_rows_of_two_records_frames_concatenated_are_refused_not_read_from_one(records):
    # After pd.concat of two records frames (pandas drops their differing attrs) and
    # attrs.update from one of them, as the message advised, the other frame's rows
    # read the first one's activations, silently.
    first, second = records_frame(records[:14]), records_frame(records[14:])
    both = pd.concat([first, second], ignore_index=True)
    with pytest.raises(ValueError, match=r"records_frame\(outputs_1 \+ outputs_2\)"):
        activation_matrix(both, layer=0)
    both.attrs.update(first.attrs)
    for read in (lambda: activation_matrix(both, layer=0), lambda: record_tensors(both)):
        with pytest.raises(ValueError, match=r"^(activation_matrix: 7 of the 14|record_tensors: "
                           r"14 of the 28) rows come from another records frame than the "
                           r"activations this frame carries .*records_frame\(outputs_1 \+ "
                           r"outputs_2\)"):
            read()
    # the rows of the frame whose activations it carries still read; one frame of all
    # the records reads every row
    np.testing.assert_array_equal(activation_matrix(both.iloc[:14], layer=0),
                                  activation_matrix(first, layer=0))
    whole = records_frame(records)
    np.testing.assert_array_equal(activation_matrix(whole, layer=0),
                                  np.stack([r.tensor for r in records if r.layer == 0]))
    # rows of one frame concatenated keep its activations
    halves = pd.concat([whole[whole["layer"] == 1], whole[whole["layer"] == 0]])
    np.testing.assert_array_equal(activation_matrix(halves, layer=0),
                                  activation_matrix(whole, layer=0))


def test_a_tokenizer_without_decode_and_a_frame_that_is_not_one_are_refused_naming_them(
        records):
    # (records_frame(tokenizer=5) was "'int' object has no attribute 'decode'",
    # frame_to_records(5) another AttributeError, a frame without 'row' a KeyError)
    with pytest.raises(TypeError, match=r"records_frame: tokenizer must have a "
                                        r"decode\(list_of_ids\) method .* got int \(5\)"):
        records_frame(records, tokenizer=5)
    with pytest.raises(TypeError, match=r"frame_to_records takes a records frame .* got int"):
        frame_to_records(5)
    frame = records_frame(records)
    with pytest.raises(ValueError, match=r"frame_to_records: the frame lacks the column\(s\) "
                                         r"\['layer', .*'shape', 'row'\]"):
        frame_to_records(frame[["request", "point"]])
    assert len(frame_to_records(frame.iloc[:2])) == 2


def test_a_frame_without_tensors_is_refused_and_a_tensor_column_frame_still_read(records):
    light = records_frame(records, tensors=False)
    assert light.columns.tolist() == list(RECORD_COLUMNS)
    with pytest.raises(ValueError, match="tensors=False"):
        activation_matrix(light)
    legacy = light.assign(tensor=[r.tensor for r in records])
    np.testing.assert_array_equal(activation_matrix(legacy, layer=1),
                                  np.stack([r.tensor for r in records if r.layer == 1]))


def test_tensors_takes_true_or_false_only(records):
    kept = records_frame(records, tensors=np.bool_(True))  # (mask.any() gives one)
    np.testing.assert_array_equal(activation_matrix(kept),
                                  activation_matrix(records_frame(records)))
    with pytest.raises(TypeError, match=r"records_frame: tensors must be True or False, got "
                                        r"int \(1\)"):
        records_frame(records, tensors=1)
    with pytest.raises(TypeError, match=r"records_frame: tensors must be True or False, got "
                                        r"str \('no'\)"):
        records_frame(records, tensors="no")


def test_select_rows_keeps_the_rows_of_any_value_a_list_gives(records):
    frame = records_frame(records)
    both = select_rows(frame, layer=[0, 1], request=("req0",))
    assert both.index.tolist() == frame.index[frame.request == "req0"].tolist()
    assert select_rows(frame, layer=np.array([1])).equals(select_rows(frame, layer=1))
    # a 0-d array or tensor is its one value (it raised "iteration over a 0-d array")
    torch = pytest.importorskip("torch")
    for one in (np.array(1), np.int64(1), torch.tensor(1)):
        assert select_rows(frame, layer=one).equals(select_rows(frame, layer=1))


def test_label_rows_by_a_column_the_frame_lacks_names_its_columns(records):
    from undercurrent.notebook import label_rows
    frame = records_frame(records)
    with pytest.raises(ValueError, match=r"label_rows: by='prompt' names no column of the "
                                         r"frame; its columns are \['request', 'point'"):
        label_rows(frame, {"req0": 1}, by="prompt")


def test_activation_matrix_flattens_kv_tensors():
    record = make_records(requests=1, layers=(0,), prompt_len=1, generated=0)[0]
    kv = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)
    matrix = activation_matrix([_with_tensor(record, kv)])
    np.testing.assert_array_equal(matrix, kv.reshape(1, -1))


def test_activation_matrix_refuses_mixed_sizes_and_empty_selections(records):
    frame = records_frame(records + make_records(requests=1, hidden=4, point="other"))
    with pytest.raises(ValueError, match="different sizes"):
        activation_matrix(frame)
    with pytest.raises(ValueError, match="layers \\[0, 1\\]"):
        activation_matrix(frame, layer=7)


def test_signals_frame_one_row_per_signal_with_locations_from_metadata():
    results = {
        "p": make_result("r0", "p", [0.1, 0.7, None], ["continue", "flag", "abort"]),
        "q": make_result("r0", "q", [0.2], with_location=False),
    }
    frame = signals_frame(results)
    assert tuple(frame.columns) == SIGNAL_COLUMNS
    assert len(frame) == 4
    p_rows = frame[frame["point"] == "p"]
    assert p_rows["signal_index"].tolist() == [0, 1, 2]
    assert p_rows["generated_index"].tolist() == [0, 1, 2]
    assert p_rows["action"].tolist() == ["continue", "flag", "abort"]
    assert p_rows["flagged"].tolist() == [False, True, True]
    assert math.isnan(p_rows["score"].iloc[2])
    q_row = frame[frame["point"] == "q"].iloc[0]
    assert q_row["generated_index"] is pd_na()


def pd_na():
    import pandas as pd

    return pd.NA


def test_results_frame_summarises_each_result():
    outputs = [
        SimpleNamespace(results={"p": make_result("r0", "p", [0.1, 0.9], ["continue", "abort"])}),
        SimpleNamespace(results={"p": make_result("r1", "p", [], verdict={"max": None})}),
    ]
    frame = results_frame(outputs)
    assert tuple(frame.columns) == RESULT_COLUMNS
    first, second = frame.iloc[0], frame.iloc[1]
    assert (first["request"], first["aborted"], first["flagged"]) == ("r0", True, True)
    assert first["max_score"] == pytest.approx(0.9)
    assert first["mean_score"] == pytest.approx(0.5)
    assert first["last_score"] == pytest.approx(0.9)
    assert (first["n_signals"], first["n_flags"], first["received"]) == (2, 1, 2)
    assert not second["flagged"] and math.isnan(second["max_score"])
    assert second["verdict"] == {"max": None}


def test_signals_frame_places_each_signal_by_its_own_location():
    import dataclasses

    result = make_result("r0", "p", [0.2, 0.9], with_location=False)
    # What the router keeps: each signal says where it was emitted (no join needed);
    # metadata locations are ignored once the signal carries its own.
    located = tuple(
        dataclasses.replace(signal, request_id="r0", extraction_point_name="p", layer=3,
                            token_index=7 + i, generated_index=i,
                            metadata={"layer": 99, "token_index": 99})
        for i, signal in enumerate(result.signals)
    )
    frame = signals_frame([dataclasses.replace(result, signals=located)])
    assert frame["layer"].tolist() == [3, 3]
    assert frame["token_index"].tolist() == [7, 8]
    assert frame["generated_index"].tolist() == [0, 1]
    unlocated = signals_frame([result])  # hand-built, no location anywhere
    assert unlocated["token_index"].isna().all()


def test_empty_records_frame_has_the_dtypes_of_a_full_one(records):
    class Tok:
        def decode(self, ids):
            return f"w{ids[0]}"

    empty = records_frame([]).dtypes
    assert empty.equals(records_frame(records).dtypes)
    assert empty.equals(records_frame(records, tokenizer=Tok()).dtypes)


@pytest.mark.parametrize("scores", [[math.nan, 0.2, 0.9], [0.2, math.nan, 0.9],
                                    [0.2, 0.9, math.nan]])
def test_results_frame_scores_ignore_nan_wherever_it_falls(scores):
    frame = results_frame([make_result("r0", "p", scores)])
    row = frame.iloc[0]
    assert row["max_score"] == pytest.approx(0.9)
    assert row["mean_score"] == pytest.approx(0.55)
    assert row["last_score"] == pytest.approx(0.9)
    assert row["n_signals"] == 3


def test_results_frame_scores_are_nan_when_every_score_is_nan():
    row = results_frame([make_result("r0", "p", [math.nan, None])]).iloc[0]
    assert math.isnan(row["max_score"]) and math.isnan(row["mean_score"])
    assert math.isnan(row["last_score"])


def test_signals_frame_reads_numpy_locations_and_treats_nan_as_missing():
    from undercurrent.records import ProbeResult, ProbeSignal, ProbeStats, SignalAction

    def located_by(metadata):
        signal = ProbeSignal(action=SignalAction.CONTINUE, score=0.5, metadata=metadata)
        return ProbeResult(request_id="r0", extraction_point_name="p", verdict=None,
                           signals=(signal,), stats=ProbeStats())

    frame = signals_frame([
        located_by({"generated_index": np.int64(3), "layer": np.int32(1),
                    "token_index": np.float64(8.0)}),
        located_by({"generated_index": float("nan"), "layer": np.float32("nan")}),
    ])
    assert frame["generated_index"].iloc[0] == 3 and frame["layer"].iloc[0] == 1
    assert frame["token_index"].iloc[0] == 8
    assert frame["generated_index"].isna().iloc[1] and frame["layer"].isna().iloc[1]
