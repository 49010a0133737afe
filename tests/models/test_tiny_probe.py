"""The shipped probe, measured: its file's format, its documented accuracy and abort
threshold on fresh prompts, and live scores against a plain forward hook."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("sklearn")

from tools.tiny_model.probe_fit import (  # noqa: E402
    PROBE_FIT_SEED,
    abort_summary,
    accuracy_summary,
    capture,
    probe_prompts,
    probe_scores,
)
from tools.tiny_model.train import TRAIN_SEED, TrainingConfig  # noqa: E402
from undercurrent.models import tiny_model_path, tiny_probe_path  # noqa: E402
from undercurrent.models.corpus import generate_examples  # noqa: E402
from undercurrent.probes.weights import LINEAR_PROBE_FORMAT, load_linear_weights  # noqa: E402

FRESH_SEED = PROBE_FIT_SEED + 99  # neither the probe's training nor its held-out prompts
MARGIN = 0.06


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((tiny_model_path() / "probe_report.json").read_text())


@pytest.fixture(scope="module")
def weights():
    return load_linear_weights(tiny_probe_path())


@pytest.fixture(scope="module")
def loaded():
    directory = str(tiny_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    return model, transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def fresh(loaded, weights):
    model, tokenizer = loaded
    seen = {e.prompt for e in generate_examples(TrainingConfig.examples, TRAIN_SEED)}
    examples = probe_prompts(40, FRESH_SEED, exclude=seen)
    layer = int(weights.metadata["layer"])
    captured = capture(model, tokenizer, examples, [layer])
    return captured, probe_scores(weights.weight, weights.bias, captured.layers[layer])


def test_probe_file_is_in_the_linear_probe_format_of_the_bundled_model(weights) -> None:
    # Whether it agrees with probe_report.json and docs/model.md (written by the same
    # run) is a report, not a test: tools/probe_report_check.py.
    meta = weights.metadata
    assert meta["format"] == LINEAR_PROBE_FORMAT
    assert meta["link"] == "sigmoid"
    assert meta["tensor_type"] == "residual_stream"
    assert json.loads(meta["label_names"]) == ["benign", "harmful"]
    config = json.loads((tiny_model_path() / "config.json").read_text())
    assert 0 <= int(meta["layer"]) < config["num_hidden_layers"]
    assert 0.0 < float(meta["threshold"]) < 1.0
    assert weights.weight.shape == (config["hidden_size"],)
    assert weights.bias.shape == ()


def test_documented_accuracy_holds_on_fresh_prompts(fresh, report) -> None:
    captured, scores = fresh
    documented = report["layers"][str(report["best_layer"])]["trained"]
    measured = accuracy_summary(captured, scores)
    assert measured["accuracy_all_tokens"] >= documented["accuracy_all_tokens"] - MARGIN
    assert measured["accuracy_before_reveal"] >= documented["accuracy_before_reveal"] - MARGIN


def test_threshold_stops_harmful_replies_before_their_words_and_spares_benign(fresh,
                                                                              report) -> None:
    captured, scores = fresh
    summary = abort_summary(captured, scores, report["threshold"])
    documented = report["layers"][str(report["best_layer"])]["trained"]["abort"]
    assert (summary["harmful_aborted_before_reveal"]
            >= documented["harmful_aborted_before_reveal"] - 2 * MARGIN)
    assert summary["benign_aborted"] <= documented["benign_aborted"] + 2 * MARGIN
    assert summary["median_lead_tokens"] > 0


def test_live_linear_probe_scores_equal_a_plain_forward_pass(loaded, weights) -> None:
    """Oracle: a plain forward hook on the decoder layer, scored by hand, against the
    live probe (transformers' ``hidden_states[-1]`` is after the final norm, so the
    last layer's residual stream is read from the layer's own output)."""
    from undercurrent.api import ProbedModel

    model, tokenizer = loaded
    layer = int(weights.metadata["layer"])
    spec = {"version": "1", "extraction_points": [{
        "name": "guard", "layers": layer, "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "linear_probe",
        "probe_kind": "single_shot", "probe_args": {"path": str(tiny_probe_path())}}]}
    prompt = generate_examples(1, seed=FRESH_SEED)[0].prompt
    probed = ProbedModel(model, tokenizer, spec=spec)
    try:
        (output,) = probed.generate(prompt, max_new_tokens=12)
    finally:
        probed.close()
    ids = torch.tensor([list(output.prompt_token_ids) + list(output.token_ids)])
    seen = []

    def keep(module, args, result):
        seen.append(result[0] if isinstance(result, tuple) else result)

    handle = model.model.layers[layer].register_forward_hook(keep)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    hidden = seen[0][0]
    live = {s.generated_index: s.score for s in output.signals}
    assert len(live) >= 11
    for generated_index, score in live.items():
        row = hidden[output.prompt_len + generated_index].double().numpy()
        expected = probe_scores(weights.weight, weights.bias, row[None, :])[0]
        assert math.isclose(score, expected, rel_tol=1e-4, abs_tol=1e-5), generated_index
