"""The vLLM backend when its engine fails, without an engine: a fake engine whose
workers died, or that refuses the capture, through the backend's own code."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from undercurrent.adapters.base import BackendError, SamplingParams
from undercurrent.adapters.vllm import backend as backend_module
from undercurrent.adapters.vllm.backend import VLLMBackend
from undercurrent.adapters.vllm.channel import StepServer

SHAPE = {"pipeline_parallel_size": 1, "tensor_parallel_size": 2}


class FakeEngine:
    """What ``VLLMBackend.__init__`` asks of an in-process engine: its workers answer
    ``captures`` to the attach; ``executor`` is what runs them."""

    def __init__(self, captures: list[bool]) -> None:
        self.captures = captures
        self.executor = SimpleNamespace(is_failed=False, workers=[])
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(
            model_executor=self.executor))
        self.model_config = SimpleNamespace(
            hf_config=SimpleNamespace(eos_token_id=2),
            get_diff_sampling_param=dict)
        self.calls: list[str] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        if method == "undercurrent_describe":
            return [SHAPE]
        if method == "undercurrent_attach":
            return self.captures
        return [None] * len(self.captures)


@pytest.fixture(autouse=True)
def _no_vllm(monkeypatch):
    # (the backend asks vLLM which platform it runs on; no vLLM import here)
    platforms = SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: True))
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(platforms=platforms))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


def _backend(engine: FakeEngine) -> VLLMBackend:
    return VLLMBackend(engine, SimpleNamespace(eos_token_id=None), model_name="fake",
                       multiprocess=False, prefix_caching=False)


def test_a_dead_tensor_parallel_worker_is_named_and_every_later_call_refused():
    engine = FakeEngine([True, False])
    backend = _backend(engine)
    engine.executor.is_failed = True
    engine.executor.workers = [
        SimpleNamespace(proc=SimpleNamespace(name="VllmWorker-0", pid=11, exitcode=None)),
        SimpleNamespace(proc=SimpleNamespace(name="VllmWorker-1", pid=12, exitcode=-9))]
    for _ in range(2):
        with pytest.raises(BackendError, match=r"engine is dead \(its worker processes ended: "
                           r"VllmWorker-1 \(pid 12\) killed by SIGKILL\).*load the model again"):
            backend.generate(["hi"], ["r0"], SamplingParams(max_new_tokens=2), session=None)
    backend.close()
    assert "undercurrent_detach" not in engine.calls  # (a failed executor never answers)


def test_a_backend_that_cannot_attach_closes_its_step_server(monkeypatch):
    servers: list[StepServer] = []

    class Recorded(StepServer):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            servers.append(self)

    monkeypatch.setattr(backend_module, "StepServer", Recorded)
    with pytest.raises(BackendError, match="expected exactly one capturing vLLM worker"):
        _backend(FakeEngine([False, False]))
    (server,) = servers
    assert not server._thread.is_alive()
    assert not os.path.exists(os.path.dirname(server.address))
