"""The training script: deterministic, and it writes a loadable model directory."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tools.tiny_model.train import TrainingConfig, train  # noqa: E402

TINY_RUN = TrainingConfig(steps=3, batch_size=4, examples=64, warmup_steps=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    other_seed = dataclasses.replace(TINY_RUN, seed=TINY_RUN.seed + 1)
    summaries = {name: train(root / name, config, log_every=0)
                 for name, config in (("a", TINY_RUN), ("b", TINY_RUN), ("c", other_seed))}
    weights = {name: safetensors_torch.load_file(str(root / name / "model.safetensors"))
               for name in summaries}
    return root, summaries, weights


def test_same_seed_gives_bitwise_identical_weights(runs) -> None:
    _, summaries, weights = runs
    a, b = weights["a"], weights["b"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert summaries["a"]["final_loss"] == summaries["b"]["final_loss"]


def test_other_seed_gives_other_weights(runs) -> None:
    _, _, weights = runs
    assert any(not torch.equal(weights["a"][name], weights["c"][name]) for name in weights["a"])


def test_written_directory_loads_with_auto_classes(runs) -> None:
    root, _, _ = runs
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "a"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "a"))
    assert model.config.tie_word_embeddings
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert len(tokenizer) == model.config.vocab_size
    assert (root / "a" / "training.json").is_file()
