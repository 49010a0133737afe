"""Inline execution on the caller's (generation) thread, under the point's intervention.

``reject``: the probe runs to completion on the caller's thread.
``block_until_signal``: the probe runs on the binding's helper thread while the
caller waits at most ``timeout_ms``; a miss, an exception, or a previous call
still running yields a *fallback* signal whose action is ``on_timeout`` and whose
``metadata["reason"]`` says why. The helper thread runs one call at a time, so a
late answer never overlaps the next activation: the next caller waits for it
(inside its own deadline) and falls back with reason ``"busy"`` if it must.

Records arrive in batches: one token's records for one binding (its layers, in
order). A batch is one call, one wait and one deadline; a fallback yields one
fallback signal per record, so the counts match routing the records one by one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from undercurrent.records import ActivationRecord, ProbeSignal, SignalAction
from undercurrent.router.binding import Binding, Outcome, logger
from undercurrent.spec.types import InterventionMode, OnTimeout


def run_inline(
    binding: Binding, records: Sequence[ActivationRecord]
) -> list[ProbeSignal | None]:
    """Run an inline binding on a batch of records; per record, the signal that
    applies to generation (None when there is nothing to apply)."""
    if binding.policy.mode is InterventionMode.BLOCK_UNTIL_SIGNAL:
        return _run_blocking(binding, records)
    return _run_to_completion(binding, records)


def _run_to_completion(
    binding: Binding, records: Sequence[ActivationRecord]
) -> list[ProbeSignal | None]:
    nothing: list[ProbeSignal | None] = [None] * len(records)
    if not binding.admit_inline(len(records)):
        return nothing
    outcomes = binding.invoke_many(records, propagate_interrupts=True)
    if not binding.finish_call(records, outcomes, observed=False):
        return nothing
    return [signal for signal, _, _ in outcomes]


@dataclass
class _Call:
    """A batch of activations handed to a binding's helper thread."""

    records: Sequence[ActivationRecord]
    waited: bool = True
    abandoned: bool = False
    done: bool = False
    outcomes: list[Outcome] = field(default_factory=list)


def _run_blocking(
    binding: Binding, records: Sequence[ActivationRecord]
) -> list[ProbeSignal | None]:
    count = len(records)
    nothing: list[ProbeSignal | None] = [None] * count
    timeout_ms = binding.policy.timeout_ms or 1
    deadline = time.monotonic() + timeout_ms / 1000.0
    with binding.cond:
        binding.received += count
        if binding.closed:
            binding.dropped += count
            return nothing
        if binding.breaker_open:
            _submit_unwaited(binding, records)
            return nothing
        binding.waiting += count
        while binding.busy and not binding.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            binding.cond.wait(remaining)
        binding.waiting -= count
        if binding.finalised:  # counted as dropped by finalise()
            return nothing
        if binding.closed:
            binding.dropped += count
            return nothing
        if binding.busy:
            binding.dropped += count
            return [_fallback(binding, "busy", None) for _ in records]
        call = _Call(records)
        _hand_to_helper(binding, call)
        while not call.done and not binding.finalised:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            binding.cond.wait(remaining)
        if binding.finalised and not call.done:
            return nothing
        if not call.done:
            call.abandoned = True
            return [_fallback(binding, "timeout", None) for _ in records]
        signals: list[ProbeSignal | None] = []
        for signal, error, _ in call.outcomes:
            if error is not None:
                signals.append(_fallback(binding, "error", error))
                continue
            binding.consecutive_failures = 0
            if signal is not None:
                binding.signals.append(signal)
            signals.append(signal)
        return signals


def _submit_unwaited(binding: Binding, records: Sequence[ActivationRecord]) -> None:
    """Breaker open: run the probe if it is free, but nobody waits (lock held)."""
    if binding.busy:
        binding.dropped += len(records)
        return
    _hand_to_helper(binding, _Call(records, waited=False))


def _hand_to_helper(binding: Binding, call: _Call) -> None:
    binding.busy = True
    binding.in_flight = len(call.records)
    binding.pending = call
    if binding.helper is None:
        binding.helper = threading.Thread(
            target=_helper_loop,
            args=(binding,),
            name=f"undercurrent-block-{binding.request_id}-{binding.name}",
            daemon=True,
        )
        binding.helper.start()
    binding.cond.notify_all()


def _helper_loop(binding: Binding) -> None:
    while True:
        with binding.cond:
            while binding.pending is None and not binding.finalised:
                binding.cond.wait()
            call = binding.pending
            binding.pending = None
            if call is None or binding.finalised:
                # Finalised: a call not yet started never runs (it was counted dropped).
                binding.busy = False
                binding.in_flight = 0
                binding.helper = None
                if call is not None:
                    call.done = True
                binding.cond.notify_all()
                return
        outcomes = binding.invoke_many(call.records)
        with binding.cond:
            binding.busy = False
            binding.in_flight = 0
            call.done = True
            if not binding.finalised:
                if not call.waited:
                    binding.settle(call.records, outcomes, observed=True)
                else:
                    for record, (_, error, latency) in zip(call.records, outcomes, strict=True):
                        binding.account(latency, error, record)
                    if call.abandoned:
                        binding.late_results += len(call.records)
                    else:
                        call.outcomes = outcomes
            binding.cond.notify_all()


def _fallback(binding: Binding, reason: str, error: str | None) -> ProbeSignal:
    """Record and return the on_timeout signal (lock held); may trip the breaker."""
    policy = binding.policy
    binding.timeouts += 1
    binding.consecutive_failures += 1
    action = SignalAction.ABORT if policy.on_timeout is OnTimeout.ABORT else SignalAction.CONTINUE
    metadata: dict[str, object] = {
        "fallback": True,
        "reason": reason,
        "timeout_ms": policy.timeout_ms,
        "on_timeout": policy.on_timeout.value,
    }
    if error is not None:
        metadata["error"] = error
    signal = ProbeSignal(action=action, metadata=metadata)
    binding.signals.append(signal)
    threshold = binding.breaker_threshold
    if (threshold is not None and not binding.breaker_open
            and binding.consecutive_failures >= threshold):
        binding.breaker_open = True
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
        )
        binding.signals.append(tripped)
        return signal if action is SignalAction.ABORT else tripped
    return signal
