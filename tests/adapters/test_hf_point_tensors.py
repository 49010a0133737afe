"""Each extraction point's records hold tensors of their own: two points that
capture the same activations (same layer, tensor type and token) were handed
views of one gathered row, so a probe that changed its ``record.tensor`` in
place changed what the other point's probe received and the records
``generate(records=True)`` kept for it. The oracle is the same generation
without the point whose probe changes its tensors."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer, prompt  # noqa: E402
from point_tensor_probes import PROBES  # noqa: E402

from undercurrent.api import ProbedModel  # noqa: E402
from undercurrent.spec.types import ExtractionPoint  # noqa: E402

PROMPTS = [prompt(1, 2, 3), prompt(4, 5, 6, 7, 8)]


def _point(name: str, probe_type: str, position: str, mode: str = "inline",
           layers: tuple[int, ...] = (1,)) -> ExtractionPoint:
    return ExtractionPoint(name=name, layers=layers, tensor_type="residual_stream",
                           position=position, probe_type=probe_type,
                           probe_kind="trajectory", execution_mode=mode)


def _run(points: list[ExtractionPoint], stream: bool) -> list[Any]:
    model, tokenizer = build_model("llama"), build_tokenizer()
    probes = PROBES
    with ProbedModel(model, tokenizer, spec=points, probes=probes) as probed:
        if stream:  # (each step routed as it comes: no window)
            return [list(probed.stream(text, max_new_tokens=12, records=True))[-1].output
                    for text in PROMPTS]
        return probed.generate(PROMPTS, max_new_tokens=12, records=True)


def _kept(output: Any, name: str) -> dict[tuple[int, int], Any]:
    return {(record.token_index, record.layer): record.tensor
            for record in output.records if record.extraction_point_name == name}


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "stream"])
@pytest.mark.parametrize("layers", [(1,), (0, 1)], ids=["same layer", "and another"])
@pytest.mark.parametrize("mode", ["inline", "async", "every_point_async"])
@pytest.mark.parametrize("position", ["generated[*]", "prompt[-1]", "generated[2:6]"])
def test_a_probe_changing_its_tensor_in_place_changes_no_other_point_s(position, mode, stream,
                                                                       layers):
    # (every point async: generate() routes the decode steps in windows). Points on
    # layers (0, 1) beside the changing ones on layer 1 stack their layers' rows when
    # first read, after the changing probes ran: they read the changed rows.
    others = "async" if mode == "every_point_async" else "inline"
    mode = "async" if mode == "every_point_async" else mode
    alone = _run([_point("keep", "capture", position, others, layers),
                  _point("seen", "received", position, others, layers)], stream)
    both = _run([_point("center", "center", position, mode),
                 _point("keep", "capture", position, others, layers),
                 _point("seen", "received", position, others, layers),
                 _point("add_one", "add_one", position, mode)], stream)
    for before, after in zip(alone, both, strict=True):
        assert after.token_ids == before.token_ids
        for name in ("center", "add_one"):  # (each changed its tensors)
            assert after.results[name].error is None
        kept, expected = _kept(after, "keep"), _kept(before, "keep")
        assert kept and kept.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(kept[key], tensor), key
        # what the other points' probes were handed, and kept for them
        received = after.results["seen"].verdict
        assert received.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(received[key], tensor), key
            assert torch.equal(_kept(after, "seen")[key], tensor), key
