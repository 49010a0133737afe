"""A request's log of applied edits (:class:`EditLog`), where the decode steps of
a steady layout are kept as one journal shared by every request of the layout.

A request's edits on a steady decode step (every request of the step at the
same points and the same always-on edits, see
:meth:`~undercurrent.adapters.session.StepPlan.add_steady_tokens`) are the
same ones at the same sites, one token later each step: the step's plan is the
last plan shifted (:meth:`~undercurrent.adapters.session.StepPlan.shifted`),
and planning it does nothing per request. What each request applied is then
the layout's list of shifts (:attr:`StepPlan.edit_steps`, one entry a step,
appended once for every request) read against the request's first token and
the layout's edits; :class:`EditLog` builds its :class:`AppliedEdit` s from
it when read, in the order logging each step gives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from undercurrent.adapters.outputs import AppliedEdit
from undercurrent.records import built

#: One (edit name, layer, tensor type value) a steady step applies, in the order
#: it logs them: each edit in turn, each of its layers in turn.
EditSite = tuple[str, int, str]


class EditLog(Sequence[AppliedEdit]):
    """A request's applied edits, in order (``AppliedEdit`` s, those of steady
    steps built when read). ``append`` one; ``follow`` a steady layout's
    journal of shifts until the next ``append`` or ``follow``."""

    __slots__ = ("_built", "_following", "_unsited", "_tape", "_read", "_stopped")

    def __init__(self) -> None:
        # (None until the first entry: a request with no edit keeps no list)
        self._built: list[AppliedEdit] | None = None
        # (journal, entries read, first token, prompt length, sites) while following
        self._following: list[Any] | None = None
        # The journals followed and stopped since the entries were last built,
        # as (where in _built their entries go, the shifts read, first token,
        # prompt length, sites): built with the rest when read.
        # (None until the first: most requests never stop one, and a list each
        # would only be more objects for the collector to track)
        self._stopped: list[tuple[int, list[int], int, int, tuple[EditSite, ...]]] | None = None
        # The shifts of journals no longer followed, not yet given to
        # take_unsited, as (shifts, first token, sites); the journal followed
        # keeps how many of its shifts were given (its sixth field). (None
        # until the first, as _stopped.)
        self._unsited: list[tuple[list[int], int, tuple[EditSite, ...]]] | None = None
        # What was done to this log since take_tape, where recorded (see record).
        self._tape: list[tuple[Any, ...]] | None = None
        self._read = 0  # (the entries the journal followed last gave, once it stopped)

    def record(self) -> None:
        """Keep a tape of what is done to this log from now on, for a copy of it
        elsewhere to replay (:meth:`take_tape`; ``RequestState.replay_edits``):
        a vLLM worker's log, replayed on the driver, where a steady step's edits
        are then one shift of a journal for every request instead of an entry
        each."""
        self._tape = []

    def take_tape(self) -> list[tuple[Any, ...]]:
        """What was done to this log since the last call, in order: ``("entry",
        applied)``, ``("follow", journal, token index, sites)`` and ``("stop",
        entries read)`` (a journal's following stopped after that many of its
        entries: an entry or a follow comes next)."""
        tape = self._tape
        if not tape:
            return []
        self._tape = []
        return tape

    def stop_at(self, read: int) -> None:
        """Stop following the journal after its first ``read`` entries (what a
        tape's ``("stop", read)`` says of the log it was taken from)."""
        assert self._following is not None
        self._catch_up(stop=True, upto=read)

    def append(self, applied: AppliedEdit) -> None:
        if self._following is not None:
            self._stop()
        if self._built is None:
            self._built = [applied]
        else:
            self._built.append(applied)
        if self._tape is not None:
            self._tape.append(("entry", applied))

    def follow(self, journal: list[int], token_index: int, prompt_len: int,
               sites: Sequence[EditSite]) -> None:
        """From now on, each shift ``d`` appended to ``journal`` (the first of them
        included, if there) means ``sites`` were edited at token ``token_index +
        d`` (a token of a sequence whose prompt has ``prompt_len`` tokens: a
        generated one, or a prompt token that a later chunk of a chunked prefill
        fed, which has no generated index)."""
        if self._following is not None:
            self._stop()
        self._following = [journal, 0, token_index, prompt_len, tuple(sites), 0]
        if self._tape is not None:
            self._tape.append(("follow", journal, token_index, tuple(sites)))

    def _stop(self) -> None:
        self._catch_up(stop=True)
        if self._tape is not None:  # (how far it read: its copy reads as far)
            self._tape.append(("stop", self._read))

    def freeze(self) -> None:
        """Keep the entries of the journal followed so far, and no later one (its
        request ended: what others append is theirs)."""
        following = self._following
        if following is not None:
            journal, read, token_index, _, sites, sited = following
            if sited < len(journal):
                self._add_unsited((journal[sited:], token_index, sites))
            frozen = journal[read:]
            following[0], following[1], following[5] = frozen, 0, len(frozen)

    def cut(self, end: int) -> None:
        """Follow no journal further and drop the entries at token ``end`` or
        after it (a request that ended before the model was fed its token
        ``end``, where the engine ran past that before it stopped it)."""
        entries = self._flush()
        if self._following is not None:
            self._catch_up(stop=True)  # (every shift read: nothing left to build)
        self._built = [entry for entry in entries if entry.token_index < end]

    @property
    def following(self) -> bool:
        """Whether a journal's entries may still become this log's."""
        return self._following is not None

    def _catch_up(self, *, stop: bool, upto: int | None = None) -> None:
        following = self._following
        assert following is not None
        journal, read, token_index, prompt_len, sites, sited = following
        shifts = journal[read:upto]
        following[1] = read + len(shifts)
        if stop:
            # (its entries built when read, in their place: a change of edits
            # stops every request's journal at once)
            self._read = following[1]
            self._following = None
            if shifts:
                stopped = (len(self._built or ()), shifts, token_index, prompt_len, sites)
                if self._stopped is None:
                    self._stopped = [stopped]
                else:
                    self._stopped.append(stopped)
            end = len(journal) if upto is None else upto
            if sited < end:
                self._add_unsited((journal[sited:end], token_index, sites))
        elif shifts:
            self._build_stopped()
            if self._built is None:
                self._built = []
            self._built += _entries(shifts, token_index, prompt_len, sites)

    def _add_unsited(self, piece: tuple[list[int], int, tuple[EditSite, ...]]) -> None:
        if self._unsited is None:
            self._unsited = [piece]
        else:
            self._unsited.append(piece)

    def _build_stopped(self) -> None:
        """Build the entries of the journals stopped since the last call, each
        in its place among the others."""
        stopped, self._stopped = self._stopped, None
        if not stopped:
            return
        before, built, done = self._built or [], [], 0
        for place, shifts, token_index, prompt_len, sites in stopped:
            built += before[done:place]
            done = place
            built += _entries(shifts, token_index, prompt_len, sites)
        built += before[done:]
        self._built = built

    def _flush(self) -> list[AppliedEdit]:
        if self._stopped:
            self._build_stopped()
        if self._following is not None:
            self._catch_up(stop=False)
        if self._built is None:
            self._built = []
        return self._built

    def clear(self) -> None:
        """Forget every entry, the journal followed and the tape."""
        self._built = self._following = self._unsited = self._stopped = None
        if self._tape is not None:
            self._tape = []

    def take_unsited(self) -> list[tuple[list[int], int, tuple[EditSite, ...]]]:
        """The journals' entries logged since the last call, as (shifts, first
        token, sites) in the order logged: ``sites`` edited at each token
        ``first + shift`` (for a request's map of edited sites, kept from the
        others as they are logged; no :class:`AppliedEdit` is built for it)."""
        following = self._following
        if not self._unsited and (following is None or following[5] == len(following[0])):
            return []  # (the usual case, read per request and step on the general path)
        pieces, self._unsited = self._unsited or [], None
        if following is not None and following[5] < len(following[0]):
            pieces.append((following[0][following[5]:], following[2], following[4]))
            following[5] = len(following[0])
        return pieces

    def __len__(self) -> int:
        return len(self._flush())

    @property
    def pending(self) -> bool:
        """Whether some entries are still to be built (a journal followed, or
        stopped since they were last read)."""
        return self._following is not None or bool(self._stopped)

    def __getitem__(self, index: Any) -> Any:
        return self._flush()[index]

    def __iter__(self) -> Iterator[AppliedEdit]:
        return iter(self._flush())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EditLog):
            return self._flush() == other._flush()
        if isinstance(other, list | tuple):
            return self._flush() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (mutable, compared by content)

    def __repr__(self) -> str:
        return f"EditLog({self._flush()!r})"


def _entries(shifts: list[int], token_index: int, prompt_len: int,
             sites: Sequence[EditSite]) -> list[AppliedEdit]:
    """The entries of a journal's ``shifts`` read from token ``token_index``
    (a prompt of ``prompt_len`` tokens): ``sites`` at each shifted token, each
    made as :class:`AppliedEdit` 's own ``__init__`` makes it."""
    return [built(AppliedEdit, {"edit_name": name, "layer": layer, "token_index": token,
                                "generated_index": (token - prompt_len
                                                    if token >= prompt_len else None),
                                "tensor_type": tensor_type})
            for token in [token_index + shift for shift in shifts]
            for name, layer, tensor_type in sites]
