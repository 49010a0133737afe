"""The context-length refusal (no engine needed): its advice, followed, gives a call
that fits, and it speaks of the call that was made: ``prompt_activations`` takes no
``max_new_tokens``, so its refusal never tells the user to set one."""

from __future__ import annotations

import itertools
import re

import pytest

from undercurrent.adapters.base import SamplingParams
from undercurrent.adapters.context import context_problem

LIMIT = 16
PROMPT_ONLY = SamplingParams(max_new_tokens=1, prompt_only=True)


def fits(prompt_len: int, params: SamplingParams, counts_sampled: bool) -> bool:
    """The oracle: HF feeds the prompt and every generated token but the last
    (capture_last_token: that one too); vLLM counts every sampled token."""
    fed = prompt_len + params.max_new_tokens - 1 + params.capture_last_token
    return fed + counts_sampled <= LIMIT


@pytest.mark.parametrize("counts_sampled", [False, True], ids=["hf", "vllm"])
def test_a_prompt_activations_refusal_advises_a_shorter_prompt_not_max_new_tokens(
        counts_sampled):
    # (vLLM's said "shorten the prompt to at most 15 tokens and use max_new_tokens=1",
    # an argument prompt_activations does not take)
    longest = LIMIT - counts_sampled
    problem = context_problem(longest + 1, PROMPT_ONLY, LIMIT, counts_sampled=counts_sampled)
    assert problem is not None and "max_new_tokens" not in problem
    assert problem.endswith(f": shorten the prompt to at most {longest} tokens"), problem
    assert context_problem(longest, PROMPT_ONLY, LIMIT, counts_sampled=counts_sampled) is None
    assert fits(longest, PROMPT_ONLY, counts_sampled)
    assert not fits(longest + 1, PROMPT_ONLY, counts_sampled)


def test_the_generate_refusals_read_as_before():
    vllm = context_problem(252, SamplingParams(max_new_tokens=5), 256, counts_sampled=True)
    assert vllm == ("has 252 tokens; with max_new_tokens=5 vLLM needs 257 tokens of room (it "
                    "counts the last sampled token) but the engine's max_model_len is 256: use "
                    "max_new_tokens <= 4")
    hf = context_problem(75, SamplingParams(max_new_tokens=3), 64)
    assert hf == ("has 75 tokens; with max_new_tokens=3 the model is fed 77 positions (the last "
                  "generated token is never fed back) but the model's context is 64: shorten "
                  "the prompt to at most 62 tokens")


@pytest.mark.parametrize(("counts_sampled", "capture_last_token"),
                         list(itertools.product([False, True], repeat=2)))
def test_generate_advice_fits_when_followed_and_is_the_tightest(counts_sampled,
                                                                capture_last_token):
    for prompt_len, max_new_tokens in itertools.product(range(1, LIMIT + 4), range(1, LIMIT + 4)):
        params = SamplingParams(max_new_tokens=max_new_tokens,
                                capture_last_token=capture_last_token)
        problem = context_problem(prompt_len, params, LIMIT, counts_sampled=counts_sampled)
        assert (problem is None) == fits(prompt_len, params, counts_sampled)
        if problem is None:
            continue
        advice = problem.rsplit(": ", 1)[1]
        shorter = re.search(r"shorten the prompt to at most (\d+) tokens", advice)
        fewer = re.search(r"max_new_tokens(?: <= |=)(\d+)", advice)
        assert shorter or fewer, advice
        length = int(shorter.group(1)) if shorter else prompt_len
        tokens = int(fewer.group(1)) if fewer else max_new_tokens
        followed = SamplingParams(max_new_tokens=tokens, capture_last_token=capture_last_token)
        assert fits(length, followed, counts_sampled), (prompt_len, max_new_tokens, advice)
        if shorter and not fewer:
            assert not fits(length + 1, followed, counts_sampled)
        elif fewer and not shorter:
            assert not fits(length, SamplingParams(max_new_tokens=tokens + 1,
                                                   capture_last_token=capture_last_token),
                            counts_sampled)


def test_prompt_only_is_one_token_and_no_capture_last_token():
    for bad in ({"max_new_tokens": 2}, {"capture_last_token": True}):
        with pytest.raises(ValueError, match="prompt_only runs the prompt's forward pass"):
            SamplingParams(prompt_only=True, **{"max_new_tokens": 1, **bad})
