from __future__ import annotations

import pytest
from router_helpers import EVENTS, Recorder

from undercurrent.router import Router


@pytest.fixture(autouse=True)
def _forget_recorders():
    Recorder.instances.clear()
    yield
    for gate in EVENTS.values():
        gate.set()  # never leave a probe thread waiting
    EVENTS.clear()
    Recorder.instances.clear()


@pytest.fixture
def make_router():
    routers: list[Router] = []

    def build(**kwargs):
        kwargs.setdefault("probes", {"recorder": Recorder})
        router = Router(**kwargs)
        routers.append(router)
        return router

    yield build
    for router in routers:
        router.shutdown(wait=False)
