"""Inline execution on the caller's (generation) thread, under the point's intervention.

``reject``: the probe runs to completion on the caller's thread.
``block_until_signal``: the probe runs on the binding's helper thread while the
caller waits at most ``timeout_ms``; a miss, an exception, or a previous call
still running yields a *fallback* signal whose action is ``on_timeout`` and whose
``metadata["reason"]`` says why. The helper thread runs one call at a time, so a
late answer never overlaps the next activation: the next caller waits for it
(inside its own deadline) and falls back with reason ``"busy"`` if it must.

Activations arrive as an :class:`~undercurrent.records.ActivationBatch`: one
request's rows of one routed batch for one binding (in a decode step, that
token's layers, in order). A batch is one call, one wait and one deadline; a
fallback yields one fallback signal per row, so the counts match routing the
records one by one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from undercurrent.records import (
    ABORT_CODE,
    ActivationBatch,
    BatchSignals,
    ProbeSignal,
    SignalAction,
    as_list,
    rows_of,
)
from undercurrent.router.binding import (
    BatchOutcome,
    Binding,
    check_batch_signals,
    describe_error,
    logger,
)
from undercurrent.router.threads import mark_probe_thread
from undercurrent.spec.types import InterventionMode, OnTimeout


def run_inline(binding: Binding, batch: ActivationBatch) -> BatchSignals:
    """Run an inline binding on a batch; per row, the signal that applies to
    generation (no signal when there is nothing to apply)."""
    if binding.policy.mode is InterventionMode.BLOCK_UNTIL_SIGNAL:
        return _run_blocking(binding, batch)
    return _run_to_completion(binding, batch)


def _run_to_completion(binding: Binding, batch: ActivationBatch) -> BatchSignals:
    if not binding.admit_inline(len(batch)):
        return BatchSignals.none(len(batch))
    outcome = binding.invoke_batch(batch, propagate_interrupts=True)
    if not binding.finish_call(batch, outcome, observed=False):
        return BatchSignals.none(len(batch))
    return outcome.signals


_UNKNOWN: Any = object()


class GroupMembers(list[tuple[Any, Binding, int, int]]):
    """The (request, binding, start, stop) judged together in one routed batch
    (see :func:`judge_group`), keeping what judging them all in one call needs:
    the router gives the same members again while its routes hold."""

    __slots__ = ("_columns", "_together")

    def __init__(self) -> None:
        super().__init__()
        self._together: Any = _UNKNOWN
        self._columns: Any = None

    def columns(self) -> tuple[list[Binding], list[int], list[tuple[int, int]]]:
        """(the bindings, their row counts, their row spans), computed once."""
        if self._columns is None:
            self._columns = _columns_of(self)
        return self._columns  # type: ignore[no-any-return]

    def together(self) -> tuple[Any, list[Any], list[tuple[int, int]]] | None:
        """(``judge_many`` of the probes' class, the probes, their row spans), or
        None when the members cannot be judged in one call (see
        :func:`_judge_together`); computed once."""
        if self._together is _UNKNOWN:
            self._together = _together_of(self)
        return self._together  # type: ignore[no-any-return]


def _together_of(members: Sequence[tuple[Any, Binding, int, int]]
                 ) -> tuple[Any, list[Any], list[tuple[int, int]]] | None:
    previous = members[0][2]
    for _, _, start, stop in members:
        if start != previous:
            return None
        previous = stop
    judge_many = getattr(type(members[0][1].probe), "judge_many", None)
    if judge_many is None:
        return None
    bindings, _, spans = _columns(members)
    return judge_many, [binding.probe for binding in bindings], spans


def _columns_of(members: Sequence[tuple[Any, Binding, int, int]]
                ) -> tuple[list[Binding], list[int], list[tuple[int, int]]]:
    return ([binding for _, binding, _, _ in members],
            [stop - start for _, _, start, stop in members],
            [(start, stop) for _, _, start, stop in members])


def _columns(members: Sequence[tuple[Any, Binding, int, int]]
             ) -> tuple[list[Binding], list[int], list[tuple[int, int]]]:
    """(the bindings, their row counts, their row spans) of members: a group's
    kept ones, or worked out for a list of members."""
    return members.columns() if isinstance(members, GroupMembers) else _columns_of(members)


def _admit(members: Sequence[tuple[Any, Binding, int, int]]
           ) -> Sequence[tuple[Any, Binding, int, int]]:
    """The members whose bindings admit their rows (:meth:`Binding.admit_inline`),
    all at once when every one does (:meth:`Binding.admit_together`)."""
    bindings, counts, _ = _columns(members)
    if Binding.admit_together(bindings, counts):
        return members
    return [member for member in members if member[1].admit_inline(member[3] - member[2])]


def judge_group(batch: ActivationBatch, key: Any,
                members: Sequence[tuple[Any, Binding, int, int]]
                ) -> list[tuple[int, BatchSignals]]:
    """Judge several ``reject`` bindings' rows of one routed batch at once: their
    probes share ``key`` (:meth:`~undercurrent.probes.base.ScoresRows.group_key`),
    so the per-row values are computed once for the batch, then each probe judges
    its own rows (``judge_rows``) and each binding is settled in one update.
    ``members`` are (request, binding, start, stop); returns (start, signals) per
    binding that judged. The same counts, signals and state as each binding's
    ``on_batch`` on its own rows; a failure computing the values falls back to
    exactly that, binding by binding."""
    admitted = _admit(members)
    if not admitted:
        return []
    started = time.perf_counter()
    try:
        values = batch.shared(key, admitted[0][1].probe.row_values)
    except Exception:
        return _judge_each(batch, admitted)
    except BaseException:  # an interrupt on the generation thread: nothing ran
        for _, binding, start, stop in admitted:
            binding.release_dropped(stop - start)
        raise
    tokens, layers = batch.token_indices, batch.layers
    together = _judge_together(values, tokens, layers, admitted,
                               members if admitted is members else None)
    if isinstance(together, BatchSignals):
        return _settle_together(batch, admitted, together, started)
    judged: list[tuple[Any, Binding, int, int, BatchSignals | None, str | None]] = []
    if together is not None:  # judge_many's result is refused: an error on every row
        for request, binding, start, stop in admitted:
            binding.log_error(f"judge_many (token {tokens[start]}, {stop - start} records)",
                              together)
            judged.append((request, binding, start, stop, None, describe_error(together)))
        return _settle_group(batch, judged, started)
    try:
        for request, binding, start, stop in admitted:
            try:
                signals = binding.probe.judge_rows(rows_of(values, start, stop),
                                                   tokens[start:stop], layers[start:stop])
                check_batch_signals(signals, stop - start, binding.method("judge_rows"))
                judged.append((request, binding, start, stop, signals, None))
            except Exception as exc:
                binding.log_error(f"on_batch (token {tokens[start]}, {stop - start} records)",
                                  exc)
                judged.append((request, binding, start, stop, None, describe_error(exc)))
    except BaseException as exc:  # an interrupt: settle what ran, drop what did not
        _, binding, start, stop = admitted[len(judged)]
        binding.log_error(f"on_batch (token {tokens[start]}, {stop - start} records)", exc,
                          reraised=True)
        judged.append((None, binding, start, stop, None, describe_error(exc)))
        _settle_group(batch, judged, started)
        for _, binding, start, stop in admitted[len(judged):]:
            binding.release_dropped(stop - start)
        raise
    return _settle_group(batch, judged, started)


def _judge_together(values: Any, tokens: Sequence[int], layers: Sequence[int],
                    admitted: Sequence[tuple[Any, Binding, int, int]],
                    members: Sequence[tuple[Any, Binding, int, int]] | None = None
                    ) -> BatchSignals | Exception | None:
    """Every admitted binding's rows judged by one call of its probe class's
    :meth:`~undercurrent.probes.base.ScoresRows.judge_many` (rows of one
    contiguous range, bindings in row order); None when the class judges
    instance by instance, or when that call fails (then each instance judges
    its own rows, so an error is counted where it belongs); the error
    (:func:`~undercurrent.router.binding.check_batch_signals`) when it returned
    something other than a signal per row. ``members``: the group, when every
    member was admitted (its :meth:`GroupMembers.together` is then used)."""
    found = (members.together() if isinstance(members, GroupMembers)
             else _together_of(admitted))
    if found is None:
        return None
    judge_many, probes, spans = found
    try:
        signals: BatchSignals | None = judge_many(probes, values, spans, tokens, layers)
    except Exception:  # noqa: BLE001 - the per-instance path counts the error
        return None
    if signals is not None:
        try:
            check_batch_signals(signals, admitted[-1][3] - admitted[0][2],
                                admitted[0][1].method("judge_many"))
        except (TypeError, ValueError) as exc:
            return exc
    return signals


def _settle_together(batch: ActivationBatch, admitted: Sequence[tuple[Any, Binding, int, int]],
                     signals: BatchSignals, started: float) -> list[tuple[int, BatchSignals]]:
    """Settle the bindings judged by one :func:`_judge_together` call: one
    update each, all sharing the signal columns (row ``r`` of the batch is row
    ``r - first`` of ``signals``), in one pass when no row aborts."""
    first, last = admitted[0][2], admitted[-1][3]
    share = (time.perf_counter() - started) / (last - first)
    index = batch.index_view()
    actions = signals.actions
    kept = signals if signals.any_signal() else None
    aborting = kept is not None and kept.any_abort()
    if not aborting:
        bindings, _, spans = _columns(admitted)
        if Binding.finish_together(bindings, index, spans, kept, share, first):
            return [(first, signals)]
    for request, binding, start, stop in admitted:
        settled = binding.finish_rows(index, start, stop, kept, share * (stop - start), share,
                                      offset=first)
        if settled and aborting and ABORT_CODE in as_list(actions[start - first:stop - first]):
            request.abort_requested = True
    return [(first, signals)]


def _settle_group(batch: ActivationBatch,
                  judged: Sequence[tuple[Any, Binding, int, int, BatchSignals | None,
                                         str | None]],
                  started: float) -> list[tuple[int, BatchSignals]]:
    """Settle each judged binding (its share of the group's time per row)."""
    rows = sum(stop - start for _, _, start, stop, _, _ in judged)
    share = (time.perf_counter() - started) / rows if rows else 0.0
    pieces: list[tuple[int, BatchSignals]] = []
    index = batch.index_view()  # what the kept signals need: not the activations
    for request, binding, start, stop, signals, error in judged:
        settled = binding.finish_rows(index, start, stop, signals, share * (stop - start),
                                      share, error)
        if not settled or signals is None:
            continue
        if request is not None and signals.any_abort():
            request.abort_requested = True
        pieces.append((start, signals))
    return pieces


def _judge_each(batch: ActivationBatch, admitted: Sequence[tuple[Any, Binding, int, int]]
                ) -> list[tuple[int, BatchSignals]]:
    """Each admitted binding's ``on_batch`` on its own rows (after the shared values
    failed): errors are then counted binding by binding."""
    pieces: list[tuple[int, BatchSignals]] = []
    for index, (request, binding, start, stop) in enumerate(admitted):
        piece = batch[start:stop]
        try:
            outcome = binding.invoke_batch(piece, propagate_interrupts=True)
        except BaseException:  # an interrupt: the bindings not reached never ran
            for _, later, first, last in admitted[index + 1:]:
                later.release_dropped(last - first)
            raise
        if not binding.finish_call(piece, outcome, observed=False):
            continue
        if outcome.signals.any_abort():
            request.abort_requested = True
        pieces.append((start, outcome.signals))
    return pieces


@dataclass
class _Call:
    """A batch of activations handed to a binding's helper thread."""

    batch: ActivationBatch
    waited: bool = True
    abandoned: bool = False
    done: bool = False
    outcome: BatchOutcome | None = None


def _run_blocking(binding: Binding, batch: ActivationBatch) -> BatchSignals:
    count = len(batch)
    nothing = BatchSignals.none(count)
    timeout_ms = binding.policy.timeout_ms or 1
    deadline = time.monotonic() + timeout_ms / 1000.0
    with binding.cond:
        if not binding.receive(count):
            return nothing
        if binding.breaker_open:
            _submit_unwaited(binding, batch)
            return nothing
        binding.wait_turn(count, deadline)
        if binding.finalised:  # counted as dropped by finalise()
            return nothing
        if binding.closed:
            binding.drop(count)
            return nothing
        if binding.busy:
            binding.drop(count)
            return _fallbacks(binding, batch, "busy")
        call = _Call(batch)
        binding.hand_to_helper(call, count, _helper_loop)
        binding.wait_until(lambda: call.done, deadline)
        if binding.finalised and not call.done:
            return nothing
        if not call.done:
            call.abandoned = True
            return _fallbacks(binding, batch, "timeout")
        outcome = call.outcome
        assert outcome is not None
        if outcome.errors is None:
            binding.note_success()
            binding.keep_signals(outcome.signals, batch)
            return outcome.signals
        # Some rows failed: each gets its fallback, in order, among the others' signals.
        signals = outcome.signals.signals(batch)
        applied: list[ProbeSignal | None] = []
        for index, (signal, error) in enumerate(zip(signals, outcome.errors, strict=True)):
            if error is not None:
                applied.append(_fallback(binding, batch, index, "error", error))
                continue
            binding.note_success()
            if signal is not None:
                binding.keep_signal(signal)
            applied.append(signal)
        return BatchSignals.from_signals(applied)


def _fallbacks(binding: Binding, batch: ActivationBatch, reason: str) -> BatchSignals:
    """One fallback per row (lock held)."""
    return BatchSignals.from_signals(
        [_fallback(binding, batch, index, reason, None) for index in range(len(batch))])


def _submit_unwaited(binding: Binding, batch: ActivationBatch) -> None:
    """Breaker open: run the probe if it is free, but nobody waits (lock held)."""
    if binding.busy:
        binding.drop(len(batch))
        return
    binding.hand_to_helper(_Call(batch, waited=False), len(batch), _helper_loop)


def _helper_loop(binding: Binding) -> None:
    mark_probe_thread(binding.owner)
    while True:
        with binding.cond:
            call: _Call | None = binding.next_pending()
            if call is None or binding.finalised:
                # Finalised: a call not yet started never runs (it was counted dropped).
                if call is not None:
                    call.done = True
                binding.retire_helper()
                return
        outcome = binding.invoke_batch(call.batch)
        with binding.cond:
            call.done = True
            if not binding.finalised:
                if not call.waited:
                    binding.settle_batch(call.batch, outcome, observed=True)
                else:
                    # Counted now; the signals are kept by the caller (or never, if late).
                    binding.settle_batch(call.batch, outcome, keep=False)
                    if call.abandoned:
                        binding.count_late(len(call.batch))
                    else:
                        call.outcome = outcome
            binding.end_call()


def _fallback(binding: Binding, batch: ActivationBatch, index: int, reason: str,
              error: str | None) -> ProbeSignal:
    """Record and return the on_timeout signal for row ``index`` (lock held); may
    trip the breaker."""
    policy = binding.policy
    action = SignalAction.ABORT if policy.on_timeout is OnTimeout.ABORT else SignalAction.CONTINUE
    metadata: dict[str, object] = {
        "fallback": True,
        "reason": reason,
        "timeout_ms": policy.timeout_ms,
        "on_timeout": policy.on_timeout.value,
    }
    if error is not None:
        metadata["error"] = error
    where = batch.located(index)
    signal = ProbeSignal(action=action, metadata=metadata).at(*where)
    binding.fall_back(signal)
    if binding.trip_breaker():
        logger.warning(
            "circuit breaker open: probe %r on request %r failed %d times in a row "
            "(last: %s); generation no longer waits on it",
            binding.name, binding.request_id, binding.consecutive_failures, reason,
        )
        tripped = ProbeSignal(
            action=SignalAction.FLAG,
            metadata={
                "reason": "circuit_open",
                "consecutive_failures": binding.consecutive_failures,
                "last_failure": reason,
            },
        ).at(*where)
        binding.keep_signal(tripped)
        return signal if action is SignalAction.ABORT else tripped
    return signal
