"""Parquet round trip of records: values, dtypes, shapes and metadata come back."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from nb_builders import make_records

from undercurrent.notebook import load_records, records_frame, save_records


def test_round_trip_restores_every_column_and_tensor(tmp_path, records):
    path = save_records(records, tmp_path / "records.parquet")
    loaded = load_records(path)
    original = records_frame(records)
    pd.testing.assert_frame_equal(
        loaded.drop(columns=["tensor"]), original.drop(columns=["tensor"])
    )
    for got, want in zip(loaded["tensor"], original["tensor"], strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_round_trip_keeps_kv_shapes_float16_and_variable_sizes(tmp_path):
    base = make_records(requests=1, layers=(0,), prompt_len=3, generated=0)
    kv = np.arange(12, dtype=np.float16).reshape(2, 2, 3)
    mixed = [replace(base[0], tensor=kv), replace(base[1], tensor=np.ones(5, np.float16))]
    loaded = load_records(save_records(mixed, tmp_path / "mixed.parquet"))
    assert loaded["shape"].tolist() == [(2, 2, 3), (5,)]
    np.testing.assert_array_equal(loaded["tensor"].iloc[0], kv)
    assert loaded["tensor"].iloc[0].dtype == np.float16


def test_round_trip_of_bfloat16_keeps_the_dtype_name(tmp_path):
    torch = pytest.importorskip("torch")
    record = make_records(requests=1, layers=(0,), prompt_len=1, generated=0)[0]
    tensor = torch.tensor([[0.5, 1.25], [3.0, -1.0]], dtype=torch.bfloat16)
    loaded = load_records(save_records([replace(record, tensor=tensor)], tmp_path / "b.parquet"))
    assert loaded["dtype"].iloc[0] == "bfloat16"
    np.testing.assert_array_equal(loaded["tensor"].iloc[0], tensor.float().numpy())


def test_load_as_records_gives_activation_records(tmp_path, records):
    loaded = load_records(save_records(records, tmp_path / "r.parquet"), as_records=True)
    assert [r.key() for r in loaded] == [r.key() for r in records]
    assert loaded[3].generated_index == records[3].generated_index
    np.testing.assert_array_equal(loaded[-1].tensor, records[-1].tensor)


def test_load_refuses_a_foreign_parquet_file_and_a_missing_one(tmp_path):
    foreign = tmp_path / "foreign.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(foreign)
    with pytest.raises(ValueError, match="not an undercurrent records file"):
        load_records(foreign)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_records(tmp_path / "nope.parquet")
