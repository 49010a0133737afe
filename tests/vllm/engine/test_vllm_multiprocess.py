"""The vLLM backend with the engine core in its own process (vLLM's production
layout): the same records as the HF backend, aborts within one engine step."""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
from vllm_engine_helpers import (
    CAPTURE_TIME_SPEC,
    CHUNK_BUDGET,
    MAX_NEW_TOKENS,
    check_streamed_edits,
    compare,
    hf_reference,
    no_hold,
    prompts,
    spec_points,
    steered_guard_spec,
    stop_at,
    token_times,
)

from undercurrent.adapters.base import SamplingParams
from undercurrent.adapters.session import CaptureSession
from undercurrent.api import ProbedModel
from undercurrent.router import Router

GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def reference(model_dir, num_layers):
    texts = prompts()
    return texts, hf_reference(model_dir, texts, spec_points(num_layers), GREEDY)


@pytest.fixture(scope="module")
def backend(model_dir, reference):
    from undercurrent.adapters.vllm.backend import VLLMBackend

    loaded = VLLMBackend.from_pretrained(model_dir, dtype="float32", multiprocess=True,
                                         max_model_len=256, max_num_batched_tokens=CHUNK_BUDGET,
                                         max_num_seqs=32)
    yield loaded
    loaded.close()


def test_engine_core_runs_in_another_process(backend):
    from vllm.v1.engine.core_client import SyncMPClient

    assert isinstance(backend.engine.engine_core, SyncMPClient)


def test_concurrent_requests_give_the_hf_records_and_tokens(backend, reference, num_layers):
    texts, hf_outputs = reference
    session = CaptureSession(None, spec_points(num_layers), keep_records=True)
    outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY, session)
    assert compare(outputs, hf_outputs) <= 1e-4


def guarded(backend, router, request_ids, generated_index=2):
    """A ProbedModel whose inline guard aborts ``request_ids`` at ``generated_index``."""
    return ProbedModel(backend, router=router, spec={"extraction_points": [{
        "name": "guard", "layers": 0, "tensor_type": "mlp_out", "position": "generated[*]",
        "probe_type": "stop_at", "probe_kind": "single_shot",
        "probe_args": {"request_ids": sorted(request_ids),
                       "generated_index": generated_index}}]})


def test_steps_held_back_keep_each_step_s_capture_time(backend, reference, monkeypatch):
    # The worker holds a quiet call's steps back and sends them together; each
    # step's capture time crosses the socket with it, and its records carry it
    # (the in-process file checks the times against the model's forwards).
    from undercurrent.adapters.vllm.channel import StepServer

    texts, _ = reference
    captured: list[float | None] = []
    answer = StepServer.answer

    def spy(self, batch):
        captured.extend(getattr(each, "captured", None) for each in [*batch.earlier, batch])
        return answer(self, batch)

    monkeypatch.setattr(StepServer, "answer", spy)
    model = ProbedModel(backend, spec=CAPTURE_TIME_SPEC)
    outputs = model.generate(texts[:3], max_new_tokens=MAX_NEW_TOKENS, records=True)
    assert None not in captured
    for times in token_times(outputs):
        assert set(times) <= set(captured)
        assert times == sorted(set(times))  # (each token its own, later ones later)


@pytest.mark.parametrize("reported", ["every step", "once finished", "held"])
def test_inline_abort_stops_the_request_within_one_engine_step(backend, reference,
                                                               monkeypatch, reported):
    # "once finished": the router made to say no probe may abort, so the engine
    # reports each request only once it finishes and the aborted ones take the
    # tokens the worker sent (their records reach the driver before the abort),
    # the worker sending each step at once all the same. "held": it holds them
    # (no reply could change a step, the router said), so the abort comes late.
    texts, hf_outputs = reference
    ids = [f"r{i}" for i in range(len(texts))]
    marked = {f"r{i}" for i in range(0, len(texts), 3)}
    if reported != "every step":
        monkeypatch.setattr(Router, "may_abort", lambda self, request_ids: False)
    if reported == "once finished":
        no_hold(monkeypatch)
    router = Router(probes={"stop_at": stop_at})
    model = guarded(backend, router, marked)
    try:
        outputs = model.generate(texts, request_ids=ids, max_new_tokens=MAX_NEW_TOKENS)
    finally:
        router.shutdown()
    stopped = 0
    for output, plain in zip(outputs, hf_outputs, strict=True):
        if output.request_id in marked and len(plain.token_ids) > 3:
            stopped += 1
            assert output.aborted and output.token_ids == plain.token_ids[:3]
            if reported == "every step":
                # The worker waits for the probe, so the engine commits at most the
                # token of the step that fed the aborting token.
                assert backend.engine_token_counts[output.request_id] <= 4
            elif reported == "once finished":  # the engine reported nothing for it
                assert output.request_id not in backend.engine_token_counts
            else:  # stopped late, or finished first: the output keeps what the probe saw
                assert backend.engine_token_counts.get(output.request_id) in (
                    None, len(plain.token_ids))
        else:
            assert not output.aborted and output.token_ids == plain.token_ids
            assert backend.engine_token_counts[output.request_id] == len(plain.token_ids)
    assert stopped >= 3


@pytest.mark.timeout(300)  # (a hang guard: the call waited for good before)
def test_an_abort_on_the_last_token_ends_only_that_request_of_capture_last_token(
        backend, reference):
    # (the last token is fed only by the replay that captures it: the engine core
    # drops the replay the probe aborts, and the driver ends it as well)
    texts, hf_outputs = reference
    assert len(hf_outputs[2].token_ids) >= 4
    router = Router(probes={"stop_at": stop_at})
    model = guarded(backend, router, {"r2"}, generated_index=3)
    try:
        outputs = model.generate(texts[:6], request_ids=[f"r{i}" for i in range(6)],
                                 max_new_tokens=4, capture_last_token=True)
    finally:
        router.shutdown()
    for output, plain in zip(outputs, hf_outputs, strict=False):
        assert output.token_ids == plain.token_ids[:4], output.request_id
        assert output.aborted == (output.request_id == "r2"), output.request_id
    assert outputs[2].abort.generated_index == 3
    assert not backend.engine.has_unfinished_requests()


@pytest.mark.parametrize("call", ["generate", "stream"])
@pytest.mark.parametrize("held_after", [2, 3])
def test_an_abort_that_overtakes_the_outputs_keeps_every_token_up_to_the_aborting_one(
        backend, reference, monkeypatch, held_after, call):
    """The engine core runs ahead of the driver. Here the driver is held, once it has
    the outputs carrying ``held_after`` tokens, until the guard's abort (on generated
    token 2, fed one step after it was sampled) has reached it: the abort overtakes
    the outputs that carry the tokens up to the aborting one (held_after=2), or
    arrives together with the last of them (held_after=3). On a busy machine this
    happens by chance; here it happens every time. The output still ends exactly
    with the token whose record fired."""
    texts, hf_outputs = reference
    index = next(i for i, out in enumerate(hf_outputs) if len(out.token_ids) > 4)
    plain = hf_outputs[index].token_ids
    abort_reached = threading.Event()
    forward_abort = backend.server._on_abort

    def abort_and_tell(engine_ids):
        forward_abort(engine_ids)
        abort_reached.set()

    engine_step = backend.engine.step
    held: list[bool] = []

    def step_held_back():
        outputs = engine_step()
        if not held and any(len(o.outputs[0].token_ids) == held_after for o in outputs):
            held.append(abort_reached.wait(timeout=120))
        return outputs

    monkeypatch.setattr(backend.server, "_on_abort", abort_and_tell)
    monkeypatch.setattr(backend.engine, "step", step_held_back)
    router = Router(probes={"stop_at": stop_at})
    model = guarded(backend, router, {"r"})
    try:
        if call == "generate":
            output = model.generate([texts[index]], request_ids=["r"],
                                    max_new_tokens=MAX_NEW_TOKENS)[0]
        else:
            events = list(model.stream(texts[index], request_id="r",
                                       max_new_tokens=MAX_NEW_TOKENS))
            output = events[-1].output
            assert [e.token_id for e in events[:-1]] == list(plain[:3])
    finally:
        router.shutdown()
    assert held == [True], "the driver was never held until the abort arrived"
    assert output.aborted and output.token_ids == plain[:3]
    assert output.abort.generated_index == 2


@pytest.mark.parametrize("reported", ["every step", "held"])
def test_a_stop_string_leaves_no_record_past_its_token(backend, model_dir, reference,
                                                       num_layers, monkeypatch, reported):
    # The engine core runs ahead of the driver, which ends a request once it reads
    # the token that completes a stop string: the worker may have captured that
    # token and later ones by then (every one of them, where it holds its steps
    # back). None of their rows reaches a probe, as under the HF backend, which
    # never feeds the stop string's token to the model.
    texts, hf_outputs = reference
    if reported == "every step":
        monkeypatch.setattr(CaptureSession, "may_abort", lambda self, request_ids: True)
    stop = common_word(hf_outputs)
    params = dataclasses.replace(GREEDY, stop=(stop,))
    points = spec_points(num_layers)
    expected = hf_reference(model_dir, texts, points, params)
    assert sum(output.finish_reason == "stop" for output in expected) > len(texts) // 2
    session = CaptureSession(None, points, keep_records=True)
    outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], params, session)
    compare(outputs, expected)
    assert [output.text for output in outputs] == [output.text for output in expected]


def common_word(outputs) -> str:
    """The word found inside (after the first word, before the last) the most of
    ``outputs`` ' texts (of those, the first in order)."""
    counts = collections.Counter(word for output in outputs
                                 for word in set(output.text.split()[1:-1]))
    return min(counts, key=lambda word: (-counts[word], word))


def test_a_stop_string_leaves_no_applied_edit_past_its_token(backend, model_dir):
    # An always-on edit of every generated token, on requests a stop string ends:
    # the worker may have edited the stop string's token before the driver read
    # it; the output logs the edits the HF backend applies, no more.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hidden = AutoConfig.from_pretrained(model_dir).hidden_size
    texts = prompts()[:8]
    ids = [f"e{i}" for i in range(len(texts))]
    spec = {"version": "2", "extraction_points": [
        {"name": "resid", "layers": [1, 2], "tensor_type": "residual_stream",
         "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory"}],
        "edits": [{"name": "push", "layers": 1, "tensor_type": "residual_stream",
                   "position": "generated[*]", "op": "add", "coefficient": 2.0,
                   "vector": [0.01 * ((7 * i) % 13 - 6) for i in range(hidden)]}]}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir), spec=spec) as hf:
        stop = common_word(hf.generate(texts, max_new_tokens=MAX_NEW_TOKENS))
        expected = hf.generate(texts, max_new_tokens=MAX_NEW_TOKENS, stop=[stop], records=True,
                               request_ids=ids)
    assert sum(output.finish_reason == "stop" for output in expected) > len(texts) // 2
    outputs = ProbedModel(backend, spec=spec).generate(
        texts, max_new_tokens=MAX_NEW_TOKENS, stop=[stop], records=True, request_ids=ids)
    compare(outputs, expected)
    for ours, theirs in zip(outputs, expected, strict=True):
        assert list(ours.edits) == list(theirs.edits), ours.request_id
        assert {r.key(): r.edits for r in ours.records} == {
            r.key(): r.edits for r in theirs.records}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("repeat", range(4))
def test_a_stream_s_events_carry_the_edits_of_the_steps_that_sampled_their_tokens(
        backend, num_layers, repeat):
    # The engine core runs ahead of the driver: a later step's edits may be in
    # before a token's event is made, and wait for the next event. (Repeated: the
    # guard's abort may reach the core while the driver waits in step() for an
    # output the core then never sends, unless the abort wakes it; on a busy
    # machine one run in a few did, and waited for good: hence the timeout.)
    check_streamed_edits(list(ProbedModel(backend, spec=steered_guard_spec(
        backend, num_layers)).stream(prompts()[4], max_new_tokens=MAX_NEW_TOKENS)))


def test_a_script_loading_outside_its_main_guard_is_told_to_add_one(tmp_path, model_dir):
    # vLLM's CPU build spawns the engine core, which imports the script again: an
    # unguarded load ran there too and failed, and the script got only "Engine core
    # initialization failed". Refused before any process starts, naming the line
    # (a guarded script: tests/vllm/test_vllm_spawning.py).
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from undercurrent.adapters.vllm.backend import VLLMBackend\n"
                      f"pm = VLLMBackend.from_pretrained({model_dir!r}, multiprocess=True, "
                      "max_model_len=128)\n")
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                               timeout=600, check=False)
    assert completed.returncode == 1
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"undercurrent.adapters.base.BackendError: {script}, line 2, "
                           "loads a vLLM engine with multiprocess=True outside an `if "
                           "__name__ == \"__main__\":` block"), completed.stderr[-3000:]
    assert "EngineCore" not in completed.stderr  # (no process was started)
