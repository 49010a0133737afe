"""Tiny random models of every architecture in the table, built from configs
(no download), and a word-level tokenizer built locally."""

from __future__ import annotations

from functools import cache
from typing import Any

VOCAB = 64
WORDS = [f"w{i}" for i in range(VOCAB - 4)]

_ATTN = dict(num_attention_heads=4)
_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_key_value_heads=2,
              **_ATTN)

# config.model_type -> config kwargs (3 layers, hidden 32, vocab 64)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "mixtral": dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": _LLAMA,
    "qwen2_moe": dict(_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3": dict(_LLAMA, head_dim=8),
    "qwen3_moe": dict(_LLAMA, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32),
    "gemma": dict(_LLAMA, head_dim=8),
    "gemma2": dict(_LLAMA, head_dim=8),
    "gemma3_text": dict(_LLAMA, head_dim=8),
    "phi3": _LLAMA,
    "granite": _LLAMA,
    "olmo2": _LLAMA,
    "phi": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, **_ATTN),
    "gpt2": dict(n_embd=32, n_layer=3, n_head=4),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, **_ATTN),
    "gptj": dict(n_embd=32, n_layer=3, n_head=4, rotary_dim=4),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=3, word_embed_proj_dim=32, **_ATTN),
    "falcon": dict(hidden_size=32, num_hidden_layers=3, **_ATTN),
}

SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def build_tokenizer() -> Any:
    """A word-level ``PreTrainedTokenizerFast``: <pad>=0, <bos>=1, <eos>=2, <unk>=3,
    then w0..w59; encoding prepends <bos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>",
                                   eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


@cache
def build_model(model_type: str, eos: bool = False, vocab: int = VOCAB) -> Any:
    """A tiny random ``*ForCausalLM`` in eval mode, seeded so it is the same every time.

    ``eos=False`` gives the model no eos token, so generations always run to
    ``max_new_tokens`` (what the equivalence tests want). ``vocab``: its
    vocabulary's size (another tokenizer's, such as :func:`subword_tokenizer` 's).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    special = dict(SPECIAL)
    if not eos:
        special["eos_token_id"] = None
    config = AutoConfig.for_model(model_type, vocab_size=vocab, **special,
                                  **CONFIGS[model_type])
    torch.manual_seed(1234)
    # (Gemma2 caps its attention logits, which transformers' default sdpa ignores)
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    model = AutoModelForCausalLM.from_config(
        config, **({"attn_implementation": "eager"} if eager else {})).eval()
    model.generation_config.eos_token_id = special["eos_token_id"]
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    return model


def own_model(model_type: str, eos: bool = False) -> Any:
    """:func:`build_model`'s model, built anew: one a test may change, or count the
    hooks of (the cached one is shared by a process's tests, and some leave a
    backend open on it; a deep copy would copy its hooks too)."""
    return build_model.__wrapped__(model_type, eos)


def prompt(*indices: int) -> str:
    return " ".join(WORDS[i] for i in indices)


def transformers_generate(model: Any, tokenizer: Any, prompts: list[str], *,
                          max_new_tokens: int, temperature: float | None = None,
                          top_k: int | None = None, top_p: float = 1.0,
                          seed: int | None = None, **outputs: Any) -> tuple[Any, Any]:
    """The oracle for the HF backend, built from transformers alone (no undercurrent
    code): the tokenizer's own left-padded batch and ``model.generate()`` with every
    argument written out here. Greedy unless ``temperature`` is given. The eos is the
    model's generation config's, else the tokenizer's (what a user of plain
    transformers would pass); a seed is set right before ``generate()``.

    Returns ``(batch, generate's output)``; ``outputs`` are extra ``generate()``
    arguments such as ``output_hidden_states=True``.
    """
    import torch

    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    batch = {name: tensor.to(model.device) for name, tensor in batch.items()}
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    if temperature is None:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=top_p)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=batch["input_ids"],
                             attention_mask=batch["attention_mask"], **kwargs, **outputs)
    return batch, out


def generated_points(mode: str = "async", norm_mode: str = "async") -> list[Any]:
    """Two points on every generated token: the residual stream at layers 0-2 to a
    ``trajectory_probe`` (in ``mode``) and mlp_out at layer 1 to a ``norm_probe`` (in
    ``norm_mode``)."""
    from undercurrent.spec.types import ExtractionPoint

    return [
        ExtractionPoint(name="traj", layers=(0, 1, 2), tensor_type="residual_stream",
                        position="generated[*]", probe_type="trajectory_probe",
                        probe_kind="trajectory", execution_mode=mode),
        ExtractionPoint(name="norm", layers=(1,), tensor_type="mlp_out",
                        position="generated[*]", probe_type="norm_probe",
                        probe_kind="trajectory", execution_mode=norm_mode),
    ]


def kv_point(mode: str = "async") -> Any:
    """kv at layers 0 and 2 on every generated token, to the ``capture`` probe."""
    from undercurrent.spec.types import ExtractionPoint

    return ExtractionPoint(name="kv", layers=(0, 2), tensor_type="kv", position="generated[*]",
                           probe_type="capture", probe_kind="trajectory", execution_mode=mode)


CORPUS = ["the cat sat on the mat, then the cat ran.", "un café crème à l'élève, déjà vu",
          "日本語のテキストです。東京へ行きます", "emoji 😀 and 🎉 party 👩‍💻 at noon",
          "naïve coöperation über straße", "x = f(y) + 2; print(x)  # done",
          "Привет мир, как дела?", "don't stop: it's 3.14 or 2,718!"]
"""Text with characters of one to four bytes, for :func:`subword_tokenizer`."""


@cache
def subword_tokenizer(kind: str, clean_up: bool = False) -> Any:
    """A subword ``PreTrainedTokenizerFast`` trained here on :data:`CORPUS`, the
    specials <pad>=0, <bos>=1, <eos>=2, <unk>=3 first. ``"byte-level"``: GPT-2's
    byte-level BPE (a character's bytes may span tokens); ``"sentencepiece"``:
    llama's BPE of words that begin with "▁" for the space before them (dropped
    at the start of the text), with byte fallback (<0x..> tokens: a character
    not in the vocabulary, byte by byte); ``"wordpiece"``: BERT's WordPiece
    (words split at punctuation, a word's later pieces marked "##");
    ``"unigram"``: sentencepiece's Unigram of words that begin with "▁" (which
    transformers cleans up tokenization spaces for, when asked, as it does
    not for a BPE model).
    ``clean_up``: the decode cleans up tokenization spaces, as BERT's tokenizers
    ship (``clean_up_tokenization_spaces``: ``"don ' t ."`` is ``"don't."``; on
    a BPE tokenizer too, which transformers otherwise declines)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    if kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=False)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        tokenizer.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
            vocab_size=300, special_tokens=specials))
    elif kind == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        tokenizer.train_from_iterator(CORPUS, trainers.UnigramTrainer(
            vocab_size=200, special_tokens=specials, unk_token="<unk>"))
    elif kind == "byte-level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0)])
        # (the Japanese and the emoji left out: their characters are bytes)
        tokenizer.train_from_iterator([CORPUS[0], CORPUS[1], *CORPUS[4:]], trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials))
        saved = json.loads(tokenizer.to_str())
        vocab = saved["model"]["vocab"]
        vocab.update({f"<0x{byte:02X}>": len(vocab) + byte for byte in range(256)})
        saved["model"]["byte_fallback"] = True
        tokenizer = Tokenizer.from_str(json.dumps(saved))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", clean_up_tokenization_spaces=clean_up,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=clean_up)
