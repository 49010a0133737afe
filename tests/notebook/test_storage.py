"""Parquet round trip of records: values, dtypes, shapes and metadata come back."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from nb_builders import make_records

from undercurrent.notebook import (
    activation_matrix,
    load_records,
    record_tensors,
    records_frame,
    save_records,
)


def test_round_trip_restores_every_column_and_tensor(tmp_path, records):
    records = [replace(r, edits=("steer",) if i % 3 == 0 else ()) for i, r in enumerate(records)]
    path = save_records(records, tmp_path / "records.parquet")
    loaded = load_records(path)
    original = records_frame(records)
    # (each frame's activations_id is its own activations')
    assert loaded["activations_id"].tolist() == [loaded.attrs["activations"].id] * len(loaded)
    pd.testing.assert_frame_equal(loaded.drop(columns="activations_id"),
                                  original.drop(columns="activations_id"))
    for got, record in zip(record_tensors(loaded), records, strict=True):
        assert got.dtype == record.tensor.dtype
        np.testing.assert_array_equal(got, record.tensor)
    for layer in (0, 1):
        np.testing.assert_array_equal(activation_matrix(loaded, layer=layer),
                                      activation_matrix(original, layer=layer))


def test_a_loaded_frame_saves_again(tmp_path, records):
    again = load_records(save_records(load_records(save_records(records, tmp_path / "a.parquet")),
                                      tmp_path / "b.parquet"))
    np.testing.assert_array_equal(activation_matrix(again, layer=1),
                                  np.stack([r.tensor for r in records if r.layer == 1]))


def test_round_trip_keeps_kv_shapes_float16_and_variable_sizes(tmp_path):
    base = make_records(requests=1, layers=(0,), prompt_len=3, generated=0)
    kv = np.arange(12, dtype=np.float16).reshape(2, 2, 3)
    mixed = [replace(base[0], tensor=kv), replace(base[1], tensor=np.ones(5, np.float16))]
    loaded = load_records(save_records(mixed, tmp_path / "mixed.parquet"))
    assert loaded["shape"].tolist() == [(2, 2, 3), (5,)]
    tensors = record_tensors(loaded)
    np.testing.assert_array_equal(tensors[0], kv)
    assert tensors[0].dtype == np.float16
    np.testing.assert_array_equal(tensors[1], np.ones(5, np.float16))


def test_round_trip_of_bfloat16_keeps_the_dtype_name(tmp_path):
    torch = pytest.importorskip("torch")
    record = make_records(requests=1, layers=(0,), prompt_len=1, generated=0)[0]
    tensor = torch.tensor([[0.5, 1.25], [3.0, -1.0]], dtype=torch.bfloat16)
    loaded = load_records(save_records([replace(record, tensor=tensor)], tmp_path / "b.parquet"))
    assert loaded["dtype"].iloc[0] == "bfloat16"
    np.testing.assert_array_equal(record_tensors(loaded)[0], tensor.float().numpy())


def test_load_as_records_gives_activation_records(tmp_path, records):
    loaded = load_records(save_records(records, tmp_path / "r.parquet"), as_records=True)
    assert [r.key() for r in loaded] == [r.key() for r in records]
    assert loaded[3].generated_index == records[3].generated_index
    assert loaded[3].edits == ()
    np.testing.assert_array_equal(loaded[-1].tensor, records[-1].tensor)


def test_as_records_takes_true_or_false_only(tmp_path, records):
    path = save_records(records, tmp_path / "r.parquet")
    with pytest.raises(TypeError, match=r"load_records: as_records must be True or False, "
                                        r"got int \(0\)"):
        load_records(path, as_records=0)


def test_load_refuses_a_foreign_parquet_file_and_a_missing_one(tmp_path):
    foreign = tmp_path / "foreign.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(foreign)
    with pytest.raises(ValueError, match="not an undercurrent records file"):
        load_records(foreign)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_records(tmp_path / "nope.parquet")


def test_records_saved_under_home_load_from_the_path_returned(home, records):
    """save_records(.., "~/r.parquet") wrote $HOME/r.parquet (pyarrow expands "~")
    and returned "~/r.parquet", which load_records refused as no such file."""
    path = save_records(records, "~/r.parquet")
    assert path == home / "r.parquet" and path.is_file()
    assert len(load_records(path)) == len(load_records("~/r.parquet")) == len(records)
    with pytest.raises(ValueError, match="save_records: path is an empty path; give"):
        save_records(records, "")
    with pytest.raises(ValueError, match="load_records: path is an empty path; give"):
        load_records("")


def test_load_refuses_a_directory_naming_it(tmp_path, records):
    """A folder was read as a pyarrow dataset of every file under it, recursively:
    one holding a records file and a note failed on the note (ArrowInvalid)."""
    save_records(records, tmp_path / "r.parquet")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    for folder in (tmp_path, tmp_path / "notes"):
        with pytest.raises(IsADirectoryError,
                           match=f"load_records: {str(folder)!r} is a directory; give the "
                                 "file save_records wrote"):
            load_records(folder)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):
        load_records(fifo)  # (pyarrow would wait for a writer)
