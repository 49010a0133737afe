"""The Ctrl-C the vLLM driver and worker hold while a step is exchanged
(``adapters/vllm/interrupts.py``), with simulated Ctrl-Cs (``_thread.interrupt_main``)."""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Iterator

import pytest

from undercurrent.adapters.vllm.interrupts import HeldCtrlC

# (a Ctrl-C raised while a garbage-collector callback runs would be lost: none runs here)
pytestmark = pytest.mark.usefixtures("no_gc_callbacks")


@pytest.fixture(autouse=True)
def default_handler() -> Iterator[None]:
    """Python's own SIGINT handler, as a terminal or a notebook has it (a
    background job starts with SIGINT ignored)."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _ctrl_c() -> None:
    _thread.interrupt_main()
    for _ in range(3):  # the handler runs at the loop's next check, on this thread
        pass


def test_a_ctrl_c_is_held_until_the_block_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with HeldCtrlC() as ctrl_c:
            _ctrl_c()
            reached.append(ctrl_c.held)
    assert reached == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_ctrl_c_is_raised_when_asked_and_a_second_one_at_once():
    with pytest.raises(KeyboardInterrupt):  # the one still held, when the block ends
        with HeldCtrlC() as ctrl_c:
            ctrl_c.raise_held()  # nothing held yet: nothing raised
            _ctrl_c()
            with pytest.raises(KeyboardInterrupt):
                ctrl_c.raise_held()
            with pytest.raises(KeyboardInterrupt):
                _ctrl_c()


def test_an_error_in_the_block_is_what_propagates():
    with pytest.raises(ValueError, match="first"):
        with HeldCtrlC():
            _ctrl_c()
            raise ValueError("first")


def test_a_hold_inside_a_hold_or_off_the_main_thread_does_nothing():
    with pytest.raises(KeyboardInterrupt):
        with HeldCtrlC() as outer:
            with HeldCtrlC() as inner:
                _ctrl_c()
            assert outer.active and not inner.active and outer.held
    found = []
    thread = threading.Thread(target=lambda: found.append(HeldCtrlC().__enter__().active))
    thread.start()
    thread.join()
    assert found == [False]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_hold_inside_a_hold_does_not_ask_the_signal_module_and_later_holds_install(
        monkeypatch):
    """The worker enters a hold at every exchange, inside ``generate()``'s: the
    inner one knows the outer one is installed without ``signal.getsignal``
    (tens of µs). Once a hold ends, normally or by an error, the next one
    installs its handler again."""
    asked = []
    original = signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda number: asked.append(number) or
                        original(number))
    with HeldCtrlC() as outer:
        for _ in range(3):
            with HeldCtrlC() as inner:
                assert not inner.active
    assert outer.active is False and len(asked) == 1  # the outer hold asked once
    with pytest.raises(ValueError):
        with HeldCtrlC() as failing:
            assert failing.active
            raise ValueError("inside")
    with HeldCtrlC() as again:
        assert again.active
        _ctrl_c()
        assert again.held
        again.held = False  # let the block end quietly
    assert original(signal.SIGINT) is signal.default_int_handler
