"""Binding.settle (one pass over a batch) counts exactly what account() per record counts."""

from __future__ import annotations

from router_helpers import point, record

from undercurrent.probes import Probe, RequestContext
from undercurrent.records import ProbeSignal, SignalAction
from undercurrent.router.binding import Binding
from undercurrent.router.errors import OverflowPolicy
from undercurrent.spec.types import InterventionPolicy


def _binding() -> Binding:
    return Binding(point=point(), probe=Probe(), probe_type="recorder",
                   ctx=RequestContext("r"), policy=InterventionPolicy(),
                   queue_capacity=None, overflow=OverflowPolicy.BLOCK, breaker_threshold=None)


def _state(binding: Binding) -> tuple:
    return (binding.processed, binding.errors, binding.latency_total, binding.latency_max,
            binding.error_notes, [(s.action, s.score, dict(s.metadata)) for s in binding.signals])


def test_settle_counts_like_account_per_record_with_errors_and_signals():
    records = [record("r", "p", token) for token in range(6)]
    abort = ProbeSignal(SignalAction.ABORT, 0.9)
    outcomes = [(None, None, 0.1), (abort, None, 0.30000000000000004), (None, "Boom: 2", 0.2),
                (ProbeSignal(SignalAction.FLAG, 0.5), None, 0.3), (None, "Boom: 4", 0.0),
                (None, None, 1e-17)]
    for observed in (False, True):
        batched, oracle = _binding(), _binding()
        batched.settle(records[:2], outcomes[:2], observed=observed)
        batched.settle(records[2:], outcomes[2:], observed=observed)
        for rec, (signal, error, latency) in zip(records, outcomes, strict=True):
            oracle.account(latency, error, rec)
            if signal is not None:
                oracle.keep_signal(signal)
        expected = _state(oracle)
        if observed:  # an observed abort is kept as a flag
            assert batched.signals[0].action is SignalAction.FLAG
            assert batched.signals[0].metadata["requested_action"] == "abort"
            expected = (*expected[:5], [(SignalAction.FLAG, 0.9, {"requested_action": "abort"}),
                                        *expected[5][1:]])
        assert _state(batched) == expected
        assert batched.processed == 6 and batched.errors == 2
        assert batched.error_notes == ["on_activation (token 2, layer 0): Boom: 2"]
