"""HF backend edits, each proved against a hand-written forward hook on plain
``generate()``: tokens and logits, every op, per-prompt isolation, triggers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from oracles import (  # noqa: E402
    PROMPTS,
    hooked_generate,
    op_reference,
    probed_generate,
    unit,
)

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.probes import Probe  # noqa: E402
from undercurrent.records import ProbeSignal, SignalAction  # noqa: E402
from undercurrent.spec import Edit, ExtractionPoint, SpecValidationError  # noqa: E402

HIDDEN = 128
NEW = 12


def direction(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(HIDDEN, generator=generator) * scale


def edit(op: str = "add", vector: torch.Tensor | None = None, coefficient: float = 4.0,
         layer: int = 1, tensor_type: str = "residual_stream", position: str = "generated[*]",
         name: str = "steer", **fields) -> Edit:
    vector = direction() if vector is None else vector
    return Edit(name=name, layers=layer, tensor_type=tensor_type, position=position, op=op,
                vector=vector.tolist(), coefficient=coefficient, **fields)


def decode_rows(rows: set[int] | None, change, first_forward: int = 1):
    """A hand hook body: on decode forwards >= first_forward, ``change`` the rows."""
    def edit_rows(forward: int, hidden: torch.Tensor):
        if forward < first_forward or hidden.shape[1] != 1:
            return None
        out = hidden.clone()
        for row in range(hidden.shape[0]) if rows is None else rows:
            out[row, 0] = change(hidden[row, 0:1])[0]
        return out
    return edit_rows


def test_add_on_generated_tokens_equals_a_hand_hook_in_tokens_and_logits(tiny):
    v = direction()
    outputs, recorded = probed_generate(tiny, PROMPTS, NEW, edits=[edit("add", v, 4.0)])
    expected, oracle = hooked_generate(tiny, PROMPTS, NEW, 1, "residual_stream",
                                       decode_rows(None, lambda h: h + 4.0 * v))
    plain, _ = hooked_generate(tiny, PROMPTS, NEW, 1, "residual_stream", lambda f, h: None)
    assert [list(o.token_ids) for o in outputs] == expected
    assert expected != plain  # the edit changes what the model writes
    for row, output in enumerate(outputs):
        count = len(output.token_ids)
        assert torch.equal(recorded.row(row, count), oracle.row(row, count))
    assert all(o.edits for o in outputs)


def test_coefficient_zero_gives_the_plain_tokens(tiny):
    plain = [o.token_ids for o in tiny.generate(PROMPTS, max_new_tokens=NEW)]
    edited = tiny.generate(PROMPTS, max_new_tokens=NEW, edits=[edit(coefficient=0.0)])
    assert [o.token_ids for o in edited] == plain


@pytest.mark.parametrize(("op", "coefficient", "norm_match", "tensor_type", "layer"), [
    ("add", 0.5, True, "mlp_out", 2),
    ("project_out", 1.0, False, "residual_stream", 1),
    ("clamp", -6.0, False, "attn_out", 0),
    ("scale", 3.0, False, "residual_stream", 2),
])
def test_each_op_matches_its_own_oracle(tiny, op, coefficient, norm_match, tensor_type, layer):
    v = direction(seed=3, scale=2.0)
    extra = {"norm_match": True} if norm_match else {}
    outputs, recorded = probed_generate(
        tiny, PROMPTS, NEW,
        edits=[edit(op, v, coefficient, layer=layer, tensor_type=tensor_type, **extra)])
    expected, oracle = hooked_generate(
        tiny, PROMPTS, NEW, layer, tensor_type,
        decode_rows(None, lambda h: op_reference(op, h, v, coefficient, norm_match)))
    assert [list(o.token_ids) for o in outputs] == expected
    for row, output in enumerate(outputs):
        count = len(output.token_ids)
        torch.testing.assert_close(recorded.row(row, count), oracle.row(row, count),
                                   rtol=1e-5, atol=1e-5)


def test_project_out_leaves_no_component_at_the_same_site_and_the_record_says_edited(tiny):
    v = direction(seed=5)
    point = ExtractionPoint(name="look", layers=(1, 2), tensor_type="residual_stream",
                            position="generated[*]", probe_type="norm_probe",
                            probe_kind="single_shot")
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=[point]) as probed:
        outputs = probed.generate(PROMPTS, max_new_tokens=NEW, records=True,
                                  edits=[edit("project_out", v, 1.0, layer=1)])
        before = probed.generate(PROMPTS, max_new_tokens=NEW, records=True)
    u = unit(v)
    for output in outputs:
        at_site = [r for r in output.records if r.layer == 1]
        assert at_site and all(r.edits == ("steer",) and r.edited for r in at_site)
        assert max(abs(float(r.tensor @ u)) for r in at_site) < 1e-5
        downstream = [r for r in output.records if r.layer == 2]
        assert all(r.edits == () for r in downstream)
    untouched = [r for o in before for r in o.records if r.layer == 1]
    assert max(abs(float(r.tensor @ u)) for r in untouched) > 0.1  # the oracle can fail


def test_only_the_prompt_with_an_edit_changes_in_a_batch_of_three(tiny):
    v = direction(seed=7)
    plain = [list(o.token_ids) for o in tiny.generate(PROMPTS, max_new_tokens=NEW)]
    for steered in range(3):
        prompt_edits = [None, None, None]
        prompt_edits[steered] = [edit("add", v, 5.0)]
        outputs = tiny.generate(PROMPTS, max_new_tokens=NEW, prompt_edits=prompt_edits)
        expected, _ = hooked_generate(tiny, PROMPTS, NEW, 1, "residual_stream",
                                      decode_rows({steered}, lambda h: h + 5.0 * v))
        tokens = [list(o.token_ids) for o in outputs]
        assert tokens == expected
        for row in range(3):
            if row == steered:
                assert tokens[row] != plain[row] and outputs[row].edits
            else:
                assert tokens[row] == plain[row] and outputs[row].edits == ()


def test_prompt_positions_are_edited_during_prefill(tiny):
    v = direction(seed=9)
    outputs = tiny.generate(PROMPTS, max_new_tokens=NEW,
                            edits=[edit("add", v, 8.0, position="prompt[-1]")])

    def prefill_last(forward, hidden):
        if forward != 0:
            return None
        out = hidden.clone()
        out[:, -1] += 8.0 * v  # left padding: every prompt ends in the last column
        return out

    expected, _ = hooked_generate(tiny, PROMPTS, NEW, 1, "residual_stream", prefill_last)
    assert [list(o.token_ids) for o in outputs] == expected
    assert [(e.token_index, e.generated_index) for e in outputs[0].edits] == [
        (outputs[0].prompt_len - 1, None)]


class FlagAt(Probe):
    """Flags the request whose prompt contains ``word`` at generated token ``at``."""

    probe_kind = "single_shot"

    def __init__(self, word: str, at: int) -> None:
        self.word, self.at = word, at

    def on_start(self, ctx):
        self.mine = self.word in ctx.prompt

    def on_activation(self, record):
        hit = self.mine and record.generated_index == self.at
        return ProbeSignal(SignalAction.FLAG if hit else SignalAction.CONTINUE, score=0.0)

    def on_end(self, ctx):
        return None


def test_a_triggered_edit_applies_from_the_pass_after_the_flagging_token(tiny):
    v = direction(seed=11)
    watch = ExtractionPoint(name="watch", layers=(0,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="flag_at",
                            probe_kind="single_shot", probe_args={"word": "office", "at": 2})
    steer = edit("add", v, 6.0, when={"point": "watch", "action": "flag"})
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=[watch],
                     probes={"flag_at": FlagAt}) as probed:
        outputs = probed.generate(PROMPTS, max_new_tokens=NEW, edits=[steer])
    plain = [list(o.token_ids) for o in tiny.generate(PROMPTS, max_new_tokens=NEW)]
    # Token 2's record is made in the pass that feeds token 2 (forward 3); the edit
    # first applies to the pass that feeds token 3 (forward 4), which samples token 4.
    expected, _ = hooked_generate(tiny, PROMPTS, NEW, 1, "residual_stream",
                                  decode_rows({1}, lambda h: h + 6.0 * v, first_forward=4))
    tokens = [list(o.token_ids) for o in outputs]
    assert tokens[1][:4] == plain[1][:4]
    assert tokens[1] == expected[1] and tokens[1][4:] != plain[1][4:]
    assert tokens[0] == plain[0] and tokens[2] == plain[2]
    assert outputs[0].edits == () and outputs[2].edits == ()
    assert outputs[1].edited_tokens == tuple(range(3, len(tokens[1]) - 1))
    assert outputs[1].steered_tokens == tuple(range(4, len(tokens[1])))
    assert {e.generated_index for e in outputs[1].edits} == set(range(3, len(tokens[1]) - 1))


@pytest.mark.parametrize("watched", ["generated[2]", "generated[0:3]"])
def test_a_triggered_strided_edit_applies_at_its_own_tokens_beside_points_of_another_phase(
        tiny, watched):
    # An edit of the even tokens, switched on by a flag at generated token 2,
    # beside a point of the odd tokens (the one token after the flag is in the
    # point's phase, not the edit's): the edit applies from token 4 at every second
    # token, as a hand hook on the even tokens from 4 gives.
    v = direction(seed=12)
    watch = ExtractionPoint(name="watch", layers=(0,), tensor_type="residual_stream",
                            position=watched, probe_type="flag_at", probe_kind="single_shot",
                            probe_args={"word": "office", "at": 2})
    odd = ExtractionPoint(name="odd", layers=(2,), tensor_type="residual_stream",
                          position="generated[1:]", stride=2, probe_type="norm_probe",
                          probe_kind="single_shot")
    steer = edit("add", v, 8.0, layer=2, stride=2, when={"point": "watch", "action": "flag"})
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=[watch, odd],
                     probes={"flag_at": FlagAt}) as probed:
        outputs = probed.generate(PROMPTS, max_new_tokens=NEW, edits=[steer])

    def even_from_4(forward: int, hidden: torch.Tensor):  # (forward k feeds token k - 1)
        fed = forward - 1
        if fed < 4 or fed % 2 or hidden.shape[1] != 1:
            return None
        out = hidden.clone()
        out[1, 0] += 8.0 * v
        return out

    expected, _ = hooked_generate(tiny, PROMPTS, NEW, 2, "residual_stream", even_from_4)
    assert [list(o.token_ids) for o in outputs] == expected
    assert outputs[1].edited_tokens == tuple(range(4, NEW - 1, 2))
    assert outputs[0].edits == () and outputs[2].edits == ()


def test_spec_edits_apply_to_every_request_and_stream_takes_edits(tiny):
    v = direction(seed=13)
    spec = {"version": "2", "extraction_points": [],
            "edits": [{"name": "s", "layers": 1, "tensor_type": "residual_stream",
                       "position": "generated[*]", "op": "add", "vector": v.tolist(),
                       "coefficient": 4.0}]}
    expected, _ = hooked_generate(tiny, PROMPTS, NEW, 1, "residual_stream",
                                  decode_rows(None, lambda h: h + 4.0 * v))
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=spec) as probed:
        assert [list(o.token_ids) for o in probed.generate(PROMPTS, max_new_tokens=NEW)] \
            == expected
    streamed = [event for event in tiny.stream(PROMPTS[0], max_new_tokens=NEW,
                                                edits=[edit("add", v, 4.0)])]
    assert list(streamed[-1].output.token_ids) == expected[0]
    # Token 0 comes from the prefill (unedited); every later token is sampled under
    # the edit of the token fed before it.
    assert [bool(e.edits) for e in streamed[:-1]] == [False] + [True] * (NEW - 1)
    assert streamed[-1].output.steered_tokens == tuple(range(1, NEW))


@pytest.mark.parametrize("ending", ["capture_last_token", "abort"])
def test_a_stream_s_events_carry_every_applied_edit_the_last_one_included(tiny, ending):
    # The last event carries the edits no token's event did: those of
    # capture_last_token's extra forward, or of the forward pass whose
    # activations aborted the request (no token is sampled from it).
    v = direction(seed=17, scale=0.1)
    spec = [ExtractionPoint(
        name="guard", layers=(2,), tensor_type="residual_stream", position="generated[3]",
        probe_type="norm_probe", probe_kind="single_shot",
        probe_args={"threshold": 0.0, "action": "abort" if ending == "abort" else "flag"})]
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=spec) as probed:
        events = list(probed.stream(PROMPTS[0], max_new_tokens=NEW, edits=[edit("add", v)],
                                    capture_last_token=ending == "capture_last_token"))
    output = events[-1].output
    assert output.aborted == (ending == "abort")
    last = output.prompt_len + len(output.token_ids) - 1
    assert output.edits[-1].token_index == last  # (the aborting token's, or the last's)
    assert events[-1].edits == (output.edits[-1],)
    if ending == "abort":  # (token g's event: the edit of the token fed to sample it)
        assert [[a.generated_index for a in event.edits] for event in events] == [
            [], [0], [1], [2], [3]]
    assert [a for event in events for a in event.edits] == list(output.edits)
    assert [s for event in events for s in event.signals] == list(output.signals)


def test_registration_refuses_a_wrong_size_an_unknown_point_and_an_async_trigger(tiny):
    with pytest.raises(SpecValidationError, match=r"edits\[0\] \(name 'steer'\), field "
                                                  r"'vector': has 3 numbers .* hidden size is 128"):
        tiny.generate(PROMPTS[0], edits=[edit(vector=torch.ones(3))])
    with pytest.raises(SpecValidationError, match=r"field 'when.point': names no extraction"):
        tiny.generate(PROMPTS[0], edits=[edit(when={"point": "nowhere"})])
    with pytest.raises(SpecValidationError, match=r"field 'layers': layer\(s\) \[9\]"):
        tiny.generate(PROMPTS[0], edits=[edit(layer=9)])
    observer = ExtractionPoint(name="obs", layers=(0,), tensor_type="residual_stream",
                               position="generated[*]", probe_type="norm_probe",
                               probe_kind="trajectory", execution_mode="async")
    spec = {"version": "2", "extraction_points": [], "edits": [
        {"name": "e", "layers": 0, "tensor_type": "mlp_out", "position": 0, "op": "add",
         "vector": [1.0] * 5}]}
    with pytest.raises(SpecValidationError, match="hidden size"):
        ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=spec)
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=[observer]) as probed, \
            pytest.raises(SpecValidationError, match="async"):
        probed.generate(PROMPTS[0], edits=[edit(when={"point": "obs"})])
    with pytest.raises(SpecValidationError, match="unique"):
        tiny.generate(PROMPTS[0], edits=[edit(), edit()])
    with pytest.raises(ValueError, match="one entry per prompt"):
        tiny.generate(PROMPTS, prompt_edits=[None])


def test_a_coefficient_times_vector_past_the_model_s_dtype_is_refused(tiny):
    # (coefficient=1e300 is finite, but c*v is inf in float32: every later
    # activation was NaN and the model emitted token 0, silently)
    with pytest.raises(SpecValidationError, match=r"edits\[0\] \(name 'steer'\), field "
                                                  r"'coefficient': coefficient 1e\+300 times "
                                                  r"the vector .* largest finite float32"):
        tiny.generate(PROMPTS[0], edits=[edit(coefficient=1e300)])
    with pytest.raises(SpecValidationError, match="unit direction .* float32"):
        tiny.generate(PROMPTS[0], edits=[edit("clamp", coefficient=-1e40)])
    from undercurrent.steering.vectors import resolve_edit

    # c*v is what counts: a vector past float16's range times a small c is fine,
    # a unit vector times a c past it is not (and float64 reaches further)
    assert resolve_edit(edit(vector=direction(scale=1e6), coefficient=1e-3), HIDDEN,
                        dtype="float16").name == "steer"
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(SpecValidationError, match=f"largest finite {dtype}"):
            resolve_edit(edit("scale", coefficient=1e40 if dtype == "bfloat16" else 1e6),
                         HIDDEN, dtype=dtype)
    assert resolve_edit(edit(coefficient=1e300), HIDDEN, dtype="float64").name == "steer"


def test_edits_and_prompt_edits_of_the_wrong_shape_are_refused_naming_the_argument(tiny):
    # (edits="steer" was read one character per edit; prompt_edits=[5] failed inside
    # Python, and a generator had no len())
    with pytest.raises(TypeError, match=r"edits must be a list of edits .* got str \('steer'\)"):
        tiny.generate(PROMPTS[0], edits="steer")
    with pytest.raises(TypeError, match=r"one entry per prompt \(1\), each a list of edits "
                                        r"or None; prompt_edits\[0\] is int \(5\)"):
        tiny.generate(PROMPTS[0], prompt_edits=[5])
    with pytest.raises(TypeError, match=r"prompt_edits must be a list .* got str"):
        tiny.generate(PROMPTS[0], prompt_edits="steer")
    with pytest.raises(TypeError, match=r"prompt_edits\[0\] is a single Edit: wrap it in a list"):
        tiny.generate(PROMPTS[0], prompt_edits=[edit()])
    v = direction(seed=5)
    listed = tiny.generate(PROMPTS[:2], max_new_tokens=NEW,
                           prompt_edits=[[edit("add", v, 5.0)], None])
    generated = tiny.generate(PROMPTS[:2], max_new_tokens=NEW,
                              prompt_edits=(e for e in [[edit("add", v, 5.0)], None]))
    assert [o.token_ids for o in generated] == [o.token_ids for o in listed]


def test_capture_last_token_replays_the_edits_so_every_record_matches_a_full_forward(tiny):
    v = direction(seed=17)
    point = ExtractionPoint(name="after", layers=(2,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="norm_probe",
                            probe_kind="trajectory")
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=[point]) as probed:
        (output,) = probed.generate(PROMPTS[2], max_new_tokens=NEW, records=True,
                                    capture_last_token=True,
                                    edits=[edit("add", v, 3.0, layer=1)])
    assert [r.generated_index for r in output.records] == list(range(NEW))
    # Oracle: one forward over prompt + reply, the addition on every generated position.
    model = tiny.backend.model
    ids = torch.tensor([list(output.prompt_token_ids) + list(output.token_ids)])
    start = output.prompt_len

    def add(module, args, hidden):
        hidden = hidden.clone()
        hidden[:, start:] += 3.0 * v
        return hidden

    handle = model.model.layers[1].register_forward_hook(add)
    try:
        with torch.no_grad():
            states = model(input_ids=ids, output_hidden_states=True).hidden_states[3][0]
    finally:
        handle.remove()
    for record in output.records:
        torch.testing.assert_close(record.tensor, states[record.token_index],
                                   rtol=1e-4, atol=1e-4)
    assert output.edited_tokens == tuple(range(NEW))  # the replay edits the last token too


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("device", "dtype"), [
    ("cpu", "bfloat16"),
    pytest.param("cuda", "float32", marks=CUDA),
    pytest.param("cuda", "bfloat16", marks=CUDA),
])
def test_add_on_the_model_s_device_and_dtype_equals_a_hand_hook(device, dtype):
    """The vector reaches the rows' device and dtype: tokens and logits equal a hand
    hook adding the same vector, cast the same way, on plain ``generate()``."""
    probed = ProbedModel.from_pretrained("undercurrent/tiny", device=device, dtype=dtype)
    try:
        v = direction()
        outputs, recorded = probed_generate(probed, PROMPTS, NEW, edits=[edit("add", v, 4.0)])
        expected, oracle = hooked_generate(
            probed, PROMPTS, NEW, 1, "residual_stream",
            decode_rows(None, lambda h: h + (4.0 * v.double()).to(device=h.device,
                                                                    dtype=h.dtype)))
        plain, _ = hooked_generate(probed, PROMPTS, NEW, 1, "residual_stream",
                                   lambda f, h: None)
        assert [list(o.token_ids) for o in outputs] == expected
        assert expected != plain
        for row, output in enumerate(outputs):
            count = len(output.token_ids)
            assert recorded.row(row, count).device.type == device
            assert torch.equal(recorded.row(row, count), oracle.row(row, count))
    finally:
        probed.close()


def test_a_large_vector_times_a_small_coefficient_stays_finite_on_a_float16_model():
    """``c*v`` is computed in float64 and cast once: a vector past float16's range
    (a probe's raw weights, say) times a small coefficient adds a finite value, the
    one a hand hook adding ``(c*v)`` cast to float16 adds (it was cast first: inf)."""
    probed = ProbedModel.from_pretrained("undercurrent/tiny", dtype="float16")
    try:
        v = direction().double() * 1e5       # entries past 65504
        c = 1e-3                             # c*v well inside float16
        outputs, recorded = probed_generate(probed, PROMPTS, NEW,
                                            edits=[edit("add", v, c)])
        added = c * v
        expected, oracle = hooked_generate(
            probed, PROMPTS, NEW, 1, "residual_stream",
            decode_rows(None, lambda h: h + added.to(dtype=h.dtype)))
        assert [list(o.token_ids) for o in outputs] == expected
        for row, output in enumerate(outputs):
            count = len(output.token_ids)
            assert torch.isfinite(recorded.row(row, count)).all()
            assert torch.equal(recorded.row(row, count), oracle.row(row, count))
    finally:
        probed.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_norm_match_takes_the_norm_of_half_precision_rows_in_float32(dtype):
    """A float16 row of finite elements may have a norm past 65504: ``norm_match``
    rescales by the norm taken in float32, so the edited row is finite and equals
    the change computed in float64, cast and added in the rows' dtype."""
    from undercurrent.steering.kernels import EditKernels
    from undercurrent.steering.vectors import resolve_edit

    rows = torch.full((2, HIDDEN), 6000.0, dtype=getattr(torch, dtype))  # |h| ~ 67882
    rows[1] *= 0.5
    v = direction(seed=7)
    resolved = resolve_edit(edit("add", v, 0.01, norm_match=True), hidden_size=HIDDEN)
    edited = EditKernels().apply(resolved, rows)
    exact = rows.double()
    change = 0.01 * exact.norm(dim=-1, keepdim=True) * unit(v.double())
    assert torch.isfinite(edited).all()
    torch.testing.assert_close(edited, rows + change.to(rows.dtype))


@pytest.mark.parametrize(("op", "coefficient"), [
    ("project_out", 0.001), ("clamp", 5e4), ("scale", 1.001)])
def test_a_float16_row_s_component_past_65504_is_projected_in_float32(op, coefficient):
    """A float16 row of finite elements may have a component along ``u`` past
    65504 (here: a large vector added just before, at the same site):
    ``project_out``, ``clamp`` and ``scale`` take ``h.u`` in float32 and cast the
    change once, so the rows stay finite and match a hand hook that computes the
    change in float64 and casts it once (``h.u`` in float16 was inf)."""
    probed = ProbedModel.from_pretrained("undercurrent/tiny", dtype="float16")
    try:
        v = direction(seed=19)
        large = unit(v.double()) * 1e5  # every element below 65504, h.u past it
        edits = [edit("add", large, 1.0), edit(op, v, coefficient, name="then")]
        outputs, recorded = probed_generate(probed, PROMPTS, NEW, edits=edits)

        def by_hand(h: torch.Tensor) -> torch.Tensor:
            added = h + large.to(h.dtype)
            exact = op_reference(op, added.double(), v.double(), coefficient)
            return added + (exact - added.double()).to(h.dtype)

        expected, oracle = hooked_generate(probed, PROMPTS, NEW, 1, "residual_stream",
                                           decode_rows(None, by_hand))
        assert [list(o.token_ids) for o in outputs] == expected
        for row, output in enumerate(outputs):
            count = len(output.token_ids)
            assert torch.isfinite(recorded.row(row, count)).all()
            torch.testing.assert_close(recorded.row(row, count), oracle.row(row, count),
                                       rtol=1e-2, atol=1e-2)
    finally:
        probed.close()


def test_a_call_time_edit_problem_names_the_list_and_position_the_user_wrote(tiny):
    # The edits of a call were checked merged (spec, then edits=, then one prompt's
    # list), and a problem was named by its place in that merged list.
    spec = {"version": "2", "extraction_points": [], "edits": [
        {"name": "s", "layers": 0, "tensor_type": "mlp_out", "position": 0, "op": "add",
         "vector": [1.0] * HIDDEN}]}
    two = PROMPTS[:2]
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=spec) as probed:
        cases = [
            ({"edits": [edit(name="a"), edit(name="a")]},
             "edits[1] (name 'a'), field 'name': duplicate name 'a': already used by edits[0]"),
            ({"edits": [edit(name="a")], "prompt_edits": [None, [edit(name="b"), edit(name="a")]]},
             "prompt_edits[1][1] (name 'a'), field 'name': duplicate name 'a': already used by "
             "edits[0]"),
            ({"prompt_edits": [None, [edit(name="b"), edit(name="b")]]},
             "prompt_edits[1][1] (name 'b'), field 'name': duplicate name 'b': already used by "
             "prompt_edits[1][0]"),
            ({"prompt_edits": [[edit(name="s")], None]},
             "prompt_edits[0][0] (name 's'), field 'name': duplicate name 's': already used by "
             "the spec's edits[0]"),
            ({"prompt_edits": [[edit(name="ok")], [edit(name="c", vector=torch.ones(3))]]},
             "prompt_edits[1][0] (name 'c'), field 'vector': has 3 numbers"),
            ({"prompt_edits": [None, [{"name": "m"}]]}, "prompt_edits[1][0] (name 'm')"),
        ]
        for arguments, message in cases:
            with pytest.raises(SpecValidationError) as caught:
                probed.generate(two, max_new_tokens=1, **arguments)
            assert message in str(caught.value), (arguments, str(caught.value))
        # every prompt's problems at once (it stopped at the first prompt's)
        with pytest.raises(SpecValidationError) as caught:
            probed.generate(two, max_new_tokens=1, prompt_edits=[
                [edit(name="x", vector=torch.ones(3))], [edit(name="y", vector=torch.ones(3))]])
        assert "prompt_edits[0][0] (name 'x')" in str(caught.value)
        assert "prompt_edits[1][0] (name 'y')" in str(caught.value)
        # one edit where a prompt's list belongs: named as prompt_edits[i]
        for single in (edit(name="z"), {"name": "z"}):
            with pytest.raises(TypeError, match=r"prompt_edits\[1\] is a single \w+: wrap "
                                                r"it in a list"):
                probed.generate(two, max_new_tokens=1, prompt_edits=[None, single])
