"""The model's ``generation_config`` on the vLLM backend, applied as the HF backend
applies it.

The HF backend runs transformers' ``generate()``, which applies the model's
generation config (docs/hf.md): ``repetition_penalty``, ``min_new_tokens``, and when
sampling ``min_p``, ... (the call's own temperature, ``top_p``, ``top_k`` and
``max_new_tokens`` replace the config's). Plain vLLM applies a few of them, as
defaults a request's own parameters replace; the backend passes every request its
parameters, so it applies them itself (:meth:`GenerationSettings.sampling_kwargs`),
and refuses a setting vLLM's sampling cannot express rather than give other tokens
than the HF backend, silently.

Read from the engine's model config once, when the engine loads (vLLM's
``generation_config`` engine argument chooses where from; ``"vllm"``: none of its
sampling settings; ``override_generation_config`` replaces settings).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from undercurrent.adapters.base import BackendError, SamplingParams
from undercurrent.adapters.generation_config import other_decoding


def _set(value: Any) -> bool:
    """Set to something that acts (an empty list bans or biases nothing)."""
    return value is not None and not (isinstance(value, list | tuple | dict) and not value)


def _positive(value: Any) -> bool:
    return value is not None and value > 0


def _cutoff(value: Any) -> bool:
    return value is not None and 0 < value < 1


#: Settings that change tokens under greedy and sampling alike and that vLLM's
#: sampling cannot express: (whether a value is on, the value that turns it off,
#: what it does).
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], Any, str]] = {
    "no_repeat_ngram_size": (_positive, 0, "bans repeated n-grams"),
    "encoder_repetition_penalty": (lambda value: value is not None and value != 1, 1.0,
                                   "penalises the prompt's tokens, a decoder-only model's "
                                   "input"),
    "encoder_no_repeat_ngram_size": (_positive, 0, "bans the prompt's n-grams"),
    "bad_words_ids": (_set, None, "bans token sequences"),
    "sequence_bias": (_set, None, "biases token sequences"),
    "min_length": (_positive, 0, "bars the eos below a length counted with the prompt"),
    "forced_bos_token_id": (_set, None, "forces the first token"),
    "forced_eos_token_id": (_set, None, "forces the eos as the last token"),
    "exponential_decay_length_penalty": (_set, None, "raises the eos with the length"),
    "suppress_tokens": (_set, None, "bans tokens"),
    "begin_suppress_tokens": (_set, None, "bans tokens at the first step"),
    "watermarking_config": (_set, None, "watermarks the sampled tokens"),
    "max_time": (_set, None, "ends generation after a time"),
}

#: The same, for settings that apply only when sampling (transformers' warpers).
_UNSUPPORTED_WHEN_SAMPLING: dict[str, tuple[Callable[[Any], bool], Any, str]] = {
    "typical_p": (lambda value: value is not None and value < 1, 1.0, "typical sampling"),
    "epsilon_cutoff": (_cutoff, 0.0, "epsilon sampling"),
    "eta_cutoff": (_cutoff, 0.0, "eta sampling"),
    "top_h": (_set, None, "top-H sampling"),
}


def _refusal(name: str, value: Any, what: str, off: Any, why: str) -> str:
    return (f"the model's generation_config sets {name}={value!r} ({what}), which the "
            f"vllm backend cannot apply as transformers' generate() does ({why}), so its "
            "tokens would differ from the hf backend's; use backend='hf', or load the "
            f"engine with override_generation_config={{{name!r}: {off!r}}}")


def engine_generation_config(model_config: Any) -> dict[str, Any]:
    """The generation config settings (those not at transformers' defaults) of the
    engine with vLLM model config ``model_config``, as vLLM reads them."""
    fields = dict(model_config.try_get_generation_config())
    if model_config.generation_config == "vllm":  # (vLLM's neutral sampling defaults)
        fields = {name: value for name, value in fields.items() if name == "eos_token_id"}
    fields.update(model_config.override_generation_config or {})
    return fields


@dataclass(frozen=True)
class GenerationSettings:
    """What of the model's generation config a request's vLLM sampling parameters
    carry (build it with :func:`generation_settings`)."""

    always: Mapping[str, Any] = field(default_factory=dict)
    """vLLM ``SamplingParams`` arguments for every request (``repetition_penalty``)."""
    min_new_tokens: int = 0
    """Tokens before an eos may end a request (vLLM's ``min_tokens``, at most the
    call's ``max_new_tokens``)."""
    when_sampling: Mapping[str, Any] = field(default_factory=dict)
    """Arguments for a sampling request only (``min_p``)."""
    sampling_refusals: tuple[str, ...] = ()
    """Why a sampling call is refused (settings that apply only when sampling)."""
    eos_token_ids: frozenset[int] = frozenset()
    """The ids that end a request: the generation config's ``eos_token_id``, else the
    tokenizer's eos (the HF backend's, as ``generate()`` reads them)."""

    def sampling_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """vLLM ``SamplingParams`` arguments for a request of a call with ``params``."""
        # vLLM would stop on the tokenizer's eos too, where generate() stops on the
        # generation config's ids alone: the request stops on these ids only
        # (finish_reason "stop", stop_reason the id; min_tokens holds them back).
        kwargs: dict[str, Any] = {**self.always, "ignore_eos": True,
                                  "stop_token_ids": sorted(self.eos_token_ids)}
        if self.min_new_tokens:
            kwargs["min_tokens"] = min(self.min_new_tokens, params.max_new_tokens)
        if params.greedy:
            return kwargs
        if self.sampling_refusals:
            raise BackendError(self.sampling_refusals[0])
        min_p = self.when_sampling.get("min_p")
        if min_p is not None and (params.top_p < 1 or params.top_k is not None):
            # (vLLM keeps the tokens above min_p before top_p/top_k keep theirs,
            # transformers after: the tokens kept differ)
            raise BackendError(
                f"the model's generation_config sets min_p={min_p!r}, which vLLM applies "
                "before top_p and top_k and transformers' generate() after them, so the "
                "tokens a call with top_p < 1 or top_k may sample differ from the hf "
                "backend's; call with top_p=1.0 and no top_k, use backend='hf', or load "
                "the engine with override_generation_config={'min_p': None}")
        kwargs.update(self.when_sampling)
        return kwargs


def generation_settings(fields: Mapping[str, Any],
                        tokenizer_eos: int | None = None) -> GenerationSettings:
    """The :class:`GenerationSettings` of a generation config's settings ``fields``
    (:func:`engine_generation_config`) for a model whose tokenizer's eos id is
    ``tokenizer_eos``; a setting vLLM cannot apply at all is a ``BackendError``
    naming it, one that applies only when sampling refuses sampling calls."""
    other = other_decoding(fields.get)
    if other is not None:
        name, value, what, off = other
        raise BackendError(_refusal(name, value, what, off, "undercurrent decodes one "
                                    "sequence per prompt, one token per forward pass"))
    stop_strings = fields.get("stop_strings")
    if stop_strings is not None:
        raise BackendError(
            f"the model's generation_config sets stop_strings={stop_strings!r}, which "
            "undercurrent does not read: pass them to the call as stop= (matched and cut "
            "from the text by undercurrent) and load the engine with "
            "override_generation_config={'stop_strings': None}")
    for name, (on, off, what) in _UNSUPPORTED.items():
        value = fields.get(name)
        if on(value):
            raise BackendError(_refusal(name, value, what, off,
                                        "vLLM's sampling has no such setting"))
    refusals = tuple(
        _refusal(name, fields[name], what, off, "vLLM's sampling has no such setting")
        + " (greedy calls are unaffected)"
        for name, (on, off, what) in _UNSUPPORTED_WHEN_SAMPLING.items() if on(fields.get(name)))
    eos = fields.get("eos_token_id")
    if eos is None:
        eos = tokenizer_eos
    eos_ids = frozenset(int(i) for i in (eos if isinstance(eos, (list, tuple)) else
                                         ([] if eos is None else [eos])))
    min_new_tokens = int(fields.get("min_new_tokens") or 0)
    if min_new_tokens and tokenizer_eos is not None and tokenizer_eos not in eos_ids:
        # (vLLM's min_tokens holds back the tokenizer's eos whatever the request says)
        raise BackendError(
            f"the model's generation_config sets min_new_tokens={min_new_tokens}, and its "
            f"tokenizer's eos id {tokenizer_eos} is not among its eos_token_id "
            f"{sorted(eos_ids)}: generate() holds back only those for the first "
            f"{min_new_tokens} tokens, vLLM the tokenizer's eos as well, so the vllm "
            "backend's tokens could differ from the hf backend's; use backend='hf', or "
            "load the engine with override_generation_config={'min_new_tokens': 0}")
    always = {}
    penalty = fields.get("repetition_penalty")
    if penalty is not None and penalty != 1.0:
        always["repetition_penalty"] = float(penalty)
    min_p = fields.get("min_p")
    return GenerationSettings(
        always=always, min_new_tokens=min_new_tokens,
        when_sampling={"min_p": float(min_p)} if min_p else {},  # (0: keeps every token)
        sampling_refusals=refusals, eos_token_ids=eos_ids)
