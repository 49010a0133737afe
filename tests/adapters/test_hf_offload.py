"""Delivery off the generation thread when every point is async (the GPU path of
``ModelHooks``), exercised on CPU with ``offload="always"``: no host sync on the
generation thread inside the hooks, the same results as delivering inline, and
delivery errors reaching the caller."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    build_model,
    build_tokenizer,
    generated_points,
    kv_point,
    prompt,
)

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.adapters import session as session_module  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.records import ProbeSignal  # noqa: E402
from undercurrent.spec.types import ExtractionPoint, ProbeKind  # noqa: E402

PROMPTS = [prompt(3, 1, 4, 1, 5), prompt(2, 6), prompt(5, 3, 5, 8), prompt(9)]
SYNCING = ("cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__")


def _points(mode: str = "async") -> list[ExtractionPoint]:
    return generated_points(mode)


KV = kv_point("async")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _probed(tokenizer, points, offload):
    pm = ProbedModel(build_model("llama"), tokenizer, spec=points)
    pm.backend.hooks.offload = offload
    return pm


def _in_hooks() -> bool:
    """True when a frame of ``adapters/hf/hooks.py`` (a hook or ``flush``, and what
    flush calls) is on the stack."""
    from undercurrent.adapters.hf import hooks

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == hooks.__file__:
            return True
        frame = frame.f_back
    return False


@contextmanager
def count_syncs():
    """Count, per method, the host-syncing calls made on the calling thread while
    the hooks are on the stack (tensor reads to the host, and every CUDA
    synchronisation the hooks could issue)."""
    counts: Counter[str] = Counter()
    generation = threading.current_thread()
    patches = [(torch.Tensor, name) for name in SYNCING]
    patches += [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                (torch.cuda.Event, "synchronize")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in patches]

    def wrap(name, original):
        def counted(*args, **kwargs):
            if threading.current_thread() is generation and _in_hooks():
                counts[name] += 1
            return original(*args, **kwargs)
        return counted

    def to_counted(original):
        def counted(self, *args, **kwargs):
            # an explicit host target; ``.to(device)`` with the model's device is a
            # host-to-device copy on a GPU (``sync_count`` counts the same way)
            target = kwargs.get("device", args[0] if args else None)
            if (isinstance(target, str) and target.startswith("cpu")
                    and threading.current_thread() is generation
                    and _in_hooks()):
                counts["to('cpu')"] += 1
            return original(self, *args, **kwargs)
        return counted

    def copy_counted(original):
        def counted(self, source, non_blocking=False):
            # a blocking copy into host memory (the hooks' own copies are non-blocking)
            if (not non_blocking and self.device.type == "cpu"
                    and threading.current_thread() is generation and _in_hooks()):
                counts["copy_ to host"] += 1
            return original(self, source, non_blocking)
        return counted

    to_original, copy_original = torch.Tensor.to, torch.Tensor.copy_
    for owner, name, original in originals:
        setattr(owner, name, wrap(name, original))
    torch.Tensor.to = to_counted(to_original)
    torch.Tensor.copy_ = copy_counted(copy_original)
    try:
        yield counts
    finally:
        torch.Tensor.to, torch.Tensor.copy_ = to_original, copy_original
        for owner, name, original in originals:
            setattr(owner, name, original)


@pytest.fixture
def delivering_threads(monkeypatch):
    """The thread each ``CaptureSession.deliver`` call ran on."""
    seen: list[threading.Thread] = []
    original = session_module.CaptureSession.deliver

    def deliver(self, batches):
        seen.append(threading.current_thread())
        return original(self, batches)

    monkeypatch.setattr(session_module.CaptureSession, "deliver", deliver)
    return seen


def test_async_only_capture_makes_no_host_sync_on_the_generation_thread(
        tokenizer, delivering_threads):
    pm = _probed(tokenizer, [*_points(), KV], "always")
    with count_syncs() as counts:
        outs = pm.generate(PROMPTS, max_new_tokens=6)
    assert dict(counts) == {}
    main = threading.current_thread()
    # the 5 decode forwards feed generated tokens: each delivered, none on this thread
    assert len(delivering_threads) == 5
    assert all(thread is not main for thread in delivering_threads)
    for out in outs:
        stats = out.results["traj"].stats
        assert stats.received == 5 * 3 == stats.processed + stats.dropped
    assert not pm.backend.hooks.delivering  # the thread is gone after generate()


class MayAbort(Probe):
    """A probe written per record that reads each activation's first value: the
    router cannot know it never aborts."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def on_activation(self, record: Any) -> ProbeSignal:
        return ProbeSignal(score=float(record.tensor.reshape(-1)[0]))


def test_an_inline_point_keeps_delivery_on_the_generation_thread(
        tokenizer, delivering_threads):
    """The counter sees the inline path's syncs, so its zero above means something.
    The inline probe written per record may abort (the router cannot tell), so
    each step is routed as it comes, inside the hooks' flush (steps its probe
    could not abort would be held in windows, routed after the hooks ran)."""
    traj, norm = _points("inline")
    guard = dataclasses.replace(traj, probe_type="may_abort", probe_args={})
    pm = ProbedModel(build_model("llama"), tokenizer, spec=[guard, norm],
                     probes={"may_abort": MayAbort})
    pm.backend.hooks.offload = "always"
    with count_syncs() as counts:
        pm.generate(PROMPTS, max_new_tokens=6)
    assert sum(counts.values()) > 0
    main = threading.current_thread()
    assert len(delivering_threads) == 5
    assert all(thread is main for thread in delivering_threads)


def test_auto_delivers_on_the_generation_thread_on_cpu(tokenizer, delivering_threads):
    pm = _probed(tokenizer, _points(), "auto")
    pm.generate(PROMPTS[:1], max_new_tokens=3)
    assert delivering_threads and all(
        thread is threading.current_thread() for thread in delivering_threads)


def _fields(record):
    """A record but its request id (fresh per call), timestamp and tensor."""
    return (record.extraction_point_name, record.layer, record.tensor_type,
            record.token_index, record.is_generated, record.generated_index,
            record.token_id, record.edits)


@pytest.mark.parametrize("capture_last_token", [False, True])
def test_off_thread_delivery_gives_the_same_records_and_results(tokenizer, capture_last_token):
    outputs = {}
    for offload in ("never", "always"):
        pm = _probed(tokenizer, [*_points(), KV], offload)
        outputs[offload] = pm.generate(PROMPTS, max_new_tokens=7, records=True,
                                       capture_last_token=capture_last_token)
    for inline, off in zip(outputs["never"], outputs["always"], strict=True):
        assert off.token_ids == inline.token_ids
        assert len(off.records) == len(inline.records) > 0
        for a, b in zip(off.records, inline.records, strict=True):  # in order
            assert _fields(a) == _fields(b)
            assert torch.equal(a.tensor, b.tensor)
        assert {record.tensor_type for record in off.records} == {
            "residual_stream", "mlp_out", "kv"}
        assert set(off.results) == {"traj", "norm", "kv"}
        for name, expected in inline.results.items():
            got = off.results[name]
            assert got.error is None and expected.error is None
            assert got.verdict == expected.verdict
            assert (got.stats.received, got.stats.processed, got.stats.dropped,
                    got.stats.errors) == (expected.stats.received, expected.stats.processed,
                                          expected.stats.dropped, expected.stats.errors)
            assert got.stats.received == got.stats.processed + got.stats.dropped


def test_a_delivery_error_reaches_the_caller_and_leaves_the_model_usable(
        tokenizer, monkeypatch):
    pm = _probed(tokenizer, _points(), "always")
    calls = []
    original = session_module.deliver_forward

    def failing(session, batches, *step):
        calls.append(threading.current_thread())
        if len(calls) == 3:
            raise RuntimeError("delivery failed on purpose")
        return original(session, batches, *step)

    monkeypatch.setattr(session_module, "deliver_forward", failing)
    with pytest.raises(RuntimeError, match="delivery failed on purpose"):
        pm.generate(PROMPTS, max_new_tokens=6)
    assert all(thread is not threading.current_thread() for thread in calls)
    assert not pm.backend.hooks.delivering
    assert pm.router.live_requests() == ()
    monkeypatch.setattr(session_module, "deliver_forward", original)
    (out,) = pm.generate(PROMPTS[:1], max_new_tokens=3)
    assert out.results["traj"].stats.received == 2 * 3


def test_a_bad_offload_value_is_refused(tokenizer):
    pm = _probed(tokenizer, _points(), "sometimes")
    with pytest.raises(ValueError, match="offload must be 'auto', 'always' or 'never'"):
        pm.generate(PROMPTS[:1], max_new_tokens=2)


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: remembers the thread of each call."""

    made: list[_FakeEvent] = []

    def __init__(self):
        self.recorded_on = self.waited_on = None
        _FakeEvent.made.append(self)

    def record(self):
        self.recorded_on = threading.current_thread()

    def synchronize(self):
        self.waited_on = threading.current_thread()


class _FakeStream:
    syncs: list[threading.Thread] = []

    def synchronize(self):
        _FakeStream.syncs.append(threading.current_thread())


@pytest.mark.parametrize("offload", ["always", "never"])
def test_flush_after_device_copies_waits_on_an_event_off_thread(tokenizer, monkeypatch, offload):
    """The CUDA control flow of ``flush`` on CPU: every gathered copy is marked as
    non-blocking (as from a CUDA tensor) and torch.cuda's event and stream are
    fakes. Off-thread delivery records one event per forward on the generation
    thread and waits on it on the delivery thread, with no stream sync; inline
    delivery syncs the stream once per forward on the generation thread."""
    from undercurrent.adapters.hf.hooks import ModelHooks

    _FakeEvent.made, _FakeStream.syncs = [], []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    flush_original = ModelHooks.flush

    def device_flush(self, session):
        if self._pending:  # each forward's copies marked as from CUDA tensors (_queue does)
            self._needs_sync = True
        return flush_original(self, session)

    monkeypatch.setattr(ModelHooks, "flush", device_flush)
    pm = _probed(tokenizer, _points(), offload)
    (out,) = pm.generate(PROMPTS[:1], max_new_tokens=5)
    main = threading.current_thread()
    assert out.results["traj"].stats.received == 4 * 3
    if offload == "always":
        assert _FakeStream.syncs == []
        assert len(_FakeEvent.made) == 4
        for event in _FakeEvent.made:
            assert event.recorded_on is main
            assert event.waited_on is not None and event.waited_on is not main
    else:
        assert _FakeEvent.made == []
        assert _FakeStream.syncs == [main] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_async_only_capture_never_syncs_the_generation_thread(tokenizer):
    import copy

    pm = ProbedModel(copy.deepcopy(build_model("llama")).to("cuda"), tokenizer, spec=_points())
    assert pm.backend.hooks.offload == "auto"
    cpu = _probed(tokenizer, _points(), "never")
    with count_syncs() as counts:
        outs = pm.generate(PROMPTS, max_new_tokens=6, records=True)
    assert dict(counts) == {}
    for on_gpu, on_cpu in zip(outs, cpu.generate(PROMPTS, max_new_tokens=6, records=True),
                              strict=True):
        assert on_gpu.token_ids == on_cpu.token_ids
        for a, b in zip(on_gpu.records, on_cpu.records, strict=True):
            assert a.tensor.device.type == "cpu" and _fields(a) == _fields(b)
            torch.testing.assert_close(a.tensor, b.tensor, rtol=1e-3, atol=1e-4)


def test_an_interrupt_skips_the_forwards_not_delivered_yet(tokenizer, monkeypatch):
    """Generation fails while the delivery thread is still on the first forward:
    the forwards queued behind it are never routed, the requests are abandoned,
    and the model works again."""
    from undercurrent.adapters.hf import backend as backend_module
    from undercurrent.adapters.hf.offload import DeliveryThread

    release = threading.Event()
    holding = threading.Event()  # the delivery thread is inside the first forward
    delivered = []
    original = session_module.deliver_forward

    def slow_first(session, batches, *step):
        if not delivered:
            holding.set()
            release.wait()  # held until generation has failed and closes the thread
        delivered.append(len(delivered))
        return original(session, batches, *step)

    close_original = DeliveryThread.close

    def close(self, *, discard=False):
        self._discard = self._discard or discard
        release.set()
        close_original(self, discard=discard)

    after_token = backend_module._RowDriver.after_token
    tokens = []

    def interrupting(self, input_ids, *args, **kwargs):
        tokens.append(1)
        if len(tokens) == 4:
            # On a busy machine the delivery thread may not have taken the first
            # forward yet: fail only once it holds it, as the test means to.
            holding.wait()
            raise KeyboardInterrupt
        return after_token(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(session_module, "deliver_forward", slow_first)
    monkeypatch.setattr(DeliveryThread, "close", close)
    monkeypatch.setattr(backend_module._RowDriver, "after_token", interrupting)
    pm = _probed(tokenizer, _points(), "always")
    with pytest.raises(KeyboardInterrupt):
        pm.generate(PROMPTS, max_new_tokens=8)
    assert delivered == [0]  # forwards 2 and 3 were handed over, never routed
    assert pm.router.live_requests() == ()
    monkeypatch.setattr(backend_module._RowDriver, "after_token", after_token)
    (out,) = pm.generate(PROMPTS[:1], max_new_tokens=3)
    assert out.results["traj"].stats.received == 2 * 3
