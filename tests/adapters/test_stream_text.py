"""A stream's text pieces joined (the last event's included) equal the output's text:
a stop string is never streamed, a partial one is held back until settled."""

from __future__ import annotations

import copy
import functools
import random

import pytest

from undercurrent.adapters.session import StopMatch, StreamText, held_back, stop_position


def test_held_back_is_the_longest_end_that_could_begin_a_stop_string() -> None:
    assert held_back("say yo", ["you"]) == 2
    assert held_back("say y", ["you", "yes"]) == 1
    assert held_back("say you", ["you"]) == 0  # complete: a stop, not a prefix
    assert held_back("say ", ["you"]) == 0
    assert held_back("ab", ["abc", "bcd"]) == 2
    assert held_back("", ["x"]) == 0


def _stream(pieces_of_text: list[str], stops: list[str]) -> tuple[list[str], str]:
    """Feed the growing text token by token the way a backend does; return the
    pieces sent and what the final output text is."""
    stream = StreamText(stops)
    text, sent = "", []
    for piece in pieces_of_text:
        text += piece
        sent.append(stream.piece(text))
        if stop_position(text, stops) is not None:
            break
    cut = stop_position(text, stops)
    final = text if cut is None else text[:cut]
    sent.append(stream.rest(final))
    return sent, final


def test_pieces_joined_equal_the_final_text_on_random_texts() -> None:
    rng = random.Random(5)
    alphabet = "ab c"
    for _ in range(2000):
        tokens = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
                  for _ in range(rng.randint(1, 8))]
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(0, 2))]
        sent, final = _stream(tokens, stops)
        assert "".join(sent) == final, (tokens, stops, sent)
        assert not any(stop in final for stop in stops)


@pytest.mark.parametrize("stops", [[], ["\u20ac"], ["c\u20ac"], ["x"]])
def test_a_character_split_across_byte_tokens_is_sent_whole(stops) -> None:
    # A byte-level tokenizer's tokens are bytes: the text decoded so far ends in
    # U+FFFD while a character's bytes are incomplete, then the character.
    text = "a\U0001F600b\u00e9c\u20ac"
    tokens = [bytes([byte]) for byte in text.encode()]
    stream = StreamText(stops)
    sent = []
    for count in range(1, len(tokens) + 1):
        decoded = b"".join(tokens[:count]).decode("utf-8", errors="replace")
        sent.append(stream.piece(decoded))
        if stop_position(decoded, stops) is not None:
            break
    cut = stop_position(text, stops)
    final = text if cut is None else text[:cut]
    sent.append(stream.rest(final))
    assert "".join(sent) == final
    assert "\ufffd" not in "".join(sent)


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer, own_model, prompt  # noqa: E402

from undercurrent import ProbedModel  # noqa: E402


@pytest.fixture(scope="module")
def probed():
    with ProbedModel(build_model("llama"), build_tokenizer()) as pm:
        yield pm


def _words(probed) -> list[str]:
    out = probed.generate([prompt(3, 1, 4)], max_new_tokens=8)[0]
    return out.text.split()


def _streamed(probed, stop):
    events = list(probed.stream(prompt(3, 1, 4), max_new_tokens=8, stop=stop))
    final = events[-1]
    assert final.finished
    return events, final.output


@pytest.mark.parametrize("case", ["one token", "two tokens", "never completes"])
def test_stream_pieces_agree_with_the_output_text(probed, case) -> None:
    words = _words(probed)
    stop = {"one token": words[3], "two tokens": f"{words[3]} {words[4]}",
            "never completes": f"{words[3]} zz"}[case]
    events, output = _streamed(probed, stop)
    joined = "".join(event.text for event in events)
    assert joined == output.text
    assert stop not in joined
    generated = probed.generate([prompt(3, 1, 4)], max_new_tokens=8, stop=stop)[0]
    assert output.text == generated.text and output.token_ids == generated.token_ids
    if case == "never completes":
        assert output.finish_reason == "length" and words[3] in joined
    else:
        assert output.finish_reason == "stop"
        assert output.text == " ".join(words[:3]) + " "
        # one event per generated token, the one completing the stop string included
        assert len([e for e in events if not e.finished]) == len(output.token_ids)


def test_without_stop_strings_every_piece_is_sent_at_once(probed) -> None:
    events, output = _streamed(probed, None)
    assert events[-1].text == ""
    assert "".join(event.text for event in events) == output.text
    assert all(event.text for event in events[:-1])


def test_a_stop_match_finds_the_token_that_first_completes_a_stop_string() -> None:
    pieces = {1: "say", 2: " y", 3: "ou", 4: " and", 5: " you", 9: ""}
    decoded: list[int] = []

    def decode(ids) -> str:
        decoded.append(len(ids))
        return "".join(pieces[i] for i in ids)

    match = StopMatch(["you"], decode, eos={9})
    assert match.scan([1, 2]) is None
    assert match.scan([1, 2, 3, 4, 5]) == 2  # ("say you": the third token, once)
    # (each token decoded with the one before it, then alone: the overlap of the
    # next; the whole text once, to confirm)
    assert match.scan([1, 2, 3, 4, 5, 5]) == 2 and decoded == [1, 2, 1, 2, 1, 3]
    # An end-of-sequence token ends the request as such: it completes no stop
    # string, whatever its text (a decode that skips it gives the same text).
    assert StopMatch(["say"], lambda ids: "say" if ids[-1] == 9 else "", {9}).scan([9, 9]) is None
    assert StopMatch([""], decode).scan([1, 2]) is None  # (an empty stop string matches nothing)


def test_a_stop_match_reads_past_tokens_that_decode_to_nothing() -> None:
    # Special tokens decode to "" (skip_special_tokens): a run of them inside a
    # stop string longer than the window of tokens still completes it.
    pieces = {0: "", 1: "w5", 2: " w6", 3: " w7"}

    def decode(ids) -> str:
        return "".join(pieces[i] for i in ids)

    for empty in (5, 27, 40, 200):
        tokens = [3, 1, *[0] * empty, 2, 3]
        assert StopMatch(["w5 w6"], decode).scan(tokens) == empty + 2, empty
        assert StopMatch(["w7w5 w6 w7"], decode).scan(tokens) == empty + 3, empty
        assert StopMatch(["w6 w5"], decode).scan(tokens) is None


@pytest.mark.parametrize("strip_first_space", [False, True])
def test_a_stop_match_reads_the_end_of_the_text_and_finds_what_the_whole_text_holds(
        strip_first_space) -> None:
    # Each check decodes a token with the few before it and reads the end of the
    # text, then the whole text where that holds a stop string: the same token
    # as decoding the whole text at every token, on random texts with tokens
    # that decode to nothing (special tokens, skipped) among them. A decode that
    # drops the space its first token begins with (as sentencepiece decodes do)
    # reads a window's first token unlike the whole text's.
    rng = random.Random(11)
    pieces = {i: piece for i, piece in enumerate(
        ["a", "b", " a", " b", "ab", " ", "ba ", "\u00e9", "b\u00e9a", ""])}

    def decode(ids) -> str:
        text = "".join(pieces[i] for i in ids)
        return text[1:] if strip_first_space and text.startswith(" ") else text

    lengths: list[int] = []
    # (first, a space the decode drops at the start, before a word's own space)
    cases = [([" a"], [5, 2]), ([" a", "  a"], [9, 5, 9, 2]), (["  a"], [5, 9, 5, 2])]
    for _ in range(300):
        cases.append((["".join(rng.choice("ab \u00e9") for _ in range(rng.randint(2, 5)))
                       for _ in range(rng.randint(1, 2))],
                      [rng.choice([rng.randrange(len(pieces)), 9])
                       for _ in range(rng.randint(1, 80))]))
    for stops, tokens in cases:
        expected = next((k for k in range(len(tokens))
                         if stop_position(decode(tokens[:k + 1]), stops) is not None), None)
        match = StopMatch(stops, lambda ids: lengths.append(len(ids)) or decode(ids))
        assert match.scan(tokens) == expected, (stops, tokens)
    # (most checks read two tokens, not the text so far; some read it all, to confirm)
    assert max(lengths) > 28 and sorted(lengths)[len(lengths) * 9 // 10] <= 2


from hf_models import CORPUS, subword_tokenizer  # noqa: E402

from undercurrent.adapters.incremental_text import NO_RUN  # noqa: E402
from undercurrent.adapters.prompts import byte_runs, decode_reach, text_decoder  # noqa: E402


class _Counted:
    """A decode that counts the tokens it is given."""

    def __init__(self, decode) -> None:
        self.decode, self.tokens = decode, 0

    def __call__(self, ids) -> str:
        self.tokens += len(ids)
        return self.decode(ids)


KINDS = ["byte-level", "sentencepiece", "word-level", "wordpiece", "wordpiece, cleaned up",
         "byte-level, cleaned up", "unigram, cleaned up"]
"""Tokenizers whose decodes differ at a window's start, and three that clean up
tokenization spaces ("don ' t" is "don't": a token changes the text before it)."""


def _run_start(ids, runs, decode) -> int:
    """Where the text of the run of byte fallback tokens open at the end of
    ``ids`` begins (NO_RUN: none is open), read from the whole text."""
    first = None
    for index, token in enumerate(ids):
        if runs is not None and token in runs.bytes:
            first = index if first is None else first
        elif runs is None or token not in runs.skipped:
            first = None
    return NO_RUN if first is None else len(decode(ids[:first]))


def _tokenizer(kind: str):
    if kind == "word-level":
        return build_tokenizer()
    name, _, clean_up = kind.partition(", ")
    return subword_tokenizer(name, clean_up=bool(clean_up))


def _token_lists(tokenizer, rng: random.Random) -> list[tuple[bool, list[int]]]:
    """(encoded, ids): the corpus encoded (a character's bytes split across
    tokens, words beginning with a space), with special tokens strewn in, then
    ids at random (not encoded: byte tokens that no character's bytes complete,
    whose text a later byte may change)."""
    specials = list(tokenizer.all_special_ids)
    lists = []
    for text in [*CORPUS, " ".join(CORPUS)]:
        ids = tokenizer(text)["input_ids"]
        strewn = list(ids)
        for _ in range(len(ids) // 3):
            strewn.insert(rng.randrange(len(strewn) + 1), rng.choice(specials))
        lists += [(True, ids), (True, strewn)]
    lists += [(False, [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))])
              for _ in range(100)]
    return lists


@pytest.mark.parametrize("kind", KINDS)
def test_pieces_of_tokens_decoded_as_they_come_are_those_of_the_whole_text(kind) -> None:
    # next_piece decodes each token with a few before it; piece is given the whole
    # text decoded at each token: the same pieces, on texts whose characters span
    # tokens, whose words begin with a space dropped at the start, whose spaces
    # before punctuation a later token cleans up, with special tokens (skipped)
    # between. (No stop string holds U+FFFD: see IncrementalText.)
    tokenizer = _tokenizer(kind)
    decode = text_decoder(tokenizer)
    rng = random.Random(3)
    for encoded, ids in _token_lists(tokenizer, rng):
        text = decode(ids)
        some = text.replace("\ufffd", "")
        stops = [[], [some[-3:]] if some else [], ["\u00e9", "\U0001F600"],
                 [some[start:start + rng.randint(1, 4)]
                  for start in (rng.randrange(len(some) + 1), len(some) // 2)]][rng.randrange(4)]
        reach, runs = decode_reach(tokenizer), byte_runs(tokenizer)
        whole, incremental = StreamText(stops, reach=reach), StreamText(stops, decode, reach, runs)
        expected = [whole.piece(decode(ids[:count]), _run_start(ids[:count], runs, decode))
                    for count in range(1, len(ids) + 1)]
        pieces = [incremental.next_piece(ids[:count]) for count in range(1, len(ids) + 1)]
        assert pieces == expected, (ids, stops)
        cut = stop_position(text, stops)
        final = text if cut is None else text[:cut]
        rest = incremental.rest(final)
        assert whole.rest(final) == rest
        if encoded or not stops:
            assert "".join(pieces) + rest == final


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_decodes_each_token_with_a_few_before_it(kind) -> None:
    # The tokens given to decode grow with the text, not with its square.
    tokenizer = _tokenizer(kind)
    ids = tokenizer(" ".join(CORPUS * 40))["input_ids"]
    for length in (len(ids) // 4, len(ids)):
        decode = _Counted(text_decoder(tokenizer))
        stream = StreamText(["zz"], decode, decode_reach(tokenizer))
        for count in range(1, length + 1):
            stream.next_piece(ids[:count])
        assert decode.tokens <= 8 * length, (length, decode.tokens)


@pytest.mark.parametrize("stops", [[], ["zz"]])
def test_a_run_of_apostrophes_a_clean_up_pairs_is_decoded_at_the_same_cost_per_token(
        stops) -> None:
    # " ' " is "'": in "' ' ' '" the clean-up pairs the apostrophes from the first,
    # so the text of a window of the last few differs from the whole text's at
    # every other token. Each token is still decoded with a few before it (the
    # whole text was decoded at every token), and the pieces are the whole text's.
    tokenizer = subword_tokenizer("wordpiece", clean_up=True)
    quote, decode = tokenizer.convert_tokens_to_ids("'"), text_decoder(tokenizer)
    for length in (200, 1600):
        ids = [quote] * length
        counted = _Counted(decode)
        stream = StreamText(stops, counted, decode_reach(tokenizer))
        pieces = [stream.next_piece(ids[:count]) for count in range(1, length + 1)]
        # (28 tokens a token while an overlap or a step going back began on the
        # wrong one of a pair: the overlap was the whole window, and half the
        # steps decoded both overlaps; now 17)
        assert counted.tokens <= 20 * length, (length, counted.tokens)
        assert "".join(pieces) + stream.rest(decode(ids)) == decode(ids)
    whole = StreamText(stops, reach=decode_reach(tokenizer))
    assert pieces[:300] == [whole.piece(decode(ids[:count])) for count in range(1, 301)]


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "wordpiece, cleaned up"])
@pytest.mark.parametrize("stop", [False, True])
def test_a_stream_on_a_subword_tokenizer_sends_the_pieces_of_its_whole_text(kind, stop) -> None:
    # A random model's tokens: characters split across byte tokens, words that
    # begin with a space; each token decoded with a few before it. Its bytes at
    # random need not make characters: a later byte may turn a byte fallback
    # run's characters into U+FFFD, so the run's text is held back until the
    # run closes, and the pieces join into the output's text.
    tokenizer = _tokenizer(kind)
    with ProbedModel(build_model("llama", vocab=len(tokenizer)), tokenizer) as pm:
        decode = pm.backend.decode
        text = pm.generate([CORPUS[3]], max_new_tokens=300)[0].text
        stops = [text[len(text) // 2:len(text) // 2 + 3]] if stop else []
        counted = pm.backend.decode = _Counted(decode)
        events = list(pm.stream(CORPUS[3], max_new_tokens=300, stop=stops))
    output = events[-1].output
    ids = output.token_ids
    whole, runs = StreamText(stops, reach=decode_reach(tokenizer)), byte_runs(tokenizer)
    assert [event.text for event in events[:-1]] == [
        whole.piece(decode(ids[:count]), _run_start(ids[:count], runs, decode))
        for count in range(1, len(ids) + 1)]
    assert events[-1].text == whole.rest(output.text)
    assert "".join(event.text for event in events) == output.text
    # (the cleaned-up WordPiece tokenizer is trained anew in each process, its ties
    # broken in hash order: the random model may then sample its eos early)
    assert output.finish_reason == "stop" if stop else (
        len(ids) > 50 or output.finish_reason == "eos")
    if not stop:  # (the stop strings' own checks decode too)
        assert counted.tokens <= 8 * len(ids), (len(ids), counted.tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_match_finds_what_the_whole_text_holds_on_subword_tokenizers(kind) -> None:
    # The first token after which the whole text decoded holds a stop string (an
    # eos token completes none), with special tokens strewn in and ids at random.
    # (No stop string holds U+FFFD: one may be found later while a byte fallback
    # run is open, see IncrementalText.)
    tokenizer = _tokenizer(kind)
    decode, eos = text_decoder(tokenizer), {tokenizer.eos_token_id}
    rng = random.Random(4)
    for _, ids in _token_lists(tokenizer, rng):
        text = decode(ids).replace("\ufffd", "")
        stops = [text[start:start + rng.randint(1, 4)]
                 for start in (rng.randrange(len(text) + 1), len(text) // 2)]
        expected = next((k for k in range(len(ids)) if ids[k] not in eos
                         and stop_position(decode(ids[:k + 1]), stops) is not None), None)
        assert StopMatch(stops, decode, eos, decode_reach(tokenizer)).scan(ids) == expected, (
            ids, stops)


def test_a_stop_match_reads_a_run_of_special_tokens_at_the_same_cost_per_token() -> None:
    # Tokens that decode to nothing (<unk>, skipped) leave the window: the tokens
    # given to decode grow with the generation, not with its cube.
    model, tokenizer = own_model("llama"), build_tokenizer()
    unk = tokenizer.unk_token_id
    model.lm_head.register_forward_hook(lambda module, args, out: out + torch.nn.functional.one_hot(
        torch.tensor(unk), out.shape[-1]).to(out.dtype) * 1e4)
    with ProbedModel(model, tokenizer) as pm:
        decode = pm.backend.decode
        for length in (100, 400):
            counted = pm.backend.decode = _Counted(decode)
            output = pm.generate([prompt(1, 2)], max_new_tokens=length, stop=["w5 w6"])[0]
            assert set(output.token_ids) == {unk} and len(output.token_ids) == length
            assert counted.tokens <= 4 * length, (length, counted.tokens)


@pytest.mark.parametrize("kind", ["wordpiece, cleaned up", "byte-level, cleaned up"])
def test_a_stop_string_that_a_clean_up_of_spaces_completes_ends_the_generation(kind) -> None:
    # "don ' t" decodes to "don't": its last token joins the two tokens before
    # it. A model made to generate the tokens of "the cat ran. don't stop" stops
    # at the stop strings its whole text holds, and streams that text.
    tokenizer = _tokenizer(kind)
    decode = text_decoder(tokenizer)
    forced = tokenizer("the cat ran . don ' t stop", add_special_tokens=False)["input_ids"]
    assert decode(forced) == "the cat ran. don't stop"
    model = copy.deepcopy(build_model("llama", vocab=len(tokenizer)))
    steps = []

    def force(module, args, out):  # (the n-th forward's logits pick forced[n])
        steps.append(len(steps))
        pick = torch.tensor(forced[min(len(steps) - 1, len(forced) - 1)])
        return out + torch.nn.functional.one_hot(pick, out.shape[-1]).to(out.dtype) * 1e4

    model.lm_head.register_forward_hook(force)
    with ProbedModel(model, tokenizer) as pm:
        for stop, before in [("don't", "the cat ran. "), ("ran.", "the cat "),
                             ("n't s", "the cat ran. do"), ("ran. d", "the cat ")]:
            steps.clear()
            output = pm.generate([CORPUS[0]], max_new_tokens=len(forced), stop=[stop])[0]
            assert (output.finish_reason, output.text) == ("stop", before), stop
            assert decode(output.token_ids).startswith(before + stop)
            assert stop not in decode(output.token_ids[:-1])
            # (the stream sends none of the stop string the clean-up completes:
            # "the cat ran. don '" sends no " don" before "t" makes it "don't")
            steps.clear()
            events = list(pm.stream(CORPUS[0], max_new_tokens=len(forced), stop=[stop]))
            assert "".join(event.text for event in events) == events[-1].output.text == before, (
                stop, [event.text for event in events])
        steps.clear()
        events = list(pm.stream(CORPUS[0], max_new_tokens=len(forced)))
    assert "".join(event.text for event in events) == events[-1].output.text == decode(forced)


def test_a_stream_holds_back_an_apostrophe_a_later_token_puts_a_space_before() -> None:
    # A Unigram decode cleaned up: "the cat ' " is "the cat'" (" ' " is "'"), but
    # with "," after it, " ," is cleaned first and " ' " no longer matches: "the
    # cat ',". The "'" is held back, so what was sent begins the text at each token.
    tokenizer = subword_tokenizer("unigram", clean_up=True)
    decode, vocab = text_decoder(tokenizer), tokenizer.get_vocab()
    ids = tokenizer("the cat", add_special_tokens=False)["input_ids"] + [
        vocab["\u2581"], vocab["'"], vocab["\u2581"], vocab[","]]
    assert [decode(ids[:count]) for count in (len(ids) - 1, len(ids))] == ["the cat'", "the cat ',"]
    stream = StreamText([], decode, decode_reach(tokenizer), byte_runs(tokenizer))
    sent = ""
    for count in range(1, len(ids) + 1):
        sent += stream.next_piece(ids[:count])
        assert decode(ids[:count]).startswith(sent), (count, sent)
    assert sent + stream.rest(decode(ids)) == "the cat ',"


CLEAN_UP_KINDS = ["wordpiece, cleaned up", "byte-level, cleaned up", "unigram, cleaned up"]
"""Tokenizers whose decode cleans up tokenization spaces."""


@pytest.mark.parametrize("kind", CLEAN_UP_KINDS)
def test_a_run_of_apostrophes_is_paired_from_its_first_as_in_the_whole_text(kind) -> None:
    # " ' " is "'", replaced from the left: "' ' ' ' " is "'''' " from its first
    # space and "''''" from the next, so a window beginning inside the run (a
    # Unigram decode reads "\u2581" and "'" as tokens of their own) can read its
    # text consistently and wrongly; after such a run, " n ' t" drops the space
    # before "n" that the run's last pair left or took, three characters before
    # the "t" (a window read "''''n" there, the text "''''' n"). Each token's
    # pieces are those of the whole text, and the stop match finds the first
    # token whose whole text holds the stop string.
    tokenizer = _tokenizer(kind)
    decode, reach, eos = text_decoder(tokenizer), decode_reach(tokenizer), {tokenizer.eos_token_id}
    for text in ["she ' s" + " '" * 30 + " hi", "x" + " '" * 41 + " ,", "do n ' t" + " '" * 12,
                 *("'" + " '" * count + " n ' t" for count in (6, 8, 10))]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        texts = [decode(ids[:count]) for count in range(1, len(ids) + 1)]
        for stops in [[], ["'' h"], ["''' ,"], [texts[-1][-5:]]]:
            whole, stream = StreamText(stops, reach=reach), StreamText(stops, decode, reach)
            pieces = [stream.next_piece(ids[:count]) for count in range(1, len(ids) + 1)]
            assert pieces == [whole.piece(texts[count]) for count in range(len(ids))], (text, stops)
            end = next((count for count in range(len(ids))
                        if stop_position(texts[count], stops) is not None), None)
            assert StopMatch(stops, decode, eos, reach).scan(ids) == end, (text, stops)


@pytest.mark.parametrize("kind", CLEAN_UP_KINDS)
def test_streams_and_stop_strings_on_punctuation_a_clean_up_rewrites_match_the_whole_text(
        kind) -> None:
    # Ids drawn at random from the tokens the clean-up reads (apostrophes,
    # punctuation, "n", "t", "s", spaces of their own, special tokens): the
    # stop match finds the first token after which the whole text holds a stop
    # string, and the stream's pieces (to that token) each begin the text of
    # the tokens so far and join into the output's text.
    tokenizer = _tokenizer(kind)
    decode, reach, runs = text_decoder(tokenizer), decode_reach(tokenizer), byte_runs(tokenizer)
    eos, vocab = {tokenizer.eos_token_id}, tokenizer.get_vocab()
    pool = [vocab[token] for token in [
        "'", "n", "t", "s", "ve", "re", "m", ".", ",", "!", "?", "do", "a", "\u2581'", "\u2581n",
        "\u2581t", "\u2581.", "\u2581", "\u0120'", "\u0120n", "\u0120.", "\u0120", "##n",
        "##t", "##s", "'t", "##'"] if token in vocab]
    pool += list(tokenizer.all_special_ids)
    rng = random.Random(5)
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(20, 70))]
        some = decode(ids)
        stops = ([some[start:start + rng.randint(1, 4)] for start in (rng.randrange(len(some)),)]
                 if some and rng.random() < 0.6 else [])
        end = next((k for k in range(len(ids)) if ids[k] not in eos
                    and stop_position(decode(ids[:k + 1]), stops) is not None), None)
        assert StopMatch(stops, decode, eos, reach).scan(ids) == end, (ids, stops)
        generated = ids if end is None else ids[:end + 1]
        stream, sent = StreamText(stops, decode, reach, runs), ""
        for count in range(1, len(generated) + 1):
            sent += stream.next_piece(generated[:count])
            assert decode(generated[:count]).startswith(sent), (generated[:count], stops, sent)
        whole = decode(generated)
        cut = stop_position(whole, stops)
        final = whole if cut is None else whole[:cut]
        assert sent + stream.rest(final) == final, (generated, stops, sent)


def test_the_decode_reaches_back_only_where_it_cleans_up_spaces() -> None:
    # GPT-2's configs set clean_up_tokenization_spaces, which transformers 5 ignores
    # for a BPE model: such a tokenizer is read a token at a time, and decoded by its
    # backend, as one that does not set it (a stream held back a short word's text)
    from transformers import PreTrainedTokenizerFast

    plain = subword_tokenizer("byte-level")
    declined = PreTrainedTokenizerFast(tokenizer_object=plain.backend_tokenizer,
                                       clean_up_tokenization_spaces=True)
    ids = declined.encode("don't stop: it's 3.14")
    assert declined.decode(ids) == plain.decode(ids)  # (no clean-up applied)
    assert decode_reach(declined) == decode_reach(plain) == 0
    assert isinstance(text_decoder(declined), functools.partial)  # (the backend's own)
    assert decode_reach(subword_tokenizer("byte-level", clean_up=True)) == 4
    assert decode_reach(subword_tokenizer("wordpiece", clean_up=True)) == 4
    assert decode_reach(subword_tokenizer("wordpiece")) == 0
    assert decode_reach(subword_tokenizer("unigram", clean_up=True)) == 4


def test_byte_runs_are_found_where_the_decode_reads_a_run_of_byte_tokens_as_one() -> None:
    # Llama 2's and Mistral's decode (ByteFallback): "<0xE6> <0x97> <0xA5>" is
    # "日", and with "<0xE6>" after it, U+FFFD for each of the four bytes.
    tokenizer = subword_tokenizer("sentencepiece")
    runs = byte_runs(tokenizer)
    assert runs is not None and len(runs.bytes) == 256
    assert runs.skipped == set(tokenizer.all_special_ids)
    ids = tokenizer.convert_tokens_to_ids(["<0xE6>", "<0x97>", "<0xA5>", "<0xE6>"])
    assert set(ids) <= runs.bytes
    assert (text_decoder(tokenizer)(ids[:3]), text_decoder(tokenizer)(ids)) == ("日", "\ufffd" * 4)
    # (byte-level BPE: a byte's token is its own text; none at all elsewhere)
    for kind in ["byte-level", "wordpiece", "word-level"]:
        assert byte_runs(_tokenizer(kind)) is None, kind


def _byte_heavy_lists(tokenizer, rng: random.Random) -> list[list[int]]:
    """Token ids mostly byte fallback tokens: runs of characters' bytes, cut
    anywhere (a character's bytes incomplete at the run's end or at the end of
    the ids), invalid bytes, special tokens (skipped) inside runs, words between."""
    runs = byte_runs(tokenizer)
    assert runs is not None
    byte = dict(zip(range(256), tokenizer.convert_tokens_to_ids(
        [f"<0x{value:02X}>" for value in range(256)]), strict=True))
    words = tokenizer("the cat ran", add_special_tokens=False)["input_ids"]
    lists = [tokenizer("the 日本語", add_special_tokens=False)["input_ids"][:7],
             [byte[0x57], byte[0x84]], [byte[0x84], byte[0x57]], [byte[0xE6], words[0]]]
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(1, 6)):
            choice = rng.random()
            if choice < 0.5:
                text = "".join(rng.choice("a日é😀本 ") for _ in range(rng.randint(1, 3)))
                ids += [byte[value] for value in text.encode()]
            elif choice < 0.65:
                ids.append(byte[rng.randrange(256)])  # (a byte no character may complete)
            elif choice < 0.75:
                ids.append(rng.choice(sorted(runs.skipped)))
            else:
                ids.append(rng.choice(words))
        lists.append(ids[:rng.randint(1, len(ids))])  # (cut anywhere)
    return lists


@pytest.mark.parametrize("stop", [False, True])
def test_a_stream_holds_back_an_open_byte_fallback_run_so_its_pieces_join_into_the_output(
        stop) -> None:
    # A later byte of a run of byte fallback tokens may turn the characters
    # before it into U+FFFD ("the 日" then 本's first two bytes: "the �����"):
    # the pieces streamed as the backends stream them (to the token after which
    # the whole text first holds a stop string) joined, with the final event's
    # rest of the output's text, are the output's text, on random byte-heavy ids.
    tokenizer = subword_tokenizer("sentencepiece")
    decode, runs, reach = text_decoder(tokenizer), byte_runs(tokenizer), decode_reach(tokenizer)
    rng = random.Random(7)
    for ids in _byte_heavy_lists(tokenizer, rng):
        text = decode(ids)
        some = text.replace("\ufffd", "")
        stops = ([some[start:start + rng.randint(1, 3)] for start in (
            rng.randrange(len(some) + 1), len(some) // 2)] if stop and some else [])
        end = StopMatch(stops, decode, reach=reach).scan(ids)
        generated = ids if end is None else ids[:end + 1]
        stream = StreamText(stops, decode, reach, runs)
        pieces = [stream.next_piece(generated[:count]) for count in range(1, len(generated) + 1)]
        whole = decode(generated)
        cut = stop_position(whole, stops)
        final = whole if cut is None else whole[:cut]
        assert "".join(pieces) + stream.rest(final) == final, (ids, stops, pieces)
        # (a piece held back while its run is open, then sent: no U+FFFD sent
        # that the output's text does not hold)
        assert "".join(pieces) == final[:len("".join(pieces))], (ids, stops, pieces)


def test_a_stream_that_ends_inside_a_byte_fallback_run_joins_into_the_output_text() -> None:
    # A model made to generate "the 日本語" stops (max_new_tokens) after 本's
    # first two bytes: the output's text is "the " and U+FFFD for each of the
    # run's bytes, 日's included; the stream sent "the ", never "日".
    tokenizer = subword_tokenizer("sentencepiece")
    decode = text_decoder(tokenizer)
    byte = tokenizer.convert_tokens_to_ids
    cases = [tokenizer("the 日本語", add_special_tokens=False)["input_ids"][:7],
             [byte("<0x57>"), byte("<0x84>")],
             tokenizer("the 日本語 cat", add_special_tokens=False)["input_ids"]]
    assert decode(cases[0]) == "the " + "\ufffd" * 5 and decode(cases[1]) == "\ufffd" * 2
    model = copy.deepcopy(build_model("llama", vocab=len(tokenizer)))
    forced: list[int] = []
    steps = []

    def force(module, args, out):  # (the n-th forward's logits pick forced[n])
        steps.append(len(steps))
        if not forced:  # (a forward before any generation)
            return out
        pick = torch.tensor(forced[min(len(steps) - 1, len(forced) - 1)])
        return out + torch.nn.functional.one_hot(pick, out.shape[-1]).to(out.dtype) * 1e4

    model.lm_head.register_forward_hook(force)
    with ProbedModel(model, tokenizer) as pm:
        for ids in cases:
            forced[:], steps[:] = ids, []
            events = list(pm.stream(CORPUS[0], max_new_tokens=len(ids)))
            output = events[-1].output
            assert list(output.token_ids) == ids
            assert "".join(event.text for event in events) == output.text == decode(ids), ids
    assert "".join(event.text for event in events[:-1]) == "the 日本語 cat"
