"""Delivery off the generation thread, for forwards whose points are all async.

When every point of every request in a batch is async, routing a forward's
captures can change nothing generation reads back: async rows get no signal, so
no abort, no triggered edit, no stream signal. Then the generation thread only
has to start the device-to-host copies (non-blocking, into pinned memory on
CUDA) and record a CUDA event after them; a :class:`DeliveryThread` waits on
that event and calls :meth:`~undercurrent.adapters.session.CaptureSession.deliver`
for each forward in the order the forwards ran. The generation thread never
waits for a copy.

:meth:`DeliveryThread.drain` blocks until every forward handed over so far was
delivered; the backend calls it before a request is closed, so probe results
and records are collected only after all of the request's steps reached the
router. The first exception a delivery raises is re-raised on the generation
thread (at the next hand-over or at ``drain``); the forwards after it are not
delivered (they were never routed, so the router's accounting stays exact).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

from undercurrent.spec.types import ExecutionMode

#: Forwards handed over and not delivered yet before a hand-over waits for room:
#: bounds the pinned memory and records in flight when probes' queues block.
MAX_IN_FLIGHT = 16

_STOP = object()


def all_async(states: Sequence[Any]) -> bool:
    """True when the requests have points and every one of them is async: then no
    delivery can produce a signal that generation must see before its next step."""
    points = [point for state in states for point in state.points]
    return bool(points) and all(
        point.execution_mode is ExecutionMode.ASYNC for point in points)


class DeliveryThread:
    """One consumer thread delivering a session's forwards in order.

    ``submit(pending, event)`` hands over one forward's captures (``event``: a
    CUDA event recorded after their copies, or None on CPU); ``drain()`` waits
    until all were delivered; ``close()`` drains and stops the thread.
    """

    def __init__(self, session: Any, name: str = "undercurrent-delivery") -> None:
        self.session = session
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=MAX_IN_FLIGHT)
        self._error: BaseException | None = None
        self._discard = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._error is None and not self._discard:  # after a failure or a discard: skip
                    pending, event = item
                    if event is not None:
                        event.synchronize()  # this thread waits, generation does not
                    self.session.deliver(pending)
            except BaseException as error:  # noqa: BLE001 - re-raised on the caller
                self._error = error
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        error = self._error
        if error is not None:
            self._error = None
            raise error

    def submit(self, pending: list[Any], event: Any) -> None:
        """Hand over one forward's captures (in forward order); raises the error a
        previous delivery raised, if any."""
        self._raise()
        if not self._thread.is_alive():
            raise RuntimeError("the delivery thread has stopped; no capture can be routed")
        self._queue.put((pending, event))

    def drain(self) -> None:
        """Wait until every forward handed over so far was delivered; raise the
        first error a delivery raised."""
        self._queue.join()
        self._raise()

    def close(self, *, discard: bool = False) -> None:
        """Drain, stop the thread and raise a delivery error (safe to call twice).
        ``discard=True`` (generation failed: its requests are abandoned) skips the
        forwards not delivered yet instead of routing them."""
        self._discard = self._discard or discard
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise()
