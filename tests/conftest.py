"""Fixtures shared by the test directories."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest


class DeliveryCount:
    """Forwards delivered from a layout kept on the plan they repeat
    (``delivery._deliver_steady`` returning True, or a window holding the
    step as the hooks handed it over: ``delivery._Window.take``) since the
    last reset."""

    def __init__(self) -> None:
        self.count = 0


@pytest.fixture
def steady_deliveries(monkeypatch: pytest.MonkeyPatch) -> DeliveryCount:
    """Count, for the test, the forwards delivered from a kept layout (the
    repeated-step path of ``undercurrent.adapters.delivery``), leaving what it
    delivers unchanged."""
    from undercurrent.adapters import delivery

    counter = DeliveryCount()
    original, take = delivery._deliver_steady, delivery._Window.take

    def counted(session: Any, plan: Any, sources: Any, *step: Any) -> bool:
        done = original(session, plan, sources, *step)
        counter.count += done
        return done

    def counted_take(window: Any, session: Any, batches: Any) -> bool:
        done = take(window, session, batches)
        counter.count += done
        return done

    monkeypatch.setattr(delivery, "_deliver_steady", counted)
    monkeypatch.setattr(delivery._Window, "take", counted_take)
    return counter


@pytest.fixture
def no_gc_callbacks() -> Iterator[None]:
    """No garbage-collector callback runs during the test (those the process
    has are put back afterwards). CPython reports what a gc callback raises
    as unraisable and drops it, so a Ctrl-C (``KeyboardInterrupt``) that
    arrives while one runs never reaches the code it was meant for; hypothesis
    installs such a callback for the rest of the session once a property
    test has run. A test that sends a Ctrl-C at a random moment and counts
    where it lands would then miss one now and then on a busy machine."""
    saved = list(gc.callbacks)
    gc.callbacks.clear()
    try:
        yield
    finally:
        added = [callback for callback in gc.callbacks if callback not in saved]
        gc.callbacks[:] = saved + added


@pytest.fixture
def home(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """$HOME in one folder, the working directory in another (a path written to
    ``./~/...`` shows up there)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    yield home
    assert os.listdir(work) == [], "something was written under the working directory"
