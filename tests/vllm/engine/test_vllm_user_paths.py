"""What a newcomer does first with the vLLM backend, checked against the HF backend.

Loaded with no ``dtype``, it runs the model in the dtype its config.json declares
(float32 for the bundled model), so tokens equal the HF backend's and records agree
to float32 rounding; vLLM's own ``dtype="auto"`` would run a float32 checkpoint in
bfloat16 on CPU (different tokens, records off by ~2e-2). A stream's pieces joined
equal the output's text, with stop strings as with the HF backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm_engine_helpers import hf_reference, prompts

from undercurrent.adapters.base import SamplingParams
from undercurrent.api import ProbedModel
from undercurrent.spec.types import ExtractionPoint

MAX_NEW_TOKENS = 32
GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)


def chat_prompts() -> list[str]:
    """Prompts in the bundled model's own chat format (its replies are long enough
    for bfloat16 rounding to change tokens), then the engine tests' word prompts."""
    from undercurrent.models.corpus import generate_examples

    return [example.prompt for example in generate_examples(6, seed=11)] + prompts(4)


def points(num_layers: int) -> list[ExtractionPoint]:
    return [ExtractionPoint(name="residual", layers=tuple(range(num_layers)),
                            tensor_type="residual_stream", position="generated[*]",
                            probe_type="norm_probe", probe_kind="trajectory"),
            ExtractionPoint(name="last_prompt", layers=(num_layers,), tensor_type="final_norm",
                            position="prompt[-1]", probe_type="norm_probe",
                            probe_kind="single_shot")]


@pytest.fixture(scope="module")
def reference(model_dir, num_layers):
    # The oracle runs before vLLM is imported in this process.
    texts = chat_prompts()
    return texts, hf_reference(model_dir, texts, points(num_layers), GREEDY)


@pytest.fixture(scope="module")
def probed(model_dir, reference, num_layers):
    loaded = ProbedModel.from_pretrained(model_dir, backend="vllm", spec=points(num_layers),
                                         max_model_len=256)
    yield loaded
    loaded.close()


def test_the_default_dtype_is_the_one_config_json_declares(probed, model_dir):
    declared = json.loads((Path(model_dir) / "config.json").read_text())
    assert (declared.get("dtype") or declared.get("torch_dtype")) == "float32"
    assert probed.backend.engine.model_config.dtype == torch.float32


def test_default_dtype_tokens_and_records_equal_hf(probed, reference):
    texts, hf_outputs = reference
    outputs = probed.generate(texts, max_new_tokens=MAX_NEW_TOKENS, records=True,
                              request_ids=[f"r{i}" for i in range(len(texts))])
    differing = [ours.request_id for ours, theirs in zip(outputs, hf_outputs, strict=True)
                 if ours.token_ids != theirs.token_ids]
    assert differing == []
    for ours, theirs in zip(outputs, hf_outputs, strict=True):
        theirs_by_key = {record.key(): record for record in theirs.records}
        assert {record.key() for record in ours.records} == set(theirs_by_key)
        for record in ours.records:
            other = theirs_by_key[record.key()]
            assert record.tensor.dtype == other.tensor.dtype == torch.float32
            scale = float(other.tensor.abs().max())
            # float32 rounding, relative to the activation's size (bfloat16: ~1e-2)
            assert float((record.tensor - other.tensor).abs().max()) <= 1e-5 * max(scale, 1.0)



@pytest.mark.parametrize("words", [1, 2])
def test_stream_pieces_with_a_stop_string_equal_the_output_text(probed, reference, words):
    texts, hf_outputs = reference
    plain = hf_outputs[0].text.split()
    stop = " ".join(plain[3:3 + words])
    events = list(probed.stream(texts[0], max_new_tokens=MAX_NEW_TOKENS, stop=stop))
    output = events[-1].output
    joined = "".join(event.text for event in events)
    assert output.finish_reason == "stop"
    assert joined == output.text == " ".join(plain[:3]) + " "
    assert stop not in joined


def test_prompt_activations_equal_hf_prompt_records_without_generating(probed, reference):
    texts, hf_outputs = reference
    ids = [f"r{i}" for i in range(len(texts))]
    outputs = probed.prompt_activations(texts, request_ids=ids)
    for ours, theirs in zip(outputs, hf_outputs, strict=True):
        assert ours.token_ids == () and ours.text == "" and ours.finish_reason == "forward"
        prompt_records = {r.key(): r for r in theirs.records if not r.is_generated}
        assert {r.key() for r in ours.records} == set(prompt_records)
        for record in ours.records:
            other = prompt_records[record.key()]
            scale = float(other.tensor.abs().max())
            assert float((record.tensor - other.tensor).abs().max()) <= 1e-5 * max(scale, 1.0)


def test_input_ids_give_what_the_same_prompts_as_text_give(probed, reference):
    texts, hf_outputs = reference
    token_ids = [list(output.prompt_token_ids) for output in hf_outputs[:3]]
    by_ids = probed.generate(input_ids=token_ids, max_new_tokens=MAX_NEW_TOKENS)
    assert [o.token_ids for o in by_ids] == [o.token_ids for o in hf_outputs[:3]]
    assert [o.prompt_token_ids for o in by_ids] == [o.prompt_token_ids for o in hf_outputs[:3]]


@pytest.mark.parametrize("read", [True, False], ids=["outputs read", "results only"])
def test_a_generation_leaves_no_request_state_for_the_garbage_collector(probed, monkeypatch,
                                                                        read):
    # The driver's plans are released when the generation ends
    # (CaptureSession.release_plans): each request's state, signals and rows are
    # freed by reference counting when the outputs are dropped, with the
    # collector off (as tests/adapters/test_hf_release.py checks for HF).
    import gc
    import weakref

    from undercurrent.adapters import session as session_module

    found = []
    original = session_module.CaptureSession.open_requests

    def recording(self, entries):
        opened = original(self, entries)
        found.extend(weakref.ref(state) for state in opened)
        return opened

    monkeypatch.setattr(session_module.CaptureSession, "open_requests", recording)
    texts = prompts(4)
    gc.collect()
    gc.disable()
    try:
        outputs = probed.generate(texts, max_new_tokens=8, records=read)
        for output in outputs:
            assert output.results["residual"].stats.received > 0
            if read:
                assert len(list(output.signals)) == sum(
                    result.stats.received for result in output.results.values())
                assert len(output.records) == len(list(output.signals))
        assert len(found) == len(texts)
        del outputs, output
        assert [ref() for ref in found] == [None] * len(texts)
    finally:
        gc.enable()


def test_no_object_of_undercurrent_is_left_in_a_reference_cycle(probed):
    # Not only the requests' states: nothing undercurrent made, on the driver's
    # side or the in-process worker's (a decode step's repeated plan and its
    # groups among them, one per step), is found by the collector once the
    # outputs are dropped.
    import gc

    from cycles import undercurrent_types_in_cycles

    texts = prompts(4)
    probed.generate(texts, max_new_tokens=4)  # (the engine's own first-call garbage)
    gc.collect()
    gc.disable()
    try:
        outputs = probed.generate(texts, max_new_tokens=12)
        assert all(output.results["residual"].stats.received > 0 for output in outputs)
        del outputs
        left = undercurrent_types_in_cycles()
    finally:
        gc.enable()
    assert left == []


def test_a_call_past_max_model_len_is_refused_before_it_runs(probed):
    # vLLM ended such a request early with finish_reason="length", silently; it
    # counts the last sampled token, so prompt + max_new_tokens <= max_model_len.
    ids = [1] + [20] * 251  # 252 tokens, max_model_len 256
    with pytest.raises(ValueError, match=r"prompt 0 has 252 tokens; with max_new_tokens=5 "
                                         r"vLLM needs 257 tokens of room .* max_model_len is "
                                         r"256: use max_new_tokens <= 4"):
        probed.generate(input_ids=[ids], max_new_tokens=5)
    with pytest.raises(ValueError, match="use max_new_tokens <= 4"):
        list(probed.stream(input_ids=ids, max_new_tokens=5))
    (output,) = probed.generate(input_ids=[ids], max_new_tokens=4)
    assert len(output.token_ids) == 4 or output.finish_reason == "eos"


def test_a_prompt_activations_past_max_model_len_is_told_the_prompt_that_fits(probed):
    # (it advised max_new_tokens=1, an argument prompt_activations does not take)
    with pytest.raises(ValueError) as refused:
        probed.prompt_activations(input_ids=[[1] + [20] * 255])  # 256 tokens
    message = str(refused.value)
    assert "max_new_tokens" not in message, message
    assert message.endswith("max_model_len is 256: shorten the prompt to at most 255 tokens")
    (output,) = probed.prompt_activations(input_ids=[[1] + [20] * 254])
    assert output.finish_reason == "forward"


def test_a_seeded_call_samples_repeated_prompts_apart_and_reproducibly(probed):
    # One shared seed gave every copy of a prompt the same sample; request i is
    # seeded with seed + i.
    def sample(seed):
        return [o.token_ids for o in probed.generate(
            ["user : hi"] * 4, max_new_tokens=8, temperature=1.0, seed=seed)]

    first = sample(7)
    assert first == sample(7) and len(set(first)) > 1
    assert sample(8)[0] == first[1]  # request 1 of seed 7 is seeded with 8


def test_a_misspelt_engine_argument_leaves_no_staging_folder(model_dir):
    import tempfile

    def staged():
        return set(Path(tempfile.gettempdir()).glob("undercurrent-vllm-model-*"))

    from undercurrent.adapters.vllm.loading import extra_safetensors

    assert extra_safetensors(Path(model_dir))  # (so this load stages a folder)
    before = staged()
    with pytest.raises(TypeError, match="max_num_seq"):
        ProbedModel.from_pretrained(model_dir, backend="vllm", max_num_seq=4)
    assert staged() == before


def test_a_tokenizer_path_is_the_engines_tokenizer_and_ours(model_dir, reference, tmp_path):
    # tokenizer= went to the engine alone: the backend tokenized and decoded with
    # the model directory's tokenizer all the same.
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path)
    texts, expected = reference
    with ProbedModel.from_pretrained(model_dir, backend="vllm", tokenizer=tmp_path,
                                     max_model_len=256) as loaded:
        assert loaded.backend.tokenizer.name_or_path == str(tmp_path)
        (output,) = loaded.generate(texts[:1], max_new_tokens=MAX_NEW_TOKENS)
    assert output.token_ids == expected[0].token_ids
