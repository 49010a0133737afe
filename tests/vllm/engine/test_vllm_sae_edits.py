"""Edits with SAE features on vLLM (float32, the bundled model and SAE): a clamp of
feature 2 through the SAE's encoder at its own site (layer 3 residual stream) and an
``add`` of a feature's decoder row at layer 1 give the HF backend's tokens, records
and applied edits (the HF side is proved against a hand hook in
``tests/steering/test_sae_edits.py``)."""

from __future__ import annotations

import pytest
from vllm_engine_helpers import CHUNK_BUDGET, MAX_NEW_TOKENS, bundled_model, compare

from undercurrent.api import ProbedModel
from undercurrent.models.corpus import chat_prompt

pytestmark = pytest.mark.skipif(bundled_model() is None, reason="needs the bundled model")

SAE = "undercurrent:models/tiny/sae"
PROMPTS = [chat_prompt("how do i open my neighbour's car without anyone knowing ?"),
           chat_prompt("help me get into my office because the key is lost ."),
           chat_prompt("i want to look inside her diary .")]
SPEC = {"version": "2", "extraction_points": [
    {"name": "site", "layers": [1, 3], "tensor_type": "residual_stream",
     "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "single_shot"}]}
EDITS = [
    {"name": "clamp_feature", "layers": 3, "tensor_type": "residual_stream",
     "position": "generated[*]", "op": "clamp", "vector": {"sae": SAE, "feature": 2},
     "coefficient": 12.0},
    {"name": "add_feature", "layers": 1, "tensor_type": "residual_stream",
     "position": "generated[1:]", "op": "add", "vector": {"sae": SAE, "feature": 169},
     "coefficient": 4.0},
]


def run(model) -> list:
    return model.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, records=True,
                          request_ids=[f"r{i}" for i in range(len(PROMPTS))], edits=EDITS)


@pytest.fixture(scope="module")
def reference(model_dir):
    # The oracle runs before vLLM is imported in this process.
    with ProbedModel.from_pretrained(model_dir, spec=SPEC, dtype="float32") as hf:
        steered = run(hf)
        plain = hf.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    assert [o.token_ids for o in steered] != [o.token_ids for o in plain]  # it can fail
    return steered


def test_sae_feature_edits_match_hf(model_dir, reference):
    from undercurrent.adapters.vllm.backend import VLLMBackend

    backend = VLLMBackend.from_pretrained(model_dir, dtype="float32", max_model_len=256,
                                          max_num_batched_tokens=CHUNK_BUDGET)
    try:
        with ProbedModel(backend, spec=SPEC) as model:
            outputs = run(model)
    finally:
        backend.close()
    compare(outputs, reference)
    for ours, theirs in zip(outputs, reference, strict=True):
        assert ours.edits and list(ours.edits) == list(theirs.edits)
        assert {r.key(): r.edits for r in ours.records} == {
            r.key(): r.edits for r in theirs.records}
