"""Inline execution on the caller's (generation) thread, under the point's intervention.

``reject``: the probe runs to completion on the caller's thread.
``block_until_signal``: the probe runs on the binding's helper thread while the
caller waits at most ``timeout_ms``; a miss, an exception, or a previous call
still running yields a *fallback* signal whose action is ``on_timeout`` and whose
``metadata["reason"]`` says why. The helper thread runs one call at a time, so a
late answer never overlaps the next activation: the next caller waits for it
(inside its own deadline) and falls back with reason ``"busy"`` if it must.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from undercurrent.records import ActivationRecord, ProbeSignal, SignalAction
from undercurrent.router.binding import Binding, logger, observed_only
from undercurrent.spec.types import InterventionMode, OnTimeout


def run_inline(binding: Binding, record: ActivationRecord) -> ProbeSignal | None:
    """Run an inline binding on one record; returns the signal that applies to generation."""
    if binding.policy.mode is InterventionMode.BLOCK_UNTIL_SIGNAL:
        return _run_blocking(binding, record)
    return _run_to_completion(binding, record)


def _run_to_completion(binding: Binding, record: ActivationRecord) -> ProbeSignal | None:
    with binding.cond:
        binding.received += 1
        binding.waiting += 1
        while binding.busy and not binding.closed:
            binding.cond.wait()
        binding.waiting -= 1
        if binding.finalised:  # counted as dropped by finalise()
            return None
        if binding.closed:
            binding.dropped += 1
            return None
        binding.busy = True
    signal, error, latency = binding.invoke(record, propagate_interrupts=True)
    with binding.cond:
        binding.busy = False
        binding.cond.notify_all()
        if binding.finalised:  # counted as dropped when the result was frozen
            return None
        binding.account(latency, error, record)
        if signal is not None:
            binding.signals.append(signal)
    return signal


@dataclass
class _Call:
    """One activation handed to a binding's helper thread."""

    record: ActivationRecord
    waited: bool = True
    abandoned: bool = False
    done: bool = False
    signal: ProbeSignal | None = None
    error: str | None = None


def _run_blocking(binding: Binding, record: ActivationRecord) -> ProbeSignal | None:
    timeout_ms = binding.policy.timeout_ms or 1
    deadline = time.monotonic() + timeout_ms / 1000.0
    with binding.cond:
        binding.received += 1
        if binding.closed:
            binding.dropped += 1
            return None
        if binding.breaker_open:
            _submit_unwaited(binding, record)
            return None
        binding.waiting += 1
        while binding.busy and not binding.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            binding.cond.wait(remaining)
        binding.waiting -= 1
        if binding.finalised:  # counted as dropped by finalise()
            return None
        if binding.closed:
            binding.dropped += 1
            return None
        if binding.busy:
            binding.dropped += 1
            return _fallback(binding, "busy", None)
        call = _Call(record)
        _hand_to_helper(binding, call)
        while not call.done and not binding.finalised:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            binding.cond.wait(remaining)
        if binding.finalised and not call.done:
            return None
        if not call.done:
            call.abandoned = True
            return _fallback(binding, "timeout", None)
        if call.error is not None:
            return _fallback(binding, "error", call.error)
        binding.consecutive_failures = 0
        if call.signal is not None:
            binding.signals.append(call.signal)
        return call.signal


def _submit_unwaited(binding: Binding, record: ActivationRecord) -> None:
    """Breaker open: run the probe if it is free, but nobody waits (lock held)."""
    if binding.busy:
        binding.dropped += 1
        return
    _hand_to_helper(binding, _Call(record, waited=False))


def _hand_to_helper(binding: Binding, call: _Call) -> None:
    binding.busy = True
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
                binding.helper = None
                if call is not None:
                    call.done = True
                binding.cond.notify_all()
                return
        signal, error, latency = binding.invoke(call.record)
        with binding.cond:
            binding.busy = False
            call.done = True
            if not binding.finalised:
                binding.account(latency, error, call.record)
                if not call.waited:
                    if signal is not None:
                        binding.signals.append(observed_only(signal))
                elif call.abandoned:
                    binding.late_results += 1
                else:
                    call.signal, call.error = signal, error
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
    if threshold is not None and binding.consecutive_failures >= threshold:
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
