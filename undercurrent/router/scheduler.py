"""The async scheduler: a shared pool of worker threads serving async bindings.

A binding with queued records sits (once) on a FIFO ready line. A worker takes
it, processes at most ``batch_size`` records (vectors) in order, and puts it back at the
end of the line if records remain, so every binding makes progress however many
bindings share however few workers. Only one worker holds a binding at a time,
which keeps each binding's records strictly ordered.

Bindings whose probes share their values (built-ins with a
:meth:`~undercurrent.probes.base.ScoresRows.group_key`; one binding per request
of a point) are served together: a worker that takes one also takes every
other ready binding of the same key, takes everything each has queued (at
most its queue's capacity, which may exceed ``batch_size``), and judges them
all with one
:meth:`~undercurrent.probes.base.ScoresRows.judge_many` call, then settles
each binding on its own. The counts, signals and state are those of serving
each binding alone; a class without ``judge_many``, or a call that fails, falls
back to that: each binding's own call on the rows it took (one call for all
of them, so a probe that raises counts an error on each).

A probe that hangs would pin its worker. A supervisor notices workers stuck in
one call for longer than ``stall_timeout_s`` and starts replacements (up to
``max_workers`` threads), so the other bindings keep moving; surplus workers
retire once the stuck call returns.
"""

from __future__ import annotations

import atexit
import collections
import operator
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from undercurrent.records import ActivationBatch, BatchSignals, join_values, rows_of
from undercurrent.router.binding import Binding, check_batch_signals, describe_error
from undercurrent.router.threads import mark_probe_thread

#: At most this many bindings are judged together in one worker call.
GROUP_LIMIT = 256


class _Worker:
    __slots__ = ("thread", "call_started")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.call_started: float | None = None


class AsyncScheduler:
    """Runs async bindings' queued records on ``workers`` shared threads."""

    def __init__(
        self,
        workers: int,
        *,
        batch_size: int = 16,
        stall_timeout_s: float = 1.0,
        max_workers: int | None = None,
        owner: object | None = None,
    ) -> None:
        # (the router whose probes the workers run, held weakly: see router.threads)
        self._owner = None if owner is None else weakref.ref(owner)
        self.target = workers
        self.batch_size = batch_size
        self.stall_timeout_s = stall_timeout_s
        self.max_workers = max_workers if max_workers is not None else 4 * workers + 8
        self._cond = threading.Condition()
        self._ready: deque[Binding] = deque()
        self._workers: list[_Worker] = []
        self._stopping = False
        self._supervisor: threading.Thread | None = None
        self._supervisor_stop = threading.Event()

    # -- public ---------------------------------------------------------------------

    def schedule(self, binding: Binding) -> None:
        """Put a binding with queued records on the ready line."""
        self.schedule_many((binding,))

    def schedule_many(self, bindings: Sequence[Binding]) -> None:
        """Put bindings with queued records on the ready line, waking in one go
        as many workers as they make turns (:func:`_turns`; at most every
        worker)."""
        if not bindings:
            return
        turns = _turns(bindings)
        with self._cond:
            self._ready.extend(bindings)
            if not self._workers and not self._stopping:
                for _ in range(self.target):
                    self._spawn_locked()
                self._start_supervisor_locked()
                _RUNNING.add(self)
            self._cond.notify(turns)

    def worker_count(self) -> int:
        """Worker threads alive now (more than ``workers`` while some are stalled)."""
        with self._cond:
            return len(self._workers)

    def ready_count(self) -> int:
        """Bindings waiting for a worker."""
        with self._cond:
            return len(self._ready)

    def stop(self, wait: bool = True, timeout_s: float | None = None) -> None:
        """Stop the workers once the ready line is empty; optionally join them."""
        with self._cond:
            self._stopping = True
            workers = [w.thread for w in self._workers if w.thread is not None]
            self._cond.notify_all()
        self._supervisor_stop.set()
        if wait:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            for thread in workers:
                if thread is threading.current_thread():
                    continue
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                thread.join(None if remaining is None or remaining >= threading.TIMEOUT_MAX
                            else remaining)

    # -- workers --------------------------------------------------------------------

    def _spawn_locked(self) -> None:
        worker = _Worker()
        thread = threading.Thread(
            target=self._work, args=(worker,), name="undercurrent-async-worker", daemon=True
        )
        worker.thread = thread
        self._workers.append(worker)
        thread.start()

    def _stalled_locked(self, now: float) -> int:
        return sum(
            1
            for w in self._workers
            if w.call_started is not None and now - w.call_started > self.stall_timeout_s
        )

    def _work(self, worker: _Worker) -> None:
        mark_probe_thread(None if self._owner is None else self._owner())
        while True:
            with self._cond:
                while not self._ready and not self._stopping:
                    self._cond.wait()
                if not self._ready:
                    self._workers.remove(worker)
                    return
                binding = self._ready.popleft()
                peers = self._peers_locked(binding)
            if peers:
                self.schedule_many(self._run_group([binding, *peers], worker))
            elif self._run_batch(binding, worker):
                self.schedule(binding)
            with self._cond:
                healthy = len(self._workers) - self._stalled_locked(time.monotonic())
                if healthy > self.target:
                    self._workers.remove(worker)
                    return

    def _peers_locked(self, binding: Binding) -> list[Binding]:
        """The ready bindings to judge with ``binding`` (taken off the line)."""
        key = binding.async_group
        if key is None or not self._ready:
            return []
        peers: list[Binding] = []
        rest: deque[Binding] = deque()
        for other in self._ready:
            if len(peers) < GROUP_LIMIT - 1 and other.async_group == key:
                peers.append(other)
            else:
                rest.append(other)
        if peers:
            self._ready = rest
        return peers

    def _run_group(self, bindings: Sequence[Binding], worker: _Worker) -> list[Binding]:
        """Serve several bindings of one group key: everything each has queued
        (at most its queue's capacity), judged together; returns those that
        still have work. A group's turn costs one judging call for all its
        bindings, so each gives its whole queue: a window's rows, routed at
        once, are judged in one turn, not in ``batch_size`` slices."""
        taken = Binding.take_together(bindings)
        if taken is None:  # (a lock taken, or a probe that does not batch: each alone)
            taken = []
            for binding in bindings:
                pieces = binding.take_queued_rows(binding.queue_capacity)
                if pieces is not None:
                    taken.append((binding, pieces))
        if not taken:
            return []
        worker.call_started = time.monotonic()
        try:
            kept = _judge_taken(taken)
            if kept is None:
                for binding, pieces in taken:
                    batch = ActivationBatch.concat(
                        [routed[start:stop] for routed, start, stop in pieces])
                    binding.finish_call(batch, binding.invoke_batch(batch), observed=True)
        finally:
            worker.call_started = None
        # Only those served this turn: one found empty was unscheduled then, and a
        # producer that queued on it since has scheduled it again itself (handing
        # it back too would put it on the line twice, for two workers at once).
        if kept is None:
            kept = [binding.keep_scheduled() for binding, _ in taken]
        return [binding for (binding, _), more in zip(taken, kept, strict=True) if more]

    def _run_batch(self, binding: Binding, worker: _Worker) -> bool:
        """Process up to ``batch_size`` vectors; True when the binding still has work.

        A probe that scores batches gets every vector taken in one call; any
        other probe gets one vector per call, so a drain deadline drops only
        vectors that have not started.
        """
        done = 0
        while done < self.batch_size:
            batch = binding.take_queued(self.batch_size - done)
            if batch is None:
                return False
            worker.call_started = time.monotonic()
            outcome = binding.invoke_batch(batch)
            worker.call_started = None
            binding.finish_call(batch, outcome, observed=True)
            done += len(batch)
        return binding.keep_scheduled()

    # -- stall compensation -------------------------------------------------------------

    def _start_supervisor_locked(self) -> None:
        if self._supervisor is not None:
            return
        self._supervisor = threading.Thread(
            target=self._supervise, name="undercurrent-async-supervisor", daemon=True
        )
        self._supervisor.start()

    def _supervise(self) -> None:
        interval = max(0.01, self.stall_timeout_s / 4)
        while not self._supervisor_stop.wait(interval):
            with self._cond:
                if self._stopping and not self._ready:
                    return
                if not self._ready:
                    continue
                healthy = len(self._workers) - self._stalled_locked(time.monotonic())
                while healthy < self.target and len(self._workers) < self.max_workers:
                    self._spawn_locked()
                    healthy += 1
                self._cond.notify_all()


#: Schedulers whose workers have started: stopped and joined when the
#: interpreter exits (:func:`_stop_at_exit`).
_RUNNING: weakref.WeakSet[AsyncScheduler] = weakref.WeakSet()
#: How long the interpreter's exit waits for each scheduler's workers.
EXIT_JOIN_S = 10.0


def _stop_at_exit() -> None:
    """Stop every running scheduler and join its workers, before the
    interpreter finalises. The workers are daemon threads, so a script that
    ends without closing its router (``ProbedModel.close()``) does not wait
    for them; but one still running then (finishing a turn, letting go of the
    rows it judged) is stopped where it next takes the interpreter lock, in
    whatever native frame it is in, and in torch's freeing of a tensor that
    aborts the whole process ("terminate called without an active
    exception"). Here, at exit, they finish first: the ready line is judged
    (each scheduler waits at most :data:`EXIT_JOIN_S`)."""
    for scheduler in list(_RUNNING):
        scheduler.stop(wait=True, timeout_s=EXIT_JOIN_S)


atexit.register(_stop_at_exit)

_GROUP = operator.attrgetter("async_group")


def _turns(bindings: Sequence[Binding]) -> int:
    """How many workers' turns ``bindings`` make: one each, except that a
    worker takes the ready bindings of one group key together (up to
    :data:`GROUP_LIMIT`). Waking more workers than that wakes some for nothing:
    each would take the interpreter lock from the generation thread only to
    find the ready line empty."""
    keys = collections.Counter(map(_GROUP, bindings))  # (counted in C)
    alone = keys.pop(None, 0)
    return alone + sum(-(-count // GROUP_LIMIT) for count in keys.values())


def _judge_taken(taken: Sequence[tuple[Binding, list[tuple[ActivationBatch, int, int]]]]
                 ) -> list[bool] | None:
    """Judge every binding's taken rows with one ``judge_many`` call of the probes'
    class, reading the values each routed batch computed once, and settle each
    binding; per binding, whether it stays scheduled (:meth:`Binding.finish_ranges`).
    None (nothing judged or settled) when the class has none, the probes are not
    all of it, or computing or judging fails."""
    probes = [binding.probe for binding, _ in taken]
    cls = type(probes[0])
    judge_many = getattr(cls, "judge_many", None)
    if judge_many is None or any(type(probe) is not cls for probe in probes):
        return None
    key = taken[0][0].async_group
    started = time.perf_counter()
    try:
        joined = _one_range(taken, key, probes[0]) or _joined(taken, key, probes)
        values, spans, tokens, layers, placed = joined
        signals: BatchSignals | None = judge_many(probes, values, spans, tokens, layers)
    except Exception:  # noqa: BLE001 - each binding's own call counts the error
        return None
    if signals is None:
        return None
    share = (time.perf_counter() - started) / len(tokens)
    try:
        check_batch_signals(signals, len(tokens), taken[0][0].method("judge_many"))
    except (TypeError, ValueError) as exc:  # refused: an error on every row judged
        error = describe_error(exc)
        refused = []
        for (binding, _), (first, last), where in zip(taken, spans, placed, strict=True):
            binding.log_error(f"judge_many (token {tokens[first]}, {last - first} records)",
                              exc)
            refused.append(binding.finish_ranges(where, None, share * (last - first), share,
                                                 error))
        return refused
    kept = signals if signals.any_signal() else None
    shares = [share * (last - first) for first, last in spans]
    finished = Binding.finish_ranges_together(
        [(binding, where) for (binding, _), where in zip(taken, placed, strict=True)],
        kept, shares, share)
    if finished is not None:
        return finished
    return [binding.finish_ranges(where, kept, latency, share)
            for (binding, _), latency, where in zip(taken, shares, placed, strict=True)]


_Joined = tuple[Any, list[tuple[int, int]], Sequence[int], Sequence[int],
                list[list[tuple[ActivationBatch, int, int, int]]]]


def _one_range(taken: Sequence[tuple[Binding, list[tuple[ActivationBatch, int, int]]]],
               key: Any, probe: Any) -> _Joined | None:
    """What :func:`_joined` gives, when every binding took one piece and the
    pieces follow each other in one routed batch (each request's rows of one
    step, queued by one routing): that batch's rows and values sliced once,
    nothing joined. None otherwise."""
    if len(taken[0][1]) != 1:
        return None
    routed, first, last = taken[0][1][0]
    for _, pieces in taken[1:]:
        if len(pieces) != 1:
            return None
        batch, start, stop = pieces[0]
        if batch is not routed or start != last:
            return None
        last = stop
    view = routed.index_view()
    spans: list[tuple[int, int]] = []
    placed: list[list[tuple[ActivationBatch, int, int, int]]] = []
    for _, ((_, start, stop),) in taken:
        spans.append((start - first, stop - first))
        placed.append([(view, start, stop, first)])
    return (rows_of(routed.shared(key, probe.row_values), first, last), spans,
            routed.token_indices[first:last], routed.layers[first:last], placed)


def _joined(taken: Sequence[tuple[Binding, list[tuple[ActivationBatch, int, int]]]],
            key: Any, probes: Sequence[Any]) -> _Joined:
    """Every binding's taken rows joined, in order: (their values, each
    binding's span of the joined rows, the rows' token indices and layers, and
    per binding its (index batch, start, stop, offset) ranges: row ``r`` of a
    routed batch is row ``r - offset`` of the joined rows)."""
    spans: list[tuple[int, int]] = []
    tokens: list[int] = []
    layers: list[int] = []
    placed: list[list[tuple[ActivationBatch, int, int, int]]] = []
    views: dict[int, ActivationBatch] = {}
    values = []
    for (_, pieces), probe in zip(taken, probes, strict=True):
        first = len(tokens)
        where = []
        for routed, start, stop in pieces:
            values.append(rows_of(routed.shared(key, probe.row_values), start, stop))
            view = views.get(id(routed))
            if view is None:
                view = views[id(routed)] = routed.index_view()
            where.append((view, start, stop, start - len(tokens)))
            tokens += routed.token_indices[start:stop]
            layers += routed.layers[start:stop]
        spans.append((first, len(tokens)))
        placed.append(where)
    return join_values(values), spans, tokens, layers, placed
