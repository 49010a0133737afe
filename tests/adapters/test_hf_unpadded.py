"""The generation_config settings that read a row's earlier tokens apply to each
prompt of a left-padded batch as to that prompt alone (the oracle: plain
``generate()`` on the unpadded prompt), and a batch without padding stays
token-identical to plain ``generate()``."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import build_model, build_tokenizer

from undercurrent import ProbedModel
from undercurrent.adapters.base import SamplingParams
from undercurrent.adapters.hf.unpadded import unpadded_settings

NEW_TOKENS = 8
#: A short prompt batched with a longer one: its row is left-padded.
SHORT, LONG = "w45", "w1 w2 w3 w4 w5 w6 w7 w8 w9"

#: Each setting generate() reads the earlier tokens for, at a value that changes the
#: tiny model's greedy tokens.
SETTINGS = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 5.0},
    {"min_length": 8},
    {"encoder_repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 1},
    {"encoder_no_repeat_ngram_size": 1},
    {"sequence_bias": {(2, 2): 5.0, (45,): 3.0}},
    {"bad_words_ids": [[2, 31]]},
]


def llama_without_pad_token(**settings):
    """The tiny llama, its tokenizer without a pad token (as Llama's and Mistral's:
    the backend pads with the eos id), its generation config with ``settings``."""
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    model = copy.deepcopy(build_model("llama", eos=True))
    model.generation_config.pad_token_id = None
    for name, value in settings.items():
        setattr(model.generation_config, name, value)
    return model, tokenizer


def plain_generate(backend, input_ids, attention_mask):
    """Each row's new tokens from plain generate() on the batch, to its eos."""
    with torch.no_grad():
        out = backend.model.generate(
            input_ids, attention_mask=attention_mask,
            **backend.sampling_kwargs(SamplingParams(max_new_tokens=NEW_TOKENS)))
    rows = []
    for tokens in out[:, input_ids.shape[1]:].tolist():
        ends = [i for i, token in enumerate(tokens) if token in backend.eos_token_ids]
        rows.append(tuple(tokens[:ends[0] + 1] if ends else tokens))
    return rows


def alone(probed, prompt):
    """The oracle: plain generate() on ``prompt`` alone, its new tokens to the eos."""
    ids = torch.tensor([probed.backend.encode(prompt)])
    return plain_generate(probed.backend, ids, torch.ones_like(ids))[0]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: next(iter(s)))
def test_a_padded_rows_tokens_are_the_prompts_alone(settings):
    # (the pad id, the eos here, was penalised, counted and matched in a padded row:
    # the short prompt ran past its eos when batched with the long one)
    model, tokenizer = llama_without_pad_token(**settings)
    with ProbedModel(model, tokenizer, spec=None) as probed:
        assert probed.backend.pad_token_id in probed.backend.eos_token_ids
        batched = probed.generate([LONG, SHORT], max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in batched] == [alone(probed, LONG), alone(probed, SHORT)]
        # (the same prompt, first in its batch, and alone)
        assert probed.generate([SHORT, LONG], max_new_tokens=NEW_TOKENS)[0].token_ids == (
            batched[1].token_ids)
        assert probed.generate([SHORT], max_new_tokens=NEW_TOKENS)[0].token_ids == (
            batched[1].token_ids)


def test_the_padding_changes_a_setting_s_tokens_in_plain_generate():
    # The case the test above guards: plain generate() on the padded batch gives the
    # short prompt other tokens than alone (else the test above proves nothing).
    model, tokenizer = llama_without_pad_token(repetition_penalty=1.3)
    with ProbedModel(model, tokenizer, spec=None) as probed:
        backend = probed.backend
        padded = plain_generate(backend, *backend._left_padded([backend.encode(LONG),
                                                                 backend.encode(SHORT)]))
        assert padded[1] != alone(probed, SHORT)


def test_a_batch_without_padding_is_left_to_plain_generate():
    model, tokenizer = llama_without_pad_token(repetition_penalty=1.3, min_length=9,
                                               no_repeat_ngram_size=2)
    prompts = ["w1 w2 w3", "w45 w7 w8"]
    with ProbedModel(model, tokenizer, spec=None) as probed:
        backend = probed.backend
        input_ids, attention_mask = backend._left_padded([backend.encode(p) for p in prompts])
        assert unpadded_settings(model.generation_config, input_ids, attention_mask, [2]) == (
            {}, None)
        outputs = probed.generate(prompts, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outputs] == plain_generate(backend, input_ids,
                                                                attention_mask)


def test_min_new_tokens_replaces_min_length_as_in_generate():
    # (generate() then counts new tokens, the same in every row: nothing to move)
    model, _ = llama_without_pad_token(min_length=30, min_new_tokens=2)
    input_ids = torch.tensor([[2, 2, 1, 5], [1, 5, 6, 7]])
    off, processor = unpadded_settings(model.generation_config, input_ids,
                                       (input_ids != 2).long(), [2])
    assert (off, processor) == ({}, None)
