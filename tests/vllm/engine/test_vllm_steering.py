"""Live edits on vLLM (float32, the bundled model): 16 concurrent requests, half of
them steered (always-on edits of every op and site, and one triggered by an inline
probe's flag), give the same tokens, records, edited flags and applied edits as the
HF backend; the same at tensor parallelism 2 (every rank applies the edit)."""

from __future__ import annotations

import random

import pytest
from vllm_engine_helpers import CHUNK_BUDGET, compare

from undercurrent.api import ProbedModel
from undercurrent.models.corpus import chat_prompt, make_prompt
from undercurrent.probes import probe
from undercurrent.records import ProbeSignal

COUNT = 16
NEW = 10
PROBE = "undercurrent:models/tiny/probe.safetensors"
TRIGGERED = {"r6", "r14"}


@probe(register=False)
def flag_at(record, *, request_ids=(), generated_index=2):
    """Flags the listed requests at one generated index."""
    if record.request_id in request_ids and record.generated_index == generated_index:
        return ProbeSignal(action="flag", score=1.0)
    return ProbeSignal(action="continue", score=0.0)


def texts() -> list[str]:
    rng = random.Random(15)
    return [chat_prompt(make_prompt(rng, i % 2)) for i in range(COUNT)]


SPEC = {"version": "2", "extraction_points": [
    {"name": "watch", "layers": 0, "tensor_type": "residual_stream",
     "position": "generated[*]", "probe_type": "flag_at", "probe_kind": "single_shot",
     "probe_args": {"request_ids": sorted(TRIGGERED)}},
    {"name": "resid", "layers": [1, 2, 3], "tensor_type": "residual_stream",
     "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory"},
    {"name": "mlp", "layers": 2, "tensor_type": "mlp_out", "position": "generated[*]",
     "probe_type": "norm_probe", "probe_kind": "trajectory"},
    {"name": "attn_prompt", "layers": 0, "tensor_type": "attn_out", "position": "prompt[-1]",
     "probe_type": "norm_probe", "probe_kind": "single_shot"},
]}


def vector(seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(0.0, 1.0) for _ in range(128)]


def edits_for(index: int) -> list[dict] | None:
    """Half the requests steered: every op, every site, prompt and generated positions."""
    kind = index % 4
    if kind in (1, 3):
        return None
    if f"r{index}" in TRIGGERED:
        return [{"name": "triggered", "layers": 1, "tensor_type": "residual_stream",
                 "position": "generated[*]", "op": "add", "vector": vector(1),
                 "coefficient": 6.0, "when": {"point": "watch", "action": "flag"}}]
    if kind == 0:
        return [{"name": "push", "layers": 1, "tensor_type": "residual_stream",
                 "position": "generated[*]", "op": "add", "vector": vector(2),
                 "coefficient": 4.0},
                {"name": "damp", "layers": 2, "tensor_type": "mlp_out",
                 "position": "generated[2:]", "op": "scale", "vector": PROBE,
                 "coefficient": 0.2}]
    return [{"name": "away", "layers": 2, "tensor_type": "residual_stream",
             "position": "generated[*]", "op": "project_out", "vector": PROBE},
            {"name": "pin", "layers": 0, "tensor_type": "attn_out", "position": "prompt[-1]",
             "op": "clamp", "vector": vector(3), "coefficient": -3.0},
            {"name": "norm", "layers": 3, "tensor_type": "residual_stream",
             "position": "generated[1:8]", "stride": 2, "op": "add", "vector": vector(4),
             "coefficient": 0.5, "norm_match": True}]


def run(model) -> list:
    return model.generate(texts(), max_new_tokens=NEW, records=True,
                          request_ids=[f"r{i}" for i in range(COUNT)],
                          prompt_edits=[edits_for(i) for i in range(COUNT)])


def untriggered(index: int) -> list[dict] | None:
    """The always-on edits alone (no point to trigger them in a spec-less model)."""
    return None if f"r{index}" in TRIGGERED else edits_for(index)


def run_edits_only(model) -> list:
    return model.generate(texts(), max_new_tokens=NEW,
                          request_ids=[f"r{i}" for i in range(COUNT)],
                          prompt_edits=[untriggered(i) for i in range(COUNT)])


#: The always-on edits of every request (``edits_for(0)``: ``add`` on every
#: generated token, ``scale`` from the third) beside a point on every token.
ALWAYS_ON_SPEC = {"version": "2", "extraction_points": [SPEC["extraction_points"][1]]}

#: A guard on the bundled probe's score, whose flag switches on an edit for its
#: request (every request has it, at a layer the guard captures: its records
#: there say so); its threshold is set from the scores each request's first
#: tokens get (see ``switched_threshold``).
SWITCHED_COUNT, SWITCHED_NEW = 8, 16


def switched_spec(threshold: float) -> dict:
    return {"version": "2", "extraction_points": [
        {"name": "guard", "layers": [2, 3], "tensor_type": "residual_stream",
         "position": "generated[*]", "probe_type": "linear_probe", "probe_kind": "trajectory",
         "probe_args": {"path": PROBE, "threshold": threshold, "action": "flag",
                        "check_metadata": False}}]}


SWITCHED_EDIT = [{"name": "switched", "layers": 2, "tensor_type": "residual_stream",
                  "position": "generated[*]", "op": "add", "vector": vector(5),
                  "coefficient": 3.0, "when": {"point": "guard", "action": "flag"}}]


def late_threshold(watched: list) -> float:
    """A threshold some request's score reaches, where the first to reach it
    does so as late as any threshold allows (later is better: the steps
    before a switch repeat their cycle), midway between two scores some
    distance apart: vLLM's scores differ from HF's in their last digits, and
    one at the threshold, or near it, would switch on one backend and not on
    the other."""
    def first(threshold: float) -> int:
        return min(s.generated_index for output in watched for s in output.signals
                   if s.score >= threshold)

    scores = sorted({s.score for output in watched for s in output.signals}, reverse=True)
    candidates = [(high + low) / 2 for high, low in zip(scores, scores[1:], strict=False)
                  if high - low > 1e-6]
    # (the latest first switch; of those, the lowest threshold: the most switches)
    return max(candidates, key=lambda threshold: (first(threshold), -threshold))


def strided_spec(threshold: float) -> dict:
    """:func:`switched_spec` beside a point of stride 2: the steps before a switch
    take turns in a cycle of two plans."""
    spec = switched_spec(threshold)
    return {**spec, "extraction_points": [*spec["extraction_points"], {
        "name": "second", "layers": [1], "tensor_type": "mlp_out",
        "position": "generated[*]", "stride": 2, "probe_type": "norm_probe",
        "probe_kind": "trajectory"}]}


def run_switched(model) -> list:
    return model.generate(texts()[:SWITCHED_COUNT], max_new_tokens=SWITCHED_NEW, records=True,
                          request_ids=[f"s{i}" for i in range(SWITCHED_COUNT)],
                          edits=SWITCHED_EDIT)


def switched_threshold(watched: list) -> float:
    """A threshold that half the requests' scores reach within their first
    eight tokens (each at its own), and the others' never before."""
    firsts = sorted(max(s.score for s in output.signals if s.generated_index < 8)
                    for output in watched)
    return (firsts[len(firsts) // 2 - 1] + firsts[len(firsts) // 2]) / 2


def run_always_on(model) -> list:
    """Four requests, each with the same always-on edits: after the prefill every
    step decodes all four (the engine's budget splits no prompt of theirs over
    later steps), 20 tokens long."""
    return model.generate(texts()[:4], max_new_tokens=20, records=True,
                          request_ids=[f"r{i}" for i in range(4)],
                          prompt_edits=[edits_for(0)] * 4)


#: Edits that end, every request the same: the prompt's last token, a slice of
#: generated tokens and one generated token (beside ``ALWAYS_ON_SPEC`` 's point).
ENDING_EDITS = [
    {"name": "pin", "layers": 0, "tensor_type": "attn_out", "position": "prompt[-1]",
     "op": "clamp", "vector": vector(3), "coefficient": -3.0},
    {"name": "window", "layers": 1, "tensor_type": "residual_stream",
     "position": "generated[2:9]", "op": "add", "vector": vector(2), "coefficient": 4.0},
    {"name": "once", "layers": 2, "tensor_type": "residual_stream", "position": "generated[11]",
     "op": "add", "vector": vector(4), "coefficient": 6.0},
]


#: A point of every second generated token beside an edit of the same tokens.
STRIDED_SPEC = {"version": "2", "extraction_points": [
    {**SPEC["extraction_points"][1], "stride": 2}]}
STRIDED_EDITS = [{"name": "every_second", "layers": 1, "tensor_type": "residual_stream",
                  "position": "generated[*]", "stride": 2, "op": "add", "vector": vector(6),
                  "coefficient": 4.0}]


def run_strided_edit(model) -> list:
    return model.generate(texts()[:2], max_new_tokens=16, records=True,
                          request_ids=[f"t{i}" for i in range(2)], edits=STRIDED_EDITS)


def run_ending(model) -> list:
    return model.generate(texts()[:4], max_new_tokens=20, records=True,
                          request_ids=[f"e{i}" for i in range(4)], edits=ENDING_EDITS)


def _count_edited_repeats(monkeypatch) -> list[bool]:
    """For each plan made a step later (``StepPlan.shifted``, or ``advanced``
    moving a plan on in place), whether it applies edits."""
    from undercurrent.adapters.session import StepPlan

    edited: list[bool] = []
    shifted, advanced = StepPlan.shifted, StepPlan.advanced

    def counted_shift(plan, delta=1):
        made = shifted(plan, delta)
        edited.append(bool(made.edits))
        return made

    def counted_advance(plan, delta=1):
        made = advanced(plan, delta)
        edited.append(bool(made.edits) and made is plan)
        return made

    monkeypatch.setattr(StepPlan, "shifted", counted_shift)
    monkeypatch.setattr(StepPlan, "advanced", counted_advance)
    return edited


def _count_column_plans(monkeypatch) -> list[int]:
    """One entry for each step the driver plans from its columns
    (``channel.step_deliveries``)."""
    from undercurrent.adapters.vllm import channel

    planned: list[int] = []
    step_deliveries = channel.step_deliveries

    def counted_deliveries(batch, table):
        planned.append(1)
        return step_deliveries(batch, table)

    monkeypatch.setattr(channel, "step_deliveries", counted_deliveries)
    return planned


def check_same(outputs, reference) -> None:
    compare(outputs, reference)
    for ours, theirs in zip(outputs, reference, strict=True):
        assert list(ours.edits) == list(theirs.edits), ours.request_id
        edited = {r.key(): r.edits for r in ours.records}
        assert edited == {r.key(): r.edits for r in theirs.records}, ours.request_id


@pytest.fixture(scope="module")
def reference(model_dir):
    # The oracle runs before vLLM is imported in this process.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir), spec=SPEC,
                     probes={"flag_at": flag_at}, batch_size=COUNT) as hf:
        outputs = run(hf)
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir), spec=ALWAYS_ON_SPEC,
                     batch_size=COUNT) as hf:
        always_on = run_always_on(hf)
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir),
                     spec=switched_spec(2.0), batch_size=COUNT) as hf:
        watched = run_switched(hf)  # (a threshold no score reaches)
    threshold = switched_threshold(watched)
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir),
                     spec=switched_spec(threshold), batch_size=COUNT) as hf:
        switched = run_switched(hf)
    at = [output.edits[0].generated_index if output.edits else None for output in switched]
    # (switched on at different tokens for some requests, never for others)
    assert None in at and len({index for index in at if index is not None}) > 1
    late = late_threshold(watched)
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir),
                     spec=strided_spec(late), batch_size=COUNT) as hf:
        strided = run_switched(hf)
    assert any(output.edits for output in strided)
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir), batch_size=COUNT) as hf:
        edits_only = run_edits_only(hf)
        plain = hf.generate(texts(), max_new_tokens=NEW,
                            request_ids=[f"r{i}" for i in range(COUNT)])
    steered = [i for i in range(COUNT) if edits_for(i)]
    assert len(steered) == COUNT // 2
    for i in range(COUNT):
        if i in steered:
            assert outputs[i].edits
        else:
            assert outputs[i].edits == () and outputs[i].token_ids == plain[i].token_ids
    changed = [i for i in steered if outputs[i].token_ids != plain[i].token_ids]
    assert len(changed) >= COUNT // 4  # the edits matter, so the comparison can fail
    for request in TRIGGERED:
        index = int(request[1:])
        assert outputs[index].edited_tokens[0] == 3
        assert outputs[index].token_ids[:4] == plain[index].token_ids[:4]
    assert sum(a.token_ids[:NEW] != p.token_ids
               for a, p in zip(always_on, plain, strict=False)) >= 2
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir), spec=ALWAYS_ON_SPEC,
                     batch_size=COUNT) as hf:
        ending = run_ending(hf)
    assert sum(e.token_ids[:NEW] != p.token_ids
               for e, p in zip(ending, plain, strict=False)) >= 2
    with ProbedModel(model, AutoTokenizer.from_pretrained(model_dir), spec=STRIDED_SPEC,
                     batch_size=COUNT) as hf:
        strided_edit = run_strided_edit(hf)
    assert all(len(output.edits) == 8 for output in strided_edit)  # (generated 0, 2, .. 14)
    return (outputs, edits_only, always_on, (threshold, switched), (late, strided), ending,
            strided_edit)


def _engine(model_dir, ranks, budget=CHUNK_BUDGET):
    from undercurrent.adapters.vllm.backend import VLLMBackend

    return VLLMBackend.from_pretrained(model_dir, dtype="float32", max_model_len=256,
                                       max_num_batched_tokens=budget,
                                       tensor_parallel_size=ranks)


@pytest.mark.parametrize("ranks", [1, 2])
def test_steered_requests_match_hf_tokens_records_and_edits(model_dir, reference, ranks):
    with_points, edits_only, *_ = reference
    backend = _engine(model_dir, ranks)
    try:
        # Steps that capture nothing report their edits at the end of the call.
        alone = run_edits_only(ProbedModel(backend))
        for ours, theirs in zip(alone, edits_only, strict=True):
            assert ours.token_ids == theirs.token_ids, ours.request_id
            assert list(ours.edits) == list(theirs.edits)
        assert sum(bool(o.edits) for o in alone) == COUNT // 2 - len(TRIGGERED)
        with ProbedModel(backend, spec=SPEC, probes={"flag_at": flag_at}) as model:
            check_same(run(model), with_points)
            with pytest.raises(Exception, match="capture_last_token"):
                model.generate(texts()[:1], max_new_tokens=2, capture_last_token=True,
                               edits=edits_for(0))
    finally:
        backend.close()




def test_the_worker_keeps_no_device_copy_of_a_call_s_edits_once_it_ends(model_dir,
                                                                       monkeypatch):
    """The worker resolves each call's edits anew and caches their vectors on the
    device by edit: once the call's requests are released, those copies go (they
    piled up, one set per call, until close())."""
    from undercurrent.adapters.vllm import worker

    before, after = [], []
    release = worker._Capture.release

    def recording(self, engine_ids):
        before.append(len(self.kernels._vectors))
        release(self, engine_ids)
        after.append(len(self.kernels._vectors))

    monkeypatch.setattr(worker._Capture, "release", recording)
    backend = _engine(model_dir, 1)
    try:
        model = ProbedModel(backend)
        for _ in range(3):
            outputs = model.generate(texts()[:2], max_new_tokens=4, edits=edits_for(0))
            assert all(output.edits for output in outputs)
            assert after[-1] == 0
        events = list(model.stream(texts()[0], max_new_tokens=4, edits=edits_for(0)))
        assert events[-1].output.edits and after[-1] == 0
        assert max(before) > 0  # (the edits were cached while their requests ran)
    finally:
        backend.close()


def test_always_on_edits_of_every_request_repeat_their_plans_and_match_hf(
        model_dir, reference, monkeypatch):
    """Every request steered by always-on edits: from the third generated token
    the worker repeats each step's plan with its edits (``_edits_repeat``, then
    the plan shifted a token at a time), it sends its steps several at a time
    (no answer of the driver can change a step: no triggered edit, no probe
    that may abort), and the tokens, records, edited flags and applied edits
    are HF's."""
    from undercurrent.adapters.vllm import worker
    from undercurrent.adapters.vllm.channel import StepServer

    sent: list[int] = []  # the steps each exchange carried
    answer = StepServer.answer

    def counted_answer(server, batch):
        sent.append(1 + len(batch.earlier))
        return answer(server, batch)

    monkeypatch.setattr(StepServer, "answer", counted_answer)

    repeated: list[bool] = []
    edits_repeat = worker._edits_repeat

    def counted(plan, fed):
        repeated.append(edits_repeat(plan, fed))
        return repeated[-1]

    monkeypatch.setattr(worker, "_edits_repeat", counted)
    edited_shifts = _count_edited_repeats(monkeypatch)
    backend = _engine(model_dir, 1)
    try:
        with ProbedModel(backend, spec=ALWAYS_ON_SPEC) as model:
            check_same(run_always_on(model), reference[2])
    finally:
        backend.close()
    assert repeated and all(repeated) and sum(edited_shifts) >= 10
    assert sent and max(sent) > 1


def test_edits_that_end_leave_the_steps_around_them_repeated_and_match_hf(
        model_dir, reference, monkeypatch):
    """Every request with the same edits of the prompt's last token, of a slice
    of generated tokens and of one generated token: the worker repeats each
    step's plan within the slice (with its edit) and between and after them
    (the steps planned afresh: those where an edit starts or ends), the
    driver repeats its plans up to each such step, and the tokens, records,
    edited flags and applied edits are HF's."""
    from undercurrent.adapters.session import StepPlan

    fresh: list[int] = []  # each decode step planned a request at a time
    add_window = StepPlan.add_window

    def counted(plan, state, start, stop, slot_of):
        if stop - start == 1 and start >= state.prompt_len:
            fresh.append(start - state.prompt_len)
        return add_window(plan, state, start, stop, slot_of)

    monkeypatch.setattr(StepPlan, "add_window", counted)
    edited_shifts = _count_edited_repeats(monkeypatch)
    planned = _count_column_plans(monkeypatch)
    from undercurrent.adapters import delivery

    alone: list[int] = []  # (decode steps the driver routed as they came)
    deliver_matches = delivery._deliver_matches

    def counted_alone(session, matches, sources):
        if matches and all(match.token_index >= match.state.prompt_len for match in matches):
            alone.append(matches[0].token_index - matches[0].state.prompt_len)
        return deliver_matches(session, matches, sources)

    monkeypatch.setattr(delivery, "_deliver_matches", counted_alone)
    backend = _engine(model_dir, 1)
    try:
        with ProbedModel(backend, spec=ALWAYS_ON_SPEC) as model:
            check_same(run_ending(model), reference[5])
    finally:
        backend.close()
    # (the steps whose edits differ from the next one's are not repeated, but
    # held in the window like the others, not routed as they come)
    assert alone == [], alone
    # (planned afresh only where an edit starts or ends for some request fed:
    # two of them a step behind the others, their prompts' prefill split; each
    # step after the last edit, and the slice's middle, repeated)
    assert fresh and max(fresh) <= 12 and not {4, 5, 6} & set(fresh), fresh
    assert sum(edited_shifts) >= 4  # (the slice's steps repeated with its edit)
    # (the driver plans from columns where an edit starts or ends for some
    # request, and repeats the rest: 10 of the 20 steps; 15 when each step up
    # to the last edit's end was planned)
    assert planned and len(planned) <= 12, len(planned)


def test_an_edit_of_the_points_stride_repeats_with_their_strided_plan_and_matches_hf(
        model_dir, reference, monkeypatch):
    """A point of every second generated token beside an edit of the same
    tokens, two requests (prefilled in one step: in phase, as a strided
    layout must be to repeat): the worker repeats the captured steps' plan a
    stride later with the edit (nothing planned between), and the tokens,
    records, edited flags and applied edits are HF's."""
    edited_shifts = _count_edited_repeats(monkeypatch)
    backend = _engine(model_dir, 1)
    try:
        with ProbedModel(backend, spec=STRIDED_SPEC) as model:
            check_same(run_strided_edit(model), reference[6])
    finally:
        backend.close()
    assert sum(edited_shifts) >= 3


def test_a_guard_switching_an_edit_on_keeps_the_steps_repeated_and_matches_hf(
        model_dir, reference, monkeypatch):
    """Every request's edit waits for its guard's flag (a built-in linear probe),
    which comes at a different token for each of half of them: the worker
    repeats its steps before and after each switch (the switch drops the plans
    kept, and the request is steady again from the token after the signal's,
    with the edit at its row), the driver repeats its plans too (its rows'
    edits read from the requests' logs), and the tokens, records, edited flags
    and applied edits are HF's."""
    threshold, theirs = reference[3]
    edited_shifts = _count_edited_repeats(monkeypatch)
    planned = _count_column_plans(monkeypatch)
    backend = _engine(model_dir, 1)
    try:
        with ProbedModel(backend, spec=switched_spec(threshold)) as model:
            check_same(run_switched(model), theirs)
    finally:
        backend.close()
    # (the worker repeats plans that apply the edit; the driver plans a few
    # steps from their columns: at the start and after each switch)
    assert sum(edited_shifts) >= 4
    assert planned and len(planned) < SWITCHED_NEW // 2 + SWITCHED_COUNT


def test_a_guard_beside_a_strided_point_repeats_its_cycle_until_the_switch_and_matches_hf(
        model_dir, reference, monkeypatch):
    """The guard of the last test, at a threshold reached late, beside a point
    of stride 2: before the switches the worker repeats a cycle of two plans
    (the triggered edit applies nowhere yet: ``RequestState.repeats_every``),
    a switch drops it, and the tokens, records, edited flags and applied
    edits are HF's."""
    from undercurrent.adapters.vllm import worker

    threshold, theirs = reference[4]
    cycles: list[bool] = []
    cycled = worker._Capture._cycled

    def counted(capture, phase, fed, forward):
        found = cycled(capture, phase, fed, forward)
        cycles.append(found is not None)
        return found

    monkeypatch.setattr(worker._Capture, "_cycled", counted)
    # (every prompt prefilled in one step, so that the requests decode in
    # phase: a prompt split over steps puts its request a token behind, and
    # requests out of phase with a point of stride 2 make no cycle)
    backend = _engine(model_dir, 1, budget=2048)
    try:
        with ProbedModel(backend, spec=strided_spec(threshold)) as model:
            check_same(run_switched(model), theirs)
    finally:
        backend.close()
    assert True in cycles
