"""The architecture table: every entry locates its capture sites on a tiny random
model built from a config, captures every tensor type at every layer, and agrees
with the model's own hidden states."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    CONFIGS,
    build_model,
    build_tokenizer,
    prompt,
    transformers_generate,
)

from undercurrent.adapters import CaptureSession, SamplingParams  # noqa: E402
from undercurrent.adapters.hf.architectures import (  # noqa: E402
    ARCHITECTURES,
    find_architecture,
    supported_model_types,
)
from undercurrent.adapters.hf.backend import HFBackend  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, TensorType  # noqa: E402

REQUIRED = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
            "phi3", "gpt2", "gpt_neox", "gptj", "opt", "falcon"}


def test_the_table_covers_the_required_families_and_every_entry_is_tested():
    assert REQUIRED <= set(supported_model_types())
    assert set(supported_model_types()) == set(CONFIGS)
    assert len({e.family for e in ARCHITECTURES}) == len(ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_tensor_type_at_every_layer(model_type):
    model = build_model(model_type)
    backend = HFBackend(model, build_tokenizer())
    caps = backend.capabilities()
    assert find_architecture(model).model_types[0] == model_type or model_type in \
        find_architecture(model).model_types
    n = caps.num_layers
    assert n == 3 and set(caps.tensor_types) == set(TensorType)
    points = [ExtractionPoint(name=f"{t.value}_{pos}", layers=caps.valid_layers(t), tensor_type=t,
                              position=pos, probe_type="none",
                              probe_kind="trajectory" if "*" in pos else "single_shot")
              for t in TensorType for pos in ("prompt[-1]", "generated[*]")]
    prompts = [prompt(4, 8, 15, 16, 23), prompt(42, 7)]
    session = CaptureSession(None, points, keep_records=True)
    params = SamplingParams(max_new_tokens=3)
    outs = backend.generate(prompts, ["a", "b"], params, session)
    batch, generated = transformers_generate(model, backend.tokenizer, prompts,
                                             max_new_tokens=params.max_new_tokens)
    ids = batch["input_ids"]
    plain = generated[:, ids.shape[1]:].tolist()
    for row, out in enumerate(outs):
        assert list(out.token_ids) == plain[row][: len(out.token_ids)]
        fed = 1 + len(out.token_ids) - 1  # last prompt token + fed generated tokens
        per_token = 4 * n + 1  # four per-layer types at n layers, plus final_norm
        assert len(out.records) == fed * per_token
        for record in out.records:
            if record.tensor_type == "kv":
                assert tuple(record.tensor.shape) == (2, caps.num_kv_heads, caps.head_dim)
            else:
                assert tuple(record.tensor.shape) == (caps.hidden_size,)
            assert record.tensor.device.type == "cpu" and record.tensor.dtype == torch.float32
    # the unpadded row against a plain forward of its own prompt
    first = {(r.tensor_type, r.layer): r.tensor for r in outs[0].records if not r.is_generated}
    with torch.no_grad():
        hidden = model(ids[:1], output_hidden_states=True).hidden_states
    torch.testing.assert_close(first[("residual_stream", 0)], hidden[1][0, -1])
    torch.testing.assert_close(first[("final_norm", n)], hidden[n][0, -1])
    backend.close()  # (build_model's model is shared: leave no hook on it)


def _gemma2_directory(directory):
    """A tiny Gemma2 saved with a tokenizer, its weights large enough that the
    attention logits reach the config's softcap (50)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", vocab_size=64, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, **CONFIGS["gemma2"])
    assert config.attn_logit_softcapping == 50.0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.8)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return str(directory)


def test_gemma2_from_a_path_gives_the_reference_eager_forward_s_activations(tmp_path):
    # transformers loads Gemma2 with sdpa attention by default, which drops its
    # attention softcap: records were a percent or so away from the model's own
    # (eager) forward and from the vllm backend's.
    from transformers import AutoModelForCausalLM

    from undercurrent.api import ProbedModel

    path = _gemma2_directory(tmp_path)
    spec = [ExtractionPoint(name=f"resid_{position}", layers=(0, 1),
                            tensor_type="residual_stream", position=position,
                            probe_type="capture", probe_kind="single_shot")
            for position in ("prompt[0]", "prompt[-5]", "prompt[-1]")]
    with ProbedModel.from_pretrained(path, spec=spec, dtype="float32") as pm:
        out = pm.generate([prompt(*range(4, 30))], max_new_tokens=1, records=True)[0]
    assert len(out.records) == 2 * 3
    ids = torch.tensor([list(out.prompt_token_ids)])

    def hidden_states(attention):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation=attention).eval()
        with torch.no_grad():
            return model(ids, output_hidden_states=True).hidden_states

    eager, sdpa = hidden_states("eager"), hidden_states("sdpa")
    for record in out.records:
        want = eager[record.layer + 1][0, record.token_index]
        torch.testing.assert_close(record.tensor, want, rtol=1e-5, atol=1e-5)
    # (the cap is reached: without it the activations are not the same)
    assert max(float((eager[i] - sdpa[i]).abs().max()) for i in (1, 2)) > 1e-2


def test_a_gemma2_model_on_sdpa_attention_is_warned_about_naming_eager():
    from transformers import AutoConfig, AutoModelForCausalLM

    from undercurrent.api import ProbedModel

    config = AutoConfig.for_model("gemma2", vocab_size=64, pad_token_id=0, **CONFIGS["gemma2"])
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with pytest.warns(UserWarning, match=r"Gemma2ForCausalLM runs attn_implementation='sdpa', "
                                         r"which ignores its config.attn_logit_softcapping=50"
                                         r".*attn_implementation='eager'"):
        ProbedModel(sdpa, build_tokenizer()).close()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProbedModel(build_model("gemma2"), build_tokenizer()).close()


def test_gemma2_keeps_the_attention_a_config_given_to_from_pretrained_chooses(tmp_path):
    # it was switched to eager silently, where the same choice as a keyword is kept
    from transformers import AutoConfig

    from undercurrent.api import ProbedModel

    path = _gemma2_directory(tmp_path)
    config = AutoConfig.from_pretrained(path, attn_implementation="sdpa")
    with pytest.warns(UserWarning, match="runs attn_implementation='sdpa'"), \
            ProbedModel.from_pretrained(path, config=config) as pm:
        assert pm.backend.model.config._attn_implementation == "sdpa"
    with ProbedModel.from_pretrained(path, config=AutoConfig.from_pretrained(path)) as pm:
        assert pm.backend.model.config._attn_implementation == "eager"
