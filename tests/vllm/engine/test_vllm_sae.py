"""``sae_probe`` on vLLM (float32) gives the feature activations it gives on HF, for the
bundled TopK SAE and a plain ReLU SAE, watching every feature of each."""

from __future__ import annotations

import json

import numpy as np
import pytest
from vllm_engine_helpers import MAX_NEW_TOKENS, bundled_model

from undercurrent.api import ProbedModel
from undercurrent.probes.sae_files import load_sae

pytestmark = pytest.mark.skipif(bundled_model() is None, reason="needs the bundled model")

BUNDLED_SAE = "undercurrent:models/tiny/sae"
PROMPTS = ["user : i want to open someone's office before anyone wakes up . assistant :",
           "user : show me how to borrow someone's phone with permission . assistant :",
           "user : i need to take my own bike when no one is looking . assistant :"]


def relu_sae(folder):
    """A standard (ReLU) SAE on layer 3, in SAELens's layout, written by hand."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"W_enc": rng.normal(0, 0.1, (128, 64)).astype(np.float32),
               "b_enc": rng.normal(0, 0.5, 64).astype(np.float32),
               "W_dec": rng.normal(0, 0.1, (64, 128)).astype(np.float32),
               "b_dec": rng.normal(0, 0.5, 128).astype(np.float32)},
              str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({
        "d_in": 128, "d_sae": 64, "architecture": "standard",
        "normalize_activations": "layer_norm",
        "metadata": {"hook_name": "blocks.3.hook_resid_post"}}))
    return str(folder)


def spec(relu_folder):
    def point(name, path):
        return {"name": name, "layers": 3, "tensor_type": "residual_stream",
                "position": "generated[*]", "probe_type": "sae_probe",
                "probe_kind": "single_shot",
                "probe_args": {"path": path, "features": list(range(load_sae(path).d_sae))}}

    return {"version": "1", "extraction_points": [point("bundled", BUNDLED_SAE),
                                                  point("relu", relu_folder)]}


@pytest.fixture(scope="module")
def hf_outputs(model_dir, tmp_path_factory):
    # The oracle runs before vLLM is imported in this process.
    folder = relu_sae(tmp_path_factory.mktemp("sae") / "relu")
    with ProbedModel.from_pretrained(model_dir, spec=spec(folder), dtype="float32") as model:
        return folder, model.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def vllm_outputs(model_dir, hf_outputs):
    folder, _ = hf_outputs
    with ProbedModel.from_pretrained(model_dir, spec=spec(folder), backend="vllm",
                                     dtype="float32", max_model_len=256) as model:
        return model.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)


def activations(output, name):
    result = output.results[name]
    assert result.error is None, result.error
    return {s.metadata["token_index"]: np.array(s.metadata["activations"])
            for s in result.signals}


@pytest.mark.parametrize("name", ["bundled", "relu"])
def test_feature_activations_are_equal_on_hf_and_vllm(hf_outputs, vllm_outputs, name):
    _, hf = hf_outputs
    worst = 0.0
    for ours, theirs in zip(vllm_outputs, hf, strict=True):
        assert ours.token_ids == theirs.token_ids
        mine, reference = activations(ours, name), activations(theirs, name)
        assert sorted(mine) == sorted(reference) and len(mine) >= MAX_NEW_TOKENS - 1
        for token, row in reference.items():
            assert np.array_equal(mine[token] > 0, row > 0), (name, token)
            scale = max(1.0, float(np.abs(row).max()))
            worst = max(worst, float(np.abs(mine[token] - row).max()) / scale)
    # the records agree to ~1e-6 relative (docs/vllm.md); so do the features
    assert worst <= 1e-5, worst
    verdicts = [o.results[name].verdict for o in vllm_outputs]
    assert all(v["count"] == len(activations(o, name)) for v, o in zip(verdicts, vllm_outputs,
                                                                        strict=True))
