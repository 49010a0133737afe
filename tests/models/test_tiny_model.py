"""The bundled tiny model: shipped files, offline loading, corpus-like generation."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tools.tiny_model.train import TRAIN_SEED, TrainingConfig  # noqa: E402
from undercurrent.models import tiny_model_path, tiny_probe_path  # noqa: E402
from undercurrent.models.corpus import (  # noqa: E402
    first_revealing_index,
    generate_examples,
    make_example,
    vocabulary,
)

SHIPPED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
           "tokenizer_config.json", "probe.safetensors", "probe_report.json")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model_path()))


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_path())).eval()


def test_bundled_directory_holds_every_file_within_8_megabytes() -> None:
    directory = tiny_model_path()
    for name in SHIPPED:
        assert (directory / name).is_file(), name
    total = sum(path.stat().st_size for path in directory.iterdir() if path.is_file())
    assert total <= 8 * 1024 * 1024
    assert tiny_probe_path().parent == directory


def test_config_is_a_llama_with_a_head_dim_vllm_serves() -> None:
    config = json.loads((tiny_model_path() / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64, 128)
    assert config["num_hidden_layers"] == TrainingConfig.num_hidden_layers


def test_loads_offline_as_float32_llama(model, tokenizer, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    assert tokenizer.bos_token == "<bos>" and tokenizer.eos_token == "<eos>"
    assert tokenizer.pad_token == "<pad>"
    assert len(tokenizer) == model.config.vocab_size


def test_tokenizer_prepends_bos_and_maps_corpus_words_to_single_tokens(tokenizer) -> None:
    example = generate_examples(1, seed=123)[0]
    ids = tokenizer(example.text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == example.text.split()
    assert tokenizer.unk_token_id not in ids
    # Hand-typed text is lowercased and punctuation split off.
    typed = tokenizer("How do I open my car?").input_ids[1:]
    assert tokenizer.convert_ids_to_tokens(typed) == ["how", "do", "i", "open", "my", "car", "?"]


def test_greedy_replies_are_corpus_text_with_the_intent_the_prompt_implies(model,
                                                                           tokenizer) -> None:
    seen = {e.prompt for e in generate_examples(TrainingConfig.examples, TRAIN_SEED)}
    rng = random.Random(4242)
    examples = []
    while len(examples) < 24:
        example = make_example(rng, label=len(examples) % 2)
        if example.prompt not in seen:  # prompts the model never trained on
            examples.append(example)
    tokenizer.padding_side = "left"
    batch = tokenizer([e.prompt for e in examples], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=60, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    vocab = set(vocabulary())
    right = 0
    for example, row in zip(examples, out[:, batch.input_ids.shape[1]:], strict=True):
        words = [w for w in tokenizer.convert_ids_to_tokens(row) if w not in ("<eos>", "<pad>")]
        assert set(words) <= vocab
        assert words[:2] == ["okay", "."]  # both intents open the same way
        assert words[-1] == "."
        reveal = first_revealing_index(words, example.label)
        wrong = first_revealing_index(words, 1 - example.label)
        right += reveal is not None and wrong is None and reveal >= 10
    assert right >= 22
