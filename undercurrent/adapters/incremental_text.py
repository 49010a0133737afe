"""A request's generated text, decoded as its tokens come, at a cost per token
that does not grow with the text (what a stream's pieces and the stop strings
are read from; decoding the whole text at every token costs the square of its
length)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from undercurrent.adapters.prompts import ByteRuns

REPLACEMENT = "\ufffd"
"""What a decode gives for the bytes of a character not complete yet (a byte-level
tokenizer splits an emoji or a CJK character across tokens)."""


OPEN = 8
"""How many tokens whose text ends in U+FFFD :class:`IncrementalText` keeps
open (a character's bytes span four tokens at most: past that, the bytes are
not a character, as a byte fallback run with an invalid byte stays U+FFFD)."""

NO_RUN = 2**62
""":attr:`IncrementalText.run_start` while no run of byte fallback tokens is open."""

MARKS = 16
"""How many of the last steps that took text :class:`IncrementalText` can go
back to, where a token changed the text before it."""


class IncrementalText:
    """``decode(tokens)`` as the tokens come, one :meth:`step` per token, each
    decoding a few tokens only (as transformers' ``TextStreamer`` and vLLM's
    incremental detokenizer do).

    A step decodes the *window*: the *overlap* (the last tokens that gave
    text: a decode that drops the space its first token begins with, as
    sentencepiece's does, drops it from their text, not from the new token's)
    and the tokens after it; the text the window decodes to past the
    overlap's own is the new end of the text. Tokens that add no text (special
    tokens, skipped; before any text, those that add none twice over either)
    leave the window; text that ends in U+FFFD (a character
    whose bytes are not all in yet) stays open until a later token completes
    it, or for :data:`OPEN` tokens (a token that changes it after is found as
    below).

    Where the window's text does not begin with the overlap's own, the new
    token changed the text before it. Where the window's text ends in U+FFFD
    (sentencepiece's byte fallback gives U+FFFD for every byte of a run of
    byte tokens, complete characters included, until the last character is
    complete), the text ends in U+FFFD until a later token completes it. Else
    the step goes back over the tokens of the last steps that took text (up
    to :data:`MARKS` of them, then to the first token) until the text of
    those before them is how their window's begins: it reports the text from
    there on.

    What a token's text depends on is decoded with it, however far back: a
    run of byte fallback tokens that holds a byte no character has is U+FFFD
    for each of its bytes, so its tokens are decoded with the whole run (the
    run's cost grows with its square; the text's elsewhere does not).

    A decode that cleans up tokenization spaces (transformers'
    ``clean_up_tokenization_spaces``: ``"do n ' t"`` is ``"don't"``) drops
    spaces before a token's own text, up to ``reach`` characters back: the
    overlap then holds the last tokens that gave text whose text past the
    first of them (whose own may differ at the window's start) holds the
    first space among the text's last ``reach`` characters, and a step going
    back decodes ``reach`` characters past the first before the mark it goes
    back to (or from one token earlier, where those do not read as the window
    does: a run of ``" ' "`` is cleaned up in pairs from its first token; the
    one that read as the window the last time is tried first). The overlap
    likewise begins a token earlier where its text from the first of those
    steps does not end as the window's. Either begins only where its own text
    ends as the text does at its end (its last ``reach`` characters, or two
    where it holds only spaces and ``'``: a window beginning inside a run of
    ``" '"`` pairs it as the whole text does only an even number of pairs past
    the run's first space, and else reads the tokens after it wrongly, yet
    consistently; see :meth:`_pairs_as_whole`); else the overlap stays the
    window, and a step going back tries the marks before.

    Given ``runs`` (:func:`~undercurrent.adapters.prompts.byte_runs`: the
    decode reads a run of byte fallback tokens as one), :attr:`run_start` is
    where the text of the run still open begins: a later byte of the run may
    turn all of its text into U+FFFD, the characters that were complete
    included, so what reads the text holds that part back until a token that
    is no byte token (nor a special token the decode skips) closes the run.

    :attr:`tail` holds the text from :attr:`tail_start` on: at least ``keep``
    characters before the part a later step may change (what a stop string
    ending in the next token, or a piece held back, can reach), and the text
    of the open run of byte fallback tokens."""

    __slots__ = ("decode", "keep", "reach", "runs", "run_start", "count", "ids", "overlap",
                 "overlap_text", "groups", "stable", "solid", "marks", "earlier", "tail",
                 "tail_start")

    def __init__(self, decode: Callable[[Sequence[int]], str], keep: int = 0,
                 reach: int = 0, runs: ByteRuns | None = None) -> None:
        self.decode = decode
        self.keep = keep
        self.reach = reach
        self.runs = runs
        self.run_start = NO_RUN
        """Where the text of the open run of byte fallback tokens begins
        (:data:`NO_RUN`: none is open)."""
        self.count = 0
        """How many tokens the steps have taken."""
        self.ids: list[int] = []  # the window: the overlap's ids, then those after it
        self.overlap = 0  # (how many of ids)
        self.overlap_text = ""  # decode(ids[:overlap])
        # (token count, text length) of each step that took text whose tokens end
        # the overlap, the earliest first
        self.groups: list[tuple[int, int]] = []
        self.stable = 0
        """The length of the text up to the overlap's end: no later step changes it
        (but one whose token changes the text before it)."""
        self.solid = 0  # (stable, less any U+FFFD it ends with)
        # (token count, text length) after each of the last steps that took text
        self.marks: list[tuple[int, int]] = [(0, 0)]
        self.earlier = 0  # (whether the last step going back began a token before its mark)
        self.tail = ""
        self.tail_start = 0

    def step(self, tokens: Sequence[int]) -> int:
        """Take ``tokens[count]`` (``tokens``: the request's tokens so far, or more):
        returns the index from which the text changed (the text before it is as it
        was; :attr:`tail` holds the new text past it, and ``keep`` characters
        before the text the last step left unchanged for good)."""
        settled = min(self.solid, self.marks[0][1], self.run_start) - self.keep
        if settled > self.tail_start:  # (what no later step can reach)
            self.tail, self.tail_start = self.tail[settled - self.tail_start:], settled
        ids = self.ids
        token = int(tokens[self.count])
        ids.append(token)
        self.count += 1
        runs = self.runs
        if runs is not None:
            if token in runs.bytes:
                if self.run_start == NO_RUN:  # (the run's text begins where the text ends)
                    self.run_start = self.tail_start + len(self.tail)
            elif token not in runs.skipped:
                self.run_start = NO_RUN
        window = self.decode(ids)
        start = self.stable
        if window.startswith(self.overlap_text):
            self._take(window, window[len(self.overlap_text):], start, ids[self.overlap:])
        elif window.endswith(REPLACEMENT):
            # (the text ends in U+FFFD either way, and is read again once the
            # character completes)
            self.tail = self.tail[:start - self.tail_start] + REPLACEMENT
        else:
            start = self._go_back(tokens)
        return start

    def _take(self, window: str, new: str, start: int, after: list[int]) -> None:
        """Take ``new``, the text past ``start`` of the tokens ``after`` the
        overlap (``window``: their text with the overlap's)."""
        self.tail = self.tail[:start - self.tail_start] + new
        if not new:
            # (they add no text: special tokens, skipped; before any text, tokens
            # whose text is a space the decode drops at the start, as
            # sentencepiece's does, give text after another: they stay)
            if self.overlap_text or not self.decode(after + after):
                self.ids = self.ids[:self.overlap]
        elif not new.endswith(REPLACEMENT) or len(after) > OPEN:
            # (their own text, with those of the last steps before that hold a
            # space among the last `reach` characters, past the first step's:
            # the overlap of the next step, where it is the end of the window's;
            # else the window stays the overlap)
            groups = self.groups
            groups.append((len(after), len(new)))
            space = window.find(" ", max(len(window) - self.reach, 0)) if self.reach else -1
            held = len(window) - space if space >= 0 else 0
            while len(groups) > 1 and sum(length for _, length in groups[2:]) >= held:
                del groups[0]
            size = sum(count for count, _ in groups)
            # (past the first step's text, which may differ at the window's start)
            later = sum(length for _, length in groups[1:])
            decoded = len(groups) > 1 or bool(self.overlap_text)
            self.overlap_text = window
            # (and, where the decode cleans up spaces, from the token before: a run
            # of " ' " is cleaned up in pairs from its first token)
            end = start + len(new)
            for extra in (0, 1) if self.reach and size < len(self.ids) else (0,):
                kept = self.ids[len(self.ids) - size - extra:]
                text = self.decode(kept) if decoded or extra else new
                if text and later <= len(text) and window.endswith(text[len(text) - later:]
                                                                  if later else text) \
                        and self._pairs_as_whole(text, end):
                    self.ids, self.overlap_text = kept, text
                    groups[0] = (groups[0][0] + extra, groups[0][1])
                    break
            self.overlap = len(self.ids)
            self.stable = start + len(new)
            self.solid = start + len(new.rstrip(REPLACEMENT))
            self.marks.append((self.count, self.stable))
            del self.marks[:-MARKS]

    def _go_back(self, tokens: Sequence[int]) -> int:
        """The new token changed the text before it: decode again from the
        latest mark whose text the tokens since the mark before it begin with
        (from the first token, where none does); returns where the text changed."""
        marks = self.marks
        for index in range(len(marks) - 2, 0, -1):
            first, start = marks[index]
            # (the tokens of the step before the mark, and of those before it
            # until the text after the first of them holds `reach` characters)
            earliest = index - 1
            while earliest > 0 and start - marks[earliest + 1][1] < self.reach:
                earliest -= 1
            mark = marks[earliest][0]
            # (and, where the decode cleans up spaces, from the token before: in a
            # run of " ' " the clean-up pairs its tokens from the first, so a window
            # of an even number of them never reads as it does after one more;
            # marks one token apart are gone once a step went back over two)
            # (the one that read as the window last time first: in such a run the
            # marks keep the same parity)
            for earlier in (self.earlier, 1 - self.earlier) if self.reach and mark else (0,):
                overlap = list(tokens[mark - earlier:first])
                text = self.decode(overlap)
                window = self.decode([*overlap, *tokens[first:self.count]])
                if text and window.startswith(text) and self._pairs_as_whole(text, start):
                    del marks[index + 1:]
                    self.earlier = earlier
                    return self._restart(tokens, overlap, text, window, first, start)
        return self.resync(tokens[:self.count])

    def _pairs_as_whole(self, text: str, end: int) -> bool:
        """Whether a window that begins with tokens whose own text is ``text``
        (the text's first ``end`` characters end with theirs) cleans up the
        ``" ' "`` of a run past them as the whole text does.

        The clean-up replaces ``" ' "`` from the left, so in a run of ``" '"`` it
        joins the pairs from the run's first space: a window that begins inside
        the run joins the same pairs, and reads the tokens after it as the whole
        text does, only where it begins an even number of pairs past that space
        (``"' ' ' ' "`` is ``"'''' "`` from its first space, ``"''''"`` from
        the next). Their text tells which: past a character other than a space
        or ``'`` the window reads as the whole text does from any start, but the
        space just before it is the run's last, which the window may have taken
        where the text kept it (``"' ' ' ' n"`` is ``"''''n"``, in the text
        ``"''''' n"``, and a ``"'t"`` after it drops that space), so their last
        ``reach`` characters must be the text's; in a run, both join all its
        spaces but the last, which one of them leaves where they began an odd
        number of pairs apart (``" '"`` or ``"' "`` against ``"''"`` or
        ``"'"`` at the end), so their last two must be. Where neither shows (a
        text of one ``'``, or the text before it not held), the window is taken
        to pair otherwise."""
        if not self.reach:
            return True
        size = min(len(text), self.reach) if text.strip("' ") else 2
        held = end - self.tail_start
        return len(text) >= size and held >= size and self.tail[held - size:held] == text[-size:]

    def resync(self, tokens: Sequence[int]) -> int:
        """Decode ``tokens`` (the request's tokens so far) whole, and step on from
        their text; returns 0 (the index from which the text changed)."""
        self.count = len(tokens)
        self.marks[:] = [(0, 0)]
        self.tail, self.tail_start = "", 0
        return self._restart(tokens, [], "", self.decode(tokens), 0, 0)

    def _restart(self, tokens: Sequence[int], overlap: list[int], text: str, window: str,
                 first: int, start: int) -> int:
        """Step on from the mark of ``first`` tokens and ``start`` characters, with
        ``overlap`` (whose text is ``text``) before it, whose ``window`` with the
        tokens since is read."""
        after = list(tokens[first:self.count])
        self.ids, self.overlap, self.overlap_text = [*overlap, *after], len(overlap), text
        self.groups = [(len(overlap), len(text))] if overlap else []
        self.stable = self.solid = start
        self._take(window, window[len(text):], start, after)
        return start
