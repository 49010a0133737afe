"""Architecture errors: one type for both backends, raised when the backend is built
or a point is registered, never from a hook while the model generates."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import CONFIGS, build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent.adapters import (  # noqa: E402
    BackendError,
    CapabilityError,
    UnsupportedArchitectureError,
)
from undercurrent.adapters.hf.architectures import (  # noqa: E402
    UnsupportedArchitectureError as HFArchitectureError,
)
from undercurrent.adapters.hf.backend import HFBackend  # noqa: E402
from undercurrent.adapters.vllm import layout  # noqa: E402
from undercurrent.api import ProbedModel  # noqa: E402
from undercurrent.errors import ProblemsError  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, TensorType  # noqa: E402


def test_both_backends_raise_the_one_architecture_error():
    assert HFArchitectureError is UnsupportedArchitectureError
    assert issubclass(UnsupportedArchitectureError, CapabilityError)
    assert issubclass(UnsupportedArchitectureError, ProblemsError)

    class MambaForCausalLM:
        config = types.SimpleNamespace(model_type="mamba")

    with pytest.raises(UnsupportedArchitectureError) as hf:
        HFBackend(MambaForCausalLM(), build_tokenizer())
    assert "'mamba'" in str(hf.value)
    assert hf.value.errors() == [{"loc": (), "msg": str(hf.value), "type": "architecture"}]

    # A vLLM model class whose decoder layers cannot be found, and one whose layers
    # have no MLP block: the same error, from the layout lookup at engine start.
    with pytest.raises(UnsupportedArchitectureError, match="cannot find the decoder layers"):
        layout.locate(types.SimpleNamespace())
    layerless = types.SimpleNamespace(model=types.SimpleNamespace(
        layers=[types.SimpleNamespace(self_attn=object())]))
    with pytest.raises(UnsupportedArchitectureError, match="layer 0 has no MLP block"):
        layout.locate(layerless)
    # A class of vLLM's Transformers modeling backend, with layers where a native
    # model has them: refused all the same (tests/vllm/engine/test_vllm_refusals.py
    # loads one).
    wrapped = type("TransformersForCausalLM", (), {
        "__module__": "vllm.model_executor.models.transformers"})()
    wrapped.model = types.SimpleNamespace(layers=[types.SimpleNamespace(
        self_attn=object(), mlp=object())])
    with pytest.raises(UnsupportedArchitectureError, match="Transformers modeling backend"):
        layout.locate(wrapped)
    # A native vLLM class of a family the table lacks (tests/vllm/engine/
    # test_vllm_refusals.py loads one): its layers are found, but how they return
    # the residual stream is not known, so it is refused as the HF backend refuses it.
    stablelm = type("StablelmForCausalLM", (), {})()
    stablelm.config = types.SimpleNamespace(model_type="stablelm")
    stablelm.model = wrapped.model
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"'StablelmForCausalLM' \(config.model_type='stablelm'\) is not a "
                             "family in undercurrent's architecture table"):
        layout.locate(stablelm)
    stablelm.config.model_type = "llama"
    assert layout.locate(stablelm).num_layers == 1
    # vLLM reads a Mistral checkpoint's params.json (as mistralai's repos ship it)
    # with model_type "transformer" and runs it with its Mistral class, whose layers
    # are the table's: it was refused
    mistral = type("MistralForCausalLM", (), {})()
    mistral.config = types.SimpleNamespace(model_type="transformer")
    mistral.model = wrapped.model
    assert layout.locate(mistral).num_layers == 1


class _OpaqueCache:
    """Forwards every call to the real cache but is not a transformers ``Cache``: the
    decoder layers still cache, yet no cache object reaches them that kv could read."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _hide_the_cache(model):
    from transformers.cache_utils import Cache

    def pre_hook(module, args, kwargs):
        kwargs = {key: _OpaqueCache(value) if isinstance(value, Cache) else value
                  for key, value in kwargs.items()}
        return args, kwargs

    for layer in model.model.layers:
        layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return model


def _point(name, tensor_type):
    return ExtractionPoint(name=name, layers=[1], tensor_type=tensor_type,
                           position="generated[*]", probe_type="capture",
                           probe_kind="single_shot")


def test_kv_without_a_cache_object_is_refused_at_construction_not_mid_generation():
    tokenizer = build_tokenizer()
    model = _hide_the_cache(build_model.__wrapped__("llama"))
    with pytest.raises(CapabilityError) as refused:
        ProbedModel(model, tokenizer, spec=[_point("keys", TensorType.KV)])
    message = str(refused.value)
    assert "'keys'" in message and "'kv'" in message and "no cache object" in message
    assert refused.value.errors()[0]["loc"] == ("extraction_points", 0, "tensor_type")

    # The same model serves every other tensor type, and its generation is untouched
    # by the check (same tokens as on a model the check never ran on).
    with ProbedModel(model, tokenizer, spec=[_point("resid", TensorType.RESIDUAL_STREAM)]) as pm:
        assert not pm.capabilities().supports(TensorType.KV)
        out = pm.generate([prompt(3, 4, 5)], max_new_tokens=4, records=True)[0]
    with ProbedModel(build_model.__wrapped__("llama"), tokenizer) as reference:
        assert reference.capabilities().supports(TensorType.KV)
        expected = reference.generate([prompt(3, 4, 5)], max_new_tokens=4)[0]
    assert out.token_ids == expected.token_ids
    assert [r.generated_index for r in out.records] == [0, 1, 2]


def test_kv_is_read_when_the_cache_reaches_the_layers():
    tokenizer = build_tokenizer()
    with ProbedModel(build_model.__wrapped__("llama"), tokenizer,
                     spec=[_point("keys", TensorType.KV)]) as pm:
        out = pm.generate([prompt(3, 4, 5)], max_new_tokens=3, records=True)[0]
    assert [r.tensor_type for r in out.records] == [TensorType.KV] * 2


def test_every_architecture_in_the_table_passes_the_kv_check():
    tokenizer = build_tokenizer()
    for model_type in sorted(CONFIGS):
        backend = HFBackend(build_model(model_type), tokenizer)
        assert backend.hooks.kv_cache_problem() is None, model_type
        assert backend.capabilities().supports(TensorType.KV), model_type


def _config(model_type, **fields):
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, vocab_size=64, pad_token_id=0, **fields)


@pytest.mark.parametrize("model_class", ["LlamaForSequenceClassification", "LlamaModel"])
def test_a_model_that_cannot_generate_is_refused_naming_the_class_to_load(model_class):
    # (a raw AttributeError on generation_config, or a table path it has no attribute for)
    import transformers
    model = getattr(transformers, model_class)(_config("llama", **CONFIGS["llama"])).eval()
    with pytest.raises(BackendError, match=f"{model_class} cannot generate text: the hf backend "
                                           r"needs a \*ForCausalLM model .* AutoModelForCausalLM"):
        ProbedModel(model, build_tokenizer())


@pytest.mark.parametrize("fields, message", [
    (dict(do_layer_norm_before=False),
     r"post-LN OPT \(config.do_layer_norm_before=False, as facebook/opt-350m\) is not supported"),
    (dict(_remove_final_layer_norm=True),
     r"OPT without its final layer norm \(config._remove_final_layer_norm=True\)"),
])
def test_opt_without_the_pre_ln_layout_is_refused_saying_which_variant(fields, message):
    from transformers import OPTForCausalLM
    model = OPTForCausalLM(_config("opt", **{**CONFIGS["opt"], **fields})).eval()
    with pytest.raises(UnsupportedArchitectureError, match=message):
        ProbedModel(model, build_tokenizer())


def test_a_multimodal_wrapper_is_refused_naming_the_text_model_to_load():
    from transformers import AutoModelForCausalLM
    config = _config("gemma3", text_config=dict(CONFIGS["gemma3_text"], vocab_size=64),
                     vision_config=dict(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        image_size=28, patch_size=14),
                     mm_tokens_per_image=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"Gemma3ForConditionalGeneration is a multimodal wrapper "
                             r"\(config.model_type='gemma3'\) around a 'gemma3_text' language "
                             r"model; .* load the text model with Gemma3ForCausalLM"):
        ProbedModel(model, build_tokenizer())


@pytest.mark.parametrize("model_type, fields, parallel", [
    ("gpt_neox", {}, True),
    ("gpt_neox", dict(use_parallel_residual=False), False),
    ("falcon", {}, True),
    ("falcon", dict(parallel_attn=False, alibi=True, multi_query=False), False),
    ("gptj", {}, True),
    ("llama", {}, False),
])
def test_the_parallel_block_note_follows_the_models_config(model_type, fields, parallel):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(
        _config(model_type, **{**CONFIGS[model_type], **fields})).eval()
    notes = HFBackend(model, build_tokenizer()).capabilities().notes
    assert ("parallel attention and MLP" in notes.get("_table", "")) is parallel
