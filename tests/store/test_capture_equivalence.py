"""A store holds exactly what ``generate(records=True)`` returns: same keys, same
float32 values, same outputs and results; float16/bfloat16 storage to their
precision; reductions equal to the same reduction done on the oracle's records."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from store_helpers import corpus_prompts, oracle_vectors, request_ids, store_vectors

from undercurrent import open_activations
from undercurrent.probes.base import Probe
from undercurrent.spec.types import ProbeKind
from undercurrent.store import StoreError

pytest.importorskip("torch")
pytest.importorskip("pyarrow")

SAMPLING = dict(max_new_tokens=8, temperature=0.8, seed=3, batch_size=4)


@pytest.fixture(scope="module")
def prompts():
    return corpus_prompts(10)[0]


@pytest.fixture(scope="module")
def oracle(tiny, prompts):
    return tiny.generate(prompts, request_ids=request_ids(len(prompts)), records=True,
                         **SAMPLING)


@pytest.fixture(scope="module")
def store(tiny, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("store")
    summary = tiny.capture(prompts, out, progress=False, shard_prompts=3, **SAMPLING)
    assert summary.requests == len(prompts) and summary.skipped == 0
    return open_activations(out)


def test_float32_store_has_the_same_keys_and_values_as_generate(store, oracle):
    expected = oracle_vectors(oracle)
    found = store_vectors(store)
    assert len(expected) > 300
    assert found.keys() == expected.keys()
    for key, vector in expected.items():
        assert found[key].dtype == np.float32
        np.testing.assert_array_equal(found[key], vector, err_msg=str(key))
    assert len(store) == len(expected) == len(store.index)
    assert store.index.duplicated(["request_id", "extraction_point_name", "layer",
                                   "token_index"]).sum() == 0


def test_index_rows_describe_their_records(store, oracle):
    records = {record.key(): record for output in oracle for record in output.records}
    for row in store.index.itertuples(index=False):
        record = records[(row.request_id, row.extraction_point_name, row.layer,
                          row.token_index)]
        assert row.tensor_type == record.tensor_type
        assert row.is_generated == record.is_generated
        generated_index = None if pd.isna(row.generated_index) else int(row.generated_index)
        assert generated_index == record.generated_index
        assert int(row.token_id) == record.token_id
        assert row.prompt_index == int(row.request_id[1:])


def test_outputs_and_results_are_stored(store, oracle):
    outputs = store.outputs
    assert outputs["prompt_index"].tolist() == list(range(len(oracle)))
    for row, output in zip(outputs.itertuples(index=False), oracle, strict=True):
        assert row.request_id == output.request_id
        assert row.prompt == output.prompt
        assert row.text == output.text
        assert list(row.token_ids) == list(output.token_ids)
        assert list(row.prompt_token_ids) == list(output.prompt_token_ids)
        assert row.finish_reason == output.finish_reason
        assert bool(row.aborted) is output.aborted
    from undercurrent.notebook import results_frame

    expected = results_frame(oracle)
    found = store.results.sort_values(["prompt_index", "point"], ignore_index=True)
    expected = expected.sort_values(["request", "point"], ignore_index=True)
    assert found["request"].tolist() == expected["request"].tolist()
    assert found["received"].tolist() == expected["received"].tolist()
    assert found["verdict"].tolist() == [
        pytest.approx(v) if isinstance(v, float) else v for v in expected["verdict"]]


def test_store_frames_equal_the_live_frames_of_the_same_outputs(store, oracle):
    # pandas 3 read the store's strings back as its ``str`` dtype (NaN for a missing
    # error), where the live frames hold ``object`` (None): the frames never compared
    # equal. What differs by nature is left out: when each run happened (timestamps,
    # probe latency), and the store's own prompt_index, matrix row numbers and
    # activations id.
    from undercurrent.notebook import records_frame, results_frame

    def records(frame):
        return frame.drop(columns=["timestamp", "row", "activations_id"]).sort_values(
            ["request", "point", "layer", "token_index"], ignore_index=True)

    def results(frame):
        return frame.drop(columns=["mean_latency_s"]).sort_values(
            ["request", "point"], ignore_index=True)

    pd.testing.assert_frame_equal(
        records(store.records_frame(tensors=False).drop(columns=["prompt_index"])),
        records(records_frame(oracle, tensors=False)), check_dtype=True)
    pd.testing.assert_frame_equal(results(store.results.drop(columns=["prompt_index"])),
                                  results(results_frame(oracle)), check_dtype=True)
    assert store.outputs["abort_point"].tolist() == [None] * len(oracle)  # (not NaN)
    strings = ["request_id", "prompt", "text", "finish_reason", "abort_point"]
    assert [str(dtype) for dtype in store.outputs[strings].dtypes] == ["object"] * len(strings)


def test_vectors_memory_maps_a_block_and_gathers_any_subset(store, oracle):
    expected = oracle_vectors(oracle)
    index = store.index
    # One layer of one point is one contiguous block per shard: a memmap view.
    one_shard = index[(index["shard"] == index["shard"].iloc[0])
                      & (index["extraction_point_name"] == "resid") & (index["layer"] == 2)]
    block = store.vectors(one_shard)
    assert isinstance(block, np.memmap)
    assert not block.flags.writeable
    # Any subset, in any order, across shards and layers comes back aligned.
    rows = index[index["extraction_point_name"] == "resid"].sample(frac=0.5, random_state=1)
    gathered = store.vectors(rows)
    for row, vector in zip(rows.itertuples(index=False), gathered, strict=True):
        key = (row.request_id, row.extraction_point_name, row.layer, row.token_index)
        np.testing.assert_array_equal(vector, expected[key])
    # Positions and masks over the index work too.
    mask = (index["extraction_point_name"] == "kv_last_prompt").to_numpy()
    np.testing.assert_array_equal(store.vectors(mask), store.vectors(np.flatnonzero(mask)))
    assert store.vectors(mask).shape[1:] == (2, 2, 64)
    with pytest.raises(ValueError, match="different shapes"):
        store.vectors(index)


def test_records_frame_feeds_the_notebook_helpers(store, oracle):
    from undercurrent.notebook import activation_matrix, records_frame

    frame = store.records_frame(store.select(point="resid", layer=1).index)
    assert "tensor" not in frame.columns
    expected = records_frame(oracle)
    expected = expected[(expected["point"] == "resid") & (expected["layer"] == 1)]
    oracle_rows = activation_matrix(expected)
    merged = frame.merge(expected.assign(at=range(len(expected))),
                         on=["request", "point", "layer", "token_index"],
                         suffixes=("", "_oracle"))
    assert len(merged) == len(expected) == len(frame)
    merged.attrs.update(frame.attrs)  # merge drops the activations riding in attrs
    np.testing.assert_array_equal(activation_matrix(merged),
                                  oracle_rows[merged["at"].to_numpy()])
    joined = frame.merge(store.outputs, left_on="prompt_index", right_on="prompt_index")
    assert (joined["request"] == joined["request_id"]).all()


def test_select_positions(store):
    last = store.select(point="resid", positions="last").index
    assert len(last) == store.index.query("extraction_point_name == 'resid'").groupby(
        ["request_id", "layer"]).ngroups
    assert store.select(positions="prompt").index["is_generated"].sum() == 0
    assert store.select(positions="generated").index["is_generated"].all()
    with pytest.raises(ValueError, match="positions="):
        store.select(positions="middle")


def test_a_view_reports_its_own_rows(store):
    # The oracle: the view's own vectors and index, read back.
    assert store.nbytes == sum(store.vectors(store.select(point=name).index).nbytes
                               for name in store.points)
    view = store.select(point="resid", layer=1, positions="generated")
    assert view.points == ["resid"] and view.layers == [1]
    assert view.nbytes == view.vectors().nbytes < store.nbytes
    assert view.n_prompts == view.index["prompt_index"].nunique()
    assert repr(view).startswith("ActivationStore view(")
    empty = store.select(point="mlp", positions="generated")  # (it reads a prompt token)
    assert (len(empty), empty.points, empty.nbytes, empty.n_prompts) == (0, [], 0, 0)


def test_select_builds_only_the_rows_it_asks_for(store, monkeypatch):
    # A point and layer are filtered shard by shard before the rows reach pandas:
    # the whole index is never built, and the view equals that filter of it.
    from undercurrent.store import reader

    built: list[int] = []
    read_index = reader.read_index

    def counted(paths, keep=None):
        frame = read_index(paths, keep)
        built.append(len(frame))
        return frame

    monkeypatch.setattr(reader, "read_index", counted)
    fresh = open_activations(store.path)
    view = fresh.select(point="resid", layer=1)
    last = fresh.select(point="resid", layer=[1, 3], tensor_type="residual_stream",
                        positions="last")
    assert fresh.held_points == ["resid", "kv_last_prompt", "mlp"]  # (one column read)
    assert built == [len(view), 2 * len(view)] and len(view) < len(store) / 4
    index = store.index
    resid = index["extraction_point_name"] == "resid"
    # (the same rows, labels and values)
    pd.testing.assert_frame_equal(view.index, index[resid & (index["layer"] == 1)])
    pd.testing.assert_frame_equal(
        last.index, store.select(point="resid", layer=[1, 3], positions="last").index)


def test_the_index_holds_no_object_per_row_and_reads_an_older_store(store, tmp_path):
    # (a store written before the edits column: every row without edits)
    import shutil

    import pyarrow.parquet as pq

    index = store.index
    for column in ("request_id", "extraction_point_name", "tensor_type", "shard"):
        # (Arrow-backed: no object per row; pandas 2's "str" is object)
        assert index[column].dtype != object and index[column].dtype == "string", column
    assert len({id(names) for names in index["edits"]}) == 1  # (one () shared)
    assert set(index["edits"]) == {()} and index["request_id"].iloc[0] == "p000000"
    # they behave as strings (as categoricals they sorted in spec order, and max,
    # comparisons and concatenation raised)
    assert index["request_id"].max() == index["request_id"].astype(object).max()
    assert (index["extraction_point_name"] + "@").iloc[0] == "resid@"
    assert index.sort_values("extraction_point_name", kind="stable")[
        "extraction_point_name"].unique().tolist() == ["kv_last_prompt", "mlp", "resid"]
    assert int(index["edits"].map(len).sum()) == 0
    older = tmp_path / "older"
    shutil.copytree(store.path, older)
    first = next(iter(sorted((older / "shards").glob("part*")))) / "index.parquet"
    pq.write_table(pq.read_table(first).drop_columns(["edits"]), first)
    reopened = open_activations(older)
    pd.testing.assert_frame_equal(reopened.index, index)
    pd.testing.assert_frame_equal(
        reopened.records_frame(tensors=False).drop(columns="activations_id"),
        store.records_frame(tensors=False).drop(columns="activations_id"))


def test_a_store_with_no_shard_yet_has_every_column_with_its_dtype(tiny, prompts, store,
                                                                    tmp_path):
    # (a capture in progress, or a part with no prompts: here part 0 of 2 of one prompt)
    from undercurrent.store import sweep_linear_probes

    summary = tiny.capture(prompts[:1], tmp_path, shard="0/2", progress=False, **SAMPLING)
    assert summary.requests == 0
    empty = open_activations(tmp_path)
    for frame, full in ((empty.index, store.index), (empty.outputs, store.outputs),
                        (empty.results, store.results)):
        assert len(frame) == 0
        assert frame.dtypes.astype(str).to_dict() == full.dtypes.astype(str).to_dict()
    for positions in ("all", "prompt", "generated", "last", "last_prompt"):
        assert len(empty.select(positions=positions)) == 0
    with pytest.raises(ValueError, match="no rows for point='resid', positions='last_prompt'"):
        sweep_linear_probes(empty, [1], point="resid", positions="last_prompt")


@pytest.mark.parametrize("storage_dtype", ["float16", "bfloat16"])
def test_half_precision_storage_matches_to_its_precision(tiny, prompts, oracle, tmp_path,
                                                         storage_dtype):
    import torch

    summary = tiny.capture(prompts, tmp_path, progress=False, storage_dtype=storage_dtype,
                           **SAMPLING)
    store = open_activations(tmp_path)
    expected = oracle_vectors(oracle)
    found = store_vectors(store)
    assert found.keys() == expected.keys()
    for key, vector in expected.items():
        # The oracle: torch's own rounding of the float32 value.
        rounded = torch.from_numpy(vector).to(getattr(torch, storage_dtype)).float().numpy()
        np.testing.assert_array_equal(np.asarray(found[key], dtype=np.float32), rounded)
    assert summary.bytes * 2 == sum(v.nbytes for v in expected.values())
    assert store.nbytes == summary.bytes
    # (the frame's dtype is the captured tensors', as in the live frame; the
    # vectors come back widened from the storage dtype)
    from undercurrent.notebook import records_frame

    assert set(store.records_frame(tensors=False)["dtype"]) == set(
        records_frame(oracle)["dtype"]) == {"float32"}


def test_reductions_equal_the_reduced_oracle(tiny, prompts, oracle, tmp_path):
    reduce = {"resid": "mean_generated", "kv_last_prompt": "project:16",
              "mlp": "last_token"}
    tiny.capture(prompts, tmp_path, progress=False, reduce=reduce, **SAMPLING)
    store = open_activations(tmp_path)
    index = store.index
    for output in oracle:
        by_layer: dict[tuple[str, int], list] = {}
        for record in output.records:
            by_layer.setdefault((record.extraction_point_name, record.layer), []).append(record)
        for (point, layer), records in by_layer.items():
            rows = index[(index["request_id"] == output.request_id)
                         & (index["extraction_point_name"] == point) & (index["layer"] == layer)]
            stored = store.vectors(rows)
            if point == "resid":
                generated = [r for r in records if r.is_generated]
                mean = np.mean([r.tensor.float().numpy() for r in generated], axis=0)
                assert len(rows) == 1
                assert int(rows["token_index"].iloc[0]) == max(r.token_index for r in generated)
                np.testing.assert_allclose(stored[0], mean, rtol=1e-5, atol=1e-6)
            elif point == "kv_last_prompt":
                rng = np.random.default_rng(0)
                matrix = rng.standard_normal((2 * 2 * 64, 16)) / np.sqrt(16)
                flat = np.stack([r.tensor.float().numpy().reshape(-1) for r in records])
                np.testing.assert_allclose(stored, flat @ matrix, rtol=1e-4, atol=1e-4)
                assert stored.shape == (len(records), 16)
            else:
                last = max(records, key=lambda r: r.token_index)
                assert rows["token_index"].tolist() == [last.token_index]
                np.testing.assert_array_equal(stored[0], last.tensor.float().numpy())
    assert store.reductions["resid"].tokens == "mean_generated"
    # the store rebuilds the projection from the captured shape it records
    np.testing.assert_array_equal(store.projection("kv_last_prompt"),
                                  (matrix).astype(np.float32))
    assert store.projection("resid") is None and store.projection("mlp") is None


def test_a_float64_model_reduces_in_float64(prompts, tmp_path):
    # A float64 model's vectors are stored as float64: their mean and projection
    # are the float64 ones of its live records (float32 sums were off by ~1e-6).
    from store_helpers import SPEC

    from undercurrent import ProbedModel

    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=SPEC, dtype="float64")
    try:
        chosen = prompts[:3]
        live = model.generate(chosen, request_ids=request_ids(3), records=True,
                              max_new_tokens=6)
        model.capture(chosen, tmp_path, progress=False, max_new_tokens=6,
                      reduce={"resid": "mean_generated", "kv_last_prompt": "project:16"})
    finally:
        model.close()
    store = open_activations(tmp_path)
    index = store.index
    for output in live:
        for point, layer in (("resid", 2), ("kv_last_prompt", 3)):
            records = [r for r in output.records
                       if (r.extraction_point_name, r.layer) == (point, layer)]
            assert records and all(str(r.tensor.dtype) == "torch.float64" for r in records)
            rows = index[(index["request_id"] == output.request_id)
                         & (index["extraction_point_name"] == point) & (index["layer"] == layer)]
            stored = store.vectors(rows)
            assert stored.dtype == np.float64
            tensors = np.stack([r.tensor.numpy() for r in records])
            if point == "resid":
                expected = tensors.mean(axis=0)[None]
            else:
                flat = tensors.reshape(len(records), -1)
                expected = flat @ store.reductions[point].projection(flat.shape[1]).astype(
                    np.float64)
            np.testing.assert_allclose(stored, expected, rtol=1e-12, atol=1e-12)


def test_repr_and_len(store):
    text = repr(store)
    assert "prompts=10/10" in text and f"vectors={len(store)}" in text
    assert "'resid'" in text


def test_a_steered_store_says_which_edits_each_vector_had(tiny, prompts, tmp_path):
    # Each row keeps its record's edits (the names applied at its very site), so
    # the store's records_frame says what the live one says.
    import yaml
    from store_helpers import SPEC

    from undercurrent import ProbedModel
    from undercurrent.notebook import records_frame

    spec = {"version": "2", "extraction_points": yaml.safe_load(SPEC)["extraction_points"],
            "edits": [{"name": "push", "layers": 1, "tensor_type": "residual_stream",
                       "position": "generated[1:]", "op": "add", "coefficient": -30.0,
                       "vector": "undercurrent:models/tiny/probe.safetensors"}]}
    steered = ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=spec)
    live = steered.generate(prompts[:3], request_ids=request_ids(3), records=True,
                            max_new_tokens=5)
    steered.capture(prompts[:3], tmp_path, progress=False, max_new_tokens=5)
    keys = ["request", "point", "layer", "token_index"]
    stored = open_activations(tmp_path).records_frame(tensors=False)
    both = stored.merge(records_frame(live), on=keys, suffixes=("", "_live"))
    assert len(both) == len(stored) == sum(len(output.records) for output in live)
    assert list(both["edits"]) == list(both["edits_live"])
    assert {names for names in both["edits"]} == {(), ("push",)}


def test_labels_one_per_prompt_or_one_per_row_are_never_mistaken(tiny, prompts, tmp_path):
    # Half the prompts stored (part 1 of 2), two rows each of one point: as many
    # rows as prompts. A list of that length could be either; it is refused, and
    # a mapping or a Series indexed like the rows says which.
    spec = {"version": "1", "extraction_points": [{
        "name": "res", "layers": [3], "tensor_type": "residual_stream",
        "position": "generated[0:2]", "probe_type": "norm_probe",
        "probe_kind": "single_shot"}]}
    from undercurrent import ProbedModel

    model = ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=spec)
    chosen = prompts[:8]
    model.capture(chosen, tmp_path, progress=False, max_new_tokens=3, shard="1/2")
    store = open_activations(tmp_path)
    index = store.index
    assert len(index) == len(chosen) and list(index["prompt_index"]) == [4, 4, 5, 5, 6, 6, 7, 7]
    labels = ["a", "b", "a", "b", "a", "a", "b", "b"]
    with pytest.raises(ValueError, match=r"8 labels for 8 prompts and 8 rows, whose rows are "
                                         r"not one per prompt in order: .*dict\(enumerate"):
        store.row_labels(labels, index)
    assert list(store.row_labels(dict(enumerate(labels)), index)) == [
        "a", "a", "a", "a", "b", "b", "b", "b"]
    assert list(store.row_labels(pd.Series(labels, index=index.index), index)) == labels
    # (a Series is read by the rows' labels, as pandas aligns: in any order)
    shuffled = pd.Series(labels, index=index.index).iloc[[3, 0, 7, 1, 6, 2, 5, 4]]
    assert list(store.row_labels(shuffled, index)) == labels
    assert list(store.row_labels(shuffled, index.iloc[::-1])) == labels[::-1]
    # Any other Series is read by its index: prompt indices or request ids (a
    # shuffled per-prompt Series was read by position: wrong labels, a sweep at chance).
    rows = index.iloc[2:]  # (prompts 5, 5, 6, 6, 7, 7: not as many rows as labels)
    per_prompt = pd.Series(labels, index=range(8)).iloc[[5, 2, 7, 0, 3, 6, 1, 4]]
    expected = ["a", "a", "b", "b", "b", "b"]
    assert list(store.row_labels(per_prompt.loc[[7, 5, 6]], rows)) == expected
    # One whose index holds both these rows' labels (2..7) and their prompts could be
    # per row (built over more rows than selected) or per prompt: the readings
    # differ, so it is refused, naming both ways to say which.
    with pytest.raises(ValueError, match=r"labels Series' index \(\[5, 2, 7\] ...; 8 "
                                         r"values\) holds both the labels of the 6 selected "
                                         r"rows and their prompt indices .*series\.to_dict"):
        store.row_labels(per_prompt, rows)
    assert list(store.row_labels(per_prompt.to_dict(), rows)) == expected
    # A Series with the default index, one per prompt, is read by position, as a list:
    # these rows' labels (2..7) lying within its index (0..7) made it refused as both.
    assert list(store.row_labels(pd.Series(labels), rows)) == expected
    assert list(store.row_labels(pd.Series(labels), index)) == labels  # (the rows' own)
    # Labels of a dataset of more prompts than were captured (0..99) hold these rows'
    # labels and their prompts too: they were read per row, silently, as the rows'.
    dataset = labels + ["b"] * 92
    for counted in (pd.Series(dataset), pd.Series(dataset, index=np.arange(100))):
        counted.index.name = "prompt_index"
        with pytest.raises(ValueError, match=r"labels Series' index \(\[0, 1, 2\] ...; 100 "
                                             r"values\) holds both the labels of the 6 "
                                             r"selected rows and their prompt indices"):
            store.row_labels(counted, rows)
    assert list(store.row_labels(pd.Series(dataset).to_dict(), rows)) == expected
    by_request = pd.Series(labels, index=[f"p{k:06d}" for k in range(8)]).iloc[::-1]
    assert list(store.row_labels(by_request, rows)) == expected
    with pytest.raises(ValueError, match=r"labels Series' index \(\['x', 'y', 'z'\] ...; 8 "
                                         r"values\) is neither .* \(no label for request_id "
                                         r"value\(s\) \['p000005', 'p000006'"):
        store.row_labels(pd.Series(labels, index=list("xyzwvuts")), rows)
    with pytest.raises(ValueError, match=r"no label for prompt_index value\(s\) \[7\]"):
        store.row_labels(per_prompt.drop(7), rows)
    with pytest.raises(ValueError, match="repeats index value"):
        store.row_labels(pd.Series(labels, index=[4, 4, 5, 5, 6, 6, 7, 7]), rows)


def test_stored_verdicts_keep_their_integer_keys(tiny, tmp_path):
    # The trajectory probe's final_by_layer is keyed by layer: JSON made {3: 0.41}
    # {'3': 0.41}, and code written against the live results frame broke on the store's.
    from undercurrent import ProbedModel
    from undercurrent.notebook import results_frame
    from undercurrent.store.capture import request_id_for

    spec = "undercurrent:models/demo.yaml"  # (the demo's spec, shipped in the package)
    model = ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=str(spec))
    prompts = ["user : how do i bake bread ? assistant :"]
    model.capture(prompts, tmp_path, max_new_tokens=6, progress=False)
    live = model.generate(prompts, request_ids=[request_id_for(0)], records=True,
                          max_new_tokens=6)
    expected = results_frame(live).set_index("point")["verdict"]
    found = open_activations(tmp_path).results.set_index("point")["verdict"]
    final = found["harm_trajectory"]["final_by_layer"]
    assert final and all(type(layer) is int for layer in final)
    assert final == pytest.approx(expected["harm_trajectory"]["final_by_layer"])
    # A shard written before the tag (no verdict_keys in its meta, every key a JSON
    # string) reads alike: a store resumed by this version would mix both forms.
    import json

    import pandas as pd

    from undercurrent.store.format import verdict_from_json

    [shard] = (tmp_path / "shards").glob("part*")
    meta = json.loads((shard / "meta.json").read_text())
    del meta["verdict_keys"]
    (shard / "meta.json").write_text(json.dumps(meta))
    results = pd.read_parquet(shard / "results.parquet")
    results["verdict"] = [json.dumps(verdict_from_json(v)) for v in results["verdict"]]
    assert '"final_by_layer": {"' in "".join(results["verdict"])
    results.to_parquet(shard / "results.parquet")
    untagged = open_activations(tmp_path).results.set_index("point")["verdict"]
    assert untagged["harm_trajectory"]["final_by_layer"] == final
    # (a shard whose verdicts a later version stored in a way this one does not know)
    meta["verdict_keys"] = "later"
    (shard / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=rf"^shard {shard.name!r}: verdicts stored with "
                                         "verdict_keys='later' are not known"):
        open_activations(tmp_path).results  # noqa: B018 - reading it raises


class _MixedKeysProbe(Probe):
    """Says, per request, each layer's last norm keyed by layer, the same dict with
    a string key among the layers (as a probe summarising its layers would), and a
    dict of its own that looks like a stored tag."""

    probe_kind = ProbeKind.TRAJECTORY

    def __init__(self, **_: object) -> None:
        self.norms: dict[int, float] = {}

    def on_start(self, context: object) -> None:
        self.norms = {}

    def on_activation(self, record):
        self.norms[record.layer] = float(record.tensor.float().norm())

    def on_end(self, context: object) -> dict:
        return {"by_layer": dict(self.norms),
                "mixed": {**self.norms, "mean": sum(self.norms.values()) / len(self.norms)},
                "__int_keys__": {"1": "a verdict's own key, not a tag"}}


@pytest.mark.parametrize("verdict", [
    {3: 0.41, -1: 2},
    {1: "a", "x": "b"},
    {"__int_keys__": {"1": 2}},
    {"__items__": [[1, 2]]},
    {"__int_keys__": {"1": 2}, "other": 3},
    {True: 1, None: 2, 0.5: 3, "s": {2: {"t": [4, {5: 6, "u": 7}]}}},
    [{1: {2: 3}}, {"a": {1: 2, "b": {"__int_keys__": {}}}}],
    {},
], ids=["all-int", "mixed", "int-keys-tag-lookalike", "items-tag-lookalike",
        "tag-name-among-keys", "nested-other-keys", "nested-list", "empty"])
def test_every_json_verdict_reads_back_equal(verdict):
    # JSON keys are strings: a dict with a non-string key (mixed with strings too)
    # must come back with its keys, and a verdict's own dict that looks like a tag
    # must come back as itself, not as what the tag would mean.
    from undercurrent.store.format import verdict_from_json, verdict_to_json

    assert verdict_from_json(verdict_to_json(verdict)) == verdict
    assert verdict_from_json(verdict_to_json(
        {np.int64(2): np.float32(0.5), "k": np.array([1, 2])})) == {2: 0.5, "k": [1, 2]}
    with pytest.raises(TypeError, match=r"key \(1, 2\) \(tuple\) cannot be stored"):
        verdict_to_json({(1, 2): 3})


def test_a_stored_verdict_with_mixed_keys_reads_back_as_the_live_one(tiny, tmp_path):
    from undercurrent import ProbedModel
    from undercurrent.store.capture import request_id_for

    points = [{"name": "norms", "layers": [0, 2], "tensor_type": "residual_stream",
               "position": "generated[*]", "probe_type": "mixed_keys",
               "probe_kind": "trajectory"}]
    model = ProbedModel(tiny.backend.model, tiny.backend.tokenizer,
                        spec={"version": "1", "extraction_points": points},
                        probes={"mixed_keys": _MixedKeysProbe})
    prompts = ["user : how do i bake bread ? assistant :"]
    live = model.generate(prompts, request_ids=[request_id_for(0)], max_new_tokens=4)
    model.capture(prompts, tmp_path, max_new_tokens=4, progress=False)
    expected = live[0].results["norms"].verdict
    assert set(expected["mixed"]) == {0, 2, "mean"}
    [found] = open_activations(tmp_path).results["verdict"]
    assert found == expected


def test_shards_of_earlier_versions_read_their_verdicts_as_they_did():
    # "tagged" shards knew only the integer-key tag (mixed keys had become strings);
    # shards before any tag had only strings (digit keys read back as integers).
    from undercurrent.store.format import verdict_from_json

    stored = '{"a": {"__int_keys__": {"3": 1}}, "m": {"1": 2, "b": 3}, "d": {"4": 5}}'
    assert verdict_from_json(stored, written_as="tagged") == {
        "a": {3: 1}, "m": {"1": 2, "b": 3}, "d": {"4": 5}}
    assert verdict_from_json(stored, written_as=None) == {
        "a": {"__int_keys__": {3: 1}}, "m": {"1": 2, "b": 3}, "d": {4: 5}}
    with pytest.raises(StoreError, match="verdict_keys='later' are not known"):
        verdict_from_json(stored, written_as="later")
