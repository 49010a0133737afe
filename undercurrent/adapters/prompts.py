"""What a generation call takes as its prompts: text, or token ids already encoded.

``ProbedModel.generate``/``stream``/``prompt_activations`` accept either
``prompts`` (strings) or ``input_ids`` (token ids); both become a list of
:data:`PromptInput` that every backend turns into ``(text, token ids)`` with
:func:`tokenize_prompts`. Token ids pass to the model exactly as given (no BOS added).
"""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

PromptInput = str | tuple[int, ...]
"""One prompt: its text (tokenized by the backend) or its token ids."""


def check_prompts(prompts: Any) -> list[str]:
    """``prompts`` as a list of strings (a single string gives a list of one).

    Raises ``TypeError`` naming the first offending prompt: bytes, token-id lists,
    None or numbers are not prompts (token ids go to ``input_ids=``), and a
    mapping (whose keys would silently become the prompts) is refused too.
    """
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray, Mapping)) or not isinstance(prompts, Iterable):
        raise TypeError(
            f"prompts must be a string or a list of strings, got {type(prompts).__name__}"
        )
    items = list(prompts)
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(
                f"prompts[{index}] is {type(item).__name__} ({item!r:.60}); every prompt "
                "must be a string (decode bytes first; pass token ids as input_ids=)"
            )
        if not item.isascii():
            refuse_lone_surrogates(item, f"prompts[{index}]")
    return items


def refuse_lone_surrogates(text: str, where: str) -> None:
    """Refuse text no tokenizer can encode: a lone surrogate, which is what bytes
    that are not UTF-8 become when read with ``errors="surrogateescape"`` (as
    Python reads command-line arguments)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{where} is not valid text: character {error.start} is the lone surrogate "
            f"{text[error.start]!r} (bytes that are not UTF-8, as a shell passes them); "
            "decode the bytes with their real encoding first") from None


def _token_rows(input_ids: Any) -> list[Any]:
    """Rows of ``input_ids``: a list of token-id lists, one flat list (one prompt),
    or a 1-D/2-D tensor or array (each row one prompt, taken as it is).

    A 1-D tensor, or a list whose first item is no row (a number, None), is one
    prompt whatever its items are, so a bad one is named ``input_ids[0][j]``."""
    tolist = getattr(input_ids, "tolist", None)
    if callable(tolist) and not isinstance(input_ids, (list, tuple)):
        ndim = getattr(input_ids, "ndim", None)
        if ndim not in (1, 2):
            raise ValueError(f"input_ids must be 1-D (one prompt) or 2-D (one row per "
                             f"prompt), got {ndim}-D")
        return [tolist()] if ndim == 1 else tolist()
    if isinstance(input_ids, (str, bytes, bytearray, Mapping)) or not isinstance(
            input_ids, (list, tuple)):
        raise TypeError(f"input_ids must be a list of token-id lists (or one list of token "
                        f"ids, or a tensor), got {type(input_ids).__name__}")
    if input_ids and not _is_row(input_ids[0]):
        return [input_ids]
    return list(input_ids)


def _is_row(value: Any) -> bool:
    """Whether ``value`` reads as a prompt's row (a sequence, a tensor of 1-D or
    more) rather than one token."""
    if isinstance(value, (list, tuple, str, bytes, bytearray)):
        return True
    return bool(getattr(value, "ndim", 0))


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_PLAIN_INTS = {int}
_PLAIN_ROWS = (list, tuple)
_PLAIN_ROW_TYPES = set(_PLAIN_ROWS)


def plain_ids(row: Sequence[Any]) -> tuple[int, ...]:
    """``row`` (token ids) as a tuple of plain ints: the row itself where it is
    one already (a prompt :func:`check_input_ids` gave is not copied again:
    one tuple per prompt, not one per step of its way to the model).

    >>> row = (1, 2)
    >>> plain_ids(row) is row, plain_ids([1, True])
    (True, (1, 1))
    """
    if type(row) is tuple and list(map(type, row)).count(int) == len(row):
        return row
    return tuple(map(int, row))


def check_input_ids(input_ids: Any, vocab_size: int | None = None) -> list[tuple[int, ...]]:
    """``input_ids`` as one tuple of token ids per prompt.

    Every id must be an integer in ``[0, vocab_size)``, and every prompt non-empty;
    errors name the offending ``input_ids[i][j]``.
    """
    rows = _token_rows(input_ids)
    if not rows:
        raise ValueError("input_ids is empty; give at least one prompt's token ids")
    if set(map(type, rows)) <= _PLAIN_ROW_TYPES and all(rows):
        # Lists or tuples of plain ints in range, none empty (the usual case):
        # checked at once, in C.
        tokens = list(itertools.chain.from_iterable(rows))
        if (set(map(type, tokens)) == _PLAIN_INTS and min(tokens) >= 0
                and (vocab_size is None or max(tokens) < vocab_size)):
            return list(map(tuple, rows))
    checked = []
    for index, row in enumerate(rows):
        if type(row) not in _PLAIN_ROWS:  # (a list or tuple as it is: the usual case)
            if hasattr(row, "tolist") and not isinstance(row, (list, tuple)):
                row = row.tolist()
            if isinstance(row, (str, bytes, bytearray)) or not isinstance(row, (list, tuple)):
                raise TypeError(f"input_ids[{index}] is {type(row).__name__} ({row!r:.60}); "
                                "each prompt must be a list of token ids")
        if not row:
            raise ValueError(f"input_ids[{index}] is empty; a prompt needs at least one token")
        if (set(map(type, row)) == _PLAIN_INTS and min(row) >= 0
                and (vocab_size is None or max(row) < vocab_size)):
            checked.append(tuple(row))  # plain ints in range: the usual case, checked at once
            continue
        for position, token in enumerate(row):
            if not _is_token(token):
                raise TypeError(f"input_ids[{index}][{position}] is {type(token).__name__} "
                                f"({token!r:.40}); token ids are integers")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"input_ids[{index}][{position}] is {token}; token ids of "
                                 f"this model are {bound}")
        checked.append(tuple(int(token) for token in row))
    return checked


def prompt_inputs(prompts: Any, input_ids: Any, vocab_size: int | None = None
                  ) -> list[PromptInput]:
    """Exactly one of ``prompts`` / ``input_ids``, checked, as a list of prompts."""
    if prompts is not None and input_ids is not None:
        raise TypeError("pass either prompts or input_ids, not both")
    if input_ids is not None:
        return list(check_input_ids(input_ids, vocab_size))
    if prompts is None:
        raise TypeError("prompts must be a string or a list of strings, got None; or give "
                        "token ids as input_ids=[[token ids], ...]")
    return list(check_prompts(prompts))


def tokenize_prompts(prompts: Sequence[PromptInput], tokenizer: Any,
                     vocab_size: int | None = None) -> tuple[list[str], list[tuple[int, ...]]]:
    """Each prompt's text and token ids (a tuple of ints, :func:`plain_ids`): a
    text prompt encoded with ``tokenizer`` (every text prompt in one call, each
    encoded as it would be alone), a token-id prompt kept as it is and decoded
    (special tokens included) for its text. A prompt that encodes to no tokens
    is refused, and so is a text prompt that encodes to an id past
    ``vocab_size`` (a token the tokenizer has and the model has no embedding
    for: HF's embedding raises on it, vLLM's reads a padding row)."""
    strings = [prompt for prompt in prompts if isinstance(prompt, str)]
    batch = iter(tokenizer(strings)["input_ids"] if strings else ())
    decode = (text_decoder(tokenizer, skip_special_tokens=False)
              if len(strings) < len(prompts) else None)
    if decode is not None and not strings:  # token ids only: converted and decoded at once
        encoded = list(map(plain_ids, prompts))
        if all(encoded):
            return list(map(decode, encoded)), encoded
    texts, encoded = [], []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, ids = prompt, plain_ids(next(batch))
            if vocab_size is not None and ids and max(ids) >= vocab_size:
                position = next(i for i, token in enumerate(ids) if token >= vocab_size)
                raise ValueError(
                    f"prompts[{index}] ({prompt!r:.60}) encodes to token id {ids[position]} "
                    f"(token {position}), outside this model's vocabulary [0, {vocab_size}): "
                    "its tokenizer has tokens the model has no embedding for (an added "
                    "special token?)")
        else:
            assert decode is not None
            ids = plain_ids(prompt)
            text = decode(ids)
        if not ids:
            raise ValueError(f"prompts[{index}] ({prompt!r:.60}) encodes to no tokens")
        texts.append(text)
        encoded.append(ids)
    return texts, encoded


def text_decoder(tokenizer: Any, *, skip_special_tokens: bool = True
                 ) -> Callable[[Sequence[int]], str]:
    """``ids -> str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))``.

    A transformers tokenizer backed by a ``tokenizers`` tokenizer, whose class
    keeps transformers' own ``decode`` and ``_decode`` and which cleans up no
    tokenization spaces, gets exactly the backend's text: such a tokenizer is
    decoded by its backend directly, without transformers' per-call argument
    handling (a backend decodes once per request at the end of a generation, and
    once per request and step while streaming or watching for stop strings; a
    prompt given as token ids is decoded, special tokens kept, for its text).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _decodes_with_backend(tokenizer):
        # (the backend's own text, a str: called in C, with no Python frame per call)
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


CLEAN_UP_REACH = 4
"""How many characters before a token's text transformers' clean-up of
tokenization spaces may change once the token comes: ``" n't"`` past a
``" ' "`` joined first (``"do n ' t"`` is ``"don't"``: the token ``t`` drops
the space four characters before its own text)."""


def decode_reach(tokenizer: Any) -> int:
    """How many characters of the text before a token :func:`text_decoder`'s
    decode may change once the token comes (what a decode of a few tokens at a
    time must hold before the new one): :data:`CLEAN_UP_REACH` where the
    tokenizer cleans up tokenization spaces (``clean_up_tokenization_spaces``,
    as BERT's WordPiece tokenizers ship), else 0 (transformers 5 ignores the
    setting for a BPE model, as GPT-2's configs set it, unless forced)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True) or _skips_clean_up(tokenizer):
        return 0
    return CLEAN_UP_REACH


def _skips_clean_up(tokenizer: Any) -> bool:
    """True where transformers' ``_decode`` ignores ``clean_up_tokenization_spaces``:
    a ``tokenizers`` BPE model, unless ``..._for_bpe_even_though_it_will_corrupt_output``."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode
            and backend is not None and type(backend.model).__name__ == "BPE"
            and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_"
                                       "will_corrupt_output", False))


def _decodes_with_backend(tokenizer: Any) -> bool:
    """True when ``tokenizer.decode(ids, skip_special_tokens=True)`` is its
    backend's ``decode`` of the same ids (transformers 5's ``TokenizersBackend``)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its own decode, always right
        return False
    kind = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend)
            and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is TokenizersBackend._decode
            and (not getattr(tokenizer, "clean_up_tokenization_spaces", True)
                 or _skips_clean_up(tokenizer)))


class ByteRuns(NamedTuple):
    """The tokens of a tokenizer whose decode reads a run of byte fallback
    tokens as one (:func:`byte_runs`)."""

    bytes: frozenset[int]
    """The byte tokens (``<0xE6>``): a run of them decodes to its characters where
    its bytes are valid UTF-8, else to U+FFFD for each of its bytes (the
    characters complete before an invalid or incomplete one included)."""
    skipped: frozenset[int]
    """Special tokens the decode skips: they leave a run open (the decode drops
    them before reading runs)."""


def byte_runs(tokenizer: Any) -> ByteRuns | None:
    """The byte tokens of ``tokenizer`` where :func:`text_decoder`'s decode reads
    a run of them as one (a ``tokenizers`` ``ByteFallback`` decoder, as Llama 2's
    and Mistral's tokenizers ship: ``<0xE6> <0x97> <0xA5>`` is ``"日"``, but with
    ``<0xE6>`` after it, ``"����"``), else None: a later byte token may then
    change the text of those before it, back to where the run began.

    Found once per tokenizer by looking up the 256 byte tokens and decoding one
    such run, so a decode of any kind is read as it behaves."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    back = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None or back is None:
        return None
    names = [f"<0x{byte:02X}>" for byte in range(256)]
    # (ByteFallback reads lowercase hex digits too)
    names += [name.lower() for name in names if name != name.lower()]
    # (an unknown name gives the unknown token's id, or None: kept where its id
    # is its own)
    known = [(name, token) for name, token in zip(names, convert(names), strict=True)
             if isinstance(token, int)]
    found = {name: token for (name, token), kept in zip(
        known, back([token for _, token in known]), strict=True) if kept == name}
    spelled = [f"<0x{byte:02X}>" for byte in "日".encode()]
    if not all(name in found for name in spelled):
        return None
    character = [found[name] for name in spelled]
    decode = text_decoder(tokenizer)
    if decode(character) != "日" or decode([*character, character[0]]).startswith("日"):
        return None  # (each byte token's text its own, or no byte fallback at all)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special.update(token for token, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
                   if getattr(added, "special", False))
    return ByteRuns(frozenset(found.values()),
                    frozenset(token for token in special if not decode([token])))
