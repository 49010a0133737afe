"""Settings of the engine and the model the vLLM backend sets or reads: the CPU KV
cache size (``kv_cache_gib``), prefix caching as the engine resolved it, the
model's generation config (applied as the HF backend's generate() applies it). One
engine for the whole file, on a copy of the test model with its own generation
config, and one on a copy whose tokenizer's eos is not its generation config's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from vllm_engine_helpers import prompts

from undercurrent.adapters.base import BackendError
from undercurrent.adapters.capabilities import CapabilityError
from undercurrent.api import ProbedModel

GIB = 1 << 30

NEW_TOKENS = 16

#: Settings generate() applies that vLLM's own defaults leave out (min_new_tokens)
#: or that the backend's requests replaced (repetition_penalty): each changes the
#: test model's greedy tokens.
GENERATION_SETTINGS = {"repetition_penalty": 3.0, "min_new_tokens": 9}


def model_with_generation_config(model_dir, folder, **settings):
    """A copy of the test model in ``folder`` whose generation config adds ``settings``."""
    shutil.copytree(model_dir, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **settings}))
    return str(folder)


@pytest.fixture(scope="module")
def settings_model(model_dir, tmp_path_factory):
    """A copy of the test model with :data:`GENERATION_SETTINGS` and no pad token, as
    Llama's and Mistral's checkpoints: the hf backend left-pads with the eos id."""
    folder = model_with_generation_config(model_dir, tmp_path_factory.mktemp("m") / "model",
                                          **GENERATION_SETTINGS)
    for name, key in (("tokenizer_config.json", "pad_token"),
                      ("generation_config.json", "pad_token_id")):
        path = os.path.join(folder, name)
        with open(path) as file:
            config = json.load(file)
        config.pop(key, None)
        with open(path, "w") as file:
            json.dump(config, file)
    return folder


@pytest.fixture(scope="module")
def hf_outputs(settings_model):
    # The oracle runs before vLLM is imported in this process.
    with ProbedModel.from_pretrained(settings_model, dtype="float32") as hf:
        assert hf.backend.pad_token_id in hf.backend.eos_token_ids
        return hf.generate(prompts(), max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def alone_tokens(settings_model):
    """Each prompt's new tokens (to its eos) from plain generate() on it alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings_model)
    model = AutoModelForCausalLM.from_pretrained(settings_model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    tokens = []
    for prompt in prompts():
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=eos)[0, ids.shape[1]:]
        new = out.tolist()
        tokens.append(tuple(new[:new.index(eos) + 1] if eos in new else new))
    return tokens


@pytest.fixture(scope="module")
def eos_model(model_dir, tmp_path_factory):
    """``(copy of the test model whose tokenizer's eos is the first token it generates
    after prompts()[0], outside its generation config's eos_token_id, the hf
    backend's outputs on it)``."""
    from transformers import AutoTokenizer

    with ProbedModel.from_pretrained(model_dir, dtype="float32") as hf:
        first = hf.generate(prompts()[0], max_new_tokens=1)[0].token_ids[0]
        assert first not in hf.backend.eos_token_ids
    folder = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(model_dir, folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["eos_token"] = AutoTokenizer.from_pretrained(model_dir).convert_ids_to_tokens(first)
    path.write_text(json.dumps(config))
    with ProbedModel.from_pretrained(str(folder), dtype="float32") as hf:
        assert hf.backend.tokenizer.eos_token_id == first
        return str(folder), hf.generate(prompts(), max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def model(settings_model, hf_outputs, alone_tokens, eos_model):
    before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    with ProbedModel.from_pretrained(settings_model, backend="vllm", dtype="float32",
                                     max_model_len=128, kv_cache_gib=2.0,
                                     enable_prefix_caching=None) as loaded:
        # kv_cache_gib sized this engine only: an engine loaded later in the process
        # without it gets the process's size (it got 2 GiB, and after a refused
        # kv_cache_gib every later load failed the same way).
        assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == before
        yield loaded


def test_kv_cache_gib_is_whole_gib_a_float_included(model, model_dir):
    # (vLLM reads VLLM_CPU_KVCACHE_SPACE with int(): "2.0" failed deep in its config)
    assert model.backend.engine.vllm_config.cache_config.kv_cache_memory_bytes == 2 * GIB
    from undercurrent.adapters.vllm.backend import VLLMBackend

    with pytest.raises(ValueError, match="kv_cache_gib must be a whole number of GiB, at "
                                         "least 1 .* got 0.5"):
        VLLMBackend.from_pretrained(model_dir, kv_cache_gib=0.5)


def test_prefix_caching_is_read_from_the_engine(model):
    # None is vLLM's own default, "on": the backend took it for off, so a prompt
    # point went unrefused and its records went missing on a cache hit.
    assert model.backend.engine.vllm_config.cache_config.enable_prefix_caching
    assert model.backend.prefix_caching is True
    with pytest.raises(CapabilityError, match="position prompt\\[0\\] can select prompt "
                                              "tokens, but this vLLM engine has prefix caching"):
        ProbedModel(model.backend, spec={"extraction_points": [{
            "name": "first", "layers": [0], "tensor_type": "residual_stream",
            "position": "prompt[0]", "probe_type": "norm_probe",
            "probe_kind": "single_shot"}]})


def test_the_models_generation_config_applies_as_on_the_hf_backend(model, hf_outputs):
    # (the backend's requests dropped it: other tokens than the hf backend's, silently)
    outputs = model.generate(prompts(), max_new_tokens=NEW_TOKENS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in hf_outputs]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in hf_outputs]
    assert min(len(o.token_ids) for o in outputs) >= GENERATION_SETTINGS["min_new_tokens"]


def test_each_prompt_gets_its_tokens_alone_on_both_backends(model, hf_outputs, alone_tokens):
    # The hf backend left-pads the batch with the eos id: generate()'s
    # repetition_penalty penalised it in the padded rows, which ran past the eos
    # they end on alone (and on vLLM, which pads nothing).
    assert [o.token_ids for o in hf_outputs] == alone_tokens
    outputs = model.generate(prompts(), max_new_tokens=NEW_TOKENS)
    assert [o.token_ids for o in outputs] == alone_tokens


def test_a_generation_setting_vllm_cannot_apply_is_refused_before_the_engine_starts(
        model_dir, tmp_path):
    from undercurrent.adapters.vllm.backend import VLLMBackend

    path = model_with_generation_config(model_dir, tmp_path / "model", no_repeat_ngram_size=3)
    with pytest.raises(BackendError, match="generation_config sets no_repeat_ngram_size=3 "
                                           ".*override_generation_config="):
        VLLMBackend.from_pretrained(path, max_model_len=128)
    # (the engine argument that turns it off)
    with pytest.raises(BackendError, match="generation_config sets no_repeat_ngram_size=2"):
        VLLMBackend.from_pretrained(path, max_model_len=128,
                                    override_generation_config={"no_repeat_ngram_size": 2})


def test_a_request_ends_on_the_hf_backends_eos_ids_alone(model, eos_model):
    # The tokenizer's eos is not among the generation config's eos_token_id: the hf
    # backend (as generate()) stops on the latter alone, the engine stopped on the
    # tokenizer's as well (at prompt 0's first token here).
    path, hf_outputs = eos_model
    with ProbedModel.from_pretrained(path, backend="vllm", dtype="float32",
                                     max_model_len=128) as loaded:
        assert loaded.backend.eos_token_ids == model.backend.eos_token_ids
        outputs = loaded.generate(prompts(), max_new_tokens=NEW_TOKENS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in hf_outputs]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in hf_outputs]
    assert "eos" in {o.finish_reason for o in outputs}  # (the config's eos ends some)
