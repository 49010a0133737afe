"""Each extraction point's tensors are its own on the vLLM backend too: a probe
that changes its ``record.tensor`` in place changes neither what another point
capturing the same activations receives (inline, or async on a worker) nor the
records kept for it. The oracle is the HF backend's records of those
points, without the probes that change theirs. One engine for the whole file."""

from __future__ import annotations

from typing import Any

import pytest
from point_tensor_probes import PROBES
from vllm_engine_helpers import CHUNK_BUDGET, MAX_NEW_TOKENS, hf_reference, prompts

from undercurrent.adapters.base import SamplingParams
from undercurrent.api import ProbedModel
from undercurrent.spec.types import ExtractionPoint

POSITIONS = {"g": "generated[*]", "p": "prompt[-1]"}


def _points(changing: bool) -> list[ExtractionPoint]:
    found = []
    for tag, position in POSITIONS.items():
        kinds = [("keep", "capture", "inline"), ("seen", "received", "async")]
        if changing:  # (before and after the others; inline: on the in-process engine
            # an async probe's tensors are inference tensors, which refuse changes)
            kinds = [("center", "center", "inline"), *kinds, ("add_one", "add_one", "inline")]
        found += [ExtractionPoint(name=f"{name}_{tag}", layers=(1,),
                                  tensor_type="residual_stream", position=position,
                                  probe_type=probe_type, probe_kind="trajectory",
                                  execution_mode=mode)
                  for name, probe_type, mode in kinds]
    return found


@pytest.fixture(scope="module")
def reference():
    texts = prompts(6)
    return texts


@pytest.fixture(scope="module")
def expected(model_dir, reference):
    # The oracle runs before vLLM is imported in this process.
    outputs = hf_reference(model_dir, reference, _points(False),
                           SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    return [_kept(output) for output in outputs], [output.token_ids for output in outputs]


@pytest.fixture(scope="module")
def probed(model_dir, expected):
    loaded = ProbedModel.from_pretrained(
        model_dir, backend="vllm", dtype="float32", spec=_points(True),
        probes=PROBES,
        max_model_len=256, max_num_batched_tokens=CHUNK_BUDGET, max_num_seqs=32)
    yield loaded
    loaded.close()


def _kept(output: Any) -> dict[str, dict[tuple[int, int], Any]]:
    found: dict[str, dict[tuple[int, int], Any]] = {}
    for record in output.records:
        found.setdefault(record.extraction_point_name, {})[
            (record.token_index, record.layer)] = record.tensor
    return found


def _check(outputs: list[Any], expected: Any) -> None:
    kept_by_output, token_ids = expected
    for output, want, tokens in zip(outputs, kept_by_output, token_ids, strict=True):
        assert output.token_ids == tokens
        kept = _kept(output)
        for tag in POSITIONS:
            for name in ("center", "add_one"):  # (each changed its tensors)
                assert output.results[f"{name}_{tag}"].error is None
            reference = want[f"keep_{tag}"]
            assert reference
            received = output.results[f"seen_{tag}"].verdict
            for got in (kept[f"keep_{tag}"], kept[f"seen_{tag}"], received):
                assert got.keys() == reference.keys()
                for key, tensor in reference.items():
                    assert float((got[key] - tensor).abs().max()) <= 1e-4, (tag, key)


def test_probes_changing_their_tensors_in_place_change_no_other_point_s(probed, reference,
                                                                        expected):
    outputs = probed.generate(reference, max_new_tokens=MAX_NEW_TOKENS, records=True)
    _check(outputs, expected)


def test_a_stream_s_points_keep_their_own_tensors_too(probed, reference, expected):
    events = list(probed.stream(reference[0], max_new_tokens=MAX_NEW_TOKENS, records=True))
    _check([events[-1].output], ([expected[0][0]], [expected[1][0]]))
