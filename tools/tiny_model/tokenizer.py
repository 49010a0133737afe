"""The bundled model's tokenizer: one token per corpus word, built with ``tokenizers``.

Input is lowercased and split on whitespace, with ``. , ? !`` split off as
tokens of their own, so text typed by hand ("How do I open my car?") maps onto
the corpus vocabulary. Words outside it become ``<unk>``. Encoding prepends
``<bos>``, as Llama tokenizers do; replies end with ``<eos>``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)


def build_tokenizer(words: Sequence[str]) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``SPECIAL_TOKENS`` followed by ``words``.

    Ids are assigned in order, so the same word list always gives the same ids.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *words))}
    if len(vocab) != len(SPECIAL_TOKENS) + len(words):
        raise ValueError("build_tokenizer: the word list has duplicates or special tokens")
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"[.,?!]"), "isolated")]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``.

    The config names ``PreTrainedTokenizerFast``, which transformers 4.x and 5.x
    (and vLLM) both load from ``tokenizer.json`` alone.
    """
    tokenizer.save_pretrained(str(directory))
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
