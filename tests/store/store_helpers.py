"""Shared pieces of the store tests: the bundled model with a multi-point spec,
corpus prompts, and the oracle (``generate(records=True)``) keyed like a store."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

SPEC = """
extraction_points:
  - name: resid
    layers: [0, 1, 2, 3]
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: norm_probe
    probe_kind: trajectory
  - name: kv_last_prompt
    layers: [1, 3]
    tensor_type: kv
    position: "prompt[-1]"
    probe_type: norm_probe
    probe_kind: single_shot
  - name: mlp
    layers: [2]
    tensor_type: mlp_out
    position: "prompt[-2]"
    probe_type: norm_probe
    probe_kind: single_shot
"""


def corpus_prompts(count: int, seed: int = 5) -> tuple[list[str], list[int]]:
    """Corpus prompts with their labels (0 benign, 1 harmful), alternating."""
    from undercurrent.models.corpus import make_prompt

    rng = random.Random(seed)
    labels = [index % 2 for index in range(count)]
    return [make_prompt(rng, label) for label in labels], labels


def request_ids(count: int) -> list[str]:
    from undercurrent.store.capture import request_id_for

    return [request_id_for(index) for index in range(count)]


def oracle_vectors(outputs: Any) -> dict[tuple[str, str, int, int], np.ndarray]:
    """``{(request, point, layer, token): float32 vector}`` from records."""
    found = {}
    for output in outputs:
        for record in output.records:
            found[record.key()] = record.tensor.float().numpy().copy()
    return found


def store_vectors(store: Any) -> dict[tuple[str, str, int, int], np.ndarray]:
    """The same mapping read back from a store, one point at a time."""
    found = {}
    index = store.index
    for point in index["extraction_point_name"].unique():
        rows = index[index["extraction_point_name"] == point]
        vectors = store.vectors(rows)
        for key, vector in zip(
                zip(rows["request_id"], rows["extraction_point_name"], rows["layer"],
                    rows["token_index"], strict=True), vectors, strict=True):
            found[(key[0], key[1], int(key[2]), int(key[3]))] = np.asarray(vector)
    return found
