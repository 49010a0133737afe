"""The model's generation config on the vLLM backend: what each request applies, and
what is refused (no engine; tests/vllm/engine/test_vllm_engine_settings.py checks the
tokens against the hf backend's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from undercurrent.adapters.base import BackendError, SamplingParams
from undercurrent.adapters.vllm.generation import (
    engine_generation_config,
    generation_settings,
)

GREEDY = SamplingParams(max_new_tokens=8)
SAMPLING = SamplingParams(max_new_tokens=8, temperature=0.7)


def test_settings_generate_applies_reach_each_request():
    settings = generation_settings({"repetition_penalty": 1.05, "min_new_tokens": 12,
                                    "min_p": 0.1, "temperature": 0.6, "top_k": 20,
                                    "max_new_tokens": 512, "chat_format": "chatml",
                                    "eos_token_id": [7, 2]}, tokenizer_eos=2)
    # (min_tokens at most the call's max_new_tokens; min_p only when sampling; the
    # call's own temperature, top_k and max_new_tokens replace the config's)
    eos = {"ignore_eos": True, "stop_token_ids": [2, 7]}
    assert settings.sampling_kwargs(GREEDY) == {"repetition_penalty": 1.05, "min_tokens": 8,
                                                **eos}
    assert settings.sampling_kwargs(SAMPLING) == {"repetition_penalty": 1.05, "min_tokens": 8,
                                                  "min_p": 0.1, **eos}
    assert generation_settings({"repetition_penalty": 1.0}).sampling_kwargs(GREEDY) == {
        "ignore_eos": True, "stop_token_ids": []}


@pytest.mark.parametrize(("setting", "value"), [
    ("no_repeat_ngram_size", 3), ("bad_words_ids", [[5]]), ("min_length", 10),
    ("suppress_tokens", [4]), ("forced_eos_token_id", 2), ("sequence_bias", {(5,): 1.0}),
    ("num_beams", 4), ("guidance_scale", 1.5),
    # (transformers applies these to a decoder-only model's prompt: they were carried
    # into no request, so the tokens differed from the hf backend's)
    ("encoder_repetition_penalty", 5.0), ("encoder_no_repeat_ngram_size", 1)])
def test_a_setting_vllm_cannot_apply_is_refused_naming_it(setting, value):
    with pytest.raises(BackendError, match=f"generation_config sets {setting}="
                                           ".*override_generation_config="):
        generation_settings({setting: value})


@pytest.mark.parametrize(("setting", "off"), [
    ("no_repeat_ngram_size", 0), ("min_length", 0), ("num_beams", 1), ("guidance_scale", 1),
    ("encoder_repetition_penalty", 1.0), ("encoder_no_repeat_ngram_size", 0),
    ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("bad_words_ids", None),
    # (empty lists and min_p 0 act on nothing: they were refused)
    ("bad_words_ids", []), ("suppress_tokens", []), ("begin_suppress_tokens", []),
    ("min_p", 0.0)])
def test_a_setting_at_its_off_value_is_no_refusal(setting, off):
    for params in (SAMPLING, SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9)):
        assert generation_settings({setting: off}, 2).sampling_kwargs(params) == {
            "ignore_eos": True, "stop_token_ids": [2]}


def test_stop_strings_in_the_config_are_refused_pointing_at_stop():
    with pytest.raises(BackendError, match="stop_strings=.*pass them to the call as stop="):
        generation_settings({"stop_strings": ["\n\n"]})


def test_a_sampling_only_setting_refuses_sampling_calls_alone():
    settings = generation_settings({"typical_p": 0.9})
    assert "typical_p" not in settings.sampling_kwargs(GREEDY)
    with pytest.raises(BackendError, match="typical_p=0.9 .*greedy calls are unaffected"):
        settings.sampling_kwargs(SAMPLING)


def test_min_p_with_top_p_or_top_k_is_refused():
    # (vLLM keeps the tokens above min_p before top_p/top_k, transformers after)
    settings = generation_settings({"min_p": 0.1})
    for params in (SamplingParams(temperature=0.7, top_p=0.9),
                   SamplingParams(temperature=0.7, top_k=5)):
        with pytest.raises(BackendError, match="min_p=0.1, which vLLM applies before top_p"):
            settings.sampling_kwargs(params)


def test_the_engine_arguments_choose_the_settings():
    def model_config(source, override=None):
        return SimpleNamespace(
            generation_config=source, override_generation_config=override or {},
            try_get_generation_config=lambda: {"eos_token_id": [2, 7],
                                               "repetition_penalty": 1.2})

    assert engine_generation_config(model_config("auto")) == {
        "eos_token_id": [2, 7], "repetition_penalty": 1.2}
    # "vllm": vLLM's neutral sampling defaults (the eos ids stay the model's)
    assert engine_generation_config(model_config("vllm")) == {"eos_token_id": [2, 7]}
    assert engine_generation_config(model_config("auto", {"repetition_penalty": 1.0})) == {
        "eos_token_id": [2, 7], "repetition_penalty": 1.0}


def test_the_eos_ids_are_the_generation_configs_else_the_tokenizers():
    # (as generate() reads them on the hf backend: a tokenizer's eos outside the
    # config's ids ends no request)
    assert generation_settings({"eos_token_id": 2}, tokenizer_eos=38).eos_token_ids == {2}
    assert generation_settings({"eos_token_id": [2, 5]}, 2).eos_token_ids == {2, 5}
    assert generation_settings({}, tokenizer_eos=38).eos_token_ids == {38}
    assert generation_settings({}).eos_token_ids == frozenset()


def test_min_new_tokens_with_a_tokenizer_eos_outside_the_configs_is_refused():
    # (vLLM's min_tokens holds back the tokenizer's eos too, generate() does not)
    with pytest.raises(BackendError, match="min_new_tokens=4, and its tokenizer's eos id 38 "
                                           "is not among its eos_token_id \\[2\\]"):
        generation_settings({"min_new_tokens": 4, "eos_token_id": 2}, tokenizer_eos=38)
    assert generation_settings({"min_new_tokens": 4, "eos_token_id": [2, 38]},
                               38).min_new_tokens == 4
