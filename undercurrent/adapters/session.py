"""Backend-neutral capture bookkeeping: which tokens each request's points want,
activations batched and routed, aborts, and the per-prompt output at the end.

A backend drives one :class:`CaptureSession` per ``generate()``/``stream()`` call:

1. ``open_request(id, prompt, prompt_token_ids)`` when a prompt is tokenized
   (registers it with the router);
2. before each forward, a :class:`StepPlan` says which (layer, tensor type) pairs
   anything wants and where in the engine's batch the wanted tokens sit
   (``plan.add_window(state, start, stop, slot_of)``): one :class:`PlanMatch`
   per (request, token, point), and per pair a :class:`CaptureGroup` of slots;
3. after the forward, ``deliver(batches)`` takes, per captured (layer, tensor
   type), the tensor type, the group and the gathered rows,
   builds one :class:`~undercurrent.records.ActivationBatch` per extraction
   point across every request and routes it with one
   :meth:`~undercurrent.router.Router.route_columns` call (see
   :mod:`undercurrent.adapters.delivery`); an ``abort`` signal stops that
   request;
4. ``add_token`` as tokens are sampled, ``close_request`` at the end.

Matching is arithmetic on the position selectors (no loop over tokens), and a
point stops costing anything once it can match no later token.

Live edits ride the same plan: each request carries its resolved edits; the plan
says, per (layer, tensor type), which slots each edit changes in this forward
(the hook applies them before it captures, so a capture at the same site sees
the edited value). A triggered edit (``when``) is armed by a signal routed here
and takes part in planning from the next forward on.
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from undercurrent.adapters.delivery import (
    PlanMatch,
    RecordLog,
    SignalLog,
    deliver_forward,
    flush_window,
)
from undercurrent.adapters.edit_log import EditLog
from undercurrent.adapters.incremental_text import NO_RUN, REPLACEMENT, IncrementalText
from undercurrent.adapters.outputs import AbortInfo, AppliedEdit, GenerationOutput, TokenSignal
from undercurrent.adapters.prompts import ByteRuns, plain_ids
from undercurrent.probes.base import RequestContext
from undercurrent.records import LazySequence, ProbeResult, SignalAction, built
from undercurrent.spec.types import Edit, ExtractionPoint, TensorType

if TYPE_CHECKING:  # annotations only: the session imports no router at run time
    from undercurrent.router.protocol import SessionRouter

PairKey = tuple[int, TensorType]


def _tokens_in_window(point: ExtractionPoint | Edit, prompt_len: int, start: int,
                      stop: int) -> range:
    """Absolute token indices in ``[start, stop)`` that ``point`` selects."""
    selector = point.position
    if not selector.is_continuous:
        target = selector.target_index(prompt_len)
        if target is None or not start <= target < stop:
            return range(0)
        return range(target, target + 1)
    # Continuous selectors match generated tokens only: generated index g sits at
    # absolute index prompt_len + g.
    first_g = max(start - prompt_len, selector.start, 0)
    stop_g = stop - prompt_len
    if selector.stop is not None:
        stop_g = min(stop_g, selector.stop)
    if first_g >= stop_g:
        return range(0)
    stride = point.stride
    first_g += (-(first_g - selector.start)) % stride
    return range(prompt_len + first_g, prompt_len + stop_g, stride)


def _absolute_selector(point: ExtractionPoint, prompt_len: int
                       ) -> tuple[int, int | None, int, int, int | None]:
    """``point``'s selector in absolute token indices: (first, end, base, stride,
    target). A single-token selector matches only ``target`` (-1: none); a
    continuous one matches ``first <= t < end`` (end None: unbounded) with
    ``(t - base) % stride == 0``. What :func:`_tokens_in_window` computes for
    a window, for one token at a time."""
    selector = point.position
    if not selector.is_continuous:
        target = selector.target_index(prompt_len)
        return 0, None, 0, 1, -1 if target is None else target
    base = prompt_len + selector.start
    first = prompt_len + max(selector.start, 0)
    end = None if selector.stop is None else prompt_len + selector.stop
    return first, end, base, point.stride, None


def _steady_from(selectors: Iterable[tuple[int, int | None, int, int, int | None]]
                 ) -> tuple[int, int, int | None] | None:
    """``(first, stride, until)``: from token index ``first`` on, and before
    ``until`` (None: for good), every one of ``selectors`` (from
    :func:`_absolute_selector`) matches every ``stride`` th token, ``first``
    among them, and none matches the tokens between (None when one of them
    picks one token, when their strides or their phases differ, or when no
    token is left before one ends)."""
    first, stride, base, until = 0, None, 0, None
    for start, end, phase, each, target in selectors:
        if target is not None:
            return None
        if stride is None:
            stride, base = each, phase
        elif each != stride or (phase - base) % stride:
            return None
        first = max(first, start)
        if end is not None:
            until = end if until is None else min(until, end)
    if stride is None:
        return first, 1, None
    first += (base - first) % stride
    if until is not None and first >= until:
        return None
    return first, stride, until


def _steady_with_edits(steady: tuple[int, int, int | None] | None, edits: Sequence[Any],
                       prompt_len: int, armed: Mapping[str, int] | None = None
                       ) -> tuple[int, int, int | None] | None:
    """:func:`_steady_from` 's ``(first, stride, until)`` of a request's points
    (``(0, 1, None)`` for none) once its ``edits`` are planned too: from
    ``first`` on, and before ``until``, every token gets the same edits.
    An edit that applies to no token from ``first`` on (a prompt token's, a
    slice that has ended) changes nothing; one that starts later ends the
    steps at its first token; one that is on at ``first`` must select the
    tokens the points match (of their stride, ``first`` among them: it then
    applies at every steady step up to its last, ``until`` moving past it).
    (At each token where an edit starts or stops applying,
    :meth:`RequestState.pass_edit_marks` works the steps from there out
    again.) Given ``armed`` (edit name -> the token whose signal
    switched it on), a triggered edit in it applies like an always-on one from
    the token after, and one not in it yet applies nowhere (until a signal arms
    it: :meth:`RequestState.arm` then works the request's steady steps out
    again); without, any triggered edit has each step planned. None where an
    edit is otherwise (each step planned: an edit of every second token
    beside points of every token, one of every token beside points of a
    stride)."""
    if not edits or steady is None:
        return steady
    first, stride, until = steady
    for resolved in edits:
        edit = resolved.edit
        span = _edit_span(edit, prompt_len)
        if edit.when is not None:
            if armed is None:
                return None
            armed_at = armed.get(edit.name)
            if armed_at is None or span is None:
                continue
            if armed_at + 1 > span[0]:
                # (its first token from the one after: of its stride, from its own first)
                behind = armed_at + 1 - span[0]
                span = (span[0] + -(-behind // edit.stride) * edit.stride, span[1])
        if span is None:
            continue
        begins, ends = span
        if ends is not None and ends <= max(begins, first):
            continue  # (it applies to no token from first on)
        if begins > first:  # (the steps before its first token)
            until = begins if until is None else min(until, begins)
            continue
        if edit.stride != stride or (first - begins) % stride:
            return None  # (it edits tokens no point matches, or skips some that one does)
        if ends is not None:
            until = ends if until is None else min(until, ends)
    if until is not None and first >= until:
        return None
    return first, stride, until


def _edit_span(edit: Edit, prompt_len: int) -> tuple[int, int | None] | None:
    """The absolute tokens ``edit`` selects after a prompt of ``prompt_len``
    tokens lie in ``[begins, ends)`` (``ends`` None: for good), every
    ``edit.stride`` th from ``begins``; None where it selects none."""
    position = edit.position
    if not position.is_continuous:
        target = position.target_index(prompt_len)
        return None if target is None else (target, target + 1)
    begins = prompt_len + max(position.start, 0)
    ends = None if position.stop is None else prompt_len + position.stop
    return None if ends is not None and ends <= begins else (begins, ends)


def _edit_sites(edits: Sequence[Any]) -> list[tuple[str, int, str]]:
    """(name, layer, tensor type value) of every site ``edits`` change, in the
    order each request's log of applied edits takes them."""
    return [(resolved.edit.name, layer, resolved.edit.tensor_type.value)
            for resolved in edits for layer in resolved.edit.layers]


def _done(resolved: Any, prompt_len: int, token_index: int) -> bool:
    """Whether ``resolved`` can apply to no token from ``token_index`` on."""
    last = resolved.edit.position.last_index(prompt_len)
    return last is not None and last < token_index


NEVER = 2**62
"""A token index past any generation (:attr:`RequestState.quiet_until` of a
request with no point nor edit left)."""


_Bounds = tuple[dict[int, int | None], bool,
                dict[int, tuple[int, int | None, int, int, int | None]],
                tuple[int, int, int | None] | None, int]


class _Worked(NamedTuple):
    """What :meth:`RequestState.pass_edit_marks` worked out at a mark, for a
    request of these live ``points`` and ``edits`` (the very objects): the
    edits live after it, and ``(steady_from, steady_stride, steady_until)``."""

    points: Sequence[ExtractionPoint]
    edits: Sequence[Any]
    live_edits: Sequence[Any]
    steady: tuple[int | None, int, int | None]


class _Quiet(NamedTuple):
    """:attr:`RequestState.quiet_until` of a request of these live ``points``
    and ``edits`` (the very objects), kept beside :class:`_Worked` entries for
    the requests opened with it (by prompt length)."""

    points: Sequence[ExtractionPoint]
    edits: Sequence[Any]
    quiet: int


def _bounds(points: Sequence[ExtractionPoint], prompt_len: int) -> _Bounds:
    """Where ``points`` match after a prompt of ``prompt_len`` tokens (read only,
    shared by the requests with that length): the last index each can match
    (None: unbounded), by ``id(point)``, for retiring it; whether one of them
    is bounded; each one's selector in absolute token indices (for one-token
    windows); the first index from which every point matches every stride-th
    token and none the others, and that stride (:attr:`RequestState.steady_from`
    and ``steady_stride`` before edits); the first index any of them may match
    (:attr:`RequestState.quiet_until` before edits)."""
    last_index = {id(point): point.position.last_index(prompt_len) for point in points}
    selectors = {id(point): _absolute_selector(point, prompt_len) for point in points}
    return (last_index, any(last is not None for last in last_index.values()), selectors,
            _steady_from(selectors.values()), _first_match(selectors.values()))


def _first_match(selectors: Iterable[tuple[int, int | None, int, int, int | None]]) -> int:
    """The first token index any of ``selectors`` (from :func:`_absolute_selector`)
    may match: a lower bound (a single-token one's target, -1 where it has
    none; :data:`NEVER` for none)."""
    return min((first if target is None else target
                for first, _, _, _, target in selectors), default=NEVER)


def stop_position(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    found = [index for index in (text.find(stop) for stop in stops if stop) if index >= 0]
    return min(found) if found else None


class StopMatch:
    """Where a request's stop strings first end it: the generated index of the
    token after which its text (the generated tokens decoded, without the
    prompt) first holds one (an end-of-sequence token ends a request as such,
    so it completes no stop string). Both backends end a request there.

    :meth:`scan` reads the tokens as they come, each checked once, on the end
    of the text only: each token is decoded with the few before it
    (:class:`~undercurrent.adapters.incremental_text.IncrementalText`; tokens
    that decode to nothing, as special tokens do, leave its window), and a
    stop string the token completes ends past where it changed the text, so
    the ``longest - 1`` characters before that are read besides. Where that
    holds one, the whole text is decoded to confirm it: a check costs the same
    at the thousandth token as at the tenth. (A stop string that holds U+FFFD
    may be found later than in the whole text: while a run of byte fallback
    tokens is open, the whole text's U+FFFD for each of its bytes is read as
    one.) ``reach``: how many characters before a token's text its decode may
    change (:func:`~undercurrent.adapters.prompts.decode_reach`)."""

    __slots__ = ("stops", "decode", "eos", "longest", "text", "index")

    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str],
                 eos: Collection[int] = (), reach: int = 0) -> None:
        self.stops = tuple(stops)
        self.decode = decode
        self.eos = eos
        self.longest = max(map(len, self.stops), default=0)
        self.text = IncrementalText(decode, self.longest, reach)
        self.index: int | None = None
        """The generated index of the token that completed a stop string (None: none yet)."""

    def scan(self, generated: Sequence[int]) -> int | None:
        """:attr:`index`, once the tokens of ``generated`` not checked yet are
        (``generated``: the request's generated tokens so far, or more)."""
        text = self.text
        while self.index is None and text.count < len(generated):
            start = text.step(generated)
            if generated[text.count - 1] in self.eos:
                continue
            begin = max(start - self.longest + 1, text.tail_start) - text.tail_start
            if stop_position(text.tail[begin:], self.stops) is None:
                continue
            if self._holds(generated[:text.count]):
                self.index = text.count - 1
            else:  # (the end read is not the whole text's: read on from the whole text)
                text.resync(generated[:text.count])
        return self.index

    def _holds(self, tokens: Sequence[int]) -> bool:
        return stop_position(self.decode(tokens), self.stops) is not None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that could begin a stop string (a proper
    prefix of one): a stream holds it back until the next token says whether the
    stop string completes."""
    longest = max((len(stop) for stop in stops), default=0) - 1
    for size in range(min(longest, len(text)), 0, -1):
        tail = text[-size:]
        if any(stop.startswith(tail) and len(stop) > size for stop in stops):
            return size
    return 0


def _same_points(lists: list[Sequence[ExtractionPoint]], points: Sequence[ExtractionPoint]
                 ) -> bool:
    """Whether each of ``lists`` holds the very ``points`` (the same list, most
    often: a request's points until one retires), in order."""
    if all(map(operator.is_, lists, itertools.repeat(points))):
        return True
    # (each distinct list once: requests opened together share theirs, found in C)
    return all(len(each) == len(points) and all(map(operator.is_, each, points))
               for each in dict(zip(map(id, lists), lists, strict=True)).values())


#: Each tensor type by its value (what an applied edit's ``tensor_type`` holds).
_TENSOR_TYPES = {tensor_type.value: tensor_type for tensor_type in TensorType}

# A request state's fields, read in C over a call's or a step's requests.
_STEADY_FROM = operator.attrgetter("steady_from")
_STEADY_STRIDE = operator.attrgetter("steady_stride")
_STEADY_UNTIL = operator.attrgetter("steady_until")
_POINTS = operator.attrgetter("points")
_ABORT = operator.attrgetter("abort")
_CLOSED = operator.attrgetter("closed")
_ARMED = operator.attrgetter("armed")
_PROMPT_LEN = operator.attrgetter("prompt_len")
_PROMPT = operator.attrgetter("prompt")
_PROMPT_TOKEN_IDS = operator.attrgetter("prompt_token_ids")
_FINISH_REASON = operator.attrgetter("finish_reason")
_LIVE_EDITS = operator.attrgetter("_live_edits")
_LIVE_POINTS = operator.attrgetter("_live_points")
_BOUNDED = operator.attrgetter("_bounded")
_EDIT_MARKS = operator.attrgetter("_edit_marks")


class StreamText:
    """The text pieces of one request's stream, so that the pieces joined (the final
    event's included) equal ``GenerationOutput.text``: a stop string, and a partial
    one before it, are never sent (vLLM and OpenAI streams behave the same way).

    Given ``decode``, :meth:`next_piece` decodes the tokens as they come
    (:class:`~undercurrent.adapters.incremental_text.IncrementalText`: a few
    tokens a step, and only the end of the text is read), with the pieces
    :meth:`piece` gives for the whole text decoded at each token (but for a
    stop string that holds U+FFFD, while a run of byte fallback tokens is
    open: the whole text's U+FFFD for each of its bytes is read as one).

    ``reach``: how many characters before a token's text its decode may change
    (:func:`~undercurrent.adapters.prompts.decode_reach`: a decode that cleans
    up tokenization spaces drops the space before a later ``"."`` or ``"'"``).
    Text from a space or an apostrophe among the last ``reach`` characters on
    (a later token's text may drop the space, or put one back before the
    apostrophe: ``"x ' "`` is ``"x'"``, ``"x ' ,"`` is ``"x ',"``), and a
    partial stop string just before it (which the space dropped may complete),
    is held back until later tokens settle it.

    ``runs``: the byte fallback tokens of a decode that reads a run of them as
    one (:func:`~undercurrent.adapters.prompts.byte_runs`: a later byte of the
    run may turn the characters before it into U+FFFD). The text of an open
    run is held back until a token that is no byte token closes it, or until
    the final event."""

    def __init__(self, stops: Sequence[str],
                 decode: Callable[[Sequence[int]], str] | None = None, reach: int = 0,
                 runs: ByteRuns | None = None) -> None:
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.reach = reach
        self.sent = 0
        """The length of the text sent so far."""
        self.stopped = False  # (a stop string was found: nothing more is sent)
        # (a stop string may begin `longest` - 1 characters before the text a step
        # changes, and a piece held back reaches as far back before what was sent,
        # or `reach` characters back)
        self.text = (None if decode is None
                     else IncrementalText(decode, 2 * self.longest + reach, reach, runs))

    def piece(self, text: str, run_start: int = NO_RUN) -> str:
        """The new piece for the decoded generated text so far. A character whose
        bytes are split across tokens (byte-level tokenizers: an emoji, CJK) decodes
        to U+FFFD until its last byte comes: what ends in it is held back, so the
        character is sent whole once complete (as transformers' TextStreamer and
        vLLM's detokenizer do). ``run_start``: where the text of an open run of
        byte fallback tokens begins (held back from there on)."""
        return self._piece(text, 0, 0, run_start)

    def next_piece(self, tokens: Sequence[int]) -> str:
        """The new piece once the generated tokens are ``tokens`` (those not read
        yet are decoded, one at a time): what :meth:`piece` gives for their whole
        text."""
        text = self.text
        if text is None:
            raise ValueError("this StreamText was made without a decode: give piece() "
                             "the text so far")
        pieces = []
        while text.count < len(tokens):
            start = text.step(tokens)
            pieces.append(self._piece(text.tail, text.tail_start, start, text.run_start))
        return "".join(pieces)

    def _piece(self, text: str, offset: int, start: int, run_start: int) -> str:
        """:meth:`piece` for ``text``, the text from index ``offset`` on, of which
        the part before index ``start`` is as it was at the last piece (so a stop
        string it holds ends past ``start``)."""
        if self.stopped:
            return ""
        if self.stops:
            begin = max(start - self.longest + 1, 0) - offset
            cut = stop_position(text[begin:], self.stops)
            if cut is not None:
                self.stopped = True
                return self._advance(text[:begin + cut], offset)
        text = text.rstrip(REPLACEMENT)
        end = len(text)
        if self.stops:
            end -= held_back(text, self.stops)
        if self.reach:
            # (a space a later token's text may clean up, or an apostrophe a clean-up
            # of " ' " gave, before which a later token's text puts the space back:
            # "x ' " is "x'", and "x ' ," is "x ',")
            last = text[max(len(text) - self.reach, 0):]
            marks = [index for index in (last.find(" "), last.find("'")) if index >= 0]
            if marks:
                mark = len(text) - len(last) + min(marks)
                # (what precedes it may begin a stop string that the clean-up completes)
                end = min(end, mark - held_back(text[:mark], self.stops))
        return self._advance(text[:min(end, run_start - offset)], offset)

    def rest(self, final_text: str) -> str:
        """What the final event carries: the part of the output's text not sent yet
        (a held-back partial stop string that never completed)."""
        return self._advance(final_text, 0)

    def _advance(self, text: str, offset: int) -> str:
        end = offset + len(text)
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent - offset:], end
        return piece


class RequestState:
    """One request's bookkeeping: prompt, points still able to match, generated
    tokens, signals, records, abort and finish reason."""

    # What every request starts with, read from the class until a request sets
    # its own (an adapter opens one state per request of a call).
    abort: AbortInfo | None = None
    finish_reason: str | None = None
    signals_read = 0
    closed = False
    retire_edits = True
    edits_read = 0
    stream_text: StreamText | None = None
    """The pieces a stream has sent (set by a streaming backend)."""
    stop_match: StopMatch | None = None
    """Where the call's stop strings end this request (set by a backend that
    finds them itself while rows may still come from the tokens after)."""
    steady_from: int | None = None
    """The first token index from which every ``steady_stride`` th token matches
    every point, the tokens between none, up to ``steady_until`` (exclusive;
    None: for good), and each token gets the same edits: none, or edits of
    every token (the stride then 1; None: no such index). From there
    on, each decode step that captures or edits plans the same captures and
    edits ``steady_stride`` tokens later (:meth:`StepPlan.shifted`)."""
    steady_stride = 1
    steady_until: int | None = None
    steady_until_armed = True
    """Whether a triggered edit not switched on yet leaves the request steady (its
    backend plans again once :meth:`arm` switches one on); False: any triggered
    edit has each step planned."""
    # (the points and edits left that quiet_until was worked out for, and it)
    _quiet: _Quiet | None = None

    def __init__(
        self,
        request_id: str,
        prompt: str,
        prompt_token_ids: Sequence[int],
        points: Sequence[ExtractionPoint],
        keep_records: bool = False,
        edits: Sequence[Any] = (),
        bounds: dict[int, _Bounds] | None = None,
        worked: dict[tuple[Any, ...], _Worked | _Quiet | list[Any]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = plain_ids(prompt_token_ids)
        self.prompt_len = len(self.prompt_token_ids)
        self.points = tuple(points)
        self._live_points: Sequence[ExtractionPoint] = self.points  # (replaced, never changed)
        # Where the points match, for a prompt of this length: ``bounds`` (when
        # given) keeps them by prompt length for requests with these very points.
        found = None if bounds is None else bounds.get(self.prompt_len)
        if found is None:
            found = _bounds(self.points, self.prompt_len)
            if bounds is not None:
                bounds[self.prompt_len] = found
        self._last_index, self._bounded, self._selectors, steady, self._first = found
        steady = _steady_with_edits(steady, edits, self.prompt_len,
                                    {} if self.steady_until_armed else None)
        if steady is not None:
            self.steady_from, self.steady_stride, self.steady_until = steady
        self.generated: list[int] = []
        self.records: RecordLog | None = RecordLog() if keep_records else None
        self.signals = SignalLog()
        """Inline signals in routing order (``TokenSignal`` s, built when read)."""
        # Live edits: ResolvedEdit objects (undercurrent.steering), those that can
        # still apply, the triggered ones switched on (name -> token index of the
        # signal), what was applied, and which edits changed each captured site.
        self.edits = tuple(edits)
        # (the edits themselves until one retires: requests given the same
        # tuple share it, and compare theirs by identity; replaced, never changed)
        self._live_edits: Sequence[Any] = self.edits
        # Each token where an edit starts or stops applying, ascending, until
        # planned (pass_edit_marks then works the steady steps out again).
        # (no list where there is no edit: one object fewer per request)
        self._edit_marks: list[int] | tuple[()] = sorted({
            mark for resolved in self.edits
            if (span := _edit_span(resolved.edit, self.prompt_len)) is not None
            for mark in span if mark is not None}) if self.edits else ()
        # What pass_edit_marks worked out at a mark, for requests opened with
        # this one (by prompt length, mark, and how edits retire and arm).
        self._worked = worked
        self.armed: dict[str, int] = {}
        self.applied = EditLog()
        self._edited_sites: dict[tuple[int, TensorType, int], tuple[str, ...]] = {}

    @property
    def live(self) -> bool:
        """Still generating: neither finished nor aborted."""
        return self.finish_reason is None

    @property
    def aborted(self) -> bool:
        return self.abort is not None

    def token_id_at(self, token_index: int) -> int | None:
        """The token at an absolute index (prompt or generated), if known yet."""
        if token_index < self.prompt_len:
            return self.prompt_token_ids[token_index]
        generated_index = token_index - self.prompt_len
        if generated_index < len(self.generated):
            return self.generated[generated_index]
        return None

    @property
    def exhausted(self) -> bool:
        """Whether no point is left that may match a later token, nor an edit
        that may apply to one: each has retired (it matched its one token, its
        slice ended, its tokens are done). Retired ones never come back, so no
        later step of this request plans anything."""
        return not self._live_points and not self._live_edits

    @property
    def quiet_until(self) -> int:
        """The first token index at which a point left may match or an edit
        left may apply: a lower bound (each one's first token, whatever its
        stride or trigger; :data:`NEVER` when none is left, see
        :attr:`exhausted`). A token before it matches nothing, gets no edit and
        retires nothing, so a step that feeds this request such a token plans
        nothing for it."""
        points, edits = self._live_points, self._live_edits
        if points is self.points and not edits:  # (every point left, no edit)
            return self._first
        known = self._quiet
        if known is not None and known[0] is points and known[1] is edits:
            return known[2]
        prompt_len, worked = self.prompt_len, self._worked
        if worked is not None:  # (requests opened together: once per prompt length)
            found = worked.get(("quiet", prompt_len))
            if isinstance(found, _Quiet) and (
                    (found.points is points or _same_points([points], found.points))
                    and (found.edits is edits or _same_points([edits], found.edits))):
                self._quiet = found
                return found.quiet
        firsts = [_first_match(map(self._selectors.__getitem__, map(id, points)))]
        for resolved in edits:
            span = _edit_span(resolved.edit, prompt_len)
            if span is not None:
                firsts.append(span[0])
        known = self._quiet = _Quiet(points, edits, min(firsts))
        if worked is not None:
            worked["quiet", prompt_len] = known
        return known.quiet

    def edits_on_at(self, token_index: int, edits: Sequence[Any] | None = None) -> list[Any]:
        """Those of ``edits`` (default: the live ones) that apply to
        ``token_index``: on (always, or switched on by the signal of an
        earlier token) and selecting it, in their order."""
        armed, prompt_len = self.armed, self.prompt_len
        return [resolved for resolved in (self._live_edits if edits is None else edits)
                if (resolved.edit.when is None
                    or armed.get(resolved.edit.name, token_index) < token_index)
                and _tokens_in_window(resolved.edit, prompt_len, token_index, token_index + 1)]

    def edit_sites_at(self, token_index: int) -> list[tuple[str, int, str]]:
        """(name, layer, tensor type value) of each site the edits that apply to
        ``token_index`` change (:meth:`edits_on_at`), in the order its log of
        applied edits takes them."""
        return _edit_sites(self.edits_on_at(token_index))

    def edits_prompt(self) -> bool:
        """Whether an edit selects a token of the prompt (its prefill then
        plans it, wherever the points match generated tokens only)."""
        prompt_len = self.prompt_len
        for resolved in self.edits:
            position = resolved.edit.position
            if not position.is_continuous:
                target = position.target_index(prompt_len)
                if target is not None and target < prompt_len:
                    return True
        return False

    def wanted_pairs(self) -> set[PairKey]:
        """(layer, tensor type) pairs the points still able to match, and the edits
        still able to apply, ask for."""
        wanted = {(layer, point.tensor_type) for point in self._live_points
                  for layer in point.layers}
        wanted.update((layer, resolved.edit.tensor_type) for resolved in self._live_edits
                      for layer in resolved.edit.layers)
        return wanted

    def edits_in_window(self, start: int, stop: int) -> list[tuple[int, Any]]:
        """(token index, resolved edit) for every token in ``[start, stop)`` an edit
        that is on applies to: an always-on edit wherever its position selects, a
        triggered one only past the token whose signal armed it (so a recomputed
        window gets exactly the edits it had). Once an edit can apply to no
        token at or after ``stop``, it retires (when ``retire_edits``) and the
        request's steady steps are worked out again from ``stop`` on."""
        if not self._live_edits or self.aborted or self.closed:
            return []
        found: list[tuple[int, Any]] = []
        for resolved in self._live_edits:
            edit = resolved.edit
            first = start
            if edit.when is not None:
                armed_at = self.armed.get(edit.name)
                if armed_at is None:
                    continue
                first = max(start, armed_at + 1)
            found.extend((index, resolved) for index in _tokens_in_window(
                edit, self.prompt_len, first, stop))
        if self._edit_marks and self._edit_marks[0] <= stop:
            self.pass_edit_marks(stop)
        return found

    def pass_edit_marks(self, stop: int) -> None:
        """The tokens before ``stop`` are planned: where an edit starts or
        stops applying at ``stop`` or before, each edit that can apply to no
        token from ``stop`` on retires (where edits retire), and the request's
        steady steps are worked out again from ``stop`` on
        (:func:`_steady_with_edits`), once per such token."""
        marks = self._edit_marks
        if not marks or marks[0] > stop:
            return
        while marks and marks[0] <= stop:
            del marks[0]
        # (steady steps that start at stop or later were worked out with these
        # edits in view: the same again; the prefill of a prompt token's edit)
        worked_out = self.steady_from is not None and stop <= self.steady_from
        worked, key = self._worked, None
        if worked is not None and not self.armed:
            # Requests opened together with the same points and edits, and a
            # prompt of this length, work out the same at this mark: once.
            key = (self.prompt_len, stop, worked_out, self.retire_edits,
                   self.steady_until_armed)
            found = worked.get(key)
            if isinstance(found, _Worked) and (
                    (found.points is self._live_points
                     or _same_points([self._live_points], found.points))
                    and (found.edits is self._live_edits
                         or _same_points([self._live_edits], found.edits))):
                self._live_edits = found.live_edits
                if not worked_out:  # (as _steady_after leaves them)
                    if found.steady[0] is None:
                        self.steady_from = None
                    else:
                        self.steady_from, self.steady_stride, self.steady_until = found.steady
                return
        before = self._live_edits
        if self.retire_edits:
            live = [resolved for resolved in before
                    if (last := resolved.edit.position.last_index(self.prompt_len)) is None
                    or last >= stop]
            if len(live) != len(before):  # (else the same object: compared by identity)
                # (requests opened together, whatever their prompt's length, share
                # the edits left as one object)
                self._live_edits = live if worked is None else worked.setdefault(
                    ("live", *map(id, live)), live)
        if not worked_out:
            self._steady_after(stop)
        if key is not None and worked is not None:
            worked[key] = _Worked(self._live_points, before, self._live_edits,
                                  (self.steady_from, self.steady_stride, self.steady_until))

    def arm(self, point_name: str, action: SignalAction, token_index: int) -> bool:
        """Switch on the triggered edits waiting for ``action`` from ``point_name``
        (each from the token after ``token_index`` on; from the first generated
        token where ``token_index`` is a prompt token, as where the prompt is fed
        in one pass, though vLLM may feed its later tokens in later passes);
        True where one was. The
        request's :attr:`steady_from` is then worked out again (its edits
        changed): where each edit switched on is continuous, unbounded and of
        stride 1, the request is steady again from the first token it applies
        to (with :attr:`steady_until_armed`; else its steps are planned each as
        it comes)."""
        switched = False
        token_index = max(token_index, self.prompt_len - 1)
        for resolved in self.edits:
            trigger = resolved.edit.when
            if (trigger is not None and trigger.point == point_name
                    and trigger.action.value == action.value
                    and resolved.edit.name not in self.armed):
                self.armed[resolved.edit.name] = token_index
                switched = True
        if switched:
            self.switched_on(token_index)
        return switched

    def switched_on(self, token_index: int) -> None:
        """A triggered edit was switched on by the signal of ``token_index``
        (:attr:`armed` says so): :attr:`steady_from` worked out again from the
        token after (with :attr:`steady_until_armed`; else each step planned)."""
        if self.steady_until_armed:
            self._steady_after(token_index + 1)
        else:
            self.steady_from = None

    def log_edit(self, resolved: Any, layer: int, token_index: int) -> None:
        """Remember that ``resolved`` changes ``layer`` at ``token_index`` (this forward)."""
        self.log_applied(resolved.edit.name, resolved.edit.tensor_type, layer, token_index)

    def replay_edits(self, tape: Sequence[tuple[Any, ...]],
                     journals: dict[int, list[int]]) -> None:
        """Log what another log's tape says (:meth:`EditLog.take_tape`, as a vLLM
        worker sends it: each entry as ``("entry", name, tensor type value,
        layer, token index)``, each journal by its number in ``journals``,
        this side's copies of them; one not there yet is empty so far)."""
        applied = self.applied
        for step in tape:
            kind = step[0]
            if kind == "entry":
                self.log_applied(step[1], TensorType(step[2]), step[3], step[4])
            elif kind == "follow":
                applied.follow(journals.setdefault(step[1], []), step[2], self.prompt_len,
                               step[3])
            else:
                applied.stop_at(step[1])

    def log_applied(self, name: str, tensor_type: TensorType, layer: int,
                    token_index: int) -> None:
        """Remember that edit ``name`` changed (layer, tensor type) at ``token_index``."""
        generated = token_index - self.prompt_len if token_index >= self.prompt_len else None
        self.applied.append(AppliedEdit(name, layer, token_index, generated, tensor_type.value))
        site = (layer, tensor_type, token_index)
        self._edited_sites[site] = (*self._edited_sites.get(site, ()), name)

    @property
    def edited_sites(self) -> dict[tuple[int, TensorType, int], tuple[str, ...]]:
        """The names of the edits applied at each (layer, tensor type, token index)
        so far, in the order applied (a captured row's ``edits``)."""
        sites = self._edited_sites
        # (steady steps' edits, read from their journals: no entry built for it)
        for shifts, token_index, edited in self.applied.take_unsited():
            keyed = [(layer, _TENSOR_TYPES[tensor_type], name)
                     for name, layer, tensor_type in edited]
            for shift in shifts:
                token = token_index + shift
                for layer, tensor_type, name in keyed:
                    site = (layer, tensor_type, token)
                    sites[site] = (*sites.get(site, ()), name)
        return sites

    def matches_in_window(self, start: int, stop: int) -> list[tuple[int, ExtractionPoint]]:
        """(token index, point) for every token in ``[start, stop)`` a point
        selects; then retires the points that cannot match at or after ``stop``.

        The backend decides which requests to plan (usually the live ones); an
        aborted or closed request matches nothing.
        """
        found: list[tuple[int, ExtractionPoint]] = []
        if self.aborted or self.closed:
            return found
        if stop - start == 1:  # a decode step: one comparison per point
            selectors = self._selectors
            for point in self._live_points:
                first, end, base, stride, target = selectors[id(point)]
                if (start == target if target is not None else
                        start >= first and (end is None or start < end)
                        and (stride == 1 or (start - base) % stride == 0)):
                    found.append((start, point))
        else:
            for point in self._live_points:
                found.extend((index, point) for index in _tokens_in_window(
                    point, self.prompt_len, start, stop))
        if self._bounded:
            last_index = self._last_index
            live = len(self._live_points)
            self._live_points = [point for point in self._live_points
                                 if (last := last_index[id(point)]) is None or last >= stop]
            self._bounded = any(last_index[id(point)] is not None for point in self._live_points)
            if len(self._live_points) != live:
                self._steady_after(stop)
        if stop - start > 1 and len(found) > 1:
            found.sort(key=lambda item: item[0])
        return found

    def repeats_every(self, token_index: int) -> int | None:
        """The period after which the points matching ``token_index`` match again,
        and every token from it on: the least common multiple of the points'
        strides, where each point still able to match is continuous, unbounded
        and selects tokens from ``token_index`` or before, and each edit is
        always on (no ``when``), continuous, unbounded, of stride 1 and applies
        to ``token_index`` (so to every token from it on), triggered and not
        switched on yet (it applies nowhere: a switch makes the backend plan
        again), or done (a prompt token's, a slice that has ended); None
        otherwise.
        Points of several strides then plan the same steps again, a period
        later, with the same edits at every step (what a backend may repeat)."""
        if self._bounded or self.aborted or self.closed:
            return None
        for resolved in self._live_edits:
            edit = resolved.edit
            if edit.when is not None and edit.name not in self.armed:
                continue  # (it applies nowhere until a switch, which drops the cycle)
            if _done(resolved, self.prompt_len, token_index):
                continue
            position = edit.position
            if (edit.when is not None or not position.is_continuous
                    or position.stop is not None or edit.stride != 1
                    or token_index < self.prompt_len + max(position.start, 0)):
                return None
        period = 1
        for point in self._live_points:
            first, end, _, stride, target = self._selectors[id(point)]
            if target is not None or end is not None or first > token_index:
                return None
            period = math.lcm(period, stride)
        return period

    def edits_same_until(self, token_index: int) -> int | None:
        """The token before which every token from ``token_index`` on gets the
        edits that token gets (None: every token from it on does;
        ``token_index + 1``: it alone). Each edit either applies to no token
        from it on, waits for a signal not given yet (it applies nowhere until
        one is, and :meth:`arm` says so), starts later (the tokens before its
        first), or is on at ``token_index`` (always, or switched on by the
        signal of an earlier token): of stride 1, the tokens up to its last,
        else that token alone. A backend that repeats a step's layout with the
        edits each row had then gets the later steps' right up to there."""
        if self.aborted or self.closed:
            return token_index + 1
        armed, prompt_len = self.armed, self.prompt_len
        until = None
        for resolved in self._live_edits:
            edit = resolved.edit
            span = _edit_span(edit, prompt_len)
            if span is None:
                continue
            begins, ends = span
            if edit.when is not None:
                armed_at = armed.get(edit.name)
                if armed_at is None:
                    continue
                begins = max(begins, armed_at + 1)
            if ends is not None and ends <= max(begins, token_index):
                continue  # (done: it applies to no token from here on)
            if begins > token_index or edit.stride == 1:
                edge = begins if begins > token_index else ends
                if edge is not None:
                    until = edge if until is None else min(until, edge)
                continue
            return token_index + 1
        return until

    def _steady_after(self, stop: int) -> None:
        """Once points have retired at ``stop`` (they matched one token, or a
        bounded slice ended), or a signal switched an edit on for the tokens
        from ``stop`` on: the steady pattern of the points left and the edits
        on (:attr:`steady_from`), from ``stop`` on (a plan made before it held
        the retired points' captures, or lacked the edit), or none."""
        self.steady_from = None
        live = self._live_points
        # (with no point left, the edits' own, if any)
        found = (_steady_from([self._selectors[id(point)] for point in live])
                 if live or self._live_edits else None)
        if found is not None and found[0] < stop:  # (the first of its matches from stop on)
            first, stride, until = found
            found = (first + -(-(stop - first) // stride) * stride, stride, until)
        # (an edit done before then changes nothing)
        found = _steady_with_edits(found, self._live_edits, self.prompt_len,
                                   self.armed if self.steady_until_armed else None)
        if found is None:
            return
        first, stride, until = found
        if until is None or first < until:
            self.steady_from, self.steady_stride, self.steady_until = first, stride, until

    def unread_edits(self, before: int | None = None) -> tuple[AppliedEdit, ...]:
        """Edits applied since the last call (what a stream event carries);
        ``before``: only those at tokens before that index (the log holds them
        in token order), the others left for the next call."""
        applied = self.applied
        end = len(applied)
        if before is not None:
            start = end = self.edits_read
            while end < len(applied) and applied[end].token_index < before:
                end += 1
            if end == start:
                return ()
        fresh = tuple(applied[self.edits_read:end])
        self.edits_read = end
        return fresh

    def unread_signals(self) -> tuple[TokenSignal, ...]:
        """Signals that arrived since the last call (what a stream event carries)."""
        fresh = tuple(self.signals[self.signals_read:])
        self.signals_read = len(self.signals)
        return fresh


@dataclass
class CaptureTarget:
    """One record to build: a request's point wants ``layer`` at ``token_index``,
    found at row ``slot_index`` of the group's gathered tensor."""

    state: RequestState
    point: ExtractionPoint
    layer: int
    token_index: int
    slot_index: int


class CaptureGroup:
    """Everything one (layer, tensor type) hook must capture in one forward.

    ``slots`` are engine-specific locations (e.g. ``(row, column)`` in a padded
    batch, or a flat token position), unique; gather them in this order with one
    device-to-host copy and hand the group itself to
    :meth:`CaptureSession.deliver` with the rows. The group keeps no object per
    vector: what each row serves is in its plan's :class:`PlanMatch` es
    (:attr:`targets` lists it as :class:`CaptureTarget` s, built when read).
    """

    __slots__ = ("key", "plan", "slots", "_slot_index", "index_cache")

    def __init__(self, key: PairKey | None = None, plan: StepPlan | None = None) -> None:
        self.key = key
        self.plan = plan
        self.slots: list[Hashable] = []
        self._slot_index: dict[Hashable, int] = {}
        self.index_cache: dict[Any, Any] = {}
        """What an engine derives from :attr:`slots` (e.g. index tensors per
        device), shared by the plans :meth:`StepPlan.shifted` makes."""

    def row_of(self, slot: Hashable) -> int:
        """The row of ``slot`` in the gathered tensor (added if new)."""
        index = self._slot_index.get(slot)
        if index is None:
            index = self._slot_index[slot] = len(self.slots)
            self.slots.append(slot)
        return index

    @property
    def targets(self) -> list[CaptureTarget]:
        """One :class:`CaptureTarget` per captured vector, in planning order."""
        found: list[CaptureTarget] = []
        if self.plan is not None and self.key is not None:
            layer, tensor_type = self.key
            for match in self.plan.matches:
                if match.point.tensor_type is not tensor_type or layer not in match.layers:
                    continue
                found.append(CaptureTarget(match.state, match.point, layer, match.token_index,
                                           match.rows[match.layers.index(layer)]))
        return found


@dataclass
class EditSlots:
    """Where one resolved edit applies at one (layer, tensor type) in one forward:
    engine-specific ``slots``, like a :class:`CaptureGroup`'s."""

    resolved: Any
    slots: list[Hashable] = field(default_factory=list)
    index_cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """What an engine derives from :attr:`slots` once they are planned (e.g. index
    tensors per device), shared by the plans :meth:`StepPlan.shifted` makes."""
    rank: int = field(default=0, compare=False, repr=False)
    """The edit's place among its requests' edits (each request's are the
    session's, then its own: an edit shared by several has the same place in
    each), by which a pair's edits are applied (:meth:`StepPlan.add_edit`)."""


class StepPlan:
    """What one forward pass must capture, grouped by (layer, tensor type), and
    which edits it applies where (``edits``: pair -> edits in the order to apply)."""

    # What every plan starts with, read from the class until a plan sets its own
    # (a decode step makes one plan).
    base: StepPlan | None = None
    """For a plan made by :meth:`shifted`: the plan it repeats ``delta`` tokens
    later (never itself a shifted plan)."""
    delta = 0
    steady: Any = None
    """What delivery derives once from a plan that others repeat (kept on the
    base plan; see :mod:`undercurrent.adapters.delivery`)."""
    repeatable = False
    """Set by a backend that keeps this plan to repeat it, or that wants its
    step held as a repeat's would be though it is not repeated (the vLLM
    driver's step whose edits differ from the next one's): delivery may use
    the plan's layout from this step on, not only from its first repeat."""
    alternates = False
    """Set by a backend whose repeats of this plan alternate with the repeats of
    others (a cycle of several plans: points of several strides): delivery then
    hands each request its rows of each step, rather than have them follow one
    layout's journal, and a window holds the steps of every plan of the cycle
    (see ``delivery._Window.admits``)."""
    edit_steps: list[int] | None = None
    """For a plan with edits that others repeat (:meth:`add_steady_tokens`): the
    shift of each plan made from it, its own (0) first, appended as each is
    made. Each request's :class:`~undercurrent.adapters.edit_log.EditLog`
    follows it (every step applies the same edits, a token later). The plans
    of a cycle (a backend repeating several plans in turn) share one list,
    each appending its shifts plus its :attr:`edit_offset`."""
    edit_offset = 0
    """Added to each shift this plan's repeats append to :attr:`edit_steps`: how
    many tokens after the token the list's followers count from this plan's
    own tokens are."""
    edits_logged = False
    """Set on a plan rebuilt from a vLLM worker's columns: it holds no edits (the
    worker applied them, and reported each to the requests' logs before the
    step is delivered), so delivery reads the edits at its rows from the
    requests' logs (``RequestState.edited_sites``) instead."""
    one_each = False
    """Set by :meth:`add_steady_tokens` for one point: match ``k`` is the ``k`` th
    request's (each request once), at row ``k`` of every group, for a generated
    token."""

    def __init__(self) -> None:
        self.groups: dict[PairKey, CaptureGroup] = {}
        self.edits: dict[PairKey, dict[int, EditSlots]] = {}
        self._matches: list[PlanMatch] | None = []
        self._layouts: dict[int, tuple[ExtractionPoint, tuple[int, ...],
                                       list[CaptureGroup]]] = {}

    @property
    def matches(self) -> list[PlanMatch]:
        """One per (request, token, point) planned, in planning order."""
        if self._matches is None:  # a shifted plan's, built when first read
            assert self.base is not None
            delta = self.delta
            self._matches = [PlanMatch(match.state, match.point, match.token_index + delta,
                                       match.layers, match.rows, match.seq, match.orders)
                             for match in self.base.matches]
        return self._matches

    def release(self) -> None:
        """Let go of everything this plan reaches: its groups (which refer back to
        it: a reference cycle), matches, edits, layout and base. Called on the
        plans of a call once its requests are closed
        (:meth:`CaptureSession.release_plans`), so that the requests' states,
        signals and rows the plans reach are freed then, not when the garbage
        collector next finds the cycle (each step's plan would otherwise keep the
        whole call alive until then). The plan is empty afterwards."""
        for group in self.groups.values():
            group.plan = None
        # A request's signal log keeps the matches it was routed with (for the
        # order of its rows), and each match its request's state: a cycle too.
        # What the log reads of a match later is its order, never its state.
        for match in self._matches or ():
            match.state = None  # type: ignore[assignment]
        self.groups, self.edits, self._layouts = {}, {}, {}
        self._matches, self.base, self.steady = [], None, None
        self.one_each = self.alternates = False

    def delivered(self) -> None:
        """Called once nothing reads this plan through its groups any more (a
        shifted plan once its forward is routed; any plan once a vLLM worker has
        gathered its rows): its groups let go of it. Each group refers back to its
        plan, a reference cycle: without this, the plan is freed by the garbage
        collector, not when its holders drop it, and a long generation makes one
        plan per decode step. The groups keep their slots, so the plan can still
        be :meth:`shifted`."""
        for group in self.groups.values():
            group.plan = None

    def shifted(self, delta: int = 1) -> StepPlan:
        """This plan again with every token ``delta`` later: the same groups (the
        same slots) and the same matches, each at ``token_index + delta``. What a
        decode step plans when every request it feeds is past its
        :attr:`RequestState.steady_from` and feeds the token after the one it fed
        in this plan, at the same slot. Nothing per match is built unless
        :attr:`matches` is read. The same edits apply at the same slots: only
        a plan whose edits apply to every token from its own on repeats
        (:attr:`edit_steps` logs the shift for its requests)."""
        base = self if self.base is None else self.base
        plan = StepPlan()
        plan.base, plan.delta, plan._matches = base, self.delta + delta, None
        if base.edits:
            if base.edit_steps is None:
                raise ValueError("a step plan with edits that is not steady cannot be shifted")
            plan.edits = base.edits
            base.edit_steps.append(plan.delta + base.edit_offset)
        groups = plan.groups
        new = object.__new__
        for key, group in base.groups.items():
            # (the group's own containers shared, not made and dropped: once per step)
            twin = groups[key] = new(CaptureGroup)
            twin.key, twin.plan, twin.slots = key, plan, group.slots
            twin._slot_index, twin.index_cache = group._slot_index, group.index_cache
        return plan

    def advanced(self, delta: int = 1) -> StepPlan:
        """:meth:`shifted`, made by moving this plan itself ``delta`` tokens on
        where it is a shifted plan already delivered (:meth:`delivered`: its
        groups let go of it, so nothing reads it any more): its groups then
        serve the next step too, and nothing is built. Otherwise a new shifted
        plan. What a backend's decode loop asks for the next step of a steady
        generation (a plan handed to another thread is not delivered yet when
        the next one is made, so it is never moved)."""
        groups = self.groups
        if self.base is None or not groups or any(
                group.plan is not None for group in groups.values()):
            return self.shifted(delta)
        self.delta += delta
        self._matches = None  # (built from the base plan when read, at the new delta)
        if self.base.edit_steps is not None:
            self.base.edit_steps.append(self.delta + self.base.edit_offset)
        for group in groups.values():
            group.plan = self
        return self

    def _layout(self, point: ExtractionPoint) -> tuple[tuple[int, ...], list[CaptureGroup]]:
        """The point's layers in ascending order and the group of each."""
        found = self._layouts.get(id(point))
        if found is None or found[0] is not point:
            layers = tuple(sorted(set(point.layers)))
            groups = []
            for layer in layers:
                key = (layer, point.tensor_type)
                group = self.groups.get(key)
                if group is None:
                    group = self.groups[key] = CaptureGroup(key, self)
                groups.append(group)
            found = self._layouts[id(point)] = (point, layers, groups)
        return found[1], found[2]

    def add_window(self, state: RequestState, start: int, stop: int,
                   slot_of: Callable[[int], Hashable]) -> None:
        """Plan the tokens ``[start, stop)`` of ``state`` this forward feeds;
        ``slot_of(token_index)`` says where each sits in the engine's tensors."""
        if self.base is not None:
            raise ValueError("a shifted step plan is complete: plan a new one to add to")
        self.one_each = False
        matches = self.matches
        for token_index, point in state.matches_in_window(start, stop):
            slot = slot_of(token_index)
            layers, groups = self._layout(point)
            matches.append(PlanMatch(state, point, token_index, layers,
                                     [group.row_of(slot) for group in groups], len(matches)))
        self.add_edit_window(state, start, stop, slot_of)

    def add_prompts(self, fed: Sequence[tuple[RequestState, Callable[[int], Hashable]]]
                    ) -> bool:
        """:meth:`add_alike_windows` of each (state, slot_of)'s whole prompt
        (tokens ``[0, prompt_len)``): what a prompt matches, gets and retires
        worked out once per prompt length."""
        return self.add_alike_windows([(state, 0, state.prompt_len, slot_of)
                                       for state, slot_of in fed])

    def add_alike_windows(self, fed: Sequence[tuple[RequestState, int, int,
                                                    Callable[[int], Hashable]]]) -> bool:
        """:meth:`add_window` of each (state, start, stop, slot_of) in order, with
        what a window matches, gets and retires worked out once per prompt
        length and window (a prefill's prompts; a decode step's tokens, the
        same generated token for each, where a slice ends): a fresh plan;
        requests of the same points and edits (the very objects), none aborted,
        closed or armed, and each of them alike in how its edits retire and arm
        (so windows of one prompt length and place match the same tokens and
        leave the same points, edits and steady steps). The plan, the edits'
        slots in their order, and each request's points left, steady steps and
        log of applied edits are what :meth:`add_window` of each request
        gives. Returns False, planning nothing, otherwise (plan each request
        with :meth:`add_window`)."""
        if self.base is not None or self.groups or self.edits or self._matches or not fed:
            return False
        states = [state for state, _, _, _ in fed]
        first = states[0]
        points, edits = first._live_points, first._live_edits
        if (list(map(_ABORT, states)).count(None) != len(states) or any(map(_CLOSED, states))
                or any(map(_ARMED, states))
                or len({(state.retire_edits, state.steady_until_armed) for state in states}) != 1
                or not _same_points(list(map(_LIVE_POINTS, states)), points)
                or not _same_points(list(map(_LIVE_EDITS, states)), edits)):
            return False
        # By prompt length and window: its matches and its edits (token index,
        # point or edit), and what its first request was left with once matched:
        # the points left where one retired (None: none did), whether one left
        # may retire, and its steady steps.
        known: dict[tuple[int, int, int],
                    tuple[list[tuple[int, ExtractionPoint]], list[tuple[int, Any]],
                          Sequence[ExtractionPoint] | None, bool,
                          tuple[int | None, int, int | None]]] = {}
        matches = self._matches
        assert matches is not None
        for state, start, stop, slot_of in fed:
            key = (state.prompt_len, start, stop)
            found = known.get(key)
            if found is None:  # (worked out on this request, as add_window does)
                live = len(state._live_points)
                matched = state.matches_in_window(start, stop)
                left = state._live_points if len(state._live_points) != live else None
                steady = (state.steady_from, state.steady_stride, state.steady_until)
                found = known[key] = (matched, state.edits_in_window(start, stop), left,
                                      state._bounded, steady)
            else:  # (what that request was left with, and its edit marks passed)
                matched, _, left, bounded, steady = found
                if left is not None:  # (a point retired: the steady steps worked out again)
                    state._live_points, state._bounded = left, bounded
                    if steady[0] is None:  # (as _steady_after leaves them)
                        state.steady_from = None
                    else:
                        state.steady_from, state.steady_stride, state.steady_until = steady
                if state._edit_marks and state._edit_marks[0] <= stop:
                    state.pass_edit_marks(stop)
            for token_index, point in matched:
                slot = slot_of(token_index)
                layers, groups = self._layout(point)
                matches.append(PlanMatch(state, point, token_index, layers,
                                         [group.row_of(slot) for group in groups],
                                         len(matches)))
            for token_index, resolved in found[1]:
                slot = slot_of(token_index)
                for layer in resolved.edit.layers:
                    self.add_edit(state, resolved, layer, token_index, slot)
        self.one_each = False  # (as add_window leaves it)
        return True

    def add_steady_tokens(self, fed: Sequence[tuple[RequestState, int, Hashable]]) -> bool:
        """:meth:`add_window` of the one token ``token_index`` at ``slot`` for each
        (state, token_index, slot) in order, planned at once where that gives the
        same plan: a fresh plan, requests of the same points, each live and past
        its :attr:`RequestState.steady_from` (every point matches the token, and
        the same edits apply: none, or the same always-on ones), no two points
        sharing a (layer, tensor type), no slot given twice. Each group then
        holds every slot in order, so request ``k`` sits at row ``k`` of each of
        its groups; each edit applies at every slot. Each request's log of
        applied edits follows :attr:`edit_steps` (this step's and its repeats').
        Returns False, planning nothing, otherwise (plan each request with
        :meth:`add_window`)."""
        if self.base is not None or self.groups or self.edits or self._matches or not fed:
            return False
        states, tokens, slots = (list(column) for column in zip(*fed, strict=True))
        if any(map(_EDIT_MARKS, states)):
            for state, token in zip(states, tokens, strict=True):
                if state._edit_marks and state._edit_marks[0] <= token:
                    state.pass_edit_marks(token)  # (steady from this token, maybe)
        # The points still able to match (all of them, until one that ends has
        # retired: see RequestState._steady_after), and the edits.
        first = states[0]
        points, edits = first._live_points, first._live_edits
        # Each request of these points and edits, steady from its token on,
        # neither aborted nor closed: checked in C, a column at a time.
        steady_from = list(map(_STEADY_FROM, states))
        if (None in steady_from or not all(map(operator.ge, tokens, steady_from))
                or list(map(_ABORT, states)).count(None) != len(states)
                or any(map(_CLOSED, states))
                or not _same_points(list(map(_LIVE_POINTS, states)), points)
                or not _same_points(list(map(_LIVE_EDITS, states)), edits)):
            return False
        strides = list(map(_STEADY_STRIDE, states))
        if strides.count(1) != len(strides) and any(
                (token - first) % stride for token, first, stride
                in zip(tokens, steady_from, strides, strict=True)):
            return False  # (a token between a stride's: no point matches it)
        untils = list(map(_STEADY_UNTIL, states))
        if untils.count(None) != len(untils) and any(
                until is not None and token >= until
                for token, until in zip(tokens, untils, strict=True)):
            return False  # (past a slice's end)
        if not self._plan_rows(points, fed, states, tokens, slots):
            return False
        if not edits:
            return True
        # Each request steady from its token on: an edit that applies to it
        # (always on, or switched on by a signal, and selecting it) applies to
        # every token of its steady steps, one that does not (not switched on
        # yet, done, or a single token later on) to none.
        on: list[list[Any]] = []
        known: dict[tuple[int, int], list[Any]] = {}  # (by prompt length and token)
        for state, token in zip(states, tokens, strict=True):
            if state.armed:
                on.append(state.edits_on_at(token, edits))
                continue
            found = known.get((state.prompt_len, token))
            if found is None:
                found = known[(state.prompt_len, token)] = state.edits_on_at(token, edits)
            on.append(found)
        same = on[0]
        if all(len(each) == len(same) and all(map(operator.is_, each, same)) for each in on):
            if same:
                self._plan_edit_slots(same, slots)
                self.edit_steps = journal = [0]
                sites = _edit_sites(same)
                for state, token in zip(states, tokens, strict=True):
                    state.applied.follow(journal, token, state.prompt_len, sites)
            return True
        self._plan_edits_of_each(edits, on, states, tokens, slots)
        return True

    def _plan_edits_of_each(self, edits: Sequence[Any], on: list[list[Any]],
                            states: list[RequestState], tokens: list[int],
                            slots: list[Hashable]) -> None:
        """:meth:`add_steady_tokens` 's edits where they differ between requests
        (``on``: those each request's token gets, a triggered one switched on
        for some, a slice ended for others): each edit at the slots of the
        requests it applies to, in the order :meth:`add_window` of each request
        plans them, and each request's log following the plan's shifts with
        the sites of its own edits."""
        self.edit_steps = journal = [0]
        for resolved in edits:
            where = [slot for slot, each in zip(slots, on, strict=True)
                     if any(mine is resolved for mine in each)]
            if where:
                self._plan_edit_slots([resolved], where)
        for state, token, each in zip(states, tokens, on, strict=True):
            state.applied.follow(journal, token, state.prompt_len, _edit_sites(each))

    def add_alike_tokens(self, fed: Sequence[tuple[RequestState, int, Hashable]]) -> bool:
        """:meth:`add_window` of the one token ``token_index`` at ``slot`` for each
        (state, token_index, slot) in order, planned at once where every request
        is alike: a fresh plan; requests of the same points and the same edits,
        every edit always on (no ``when``; a triggered edit no request has
        switched on yet applies nowhere, as if absent, and so does one done for
        every request), no point or edit that picks one token or ends (none
        retires); each request live, its token matched by
        the same points and the same edits as every other's; no two matching
        points sharing a (layer, tensor type), no slot given twice. These are
        the decode steps :meth:`add_steady_tokens` declines that repeat no
        plan: points of several strides, live edits. The plan, the edits'
        slots and each request's log of applied edits are what
        :meth:`add_window` of each request in turn gives. Returns False,
        planning nothing, otherwise (plan each request with :meth:`add_window`)."""
        if self.base is not None or self.groups or self.edits or self._matches or not fed:
            return False
        states, tokens, slots = (list(column) for column in zip(*fed, strict=True))
        if any(map(_EDIT_MARKS, states)):  # (an edit that ended before this token retires)
            for state, token in zip(states, tokens, strict=True):
                state.pass_edit_marks(token)
        first = states[0]
        points, edits = first._live_points, first._live_edits
        if (not (edits or points) or list(map(_ABORT, states)).count(None) != len(states)
                or any(map(_CLOSED, states)) or any(map(_BOUNDED, states))
                or not _same_points(list(map(_LIVE_POINTS, states)), points)
                or not _same_points(list(map(_LIVE_EDITS, states)), edits)):
            return False
        if any(resolved.edit.when is not None for resolved in edits):
            # A triggered edit no request has switched on applies nowhere yet:
            # planned as if absent (a switch makes the backend plan again).
            if any(resolved.edit.name in state.armed for state in states
                   for resolved in edits if resolved.edit.when is not None):
                return False
            edits = [resolved for resolved in edits if resolved.edit.when is None]
            if not (edits or points):
                return False
        if any(not resolved.edit.position.is_continuous or resolved.edit.position.stop
               is not None for resolved in edits):
            # An edit done for every request (a prompt token's, a slice ended)
            # applies nowhere; one that is not yet ends: each request planned alone.
            edits = [resolved for resolved in edits
                     if not all(_done(resolved, state.prompt_len, token)
                                for state, token in zip(states, tokens, strict=True))]
        for resolved in edits:
            edit = resolved.edit
            if not edit.position.is_continuous or edit.position.stop is not None:
                return False
        matching: tuple[list[ExtractionPoint], list[Any]] | None = None
        for state, token in zip(states, tokens, strict=True):
            selectors = state._selectors
            found_points = []
            for point in points:
                start, end, base, stride, target = selectors[id(point)]
                if target is not None or end is not None:
                    return False  # (a point that retires: each request planned alone)
                if token >= start and (stride == 1 or (token - base) % stride == 0):
                    found_points.append(point)
            generated = token - state.prompt_len  # (edits select generated tokens only)
            found_edits = [resolved for resolved in edits
                           if generated >= max(resolved.edit.position.start, 0)
                           and not (generated - resolved.edit.position.start)
                           % resolved.edit.stride]
            if matching is None:
                matching = (found_points, found_edits)
            elif (found_points, found_edits) != matching:  # (the same, compared in order)
                return False
        assert matching is not None
        found_points, found_edits = matching
        if found_points and not self._plan_rows(found_points, fed, states, tokens, slots):
            return False
        self.one_each = False  # (as add_window leaves it)
        self._plan_edit_slots(found_edits, slots)
        for state, token in zip(states, tokens, strict=True):
            for resolved in found_edits:
                for layer in resolved.edit.layers:
                    state.log_edit(resolved, layer, token)
        return True

    def _plan_edit_slots(self, edits: Sequence[Any], slots: list[Hashable]) -> None:
        """Each of ``edits`` at every one of ``slots``, at each of its layers: each
        pair's edits in the order :meth:`add_edit` of each request makes them."""
        for resolved in edits:
            for layer in resolved.edit.layers:
                entries = self.edits.setdefault((layer, resolved.edit.tensor_type), {})
                entry = entries.get(id(resolved))
                if entry is None:
                    entry = entries[id(resolved)] = EditSlots(resolved)
                entry.slots.extend(slots)

    def _plan_rows(self, points: Sequence[ExtractionPoint],
                   fed: Sequence[tuple[RequestState, int, Hashable]], states: list[RequestState],
                   tokens: list[int], slots: list[Hashable]) -> bool:
        """The plan of ``points`` matching each request's one token (request ``k``
        at row ``k`` of each group): what :meth:`add_window` of each gives. False,
        planning nothing, where two points share a (layer, tensor type) or a slot
        is given twice."""
        generated = all(map(operator.ge, tokens, map(_PROMPT_LEN, states)))  # no prompt token
        pairs = [(layer, point.tensor_type) for point in points for layer in set(point.layers)]
        if len(set(pairs)) != len(pairs) or len(set(slots)) != len(slots):
            return False
        layouts = [self._layout(point) for point in points]
        rows = dict(zip(slots, range(len(slots)), strict=True))
        for _, groups in layouts:
            for group in groups:
                group.slots, group._slot_index = list(slots), dict(rows)
        matches = self._matches
        assert matches is not None
        if len(points) == 1:
            point = points[0]
            layers, groups = layouts[0]
            matches.extend([PlanMatch(state, point, token_index, layers, [row] * len(groups), row)
                            for row, (state, token_index) in enumerate(zip(states, tokens,
                                                                           strict=True))])
            self.one_each = generated and len(set(map(id, states))) == len(states)
            return True
        for row, (state, token_index, _) in enumerate(fed):
            for point, (layers, groups) in zip(points, layouts, strict=True):
                matches.append(PlanMatch(state, point, token_index, layers,
                                         [row] * len(groups), len(matches)))
        return True

    # -- a plan rebuilt from columns (rows gathered elsewhere) -----------------
    def add_gathered(self, key: PairKey, count: int) -> CaptureGroup:
        """Declare the group of ``key`` as ``count`` rows gathered elsewhere (a vLLM
        worker gathers them and ships the rows with their columns): its slots are
        the row numbers ``0 .. count - 1``. With :meth:`add_match` this rebuilds a
        plan whose groups :meth:`CaptureSession.deliver` takes as they are."""
        if key in self.groups:
            raise ValueError(f"layer {key[0]} {key[1].value} is in this step plan already")
        group = self.groups[key] = CaptureGroup(key, self)
        group.slots = list(range(count))
        group._slot_index = dict(zip(range(count), range(count), strict=True))
        return group

    def add_match(self, state: RequestState, point: ExtractionPoint, token_index: int,
                  layers: tuple[int, ...], rows: list[int]) -> PlanMatch:
        """Append one (request, token, point) match: ``point``'s ``layers`` (in
        ascending order, each with a group, e.g. from :meth:`add_gathered`) sit at
        ``rows[j]`` of the group of ``(layers[j], point.tensor_type)``."""
        if self.base is not None:
            raise ValueError("a shifted step plan is complete: plan a new one to add to")
        self.one_each = False
        match = PlanMatch(state, point, token_index, layers, rows, len(self.matches))
        self.matches.append(match)
        return match

    def add_edit_window(self, state: RequestState, start: int, stop: int,
                        slot_of: Callable[[int], Hashable], *, log: bool = True) -> None:
        """Plan the edits that are on for the tokens ``[start, stop)`` of ``state``
        (``log=False`` for tokens recomputed after their edits were reported)."""
        for token_index, resolved in state.edits_in_window(start, stop):
            slot = slot_of(token_index)
            for layer in resolved.edit.layers:
                self.add_edit(state, resolved, layer, token_index, slot, log=log)

    def add_edit(self, state: RequestState, resolved: Any, layer: int, token_index: int,
                 slot: Hashable, *, log: bool = True) -> None:
        """Apply ``resolved`` at ``layer`` to the token at ``slot`` in this forward
        (``log=False`` for a replay of an edit already reported)."""
        edits = self.edits.setdefault((layer, resolved.edit.tensor_type), {})
        entry = edits.get(id(resolved))
        if entry is None:
            rank = next((index for index, mine in enumerate(state.edits) if mine is resolved),
                        len(state.edits))
            entry = edits[id(resolved)] = EditSlots(resolved, rank=rank)
            if len(edits) > 1 and rank < max(other.rank for other in edits.values()):
                # (planned after a request without the edits before it: each
                # request's edits meet at the pair in its own order)
                ordered = sorted(edits.items(), key=lambda item: item[1].rank)
                edits.clear()
                edits.update(ordered)
        entry.slots.append(slot)
        if log:
            state.log_edit(resolved, layer, token_index)

    def get(self, layer: int, tensor_type: TensorType) -> CaptureGroup | None:
        return self.groups.get((layer, tensor_type))

    def get_edits(self, layer: int, tensor_type: TensorType) -> Iterable[EditSlots] | None:
        """The edits to apply at (layer, tensor type) in this forward, in order."""
        edits = self.edits.get((layer, tensor_type))
        return None if edits is None else edits.values()

    def pairs(self) -> set[PairKey]:
        """Every (layer, tensor type) this forward captures or edits."""
        return set(self.groups) | set(self.edits)

    def __bool__(self) -> bool:
        return bool(self.groups) or bool(self.edits)


def quiet_steps(fed: Iterable[tuple[RequestState, int]]) -> int:
    """The steps from this one before any request of ``fed`` ((state, token
    index fed)) is fed a token its first point or edit left may take, each
    taking one token a step: the least :attr:`RequestState.quiet_until` less
    the token, and 0 as soon as one request's token is due (the others are
    not asked: a step where one is due plans)."""
    least = NEVER
    for state, token_index in fed:
        gap = state.quiet_until - token_index
        if gap <= 0:
            return 0
        least = min(least, gap)
    return least


def one_token_later(before: Sequence[tuple[RequestState, int, Hashable]],
                    now: Sequence[tuple[RequestState, int, Hashable]]) -> bool:
    """Whether a step feeding ``now`` ((state, token index, slot) per request)
    feeds the same requests at the same slots as one feeding ``before``, each
    the token after the one it fed then: with every request steady, its plan
    is the earlier plan :meth:`~StepPlan.shifted` by one."""
    return len(before) == len(now) and all(
        fed[0] is was[0] and fed[1] == was[1] + 1 and fed[2] == was[2]
        for fed, was in zip(now, before, strict=True))


class CaptureSession:
    """Bookkeeping for one generation call, shared by every backend.

    ``router`` (a :class:`~undercurrent.router.SessionRouter`) may be None when
    no point is declared. ``on_result`` is called with
    each ``ProbeResult`` as its request ends. ``windows``: nothing reads a
    request's signals before it ends (``generate()``, not ``stream()``), so the
    decode steps of an inline point whose probes cannot abort, or of an async
    point, may be routed several at a time (see
    :class:`~undercurrent.adapters.delivery._Window`).
    """

    def __init__(
        self,
        router: SessionRouter | None,
        points: Sequence[ExtractionPoint],
        *,
        model_name: str = "",
        keep_records: bool = False,
        on_result: Callable[[ProbeResult], Any] | None = None,
        edits: Sequence[Any] = (),
        request_edits: Mapping[str, Sequence[Any]] | None = None,
        windows: bool = False,
    ) -> None:
        self.router: SessionRouter | None = router
        self.windows = windows
        self.window: Any = None  # the decode steps held back (delivery._Window), if any
        # Every plan delivered, weakly: one no longer used is freed when the garbage
        # collector finds its cycle, as before; the rest are released at the end.
        self.delivered_plans: list[weakref.ref[StepPlan]] = []
        self.points = tuple(points)
        # Resolved edits (undercurrent.steering.ResolvedEdit) for every request, and
        # more for some requests (by request id), applied after the shared ones.
        self.edits = tuple(edits)
        self.request_edits = dict(request_edits or {})
        self.model_name = model_name
        self.keep_records = keep_records
        self.on_result = on_result
        self.requests: dict[str, RequestState] = {}
        self._registered: set[str] = set()
        self.aborted: list[RequestState] = []
        """The requests an inline probe aborted, in order (a backend finds a step's
        aborts past the length this had before it, without looking at every request)."""
        self.closes = 0
        """How many requests were closed (with :attr:`aborted`: whether any request
        ended since some earlier moment, without looking at every request)."""
        self.arms = 0
        """How many times a signal switched on a triggered edit (a backend that
        repeats its plans plans again after one)."""

    # -- lifecycle -------------------------------------------------------
    def open_request(self, request_id: str, prompt: str, prompt_token_ids: Sequence[int],
                     points: Sequence[ExtractionPoint] | None = None) -> RequestState:
        """Start tracking a request and register its points with the router."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already open in this generation")
        chosen = self.points if points is None else tuple(points)
        edits = (*self.edits, *self.request_edits.get(request_id, ()))
        state = RequestState(request_id, prompt, prompt_token_ids, chosen, self.keep_records,
                             edits)
        if chosen and self.router is not None:
            self.router.register_request(request_id, list(chosen), self._context(state))
            self._registered.add(request_id)
        self.requests[request_id] = state
        return state

    def open_requests(self, requests: Sequence[tuple[str, str, Sequence[int]]]
                      ) -> list[RequestState]:
        """:meth:`open_request` for each (request id, prompt, prompt token ids), with
        the session's points, all or nothing: registered with the router at once
        (``Router.register_requests``: the points checked and each probe built
        once) when the router can, else one by one."""
        register_many = getattr(self.router, "register_requests", None)
        if register_many is None or not self.points or len(requests) < 2:
            return [self.open_request(*request) for request in requests]
        ids = [request_id for request_id, _, _ in requests]
        if len(set(ids)) != len(ids) or not self.requests.keys().isdisjoint(ids):
            seen: set[str] = set()  # (the first id open already or given twice, named)
            for request_id in ids:
                if request_id in self.requests or request_id in seen:
                    raise ValueError(
                        f"request id {request_id!r} is already open in this generation")
                seen.add(request_id)
        bounds: dict[int, _Bounds] = {}  # (the same points for all: by prompt length)
        # (see RequestState.pass_edit_marks and quiet_until)
        worked: dict[tuple[Any, ...], _Worked | _Quiet | list[Any]] = {}
        shared = tuple(self.edits)  # (each request's own edits after these)
        mine = self.request_edits
        states = [RequestState(request_id, prompt, token_ids, self.points, self.keep_records,
                               (*shared, *mine[request_id]) if request_id in mine else shared,
                               bounds, worked)
                  for request_id, prompt, token_ids in requests]
        # (each request's context, as _context makes it: built in C, a field at a time)
        register_many(list(map(RequestContext.of_prompt, ids, map(_PROMPT, states),
                               map(_PROMPT_LEN, states), itertools.repeat(self.model_name),
                               map(_PROMPT_TOKEN_IDS, states))), list(self.points))
        self._registered.update(ids)
        self.requests.update(zip(ids, states, strict=True))
        return states

    def _context(self, state: RequestState) -> RequestContext:
        # (the state's prompt token ids are a tuple of ints already)
        return RequestContext.of_prompt(state.request_id, state.prompt, state.prompt_len,
                                        self.model_name, state.prompt_token_ids)

    def close_request(self, request_id: str, text: str,
                      finish_reason: str | None = None) -> GenerationOutput:
        """End a request: collect its probe results and build its output."""
        state = self.requests[request_id]
        if state.finish_reason is None:
            state.finish_reason = finish_reason or "length"
        flush_window(self)  # what was held back is judged before any request ends
        return self._output(state, text, self._end(request_id))

    def close_requests(self, closing: Sequence[tuple[str, str, str | None]]
                       ) -> list[GenerationOutput]:
        """:meth:`close_request` for each (request id, text, finish reason), in
        order, with the probe results of all of them collected from the router at
        once (``Router.end_requests``) when the router can: the same outputs, and
        ``on_result`` is called for each request's results in the same order.
        When the router cannot, each request is ended in turn."""
        states = [self.requests[request_id] for request_id, _, _ in closing]
        for state, (_, _, finish_reason) in zip(states, closing, strict=True):
            if state.finish_reason is None:
                state.finish_reason = finish_reason or "length"
        flush_window(self)  # what was held back is judged before any request ends
        router = self.router
        end_many = getattr(router, "end_requests", None)
        ended = [request_id for request_id, _, _ in closing if request_id in self._registered]
        if end_many is None or len(ended) < 2:
            return [self._output(state, text, self._end(request_id))
                    for state, (request_id, text, _) in zip(states, closing, strict=True)]
        self._registered.difference_update(ended)
        found = dict(zip(ended, end_many(ended), strict=True))
        outputs = []
        for state, (request_id, text, _) in zip(states, closing, strict=True):
            results = found.get(request_id, {})
            if self.on_result is not None:
                for result in results.values():
                    self.on_result(result)
            outputs.append(self._output(state, text, results))
        return outputs

    def _output(self, state: RequestState, text: str, results: dict[str, ProbeResult]
                ) -> GenerationOutput:
        """Mark a request closed (its finish reason set) and build its output."""
        assert state.finish_reason is not None
        state.closed = True
        self.closes += 1
        state.applied.freeze()
        if state.records is not None:  # (its own rows: not the batch's, kept with them)
            state.records.own_rows()
        # (every field given: built without the frozen __init__, one per request)
        return built(GenerationOutput, {
            "request_id": state.request_id,
            "prompt": state.prompt,
            "text": text,
            "token_ids": tuple(state.generated),
            "prompt_len": state.prompt_len,
            "prompt_token_ids": state.prompt_token_ids,
            "finish_reason": state.finish_reason,
            "abort": state.abort,
            "results": results,
            "signals": LazySequence(state.signals.__iter__),
            "records": state.records,
            # (a steady layout's edits built when read, as the signals are)
            "edits": (LazySequence(state.applied.__iter__) if state.applied.pending
                      else tuple(state.applied)),
        })

    def may_abort(self, request_ids: Iterable[str]) -> bool:
        """Whether a probe may stop one of these open requests before it ends
        (:meth:`~undercurrent.router.Router.may_abort`). Requests with no probe
        registered cannot be stopped; a router that cannot tell is taken to say
        yes."""
        router = self.router
        registered = [request_id for request_id in request_ids
                      if request_id in self._registered]
        if router is None or not registered:
            return False
        check = getattr(router, "may_abort", None)
        return True if check is None else bool(check(registered))

    def _end(self, request_id: str) -> dict[str, ProbeResult]:
        router = self.router
        if router is None or request_id not in self._registered:  # none registered
            return {}
        self._registered.discard(request_id)
        results = dict(router.end_request(request_id))
        if self.on_result is not None:
            for result in results.values():
                self.on_result(result)
        return results

    def abandon(self) -> None:
        """End every request still registered (after an error or interrupt), so the
        router holds no live request and no worker keeps waiting. Nothing waits
        for async queues to drain (no result is returned: what is still queued
        counts as dropped), and a second interrupt while ending them still ends
        every one, then propagates."""
        router = self.router
        if router is None:  # nothing was registered
            return
        try:
            flush_window(self)  # the steps held back are judged: their rows are counted
        except BaseException:  # noqa: BLE001 - the first error is what the caller sees
            self.window = None
        ids = list(self._registered)
        self._registered.clear()
        end_many = getattr(router, "end_requests", None)  # (the Router's; not a protocol's)
        if end_many is not None:
            try:  # one call: an interrupt part-way ends every binding not ended yet
                end_many(ids, timeout_s=0.0)
                return
            except Exception:  # noqa: BLE001 - some id was not live: each in turn below
                pass
        interrupted: BaseException | None = None
        for request_id in ids:
            try:
                router.end_request(request_id)
            except Exception:  # noqa: BLE001 - cleanup must reach every request
                pass
            except BaseException as error:  # noqa: BLE001 - raised once all are ended
                interrupted = interrupted or error
        if interrupted is not None:
            raise interrupted

    def release_plans(self) -> None:
        """Release every plan delivered so far that is still alive
        (:meth:`StepPlan.release`): a backend calls it once every request it
        delivered for is closed, so that what the plans reach (requests' states,
        signals, rows) is freed when the caller drops the outputs, not when the
        garbage collector next runs. The plans are held weakly until then: a
        long generation does not keep each step's plan."""
        for ref in self.delivered_plans:
            plan = ref()
            if plan is not None:
                plan.release()
        self.delivered_plans.clear()

    # -- per step --------------------------------------------------------
    @property
    def has_edits(self) -> bool:
        """True when any request of this session may be edited."""
        return bool(self.edits) or any(self.request_edits.values())

    def live_requests(self) -> list[RequestState]:
        states = list(self.requests.values())
        if list(map(_FINISH_REASON, states)).count(None) == len(states):  # (all live: in C)
            return states
        return [state for state in states if state.live]

    def wanted_pairs(self) -> set[PairKey]:
        """(layer, tensor type) pairs any live request can still match."""
        wanted: set[PairKey] = set()
        live = self.live_requests()
        if (not any(map(_LIVE_EDITS, live))
                and all(map(operator.is_, map(_LIVE_POINTS, live), map(_POINTS, live)))):
            # No edit, and every request's points all live (the usual case at the
            # start of a call, checked in C): the pairs of each points tuple, once.
            for state in dict(zip(map(id, map(_POINTS, live)), live, strict=True)).values():
                wanted |= state.wanted_pairs()
            return wanted
        done: set[int] = set()  # ids of the points tuples counted whole
        for state in live:
            points = state.points
            if not state._live_edits and len(state._live_points) == len(points):
                # Every point live and no edit: the pairs of its points, counted
                # once for the requests sharing them.
                if id(points) in done:
                    continue
                done.add(id(points))
            wanted |= state.wanted_pairs()
        return wanted

    def add_token(self, state: RequestState, token_id: int) -> None:
        """Record a sampled token for a live request."""
        state.generated.append(int(token_id))

    @property
    def registered(self) -> set[str]:
        """Ids of the requests registered with the router and not ended yet."""
        return self._registered

    def deliver(self, batches: Iterable[tuple[TensorType,
                                               CaptureGroup | Sequence[CaptureTarget], Any]]
                ) -> None:
        """Route the activations one forward pass captured.

        ``batches`` yields (tensor type, targets, rows) with ``rows[t.slot_index]``
        the captured tensor of target ``t`` (already on the CPU; rows of one
        torch tensor, numpy array or list). The targets are a plan's
        :class:`CaptureGroup` (its rows are ``rows[i]`` for ``group.slots[i]``;
        when every group of the plan arrives, nothing per vector is built) or a
        sequence of :class:`CaptureTarget` s. Each extraction point's rows go to
        the router as one :class:`~undercurrent.records.ActivationBatch` across
        requests (grouped by request, in layer order), in token order per
        request, so trajectory probes see a request's tokens in sequence; all of
        it inside one ``router.step()``. Signals, aborts and edit arming are
        applied per row from the returned columns.
        """
        deliver_forward(self, batches, getattr(self.router, "step", None))
