"""Probes over a store: ``fit_linear_probe(store, ...)`` equals the fit on the
same activations taken from ``generate(records=True)``; ``sweep_linear_probes``
gives one row per layer with held-out metrics split by request; the figure."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd
import pytest
from store_helpers import corpus_prompts, request_ids

from undercurrent import open_activations
from undercurrent.store import SWEEP_COLUMNS, sweep_figure, sweep_linear_probes

pytest.importorskip("torch")
pytest.importorskip("sklearn")

OPTIONS = dict(max_new_tokens=6, batch_size=8)


@pytest.fixture(scope="module")
def labelled(tiny, tmp_path_factory):
    prompts, labels = corpus_prompts(40, seed=3)
    out = tmp_path_factory.mktemp("sweep")
    tiny.capture(prompts, out, progress=False, **OPTIONS)
    return open_activations(out), prompts, labels


def test_fit_on_a_store_equals_the_fit_on_records(tiny, labelled):
    from undercurrent.notebook import fit_linear_probe, records_frame

    store, prompts, labels = labelled
    outputs = tiny.generate(prompts, request_ids=request_ids(len(prompts)), records=True,
                            **OPTIONS)
    frame = records_frame(outputs)
    by_request = {rid: label for rid, label in zip(request_ids(len(prompts)), labels,
                                                   strict=True)}
    # The frame's rows follow the store's order (layer, prompt, token) for one point.
    frame = frame[frame["point"] == "resid"].sort_values(["layer", "request", "token_index"])
    oracle = fit_linear_probe(frame, by_request, layer=2, seed=0)
    import pandas as pd

    # per request, per prompt; a Series by prompt index in any order is a mapping
    shuffled = pd.Series(labels).sample(frac=1, random_state=0)
    for y in (by_request, labels, dict(enumerate(labels)), shuffled):
        fit = fit_linear_probe(store, y, point="resid", layer=2, seed=0)
        assert fit.metrics == oracle.metrics
        np.testing.assert_allclose(fit.weight, oracle.weight, rtol=1e-4, atol=1e-6)
        assert (fit.layer, fit.tensor_type) == (2, "residual_stream")
    assert oracle.metrics["split"] == "request"
    with pytest.raises(ValueError, match="mixes layers"):
        fit_linear_probe(store, labels, point="resid")


@pytest.mark.parametrize("positions", ["last", "all"])
def test_a_fit_on_a_view_holds_out_the_rows_a_fit_on_its_records_frame_does(labelled,
                                                                             positions):
    """One split rule for both routes: with one row per request (``last``) both
    split rows, with several (``all``) both split by request; same seed, same
    held-out rows, same weights (the sweep's too)."""
    from undercurrent.notebook import fit_linear_probe

    store, prompts, labels = labelled
    by_request = dict(zip(request_ids(len(prompts)), labels, strict=True))
    view = store.select(point="resid", layer=2, positions=positions)
    on_view = fit_linear_probe(view, labels, layer=2, seed=1)
    on_frame = fit_linear_probe(view.records_frame(), by_request, layer=2, seed=1)
    assert on_view.metrics == on_frame.metrics
    assert on_view.metrics["split"] == ("row" if positions == "last" else "request")
    np.testing.assert_allclose(on_view.weight, on_frame.weight, rtol=1e-5, atol=1e-7)
    swept = sweep_linear_probes(store, labels, point="resid", layers=[2],
                                positions=positions, seed=1).iloc[0]
    assert (swept["accuracy"], swept["n_test"]) == (on_frame.metrics["test_accuracy"],
                                                    on_frame.metrics["n_test"])


def test_sweep_has_one_row_per_layer_with_held_out_metrics(labelled):
    store, _, labels = labelled
    frame = sweep_linear_probes(store, labels, point="resid", positions="generated", seed=0)
    assert list(frame.columns) == list(SWEEP_COLUMNS)
    assert frame["layer"].tolist() == [0, 1, 2, 3]
    resid = store.index[store.index["extraction_point_name"] == "resid"]
    for row in frame.itertuples(index=False):
        layer_rows = resid[resid["layer"] == row.layer]
        assert row.n == len(layer_rows) == row.n_train + row.n_test
        assert row.n_requests == 40
        assert 0 <= row.accuracy <= 1 and 0 <= row.auc <= 1
    # The bundled model carries the intent: some layer beats chance clearly.
    assert frame["auc"].max() > 0.8
    last = sweep_linear_probes(store, labels, point="resid", layers=[3], positions="last")
    assert last["n"].tolist() == [40]
    with pytest.raises(ValueError, match="pick one"):
        sweep_linear_probes(store, labels)
    # a layer the point lacks was refused as "no rows for point=None"
    with pytest.raises(ValueError, match=r"^sweep_linear_probes: no rows of point 'resid' at "
                                         r"layer 9 \(positions='all'\); it has layers "
                                         r"\[0, 1, 2, 3\]"):
        sweep_linear_probes(store, labels, point="resid", layers=[1, 9])


def test_per_row_labels_of_more_rows_than_a_fit_selects_are_read_by_row(labelled):
    """A Series of labels for every row of a point (built from its view's index),
    fit one layer at a time, is read per row by label, as pandas aligns (and as a
    records frame reads it). It was read as {prompt_index: label}, silently: most
    rows got another row's label. The oracle: scikit-learn on the layer's vectors
    with ``y.reindex(rows)``."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from undercurrent.notebook import fit_linear_probe

    store, _, labels = labelled
    view = store.select(point="resid")
    rows = view.index
    # a per-token label: the request's, flipped on odd tokens
    y = rows["prompt_index"].map(dict(enumerate(labels))) ^ (rows["token_index"] % 2)
    # (the same labels over every row of the store, other points included)
    everywhere = y.reindex(store.index.index, fill_value=0)
    swept = sweep_linear_probes(store, y, point="resid", layers=[1, 2], test_size=0)
    for layer in (1, 2):
        selected = view.select(layer=layer).index
        expected = y.reindex(selected.index).to_numpy()
        assert len(y) != len(selected) and not (
            expected == y.reindex(selected["prompt_index"]).to_numpy()).all()
        for given in (y, everywhere):
            assert (view.row_labels(given, selected) == expected).all()
            assert (store.row_labels(given, selected) == expected).all()
        X = np.asarray(store.vectors(selected), dtype=np.float64).reshape(len(selected), -1)
        scaler = StandardScaler().fit(X)
        oracle = LogisticRegression(max_iter=2000).fit(scaler.transform(X), expected)
        oracle_accuracy = float((oracle.predict(scaler.transform(X)) == expected).mean())
        for fit in (fit_linear_probe(view, y, layer=layer, test_size=0),
                    fit_linear_probe(store, everywhere, point="resid", layer=layer,
                                     test_size=0)):
            np.testing.assert_allclose(fit.weight, oracle.coef_[0] / scaler.scale_,
                                       rtol=1e-4, atol=1e-6)
            assert fit.metrics["n_train"] == len(selected)
        row = swept[swept["layer"] == layer].iloc[0]
        assert (row["n_train"], row["train_accuracy"]) == (len(selected), oracle_accuracy)


@pytest.mark.parametrize("narrowing, problem", [
    (dict(point="resid_typo"), "this store has no point 'resid_typo'; it holds 'resid', "
                               "'kv_last_prompt', 'mlp'"),
    (dict(point="mlp", layer=[2, 3]), "no layer 3 in the store of point 'mlp': it holds "
                                      "layers [2]"),
    (dict(layer=7), "no layer 7 in the store: it holds layers [0, 1, 2, 3]"),
    (dict(point="resid", tensor_type="kv"), "no 'kv' rows of point 'resid': the store "
                                            "holds 'residual_stream'"),
    (dict(point="mlp", layer=[]), "layer=[] names no layer, which would select nothing; "
                                  "give a layer or a list of them (the store of point 'mlp' "
                                  "holds layers [2]), or leave layer out for all"),
])
def test_select_refuses_a_point_layer_or_tensor_type_the_store_has_none_of(labelled,
                                                                          narrowing, problem):
    # a typo selected nothing: an empty view, without a word
    store, _, _ = labelled
    with pytest.raises(ValueError, match="^select: " + re.escape(problem)):
        store.select(**narrowing)
    assert len(store.select(point="mlp", layer=2, tensor_type="mlp_out")) > 0


def test_row_selections_are_checked_against_the_index(labelled):
    # pandas answered "positional indexers are out-of-bounds" or "Item wrong length",
    # vectors(5) failed on a missing 'shard' column and a position 1.5 read row 1
    store, _, _ = labelled
    view = store.select(point="mlp")
    count = len(view.index)
    calls = {"select(rows=)": lambda rows: view.select(rows=rows),
             "vectors()": view.vectors,
             "records_frame()": lambda rows: view.records_frame(rows, tensors=False)}
    for caller, call in calls.items():
        for rows, error, problem in [
                ([count], ValueError, f"row position {count} is out of range; the store "
                                      f"view has {count} rows (positions 0 to {count - 1})"),
                ([0, -count - 1], ValueError, f"row position {-count - 1} is out of range"),
                ([True], ValueError, f"a boolean mask of 1 values for {count} rows"),
                ([1.5], TypeError, "rows holds float64 values ([1.5]); row positions are "
                                   "integers"),
                (["a"], TypeError, "rows holds <U1 values"),
                ("abc", TypeError, "rows is str ('abc'); pass rows of store.index"),
                (5, TypeError, "rows is int (5); pass rows of store.index (a frame), a "
                               "boolean mask over it or a list of row positions; for one "
                               "row pass [5]"),
                ([[0, 1]], TypeError, "rows is list ([[0, 1]])")]:
            with pytest.raises(error, match="^" + re.escape(f"{caller}: {problem}")):
                call(rows)
    expected = view.index.iloc[[1, -1]]
    mask = np.zeros(count, dtype=bool)
    mask[[1, -1]] = True
    for rows in ([1, -1], np.array([1, count - 1], dtype=np.int16), pd.Series(mask)):
        assert view.select(rows=rows).index.equals(expected), rows
        np.testing.assert_array_equal(view.vectors(rows), view.vectors(expected))
    assert view.select(rows=[]).index.empty


def test_projection_refuses_a_point_the_store_has_none_of(labelled):
    # None read as "not projected" for a typo
    store, _, _ = labelled
    assert store.projection("mlp") is None and store.projected("mlp") is None
    for method in (store.projection, store.projected):
        with pytest.raises(ValueError, match=f"^{method.__name__}: this store has no point "
                                             "'mlp_typo'; it holds 'resid', "):
            method("mlp_typo")


def test_sweep_figure_draws_accuracy_auc_and_chance(labelled):
    store, _, labels = labelled
    frame = sweep_linear_probes(store, labels, point="resid", layers=[1, 3])
    figure = sweep_figure(frame)
    assert [trace.name for trace in figure.data] == ["held-out accuracy", "held-out AUC",
                                                     "chance"]
    assert list(figure.data[1].y) == frame["auc"].tolist()
    with pytest.raises(ValueError, match="empty"):
        sweep_figure(frame.iloc[:0])


def test_layers_may_be_numpy_integers_but_not_bools(labelled):
    from undercurrent.notebook import fit_linear_probe

    store, _, labels = labelled
    layer_one = store.select(layer=1).index
    assert len(layer_one) and set(layer_one["layer"]) == {1}
    assert store.select(layer=np.int64(1)).index.equals(layer_one)
    both = store.select(layer=[np.int32(1), 3]).index
    assert both.equals(store.select(layer=np.array([1, 3])).index)
    assert set(both["layer"]) == {1, 3}
    fit = fit_linear_probe(store, labels, point="resid", layer=np.int64(2), seed=0)
    assert fit.layer == 2 and fit.metrics == fit_linear_probe(
        store, labels, point="resid", layer=2, seed=0).metrics
    frame = sweep_linear_probes(store, labels, point="resid", layers=np.array([1, 3]))
    assert frame["layer"].tolist() == [1, 3]
    for call in (lambda: store.select(layer=True), lambda: store.select(layer=[1, False]),
                 lambda: store.select(layer="1"),
                 lambda: sweep_linear_probes(store, labels, point="resid", layers=[True])):
        with pytest.raises(TypeError, match="not a bool"):
            call()


def test_missing_labels_of_a_store_are_refused_naming_the_requests_or_prompts(labelled):
    # A NaN among string labels would become the label "nan" once numpy holds them:
    # each form of labels is checked as given.
    store, prompts, labels = labelled
    named = ["harmful" if label else "benign" for label in labels]
    ids = request_ids(len(prompts))
    by_request = dict(zip(ids, named, strict=True))
    by_request[ids[3]] = float("nan")
    with pytest.raises(ValueError, match=rf"request_id value\(s\) \['{ids[3]}'\]"):
        fit_linear_probe_on(store, by_request)
    per_prompt = list(named)
    per_prompt[5] = None
    with pytest.raises(ValueError, match=r"no label \(None or NaN\) for prompt_index value\(s\) "
                                         r"\['5'\]"):
        fit_linear_probe_on(store, per_prompt)
    assert fit_linear_probe_on(store, named).metrics["n_train"] > 0


def fit_linear_probe_on(store, labels):
    from undercurrent.notebook import fit_linear_probe

    return fit_linear_probe(store, labels, point="resid", layer=2, seed=0)


def test_a_steering_vector_fits_on_a_store_or_view_as_on_its_records_frame(labelled):
    # fit_steering_vector took the store for an array ("float() argument must be ...
    # not 'ActivationStore'")
    from undercurrent.steering import fit_steering_vector

    store, _, labels = labelled
    view = store.select(point="resid", layer=2)
    frame = store.records_frame(view.index)
    oracle = fit_steering_vector(frame, dict(zip(frame["request"], (
        labels[p] for p in frame["prompt_index"]), strict=True)))
    for fitted in (fit_steering_vector(store, labels, point="resid", layer=2),
                   fit_steering_vector(view, labels)):
        np.testing.assert_allclose(fitted.vector, oracle.vector, rtol=1e-6, atol=1e-7)
        assert (fitted.layer, fitted.tensor_type, fitted.counts) == (
            2, "residual_stream", oracle.counts)
    with pytest.raises(ValueError, match=r"^fit_steering_vector: the store mixes layers"):
        fit_steering_vector(store, labels, point="resid")


def test_a_probe_fitted_on_projected_vectors_scores_live_activations_as_the_fit_did(
        tiny, tmp_path):
    # The saved probe held weights over the random features: run live on the
    # captured activations it gave unrelated scores (no error when K was the hidden
    # size, as here). The projection is folded into the saved weight.
    import dataclasses

    from undercurrent.notebook import fit_linear_probe
    from undercurrent.probes.weights import load_linear_weights
    from undercurrent.steering import fit_steering_vector

    prompts, labels, store = _projected_store(tiny, tmp_path)
    fit = fit_linear_probe(store, labels, point="resid", layer=2,
                           save_to=tmp_path / "probe.safetensors")
    view = store.select(point="resid", layer=2)
    fitted = fit.predict_proba(view.vectors())[:, 1]
    np.testing.assert_allclose(_live_scores(tmp_path / "probe.safetensors", prompts, view),
                               fitted, rtol=0, atol=1e-5)
    assert fit.weight.shape == (128,) and fit.projected == "project:128"
    saved = load_linear_weights(tmp_path / "probe.safetensors")
    assert saved.hidden == 128 and saved.metadata["folded_reduction"] == "project:128"
    # inline weights fold it in too; a projection the store cannot rebuild is refused
    inline = fit_linear_probe(store, labels, point="resid", layer=2).probe_args()
    np.testing.assert_allclose(inline["weight"], fit.raw_weights()[0], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"'project:128', whose projection matrix the store "
                       r"could not rebuild"):
        dataclasses.replace(fit, projection=None, path=None).probe_args()
    with pytest.raises(ValueError, match=r"^fit_steering_vector: the store holds this "
                       r"point's vectors projected \(project:128\)"):
        fit_steering_vector(store, labels, point="resid", layer=2)


def test_a_probe_fitted_on_a_stores_records_frame_of_projected_vectors_folds_the_projection(
        tiny, tmp_path):
    # store.records_frame gave a plain frame: a probe fitted on it was saved over
    # the random features (run live, scores off by up to 0.99 with no error) and
    # fit_steering_vector took it. Its activations now carry the point's reduction,
    # through the frame operations that keep attrs (filter, sort).
    from undercurrent.notebook import fit_linear_probe, load_records, save_records
    from undercurrent.probes.weights import load_linear_weights
    from undercurrent.steering import fit_steering_vector

    prompts, labels, store = _projected_store(tiny, tmp_path)
    by_request = dict(zip(request_ids(len(prompts)), labels, strict=True))
    frame = store.records_frame()
    frame = frame[frame["layer"] >= 1].sort_values(["request", "token_index"], ascending=False)
    fit = fit_linear_probe(frame, by_request, point="resid", layer=2, seed=0,
                           save_to=tmp_path / "probe.safetensors")
    assert fit.weight.shape == (128,) and fit.projected == "project:128"
    np.testing.assert_array_equal(fit.projection, store.projection("resid"))
    saved = load_linear_weights(tmp_path / "probe.safetensors")
    assert saved.metadata["folded_reduction"] == "project:128"
    view = store.select(point="resid", layer=2)
    fitted = fit.predict_proba(view.vectors())[:, 1]
    np.testing.assert_allclose(_live_scores(tmp_path / "probe.safetensors", prompts, view),
                               fitted, rtol=0, atol=1e-5)
    # inline weights fold it in too; a point stored raw in the same frame is fitted raw
    inline = fit_linear_probe(frame, by_request, point="resid", layer=2, seed=0).probe_args()
    np.testing.assert_allclose(inline["weight"], fit.raw_weights()[0], rtol=1e-6, atol=1e-7)
    raw = fit_linear_probe(frame, by_request, point="kv_last_prompt", layer=1, seed=0)
    assert raw.projected is None
    # saved with save_records and loaded back, the frame keeps the mark (it lost it)
    loaded = load_records(save_records(frame, tmp_path / "frame.parquet"))
    again = fit_linear_probe(loaded, by_request, point="resid", layer=2, seed=0)
    assert again.projected == "project:128"
    np.testing.assert_array_equal(again.projection, fit.projection)
    np.testing.assert_allclose(again.raw_weights()[0], fit.raw_weights()[0], rtol=1e-6,
                               atol=1e-7)
    assert fit_linear_probe(loaded, by_request, point="kv_last_prompt", layer=1,
                            seed=0).projected is None
    with pytest.raises(ValueError, match=r"^fit_steering_vector: the store holds this "
                       r"point's vectors projected \(project:128\)"):
        fit_steering_vector(frame, by_request, point="resid", layer=2)
    # a frame that lost its attrs lost the mark with the activations: refused, not raw
    bare = frame.copy()
    bare.attrs = {}
    with pytest.raises(ValueError, match=r"this frame carries no activations"):
        fit_linear_probe(bare, by_request, point="resid", layer=2)


def test_records_of_a_projected_frame_are_refused_as_the_mark_would_be_lost(tiny, tmp_path):
    # frame_to_records gave records of the projections with no mark: a probe fitted
    # on their records_frame (or on a file saved from them) took them for activations.
    from undercurrent.notebook import (
        fit_linear_probe,
        frame_to_records,
        load_records,
        records_frame,
        save_records,
    )

    prompts, labels, store = _projected_store(tiny, tmp_path)
    frame = store.records_frame()
    projected = (r"point 'resid' holds projections of its activations \(project:128\), not "
                 r"activations; .*keep the rows in a records frame")
    with pytest.raises(ValueError, match=rf"^frame_to_records: {projected}"):
        frame_to_records(frame[frame["layer"] == 2])
    path = save_records(frame, tmp_path / "frame.parquet")
    with pytest.raises(ValueError, match=rf"^load_records\(as_records=True\): {projected}"):
        load_records(path, as_records=True)
    # the point stored raw converts, and its records fit as its frame does
    raw = frame[frame["point"] == "kv_last_prompt"]
    by_request = dict(zip(request_ids(len(prompts)), labels, strict=True))
    remade = fit_linear_probe(records_frame(frame_to_records(raw)), by_request,
                              point="kv_last_prompt", layer=1, seed=0)
    np.testing.assert_allclose(remade.weight, fit_linear_probe(
        raw, by_request, point="kv_last_prompt", layer=1, seed=0).weight, rtol=1e-6)


def _projected_store(tiny: Any, tmp_path: Any) -> tuple[list[str], list[int], Any]:
    """16 labelled prompts and their store, the residual stream kept as project:128."""
    prompts, labels = corpus_prompts(16, seed=3)
    tiny.capture(prompts, tmp_path / "acts", progress=False, reduce={"resid": "project:128"},
                 storage_dtype="float32", **OPTIONS)
    return prompts, labels, open_activations(tmp_path / "acts")


def _live_scores(probe_path: Any, prompts: list[str], view: Any) -> list[float]:
    """The saved probe's scores, run live at layer 2 of the bundled model, at the
    store view's rows (request and token), in the view's order."""
    from undercurrent import ProbedModel
    from undercurrent.notebook import signals_frame

    spec = {"extraction_points": [{
        "name": "guard", "layers": [2], "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "linear_probe", "probe_kind": "trajectory",
        "probe_args": {"path": str(probe_path)}}]}
    live = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    try:
        scores = signals_frame(live.generate(prompts, request_ids=request_ids(len(prompts)),
                                             **OPTIONS))
    finally:
        live.close()
    by_token = dict(zip(zip(scores["request"], scores["token_index"], strict=True),
                        scores["score"], strict=True))
    rows = view.index
    return [by_token[key] for key in zip(rows["request_id"], rows["token_index"], strict=True)]
