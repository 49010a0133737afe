"""The context-length refusal both backends give before anything runs: a prompt
that cannot fit the model's context with ``max_new_tokens`` after it, with advice
that works for the call that was made (``generate``/``stream``, or
``prompt_activations``, which takes no ``max_new_tokens``)."""

from __future__ import annotations

from undercurrent.adapters.base import SamplingParams


def positions_needed(prompt_len: int, params: SamplingParams, *,
                     counts_sampled: bool = False) -> int:
    """Positions a ``prompt_len``-token prompt needs under ``params``.

    The model is fed the prompt, then every generated token but the last (which
    is sampled and never fed back) unless ``capture_last_token`` runs the extra
    forward that feeds it too. ``counts_sampled``: the limit counts every sampled
    token, the last one too (vLLM's ``max_model_len`` does; a Hugging Face
    model's position table counts only what it is fed)."""
    extra = int(params.capture_last_token) + int(counts_sampled)
    return prompt_len + params.max_new_tokens - 1 + extra


def context_problem(prompt_len: int, params: SamplingParams, limit: int, *,
                    counts_sampled: bool = False) -> str | None:
    """Why a ``prompt_len``-token prompt cannot run under ``params`` in a
    ``limit``-position context (None when it can): the sentence after
    ``"prompt {index} "``, ending with the tightest advice that works.

    ``counts_sampled`` is vLLM's count (see :func:`positions_needed`), and its
    wording (``max_model_len``). For ``params.prompt_only`` (the call is
    ``prompt_activations``) the only advice is a shorter prompt, and
    ``max_new_tokens`` is not named: that call does not take it."""
    needed = positions_needed(prompt_len, params, counts_sampled=counts_sampled)
    if needed <= limit:
        return None
    context = (f"the engine's max_model_len is {limit}" if counts_sampled else
               f"the model's context is {limit}")
    if params.prompt_only:
        longest = limit - positions_needed(0, params, counts_sampled=counts_sampled)
        why = (f"; vLLM needs {needed} tokens of room (it samples one token after the "
               "prompt's forward pass, and counts it)" if counts_sampled else "")
        return (f"has {prompt_len} tokens{why} but {context}: shorten the prompt to at most "
                f"{longest} tokens")
    room = limit - positions_needed(prompt_len, _one_token(params),
                                    counts_sampled=counts_sampled) + 1
    if room >= 1:
        fix = f"use max_new_tokens <= {room}"
    else:
        longest = limit - positions_needed(0, params, counts_sampled=counts_sampled)
        one_token = limit - positions_needed(0, _one_token(params),
                                             counts_sampled=counts_sampled)
        fix = (f"shorten the prompt to at most {longest} tokens" if longest >= 1 else
               f"shorten the prompt to at most {one_token} tokens and use max_new_tokens=1")
    if counts_sampled:
        count = (f"vLLM needs {needed} tokens of room (it counts the last sampled token"
                 + (", and capture_last_token replays the sequence"
                    if params.capture_last_token else "") + ")")
    else:
        count = f"the model is fed {needed} positions (" + (
            "capture_last_token feeds the last generated token too"
            if params.capture_last_token else "the last generated token is never fed back") + ")"
    return (f"has {prompt_len} tokens; with max_new_tokens={params.max_new_tokens} {count} "
            f"but {context}: {fix}")


def _one_token(params: SamplingParams) -> SamplingParams:
    return SamplingParams(max_new_tokens=1, capture_last_token=params.capture_last_token)
