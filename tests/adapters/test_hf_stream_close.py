"""ProbedModel.close() on another thread ends a stream being read (docs/hf.md,
Cleanup): its generation is cancelled, close() returns, and the reader gets the
events generated before, then a final event with ``finish_reason="cancelled"``,
then the end of the iteration (close() waited for the whole generation, and a
reader between two events got ``ValueError('generator already executing')``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from closing import close_in_thread  # noqa: E402
from hf_models import build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.records import ProbeSignal  # noqa: E402
from undercurrent.spec.types import ExtractionPoint  # noqa: E402

NEW = 40


class HoldUntilCancelled(Probe):
    """Holds the generation at its first generated token until close() has cancelled
    the stream (``stream``'s cancel event, which close() sets), then says so."""

    probe_kind = "single_shot"
    stream: Any = None
    cancelled = threading.Event()

    def on_activation(self, record: Any) -> ProbeSignal:
        if record.generated_index == 0:
            try:
                type(self).stream._cancel.wait()
            finally:  # (set even when this raised: the reader must not wait forever)
                type(self).cancelled.set()
        return ProbeSignal("continue")


def _streaming() -> tuple[ProbedModel, Any, Any]:
    """A probed model (no eos: only max_new_tokens or a cancel ends it), its stream
    of NEW tokens and that stream's first event."""
    model = build_model("gpt2")
    pm = ProbedModel(model, build_tokenizer(), probes={"hold": HoldUntilCancelled},
                     spec=[ExtractionPoint(name="p", layers=(1,), tensor_type="residual_stream",
                                           position="generated[*]", probe_type="hold",
                                           probe_kind="single_shot")])
    HoldUntilCancelled.cancelled = threading.Event()
    stream = HoldUntilCancelled.stream = pm.stream(prompt(3, 1, 4), max_new_tokens=NEW)
    return pm, stream, next(stream)


def _check_cancelled(pm: ProbedModel, first: Any, rest: list[Any], stream: Any) -> None:
    events = [first, *rest]
    final = events[-1]
    assert final.finished and not any(event.finished for event in events[:-1])
    assert final.output.finish_reason == "cancelled"
    # (the token sampled from the forward the probe held is not taken: the stream
    # ends there)
    assert final.output.token_ids == (first.token_id,)
    assert "".join(event.text for event in events) == final.output.text
    with pytest.raises(StopIteration):
        next(stream)
    # The model was let go: another ProbedModel of it generates.
    with ProbedModel(pm.backend.model, build_tokenizer()) as second:
        assert len(second.generate([prompt(3, 1, 4)], max_new_tokens=2)[0].token_ids) == 2


def test_close_on_another_thread_cancels_the_stream_its_reader_waits_on() -> None:
    pm, stream, first = _streaming()
    closer, errors = close_in_thread(pm)
    rest = list(stream)  # (waits in next() while close() cancels the generation)
    closer.join()
    assert errors == []
    _check_cancelled(pm, first, rest, stream)


def test_a_reader_between_two_events_gets_the_rest_of_a_stream_close_ended() -> None:
    pm, stream, first = _streaming()
    closer, errors = close_in_thread(pm)
    # The reader handles its event while close() cancels the generation and ends
    # the stream on its own thread; the reader's next() then comes (while close()
    # ends it, or after).
    HoldUntilCancelled.cancelled.wait()
    rest = list(stream)
    closer.join()
    assert errors == []
    _check_cancelled(pm, first, rest, stream)


class CloseTheStream(Probe):
    """Closes its own stream at the first generated token (a probe's or a callback's
    stream.close() inside the generation)."""

    probe_kind = "single_shot"
    stream: Any = None

    def on_activation(self, record: Any) -> ProbeSignal:
        if record.generated_index == 1:
            type(self).stream.close()
        return ProbeSignal("continue")


def test_a_stream_closed_from_inside_its_own_generation_ends_cancelled() -> None:
    # The reader's next() held the stream's lock while the probe's close() waited
    # for it: a hang (before the lock: "generator already executing").
    with ProbedModel(build_model("gpt2"), build_tokenizer(), probes={"closer": CloseTheStream},
                     spec=[ExtractionPoint(name="p", layers=(1,), tensor_type="residual_stream",
                                           position="generated[*]", probe_type="closer",
                                           probe_kind="single_shot")]) as pm:
        stream = CloseTheStream.stream = pm.stream(prompt(3, 1, 4), max_new_tokens=NEW)
        events = list(stream)
        assert events[-1].finished and events[-1].output.finish_reason == "cancelled"
        assert len(events[-1].output.token_ids) < NEW
        assert len(pm.generate([prompt(3, 1, 4)], max_new_tokens=2)[0].token_ids) == 2


def test_a_stream_closed_on_the_thread_advancing_it_only_cancels() -> None:
    # (vLLM runs its generation, probes and callbacks, on the reader's thread: the
    # lock the reader's next() held was taken again by close() on that thread)
    from undercurrent.adapters.open_streams import OpenStream

    cancel = threading.Event()

    def events() -> Any:
        yield 1
        stream.close()
        yield 2 if cancel.is_set() else 0

    stream = OpenStream(events(), cancel)
    assert list(stream) == [1, 2]
    with pytest.raises(StopIteration):
        next(stream)
