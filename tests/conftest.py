"""Fixtures shared by the test directories."""

from __future__ import annotations

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
