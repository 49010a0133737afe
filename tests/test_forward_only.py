"""``ProbedModel.prompt_activations``: the spec's activations for prompts from one
forward pass, checked against transformers' ``output_hidden_states``; ``input_ids=``
in place of prompt strings; the ``capture`` probe type for capture-only points."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "adapters"))
from hf_models import build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.adapters.prompts import plain_ids  # noqa: E402
from undercurrent.spec.types import ExtractionPoint  # noqa: E402

LAYERS = 3  # the tiny llama's decoder layers
PROMPTS = [prompt(3, 1, 4, 1, 5, 9), prompt(2, 6), prompt(5, 3, 5, 8)]


def capture_point(name: str, layers, position, tensor_type="residual_stream",
                  kind="single_shot") -> ExtractionPoint:
    return ExtractionPoint(name=name, layers=tuple(layers), tensor_type=tensor_type,
                           position=position, probe_type="capture", probe_kind=kind)


SPEC = [
    capture_point("first", (0, 1), "prompt[0]"),
    capture_point("last", (0, 1), "prompt[-1]"),
    capture_point("absolute", (1,), 2),
    capture_point("normed", (LAYERS,), "prompt[-1]", tensor_type="final_norm"),
    # generated positions: nothing without generation
    capture_point("generated", (0,), "generated[*]", kind="trajectory"),
    capture_point("after_prompt", (0,), "prompt[-1]+1"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def probed(tokenizer):
    with ProbedModel(build_model("llama"), tokenizer, spec=SPEC) as pm:
        yield pm


def hidden_states(tokenizer, text: str) -> tuple:
    """The oracle: transformers' own hidden states of one unpadded forward."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return build_model("llama")(ids, output_hidden_states=True).hidden_states


def expected_keys(prompt_len: int) -> set[tuple[str, int, int]]:
    last = prompt_len - 1
    keys = {("first", layer, 0) for layer in (0, 1)} | {("last", layer, last) for layer in (0, 1)}
    keys.add(("normed", LAYERS, last))
    if prompt_len > 2:
        keys.add(("absolute", 1, 2))
    return keys


def test_records_equal_transformers_hidden_states_for_a_ragged_batch(probed, tokenizer):
    outputs = probed.prompt_activations(PROMPTS)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        states = hidden_states(tokenizer, output.prompt)
        assert output.text == "" and output.token_ids == ()
        assert output.finish_reason == "forward" and not output.aborted
        keys = {(r.extraction_point_name, r.layer, r.token_index) for r in output.records}
        assert keys == expected_keys(output.prompt_len)
        assert len(keys) == len(output.records)
        for record in output.records:
            assert not record.is_generated and record.generated_index is None
            assert record.token_id == output.prompt_token_ids[record.token_index]
            # residual_stream at layer l is hidden_states[l + 1]; final_norm at N is [N]
            layer = record.layer if record.tensor_type == "final_norm" else record.layer + 1
            oracle = states[layer][0, record.token_index]
            torch.testing.assert_close(record.tensor, oracle, atol=1e-5, rtol=1e-5)


def test_prompt_records_equal_those_of_a_generation(probed):
    ids = ["a", "b", "c"]
    forward = probed.prompt_activations(PROMPTS, request_ids=ids)
    generated = probed.generate(PROMPTS, max_new_tokens=3, records=True, request_ids=ids)
    for ours, theirs in zip(forward, generated, strict=True):
        prompt_records = {r.key(): r for r in theirs.records if not r.is_generated}
        assert {r.key() for r in ours.records} == set(prompt_records)
        for record in ours.records:
            assert torch.equal(record.tensor, prompt_records[record.key()].tensor)
        # the generation itself did capture its generated tokens
        assert any(r.is_generated for r in theirs.records)


def test_the_capture_probe_keeps_records_and_says_nothing(probed):
    output = probed.generate(PROMPTS[:1], max_new_tokens=4, records=True)[0]
    assert output.signals == ()
    for name, result in output.results.items():
        assert result.verdict is None and result.signals == () and result.error is None
        count = sum(r.extraction_point_name == name for r in output.records)
        assert result.stats.received == result.stats.processed == count
    assert output.results["generated"].stats.received == 3  # 4 tokens, 3 fed back


# -- input_ids -----------------------------------------------------------------------

def test_input_ids_give_what_the_same_prompts_as_text_give(probed, tokenizer):
    ids = [tokenizer(text)["input_ids"] for text in PROMPTS]
    by_text = probed.generate(PROMPTS, max_new_tokens=4, records=True)
    by_ids = probed.generate(input_ids=ids, max_new_tokens=4, records=True)
    for text_output, ids_output in zip(by_text, by_ids, strict=True):
        assert ids_output.token_ids == text_output.token_ids
        assert ids_output.prompt_token_ids == text_output.prompt_token_ids
        # (the prompt's text: its ids decoded, special tokens kept)
        assert ids_output.prompt == tokenizer.decode(list(ids_output.prompt_token_ids))
        assert ids_output.prompt.startswith(tokenizer.bos_token)
        assert [r.key()[1:] for r in ids_output.records] == [
            r.key()[1:] for r in text_output.records]
        for ours, theirs in zip(ids_output.records, text_output.records, strict=True):
            assert torch.equal(ours.tensor, theirs.tensor)
    forward = probed.prompt_activations(input_ids=torch.tensor(ids[2]))
    assert [r.key()[1:] for r in forward[0].records] == [
        r.key()[1:] for r in probed.prompt_activations(PROMPTS[2])[0].records]
    events = list(probed.stream(input_ids=ids[0], max_new_tokens=4))
    assert events[-1].output.token_ids == by_text[0].token_ids


def test_input_ids_are_fed_as_given_without_a_bos(probed, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"][1:]  # drop the <bos> the tokenizer adds
    output = probed.prompt_activations(input_ids=[ids])[0]
    assert output.prompt_token_ids == tuple(ids)
    with torch.no_grad():
        states = build_model("llama")(torch.tensor([ids]), output_hidden_states=True)
    first = next(r for r in output.records if r.extraction_point_name == "first" and r.layer == 0)
    assert first.token_id == ids[0]
    torch.testing.assert_close(first.tensor, states.hidden_states[1][0, 0], atol=1e-5, rtol=1e-5)


def test_prompt_ids_come_back_as_plain_ints_whatever_form_they_were_given_in(probed, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    given = [list(ids), tuple(ids), np.array(ids), torch.tensor(ids)]
    outputs = probed.generate(input_ids=given, max_new_tokens=2)
    for output in outputs:
        assert output.prompt_token_ids == tuple(ids)
        assert set(map(type, output.prompt_token_ids)) == {int}
        assert output.token_ids == outputs[0].token_ids
    given[0][0] = ids[0] + 1  # (the caller's list changed after the call: not the output's)
    assert outputs[0].prompt_token_ids == tuple(ids)


def test_plain_ids_keep_a_tuple_of_plain_ints_and_convert_anything_else():
    row = (3, 1, 4)
    assert plain_ids(row) is row
    for other in ([3, 1, 4], (3, np.int64(1), 4), np.array([3, 1, 4]), (3, True, 4)):
        made = plain_ids(other)
        assert type(made) is tuple and set(map(type, made)) == {int}
        assert made == (3, 1, 4)  # (True is 1, as int gives it)


@pytest.mark.parametrize(("kwargs", "error", "fragment"), [
    ({"prompts": PROMPTS[:1], "input_ids": [[1, 5]]}, TypeError,
     "pass either prompts or input_ids, not both"),
    ({}, TypeError, "prompts must be a string or a list of strings, got None; or give "
                    "token ids as input_ids="),
    ({"input_ids": [[1, 5], []]}, ValueError, "input_ids[1] is empty"),
    ({"input_ids": [[1, 5.0]]}, TypeError, "input_ids[0][1] is float"),
    ({"input_ids": [[1, 5], (1, True)]}, TypeError, "input_ids[1][1] is bool"),
    ({"input_ids": [[1, 5], [np.int64(7), 3.5]]}, TypeError, "input_ids[1][1] is float"),
    # One prompt's flat row (or 1-D tensor) with a bad id: that id is named, not
    # the good first one as a prompt that should have been a list.
    ({"input_ids": [1, 5, 2.5]}, TypeError, "input_ids[0][2] is float (2.5)"),
    ({"input_ids": [1, 5, None]}, TypeError, "input_ids[0][2] is NoneType (None)"),
    ({"input_ids": torch.tensor([1, 5, 6]).float()}, TypeError, "input_ids[0][0] is float"),
    ({"input_ids": [[1, -2]]}, ValueError, "input_ids[0][1] is -2"),
    ({"input_ids": [[1, 64]]}, ValueError, "input_ids[0][1] is 64; token ids of this model "
                                           "are [0, 64)"),
    ({"input_ids": "w1 w2"}, TypeError, "input_ids must be a list of token-id lists"),
    ({"input_ids": [["w1"]]}, TypeError, "input_ids[0][0] is str"),
    ({"input_ids": []}, ValueError, "input_ids is empty"),
    ({"prompts": [[1, 2]]}, TypeError, "pass token ids as input_ids="),
])
@pytest.mark.parametrize("call", ["generate", "prompt_activations"])
def test_bad_prompt_arguments_are_named(probed, kwargs, error, fragment, call):
    with pytest.raises(error) as caught:
        getattr(probed, call)(**kwargs)
    assert fragment in str(caught.value)


def test_stream_takes_one_prompt_or_one_row_of_input_ids(probed):
    with pytest.raises(TypeError, match="pass either prompts or input_ids, not both"):
        list(probed.stream(PROMPTS[0], input_ids=[1, 5]))
    with pytest.raises(TypeError, match="stream\\(\\) takes one prompt string, got NoneType"):
        list(probed.stream())
    with pytest.raises(ValueError, match="stream\\(\\) takes one prompt, got 2 rows"):
        list(probed.stream(input_ids=[[1, 5], [1, 6]]))
    with pytest.raises(TypeError, match=r"^input_ids\[0\]\[2\] is float \(2.5\)"):
        list(probed.stream(input_ids=[1, 5, 2.5]))
