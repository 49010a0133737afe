"""One forward pass's captured rows, routed as columns: the delivery step of
:meth:`~undercurrent.adapters.session.CaptureSession.deliver`.

The hooks hand over one gathered tensor per (layer, tensor type). What each row
serves is a :class:`PlanMatch`, one per (request, token, point): the plan's own
matches when every group of one plan arrives (the HF hooks, the vLLM driver),
or matches gathered from :class:`~undercurrent.adapters.session.CaptureTarget`
s given one by one (:func:`matches_of_targets`: a KV capture that lost rows to
a sliding window, tests). Each extraction point's rows then become one
:class:`~undercurrent.records.ActivationBatch` across every request (rows
grouped by request, in layer order), gathered with one index operation per
layer (none where a layer's rows are already in order) and one stack, and routed
with one :meth:`~undercurrent.router.Router.route_columns` call. A forward that
feeds several tokens of a request (a prefill) is delivered in *waves*: wave
``k`` holds the ``k``-th fed token of each request, so a request's tokens reach
its probes in order and an abort stops the tokens after it, as routing record
by record would. A decode step is one wave.

Nothing per vector is built here beyond the index columns: signals stay
columns (:class:`SignalLog` materialises ``TokenSignal`` s when read) and
records are built only for ``records=True`` (:class:`RecordLog`).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import itertools
import operator
import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from undercurrent.adapters.outputs import AbortInfo, TokenSignal
from undercurrent.probes.arrays import numpy_module
from undercurrent.probes.base import ABORT_ONLY
from undercurrent.records import (
    ABORT_CODE,
    ACTION_CODES,
    CODE_ACTIONS,
    NO_SIGNAL,
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    DeferredRows,
    IntColumn,
    ProbeSignal,
    SignalAction,
    as_list,
    capture_time,
    concat_rows,
)

if TYPE_CHECKING:  # annotations only: the session imports this module
    from undercurrent.adapters.session import RequestState
    from undercurrent.spec.types import ExtractionPoint

_CONTINUE = ACTION_CODES[SignalAction.CONTINUE]
_LAYER_ORDER = operator.itemgetter(0, 1)


class PlanMatch:
    """One (request, token, point) a forward serves: the point's ``layers`` (in
    ascending order) sit at ``rows[j]`` of the gathered tensor of
    ``(layers[j], point.tensor_type)``. ``seq`` orders matches as planned: of
    two points' rows at one layer and token, the lower ``seq`` comes first
    (signals, records, which abort counts). ``orders`` (one per layer) replaces
    ``seq`` layer by layer where the order is not the same at every layer."""

    __slots__ = ("state", "point", "token_index", "layers", "rows", "seq", "orders")

    def __init__(self, state: RequestState, point: ExtractionPoint, token_index: int,
                 layers: tuple[int, ...], rows: list[int], seq: int,
                 orders: list[int] | None = None) -> None:
        self.state = state
        self.point = point
        self.token_index = token_index
        self.layers = layers
        self.rows = rows
        self.seq = seq
        self.orders = orders

    def order_of(self, column: int) -> int:
        """The order of the row of ``layers[column]`` among the rows of that layer."""
        return self.seq if self.orders is None else self.orders[column]


class RoutedPoint:
    """One point's batch of one wave and the signals routing it returned."""

    __slots__ = ("batch", "signals", "_located")

    def __init__(self, batch: ActivationBatch, signals: BatchSignals) -> None:
        self.batch = batch
        self.signals = signals
        self._located: list[ProbeSignal | None] | None = None

    def located(self) -> list[ProbeSignal | None]:
        """Every row's signal as an object, located (built once, shared by the
        requests of the batch)."""
        if self._located is None:
            self._located = self.signals.signals(self.batch)
        return self._located


class Journal(list[Any]):
    """What a steady layout's point gives its requests, one entry per decode
    step, in order: the routed batches that gave a signal (followed by each
    request's :class:`SignalLog`) or the captured batches (followed by each
    :class:`RecordLog`). Every request reads its own rows of each entry instead
    of being handed them step by step. ``intact`` turns False when a request
    stops following it."""

    __slots__ = ("intact",)

    def __init__(self) -> None:
        super().__init__()
        self.intact = False


class _Follow:
    """A request following a :class:`Journal`: its rows ``start:stop`` (serving
    ``match``) of each entry from ``first`` on are its own."""

    __slots__ = ("journal", "start", "stop", "match", "first")

    def __init__(self, journal: Journal, start: int, stop: int, match: Any) -> None:
        self.journal, self.start, self.stop, self.match = journal, start, stop, match
        self.first = len(journal)

    def take(self, stop: bool) -> list[Any]:
        """The entries not read yet; ``stop``: the last read (the journal is then
        no longer intact)."""
        journal = self.journal
        end = len(journal)  # an entry appended meanwhile is read next time
        fresh = journal[self.first:end]
        self.first = end
        if stop:
            journal.intact = False
        return fresh


class _WindowRuns:
    """A request's rows of a window of several points (:meth:`_Window.route`),
    read step by step when first needed: per point (routed or captured batch,
    the request's first row, rows per step, the match they serve), the rows
    of step ``s`` being ``start + s * count`` to ``start + (s + 1) * count``.
    A part of five entries holds some of the steps only (a window of
    alternating layouts): the fifth maps each of its steps to its place ``j``
    among them (its rows ``start + j * count`` on)."""

    __slots__ = ("parts", "steps")

    def __init__(self, parts: list[tuple[Any, ...]], steps: int) -> None:
        self.parts = parts
        self.steps = steps

    def tokens(self) -> Iterator[list[tuple[Any, int, int, Any]]]:
        """Each step's runs, as routing the step would have given them: one per
        point, (batch, start, stop, match)."""
        for step in range(self.steps):
            runs = []
            for part in self.parts:
                source, start, count, match = part[:4]
                place = step if len(part) == 4 else part[4].get(step)
                if place is not None:
                    runs.append((source, start + place * count, start + (place + 1) * count,
                                 match))
            yield runs

    def rows(self) -> int:
        """How many rows it holds."""
        return sum(part[2] * (self.steps if len(part) == 4 else len(part[4]))
                   for part in self.parts)


def _extents(entry: tuple[ActivationBatch, int, int] | _WindowRuns
             ) -> list[tuple[ActivationBatch, int, int]]:
    """(batch, start, stop): the rows of each captured batch a :class:`RecordLog`
    entry reads (a window's part: from its first step's to its last's)."""
    if not isinstance(entry, _WindowRuns):
        return [entry]
    found = []
    for part in entry.parts:
        source, start, count = part[:3]
        steps = entry.steps if len(part) == 4 else max(part[4].values(), default=-1) + 1
        if steps:
            found.append((source, start, start + steps * count))
    return found


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, those that overlap or touch joined."""
    spans: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
        else:
            spans.append((start, stop))
    return spans


def _moved_entry(entry: tuple[ActivationBatch, int, int] | _WindowRuns,
                 moved: dict[int, tuple[ActivationBatch, list[int], list[int]]]
                 ) -> tuple[ActivationBatch, int, int] | _WindowRuns:
    """A :class:`RecordLog` entry reading the batches of its own rows instead (by
    ``id`` of the batch they were copied from: the copy, each span's first row
    there, and where each span begins in the copy)."""

    def place(source: Any, row: int) -> tuple[Any, int]:
        found = moved.get(id(source))
        if found is None:
            return source, row
        own, starts, bases = found
        span = bisect.bisect_right(starts, row) - 1
        return own, bases[span] + row - starts[span]

    if not isinstance(entry, _WindowRuns):
        batch, start, stop = entry
        own, first = place(batch, start)
        return own, first, first + stop - start
    parts = []
    for part in entry.parts:
        own, first = place(part[0], part[1])
        parts.append((own, first, *part[2:]))
    return _WindowRuns(parts, entry.steps)


class SignalLog(Sequence[TokenSignal]):
    """A request's inline signals in routing order, kept as references to routed
    batches and built into ``TokenSignal`` s only when read."""

    def __init__(self) -> None:
        # (None until read: most logs are read once, or never)
        self._built: list[TokenSignal] | None = None
        # Per (wave, request): the rows of each routed point, as (routed point,
        # start, stop, the match they serve: it orders rows across points), that
        # one run itself where there is one; or a window's steps of several points.
        self._pending: list[_Run | list[_Run] | _WindowRuns] = []
        self.following: _Follow | None = None
        """The journal whose entries are this request's next signals, if any."""

    def add(self, runs: list[_Run]) -> None:
        """Signals of one token: each point's rows (run order: by point), with the
        match they serve or its order (see :func:`_order`)."""
        if self.following is not None:
            self._catch_up(stop=True)
        self._pending.append(runs)

    def add_run(self, run: _Run) -> None:
        """:meth:`add` of one point's rows of one token (or of a window's steps of
        one point), kept as they are: no list around them, since a request
        keeps one per step (or window) until its signals are read."""
        if self.following is not None:
            self._catch_up(stop=True)
        self._pending.append(run)

    def add_window(self, runs: _WindowRuns) -> None:
        """Signals of a window's steps, several points routed together."""
        if self.following is not None:
            self._catch_up(stop=True)
        self._pending.append(runs)

    def follow(self, journal: Journal, start: int, stop: int, match: PlanMatch) -> None:
        """From now on, each entry added to ``journal`` holds this request's
        signals of one token, at rows ``start:stop``, until :meth:`add` or
        another ``follow``."""
        if self.following is not None:
            self._catch_up(stop=True)
        self.following = _Follow(journal, start, stop, match)

    def _catch_up(self, *, stop: bool) -> None:
        """The followed journal's new entries, as pending runs; ``stop``: follow
        it no more."""
        follow = self.following
        assert follow is not None
        start, end, match = follow.start, follow.stop, follow.match
        self._pending.extend((routed, start, end, match) for routed in follow.take(stop))
        if stop:
            self.following = None

    def _flush(self) -> list[TokenSignal]:
        if self.following is not None:
            self._catch_up(stop=False)
        built = self._built
        if built is None:
            built = self._built = []
        if self._pending:
            pending, self._pending = self._pending, []
            for runs in pending:
                if isinstance(runs, _WindowRuns):
                    for token in runs.tokens():
                        built.extend(_token_signals(token))
                elif isinstance(runs, tuple):  # (one run)
                    built.extend(_token_signals([runs]))
                else:
                    built.extend(_token_signals(runs))
        return built

    def __len__(self) -> int:
        return len(self._flush())

    def __getitem__(self, index: Any) -> Any:
        return self._flush()[index]

    def __iter__(self) -> Iterator[TokenSignal]:
        return iter(self._flush())


#: A point's rows of one token in a request's signal log: (routed point, start,
#: stop, the match they serve or its order: see :func:`_order`).
_Run = tuple["RoutedPoint", int, int, "PlanMatch | int"]


def _token_signals(runs: list[_Run]) -> list[TokenSignal]:
    """One token's TokenSignals, in (layer, arrival) order across its points (a
    run's match, or its order where that is one number: see :func:`_order`)."""
    found: list[tuple[int, int, TokenSignal]] = []
    for routed, start, stop, match in runs:
        signals = routed.located()
        batch = routed.batch
        for offset, row in enumerate(range(start, stop)):
            signal = signals[row]
            if signal is None:
                continue
            layer = int(batch.layers[row])
            order = match if isinstance(match, int) else match.order_of(offset)
            found.append((layer, order, TokenSignal(
                batch.point_names[row], layer, int(batch.token_indices[row]),
                batch.generated_indices[row], signal)))
    if len(runs) > 1:
        found.sort(key=lambda item: item[:2])
    return [located for _, _, located in found]


class RecordLog(Sequence[ActivationRecord]):
    """A request's captured activations (``records=True``), as row ranges of
    captured batches; the records are built when read (``len`` builds nothing).
    It compares equal to a list of the same records, and ``+`` gives a list."""

    def __reduce__(self) -> tuple[Any, ...]:
        # (pickled, or deep-copied, as the list of its records: the captured
        # batches it reads from hold locks and builders neither can copy)
        return (list, (list(self),))

    def __init__(self) -> None:
        self._built: list[ActivationRecord] = []
        # (batch, start, stop), or a window's steps of several points
        self._pending: list[tuple[ActivationBatch, int, int] | _WindowRuns] = []
        self._pending_rows = 0
        self.following: _Follow | None = None
        """The journal of captured batches whose entries hold this request's
        next records (its rows ``start:stop`` of each), if any."""

    def add(self, refs: Iterable[tuple[ActivationBatch, int]]) -> None:
        """The records of rows ``(batch, row)``, in order."""
        if self.following is not None:
            self._catch_up(stop=True)
        before = len(self._pending)
        self._pending.extend((batch, row, row + 1) for batch, row in refs)
        self._pending_rows += len(self._pending) - before

    def add_rows(self, batch: ActivationBatch, start: int, stop: int) -> None:
        """The records of rows ``start:stop`` of ``batch``, in order."""
        if self.following is not None:
            self._catch_up(stop=True)
        self._pending.append((batch, start, stop))
        self._pending_rows += stop - start

    def add_window(self, runs: _WindowRuns) -> None:
        """The records of a window's steps, several points captured together: in
        each step, in the order routing the step gives them."""
        if self.following is not None:
            self._catch_up(stop=True)
        self._pending.append(runs)
        self._pending_rows += runs.rows()

    def follow(self, journal: Journal, start: int, stop: int, match: Any = None) -> None:
        """From now on, rows ``start:stop`` of each batch added to ``journal`` are
        this request's records of one token, until :meth:`add` or another
        ``follow`` (``match``: what the rows serve, as for :meth:`SignalLog.follow`)."""
        if self.following is not None:
            self._catch_up(stop=True)
        self.following = _Follow(journal, start, stop, match)

    def _catch_up(self, *, stop: bool) -> None:
        follow = self.following
        assert follow is not None
        start, end = follow.start, follow.stop
        batches = follow.take(stop)
        self._pending.extend((batch, start, end) for batch in batches)
        self._pending_rows += len(batches) * (end - start)
        if stop:
            self.following = None

    def _flush(self) -> list[ActivationRecord]:
        if self.following is not None:
            self._catch_up(stop=False)
        if self._pending:
            pending, self._pending, self._pending_rows = self._pending, [], 0
            built = self._built
            for entry in pending:
                if isinstance(entry, _WindowRuns):
                    for pieces in entry.tokens():
                        built += [batch.records()[row] for batch, row in _record_refs(pieces)]
                else:
                    batch, start, stop = entry
                    built += batch.records()[start:stop]
        return self._built

    def own_rows(self) -> None:
        """Copy this request's rows out of the captured batches it shares with the
        other requests of its batch (a window's steps of every request are one
        tensor) into batches of its own, one copy per captured batch: its
        records, still built when read, then keep alive their own activations,
        not the whole batch's. Called when the request ends."""
        if self.following is not None:
            self._catch_up(stop=False)
        used: dict[int, tuple[ActivationBatch, list[tuple[int, int]]]] = {}
        for entry in self._pending:
            for source, start, stop in _extents(entry):
                used.setdefault(id(source), (source, []))[1].append((start, stop))
        moved: dict[int, tuple[ActivationBatch, list[int], list[int]]] = {}
        for key, (source, ranges) in used.items():
            spans = _merged(ranges)
            own = source.own_rows(spans)
            if own is not None:
                bases = list(itertools.accumulate((stop - start for start, stop in spans),
                                                  initial=0))
                moved[key] = (own, [start for start, _ in spans], bases)
        if moved:
            self._pending = [_moved_entry(entry, moved) for entry in self._pending]

    def clear(self) -> None:
        """Forget every record (as ``list.clear``: a consumer frees the memory)."""
        self._built, self._pending, self._pending_rows = [], [], 0
        if self.following is not None:
            self.following.take(False)  # read: those are forgotten too

    def __len__(self) -> int:
        # counting builds nothing
        count = len(self._built) + self._pending_rows
        follow = self.following
        if follow is not None:
            count += (len(follow.journal) - follow.first) * (follow.stop - follow.start)
        return count

    def __getitem__(self, index: Any) -> Any:
        return self._flush()[index]

    def __iter__(self) -> Iterator[ActivationRecord]:
        return iter(self._flush())

    def __repr__(self) -> str:
        return repr(self._flush())

    def __add__(self, other: Iterable[ActivationRecord]) -> list[ActivationRecord]:
        return [*self._flush(), *other]

    def __radd__(self, other: Iterable[ActivationRecord]) -> list[ActivationRecord]:
        return [*other, *self._flush()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, RecordLog)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def gather(sources: Sequence[Any], picks: Sequence[tuple[int, int]]) -> Any:
    """The rows ``sources[source][slot]`` for each (source, slot), stacked: the
    source itself when it is exactly that, else one concatenation (several
    sources) and one index operation."""
    used = sorted({source for source, _ in picks})
    if len(used) == 1:
        base = sources[used[0]]
        flat = [slot for _, slot in picks]
    else:
        offsets, total = {}, 0
        for source in used:
            offsets[source] = total
            total += len(sources[source])
        base = concat_rows([sources[source] for source in used])
        flat = [offsets[source] + slot for source, slot in picks]
    if len(flat) == len(base) and flat == list(range(len(flat))):
        return base
    if hasattr(base, "detach"):  # torch (imported already): one index_select
        return base.index_select(0, base.new_tensor(flat, dtype=sys.modules["torch"].long))
    if hasattr(base, "__array__"):
        return base[flat]
    return [base[i] for i in flat]


def deliver_forward(session: Any, batches: Iterable[tuple[Any, Any, Any]],
                    step: Any = None) -> None:
    """Route one forward pass's captures (see the module docstring), inside
    ``step()`` (the router's :meth:`~undercurrent.router.Router.step`) when
    given, unless it routes nothing (a decode step held in a window).

    ``batches`` yields (tensor type, targets, rows): the targets are a
    :class:`~undercurrent.adapters.session.CaptureGroup` of a plan, or any
    sequence of :class:`~undercurrent.adapters.session.CaptureTarget` s. When
    every group of one plan arrives, the plan's matches are delivered as they
    are (no object per vector); otherwise the targets are first gathered into
    matches (:func:`matches_of_targets`).
    """
    batches = list(batches)
    window = getattr(session, "window", None)
    if window is not None and window.take(session, batches):
        return  # (a decode step like the last one held: held as it came)
    plan = _whole_plan(batches)
    if plan is not None:
        sources = dict(zip(map(_KEY, map(_TARGETS, batches)), map(_ROWS_OF, batches),
                           strict=True))
        if plan.base is not None and _deliver_steady(session, plan, sources, step):
            plan.delivered()  # (read by nothing now: no cycle left for the collector)
            return
        plans = getattr(session, "delivered_plans", None)
        if plans is not None and (not plans or plans[-1]() is not plan):
            plans.append(weakref.ref(plan))  # see CaptureSession.release_plans
        if plan.repeatable and plan.base is None and _deliver_steady(session, plan, sources,
                                                                     step):
            return
        with _stepping(step):
            flush_window(session)
            _deliver_matches(session, plan.matches, sources)
        return
    with _stepping(step):
        flush_window(session)
        matches, sources = matches_of_targets(batches)
        _deliver_matches(session, matches, sources)


def _stepping(step: Any) -> Any:
    """``step()``, or a block that does nothing when there is no step."""
    return step() if step is not None else contextlib.nullcontext()


def matches_of_targets(batches: Sequence[tuple[Any, Any, Any]]
                       ) -> tuple[list[PlanMatch], dict[Any, Any]]:
    """Targets given one by one, as the matches a plan would hold: one
    :class:`PlanMatch` per (request, token, point), in the order of their first
    target, each layer's row in the rows of its (layer, tensor type) (the rows
    of two batches of one (layer, tensor type) are joined), and each row's
    order among its layer's rows the order its target came in."""
    sources: dict[Any, Any] = {}
    found: dict[tuple[str, int, str], tuple[Any, Any, int, dict[int, tuple[int, int]]]] = {}
    arrival = 0  # a row's order among its layer's rows: the order the targets came in
    for tensor_type, targets, rows in batches:
        if getattr(targets, "plan", None) is not None:
            targets = targets.targets  # a plan's group, the plan incomplete
        offsets: dict[Any, int] = {}
        for target in targets:
            key = (target.layer, tensor_type)
            offset = offsets.get(key)
            if offset is None:
                earlier = sources.get(key)
                offset = offsets[key] = 0 if earlier is None else len(earlier)
                sources[key] = rows if earlier is None else concat_rows([earlier, rows])
            state = target.state
            where = (state.request_id, target.token_index, target.point.name)
            match = found.get(where)
            if match is None:
                match = found[where] = (state, target.point, target.token_index, {})
            match[3][target.layer] = (offset + target.slot_index, arrival)
            arrival += 1
    matches = []
    for seq, (state, point, token_index, by_layer) in enumerate(found.values()):
        layers = tuple(sorted(by_layer))
        matches.append(PlanMatch(state, point, token_index, layers,
                                 [by_layer[layer][0] for layer in layers], seq,
                                 [by_layer[layer][1] for layer in layers]))
    return matches, sources


# -- one forward's matches, delivered without an object per vector --


def _whole_plan(batches: Sequence[tuple[Any, Any, Any]]) -> Any:
    """The plan whose every group is among ``batches`` (each once), else None."""
    if not batches:
        return None
    plan: Any = getattr(batches[0][1], "plan", None)
    if plan is None or len(batches) != len(plan.groups):
        return None
    groups = list(map(_TARGETS, batches))
    try:  # (read in C: a forward's few batches, once per step)
        if (set(map(_PLAN, groups)) != {plan}
                or len(set(map(_KEY, groups))) != len(groups)):
            return None
        # How many rows: a tensor's or array's first dimension (read without
        # Tensor.__len__, Python code in torch).
        heights = list(map(_HEIGHT, map(_SHAPE, map(_ROWS_OF, batches))))
    except (AttributeError, IndexError, TypeError):  # (targets or rows of other kinds)
        return _whole_plan_each(batches, plan)
    return plan if heights == list(map(len, map(_SLOTS, groups))) else None


def _whole_plan_each(batches: Sequence[tuple[Any, Any, Any]], plan: Any) -> Any:
    """:func:`_whole_plan` of ``plan`` for batches whose targets or rows are not
    all a plan's groups and tensors: each looked at in turn."""
    keys = set()
    for _, targets, rows in batches:
        if getattr(targets, "plan", None) is not plan:
            return None
        # How many rows: a tensor's or array's first dimension, or a list's length.
        shape = getattr(rows, "shape", None)
        if (int(shape[0]) if shape else len(rows)) != len(targets.slots):
            return None
        keys.add(targets.key)
    return plan if len(keys) == len(plan.groups) else None


_TARGETS = operator.itemgetter(1)  # a forward's batch: (tensor type, targets, rows)
_ROWS_OF = operator.itemgetter(2)
_PLAN = operator.attrgetter("plan")
_KEY = operator.attrgetter("key")
_SLOTS = operator.attrgetter("slots")
_SHAPE = operator.attrgetter("shape")
_HEIGHT = operator.itemgetter(0)


def _deliver_matches(session: Any, matches: Sequence[PlanMatch],
                     sources: dict[Any, Any]) -> None:
    """Deliver one forward's matches: each request's tokens in order (one wave
    per token), every point of a wave as one batch."""
    per_request: dict[str, tuple[Any, list[Any]]] = {}
    one_token = True  # every request feeds one token (a decode step): one wave
    for match in matches:
        state = match.state
        found = per_request.get(state.request_id)
        if found is None:
            per_request[state.request_id] = (state, [match])
            continue
        found[1].append(match)
        if one_token and match.token_index != found[1][0].token_index:
            one_token = False
    if one_token:
        current = [item for item in per_request.values() if not item[0].closed]
        if current:
            _deliver_wave(session, current, sources)
        return
    queues: list[tuple[Any, list[list[Any]]]] = []
    for state, mine in per_request.values():
        if state.closed:
            continue  # nothing is routed after the request ended
        if any(mine[i].token_index > mine[i + 1].token_index for i in range(len(mine) - 1)):
            mine.sort(key=lambda match: match.token_index)  # stable: plan order kept
        tokens: list[list[Any]] = []
        for match in mine:
            if tokens and tokens[-1][0].token_index == match.token_index:
                tokens[-1].append(match)
            else:
                tokens.append([match])
        queues.append((state, tokens))
    wave = 0
    while True:
        current = [(state, tokens[wave]) for state, tokens in queues if wave < len(tokens)]
        if not current:
            return
        _deliver_wave(session, current, sources)
        wave += 1


def _deliver_wave(session: Any, current: list[tuple[Any, list[Any]]],
                  sources: dict[Any, Any]) -> None:
    """Route one token of each request in ``current``: one batch per point."""
    live, by_point = _wave_points(current)
    if not live:
        return
    registered = session.registered
    points = []
    for items in by_point.values():
        batch, spans = _point_batch(items, sources)
        points.append((batch, spans, [(state.request_id, start, stop)
                                      for state, start, stop, _ in spans
                                      if state.request_id in registered]))
    _route_wave(session, live, points)


def _wave_points(current: list[tuple[Any, list[Any]]]
                 ) -> tuple[list[Any], dict[str, list[tuple[Any, Any]]]]:
    """The requests of ``current`` whose token is probed, and their matches by
    point, as (state, match) in request order."""
    by_point: dict[str, list[tuple[Any, Any]]] = {}
    live: list[Any] = []
    for state, matches in current:
        if state.closed:
            continue
        abort = state.abort
        if abort is not None and matches[0].token_index > abort.token_index:
            # Tokens after the abort are never probed; the aborting token's other
            # records still reach every point, so observers see what the guard saw.
            continue
        live.append(state)
        for match in matches:
            items = by_point.get(match.point.name)
            if items is None:
                items = by_point[match.point.name] = []
            items.append((state, match))
    return live, by_point


def _own_tensors(points: Sequence[tuple[ActivationBatch, Any, Any]]) -> None:
    """Give each point's batch a tensor of its own where an earlier point's batch
    of the wave holds the very same one (points capturing the same rows: the
    gather hands each the captured tensor as it is), before any is routed: a
    probe that changes its record's tensor in place then changes neither what
    another point's probes receive nor the records kept for it."""
    seen: set[int] = set()
    for batch, _, _ in points:
        rows = batch._tensor
        if rows is None:
            continue  # (built from records)
        if isinstance(rows, DeferredRows):
            # Stacked when first read, from its layers' tensors: the very ones a point
            # of one of those layers holds (the stack, a copy, is made only later).
            # Its pieces are the list its make() stacks: a shared one is replaced there.
            pieces = rows.pieces or []
            for index, piece in enumerate(pieces):
                if id(piece) in seen:
                    pieces[index] = _copied(piece)
                else:
                    seen.add(id(piece))
        elif id(rows) in seen:
            batch._tensor = _copied(rows)
        else:
            seen.add(id(rows))


def _copied(rows: Any) -> Any:
    """A copy of a batch's rows: a torch tensor's or a numpy array's (a list of
    rows, as tests give, copied deeply)."""
    if hasattr(rows, "detach"):
        return rows.clone()
    if hasattr(rows, "__array__") and hasattr(rows, "copy"):
        return rows.copy()
    return copy.deepcopy(rows)


def _route_wave(session: Any, live: list[Any],
                points: Sequence[tuple[ActivationBatch, list[tuple[Any, int, int, Any]],
                                       list[tuple[str, int, int]]]],
                journal: Journal | None = None, edits: bool = True,
                kept_journal: Journal | None = None) -> None:
    """Route each point's batch of one wave, as (batch, spans, the spans to
    route: those of registered requests), then give each request of ``live``
    its signals, records and abort. ``journal`` and ``kept_journal``: one
    point, whose requests follow these journals (the routed batch and the
    captured one are appended once, not handed to each request); ``edits``:
    whether any request may have live edits to arm."""
    if len(points) > 1:
        _own_tensors(points)
    router = session.router
    kept_rows: dict[str, list[tuple[ActivationBatch, int, int, Any]]] = {}
    # A request's runs of one token, by point; with one point, each is added at once.
    runs: dict[str, list[_Run]] | None = (
        {} if len(points) > 1 else None)
    aborts: dict[str, tuple[int, int, RoutedPoint, int]] = {}
    for batch, spans, routed_spans in points:
        if kept_journal is not None:
            kept_journal.append(batch.without_cache())
        elif session.keep_records:
            kept = batch.without_cache()  # the activations, not what probes derived
            for state, start, stop, match in spans:
                kept_rows.setdefault(state.request_id, []).append((kept, start, stop, match))
        if router is None or not routed_spans:
            continue
        signals = router.route_columns(batch, routed_spans)  # a row each, spans or not
        if not signals.any_signal():
            continue
        routed = RoutedPoint(batch.index_view(), signals)  # the tensor may go
        any_abort = signals.any_abort()
        if journal is not None:
            journal.append(routed)  # every request's signals of this token
            if not any_abort and not edits:
                continue
        # (each row's code, read where a request may abort or arm an edit)
        codes = as_list(signals.actions) if any_abort or edits else []
        for state, start, stop, match in spans:
            if journal is None:  # else: appended above, once for every request
                if runs is None:
                    state.signals.add_run((routed, start, stop, _order(match)))
                else:
                    runs.setdefault(state.request_id, []).append(
                        (routed, start, stop, _order(match)))
            if any_abort and ABORT_CODE in codes[start:stop]:
                row = codes.index(ABORT_CODE, start, stop)
                key = (match.layers[row - start], match.order_of(row - start), routed, row)
                best = aborts.get(state.request_id)
                if best is None or key[:2] < best[:2]:
                    aborts[state.request_id] = key
            if edits and state.edits:  # (an edit a signal may arm)
                for row in range(start, stop):
                    if codes[row] not in (NO_SIGNAL, _CONTINUE) and state.arm(
                            batch.point_names[row], CODE_ACTIONS[codes[row]],
                            int(batch.token_indices[row])):
                        session.arms += 1
    if not kept_rows and not runs and not aborts:
        return
    for state in live:
        if state.records is not None:
            pieces = kept_rows.get(state.request_id)
            if pieces:
                state.records.add(_record_refs(pieces))
        found = None if runs is None else runs.get(state.request_id)
        if found is not None:
            state.signals.add(found)
        abort = aborts.get(state.request_id)
        if abort is not None and state.abort is None:
            _, _, routed, row = abort
            batch = routed.batch
            signal = routed.located()[row]
            assert signal is not None
            state.abort = AbortInfo(batch.point_names[row], int(batch.layers[row]),
                                    int(batch.token_indices[row]),
                                    batch.generated_indices[row], signal)
            state.finish_reason = "abort"
            session.aborted.append(state)


def _order(match: PlanMatch) -> PlanMatch | int:
    """What a request's signal log keeps of the match its rows of one step serve:
    the order of its rows among the step's (``seq``), where that is one number
    for every layer, else the match. A log keeps its runs until the request's
    signals are read, a step each: plain numbers there let each step's plan,
    its matches and their row lists go when the step is delivered, rather
    than staying until the request ends (for the garbage collector to walk
    over again at each full collection)."""
    return match.seq if match.orders is None else match


# -- a plan repeated one token later (StepPlan.shifted): the batches' layout kept --


_MATCH = operator.itemgetter(3)  # a span's match: (state, start, stop, match)
_FIRST = operator.itemgetter(0)  # a span's state, or a (state, match) item's
_STATE = operator.attrgetter("state")
_PROMPT_LEN = operator.attrgetter("prompt_len")
_TOKEN_INDEX = operator.attrgetter("token_index")
_SECOND = operator.itemgetter(1)  # a (state, match) item's match
_REQUEST_ID = operator.attrgetter("request_id")
_GENERATED = operator.attrgetter("generated")
_CLOSED = operator.attrgetter("closed")
_ABORT = operator.attrgetter("abort")
_ROWS = operator.attrgetter("rows")


class _SteadyPoint:
    """One point's batch in every plan that repeats a base plan: what does not
    change from one step to the next, computed once."""

    __slots__ = ("name", "tensor_type", "keys", "picks", "whole", "heights", "count", "states",
                 "base_tokens", "known", "request_ids", "point_names", "layers", "tokens",
                 "generated", "spans", "routed_spans", "journal", "kept", "bases", "windowed",
                 "edits", "row_edits", "origin")

    def __init__(self, items: list[tuple[Any, PlanMatch]], registered: set[str],
                 edited: dict[Any, tuple[str, ...]] | None = None) -> None:
        first = items[0][1]
        point, layers = first.point, first.layers
        self.name = point.name
        self.tensor_type = point.tensor_type
        self.keys = [(layer, self.tensor_type) for layer in layers]
        # The edits every step applies at each of its layers (a row's ``edits``),
        # None where none applies at any (see _SteadyLayout.of); where they
        # differ between requests (a triggered edit switched on for some),
        # ``row_edits``: each row's of a step, request-major, layer-minor.
        self.edits: list[tuple[str, ...]] | None = None
        self.row_edits: list[tuple[str, ...]] | None = None
        states = list(map(_FIRST, items))
        matches = list(map(_SECOND, items))
        self._set_edits(edited, matches)
        self.picks: list[Any] | None = None  # index tensors, made from the first sources
        self.whole = False  # every pick None (each source is the layer's rows, in order)
        self.heights: list[int] | None = None  # the first sources' heights (see moved)
        count = self.count = len(layers)
        tokens = list(map(_TOKEN_INDEX, matches))
        # Each request, and its token in the base plan (two columns: no pair
        # per request for the collector to track)
        self.states, self.base_tokens = states, tokens
        ids = list(map(_REQUEST_ID, states))
        self.known = list(map(_GENERATED, states))  # (the lists themselves)
        # (each request's id once per layer, repeated in C)
        self.request_ids = ids if count == 1 else list(
            itertools.chain.from_iterable(zip(*[ids] * count, strict=True)))
        self.point_names = [point.name] * (count * len(items))
        self.layers = list(layers) * len(items)
        # Each request's base token and its index among the request's generated
        # tokens (``bases``), and each row's, as int64 arrays: a step's
        # columns are a row's plus the step's shift (IntColumns).
        np = numpy_module()
        bases = np.array(tokens, dtype=np.int64)
        offsets = bases - np.array(list(map(_PROMPT_LEN, states)), dtype=np.int64)
        self.bases: tuple[Any, Any] = (bases, offsets)
        self.tokens = np.repeat(bases, count)
        self.generated = np.repeat(offsets, count)
        # (each request's rows: ``count`` from ``row * count``; zipped in C)
        starts = range(0, count * len(items), count)
        stops = range(count, count * (len(items) + 1), count)
        self.spans = list(zip(states, starts, stops, matches, strict=True))
        self.routed_spans = (list(zip(ids, starts, stops, strict=True))
                             if registered.issuperset(ids) else
                             [(state.request_id, start, stop)
                              for state, start, stop, _ in self.spans
                              if state.request_id in registered])
        # What the requests follow when this is the only point: routed batches
        # (signals) and captured ones (records=True).
        self.journal = Journal()
        self.kept = Journal()
        self.windowed: dict[int, list[tuple[str, int, int]]] = {}  # see window_spans
        # Where this point's rows come from: a mark shared by the points moved
        # from one point (see moved), and how many tokens on from that
        # point's this one's rows are (0 for that point itself).
        self.origin: tuple[object, int] = (object(), 0)

    def _set_edits(self, edited: dict[Any, tuple[str, ...]] | None,
                   matches: Sequence[PlanMatch]) -> None:
        """:attr:`edits` and :attr:`row_edits` from the edits the base plan
        applies at each (layer, tensor type) (see :func:`_edited_everywhere`)."""
        self.edits = self.row_edits = None
        if edited:
            found = [edited.get(key, ()) for key in self.keys]
            if any(isinstance(names, dict) for names in found):
                self.row_edits = [
                    names.get(row, ()) if isinstance(names, dict) else names
                    for match in matches
                    for names, row in zip(found, match.rows, strict=True)]
            elif any(found):
                self.edits = found

    def moved(self, matches: list[PlanMatch], edited: dict[Any, tuple[str, ...]] | None,
              sources: dict[Any, Any]) -> _SteadyPoint | None:
        """This point's batch in the layout of another base plan whose
        ``matches`` are this one's requests (in order), of the same point and
        layers, at the same rows, each at a token the same shift on (where the
        edits that apply change: an edit starting or ending for every
        request), with ``edited`` the new plan's edits and ``sources`` its
        first step's rows; None where they are not. What does not depend on
        the tokens or the edits is shared (the columns of ids, names and
        layers, the routed spans, and the gathering picks where the sources
        are as high as those they were made for), not worked out again per
        request."""
        spans = self.spans
        first = matches[0] if matches else None
        if (first is None or len(matches) != len(spans) or first.point.name != self.name
                or first.layers != tuple(layer for layer, _ in self.keys)
                or not all(map(operator.is_, map(_STATE, matches), map(_FIRST, spans)))
                or not all(map(operator.eq, map(_ROWS, matches), map(_ROWS, map(_MATCH, spans))))):
            return None
        # (each request's token the same shift on from its base: told in C)
        tokens = list(map(_TOKEN_INDEX, matches))
        bases = self.base_tokens
        shift = tokens[0] - bases[0]
        if list(map(operator.sub, tokens, bases)).count(shift) != len(tokens):
            return None
        moved = _SteadyPoint.__new__(_SteadyPoint)
        for name in ("name", "tensor_type", "keys", "picks", "whole", "heights", "count",
                     "states", "known", "request_ids", "point_names", "layers", "routed_spans",
                     "windowed"):
            setattr(moved, name, getattr(self, name))
        if self.picks is not None and self.heights != [
                sources[key].shape[0] if key in sources else -1 for key in self.keys]:
            moved.picks, moved.whole, moved.heights = None, False, None  # (made again)
        moved._set_edits(edited, matches)
        moved.base_tokens = tokens
        moved.tokens, moved.generated = self.tokens + shift, self.generated + shift
        moved.spans = [(state, start, stop, match) for (state, start, stop, _), match
                       in zip(spans, matches, strict=True)]
        moved.journal, moved.kept = Journal(), Journal()
        moved.bases = (self.bases[0] + shift, self.bases[1] + shift)
        moved.origin = (self.origin[0], self.origin[1] + shift)
        return moved

    def follow(self, *, kept: bool = False) -> Journal:
        """This point's journal of routed batches (``kept``: of captured ones),
        each request's signal log (record log) following it, again for one that
        stopped since the last step."""
        journal = self.kept if kept else self.journal
        if not journal.intact:
            journal.intact = True
            for state, start, stop, match in self.spans:
                log = state.records if kept else state.signals
                follow = log.following
                if follow is None or follow.journal is not journal:
                    log.follow(journal, start, stop, match)
        return journal

    def window_spans(self, steps: int) -> list[tuple[str, int, int]]:
        """:attr:`routed_spans` in a window of ``steps`` steps (each request's
        rows of every step together), one list per window length: routing the
        same list again finds its routes kept (``Router.route_columns``)."""
        spans = self.windowed.get(steps)
        if spans is None:
            spans = self.windowed[steps] = [(request_id, start * steps, stop * steps)
                                            for request_id, start, stop in self.routed_spans]
        return spans

    def pieces(self, sources: dict[Any, Any]) -> list[Any]:
        """Per layer, its source's rows in request order (the source itself where
        it is exactly that)."""
        if self.picks is None:
            self.picks = []
            self.heights = [sources[key].shape[0] for key in self.keys]
            for column, key in enumerate(self.keys):
                # (each request's row of this layer, read in C)
                rows = list(map(operator.itemgetter(column),
                                map(_ROWS, map(_MATCH, self.spans))))
                source = sources[key]
                self.picks.append(None if rows == list(range(len(source))) else
                                  source.new_tensor(rows, dtype=sys.modules["torch"].long))
            self.whole = all(pick is None for pick in self.picks)
        if self.whole:  # every layer's rows are its source, in order: read in C
            return list(map(sources.__getitem__, self.keys))
        return [sources[key] if pick is None else sources[key].index_select(0, pick)
                for key, pick in zip(self.keys, self.picks, strict=True)]

    def rows(self, sources: dict[Any, Any], pieces: list[Any] | None = None) -> Any:
        """The gathered rows: :meth:`pieces` (given, or gathered from ``sources``)
        stacked layer-minor, when first read."""
        if pieces is None:
            pieces = self.pieces(sources)
        if len(pieces) == 1:
            return pieces[0]
        return _stacked(pieces)

    def batch(self, delta: int, sources: dict[Any, Any],
              pieces: list[Any] | None = None) -> ActivationBatch:
        """This point's batch ``delta`` tokens after the base plan's (``pieces``:
        its :meth:`pieces`, when gathered already)."""
        count = self.count
        _, offsets = self.bases
        try:
            # Each request's token, read in C: the token a steady step feeds is
            # generated already (its index among the request's generated tokens
            # is the base plan's plus the shift, never negative).
            token_ids: list[int | None] = list(map(list.__getitem__, self.known,
                                                   (offsets + delta).tolist()))
        except IndexError:  # (one not known yet: None for it, as token_id_at says)
            token_ids = [state.token_id_at(token + delta)
                         for state, token in zip(self.states, self.base_tokens, strict=True)]
        if count > 1:  # each request's id once per layer
            token_ids = list(itertools.chain.from_iterable(zip(*[token_ids] * count, strict=True)))
        return ActivationBatch(
            self.rows(sources, pieces),
            request_ids=self.request_ids,
            point_names=self.point_names,
            layers=self.layers,
            tensor_type=self.tensor_type.value,
            token_indices=IntColumn(self.tokens + delta),
            is_generated=[True] * len(self.tokens),
            generated_indices=IntColumn(self.generated + delta),
            token_ids=token_ids,
            edits=(list(self.row_edits) if self.row_edits is not None else
                   None if self.edits is None else self.edits * len(self.states)),
        )

    def window_batch(self, deltas: list[int], steps: list[list[Any]], stamps: list[float],
                     points: list[_SteadyPoint] | None = None) -> ActivationBatch:
        """This point's batches ``deltas`` tokens after the base plan's (each
        step's :meth:`pieces`, captured at ``stamps``) as one batch, grouped by
        request: each request's rows of every step in turn, layer-minor (what
        routing each step's batch in order hands its probe, in the same order),
        each row with its step's capture time. ``points``: each step's point,
        where the steps are of several layouts (see :meth:`_Window.admits`):
        each row has the edits of its step's point."""
        count, width = self.count, len(self.states)
        # Each piece is one (step, layer) with a row per request: stacked on dim 1,
        # row r of the result holds request r's pieces in (step, layer) order.
        # Stacked when first read (a probe judging without the rows never does).
        flat = [piece for pieces in steps for piece in pieces]
        tensor = _stacked(flat)
        np = numpy_module()
        # Row (r, j) of request r's rows: its base token plus the j-th shift.
        shifts = np.repeat(np.asarray(deltas, dtype=np.int64), count)
        per_request = len(shifts)
        bases, offsets = self.bases
        generated_at = offsets[:, None] + shifts  # each row's index in its request's tokens
        request_ids: list[str] = []
        for state in self.states:
            request_ids += [state.request_id] * per_request
        known = self.known
        lengths = np.array([len(tokens) for tokens in known], dtype=np.int64)
        token_ids: Sequence[int | None]
        if (offsets + int(shifts.max()) < lengths).all():
            # Every token known (a steady token is generated): one gather from
            # the requests' tokens laid end to end.
            starts = np.cumsum(lengths) - lengths
            laid = np.fromiter(itertools.chain.from_iterable(known), dtype=np.int64,
                               count=int(lengths.sum()))
            token_ids = IntColumn(laid[starts[:, None] + generated_at].ravel())
        else:
            each_shift = shifts.tolist()  # (once, not once per request)
            token_ids = [state.token_id_at(token + shift)
                         for state, token in zip(self.states, self.base_tokens, strict=True)
                         for shift in each_shift]
        total = per_request * width
        return ActivationBatch(
            tensor,
            request_ids=request_ids,
            point_names=[self.name] * total,
            layers=IntColumn(np.tile(np.asarray(self.layers[:count], dtype=np.int64),
                                     len(deltas) * width)),
            tensor_type=self.tensor_type.value,
            # (columns of Python ints made only if read: see IntColumn)
            token_indices=IntColumn((bases[:, None] + shifts).ravel()),
            is_generated=[True] * total,
            generated_indices=IntColumn(generated_at.ravel()),
            token_ids=token_ids,
            # (each request's rows: every step's edits, a layer at a time)
            edits=(self._window_edits(len(deltas)) if points is None
                   else _steps_edits(points)),
            timestamp=stamps[0],
            # (each request's rows: every step's time, once per layer)
            timestamps=np.tile(np.repeat(np.asarray(stamps, dtype=np.float64), count), width),
        )

    def step_edits(self) -> list[tuple[str, ...]]:
        """The ``edits`` column of one step's batch: each request's rows, a
        layer at a time (every row's ``()`` where no edit applies)."""
        if self.row_edits is not None:
            return self.row_edits
        return (self.edits or [()] * self.count) * len(self.states)

    def _window_edits(self, steps: int) -> list[tuple[str, ...]] | None:
        """The ``edits`` column of a window of ``steps`` steps: each request's rows
        of every step together, a layer at a time."""
        if self.row_edits is None:
            return None if self.edits is None else self.edits * (steps * len(self.states))
        count, each = self.count, self.row_edits
        return [names for start in range(0, len(each), count)
                for names in each[start:start + count] * steps]


def _steps_edits(points: list[_SteadyPoint]) -> list[tuple[str, ...]] | None:
    """The ``edits`` column of a window whose steps are of ``points`` in turn
    (one per step, each of the same requests and layers as the first, with
    edits of its own): each request's rows of every step together, a layer at
    a time."""
    first = points[0]
    if all(point is first or (point.edits == first.edits and point.row_edits is None
                              and first.row_edits is None) for point in points):
        return first._window_edits(len(points))
    count = first.count
    each = [point.step_edits() for point in points]
    return [names for start in range(0, count * len(first.states), count)
            for rows in each for names in rows[start:start + count]]


def _stacked(pieces: list[Any]) -> DeferredRows:
    """``pieces`` (tensors of one row per request each) stacked on dim 1 when
    first read: row ``r * len(pieces) + p`` is row ``r`` of ``pieces[p]``
    (probes computing per row read the pieces themselves, see
    :func:`~undercurrent.probes.arrays.map_rows`)."""
    rows = len(pieces[0]) * len(pieces)
    return DeferredRows(
        lambda: sys.modules["torch"].stack(pieces, 1).view(rows, *pieces[0].shape[1:]),
        pieces)


class _SteadyLayout:
    """The batches of every plan that repeats one base plan, one per point."""

    __slots__ = ("states", "points", "edits", "triggers", "windows", "guards", "ends")

    def __init__(self, states: list[Any], points: list[_SteadyPoint],
                 triggers: dict[str, frozenset[SignalAction]] | None = None) -> None:
        self.states = states
        self.points = points
        # The signals that may switch on an edit of these requests (a triggered
        # edit not switched on yet: a layout is made again once one is), as
        # the actions each point's signals would do it with; ``edits``: any.
        # A step whose rows of such a point may give one is routed as it
        # comes, so that the edit applies from the next step (_window_steps).
        # (``triggers``: known already, see moved)
        if triggers is None:
            found: dict[str, set[SignalAction]] = {}
            for state in states:
                for resolved in state.edits:
                    when = resolved.edit.when
                    if when is not None and resolved.edit.name not in state.armed:
                        found.setdefault(when.point, set()).add(SignalAction(when.action.value))
            triggers = {name: frozenset(actions) for name, actions in found.items()}
        self.triggers = triggers
        self.edits = bool(triggers)
        self.windows: int | None = None  # steps a _Window holds (0: none); None: not asked
        # Where a point's probes may abort, or switch an edit on: (the point's
        # index, whether routing a step's batch of it would: Router.signal_guard),
        # asked of each step before it is held.
        self.guards: list[tuple[int, Any]] = []
        # The session's (aborts, closes) when none of ``states`` had ended yet.
        self.ends: tuple[int, int] | None = None

    @classmethod
    def of(cls, base: Any, session: Any, sources: dict[Any, Any]) -> _SteadyLayout | None:
        """The layout of ``base`` 's repeats, or None where they take the general
        path: a request fed several tokens, a prompt token, a point whose layers
        differ between requests, rows not torch tensors."""
        if not all(hasattr(rows, "detach") for rows in sources.values()):
            return None
        edited = _edited_everywhere(base)
        window = getattr(session, "window", None)
        last: _SteadyLayout | None = (window.layouts[-1] if window is not None
                                      and window.layouts else None)
        if base.one_each:  # (StepPlan.add_steady_tokens: one point, each request once)
            matches = base.matches
            states = list(map(_STATE, matches))
            # Every request still open and none aborted (else the general path
            # tells which are live): looked at in C.
            if (not any(map(_CLOSED, states))
                    and list(map(_ABORT, states)).count(None) == len(states)):
                if last is not None:  # (the requests' edits changed: the last layout, moved)
                    moved = last.moved(states, [matches], edited, sources)
                    if moved is not None:
                        return moved
                return cls(states, [_SteadyPoint(list(zip(states, matches, strict=True)),
                                                 session.registered, edited)])
        per_request: dict[str, tuple[Any, list[PlanMatch]]] = {}
        for match in base.matches:
            state = match.state
            if match.token_index < state.prompt_len:
                return None
            found = per_request.get(state.request_id)
            if found is None:
                per_request[state.request_id] = (state, [match])
            elif match.token_index != found[1][0].token_index:
                return None
            else:
                found[1].append(match)
        live, by_point = _wave_points(list(per_request.values()))
        if len(live) != len(per_request):
            return None
        for items in by_point.values():
            layers = items[0][1].layers
            if any(match.layers != layers for _, match in items):
                return None
        if last is not None:
            moved = last.moved(live, [list(map(_SECOND, items)) for items in by_point.values()],
                               edited, sources)
            if moved is not None:
                return moved
        registered = session.registered
        return cls(live, [_SteadyPoint(items, registered, edited)
                          for items in by_point.values()])

    def moved(self, states: list[Any], matches: list[list[PlanMatch]],
              edited: dict[Any, Any], sources: dict[Any, Any]) -> _SteadyLayout | None:
        """The layout of another base plan of the same ``states``, in order, whose
        ``matches`` of each point (in this layout's order of points) are this
        one's at the same rows, each at a token the same shift on
        (:meth:`_SteadyPoint.moved`; ``sources``: its first step's rows); else
        None. What a change of the requests' edits makes (an edit starting or
        ending for every request). Where neither may switch an edit on and
        this one's window was worked out from the router's limits alone (more
        than one step, no guard), the new one's is the same."""
        if (len(states) != len(self.states) or len(matches) != len(self.points)
                or not all(map(operator.is_, states, self.states))):
            return None
        points = []
        for point, mine in zip(self.points, matches, strict=True):
            moved = point.moved(mine, edited, sources)
            if moved is None:
                return None
            points.append(moved)
        # (a request's edits never change, and one switched on stays on: where
        # none of these requests had a triggered edit waiting, none has now)
        layout = _SteadyLayout(states, points, None if self.triggers else {})
        if (not layout.triggers and not self.triggers and not self.guards
                and self.windows is not None and self.windows > 1):
            layout.windows = self.windows
        return layout


def _edited_everywhere(base: Any) -> dict[Any, Any]:
    """The names of the edits ``base`` applies at each (layer, tensor type) it
    captures, in the order applied (a steady plan's edits that are on:
    :meth:`StepPlan.add_steady_tokens`): one tuple where each applies to every
    row of the pair's group, else the names at each row (a dict by row; a row
    with none is not in it)."""
    if base.edits_logged:
        return _edited_as_logged(base)
    edited: dict[Any, Any] = {}
    groups = base.groups
    for key, entries in base.edits.items():
        group = groups.get(key)
        if group is None:  # (nothing captured there: no row tells of it)
            continue
        slots = group.slots
        if all(entry.slots == slots for entry in entries.values()):
            edited[key] = tuple(entry.resolved.edit.name for entry in entries.values())
            continue
        rows: dict[int, tuple[str, ...]] = {}
        index = group._slot_index
        for entry in entries.values():
            name = entry.resolved.edit.name
            for slot in entry.slots:
                row = index.get(slot)
                if row is not None:
                    rows[row] = (*rows.get(row, ()), name)
        edited[key] = rows
    return edited


def _edited_as_logged(base: Any) -> dict[Any, Any]:
    """:func:`_edited_everywhere` of a plan that holds no edits, its requests'
    logs saying what was applied at its rows (:attr:`StepPlan.edits_logged`):
    per (layer, tensor type), one tuple where every row of its group has the
    same edits, else the names at each row that has some (by row)."""
    found: dict[Any, dict[int, tuple[str, ...]]] = {}
    for match in base.matches:
        sites = match.state.edited_sites
        if not sites:
            continue
        tensor_type, token_index = match.point.tensor_type, match.token_index
        for layer, row in zip(match.layers, match.rows, strict=True):
            names = sites.get((layer, tensor_type, token_index))
            if names:
                found.setdefault((layer, tensor_type), {})[row] = names
    edited: dict[Any, Any] = {}
    for key, rows in found.items():
        names = next(iter(rows.values()))
        group = base.groups.get(key)
        whole = group is not None and len(rows) == len(group.slots)
        edited[key] = names if whole and all(
            value == names for value in rows.values()) else rows
    return edited


def _deliver_steady(session: Any, plan: Any, sources: dict[Any, Any],
                    step: Any = None) -> bool:
    """Deliver a plan that repeats its base plan ``plan.delta`` tokens later (or
    a base plan kept to be repeated, ``delta`` 0), from the layout kept on the
    base plan: what the general path would route, without planning each
    request's matches again; what it routes, inside ``step()`` (see
    :func:`deliver_forward`). False (nothing done) where the general path must:
    no layout, or a request closed or aborted since."""
    base = plan.base if plan.base is not None else plan
    layout = base.steady
    if layout is None:
        layout = base.steady = _SteadyLayout.of(base, session, sources) or False
    if layout is False:
        return False
    states = layout.states
    ends = (len(session.aborted), session.closes)
    if ends != layout.ends:  # some request ended since the last look: one of these?
        if any(state.closed or state.abort is not None for state in states):
            return False
        layout.ends = ends
    delta = plan.delta
    points = layout.points
    if layout.windows is None:
        layout.windows = _window_steps(session, layout)
        if base.alternates and layout.guards:  # (see _Window.admits)
            layout.windows = 0
    batches: list[ActivationBatch | None] | None = None
    if layout.windows:  # (routes nothing but a full window, in a step of its own)
        batches = _Window.hold(session, layout, layout.windows, delta, sources, base)
        if batches is None:
            return True
        # (a step that would abort: routed now, after the steps held; the batches
        # the guards made, their values computed, are routed)
    made: list[ActivationBatch] = []
    for index, point in enumerate(points):
        ready = None if batches is None else batches[index]
        made.append(point.batch(delta, sources) if ready is None else ready)
    with _stepping(step):
        flush_window(session)
        if len(points) == 1 and not base.alternates:
            point = points[0]
            _route_wave(session, states, [(made[0], point.spans, point.routed_spans)],
                        point.follow(), layout.edits,
                        point.follow(kept=True) if session.keep_records else None)
        else:  # (each request handed its rows: see StepPlan.alternates)
            _route_wave(session, states, [(batch, point.spans, point.routed_spans)
                                          for batch, point in zip(made, points, strict=True)],
                        edits=layout.edits)
    return True


#: A window holds at most this many decode steps ...
WINDOW_STEPS = 32
#: ... and at most this many bytes of activations.
WINDOW_BYTES = 64 << 20


def _routed_ids(point: _SteadyPoint) -> list[str]:
    """The ids of the requests whose rows of ``point`` are routed."""
    return [request_id for request_id, _, _ in point.routed_spans]


def _window_steps(session: Any, layout: _SteadyLayout) -> int:
    """How many of ``layout`` 's steps a window holds before it asks for more
    room (see :class:`_Window`); 0: each step is routed as it comes. The least
    of what each point allows (:func:`_point_window`); the points whose
    probes may abort, or give a signal that switches an edit on, get their
    guards (``layout.guards``)."""
    if not getattr(session, "windows", False) or getattr(session.router, "window_rows",
                                                          None) is None:
        return 0
    guards: list[tuple[int, Any]] = []
    least = WINDOW_STEPS
    triggers = layout.triggers
    for index, point in enumerate(layout.points):
        steps, guard = _point_window(session.router, point, triggers.get(point.name))
        if not steps:
            return 0
        if guard is not None:
            guards.append((index, guard))
        least = min(least, steps)
    layout.guards = guards
    return least


def _point_window(router: Any, point: _SteadyPoint,
                  trigger: frozenset[SignalAction] | None = None) -> tuple[int, Any]:
    """How many steps of ``point`` a window may hold (0: none), and the guard
    its steps are asked of, if any. ``trigger``: the actions of this point's
    signals that would switch an edit on (see :attr:`_SteadyLayout.triggers`)."""
    if not point.routed_spans:
        return 0, None
    ids = _routed_ids(point)
    steps: int = min(WINDOW_STEPS, router.window_rows(point.name, ids) // point.count)
    if steps > 1 and not trigger:
        return steps, None
    if not steps or trigger:
        # Probes that may abort, or switch an edit on, but tell from a step's
        # values whether they would: its steps are held as well, and one that
        # would is routed at once, after those held (_Window.hold).
        actions = (trigger or frozenset()) | (frozenset() if steps else ABORT_ONLY)
        guard = getattr(router, "signal_guard", None)
        guard = None if guard is None else guard(point.name, ids, actions)
        return (0, None) if guard is None else (steps or WINDOW_STEPS, guard)
    # Half an async queue holds one step (a point of many layers): a window of
    # one step, which grows where the queues have room for more when it is
    # full (_Window.grow). Only where their room now holds two steps (at a
    # layout's first step nothing of it is queued yet): where it cannot, such
    # a window would route each step as it comes anyway.
    room = getattr(router, "window_room", None)
    if room is not None and room(point.name, ids) // point.count > 1:
        return 1, None
    return 0, None


class _Window:
    """Decode steps of a steady layout whose routing waits, to be routed as one
    batch per point: for a ``generate()`` call (nothing reads a signal before
    its request ends) where each point is inline and judged by probes that
    cannot abort, or async (:meth:`~undercurrent.router.Router.window_rows`),
    or inline and judged by probes that tell from a step's values whether it
    would abort, or give a signal that switches a triggered edit on
    (:meth:`~undercurrent.router.Router.signal_guard`: a step that may is
    routed at once, after the steps held, so the edit applies from the
    next). Each request's rows reach its probes (or their queues) in the
    order routing each step would give them, so the signals, verdicts and
    counts are the same; each probe is
    called, and each binding settled or queued on, once per window instead of
    once per step. With several points, each request's signals and records of
    the window are read step by step, each step's in the order routing it
    gives (:class:`_WindowRuns`). A window is routed (:func:`flush_window`)
    before any other delivery, before a request ends, and when it holds the
    layout's number of steps (at most :data:`WINDOW_STEPS`; for an async
    point, rows filling at most half of each queue, or as much of it as is
    free when the window gets there: :meth:`grow`; where half a queue holds
    one step, a window of one step that grows the same way) or
    :data:`WINDOW_BYTES` bytes.

    The layouts of plans that alternate (:attr:`StepPlan.alternates`: points of
    several strides, a cycle of plans), and those that follow each other where
    the requests' edits change (an edit of ``generated[2:12]`` starting, then
    ending), share a window where none has an abort guard (:meth:`admits`):
    each point's steps, from whichever layout, are routed as one batch
    (:meth:`_route_alternating`)."""

    __slots__ = ("layout", "limit", "deltas", "steps", "stamps", "values", "size", "step_size",
                 "base", "shapes", "layouts", "refs", "offsets", "sizes")

    def __init__(self, layout: _SteadyLayout, limit: int, base: Any) -> None:
        self.layout = layout
        self.limit = limit
        self.deltas: list[int] = []
        # Per step held, each point's pieces (see _SteadyPoint.pieces).
        self.steps: list[list[list[Any]]] = []
        self.stamps: list[float] = []  # when each step was captured (its records' timestamp)
        # Under abort guards, the probes' values of each step (computed to ask
        # them), one per guard: the window's, without computing them again; None
        # once one lacks.
        self.values: list[list[Any]] | None = [] if layout.guards else None
        self.size = 0
        self.step_size = 0  # bytes a step adds (its pieces'), read from the first step
        self.base = base  # the plan whose repeats the window holds first
        # Per base plan whose repeats the window holds (the first, and those of
        # the layouts it admits), by ``id``: (the base, its layout, the keys of
        # its groups in its order, and the height of each forward batch a step
        # brings), where each group is every point's rows of its layer as they
        # come (a step's pieces are then its batches' rows, see take()).
        self.shapes: dict[int, tuple[Any, _SteadyLayout, list[Any], list[int]]] = {}
        # Each step's layout, and for alternating layouts (see admits): each
        # point's first layout's point, by name; each layout point's tokens
        # after its name's first, as a shift; bytes a step of each layout adds.
        self.layouts: list[_SteadyLayout] = []
        self.refs: dict[str, _SteadyPoint] = {point.name: point for point in layout.points}
        self.offsets: dict[int, int] = {id(point): 0 for point in layout.points}
        self.sizes: dict[int, int] = {}

    def admits(self, layout: _SteadyLayout, limit: int) -> bool:
        """Whether a step of ``layout`` may join this window: one of its own
        layout, or of another over the same requests in the same order, neither
        with an abort guard, where each point of a name held already has the
        same layers and rows per request, at tokens a fixed shift from the
        first's: a layout alternating with it (both bases
        :attr:`StepPlan.alternates`), or the one the requests' steps repeat
        once their edits change (an edit starting or ending: each row then
        keeps its own step's edits, see :func:`_steps_edits`). The window's
        limit is then the least of both."""
        if layout is self.layout or id(layout) in self.sizes:
            return True
        if (layout.guards or self.layout.guards
                or len(layout.states) != len(self.layout.states)
                or not all(map(operator.is_, layout.states, self.layout.states))):
            return False
        offsets: dict[int, int] = {}
        for point in layout.points:
            ref = self.refs.get(point.name)
            if ref is None:
                continue
            origin, ref_origin = point.origin, ref.origin
            if origin[0] is ref_origin[0]:
                # (both moved from one point: the same keys and spans, tokens
                # each a shift from its own)
                offsets[id(point)] = origin[1] - ref_origin[1]
                continue
            if point.keys != ref.keys or [span[:3] for span in point.spans] != [
                    span[:3] for span in ref.spans]:
                return False
            shifts = point.bases[0] - ref.bases[0]
            if len(shifts) and (shifts != shifts[0]).any():
                return False
            offsets[id(point)] = int(shifts[0]) if len(shifts) else 0
        for point in layout.points:
            if point.name not in self.refs:
                self.refs[point.name] = point
                offsets[id(point)] = 0
        self.offsets.update(offsets)
        self.limit = min(self.limit, limit)
        self.sizes[id(layout)] = 0
        return True

    @classmethod
    def hold(cls, session: Any, layout: _SteadyLayout, limit: int, delta: int,
             sources: dict[Any, Any], base: Any) -> list[ActivationBatch | None] | None:
        """Add one step of ``layout`` (its captured ``sources``; ``base``: the plan
        it repeats) to the session's window of at most ``limit`` steps, routing a
        window of another layout first. Where routing the step may abort a
        request or switch an edit on (``layout.guards``), nothing is held:
        returns, per point, the step's batch its guard made (its values
        computed; None for a point without one, or not asked), for the caller
        to route at once, after the steps held."""
        pieces = [point.pieces(sources) for point in layout.points]
        aborting, values = _guarded(layout, delta, sources, pieces)
        if aborting is not None:
            return aborting
        window = session.window
        if window is not None and not window.admits(layout, limit):
            flush_window(session)
            window = None
        if window is None:
            window = session.window = cls(layout, limit, base)
        if id(base) not in window.shapes and all(point.whole for point in layout.points):
            keys = list(dict.fromkeys(key for point in layout.points for key in point.keys))
            if list(base.groups) == keys:
                window.shapes[id(base)] = (base, layout, keys,
                                           [len(group.slots) for group in base.groups.values()])
        window._add(session, delta, pieces, values, layout)
        return None

    def take(self, session: Any, batches: list[tuple[Any, Any, Any]]) -> bool:
        """Hold a forward's ``batches`` as :func:`deliver_forward` would hold
        them, where they are the next repeat of a plan whose repeats this
        window holds (its first layout's, or one it admitted), with no
        request ended since (the checks :func:`_whole_plan` and
        :func:`_deliver_steady` make, made directly): each group of the plan
        once (in the plan's order, or in another where the hooks fire in
        another), with a row per slot, each group's rows the layer's rows in
        request order (:attr:`shapes`). False (nothing done)
        otherwise: the general path then tells."""
        plan: Any = getattr(batches[0][1], "plan", None) if batches else None
        known = None if plan is None or plan.base is None else self.shapes.get(id(plan.base))
        if known is None:
            return False
        base, layout, keys, shape = known
        if (base is not plan.base or len(batches) != len(shape)
                or (len(session.aborted), session.closes) != layout.ends):
            return False
        groups = list(plan.groups.values())
        if [batch[1] for batch in batches] == groups:  # (by identity: a shifted plan's own)
            rows = [batch[2] for batch in batches]
        else:  # (the hooks' order, where it is not the plan's: points of several kinds)
            by_group = {id(batch[1]): batch[2] for batch in batches}
            if set(by_group) != set(map(id, groups)):
                return False
            rows = [by_group[id(group)] for group in groups]
        try:
            if [piece.shape[0] for piece in rows] != shape:
                return False
        except AttributeError:  # (rows of another kind)
            return False
        points = layout.points
        if len(points) == 1:  # (the point's layers are the groups)
            pieces = [rows]
        else:
            by_key = dict(zip(keys, rows, strict=True))
            pieces = [list(map(by_key.__getitem__, point.keys)) for point in points]
        aborting, values = _guarded(layout, plan.delta, {}, pieces)
        if aborting is not None:
            return False  # (the general path routes it at once, see hold)
        plan.delivered()
        self._add(session, plan.delta, pieces, values, layout)
        return True

    def _add(self, session: Any, delta: int, pieces: list[list[Any]],
             values: list[Any] | None, layout: _SteadyLayout) -> None:
        """One step of ``layout``: its ``pieces`` (per point) held, with the probes'
        ``values`` of them under abort guards (one per guard); the window routed
        once full."""
        self.deltas.append(delta)
        self.steps.append(pieces)
        self.stamps.append(capture_time())
        self.layouts.append(layout)
        if self.values is not None:
            if values is None:
                self.values = None
            else:
                self.values.append(values)
        if layout is self.layout:
            if not self.step_size:  # every step of one layout: the same pieces' shapes
                self.step_size = _size(pieces)
            self.size += self.step_size
        else:
            size = self.sizes[id(layout)] or _size(pieces)
            self.sizes[id(layout)] = size
            self.size += size
        if self.size >= WINDOW_BYTES or (len(self.steps) >= self.limit
                                         and not self.grow(session)):
            flush_window(session)

    def grow(self, session: Any) -> bool:
        """Raise the limit of a window that reached it, where the async queues of
        its points have room now for more steps than it holds (the workers have
        taken what the last window queued): up to that room and
        :data:`WINDOW_STEPS`. Rows held up to the room find it when routed
        (:meth:`~undercurrent.router.Router.window_room`), so fewer, larger
        windows drop nothing that routing at half a queue keeps. False (route
        the window now) otherwise."""
        room = getattr(session.router, "window_room", None)
        if room is None or self.limit >= WINDOW_STEPS:
            return False
        steps = min([WINDOW_STEPS] + [room(point.name, _routed_ids(point)) // point.count
                                      for point in self.refs.values()])
        if steps <= len(self.steps):
            return False
        self.limit = steps
        return True

    def route(self, session: Any) -> None:
        """Route the steps held, as one batch per point, and give each request
        its signals (and, with ``records=True``, its records of these steps)."""
        if self.sizes:  # (steps of alternating layouts)
            self._route_alternating(session)
            return
        layout = self.layout
        points = layout.points
        steps = len(self.steps)
        values = self.values if self.values is not None and len(self.values) == steps else None
        # (each guarded point's guard, and its values' place among a step's)
        guarded = {index: (slot, guard) for slot, (index, guard) in enumerate(layout.guards)}
        several = len(points) > 1
        routed_parts: dict[int, list[tuple[Any, int, int, Any]]] = {}
        kept_parts: dict[int, list[tuple[Any, int, int, Any]]] = {}
        made: list[tuple[_SteadyPoint, list[list[Any]], ActivationBatch]] = []
        for index, point in enumerate(points):
            steps_of = [step[index] for step in self.steps]
            batch = point.window_batch(self.deltas, steps_of, self.stamps)
            if several:
                # A point of the very rows of an earlier one (its layers, requests
                # and captured pieces) shares its batch's cache: what one probe
                # computed of them (their float64 matrix, an SAE's encoding) the
                # other's finds, inline or on a worker.
                for other, other_steps, other_batch in made:
                    if _same_rows(point, steps_of, other, other_steps):
                        batch.cache = other_batch.cache
                        break
                made.append((point, steps_of, batch))
            if values is not None and index in guarded:
                # (each step's values, as scoring the window's rows would give them)
                slot, guard = guarded[index]
                batch.cache[guard.key] = _interleaved([step[slot] for step in values],
                                                      len(point.states), point.count)
            if session.keep_records:
                kept = batch.without_cache()  # the activations, not what probes derived
                for state, start, stop, match in point.spans:
                    if several:
                        kept_parts.setdefault(id(state), []).append(
                            (kept, start * steps, stop - start, match))
                    else:
                        state.records.add_rows(kept, start * steps, stop * steps)
            routed = _route_window_batch(session, batch, point.window_spans(steps), point.name)
            if routed is None:
                continue
            for state, start, stop, match in point.spans:
                if several:
                    routed_parts.setdefault(id(state), []).append(
                        (routed, start * steps, stop - start, match))
                else:
                    state.signals.add_run((routed, start * steps, stop * steps, match))
        if routed_parts or kept_parts:
            _add_window_runs(layout.states, kept_parts, routed_parts, steps)

    def _route_alternating(self, session: Any) -> None:
        """:meth:`route` of steps of several layouts (alternating, or following
        each other: see :meth:`admits`): each point (by name) routed once, with
        its steps from every layout that has it (tokens on from its first
        layout's) and each step's edits; each request's signals and records
        of a step from the matches of that step's layout."""
        steps = len(self.steps)
        by_name: dict[str, list[tuple[int, int, _SteadyPoint]]] = {}
        for step, layout in enumerate(self.layouts):
            for index, point in enumerate(layout.points):
                by_name.setdefault(point.name, []).append((step, index, point))
        routed_parts: dict[int, list[tuple[Any, ...]]] = {}
        kept_parts: dict[int, list[tuple[Any, ...]]] = {}
        offsets = self.offsets
        for name, entries in by_name.items():
            ref = self.refs[name]
            count = len(entries)
            batch = ref.window_batch(
                [self.deltas[step] + offsets[id(point)] for step, _, point in entries],
                [self.steps[step][index] for step, index, _ in entries],
                [self.stamps[step] for step, _, _ in entries],
                [point for _, _, point in entries])
            # Each layout's point of this name, and the place among the name's
            # steps of each of its steps.
            places: dict[int, tuple[_SteadyPoint, dict[int, int]]] = {}
            for place, (step, _, point) in enumerate(entries):
                places.setdefault(id(point), (point, {}))[1][step] = place
            if session.keep_records:
                kept = batch.without_cache()  # the activations, not what probes derived
                for point, where in places.values():
                    for state, start, stop, match in point.spans:
                        kept_parts.setdefault(id(state), []).append(
                            (kept, start * count, stop - start, match, where))
            routed = _route_window_batch(session, batch, ref.window_spans(count), name)
            if routed is None:
                continue
            for point, where in places.values():
                for state, start, stop, match in point.spans:
                    routed_parts.setdefault(id(state), []).append(
                        (routed, start * count, stop - start, match, where))
        _add_window_runs(self.layout.states, kept_parts, routed_parts, steps)


def _route_window_batch(session: Any, batch: ActivationBatch, spans: list[tuple[str, int, int]],
                        name: str) -> RoutedPoint | None:
    """Route one point's window batch; the routed point where it gave a signal
    (None: none). A window holds no step whose probes may abort."""
    signals = session.router.route_columns(batch, spans)
    if not signals.any_signal():
        return None
    if signals.any_abort():  # window_rows admitted a probe that aborts
        raise RuntimeError(
            f"internal error: a probe of point {name!r} aborted a request "
            "while its steps were judged in a window")
    return RoutedPoint(batch.index_view(), signals)


def _add_window_runs(states: Sequence[Any], kept_parts: dict[int, list[tuple[Any, ...]]],
                     routed_parts: dict[int, list[tuple[Any, ...]]], steps: int) -> None:
    """Give each of ``states`` its records and signals of a window of ``steps``
    steps of several points (its parts, by ``id`` of the state)."""
    for state in states:
        parts = kept_parts.get(id(state))
        if parts:
            state.records.add_window(_WindowRuns(parts, steps))
        parts = routed_parts.get(id(state))
        if parts:
            state.signals.add_window(_WindowRuns(parts, steps))


def _size(pieces: list[list[Any]]) -> int:
    """Bytes a step's ``pieces`` (per point) hold, a piece two points share once."""
    unique = {id(piece): piece for point_pieces in pieces for piece in point_pieces}
    return sum(piece.element_size() * piece.nelement() for piece in unique.values())


def _same_rows(point: _SteadyPoint, steps: list[list[Any]], other: _SteadyPoint,
               other_steps: list[list[Any]]) -> bool:
    """Whether two points' window batches hold the same rows in the same order:
    the same layers of one tensor type, the same requests at the same tokens,
    and each step's very pieces."""
    return (point.keys == other.keys and len(point.states) == len(other.states)
            and all(map(operator.is_, point.states, other.states))
            and point.base_tokens == other.base_tokens
            and all(map(_same_pieces, steps, other_steps)))


def _same_pieces(pieces: list[Any], others: list[Any]) -> bool:
    return len(pieces) == len(others) and all(map(operator.is_, pieces, others))


def _guarded(layout: _SteadyLayout, delta: int, sources: dict[Any, Any],
             pieces: list[list[Any]]) -> tuple[list[ActivationBatch | None] | None,
                                               list[Any] | None]:
    """A step's ``pieces`` (per point) asked of the layout's guards, if any:
    (per point, the step's batch its guard made, its values computed, where
    routing it may abort or switch an edit on; else None, and the values each guard
    computed, to be held with the step: None without a guard, or where a
    guard's screen cleared the step before any value was computed)."""
    guards = layout.guards
    if not guards:
        return None, None
    points = layout.points
    made: list[ActivationBatch | None] = [None] * len(points)
    values: list[Any] = []
    for index, guard in guards:
        screen = guard.screen
        if screen is not None and not screen(pieces[index]):
            # (cannot abort: no batch made; its values come with the window's)
            values.append(None)
            continue
        batch = made[index] = points[index].batch(delta, sources, pieces[index])
        if guard(batch):
            return made, None
        values.append(batch.cache.get(guard.key))
    return None, (None if any(value is None for value in values) else values)


def _interleaved(steps: list[Any], requests: int, count: int) -> Any:
    """Per-row values of a window's steps (each step's rows: ``count`` per request,
    request after request) in the window batch's order: each request's rows of
    every step in turn (see :meth:`_SteadyPoint.window_batch`). Values are an
    array or list, or a tuple or dict of them (as ``ActivationBatch.shared``
    keeps them, or rows that join, as :class:`~undercurrent.probes.sparse.SparseRows`
    do)."""
    first = steps[0]
    if isinstance(first, tuple):
        return tuple(_interleaved([step[index] for step in steps], requests, count)
                     for index in range(len(first)))
    if isinstance(first, dict):
        return {key: _interleaved([step[key] for step in steps], requests, count)
                for key in first}
    np = numpy_module()
    if isinstance(first, np.ndarray):
        stacked = np.stack(steps).reshape(len(steps), requests, count, *first.shape[1:])
        return stacked.swapaxes(0, 1).reshape(len(steps) * requests * count, *first.shape[1:])
    join = getattr(type(first), "join_rows", None)  # (rows kept another way: SparseRows)
    if join is not None:
        return join([step[request * count:(request + 1) * count] for request in range(requests)
                     for step in steps])
    return [step[request * count + layer] for request in range(requests) for step in steps
            for layer in range(count)]


def flush_window(session: Any) -> None:
    """Route the session's window of held steps, if any (see :class:`_Window`),
    inside one ``router.step()``: async workers wake once for the window."""
    window = getattr(session, "window", None)
    if window is not None:
        session.window = None
        with _stepping(getattr(session.router, "step", None)):
            window.route(session)


def _record_refs(pieces: list[tuple[ActivationBatch, int, int, Any]]
                 ) -> list[tuple[ActivationBatch, int]]:
    """One token's (batch, row) references in (layer, planning) order across points."""
    if len(pieces) == 1:
        kept, start, stop, _ = pieces[0]
        return [(kept, row) for row in range(start, stop)]
    rows = [(match.layers[row - start], match.order_of(row - start), kept, row)
            for kept, start, stop, match in pieces for row in range(start, stop)]
    rows.sort(key=_LAYER_ORDER)
    return [(kept, row) for _, _, kept, row in rows]


def _point_batch(items: Sequence[tuple[Any, Any]], sources: dict[Any, Any]
                   ) -> tuple[ActivationBatch, list[tuple[Any, int, int, Any]]]:
    """One point's matches of one wave as a batch: grouped by request, each
    match's layers in ascending order; with (state, start, stop, match) per
    request."""
    first = items[0][1]
    point, layers = first.point, first.layers
    tensor_type = point.tensor_type
    uniform = all(match.layers == layers for _, match in items)
    ids: list[str] = []
    tokens: list[int] = []
    is_generated: list[bool] = []
    generated: list[int | None] = []
    token_ids: list[int | None] = []
    edits: list[tuple[str, ...]] | None = None
    spans: list[tuple[Any, int, int, Any]] = []
    start = 0
    for state, match in items:
        count = len(match.layers)
        token_index = match.token_index
        after_prompt = token_index >= state.prompt_len
        ids += [state.request_id] * count
        tokens += [token_index] * count
        is_generated += [after_prompt] * count
        generated += [token_index - state.prompt_len if after_prompt else None] * count
        token_ids += [state.token_id_at(token_index)] * count
        sites = state.edited_sites
        site_edits = ([sites.get((layer, tensor_type, token_index), ()) for layer in match.layers]
                      if sites else None)
        if site_edits is not None and any(site_edits):
            if edits is None:
                edits = [()] * start
            edits += site_edits
        elif edits is not None:
            edits += [()] * count
        spans.append((state, start, start + count, match))
        start += count
    if uniform:
        all_layers: list[int] = list(layers) * len(items)
    else:
        all_layers = [layer for _, match in items for layer in match.layers]
    batch = ActivationBatch(
        _gather(items, sources, tensor_type, layers if uniform else None),
        request_ids=ids,
        point_names=[point.name] * start,
        layers=all_layers,
        tensor_type=tensor_type.value,
        token_indices=tokens,
        is_generated=is_generated,
        generated_indices=generated,
        token_ids=token_ids,
        edits=edits,
    )
    return batch, spans


def _gather(items: Sequence[tuple[Any, Any]], sources: dict[Any, Any],
                    tensor_type: Any, layers: tuple[int, ...] | None) -> Any:
    """The matches' rows, each match's layers in turn: with torch sources and one
    layer set, one index operation per layer (none where a layer's rows are
    exactly its source) and one stack; otherwise :func:`gather`."""
    if layers is not None:
        pieces = []
        count = len(items)
        for column, layer in enumerate(layers):
            source = sources[(layer, tensor_type)]
            if not hasattr(source, "detach"):
                break
            rows = [match.rows[column] for _, match in items]
            if len(source) == count and rows == list(range(count)):
                pieces.append(source)
            else:
                pieces.append(source.index_select(
                    0, source.new_tensor(rows, dtype=sys.modules["torch"].long)))
        else:
            if len(pieces) == 1:
                return pieces[0]
            torch = sys.modules["torch"]
            return torch.stack(pieces, 1).reshape(count * len(pieces), *pieces[0].shape[1:])
    keys = list(sources)
    position = {key: index for index, key in enumerate(keys)}
    picks = [(position[(layer, tensor_type)], match.rows[column])
             for _, match in items for column, layer in enumerate(match.layers)]
    return gather([sources[key] for key in keys], picks)
