"""What the live view has seen so far, per request: tokens, scores and aborts.

Kept apart from the widgets so the bookkeeping is testable on its own. Events
are ``StreamEvent``s: a token event carries the decoded piece, and the inline
signals that arrived since the previous event (a generated token's own signals
come with the next event), each located by a ``TokenSignal``. A stream carries
no async point's signals: they are read from the final output's results (each
signal located by the router), so an async point's scores appear when its
request finishes. A NaN score is
taken as no score: it is not kept, so it neither shades a token nor moves the
scale, and the token reads "no score".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def known_score(score: Any) -> float | None:
    """``score`` as a float, or None where the probe gave none (``None`` or NaN)."""
    if score is None:
        return None
    value = float(score)
    return None if math.isnan(value) else value


@dataclass
class RequestTrace:
    """One request's stream so far.

    ``label`` is what the live view calls the request. ``pieces`` are the
    generated token texts in order, joined equal to the output's text (text a
    stream held back, as it could begin a stop string, is the piece of the token
    whose event carried it); ``scores`` maps
    ``(point, layer)`` to ``{x: score}`` where ``x`` is the generated index
    (negative for prompt tokens: ``prompt[-1]`` is -1), NaN scores left out;
    ``actions`` maps the same keys to ``{x: action}`` for flags and aborts;
    ``steered`` holds the generated indices of tokens sampled under a live edit.
    """

    request_id: str
    prompt: str = ""
    label: str = ""
    pieces: list[str] = field(default_factory=list)
    scores: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)
    actions: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)
    abort: Any = None
    finished: bool = False
    output: Any = None
    steered: set[int] = field(default_factory=set)

    def score_of(self, generated_index: int, point: str | None = None) -> float | None:
        """The score a point gave generated token ``generated_index`` (first point by default;
        the highest layer's when the point reads several)."""
        for (name, _layer), by_token in sorted(self.scores.items(),
                                               key=lambda item: (item[0][0], -item[0][1])):
            if point is not None and name != point:
                continue
            if generated_index in by_token:
                return by_token[generated_index]
        return None

    def abort_position(self) -> int | None:
        """The ``x`` of the token where a probe aborted (negative in the prompt), or None
        (no abort, or a prompt token's abort before the output tells the prompt length)."""
        if self.abort is None:
            return None
        if self.abort.generated_index is not None:
            return int(self.abort.generated_index)
        if self.output is None:
            return None
        return int(self.abort.token_index - self.output.prompt_len)

    def abort_message(self) -> str | None:
        """A sentence saying which point stopped the request, where, and with what score."""
        if self.abort is None:
            return None
        abort = self.abort
        where = (f"generated token {abort.generated_index}" if abort.generated_index is not None
                 else f"prompt token {abort.token_index}")
        score = known_score(abort.signal.score)
        return (
            f"aborted by {abort.extraction_point_name!r} (layer {abort.layer}) at {where}"
            + ("" if score is None else f", score {score:.3f}")
        )


class LiveState:
    """Accumulates stream events for any number of interleaved requests.

    Besides each request's trace it keeps what the view asks of all of them at
    every token (each point's score range, whether every score is a
    probability, the lowest token with a score, the aborted requests) up to
    date as signals arrive, so a token costs the same however many were shown.
    """

    def __init__(self) -> None:
        self.requests: dict[str, RequestTrace] = {}
        self.aborted: list[RequestTrace] = []
        """The requests a probe aborted, in the order they finished."""
        self.first_x = 0
        """The lowest token ``x`` with a score, 0 when none is negative (a prompt token)."""
        self._ranges: dict[str, tuple[float, float]] = {}
        self._outside_unit = False
        self._stale = False  # a score was replaced by another: count again from the traces

    def score_range(self, point: str | None) -> tuple[float, float] | None:
        """The lowest and highest finite score of ``point`` (any layer), or None."""
        self._refresh()
        return None if point is None else self._ranges.get(point)

    def probabilities(self) -> bool:
        """Whether every score kept (of any point) lies in [0, 1]."""
        self._refresh()
        return not self._outside_unit

    def _refresh(self) -> None:
        if not self._stale:
            return
        self._stale, self._ranges, self._outside_unit = False, {}, False
        for trace in self.requests.values():
            for (point, _layer), by_token in trace.scores.items():
                for score in by_token.values():
                    self._count(point, score)

    def _count(self, point: str, score: float) -> None:
        self._outside_unit = self._outside_unit or not 0.0 <= score <= 1.0
        if math.isfinite(score):
            low, high = self._ranges.get(point, (score, score))
            self._ranges[point] = (min(low, score), max(high, score))

    def trace(self, request_id: str) -> RequestTrace:
        """The trace of ``request_id`` (created on first sight)."""
        if request_id not in self.requests:
            self.requests[request_id] = RequestTrace(request_id)
        return self.requests[request_id]

    def add(self, event: Any) -> RequestTrace:
        """Fold one ``StreamEvent`` into its request's trace and return the trace."""
        trace = self.trace(event.request_id)
        for located in event.signals:
            self._add_signal(trace, located.extraction_point_name, located, located.signal)
        if event.token_id is not None and event.generated_index is not None:
            while len(trace.pieces) <= event.generated_index:
                trace.pieces.append("")
            trace.pieces[event.generated_index] = event.text
            if getattr(event, "edits", ()):
                trace.steered.add(event.generated_index)
        if event.finished:
            trace.finished = True
            trace.output = event.output
            if event.output is not None:
                trace.prompt = event.output.prompt
                if trace.abort is None and event.output.abort is not None:
                    self.aborted.append(trace)
                trace.abort = event.output.abort
                # Signals the stream may not have delivered one by one (e.g. the last token's).
                inline = set()
                for located in event.output.signals:
                    inline.add(located.extraction_point_name)
                    self._add_signal(trace, located.extraction_point_name, located,
                                     located.signal)
                self._add_async_signals(trace, event.output.results, inline)
                trace.steered.update(getattr(event.output, "steered_tokens", ()))
                text_tokens = len(event.output.token_ids)
                if text_tokens and len(trace.pieces) < text_tokens:
                    trace.pieces.extend([""] * (text_tokens - len(trace.pieces)))
        if event.token_id is None and event.text:
            # (text a stream held back, as it could begin a stop string that never
            # came: the last token's)
            if trace.pieces:
                trace.pieces[-1] += event.text
            else:
                trace.pieces.append(event.text)
        return trace

    def _add_async_signals(self, trace: RequestTrace, results: Any, inline: set[str]) -> None:
        """The signals of the points the stream did not carry (async points), from
        their ``ProbeResult``s; each signal says where it was emitted, as in
        ``signals_frame``."""
        for name, result in results.items():
            if name in inline:
                continue  # an inline point: its signals came with the events
            for signal in result.signals:
                if signal.layer is None or signal.token_index is None:
                    continue  # not located (a router always locates those it keeps)
                self._add_signal(trace, name, signal, signal)

    def _add_signal(self, trace: RequestTrace, point: str, located: Any, signal: Any) -> None:
        """Keep ``signal``'s score and action at the token ``located`` names (a
        ``TokenSignal``, or a ``ProbeSignal`` located by the router)."""
        key = (point, located.layer)
        if located.generated_index is not None:
            x = located.generated_index
        elif trace.output is not None:
            x = located.token_index - trace.output.prompt_len
        else:
            return  # a prompt token's signal: placed from the final output, which knows prompt_len
        score = known_score(signal.score)
        if score is not None:
            by_token = trace.scores.setdefault(key, {})
            if by_token.get(x, score) != score:
                self._stale = True  # (the score it replaces may have been an end of a range)
            by_token[x] = score
            self._count(point, score)
            self.first_x = min(self.first_x, x)
        action = getattr(signal.action, "value", signal.action)
        if action != "continue":
            trace.actions.setdefault(key, {})[x] = action
