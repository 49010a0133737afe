"""``text_decoder``: a backend's generated text is exactly
``tokenizer.decode(ids, skip_special_tokens=True)``, taken from the ``tokenizers``
backend directly only where transformers would not change it."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from hf_models import build_tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from undercurrent.adapters.prompts import text_decoder  # noqa: E402
from undercurrent.models import tiny_model_path  # noqa: E402


def _id_lists(tokenizer, count=200):
    """Random id lists over the whole vocabulary (special tokens included), and
    the edge cases: none, only special tokens."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    specials = list(tokenizer.all_special_ids)
    lists = [[], specials, specials[::-1] + [3, 4]]
    lists += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)]
    return lists


class _Spy:
    """Counts the tokenizer's own ``decode`` calls (an instance attribute: the
    class, which decides the path, is untouched)."""

    def __init__(self, tokenizer):
        self.calls = 0
        self.decode = tokenizer.decode

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.decode(*args, **kwargs)


@pytest.mark.parametrize("load", [lambda: AutoTokenizer.from_pretrained(tiny_model_path()),
                                  build_tokenizer], ids=["bundled", "word-level"])
def test_a_plain_fast_tokenizer_decodes_through_its_backend_with_the_same_text(load):
    tokenizer = load()
    assert not tokenizer.clean_up_tokenization_spaces
    spy = tokenizer.decode = _Spy(tokenizer)
    decode = text_decoder(tokenizer)
    kept = text_decoder(tokenizer, skip_special_tokens=False)  # (a token-id prompt's text)
    for ids in _id_lists(tokenizer):
        assert decode(ids) == spy.decode(ids, skip_special_tokens=True), ids
        assert kept(ids) == spy.decode(ids), ids
    assert spy.calls == 0  # the backend answered every time


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(),
                                              clean_up_tokenization_spaces=True)
    spy = tokenizer.decode = _Spy(tokenizer)
    decode = text_decoder(tokenizer)
    lists = _id_lists(tokenizer, 20)
    assert [decode(ids) for ids in lists] == [
        spy.decode(ids, skip_special_tokens=True) for ids in lists]
    assert spy.calls == len(lists)
    kept = text_decoder(tokenizer, skip_special_tokens=False)
    assert [kept(ids) for ids in lists] == [spy.decode(ids) for ids in lists]
    assert spy.calls == 2 * len(lists)  # (spy.decode itself is not counted)


def test_a_tokenizer_class_with_its_own_decode_is_asked_itself():
    base = type(AutoTokenizer.from_pretrained(tiny_model_path()))

    class Shouting(base):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens, **kwargs).upper()

    tokenizer = Shouting.from_pretrained(tiny_model_path())
    ids = _id_lists(tokenizer, 5)[-1]
    assert text_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert text_decoder(tokenizer)(ids).isupper()


def test_any_other_tokenizer_is_asked_itself():
    class Plain:
        def decode(self, ids, skip_special_tokens=False):
            return "/".join(map(str, ids)) + ("!" if skip_special_tokens else "")

    assert text_decoder(Plain())([1, 2]) == "1/2!"
    assert text_decoder(Plain(), skip_special_tokens=False)([1, 2]) == "1/2"
