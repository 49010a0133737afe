"""A Ctrl-C held while the vLLM worker and the driver exchange a step.

A send or receive cut in half leaves the worker and the driver out of step for
good (every later reply one step late, or a torn message that ends capture), and
a step's routing cut in half leaves its rows half counted, so the engine would
keep generating with its probes silently blind. :class:`HeldCtrlC` holds the
first Ctrl-C that arrives while it is active and raises it when it ends (or
when asked, between two engine steps); a second Ctrl-C interrupts at once (an
escape from a driver that stopped answering). It applies where it runs on the
main thread with Python's default SIGINT handler (the in-process engine, and the
driver's thread); elsewhere, or inside another hold, it does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

#: The hold whose handler is installed (set and read on the main thread only): a
#: hold inside it does nothing, without asking the signal module (``getsignal``
#: costs tens of µs, and the worker enters a hold at every exchange).
_installed: HeldCtrlC | None = None


class HeldCtrlC:
    """``with HeldCtrlC() as ctrl_c:``: the first Ctrl-C is held until the block
    ends or :meth:`raise_held` is called; later ones raise at once."""

    __slots__ = ("held", "active", "deferring")

    def __init__(self) -> None:
        self.held = False
        self.active = False
        self.deferring = False
        """While set, every Ctrl-C is held (see :func:`ctrl_c_deferred`)."""

    def __enter__(self) -> HeldCtrlC:
        global _installed
        if (_installed is None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._hold)
            self.active = True
            _installed = self
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        if self.held and not self.deferring:
            raise KeyboardInterrupt
        self.held = True

    def raise_held(self) -> None:
        """Raise the Ctrl-C held so far, if any (every later one raises at once)."""
        if self.held:
            raise KeyboardInterrupt

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        global _installed
        if self.active:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.active = False
            _installed = None
        if self.held and kind is None:
            raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold every Ctrl-C until the block ends, the second one too: for cleanup that
    must run whole (aborting a call's requests, ending them with the router,
    freeing the engine for the next call), where a second Ctrl-C cut in half left
    requests live or the engine held for good. Inside an active hold, that hold
    keeps what arrives (and raises it when it ends, or when asked); otherwise a
    hold of its own raises it when the block ends."""
    hold = _installed
    if hold is not None:
        hold.deferring = True
        try:
            yield
        finally:
            hold.deferring = False
        return
    with HeldCtrlC() as own:
        own.deferring = True
        yield
