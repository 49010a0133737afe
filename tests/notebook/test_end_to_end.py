"""The notebook loop on the bundled model: capture -> frame -> fit -> run live in LiveView."""

from __future__ import annotations

import html
import random

import numpy as np
import pytest

from undercurrent.models import tiny_model_path

if not (tiny_model_path() / "config.json").exists():  # pragma: no cover - model ships with repo
    pytest.skip("the bundled model is not built yet", allow_module_level=True)

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.models.corpus import LABEL_NAMES, make_prompt  # noqa: E402
from undercurrent.notebook import (  # noqa: E402
    LiveView,
    activation_matrix,
    fit_linear_probe,
    load_records,
    records_frame,
    save_records,
    signals_frame,
)
from undercurrent.spec import ExtractionPoint, ProbeSpec, parse_yaml  # noqa: E402

GENERATED = 6


@pytest.fixture(scope="module")
def captured():
    spec = parse_yaml(f"""
extraction_points:
  - name: resid
    layers: [0, 1, 2, 3]
    tensor_type: residual_stream
    position: "generated[0:{GENERATED}]"
    probe_type: norm_probe
    probe_kind: trajectory
""")
    rng = random.Random(3)
    labels = [i % 2 for i in range(40)]
    prompts = [make_prompt(rng, label) for label in labels]
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    try:
        outputs = model.generate(prompts, max_new_tokens=GENERATED, records=True)
        yield model, outputs, labels
    finally:
        model.close()


def test_records_frame_matches_the_outputs_token_by_token(captured):
    model, outputs, _ = captured
    frame = records_frame(outputs, tokenizer=model.backend.tokenizer)
    layers = model.capabilities().num_layers
    # The last sampled token is never fed back to the model, so it has no activations.
    assert len(frame) == sum(len(o.token_ids[:GENERATED]) - 1 for o in outputs) * min(layers, 4)
    for output in outputs[:5]:
        rows = frame[(frame["request"] == output.request_id) & (frame["layer"] == 0)]
        assert rows["token_id"].tolist() == list(output.token_ids[:GENERATED - 1])
        assert (rows["token_index"] - rows["generated_index"] == output.prompt_len).all()
        assert rows["token_text"].iloc[0] == model.backend.tokenizer.decode(
            [output.token_ids[0]])


def test_signals_of_inline_points_are_located_on_the_token_axis(captured):
    _, outputs, _ = captured
    signals = signals_frame(outputs)
    assert signals["generated_index"].notna().all()
    assert set(signals["generated_index"]) <= set(range(GENERATED))


def test_parquet_round_trip_of_real_records(captured, tmp_path):
    _, outputs, _ = captured
    frame = records_frame(outputs)
    loaded = load_records(save_records(outputs, tmp_path / "run.parquet"))
    assert len(loaded) == len(frame)
    for layer in range(4):
        np.testing.assert_array_equal(activation_matrix(loaded, layer=layer),
                                      activation_matrix(frame, layer=layer))


def test_a_probe_fitted_on_captured_activations_beats_chance_on_held_out_requests(captured):
    _, outputs, labels = captured
    frame = records_frame(outputs)
    label_of = {o.request_id: LABEL_NAMES[y] for o, y in zip(outputs, labels, strict=True)}
    best = max(
        (fit_linear_probe(frame, label_of, layer=layer, C=0.5) for layer in range(4)),
        key=lambda fit: fit.metrics["test_auc"],
    )
    assert best.metrics["split"] == "request"
    assert best.metrics["test_auc"] > 0.75, best.metrics


def test_fitted_probe_runs_live_and_aborts_in_the_live_view(captured, tmp_path):
    model, outputs, labels = captured
    frame = records_frame(outputs)
    label_of = {o.request_id: y for o, y in zip(outputs, labels, strict=True)}
    fit = fit_linear_probe(frame, label_of, layer=2, save_to=tmp_path / "p.safetensors",
                           threshold=0.0)  # every score reaches 0: abort on the first token
    live = ProbedModel(model.backend, spec=ProbeSpec([ExtractionPoint(
        name="mine", layers=(2,), tensor_type="residual_stream", position="generated[*]",
        probe_type="linear_probe", probe_kind="single_shot",
        probe_args=fit.probe_args(action="abort"),
    )]))
    view = LiveView(live)
    prompts = [outputs[0].prompt, outputs[1].prompt]
    results = view.run(prompts, max_new_tokens=8, display=False)
    assert [r.aborted for r in results] == [True, True]
    assert all(r.abort.generated_index == 0 and len(r.token_ids) == 1 for r in results)
    message = html.unescape(view.message.value)
    assert message.count("aborted by 'mine' (layer 2) at generated token 0") == 2
    assert len([t for t in view.figure.data if t.name.endswith(" abort")]) == 2
    expected = fit.predict_proba(activation_matrix(
        frame[frame["request"] == outputs[0].request_id], layer=2))[0, 1]
    assert results[0].abort.signal.score == pytest.approx(expected, abs=1e-4)
