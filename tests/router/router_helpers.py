"""Points, records and small instrumented probes for the router tests."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np

from undercurrent.probes import Probe
from undercurrent.records import ActivationRecord, ProbeSignal, SignalAction
from undercurrent.spec.types import ExtractionPoint, InterventionPolicy, ProbeKind


def point(
    name: str = "p",
    *,
    probe_type: str = "recorder",
    kind: str = "trajectory",
    mode: str = "inline",
    queue_depth: int | None = None,
    intervention: InterventionPolicy | None = None,
    probe_args: dict[str, Any] | None = None,
    layers: tuple[int, ...] = (0,),
) -> ExtractionPoint:
    return ExtractionPoint(
        name=name,
        layers=layers,
        tensor_type="residual_stream",
        position="generated[*]",
        probe_type=probe_type,
        probe_kind=kind,
        execution_mode=mode,
        queue_depth=queue_depth,
        intervention=intervention,
        probe_args=probe_args or {},
    )


def block(timeout_ms: int, on_timeout: str = "continue") -> InterventionPolicy:
    return InterventionPolicy(
        mode="block_until_signal", timeout_ms=timeout_ms, on_timeout=on_timeout
    )


def record(request_id: str, name: str, token: int, value: float = 1.0,
           layer: int = 0) -> ActivationRecord:
    return ActivationRecord(
        request_id=request_id,
        extraction_point_name=name,
        layer=layer,
        tensor_type="residual_stream",
        token_index=token,
        is_generated=True,
        generated_index=token,
        token_id=token,
        tensor=np.full(4, value, dtype=np.float32),
    )


EVENTS: dict[str, threading.Event] = {}


def event(name: str) -> threading.Event:
    """A named Event (probe_args are deep-copied, so probes get events by name)."""
    return EVENTS.setdefault(name, threading.Event())


class Recorder(Probe):
    """Records every token it sees and whether two calls ever overlapped.

    probe_args: ``abort_at`` (token index whose signal is abort), ``fail_at``
    (token index that raises), ``sleep_s`` (per call), ``gate`` (name of an
    :func:`event` every call waits on), ``entered`` (name of an event set on each call).
    """

    probe_kind = (ProbeKind.TRAJECTORY, ProbeKind.SINGLE_SHOT)
    instances: list[Recorder] = []

    def __init__(self, *, abort_at: int | None = None, fail_at: int | None = None,
                 sleep_s: float = 0.0, gate: str | None = None,
                 entered: str | None = None, tag: str | None = None) -> None:
        self.abort_at = abort_at
        self.fail_at = fail_at
        self.sleep_s = sleep_s
        self.gate = event(gate) if gate else None
        self.entered = event(entered) if entered else None
        self.tag = tag
        self.seen: list[int] = []
        self.started = 0
        self.ended = 0
        self.active = 0
        self.overlapped = False
        self.ended_while_active = False
        Recorder.instances.append(self)

    def on_start(self, ctx: Any) -> None:
        self.started += 1

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        self.active += 1
        if self.active > 1:
            self.overlapped = True
        try:
            if self.entered is not None:
                self.entered.set()
            if self.gate is not None:
                self.gate.wait(30)
            if self.sleep_s:
                time.sleep(self.sleep_s)
            if record.token_index == self.fail_at:
                raise RuntimeError(f"boom at {record.token_index}")
            self.seen.append(record.token_index)
            action = SignalAction.ABORT if record.token_index == self.abort_at else "continue"
            return ProbeSignal(action=action, score=float(record.token_index))
        finally:
            self.active -= 1

    def on_end(self, ctx: Any) -> Any:
        if self.active:
            self.ended_while_active = True
        self.ended += 1
        return {"seen": list(self.seen)}


def binding_of(router: Any, request_id: str, name: str) -> Any:
    """The router's binding for (request, point). White-box, so that a test can wait on
    the binding's own state (its condition) instead of sleeping and hoping."""
    return router._requests[request_id].bindings[name]


def wait_until(condition: Any, limit_s: float = 30.0) -> bool:
    """Wait until ``condition()`` holds; False if it still does not after ``limit_s``
    (a guard against a hang, not an assumption about the machine's speed)."""
    pause = threading.Event()
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        pause.wait(0.001)
    return True


def recorder_registry_entries() -> dict[str, type]:
    return {"recorder": Recorder}


def route_rows(router: Any, ids: list[str], names: Any, scale: float, tokens: int = 3) -> None:
    """Route ``tokens`` tokens of rows of each point in ``names`` to each request in
    ``ids``: one routed batch per point and token, a row per request, its value
    ``scale * (request's index + 1) * (token + 1)`` (so each request's differ)."""
    from undercurrent.records import ActivationBatch

    for token in range(tokens):
        for name in names:
            rows = [record(rid, name, token, value=scale * (index + 1) * (token + 1))
                    for index, rid in enumerate(ids)]
            router.route_columns(ActivationBatch.from_records(rows),
                                 [(rid, i, i + 1) for i, rid in enumerate(ids)])


@contextlib.contextmanager
def held_elsewhere(lock: Any) -> Any:
    """``lock`` held by another thread for the length of the block."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        yield
    finally:
        release.set()
        holder.join(30)
