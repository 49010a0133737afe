"""One probe instance bound to one (request, extraction point), with its accounting.

A :class:`Binding` owns its state: every field is private, read through
read-only properties, and changed only by a method named for the transition
(``admit_inline``, ``begin_call`` / ``end_call``, ``finish_call``,
``enqueue_batch``, ``take_queued``, ``fall_back``, ``trip_breaker``, ``close``,
``finalise``...). The execution strategies (inline ``reject`` and
``block_until_signal`` in :mod:`~undercurrent.router.inline`, async in
:mod:`~undercurrent.router.scheduler`) only call those methods.

Every field is guarded by ``cond``; user code (the probe's methods) is
always called with ``cond`` released. Methods documented "lock held" expect the
caller (a strategy) to hold ``cond``; the others take it themselves. ``busy``
marks an ``on_activation`` in flight: at most one runs per binding, and
``on_end`` never runs while one does.

Accounting: each received record ends up exactly once in ``processed`` (the
probe returned or raised) or ``dropped`` (the probe never saw it, or it was
still running when the result was finalised). Records travel as
:class:`~undercurrent.records.ActivationBatch` es (a request's rows of one
routed batch); the counters are updated once per batch, in vectors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import operator
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from undercurrent.probes.base import (
    RequestContext,
    scores_batches,
    scores_records_at_once,
    shared_key,
)
from undercurrent.records import (
    ABORT_CODE,
    ACTION_CODES,
    NO_SIGNAL,
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    LazySequence,
    ProbeResult,
    ProbeSignal,
    ProbeStats,
    SignalAction,
)
from undercurrent.router.errors import OverflowPolicy
from undercurrent.spec.types import (
    ExecutionMode,
    ExtractionPoint,
    InterventionMode,
    InterventionPolicy,
)

logger = logging.getLogger("undercurrent.router")

Outcome = tuple[ProbeSignal | None, str | None, float]
"""What one record's probe call came to: (signal, error description or None, seconds)."""


@dataclasses.dataclass
class BatchOutcome:
    """What one probe call on a batch came to: a signal (or none) per row, the
    error description per row (None when no row failed), the seconds the rows
    took in all, the longest any one row took, and the probe's method that
    judged them (``on_batch``, ``on_activations`` for all the rows at once, or
    ``on_activation`` per row), which an error note names."""

    signals: BatchSignals
    errors: list[str | None] | None
    latency: float
    longest: float
    method: str = "on_activation"

    @classmethod
    def of(cls, outcomes: Sequence[Outcome], method: str = "on_activation") -> BatchOutcome:
        """From per-record outcomes (a probe called per record, or, ``method``
        ``on_activations``, on all of them at once)."""
        total = longest = 0.0
        for _, _, latency in outcomes:
            total += latency
            if latency > longest:
                longest = latency
        errors = [error for _, error, _ in outcomes]
        return cls(BatchSignals.from_signals([signal for signal, _, _ in outcomes]),
                   errors if any(error is not None for error in errors) else None,
                   total, longest, method)


class _Where:
    """Where a row sits, for an error note (what ``_count_error`` reads of a record)."""

    __slots__ = ("token_index", "layer")

    def __init__(self, token_index: int, layer: int) -> None:
        self.token_index = token_index
        self.layer = layer


def _check_signal(signal: Any, method: str) -> None:
    if signal is not None and not isinstance(signal, ProbeSignal):
        raise TypeError(
            f"{method} returned {type(signal).__name__}; expected ProbeSignal or None"
        )


_ACTION_CODE_SET = frozenset((NO_SIGNAL, *ACTION_CODES.values()))


def check_batch_signals(signals: Any, count: int, method: str) -> None:
    """Raise unless ``signals`` is what a probe call on ``count`` rows must
    return: a ``BatchSignals`` whose action codes are integers of
    ``ACTION_CODES`` (or ``NO_SIGNAL``), one per row, and whose scores,
    metadata columns and signal objects (those given) have a value per row.
    ``method`` names the call in the message (``"Probe.on_batch at point
    'p'"``). A few passes in C over the columns, none per row in Python."""
    if type(signals) is not BatchSignals:
        raise TypeError(f"{method} returned {type(signals).__name__} for {count} rows; "
                        "it must return a BatchSignals with one row per row")
    actions: Any = signals.actions
    kind = getattr(getattr(actions, "dtype", None), "kind", None)
    problem: str | None
    if kind is not None and getattr(actions, "ndim", 1) != 1:
        problem = f"a {actions.ndim}-dimensional action column"
    elif not hasattr(actions, "__len__"):
        problem = f"actions of type {type(actions).__name__}"
    elif len(actions) != count:
        problem = f"{len(actions)} action codes"
    elif kind is not None:  # an array: its dtype and range, each checked at once
        problem = (f"action codes of dtype {actions.dtype}" if kind not in "iu" else
                   None if count == 0 or (actions.min() >= NO_SIGNAL
                                          and actions.max() <= ABORT_CODE)
                   else "action codes outside ACTION_CODES / NO_SIGNAL")
    else:  # Python values: their types and distinct values, each found in C
        if not isinstance(actions, (list, tuple)) and hasattr(actions, "tolist"):
            actions = actions.tolist()  # (a tensor, an IntColumn)
        kinds = set(map(type, actions))
        problem = (None if kinds == {int} or all(
            hasattr(found, "__index__") and found is not bool for found in kinds)
            else "action codes of type " + "/".join(sorted(found.__name__ for found in kinds)))
        if problem is None and not _ACTION_CODE_SET.issuperset(actions):
            problem = "action codes outside ACTION_CODES / NO_SIGNAL"
    if problem is None:
        columns = {"scores": signals.scores, "objects": signals.objects}
        metadata = signals.metadata
        if metadata is not None and not isinstance(metadata, Mapping):
            problem = f"metadata of type {type(metadata).__name__}"
            columns.clear()
        elif metadata is not None:
            columns.update((f"metadata column {key!r}", column)
                           for key, column in metadata.items())
        for name, column in columns.items():
            if column is not None and (not hasattr(column, "__len__") or len(column) != count):
                problem = (f"{len(column)} {name}" if hasattr(column, "__len__")
                           else f"{name} of type {type(column).__name__}")
                break
    if problem is not None:
        raise ValueError(f"{method} returned BatchSignals with {problem} for {count} rows; "
                         "it must give each row an action code (ACTION_CODES or NO_SIGNAL, "
                         "an integer) and, where given, a score, a value of each metadata "
                         "column and a signal")


def describe_error(exc: BaseException) -> str:
    """``TypeName: message`` for an exception, as results and metrics show it."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def observed_only(signal: ProbeSignal) -> ProbeSignal:
    """An async (or unwaited) signal: an ``abort`` is recorded as ``flag``."""
    if signal.action is not SignalAction.ABORT:
        return signal
    return dataclasses.replace(
        signal,
        action=SignalAction.FLAG,
        metadata={**signal.metadata, "requested_action": "abort"},
    )


class _Rows:
    """Rows ``start:stop`` of a routed batch, waiting in an async queue (sliced
    off the batch only when a worker takes them)."""

    __slots__ = ("batch", "start", "stop")

    def __init__(self, batch: ActivationBatch, start: int, stop: int) -> None:
        self.batch, self.start, self.stop = batch, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def head(self, count: int) -> _Rows:
        """The first ``count`` rows."""
        return _Rows(self.batch, self.start, self.start + count)

    def tail(self, count: int) -> _Rows:
        """The rows after the first ``count``."""
        return _Rows(self.batch, self.start + count, self.stop)


#: An inline binding's queue, and a binding's notes and signals until its first: empty and
#: shared (the garbage collector tracks every list and deque made per request).
#: Tuples: nothing can be added to them by mistake.
_NO_QUEUE: Any = ()
_NO_NOTES: Any = ()
_NONE_KEPT: Any = ()  # a binding's signals before it keeps one
#: The methods that judge rows, as an error note begins with them.
_CALL_METHODS = ("on_activation", "on_batch")

# (the C lock threading.RLock() returns, made without that Python call: one per binding)
_RLock = threading.RLock().__class__
# A binding's fields, read in C over many bindings (see least_room, shared_group).
_GROUP = operator.attrgetter("_group")
_IS_ASYNC = operator.attrgetter("_is_async")
_CLOSED = operator.attrgetter("_closed")
_CAPACITY = operator.attrgetter("_queue_capacity")
_QUEUED = operator.attrgetter("_queued")


@contextlib.contextmanager
def _all_locked(bindings: Sequence[Binding]) -> Iterator[bool]:
    """Take every binding's lock that is free; yields whether all were (the caller
    then does nothing unless so), and lets go of those taken. None is waited
    for: a thread holding one may be waiting for another."""
    mutexes = [binding._mutex for binding in bindings]
    taken = [mutex.acquire(False) for mutex in mutexes]
    try:
        yield all(taken)
    finally:
        for mutex, took in zip(mutexes, taken, strict=True):
            if took:
                mutex.release()


class Binding:
    """The router's state for one probe instance (see the module docstring)."""

    def __init__(
        self,
        *,
        point: ExtractionPoint,
        probe: Any,
        probe_type: str,
        ctx: RequestContext,
        policy: InterventionPolicy,
        queue_capacity: int | None,
        overflow: OverflowPolicy,
        breaker_threshold: int | None,
        owner: object | None = None,
    ) -> None:
        self._point = point
        # the router that made it (its helper runs that router's probes), held weakly:
        # a binding kept past its call (by a scheduler's line) keeps no router alive
        self._owner = None if owner is None else weakref.ref(owner)
        self._name = point.name
        self._probe = probe
        self._probe_type = probe_type
        self._ctx = ctx
        self._policy = policy
        self._is_async = point.execution_mode is ExecutionMode.ASYNC
        # (what results say of the binding, read once: an enum's value is Python code)
        self._execution_mode = point.execution_mode.value
        self._intervention = policy.mode.value
        self._queue_capacity = queue_capacity
        self._overflow = overflow
        self._breaker_threshold = breaker_threshold
        # How long ending the request waits for this binding to go idle. Async
        # bindings get the whole drain timeout. An inline binding can only be busy
        # with a ``block_until_signal`` call that already missed its deadline; its
        # late answer is discarded anyway, so waiting is only worth a short grace
        # (so that ``on_end`` can still run), not the full drain timeout.
        self._end_grace_s = (float("inf") if self._is_async or policy.timeout_ms is None
                             else max(1.0, 2 * policy.timeout_ms / 1000.0))
        # One re-entrant lock, taken directly; the condition on it is made the
        # first time a thread must wait (most bindings never wait: a condition is
        # eight objects for the garbage collector to track, per request), and
        # waiters are woken only when there are some.
        self._mutex = _RLock()
        self._cond: threading.Condition | None = None
        self._sleepers = 0  # threads inside _wait
        self._received = 0
        self._processed = 0
        self._dropped = 0
        self._errors = 0
        self._timeouts = 0
        self._latency_total = 0.0
        self._latency_max = 0.0
        self._late_results = 0
        # Both lists are made at the first signal kept (most bindings keep none):
        # until then, an empty tuple shared by every binding.
        self._signals: list[ProbeSignal] = _NONE_KEPT
        self._unread: list[Any] = _NONE_KEPT
        """Signal columns not materialised yet, six entries each, one after the
        other (no tuple per entry: a binding keeps one per routed step until its
        signals are read): columns, index batch, start, stop, observed, offset;
        rows ``start:stop`` of the batch, row ``r`` being row ``r - offset`` of
        the columns."""
        self._error_notes: list[str] = _NO_NOTES  # a list of its own at the first note
        self._logged_error = False
        self._traceback: str | None = None  # of the first exception the probe raised
        self._busy = False
        self._in_flight = 0  # records in the call that ``busy`` marks
        self._native = False  # served whole batches (Probe.on_batch)
        self._batched = False
        self._group: Any = None
        self._async_group: Any = None
        self._may_abort: bool | None = None  # the probe's answer, asked once (may_abort)
        self._take_probe(probe)
        self._waiting = 0  # callers counted as received, waiting on ``cond`` for their turn
        # _dropped when close() came: what the request's end dropped is counted from it
        # (a producer that close() woke, waiting for room, drops its rows itself).
        self._dropped_at_close: int | None = None
        self._closed = False
        self._start_failed = False  # on_start raised: the binding never opened
        self._finalised = False
        # Row ranges of routed batches, in order (async: an inline binding queues none).
        self._queue: deque[_Rows] = deque() if self._is_async else _NO_QUEUE
        self._queued = 0  # rows in ``queue``: the queue depth, in vectors
        self._scheduled = False
        self._consecutive_failures = 0
        self._breaker_open = False
        # block_until_signal: the call handed to this binding's helper thread.
        self._pending: Any = None
        self._helper: threading.Thread | None = None

    def _take_probe(self, probe: Any) -> None:
        """How the router serves ``probe`` (this binding's): whole batches or not,
        and in which group, if any."""
        self._probe = probe
        self._may_abort = None
        self._native = native = scores_batches(probe)
        self._batched = native or scores_records_at_once(probe)
        if native:
            self._set_group(probe)

    def _set_group(self, probe: Any) -> None:
        """The group of a binding whose probe scores whole batches."""
        # Inline, no deadline, and a probe whose values a routed batch computes once
        # for every request (ScoresRows.group_key): judged in a group by the router.
        # Async, with such a probe: a worker judges it with the other bindings of
        # the same key it finds ready (router/scheduler.py).
        key = None if getattr(probe, "group_key", None) is None else self._group_key(probe)
        if self._is_async:
            self._async_group = key
        elif self._policy.mode is InterventionMode.REJECT:
            self._group = key

    def _group_key(self, probe: Any) -> Any:
        """:func:`shared_key` of ``probe``, or None (judged on its own) where its
        ``group_key`` raises or gives a key that is not hashable: noted on the
        result, as a failure of the probe's."""
        try:
            key = shared_key(probe)
            try:
                hash(key)
            except TypeError:
                raise TypeError(f"it returned {key!r}, which is not hashable") from None
        except Exception as exc:
            self.hook_failed("group_key", exc, "the probe is judged on its own")
            return None
        return key

    def hook_failed(self, hook: str, exc: BaseException, consequence: str) -> None:
        """A method the router asks of the probe to plan its work (``group_key``,
        ``may_abort``, ``abort_test``...) raised: counted as an error and noted on
        the result once, with what the router did instead (``consequence``)."""
        self._log_first_error(hook, exc)
        with self._mutex:
            if any(note.startswith(f"{hook}: ") for note in self._error_notes):
                return
            self._errors += 1
            self._note(f"{hook}: {describe_error(exc)} ({consequence})")

    def may_abort(self) -> bool:
        """Whether the probe's signals may ever abort its request: its
        :meth:`~undercurrent.probes.base.ScoresRows.may_abort`, asked once;
        True for a probe that does not say, or whose ``may_abort`` raised (noted
        on the result)."""
        answer = self._may_abort
        if answer is None:
            check = getattr(self._probe, "may_abort", None)
            answer = True
            if check is not None:
                try:
                    answer = bool(check())
                except Exception as exc:
                    self.hook_failed("may_abort", exc, "taken as True: it may abort")
                    answer = True
            self._may_abort = answer
        return answer

    def siblings(self, probes: Sequence[Any], contexts: Sequence[RequestContext]
                 ) -> list[Binding]:
        """A binding of this one's point and settings for each other request (its
        probe and context), in one pass: what the constructor makes from the same
        arguments, the settings not worked out again (a whole call's requests
        are bound at once, :meth:`Router.register_requests`). Only on a binding
        that is not started yet (its state is still the constructor's)."""
        assert not self._received and not self._closed and not self._processed
        assert self._signals is _NONE_KEPT and self._unread is _NONE_KEPT
        cls = type(self)
        new = object.__new__
        template = dict(self.__dict__)
        template["_group"] = template["_async_group"] = template["_may_abort"] = None
        # (this one's failures are its own: a group_key that raised, say)
        template.update(_errors=0, _error_notes=_NO_NOTES, _logged_error=False, _traceback=None)
        kind, native, is_async = type(self._probe), self._native, self._is_async
        made_all = []
        for probe, ctx in zip(probes, contexts, strict=True):
            made: Binding = new(cls)
            state = made.__dict__
            state.update(template)
            state["_ctx"] = ctx
            state["_mutex"] = _RLock()
            if is_async:
                state["_queue"] = deque()
            if type(probe) is kind:  # served as this one's: only its group may differ
                state["_probe"] = probe
                if native:
                    made._set_group(probe)
            else:
                made._take_probe(probe)
            made_all.append(made)
        return made_all

    # -- read-only views (every change goes through a transition method below) --------

    @property
    def owner(self) -> object | None:
        """The router that made this binding (None for one made alone)."""
        return None if self._owner is None else self._owner()

    @property
    def request_id(self) -> str:
        """The request this binding serves."""
        return self._ctx.request_id

    @property
    def name(self) -> str:
        """The extraction point's name."""
        return self._name

    def method(self, name: str) -> str:
        """The probe's method ``name`` as an error message names it: its class,
        the method and the point (``"MyProbe.on_batch at point 'p'"``)."""
        return f"{type(self._probe).__name__}.{name} at point {self._name!r}"

    @property
    def point(self) -> ExtractionPoint:
        """The extraction point."""
        return self._point

    @property
    def probe(self) -> Any:
        """The probe instance."""
        return self._probe

    @property
    def probe_type(self) -> str:
        """The probe's registered type name."""
        return self._probe_type

    @property
    def policy(self) -> InterventionPolicy:
        """The point's intervention policy."""
        return self._policy

    @property
    def is_async(self) -> bool:
        """Whether the point runs on the async workers."""
        return self._is_async

    @property
    def end_grace_s(self) -> float:
        """How long ending the request waits at most for this binding to go idle
        (the router's drain timeout applies too; infinite: only that timeout)."""
        return self._end_grace_s

    def window_limit(self) -> int:
        """Rows per request of this binding that may wait to be routed in a window
        (:meth:`~undercurrent.router.Router.window_rows`): half the queue of an
        async binding; no limit for an inline one judged in a group by a probe
        that cannot abort; 0 (none) for any other."""
        if self._is_async:
            return (self._queue_capacity or 1) // 2
        return 0 if self._group is None or self.may_abort() else sys.maxsize

    @property
    def queue_capacity(self) -> int:
        """The most vectors an async binding's queue holds (1 for an inline one)."""
        return self._queue_capacity or 1

    @property
    def room(self) -> int:
        """How many more vectors an async binding's queue takes now without
        dropping one (its capacity less the vectors queued); 0 once closed."""
        with self._mutex:
            return 0 if self._closed else max(0, (self._queue_capacity or 1) - self._queued)

    @staticmethod
    def least_room(bindings: Sequence[Binding]) -> int:
        """The least :attr:`room` over the async ones of ``bindings``
        (``sys.maxsize`` when none is async), read in C and without their locks:
        each count is read whole, and a worker only ever makes more room."""
        queues = list(itertools.compress(bindings, map(_IS_ASYNC, bindings)))
        if not queues:
            return sys.maxsize
        if any(map(_CLOSED, queues)):
            return 0
        try:
            least: int = min(map(operator.sub, map(_CAPACITY, queues), map(_QUEUED, queues)))
        except TypeError:  # (a queue of no set capacity: each read as room reads it)
            return min(binding.room for binding in queues)
        return max(0, least)

    @property
    def overflow(self) -> OverflowPolicy:
        """What a full async queue does."""
        return self._overflow

    @property
    def group(self) -> Any:
        """The key under which the router judges this binding with others of one
        routed batch (:meth:`~undercurrent.probes.base.ScoresRows.group_key`), or None."""
        return self._group

    @staticmethod
    def shared_group(bindings: Sequence[Binding]) -> tuple[bool, Any]:
        """(True, the :attr:`group`) when every one of ``bindings`` has the same
        one (None: none is judged in a group), else (False, None); read in C."""
        keys = set(map(_GROUP, bindings))
        return (True, next(iter(keys))) if len(keys) == 1 else (False, None)

    @property
    def async_group(self) -> Any:
        """For an async binding whose probe shares its values (a
        :class:`~undercurrent.probes.base.ScoresRows` group key), that key: a
        worker judges the ready bindings of one key together. None otherwise."""
        return self._async_group

    @property
    def cond(self) -> Any:
        """The (re-entrant) lock guarding the state; a strategy holds it around
        the transitions documented as "lock held"."""
        return self._mutex

    @property
    def received(self) -> int:
        """Records handed to the binding."""
        return self._received

    @property
    def processed(self) -> int:
        """Records the probe finished (returned or raised)."""
        return self._processed

    @property
    def dropped(self) -> int:
        """Records the probe never judged, or still in flight when the result was frozen."""
        return self._dropped

    @property
    def errors(self) -> int:
        """Records (and ``on_start`` / ``on_end`` calls, and planning hooks: see
        :meth:`hook_failed`) on which the probe raised."""
        return self._errors

    @property
    def timeouts(self) -> int:
        """Fallback signals given (``block_until_signal``)."""
        return self._timeouts

    @property
    def latency_total(self) -> float:
        """Seconds the probe took, over every processed record."""
        return self._latency_total

    @property
    def latency_max(self) -> float:
        """The longest any one record took, in seconds."""
        return self._latency_max

    @property
    def error_notes(self) -> list[str]:
        """The error notes so far (a copy)."""
        return list(self._error_notes)

    @property
    def waiting(self) -> int:
        """Records whose callers wait for the probe (or for queue room)."""
        return self._waiting

    @property
    def busy(self) -> bool:
        """Whether a probe call is in flight."""
        return self._busy

    @property
    def closed(self) -> bool:
        """Whether the binding accepts no more records."""
        return self._closed

    @property
    def finalised(self) -> bool:
        """Whether the accounting is frozen (the request ended)."""
        return self._finalised

    @property
    def breaker_open(self) -> bool:
        """Whether the circuit breaker is open (generation no longer waits)."""
        return self._breaker_open

    @property
    def consecutive_failures(self) -> int:
        """Fallbacks since the last row the probe answered in time."""
        return self._consecutive_failures

    @property
    def signals(self) -> list[ProbeSignal]:
        """The signals kept so far, in order (each located at its activation; a
        copy); those kept as columns are materialised on this read."""
        return list(self._kept())

    def _kept(self) -> list[ProbeSignal]:
        """The kept signals, the columns materialised first (the list itself)."""
        if self._signals is _NONE_KEPT:
            self._signals = []
        if self._unread:
            unread, self._unread = self._unread, []
            keep = self._signals.append
            entries = iter(unread)  # (six at a time: see _unread)
            for columns, batch, start, stop, observed, offset in zip(*[entries] * 6,
                                                                     strict=True):
                if (start - offset, stop - offset) != (0, len(columns)):
                    columns = columns[start - offset:stop - offset]
                for signal in columns.signals(batch[start:stop]):
                    if signal is not None:
                        keep(observed_only(signal) if observed else signal)
        return self._signals

    def keep_signal(self, signal: ProbeSignal) -> None:
        """Keep one signal, after those kept so far (lock held)."""
        self._kept().append(signal)

    def keep_signals(self, columns: BatchSignals, batch: ActivationBatch, *,
                     observed: bool = False) -> None:
        """Keep a batch's signals (lock held), as columns until read."""
        if columns.any_signal():  # the index columns only: the tensor may go
            self._unread_list().extend((columns, batch.index_view(), 0, len(batch), observed,
                                        0))

    def _unread_list(self) -> list[Any]:
        """The signal columns not materialised yet (a list of this binding's own
        from the first one kept on)."""
        if self._unread is _NONE_KEPT:
            self._unread = []
        return self._unread

    # -- user code, called without the lock ---------------------------------------

    def invoke_many(
        self, records: Sequence[ActivationRecord], *, propagate_interrupts: bool = False
    ) -> list[Outcome]:
        """Run the probe on ``records`` (in order): one (signal, error or None,
        seconds) per record.

        A probe that overrides ``on_activations`` gets the records in one call
        (its time is shared evenly among them, and an exception marks all of them
        as errors); any other probe gets ``on_activation`` once per record, so an
        exception costs only that record.

        ``KeyboardInterrupt`` / ``SystemExit`` raised by the probe are recorded like
        any error; with ``propagate_interrupts`` (the generation thread, where
        Ctrl-C must stop generation) they are re-raised after the binding has
        been marked idle and the records settled (finished ones processed, the
        one that raised an error, unseen ones dropped), so ending the request
        neither waits for a call that is over nor loses a record.
        """
        catch: type[BaseException] = Exception if propagate_interrupts else BaseException
        outcomes: list[Outcome] = []
        batched = self._batched and len(records) > 1
        try:
            if batched:
                outcomes = self._call_batch(records, catch)
            else:
                for record in records:
                    outcomes.append(self._call_one(record, catch))
        except BaseException as exc:  # an interrupt on the generation thread
            failing = records[len(outcomes)]
            self._log_first_error(
                f"on_activations (token {failing.token_index}, {len(records)} records)"
                if batched else
                f"on_activation (token {failing.token_index}, layer {failing.layer})", exc,
                reraised=True,
            )
            failed = len(records) if batched else 1
            outcomes.extend([(None, describe_error(exc), 0.0)] * failed)
            with self._mutex:
                self.end_call()
                if not self._finalised:
                    self.settle(records[: len(outcomes)], outcomes,
                                method=self._records_method(len(records)))
                    self._dropped += len(records) - len(outcomes)
            raise
        return outcomes

    def _records_method(self, count: int) -> str:
        """The method :meth:`invoke_many` calls on ``count`` records."""
        return "on_activations" if self._batched and count > 1 else "on_activation"

    def invoke_batch(
        self, batch: ActivationBatch, *, propagate_interrupts: bool = False
    ) -> BatchOutcome:
        """Run the probe on a batch: one ``on_batch`` call for a probe that scores
        batches (an exception is an error for every row), else the records, as
        :meth:`invoke_many` runs them (an exception in ``on_activation`` costs one
        record). ``propagate_interrupts`` as for :meth:`invoke_many`."""
        if not self._native:
            records = batch.records()
            return BatchOutcome.of(self.invoke_many(
                records, propagate_interrupts=propagate_interrupts),
                self._records_method(len(records)))
        catch: type[BaseException] = Exception if propagate_interrupts else BaseException
        count = len(batch)
        started = time.perf_counter()
        try:
            signals = self._probe.on_batch(batch)
            check_batch_signals(signals, count, self.method("on_batch"))
            errors: list[str | None] | None = None
        except catch as exc:
            signals = BatchSignals.none(count)
            errors = [describe_error(exc)] * count
            self._log_first_error(
                f"on_batch (token {batch.token_indices[0]}, {count} records)", exc)
        except BaseException as exc:  # an interrupt on the generation thread
            self._log_first_error(
                f"on_batch (token {batch.token_indices[0]}, {count} records)", exc,
                reraised=True)
            failed = BatchOutcome(BatchSignals.none(count), [describe_error(exc)] * count,
                                  0.0, 0.0, "on_batch")
            with self._mutex:
                self.end_call()
                if not self._finalised:
                    self.settle_batch(batch, failed)
            raise
        elapsed = time.perf_counter() - started
        return BatchOutcome(signals, errors, elapsed, elapsed / count, "on_batch")

    def _call_one(self, record: ActivationRecord, catch: type[BaseException]) -> Outcome:
        started = time.perf_counter()
        try:
            signal = self._probe.on_activation(record)
            _check_signal(signal, "on_activation")
            error = None
        except catch as exc:
            signal = None
            error = describe_error(exc)
            self._log_first_error(
                f"on_activation (token {record.token_index}, layer {record.layer})", exc
            )
        return signal, error, time.perf_counter() - started

    def _call_batch(
        self, records: Sequence[ActivationRecord], catch: type[BaseException]
    ) -> list[Outcome]:
        started = time.perf_counter()
        error = None
        try:
            signals = list(self._probe.on_activations(records))
            if len(signals) != len(records):
                raise TypeError(
                    f"on_activations returned {len(signals)} signals for {len(records)} records; "
                    "it must return one (ProbeSignal or None) per record"
                )
            for signal in signals:  # the check of _check_signal, without a call per record
                if signal is not None and type(signal) is not ProbeSignal:
                    _check_signal(signal, "on_activations")
        except catch as exc:
            signals = [None] * len(records)
            error = describe_error(exc)
            first = records[0]
            self._log_first_error(
                f"on_activations (token {first.token_index}, {len(records)} records)", exc
            )
        share = (time.perf_counter() - started) / len(records)
        return [(signal, error, share) for signal in signals]

    def log_error(self, where: str, exc: BaseException, *, reraised: bool = False) -> None:
        """Log the binding's first exception (see :meth:`_log_first_error`)."""
        self._log_first_error(where, exc, reraised=reraised)

    def _log_first_error(self, where: str, exc: BaseException, *,
                         reraised: bool = False) -> None:
        """Log a binding's first exception: one warning line, the traceback at DEBUG
        level (and kept for ``ProbeResult.metadata["traceback"]``). ``reraised``:
        the exception (an interrupt on the generation thread) goes on up, and
        stops the generation, rather than being recorded as the call's error."""
        if self._logged_error:
            return
        self._logged_error = True
        self._traceback = "".join(traceback.format_exception(exc))
        logger.warning(
            "probe %r (%s) on request %r raised in %s: %s; %s "
            "(traceback: ProbeResult.metadata['traceback'], or DEBUG logging)",
            self._name, self._probe_type, self.request_id, where, describe_error(exc),
            "it is re-raised and generation stops" if reraised else "generation continues",
        )
        logger.debug("traceback of probe %r on request %r", self._name, self.request_id,
                     exc_info=exc)

    def start(self) -> None:
        """Call ``on_start``; a failure is recorded, never raised.

        A probe whose ``on_start`` failed is not ready to judge anything: the
        binding is closed at once, so the request's records count as dropped,
        never reach the probe and give no signal (not even a fallback), and
        ``on_end`` is not called.
        """
        try:
            self._probe.on_start(self._ctx)
        except Exception as exc:
            self._log_first_error("on_start", exc)
            with self._mutex:
                self._errors += 1
                self._start_failed = True
                self._closed = True
                self._note(
                    f"on_start: {describe_error(exc)} (the probe got no activations and "
                    "on_end was not called)"
                )

    @staticmethod
    def start_together(bindings: Sequence[Binding]) -> bool:
        """:meth:`start` of every binding of one point (one per request of a call)
        in one call of their probes' class's
        :meth:`~undercurrent.probes.base.Probe.start_many`: True when done, False
        with nothing done when the class starts each alone (or its
        ``start_many`` raised: then each :meth:`start` notes its own failure)."""
        probes = [binding._probe for binding in bindings]
        kind = type(probes[0])
        start_many = getattr(kind, "start_many", None)
        if start_many is None or any(type(probe) is not kind for probe in probes):
            return False
        try:
            return bool(start_many(probes, [binding._ctx for binding in bindings]))
        except Exception:  # (noted per binding by start, which meets it again)
            return False

    @staticmethod
    def end_idle_together(columns: Sequence[Sequence[Binding]]) -> list[list[ProbeResult]] | None:
        """:meth:`end_if_idle` of every binding of a call's requests, at once:
        ``columns[p]`` holds point ``p`` 's bindings, one per request, and the
        results come back the same way. None, with nothing done, unless every
        binding is idle (nothing queued, in flight or waiting for its turn, no
        thread waiting on it, not ended) and its lock free.

        The verdicts of a point whose probes' class ends them together
        (:meth:`~undercurrent.probes.base.Probe.end_many`) come from one call;
        the other probes' ``on_end`` run one by one, request by request (the
        order ending each request gives), each failure noted as
        :meth:`end_if_idle` notes it. The results are the ones :meth:`result`
        gives, made in one loop."""
        bindings = list(itertools.chain.from_iterable(columns))
        with _all_locked(bindings) as locked:
            if not locked:
                return None
            for binding in bindings:
                if (binding._queue or binding._busy or binding._waiting or binding._sleepers
                        or binding._finalised):
                    return None
            for binding in bindings:
                binding._closed = binding._finalised = True
        verdicts: list[list[Any] | None] = [Binding._end_many(column) for column in columns]
        if None in verdicts:  # the others' on_end, in the order ending each request gives
            alone = [index for index, found in enumerate(verdicts) if found is None]
            for index in alone:
                verdicts[index] = []
            order = [(index, binding)
                     for row in zip(*[columns[index] for index in alone], strict=True)
                     for index, binding in zip(alone, row, strict=True)]
            done = 0
            try:
                for index, binding in order:
                    verdicts[index].append(  # type: ignore[union-attr]
                        binding._verdict(not binding._start_failed))
                    done += 1
            except BaseException:
                # An interrupt: the probes after it still get on_end (as ending
                # the requests in turn gives them), then it propagates.
                for _, binding in order[done + 1:]:
                    binding._verdict(not binding._start_failed)
                raise
        return [Binding._results(column, found)  # type: ignore[arg-type]
                for column, found in zip(columns, verdicts, strict=True)]

    @staticmethod
    def _end_many(bindings: Sequence[Binding]) -> list[Any] | None:
        """The verdicts of one point's finalised bindings from their probes' class's
        ``end_many``, or None (each probe's ``on_end`` is called then)."""
        probes = [binding._probe for binding in bindings]
        kind = type(probes[0])
        end_many = getattr(kind, "end_many", None)
        if end_many is None or any(binding._start_failed for binding in bindings) or any(
                type(probe) is not kind for probe in probes):
            return None
        try:
            verdicts = end_many(probes, [binding._ctx for binding in bindings])
        except Exception:  # (noted per binding by _verdict, which meets it again)
            return None
        if verdicts is None:
            return None
        try:
            if isinstance(verdicts, (Mapping, str, bytes)):  # (its keys, or characters)
                raise TypeError("a sequence of verdicts in the probes' order is expected")
            found = list(verdicts)
        except Exception as exc:
            problem = f"returned {type(verdicts).__name__}: {describe_error(exc)}"
        else:
            if len(found) == len(bindings):
                return found
            problem = f"returned {len(found)} verdicts for {len(bindings)} probes"
        # Refused: each probe's on_end gives its verdict, as when end_many
        # raises, and every result says why.
        note = (f"end_many: {kind.__name__}.end_many at point {bindings[0]._name!r} "
                f"{problem}; it must return one verdict per probe (on_end gave each)")
        logger.warning("%s", note)
        for binding in bindings:
            with binding._mutex:
                binding._errors += 1
                binding._note(note)
        return None

    @staticmethod
    def _results(bindings: Sequence[Binding], verdicts: Sequence[Any]) -> list[ProbeResult]:
        """:meth:`result` of each finalised binding with its verdict: the same
        results, made in one loop, without a call per binding, for the plain
        ones (no error note, no traceback)."""
        if any(binding._error_notes or binding._traceback is not None for binding in bindings):
            return list(map(Binding.result, bindings, verdicts))
        new = object.__new__
        results = []
        for binding, verdict in zip(bindings, verdicts, strict=True):
            processed = binding._processed
            stats = new(ProbeStats)
            stats.__dict__.update({
                "received": binding._received, "processed": processed,
                "dropped": binding._dropped, "errors": binding._errors,
                "timeouts": binding._timeouts,
                "mean_latency_s": binding._latency_total / processed if processed else 0.0})
            result = new(ProbeResult)
            result.__dict__.update({
                "request_id": binding._ctx.request_id, "extraction_point_name": binding._name,
                "verdict": verdict,
                # (signals still columns are built when first read, as result() leaves them)
                "signals": (LazySequence(binding._kept) if binding._unread
                            else tuple(binding._signals)),
                "stats": stats, "error": None,
                "metadata": {"probe_type": binding._probe_type,
                             "execution_mode": binding._execution_mode,
                             "intervention": binding._intervention,
                             "max_latency_s": binding._latency_max,
                             "late_results": binding._late_results,
                             "breaker_open": binding._breaker_open}})
            results.append(result)
        return results

    # -- accounting, called with the lock held -------------------------------------

    def account(self, latency: float, error: str | None, record: ActivationRecord) -> None:
        """Count one record the probe finished (returned or raised)."""
        self._processed += 1
        self._latency_total += latency
        self._latency_max = max(self._latency_max, latency)
        if error is not None:
            self._count_error(error, record)

    def _note(self, note: str) -> None:
        """Add an error note for the result (lock held)."""
        if self._error_notes is _NO_NOTES:
            self._error_notes = []
        self._error_notes.append(note)

    def _count_error(self, error: str, record: ActivationRecord | _Where,
                     method: str = "on_activation", rows: int = 1) -> None:
        """Count one row the probe failed on; the first is noted, naming the
        ``method`` that raised and where: the row's token and layer
        (``on_activation``), or the first row's token and the ``rows`` the call
        judged (``on_activations``, ``on_batch``)."""
        self._errors += 1
        if not any(note.startswith(_CALL_METHODS) for note in self._error_notes):
            where = f"layer {record.layer}" if method == "on_activation" else f"{rows} records"
            self._note(f"{method} (token {record.token_index}, {where}): {error}")

    def settle(self, records: Sequence[ActivationRecord], outcomes: Sequence[Outcome], *,
               observed: bool = False, method: str = "on_activation") -> None:
        """Count finished records and keep their signals (``observed``: async or
        unwaited calls, whose ``abort`` is recorded as ``flag``; ``method``:
        the probe's method that judged them, which an error note names)."""
        # account() for each record, in one pass: the same counts, latency sum (added
        # in the same order) and maximum, error notes and signals.
        total, longest = self._latency_total, self._latency_max
        keep = self._kept().append
        for record, (signal, error, latency) in zip(records, outcomes, strict=True):
            total += latency
            if latency > longest:  # max(a, b) keeps a unless b > a
                longest = latency
            if error is not None:
                self._count_error(error, record, method, len(records))
            if signal is not None:
                signal = signal.at(record.request_id, record.extraction_point_name,
                                   record.layer, record.token_index, record.generated_index)
                keep(observed_only(signal) if observed else signal)
        self._processed += len(records)
        self._latency_total, self._latency_max = total, longest

    def settle_batch(self, batch: ActivationBatch, outcome: BatchOutcome, *,
                     observed: bool = False, keep: bool = True) -> None:
        """:meth:`settle` for a batch, in one update: every row processed, the errors
        counted, the signals kept as columns (unless ``keep`` is False)."""
        self._processed += len(batch)
        self._latency_total += outcome.latency
        if outcome.longest > self._latency_max:
            self._latency_max = outcome.longest
        if outcome.errors is not None:
            self._count_errors(batch, outcome.errors, outcome.method)
        if keep:
            self.keep_signals(outcome.signals, batch, observed=observed)

    def _count_errors(self, batch: ActivationBatch, errors: Sequence[str | None],
                      method: str = "on_activation") -> None:
        failed = [index for index, error in enumerate(errors) if error is not None]
        if not failed:
            return
        self._errors += len(failed) - 1
        first = failed[0]
        error = errors[first]
        assert error is not None
        self._count_error(error, _Where(batch.token_indices[first], batch.layers[first]),
                          method, len(batch))

    def enqueue_batch(self, batch: ActivationBatch, start: int = 0,
                      stop: int | None = None) -> bool:
        """Queue rows ``start:stop`` of a batch (all of it by default) on this async
        binding under a non-blocking overflow policy (``drop_oldest`` /
        ``drop_newest``), which drops whole vectors and counts them: the queue
        keeps at most ``queue_capacity`` vectors. The rows are sliced off the batch
        only when a worker takes them. Returns True when the binding must be
        handed to the scheduler."""
        if stop is None:
            stop = len(batch)
        count = stop - start
        with self._mutex:
            self._received += count
            if self._closed:
                self._dropped += count
                return False
            capacity = self._queue_capacity or 1
            if self._overflow is OverflowPolicy.DROP_NEWEST:
                room = max(0, capacity - self._queued)
                if room < count:
                    self._dropped += count - room
                    if room == 0:
                        return False
                    count = room  # (the first rows: the newest go)
            self._queue.append(_Rows(batch, start, start + count))
            self._queued += count
            if self._queued > capacity:  # drop_oldest: the oldest vectors go first
                self._drop_oldest(self._queued - capacity)
            if self._scheduled:
                return False
            self._scheduled = True
            return True

    @staticmethod
    def enqueue_together(bindings: Sequence[Binding], batch: ActivationBatch,
                         starts: Sequence[int], stops: Sequence[int]) -> list[Binding] | None:
        """:meth:`enqueue_batch` of rows ``starts[i]:stops[i]`` on each async
        binding, at once, where that drops nothing: each binding open, under a
        non-blocking policy, with room for its rows, and its lock free. Returns
        the bindings to hand to the scheduler (those not scheduled yet), or
        None with nothing done (each is then queued on its own)."""
        block = OverflowPolicy.BLOCK
        with _all_locked(bindings) as locked:
            if not locked:
                return None
            for binding, start, stop in zip(bindings, starts, stops, strict=True):
                capacity = binding._queue_capacity
                if (binding._closed or capacity is None or binding._overflow is block
                        or binding._queued + stop - start > capacity):  # (some would drop)
                    return None
            handed = []
            for binding, start, stop in zip(bindings, starts, stops, strict=True):
                binding._received += stop - start
                binding._queue.append(_Rows(batch, start, stop))
                binding._queued += stop - start
                if not binding._scheduled:
                    binding._scheduled = True
                    handed.append(binding)
            return handed

    def _drop_oldest(self, count: int) -> None:
        self._dropped += count
        self._queued -= count
        while count:
            head = self._queue[0]
            if len(head) <= count:
                self._queue.popleft()
                count -= len(head)
            else:
                self._queue[0] = head.tail(count)
                count = 0

    def enqueue_blocking(self, batch: ActivationBatch, hand_over: Any, start: int = 0,
                         stop: int | None = None) -> None:
        """Queue a batch under ``block``: as many vectors as there is room for, then
        wait for room for the rest (a batch larger than the queue goes in pieces).
        ``hand_over(binding)`` gives the binding to the workers as soon as it has
        queued vectors, before waiting: only a worker can make room. ``start`` /
        ``stop``: the rows of ``batch`` to queue (all by default)."""
        rows = _Rows(batch, start, len(batch) if stop is None else stop)
        count = len(rows)
        capacity = self._queue_capacity or 1
        offset = 0
        with self._mutex:
            self._received += count
        while offset < count:
            with self._mutex:
                left = count - offset
                self._waiting += left
                while self._queued >= capacity and not self._closed:
                    self._wait()
                self._waiting -= left
                if self._finalised:  # counted as dropped by finalise()
                    return
                if self._closed:
                    self._dropped += left
                    return
                take = min(left, capacity - self._queued)
                self._queue.append(rows.tail(offset).head(take))
                self._queued += take
                offset += take
                hand = not self._scheduled
                self._scheduled = True
            if hand:
                hand_over(self)

    # -- transitions of a call, lock held (the blocking strategy's steps) ---------------

    def receive(self, count: int) -> bool:
        """Count ``count`` records received (lock held); False when the binding is
        closed, the records then counted dropped."""
        self._received += count
        if self._closed:
            self._dropped += count
            return False
        return True

    def drop(self, count: int) -> None:
        """Count ``count`` received records the probe will never see (lock held)."""
        self._dropped += count

    def _wait(self, timeout: float | None = None) -> None:
        """Wait on the condition (lock held), counted so that :meth:`_wake` knows."""
        cond = self._cond
        if cond is None:  # made under the lock: one condition per binding
            cond = self._cond = threading.Condition(self._mutex)
        self._sleepers += 1
        try:
            # (past the platform's longest wait, ~292 years, a wait is untimed: the
            # callers loop on their deadline, so it only ends the same way sooner)
            cond.wait(None if timeout is None or timeout >= threading.TIMEOUT_MAX else timeout)
        finally:
            self._sleepers -= 1

    def _wake(self) -> None:
        """Wake every thread waiting on the condition, if any (lock held)."""
        if self._sleepers:
            assert self._cond is not None  # a sleeper made it
            self._cond.notify_all()

    def wait_turn(self, count: int, deadline: float | None = None) -> None:
        """Wait (lock held) until the probe is free, the binding closed, or the
        ``time.monotonic()`` deadline passed, counting ``count`` records waiting
        meanwhile (:meth:`finalise` counts them dropped)."""
        self._waiting += count
        while self._busy and not self._closed:
            if deadline is None:
                self._wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wait(remaining)
        self._waiting -= count

    def wait_until(self, done: Callable[[], bool], deadline: float) -> None:
        """Wait (lock held) until ``done()``, the binding is finalised, or the
        ``time.monotonic()`` deadline passed."""
        while not done() and not self._finalised:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wait(remaining)

    def begin_call(self, count: int) -> None:
        """Mark the probe busy with a call on ``count`` records (lock held)."""
        self._busy = True
        self._in_flight = count

    def end_call(self) -> None:
        """The call marked by :meth:`begin_call` is over: the probe is free (lock held)."""
        self._busy = False
        self._in_flight = 0
        self._wake()

    def hand_to_helper(self, call: Any, count: int,
                       loop: Callable[[Binding], None]) -> None:
        """Give ``call`` (on ``count`` records) to this binding's helper thread,
        starting it (running ``loop(self)``) if none runs (lock held); the probe
        is busy until the helper ends the call."""
        self.begin_call(count)
        self._pending = call
        if self._helper is None:
            self._helper = threading.Thread(
                target=loop,
                args=(self,),
                name=f"undercurrent-block-{self.request_id}-{self._name}",
                daemon=True,
            )
            self._helper.start()
        self._wake()

    def next_pending(self) -> Any:
        """The helper thread's next call (lock held): waits for one, or for the
        binding to be finalised; the call is no longer pending. None when there
        is none (finalised)."""
        while self._pending is None and not self._finalised:
            self._wait()
        call, self._pending = self._pending, None
        return call

    def retire_helper(self) -> None:
        """The helper thread stops (lock held): the probe is free, and a later call
        starts a new helper."""
        self._helper = None
        self.end_call()

    def count_late(self, count: int) -> None:
        """``count`` records whose answer came after their caller gave up (lock held)."""
        self._late_results += count

    def note_success(self) -> None:
        """A row the probe answered in time: the failure run ends (lock held)."""
        self._consecutive_failures = 0

    def fall_back(self, signal: ProbeSignal) -> None:
        """A row got the ``on_timeout`` fallback ``signal`` (lock held): count a
        timeout and a failure in a row, keep the signal."""
        self._timeouts += 1
        self._consecutive_failures += 1
        self.keep_signal(signal)

    def trip_breaker(self) -> bool:
        """Open the circuit breaker when the failures in a row reach its threshold
        (lock held); True when it opened now."""
        threshold = self._breaker_threshold
        if (threshold is None or self._breaker_open
                or self._consecutive_failures < threshold):
            return False
        self._breaker_open = True
        return True

    # -- transitions of a call (each takes the lock itself) ------------------------------

    def admit_inline(self, count: int) -> bool:
        """An inline caller brings ``count`` records: count them received, wait for
        the probe to be free, and mark it busy with them. False when the binding
        closed meanwhile (the records are then counted dropped, here or by
        :meth:`finalise`) and the caller must not run the probe."""
        with self._mutex:
            self._received += count
            if self._busy:
                self.wait_turn(count)
            if self._finalised:  # counted as dropped by finalise()
                return False
            if self._closed:
                self._dropped += count
                return False
            self._busy = True  # begin_call, inlined: this runs per request and step
            self._in_flight = count
            return True

    @staticmethod
    def admit_together(bindings: Sequence[Binding], counts: Sequence[int]) -> bool:
        """:meth:`admit_inline` of each binding with its count, at once (a group
        judged together): True when every one is admitted, each free and open
        and its lock free; False, with nothing done, otherwise (each is then
        admitted on its own, waiting for its turn where it must)."""
        with _all_locked(bindings) as locked:
            if not locked or any(binding._busy or binding._closed for binding in bindings):
                return False  # (a finalised binding is closed)
            for binding, count in zip(bindings, counts, strict=True):
                binding._received += count
                binding._busy = True  # begin_call, inlined
                binding._in_flight = count
            return True

    @staticmethod
    def finish_together(bindings: Sequence[Binding], batch: ActivationBatch,
                        spans: Sequence[tuple[int, int]], signals: BatchSignals | None,
                        share: float, offset: int) -> bool:
        """:meth:`finish_rows` of each binding admitted by :meth:`admit_together`,
        rows ``spans[i]`` being binding ``i`` 's, with the signal columns they
        share (row ``r`` of ``batch`` is row ``r - offset`` of ``signals``; None:
        no row got one) and ``share`` seconds per row: True when done for all,
        each settled as :meth:`finish_rows` settles it; False, with nothing
        done, when a thread waits on one of them, one was finalised meanwhile,
        or a lock is taken (each then finishes on its own)."""
        with _all_locked(bindings) as locked:
            if not locked or any(binding._sleepers or binding._finalised
                                 for binding in bindings):
                return False
            for binding, (start, stop) in zip(bindings, spans, strict=True):
                binding._busy = False  # end_call, inlined
                binding._in_flight = 0
                binding._processed += stop - start
                binding._latency_total += share * (stop - start)
                if share > binding._latency_max:
                    binding._latency_max = share
                if signals is not None:
                    binding._unread_list().extend((signals, batch, start, stop, False, offset))
            return True

    def take_queued(self, limit: int) -> ActivationBatch | None:
        """An async worker takes up to ``limit`` queued vectors (one for a probe that
        does not batch) as one batch and marks the probe busy with them. None when
        there is nothing to do: the binding is then no longer scheduled."""
        pieces = self.take_queued_rows(limit)
        if pieces is None:
            return None
        return ActivationBatch.concat([batch[start:stop] for batch, start, stop in pieces])

    def take_queued_rows(self, limit: int) -> list[tuple[ActivationBatch, int, int]] | None:
        """:meth:`take_queued` as the row ranges of the routed batches they sit in,
        (batch, start, stop) in order, nothing sliced."""
        with self._mutex:
            if not self._queue or self._finalised:
                self._scheduled = False
                self._wake()
                return None
            take = min(self._queued, limit) if self._batched else 1
            pieces: list[_Rows] = []
            left = take
            while left:
                head = self._queue[0]
                if len(head) <= left:
                    pieces.append(self._queue.popleft())
                    left -= len(head)
                else:
                    pieces.append(head.head(left))
                    self._queue[0] = head.tail(left)
                    left = 0
            self._queued -= take
            self.begin_call(take)
            self._wake()  # room for a producer blocked on a full queue
        return [(piece.batch, piece.start, piece.stop) for piece in pieces]

    @staticmethod
    def take_together(bindings: Sequence[Binding]
                      ) -> list[tuple[Binding, list[tuple[ActivationBatch, int, int]]]] | None:
        """:meth:`take_queued_rows` of each async binding of a group's turn, up to
        its queue's capacity, at once: (binding, its row ranges) for those with
        rows queued, each then busy with its whole queue; one found empty (or
        finalised) is unscheduled, as :meth:`take_queued_rows` leaves it. None,
        with nothing done, unless every lock is free, every probe scores
        batches and no queue holds more than its capacity (then each is taken
        on its own)."""
        taken: list[tuple[Binding, list[tuple[ActivationBatch, int, int]]]] = []
        with _all_locked(bindings) as locked:
            if not locked or not all(binding._batched
                                     and binding._queued <= (binding._queue_capacity or 1)
                                     for binding in bindings):
                return None
            for binding in bindings:
                queue = binding._queue
                if not queue or binding._finalised:
                    binding._scheduled = False
                else:
                    taken.append((binding, [(rows.batch, rows.start, rows.stop)
                                            for rows in queue]))
                    queue.clear()
                    binding._busy = True  # begin_call, inlined
                    binding._in_flight = binding._queued
                    binding._queued = 0
                if binding._sleepers:
                    binding._wake()  # room for a producer blocked on a full queue
        return taken

    @staticmethod
    def finish_ranges_together(
            bindings_pieces: Sequence[tuple[Binding, Sequence[tuple[ActivationBatch, int, int,
                                                                    int]]]],
            signals: BatchSignals | None, shares: Sequence[float], longest: float
    ) -> list[bool] | None:
        """:meth:`finish_ranges` of each binding of a group's turn, with its
        pieces and its latency (``shares``), at once: per binding, whether it
        stays scheduled. None, with nothing done, when a lock is taken (each
        then finishes on its own)."""
        bindings = [binding for binding, _ in bindings_pieces]
        kept: list[bool] = []
        with _all_locked(bindings) as locked:
            if not locked:
                return None
            for (binding, pieces), latency in zip(bindings_pieces, shares, strict=True):
                kept.append(binding._settle_ranges(pieces, signals, latency, longest))
        return kept

    def finish_call(self, batch: ActivationBatch, outcome: BatchOutcome, *,
                    observed: bool) -> bool:
        """The call marked by :meth:`admit_inline` / :meth:`take_queued` returned:
        the probe is free again and the batch is settled. False (nothing
        settled) when the result was frozen meanwhile, so it counted as dropped."""
        with self._mutex:
            self.end_call()
            if self._finalised:
                return False
            self.settle_batch(batch, outcome, observed=observed)
            return True

    def finish_rows(self, batch: ActivationBatch, start: int, stop: int,
                    signals: BatchSignals | None, latency: float, longest: float,
                    error: str | None = None, *, offset: int | None = None) -> bool:
        """The group call that judged rows ``start:stop`` of ``batch`` (marked by
        :meth:`admit_inline`) returned: settle them in one update, with the
        signals they got (or ``error`` for every row). ``signals`` are those rows'
        own (row ``start`` is their row 0), or, with ``offset``, columns shared
        with other bindings in which row ``r`` of the batch is row ``r - offset``
        (their rows with a signal are then kept whatever the other rows hold).
        ``batch`` is kept for locating the signals: pass its
        :meth:`~ActivationBatch.index_view`. False when the result was frozen
        meanwhile."""
        count = stop - start
        with self._mutex:
            self._busy = False  # end_call, inlined: this runs per request and step
            self._in_flight = 0
            if self._sleepers:
                self._wake()
            if self._finalised:
                return False
            self._processed += count
            self._latency_total += latency
            if longest > self._latency_max:
                self._latency_max = longest
            if error is not None:  # (judge_rows / judge_many: on_batch's two halves)
                self._count_errors(batch[start:stop], [error] * count, "on_batch")
            elif signals is not None and (offset is not None or signals.any_signal()):
                self._unread_list().extend((signals, batch, start, stop, False,
                                            start if offset is None else offset))
            return True

    def finish_ranges(self, pieces: Sequence[tuple[ActivationBatch, int, int, int]],
                      signals: BatchSignals | None, latency: float, longest: float,
                      error: str | None = None) -> bool:
        """The group call that judged this async binding's rows taken by
        :meth:`take_queued_rows` returned: settle them in one update (nothing when
        the result was frozen meanwhile), then :meth:`keep_scheduled`, in one
        hold of the lock. ``pieces`` are (index batch, start, stop, offset) per
        row range, row ``r`` of the batch being row ``r - offset`` of ``signals``
        (kept as observations), or ``error`` for every row. Returns what
        :meth:`keep_scheduled` returns."""
        with self._mutex:
            return self._settle_ranges(pieces, signals, latency, longest, error)

    def _settle_ranges(self, pieces: Sequence[tuple[ActivationBatch, int, int, int]],
                       signals: BatchSignals | None, latency: float, longest: float,
                       error: str | None = None) -> bool:
        """:meth:`finish_ranges` with the lock held: the probe free again
        (:meth:`end_call`), the rows settled unless the result was frozen, then
        :meth:`keep_scheduled` (threads waiting on the binding woken once)."""
        self._busy = False
        self._in_flight = 0
        if not self._finalised:
            self._processed += sum(stop - start for _, start, stop, _ in pieces)
            self._latency_total += latency
            if longest > self._latency_max:
                self._latency_max = longest
            if error is not None:
                for batch, start, stop, _ in pieces:
                    self._count_errors(batch[start:stop], [error] * (stop - start), "on_batch")
            elif signals is not None:
                unread = self._unread_list()
                for batch, start, stop, offset in pieces:
                    unread.extend((signals, batch, start, stop, True, offset))
        more = bool(self._queue) and not self._finalised
        if not more:
            self._scheduled = False
        if self._sleepers:
            self._wake()
        return more

    def release_dropped(self, count: int) -> None:
        """An admitted call that never ran (an interrupt stopped the group first):
        the probe is free again and the rows count as dropped."""
        with self._mutex:
            self.end_call()
            if not self._finalised:
                self._dropped += count

    def keep_scheduled(self) -> bool:
        """After a worker's turn: True when queued records remain (the binding stays
        scheduled), else it is unscheduled."""
        with self._mutex:
            if self._queue and not self._finalised:
                return True
            self._scheduled = False
            self._wake()
            return False

    # -- end of the request -----------------------------------------------------------

    def close(self) -> None:
        """Accept no more records; wake producers blocked on a full queue."""
        with self._mutex:
            self._closed = True
            if self._dropped_at_close is None:
                self._dropped_at_close = self._dropped
            self._wake()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until the queue is empty and nothing is in flight, or the deadline."""
        with self._mutex:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wait(remaining)
            return True

    def finalise(self, waited_s: float) -> bool:
        """Freeze the accounting; returns True when ``on_end`` may run now.

        Records still queued, those still in flight, and those whose callers are
        still waiting for their turn count as dropped; a late completion is then
        discarded. ``waited_s``: how long ending the request waited for this
        binding to go idle (the error note reports it).
        """
        with self._mutex:
            self._closed = True
            self._finalised = True
            queued = self._queued + self._waiting
            if self._queue:
                self._queue.clear()
            self._queued = 0
            in_flight = self._in_flight if self._busy else 0
            # (rows dropped since close() by producers it woke count as unprocessed
            # too, as they do when finalise comes first: the note and stats agree)
            dropped_since_close = (0 if self._dropped_at_close is None
                                   else self._dropped - self._dropped_at_close)
            self._dropped += queued + in_flight
            if queued or in_flight:
                what = f"{queued + dropped_since_close} unprocessed record(s)"
                if in_flight:
                    what += f" and {'one' if in_flight == 1 else in_flight} in flight"
                self._note(
                    f"{self._gave_up(waited_s)} with {what}, counted as dropped"
                )
            if in_flight:
                self._note(
                    "on_activation was still running, so on_end was not called"
                )
            self._wake()
            return not in_flight

    def _gave_up(self, waited_s: float) -> str:
        """Why records were left when the request ended, for the error note."""
        if not self._is_async and self._policy.mode is InterventionMode.BLOCK_UNTIL_SIGNAL:
            return (f"a block_until_signal call that missed its deadline was still running "
                    f"{waited_s:g}s after the request ended (ending waits "
                    "max(1 s, 2 x timeout_ms) for it)")
        if waited_s <= 0:
            return "the request ended without waiting for its queue (no drain time)"
        return f"drain timed out after {waited_s:g}s"

    def result(self, verdict: Any) -> ProbeResult:
        """The ProbeResult, from the current (final) accounting."""
        with self._mutex:
            processed = self._processed
            stats = ProbeStats.of(self._received, processed, self._dropped, self._errors,
                                  self._timeouts,
                                  self._latency_total / processed if processed else 0.0)
            metadata = {
                "probe_type": self._probe_type,
                "execution_mode": self._execution_mode,
                "intervention": self._intervention,
                "max_latency_s": self._latency_max,
                "late_results": self._late_results,
                "breaker_open": self._breaker_open,
            }
            if self._traceback is not None:
                metadata["traceback"] = self._traceback
            # The kept signals: a tuple, or built when first read if some are
            # still columns (the binding is final: nothing is added later).
            signals: tuple[ProbeSignal, ...] | LazySequence[ProbeSignal] = (
                LazySequence(lambda: list(self._kept())) if self._unread
                else tuple(self._signals))
            return ProbeResult.of(self._ctx.request_id, self._name, verdict, signals, stats,
                                  "; ".join(self._error_notes) or None, metadata)

    def looks_idle(self) -> bool:
        """Whether the binding is idle as :meth:`end_if_idle` asks, read without
        its lock: a hint (a worker may change it the next moment), which
        :meth:`end_if_idle` and :meth:`end_idle_together` check again under it."""
        return not (self._queue or self._busy or self._waiting or self._sleepers
                    or self._finalised)

    def end_if_idle(self) -> ProbeResult | None:
        """:meth:`close`, :meth:`wait_idle` and :meth:`end` at once, for a binding
        with nothing queued, in flight or waiting for its turn, and no thread
        waiting on it: what they give (nothing is dropped, so nothing waited
        for). None, with nothing done, for any other binding."""
        with self._mutex:
            if (self._queue or self._busy or self._waiting or self._sleepers
                    or self._finalised):
                return None
            self._closed = self._finalised = True
        return self._ended(not self._start_failed)

    def end(self, waited_s: float) -> ProbeResult:
        """Finalise, call ``on_end`` (unless an activation is still running), build the
        result; ``waited_s`` is how long ending the request waited for this binding."""
        return self._ended(self.finalise(waited_s) and not self._start_failed)

    def _ended(self, may_end: bool) -> ProbeResult:
        """The result of a finalised binding, with ``on_end`` 's verdict when
        ``may_end`` (an ``on_end`` that raises is counted and noted)."""
        return self.result(self._verdict(may_end))

    def _verdict(self, may_end: bool) -> Any:
        """``on_end`` 's verdict when ``may_end``, else None (an ``on_end`` that
        raises gives None, counted and noted)."""
        if not may_end:
            return None
        try:
            return self._probe.on_end(self._ctx)
        except Exception as exc:
            self._log_first_error("on_end", exc)
            with self._mutex:
                self._errors += 1
                self._note(f"on_end: {describe_error(exc)}")
            return None

    def snapshot(self) -> dict[str, Any]:
        """Live metrics for this binding."""
        with self._mutex:
            return {
                "request_id": self.request_id,
                "point": self._name,
                "probe_type": self._probe_type,
                "execution_mode": self._execution_mode,
                "intervention": self._intervention,
                "received": self._received,
                "processed": self._processed,
                "dropped": self._dropped,
                "errors": self._errors,
                "timeouts": self._timeouts,
                "queue_depth": self._queued,
                "queue_capacity": self._queue_capacity,
                "mean_latency_s": self._latency_total / self._processed if self._processed else 0.0,
                "max_latency_s": self._latency_max,
                "breaker_open": self._breaker_open,
            }
