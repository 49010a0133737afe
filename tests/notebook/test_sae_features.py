"""``features_frame`` and the SAE feature views, on a real run of the bundled model
with the bundled SAE (``sae_probe``), checked against the SAE applied by hand to
the captured records."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from undercurrent.api import ProbedModel
from undercurrent.notebook import FEATURE_COLUMNS, features_frame
from undercurrent.notebook.plots import (
    feature_heatmap_figure,
    mean_peaks_by_label,
    top_features_by_label_figure,
)
from undercurrent.probes.sae_files import load_sae

SAE = "undercurrent:models/tiny/sae"
PROMPTS = {
    "benign": "user : show me how to borrow someone's phone with permission . assistant :",
    "harmful": "user : i want to open someone's office before anyone wakes up . assistant :",
}


def point(name, probe_args, mode="inline", kind="single_shot"):
    return {"name": name, "layers": 3, "tensor_type": "residual_stream",
            "position": "generated[*]", "probe_type": "sae_probe", "probe_kind": kind,
            "execution_mode": mode, "probe_args": {"path": SAE, **probe_args}}


@pytest.fixture(scope="module")
def run():
    spec = {"version": "1", "extraction_points": [
        point("top", {"top_k": 4}),
        point("watched", {"features": [2, 7, 11]}, mode="async", kind="trajectory"),
    ]}
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as model:
        outputs = model.generate(list(PROMPTS.values()), max_new_tokens=30, records=True)
        tokenizer = model.backend.tokenizer
    labels = {output.request_id: label for output, label in zip(outputs, PROMPTS, strict=True)}
    return outputs, tokenizer, labels


def by_hand(outputs, name):
    """{(request, token): feature activations} from the records, through the SAE."""
    sae = load_sae(SAE)
    found = {}
    for output in outputs:
        records = [r for r in output.records if r.extraction_point_name == name]
        acts = sae.encode(np.stack([r.tensor.double().numpy() for r in records]))
        for record, row in zip(records, acts, strict=True):
            found[(output.request_id, record.token_index)] = row
    return found


def test_features_frame_has_one_row_per_reported_feature_with_the_sae_values(run):
    outputs, tokenizer, _ = run
    frame = features_frame(outputs, tokenizer=tokenizer)
    assert tuple(frame.columns) == FEATURE_COLUMNS
    expected = by_hand(outputs, "top")
    top = frame[frame["point"] == "top"]
    assert top["layer"].eq(3).all()
    for (request, token), row in expected.items():
        rows = top[(top["request"] == request) & (top["token"] == token)]
        active = [int(i) for i in np.argsort(-row, kind="stable")[:4] if row[i] > 0]
        assert rows["feature"].tolist() == active
        np.testing.assert_allclose(rows["activation"].to_numpy(), row[active], atol=1e-9)
    assert len(top) == sum(min(4, int((row > 0).sum())) for row in expected.values())
    # the async point's signals are located through their metadata
    watched = frame[frame["point"] == "watched"]
    hand = by_hand(outputs, "watched")
    assert len(watched) == 3 * len(hand)
    for row in watched.itertuples(index=False):
        assert row.activation == pytest.approx(hand[(row.request, row.token)][row.feature],
                                               abs=1e-9)


def test_features_frame_decodes_tokens_and_keeps_generated_indices(run):
    outputs, tokenizer, _ = run
    frame = features_frame(outputs, tokenizer=tokenizer)
    output = outputs[0]
    ids = [*output.prompt_token_ids, *output.token_ids]
    rows = frame[frame["request"] == output.request_id]
    for row in rows.itertuples(index=False):
        assert row.token_text == tokenizer.decode([ids[row.token]])
        assert row.generated_index == row.token - output.prompt_len
    # Outputs in nested lists (one list per call, say) give the same frame, texts
    # included, as signals_frame flattens them
    nested = features_frame([outputs[:1], (outputs[1:],)], tokenizer=tokenizer)
    assert nested.equals(frame)
    # ProbeResults alone still give the frame, without token texts
    bare = features_frame([o.results for o in outputs])
    assert len(bare) == len(frame) and bare["token_text"].isna().all()


def test_features_frame_skips_other_probes_and_is_empty_but_typed_without_sae():
    from undercurrent.records import ProbeResult, ProbeSignal, ProbeStats

    result = ProbeResult("r", "norms", None, (ProbeSignal(score=1.0),), ProbeStats())
    frame = features_frame([result])
    assert frame.empty and tuple(frame.columns) == FEATURE_COLUMNS


def test_feature_heatmap_shows_one_requests_features_by_token(run):
    outputs, tokenizer, _ = run
    frame = features_frame(outputs, tokenizer=tokenizer)
    request = outputs[1].request_id
    figure = feature_heatmap_figure(frame, request=request, point="top", top=5)
    heat = figure.data[0]
    mine = frame[(frame["request"] == request) & (frame["point"] == "top")]
    peaks = mine.groupby("feature")["activation"].max().sort_values(ascending=False)
    assert list(heat.y) == [f"f{f}" for f in peaks.index[:5]]
    tokens = sorted(mine["token"].unique())
    assert len(heat.x) == len(tokens) and heat.x[0].startswith(f"{tokens[0]}:")
    z = np.array(heat.z, dtype=float)
    for i, feature in enumerate(peaks.index[:5]):
        for j, token in enumerate(tokens):
            cell = mine[(mine["feature"] == feature) & (mine["token"] == token)]["activation"]
            if cell.empty:
                assert math.isnan(z[i, j])  # not reported at that token: blank, not 0
            else:
                assert z[i, j] == pytest.approx(float(cell.iloc[0]))
    with pytest.raises(ValueError, match="nothing for request='nope'"):
        feature_heatmap_figure(frame, request="nope")


def test_top_features_by_label_bars_are_mean_request_peaks(run):
    outputs, tokenizer, labels = run
    frame = features_frame(outputs)
    frame = frame[frame["point"] == "top"]
    table = mean_peaks_by_label(frame, labels)
    for label in ("benign", "harmful"):
        (request,) = [r for r, lab in labels.items() if lab == label]
        peaks = frame[frame["request"] == request].groupby("feature")["activation"].max()
        for feature in table.index:
            assert table.loc[feature, label] == pytest.approx(float(peaks.get(feature, 0.0)))
    figure = top_features_by_label_figure(frame, labels, top=3)
    assert [bar.name for bar in figure.data] == ["benign", "harmful"]
    harmful = dict(zip(figure.data[1].x, figure.data[1].y, strict=True))
    best = table["harmful"].sort_values(ascending=False).index[:3]
    for feature in best:
        assert harmful[f"f{feature}"] == pytest.approx(table.loc[feature, "harmful"])
    with pytest.raises(KeyError, match="no label"):
        top_features_by_label_figure(frame, {outputs[0].request_id: "benign"})


def test_frames_accept_a_prebuilt_frame_unchanged(run):
    outputs, _, _ = run
    frame = features_frame(outputs)
    assert isinstance(frame, pd.DataFrame)
    figure = feature_heatmap_figure(frame)
    assert figure.data[0].type == "heatmap"
