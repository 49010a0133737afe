"""What a generation returns, shared by every backend: per-prompt outputs, the
abort that stopped a request, and the per-token events of a stream."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from undercurrent.records import ActivationRecord, ProbeResult, ProbeSignal, SignalAction


@dataclass(frozen=True)
class TokenSignal:
    """A signal an inline probe returned, with where it came from.

    ``token_index`` is absolute in the request's prompt + generated sequence;
    ``generated_index`` is None for prompt tokens.
    """

    extraction_point_name: str
    layer: int
    token_index: int
    generated_index: int | None
    signal: ProbeSignal

    @property
    def action(self) -> SignalAction:
        return self.signal.action

    @property
    def score(self) -> float | None:
        return self.signal.score


@dataclass(frozen=True)
class AbortInfo(TokenSignal):
    """The located signal that stopped a request: a :class:`TokenSignal` (same
    fields, no new ones) whose name says what it did.

    The request produced no token after ``token_index``'s activations were probed:
    with an abort on generated token ``g``, the output ends with token ``g``; an
    abort on a prompt token leaves the output empty.
    """


@dataclass(frozen=True)
class AppliedEdit:
    """One live edit applied to one token at one site.

    ``token_index`` is absolute in the request's prompt + generated sequence (the
    token whose activation was changed, in the forward pass that fed it);
    ``generated_index`` is None for prompt tokens. ``tensor_type`` is the site.
    """

    edit_name: str
    layer: int
    token_index: int
    generated_index: int | None
    tensor_type: str


def steered_indices(edits: Any, count: int | None = None) -> tuple[int, ...]:
    """Generated indices sampled in a forward pass that ``edits`` changed (below
    ``count`` when given)."""
    found = {0 if edit.generated_index is None else edit.generated_index + 1 for edit in edits}
    return tuple(sorted(i for i in found if count is None or i < count))


@dataclass(frozen=True)
class GenerationOutput:
    """One prompt's generation: text, tokens, abort and each point's ``ProbeResult``.

    ``token_ids`` are the generated tokens only (the prompt's are
    ``prompt_token_ids``); ``finish_reason`` is ``"length"``, ``"eos"``,
    ``"stop"`` (a stop string; ``text`` ends before it), ``"abort"``,
    ``"cancelled"`` (a stream that ``ProbedModel.close()`` ended), or
    ``"forward"`` for ``ProbedModel.prompt_activations`` (nothing generated).
    ``prompt`` is the prompt's text (decoded from the token ids when the call
    was given ``input_ids``).
    ``records`` holds the captured ``ActivationRecord``s only when the generation
    was asked for ``records=True``: a sequence (a list, or a backend's log that
    builds the records when first read, equal to the list of them). ``edits``
    lists every live edit applied, one :class:`AppliedEdit` per (edit, layer,
    token), in the order of the forward passes that applied them; within one
    pass, in the order the request's edits are listed (the spec's, the call's,
    then the prompt's), each edit's layers in its ``layers`` order, not in the
    order the model reaches the layers (a tuple, or a
    :class:`~undercurrent.records.LazySequence` equal to it).
    ``signals`` holds each inline signal located (:class:`TokenSignal`), in
    routing order; a backend may give a
    :class:`~undercurrent.records.LazySequence` that builds them when first
    read (it compares equal to the tuple of the same items).
    """

    request_id: str
    prompt: str
    text: str
    token_ids: tuple[int, ...]
    prompt_len: int
    prompt_token_ids: tuple[int, ...] = ()
    finish_reason: str = "length"
    abort: AbortInfo | None = None
    results: Mapping[str, ProbeResult] = field(default_factory=dict)
    signals: Sequence[TokenSignal] = ()
    records: Sequence[ActivationRecord] | None = None
    edits: Sequence[AppliedEdit] = ()

    @property
    def aborted(self) -> bool:
        """True when a probe's abort stopped this request."""
        return self.abort is not None

    @property
    def edited_tokens(self) -> tuple[int, ...]:
        """Generated indices of the fed tokens whose activations an edit changed."""
        return tuple(sorted({edit.generated_index for edit in self.edits
                             if edit.generated_index is not None}))

    @property
    def steered_tokens(self) -> tuple[int, ...]:
        """Generated indices of the tokens sampled under an edit: token g+1 for each
        edited fed token g, and token 0 when the prefill edited a prompt token."""
        return steered_indices(self.edits, len(self.token_ids))

    def summary(self) -> dict[str, Any]:
        """A compact, printable view: text, abort, each point's verdict, the
        error of each point whose probe raised, and each point's record counts
        (``received``, ``processed``, ``dropped``: an async probe whose queue was
        full dropped records, and its verdict saw only the processed ones)."""
        return {
            "request_id": self.request_id,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "aborted": self.aborted,
            "abort": None if self.abort is None else {
                "point": self.abort.extraction_point_name,
                "layer": self.abort.layer,
                "token_index": self.abort.token_index,
                "score": self.abort.signal.score,
            },
            "verdicts": {name: result.verdict for name, result in self.results.items()},
            "errors": {name: str(result.error) for name, result in self.results.items()
                       if result.error is not None},
            "stats": {name: {"received": result.stats.received,
                             "processed": result.stats.processed,
                             "dropped": result.stats.dropped}
                      for name, result in self.results.items()},
        }


@dataclass(frozen=True)
class StreamEvent:
    """One step of a stream.

    Token events carry ``token_id`` / ``text`` (the decoded piece) and their
    indices; ``signals`` are the inline signals that arrived since the previous
    event (a generated token's own activations are probed on the step after it is
    sampled, so its signals come with the next event). ``edits`` are the live edits
    applied since the previous event: those of the forward pass that sampled this
    token (non-empty means the token was sampled under an edit). The last event has
    ``finished=True``, ``token_id=None`` and the complete ``output``, with the
    signals and edits no event carried yet: the last token's signals, the edits
    of the forward pass whose activations aborted the request, those of
    ``capture_last_token`` 's extra forward. The events' ``edits`` joined equal
    ``output.edits``, as their ``signals`` joined equal ``output.signals``.

    The ``text`` of all events joined, the last one's included, equals
    ``output.text``: a stop string is never streamed (``output.text`` ends before
    it too), and text that could begin one is held back until the next token
    settles it; what was held back and never became a stop string comes with the
    last event.
    """

    request_id: str
    token_id: int | None
    text: str
    token_index: int | None
    generated_index: int | None
    signals: tuple[TokenSignal, ...] = ()
    aborted: bool = False
    finished: bool = False
    output: GenerationOutput | None = None
    edits: tuple[AppliedEdit, ...] = ()
