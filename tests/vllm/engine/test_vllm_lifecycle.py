"""The vLLM backend's lifecycle under misuse: a Ctrl-C landing in the cleanup of an
interrupted call (or of a stream left early) still ends every request and frees
the engine; close() from another thread waits for the running call, ends a
stream left open, and is refused from inside the engine's own call; an engine
core process that dies mid-call ends the call with an error naming it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from closing import close_in_thread
from vllm_engine_helpers import prompts

from undercurrent.adapters.base import BackendError
from undercurrent.api import ProbedModel
from undercurrent.probes import Probe
from undercurrent.records import ProbeSignal
from undercurrent.spec.types import ExtractionPoint

NEW = 8
TEXTS = prompts(4)


class Recorder(Probe):
    """Counts what it receives; ``hook(probe, record)`` runs first when set."""

    probe_kind = "trajectory"
    hook: Any = None

    def on_start(self, ctx: Any) -> None:
        self.seen = 0

    def on_activation(self, record: Any) -> ProbeSignal:
        if type(self).hook is not None:
            type(self).hook(self, record)
        self.seen += 1
        return ProbeSignal("continue", score=float(self.seen))

    def on_end(self, ctx: Any) -> dict[str, int]:
        return {"seen": self.seen}


def _point(name: str) -> ExtractionPoint:
    return ExtractionPoint(name=name, layers=(0, 1), tensor_type="residual_stream",
                           position="generated[*]", probe_type="recorder",
                           probe_kind="trajectory")


def _load(model_dir: str) -> ProbedModel:
    return ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                       max_model_len=256, spec=[_point("inline")],
                                       probes={"recorder": Recorder})


def _summary(outputs: list[Any]) -> list[tuple[Any, ...]]:
    return [(tuple(o.token_ids), o.results["inline"].verdict["seen"],
             o.results["inline"].stats.received) for o in outputs]


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    Recorder.hook = None


def _interrupt_at(generated_index: int):
    def hook(probe: Any, record: Any) -> None:
        if record.generated_index == generated_index:
            Recorder.hook = None
            raise KeyboardInterrupt
    return hook


def test_an_interrupt_in_the_cleanup_still_ends_every_request_and_frees_the_engine(
        model_dir, monkeypatch):
    with _load(model_dir) as pm:
        baseline = _summary(pm.generate(TEXTS, max_new_tokens=NEW))
        engine = pm.backend.engine
        # A second Ctrl-C landing in each cleanup step of an interrupted call: after
        # the engine aborts its requests, and in the worker's release of them.
        abort_request, collective_rpc = engine.abort_request, engine.collective_rpc

        def abort_then_interrupt(*args: Any, **kwargs: Any) -> Any:
            abort_request(*args, **kwargs)
            raise KeyboardInterrupt

        def release_then_interrupt(method: Any, *args: Any, **kwargs: Any) -> Any:
            result = collective_rpc(method, *args, **kwargs)
            if method == "undercurrent_release":
                raise KeyboardInterrupt
            return result

        for name, replacement in (("abort_request", abort_then_interrupt),
                                  ("collective_rpc", release_then_interrupt)):
            with monkeypatch.context() as patched:
                patched.setattr(engine, name, replacement)
                Recorder.hook = _interrupt_at(2)
                with pytest.raises(KeyboardInterrupt):
                    pm.generate(TEXTS, max_new_tokens=NEW)
            assert pm.router.live_requests() == (), name
            assert _summary(pm.generate(TEXTS, max_new_tokens=NEW)) == baseline, name
        # One Ctrl-C in the cleanup of a stream its consumer left early.
        with monkeypatch.context() as patched:
            patched.setattr(engine, "collective_rpc", release_then_interrupt)
            stream = pm.stream(TEXTS[0], max_new_tokens=NEW)
            next(stream)
            with pytest.raises(KeyboardInterrupt):
                stream.close()
        assert pm.router.live_requests() == ()
        assert _summary(pm.generate(TEXTS, max_new_tokens=NEW)) == baseline


@pytest.mark.timeout(300)  # (a hang guard: close() inside the call waited for good)
def test_close_waits_for_a_call_in_another_thread_and_is_refused_inside_one(model_dir):
    pm = _load(model_dir)
    baseline = _summary(pm.generate(TEXTS, max_new_tokens=NEW))

    def closes(probe: Any, record: Any) -> None:
        if record.generated_index == 1:
            Recorder.hook = None
            pm.close()

    # (with a finished stream held, not read to its end, too: close() counted it as
    # a stream suspended on this thread, not as a call running there, and waited
    # for the call it was called from, for good)
    held = pm.stream(TEXTS[0], max_new_tokens=NEW)
    for held_stream in (None, held):
        if held_stream is not None:
            assert next(event for event in held_stream if event.finished).output.token_ids
        Recorder.hook = closes  # (raises into the probe's result: the call goes on)
        (inside,) = pm.generate(TEXTS[:1], max_new_tokens=NEW)
        assert "close() was called from inside this engine's own generation" in str(
            inside.results["inline"].error)
    reached, release, progress = threading.Event(), threading.Event(), threading.Event()

    def gate(probe: Any, record: Any) -> None:
        if record.generated_index == 2 and not reached.is_set():
            reached.set()
            release.wait()

    class TellsItWaits(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            progress.set()  # (close() waits for the call)
            return super().wait(timeout)

    pm.backend._idle = TellsItWaits()
    Recorder.hook = gate
    done: dict[str, Any] = {}
    generating = threading.Thread(target=lambda: done.update(
        outputs=pm.generate(TEXTS, max_new_tokens=NEW)))
    generating.start()
    reached.wait()
    closing = threading.Thread(target=lambda: (pm.close(), progress.set()))
    closing.start()
    progress.wait()  # (close() returned, or waits for the call)
    release.set()
    generating.join()
    closing.join()
    assert _summary(done["outputs"]) == baseline
    with pytest.raises(BackendError, match="closed"):
        pm.generate(TEXTS[:1], max_new_tokens=NEW)


def test_close_from_an_async_probe_is_refused_while_the_engine_generates(model_dir):
    # (on a router worker: close() waited for the call, whose drain waited for it)
    async_point = ExtractionPoint(name="async", layers=(0,), tensor_type="residual_stream",
                                  position="generated[*]", probe_type="recorder",
                                  probe_kind="trajectory", execution_mode="async")
    with ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                     max_model_len=256, spec=[async_point],
                                     probes={"recorder": Recorder}) as pm:
        def closes(probe: Any, record: Any) -> None:
            if record.generated_index == 1:
                Recorder.hook = None
                pm.close()

        Recorder.hook = closes
        (output,) = pm.generate(TEXTS[:1], max_new_tokens=NEW)
        result = output.results["async"]
        assert "close() was called from a probe's thread" in str(result.error)
        assert result.stats.dropped == 0
        assert len(pm.generate(TEXTS[:1], max_new_tokens=NEW)[0].token_ids) == NEW


def test_close_ends_a_stream_left_open(model_dir):
    pm = _load(model_dir)
    stream = pm.stream(TEXTS[0], max_new_tokens=NEW)
    first = next(stream)
    pm.close()
    # (ended: its requests aborted, the engine freed; its reader gets the events left)
    _check_cancelled(first, list(stream))
    assert pm.router.live_requests() == ()
    with pytest.raises(StopIteration):
        next(stream)


def _check_cancelled(first: Any, rest: list[Any]) -> None:
    events = [first, *rest]
    final = events[-1]
    assert final.finished and not any(event.finished for event in events[:-1])
    assert final.output.finish_reason == "cancelled"
    assert final.output.token_ids == tuple(event.token_id for event in events[:-1])
    assert len(final.output.token_ids) < NEW
    assert "".join(event.text for event in events) == final.output.text


def test_close_on_another_thread_cancels_the_stream_its_reader_waits_on(model_dir):
    # close() skipped a stream being read in another thread, and waited for its
    # whole generation; a reader between two events got ValueError('generator
    # already executing') from the stream close() ended on its own thread.
    for reader_waits in (True, False):
        pm = _load(model_dir)
        stream = pm.stream(TEXTS[0], max_new_tokens=NEW)

        def hold(probe: Any, record: Any, stream: Any = stream) -> None:
            # (the generation waits here until close() has cancelled the stream)
            if record.generated_index == 0:
                stream._cancel.wait()

        Recorder.hook = hold
        try:
            first = next(stream)
            closer, errors = close_in_thread(pm)
            if not reader_waits:  # (between two events while close() ends the stream)
                stream._cancel.wait()
            rest = list(stream)  # (else waits in next() while close() cancels it)
            closer.join()
        finally:
            Recorder.hook = None
        assert errors == []
        _check_cancelled(first, rest)
        assert pm.router.live_requests() == ()
        with pytest.raises(StopIteration):
            next(stream)


def test_a_stream_read_to_its_final_event_lets_the_engine_go(model_dir):
    # A stream left with ``break`` at its final event held the engine (its
    # cleanup ran only at the next ``next()``): every call was refused until the
    # stream was collected or closed.
    with _load(model_dir) as pm:
        before = _summary(pm.generate(TEXTS[:1], max_new_tokens=NEW))
        stream = pm.stream(TEXTS[0], max_new_tokens=NEW)
        next(stream)
        with pytest.raises(BackendError, match="already generating"):
            pm.generate(TEXTS[:1], max_new_tokens=1)
        for event in stream:
            if event.finished:
                break
        assert _summary(pm.generate(TEXTS[:1], max_new_tokens=NEW)) == before
        assert list(stream) == []


def _load_multiprocess(model_dir: str) -> tuple[ProbedModel, Any]:
    """A model whose engine core runs in its own process, and that process."""
    pm = ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                     max_model_len=256, multiprocess=True,
                                     spec=[_point("inline")], probes={"recorder": Recorder})
    (core,) = pm.backend.engine.engine_core.resources.engine_manager.processes
    return pm, core


@pytest.mark.timeout(300)  # (a hang guard: the call waited for good before)
def test_an_engine_core_killed_mid_call_ends_the_call_with_an_error_naming_it(model_dir):
    import os
    import signal

    pm, core = _load_multiprocess(model_dir)

    def kills_the_core(probe: Any, record: Any) -> None:
        if record.generated_index == 2:  # (the core waits for this step's answer)
            Recorder.hook = None
            os.kill(core.pid, signal.SIGKILL)

    Recorder.hook = kills_the_core
    with pytest.raises(BackendError, match=r"engine died during this call .*pid "
                       rf"{core.pid}\) killed by SIGKILL.*load the model again"):
        pm.generate(TEXTS, max_new_tokens=NEW)
    assert pm.router.live_requests() == ()
    with pytest.raises(BackendError, match="engine is dead .*killed by SIGKILL.*load the model"):
        pm.generate(TEXTS[:1], max_new_tokens=NEW)
    with pytest.raises(BackendError, match="engine is dead"):
        next(pm.stream(TEXTS[0], max_new_tokens=NEW))
    pm.close()
    with pytest.raises(BackendError, match="closed"):
        pm.generate(TEXTS[:1], max_new_tokens=NEW)


@pytest.mark.timeout(300)
def test_an_engine_core_stopped_by_sigterm_mid_call_ends_the_call_with_an_error(model_dir):
    # vLLM's engine core, sent SIGTERM, aborts every running request and exits: the
    # call returned the outputs cut short as finished (finish_reason "abort", not
    # aborted), with no error.
    import os
    import signal
    from multiprocessing import connection

    pm, core = _load_multiprocess(model_dir)

    def stops_the_core(probe: Any, record: Any) -> None:
        # (sent while the core waits for this step's answer: it aborts its requests
        # as soon as the step is done)
        if record.generated_index == 2:
            Recorder.hook = None
            os.kill(core.pid, signal.SIGTERM)

    Recorder.hook = stops_the_core
    with pytest.raises(BackendError, match=r"engine died during this call \(its engine core "
                       r"(stopped on its own|process EngineCore \(pid \d+\) exited)"):
        pm.generate(TEXTS, max_new_tokens=NEW)
    assert pm.router.live_requests() == ()
    with pytest.raises(BackendError, match="engine is dead .*load the model again"):
        pm.generate(TEXTS[:1], max_new_tokens=NEW)
    assert connection.wait([core.sentinel], timeout=240) == [core.sentinel]
    pm.close()
    with pytest.raises(BackendError, match="closed"):
        pm.generate(TEXTS[:1], max_new_tokens=NEW)


def test_a_model_dropped_without_close_is_collected_and_its_engine_core_ends(tmp_path, model_dir):
    # A model dropped without close() (a notebook cell run again) was never collected:
    # the step server's thread held its backend, and so did the frames of the first
    # load, which vLLM's first import kept (with the error of an optional import):
    # the engine core process and its KV cache lived until the interpreter exited.
    # (A script of its own: the first load of its process.)
    import subprocess
    import sys

    script = tmp_path / "dropped.py"
    script.write_text(
        "import gc\n"
        "import sys\n"
        "import weakref\n"
        "from multiprocessing import connection\n"
        "from undercurrent import ProbedModel\n"
        "if __name__ == '__main__':\n"
        "    pm = ProbedModel.from_pretrained(sys.argv[1], backend='vllm', dtype='float32',\n"
        "                                     max_model_len=128, multiprocess=True)\n"
        "    (core,) = pm.backend.engine.engine_core.resources.engine_manager.processes\n"
        "    generated = len(pm.generate('the cat', max_new_tokens=2)[0].token_ids)\n"
        "    dropped = weakref.ref(pm.backend)  # (the engine's holder)\n"
        "    del pm\n"
        "    gc.collect()\n"
        "    collected = dropped() is None\n"
        "    # (the engine core is shut down on a thread of its own: waited for)\n"
        "    ended = collected and connection.wait([core.sentinel], timeout=300) == [\n"
        "        core.sentinel]\n"
        "    with open(sys.argv[2], 'w') as out:\n"
        "        out.write(f'{generated} {collected} {ended}')\n")
    result = tmp_path / "result.txt"
    completed = subprocess.run([sys.executable, str(script), model_dir, str(result)],
                               capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert result.read_text() == "2 True True", completed.stderr[-3000:]


def test_a_script_that_never_closes_leaves_no_staged_model_or_socket_behind(tmp_path):
    # The bundled model's directory holds a probe file, so vLLM loads a staged copy
    # of it (links in a temporary directory), and the driver listens for the worker
    # in a folder of its own: both removed at exit without close() too.
    import os
    import subprocess
    import sys

    script = tmp_path / "unclosed.py"
    script.write_text(
        "from undercurrent import ProbedModel\n"
        "pm = ProbedModel.from_pretrained('undercurrent/tiny', backend='vllm', "
        "dtype='float32', max_model_len=128)\n"
        "print(len(pm.generate('user : hi ? assistant :', max_new_tokens=2)[0].token_ids))\n")
    staging = tmp_path / "tmp"
    staging.mkdir()
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                               timeout=600, check=False,
                               env=dict(os.environ, TMPDIR=str(staging)))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().splitlines()[-1] == "2"
    assert not list(staging.glob("undercurrent-*"))
