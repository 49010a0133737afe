"""A stream's iterator that the backend's ``close()`` can end from any thread.

A Python generator runs on one thread at a time: ``close()`` on one that another
thread is advancing raises ``ValueError('generator already executing')`` in one
of the two threads, and skipping it leaves that generation running to its end.
:class:`OpenStream` advances its generator under a lock: :meth:`OpenStream.end`
cancels the generation (its reader's ``next()``, if one is running, sees it at
the next token), then, holding the lock, reads what is left of the stream into a
buffer that the reader's later ``next()`` calls hand out: the events generated
before the cancel, then the final one (``finish_reason="cancelled"``), then the
end of the iteration.
"""

from __future__ import annotations

import collections
import inspect
import threading
from collections.abc import Generator, Iterator

from undercurrent.adapters.outputs import StreamEvent


class OpenStream(Iterator[StreamEvent]):
    """One stream's events (``events``, a generator that ends its generation soon
    after ``cancel`` is set, with a final event) for one reader, endable by
    :meth:`end` from any thread."""

    def __init__(self, events: Generator[StreamEvent, None, None],
                 cancel: threading.Event) -> None:
        self._events = events
        self._cancel = cancel
        self._reading = threading.Lock()
        self._reader: int | None = None  # (the thread inside next(), if any)
        # What end() read of the stream, for the reader (None: not ended).
        self._left: collections.deque[StreamEvent] | None = None
        self._error: Exception | None = None

    def __iter__(self) -> OpenStream:
        return self

    def __next__(self) -> StreamEvent:
        with self._reading:
            if self._left is None:
                self._reader = threading.get_ident()
                try:
                    return next(self._events)
                finally:
                    self._reader = None
            if self._left:
                return self._left.popleft()
            error, self._error = self._error, None
            if error is not None:
                raise error
            raise StopIteration

    @property
    def cancel(self) -> threading.Event:
        """The event that cancels its generation (its backend tells by it which
        stream a call is)."""
        return self._cancel

    @property
    def suspended(self) -> bool:
        """Started, not ended, and not being advanced (between two events)."""
        return (self._reader is None
                and inspect.getgeneratorstate(self._events) == inspect.GEN_SUSPENDED)

    def close(self) -> None:
        """The reader's close(): cancel the generation and clean it up; no event
        comes after. Called while the stream is being advanced (by a probe or a
        callback of its own generation, on the reader's thread or the one it waits
        on), it only cancels: the ``next()`` under way ends the stream with its
        final event (it waited on that ``next()``, which waited on it: a hang)."""
        self._cancel.set()
        if not self._reading.acquire(blocking=False):
            if self._reader is not None:
                return
            self._reading.acquire()  # (end() reading the rest: it ends soon)
        try:
            self._events.close()
            self._left = collections.deque()
            self._error = None
        finally:
            self._reading.release()

    def end(self) -> None:
        """Cancel the generation and wait for it to end, keeping what is left of
        the stream for its reader (the backend's close(), on any thread). A stream
        never started is left to its first ``next()`` (which the closed backend
        refuses); one being advanced on this very thread is only cancelled."""
        self._cancel.set()
        if self._reader == threading.get_ident():
            return
        with self._reading:
            if (self._left is not None
                    or inspect.getgeneratorstate(self._events) != inspect.GEN_SUSPENDED):
                return
            left: collections.deque[StreamEvent] = collections.deque()
            try:
                left.extend(self._events)
            except Exception as error:  # noqa: BLE001 - the reader's, raised at its next()
                self._error = error
            finally:
                self._left = left
