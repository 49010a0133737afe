"""Arguments of generate()/stream()/from_pretrained(): wrong ones fail with a message
naming the argument and what would be right, and the context-length bound is the
one plain transformers ``generate()`` actually has."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.models import tiny_model_path  # noqa: E402
from undercurrent.spec.types import ExtractionPoint  # noqa: E402

POSITIONS = 64


@cache
def gpt2_with_short_context() -> Any:
    """A tiny GPT-2 with 64 learned positions and no eos: plain ``generate()`` raises
    IndexError exactly when it feeds a position past the table."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", vocab_size=64, n_positions=POSITIONS, n_embd=32,
                                  n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=None)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def probed() -> Any:
    with ProbedModel(gpt2_with_short_context(), build_tokenizer()) as pm:
        yield pm


def words(count: int) -> str:
    """A prompt of ``count`` tokens (the tokenizer prepends <bos>)."""
    return prompt(*(i % 50 for i in range(count - 1)))


def plain_generate_runs(prompt_len: int, max_new_tokens: int) -> bool:
    """The oracle: does plain transformers ``generate()`` run this length?"""
    ids = torch.full((1, prompt_len), 5, dtype=torch.long)
    try:
        with torch.no_grad():
            gpt2_with_short_context().generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0)
    except IndexError:
        return False
    return True


# -- stop -----------------------------------------------------------------------

@pytest.mark.parametrize(("stop", "got"), [(5, "got int"), (b"you", "got bytes"),
                                           ({"you"}, "got set"),
                                           (["you", 3], "stop[1] is int"),
                                           ([b"you"], "stop[0] is bytes")])
def test_stop_of_the_wrong_type_names_the_parameter_and_the_accepted_types(
        probed, stop, got) -> None:
    for call in (lambda: probed.generate([words(3)], max_new_tokens=2, stop=stop),
                 lambda: list(probed.stream(words(3), max_new_tokens=2, stop=stop))):
        with pytest.raises(TypeError) as caught:
            call()
        message = str(caught.value)
        assert message.startswith("stop must be a string or a list of strings"), message
        assert got in message


def test_stop_accepts_a_string_a_list_and_a_tuple(probed) -> None:
    runs = [probed.generate([words(3)], max_new_tokens=2, stop=stop)[0].token_ids
            for stop in ("zz", ["zz"], ("zz",), None)]
    assert runs[0] == runs[1] == runs[2] == runs[3]


@pytest.mark.parametrize("stop", ["", ["you", ""]])
def test_an_empty_stop_string_is_refused_not_skipped(probed, stop) -> None:
    # It matched nowhere (the matcher skipped it): a call ran to its length silently.
    with pytest.raises(ValueError, match=r"stop strings must not be empty; stop\[\d\] is ''"):
        probed.generate([words(3)], max_new_tokens=2, stop=stop)


# -- batch size, request ids, flags, seed ---------------------------------------

@pytest.mark.parametrize(("batch_size", "error"), [
    (0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)])
def test_a_bad_batch_size_is_refused_naming_it_and_no_prompt_is_lost(
        probed, batch_size, error) -> None:
    # -1 returned [] (both prompts dropped) and 0 used the default before.
    for call in (lambda: probed.generate([words(3)] * 2, max_new_tokens=1,
                                         batch_size=batch_size),
                 lambda: probed.prompt_activations([words(3)] * 2, batch_size=batch_size),
                 lambda: ProbedModel(gpt2_with_short_context(), build_tokenizer(),
                                     batch_size=batch_size)):
        with pytest.raises(error, match=r"^batch_size must be an integer >= 1 \(prompts per "
                                        r"generate\(\) call\)"):
            call()
    assert len(probed.generate([words(3)] * 3, max_new_tokens=1, batch_size=2)) == 3


@pytest.mark.parametrize(("request_ids", "error", "fragment"), [
    ("xy", TypeError, "request_ids must be a list of strings, one per prompt, got the str"),
    ([1, "b"], TypeError, "request_ids[0] must be a non-empty string, got int (1)"),
    (["a", None], TypeError, "request_ids[1] must be a non-empty string, got NoneType"),
    (["a", ""], TypeError, "request_ids[1] must be a non-empty string, got an empty string"),
])
def test_request_ids_are_non_empty_strings_one_per_prompt(
        probed, request_ids, error, fragment) -> None:
    with pytest.raises(error) as caught:
        probed.generate([words(3)] * 2, max_new_tokens=1, request_ids=request_ids)
    assert fragment in str(caught.value)
    for request_id in (5, ""):
        with pytest.raises(TypeError, match="request_id must be a non-empty string"):
            probed.stream(words(3), max_new_tokens=1, request_id=request_id)
    out = probed.generate([words(3)] * 2, max_new_tokens=1, request_ids=["a", "b"])
    assert [o.request_id for o in out] == ["a", "b"]


@pytest.mark.parametrize("name", ["records", "capture_last_token"])
def test_flags_are_bools_not_truthy_values(probed, name) -> None:
    # "no" was taken as True: capture_last_token="no" captured the extra token.
    with pytest.raises(TypeError, match=f"^{name} must be True or False"):
        probed.generate([words(3)], max_new_tokens=1, **{name: "no"})
    if name == "capture_last_token":
        with pytest.raises(TypeError, match=f"^{name} must be True or False"):
            ProbedModel(gpt2_with_short_context(), build_tokenizer(), capture_last_token="no")


def test_a_seed_past_torch_s_range_is_named(probed) -> None:
    with pytest.raises(ValueError, match=r"^seed must be in \[0, 2\*\*63\)"):
        probed.generate([words(3)], max_new_tokens=1, temperature=1.0, seed=2**70)


def test_numpy_sampling_numbers_sample_as_the_plain_ones_do(probed) -> None:
    # They passed undercurrent's check as they were, then transformers refused a
    # numpy float32 temperature and a numpy int64 top_k.
    import numpy as np

    plain = {"temperature": 0.75, "top_p": 0.875, "top_k": 5, "seed": 3}
    numpy = {"temperature": np.float32(0.75), "top_p": np.float32(0.875),
             "top_k": np.int64(5), "seed": np.int64(3)}
    expected = probed.generate([words(3)], max_new_tokens=6, **plain)[0].token_ids
    assert probed.generate([words(3)], max_new_tokens=6, **numpy)[0].token_ids == expected
    *_, last = probed.stream(words(3), max_new_tokens=6, **numpy)
    assert last.output.token_ids == expected


def test_a_seeded_call_samples_repeated_prompts_apart_and_reproducibly(probed) -> None:
    # Each batch was seeded with the same seed: 16 prompts in batches of 8 gave 8
    # samples, each twice. The batch starting at prompt i is seeded with seed + i.
    def samples(batch_size):
        return [o.token_ids for o in probed.generate(
            [words(3)] * 16, max_new_tokens=12, temperature=1.0, seed=0,
            batch_size=batch_size)]

    by_eight = samples(8)
    assert by_eight == samples(8)  # reproducible
    assert by_eight[:8] != by_eight[8:]
    assert len(set(by_eight)) > 8
    by_one = samples(1)
    assert len(set(by_one)) > 1 and by_one == samples(1)
    torch.manual_seed(0)  # the first batch is seeded as plain generate() would be
    ids = probed.generate([words(3)], max_new_tokens=1)[0].prompt_token_ids
    plain = gpt2_with_short_context().generate(
        torch.tensor([ids] * 8), attention_mask=torch.ones(8, len(ids), dtype=torch.long),
        max_new_tokens=12, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        pad_token_id=0)
    # (the tokenizer's eos ends a probed row; the plain oracle has none, so runs on)
    assert [tuple(row[len(ids):len(ids) + len(ours)].tolist())
            for row, ours in zip(plain, by_eight[:8], strict=True)] == by_eight[:8]


def test_two_probed_models_on_one_model_generate_one_at_a_time() -> None:
    # The lock was per ProbedModel: two on one model ran together and mixed their
    # hooks' captures. A stream holds the model's lock until its final event is
    # read, or it is closed (it was let go when the stream's generation ended, so
    # whether a call started meanwhile ran depended on timing; then it was held
    # after the final event too, until the stream was collected).
    model = gpt2_with_short_context()
    with ProbedModel(model, build_tokenizer()) as first, \
            ProbedModel(model, build_tokenizer()) as second:
        events = first.stream(words(3), max_new_tokens=4)
        next(events)  # holds the model from here
        with pytest.raises(Exception, match="a stream holds the model until its final event"):
            second.generate([words(3)], max_new_tokens=1)
        with pytest.raises(Exception, match="this model is already generating"):
            next(first.stream(words(3), max_new_tokens=1))
        events.close()
        assert len(second.generate([words(3)], max_new_tokens=2)[0].token_ids) == 2
        events = first.stream(words(3), max_new_tokens=4)
        for event in events:
            if event.finished:
                break
        # read to its final event and left: the model is free, the stream not closed
        assert events.suspended
        assert len(second.generate([words(3)], max_new_tokens=2)[0].token_ids) == 2
        assert list(events) == []
        exhausted = list(first.stream(words(3), max_new_tokens=2))
        assert exhausted[-1].finished
        assert len(second.generate([words(3)], max_new_tokens=2)[0].token_ids) == 2


@pytest.mark.parametrize("call", ["generate", "prompt_activations"])
def test_a_prompt_past_the_context_in_a_later_batch_is_named_before_any_batch_runs(
        call, tmp_path) -> None:
    # Each batch checked its own prompts as it came: prompt 5 of 6 at batch_size=2
    # was named "prompt 1", after the first two batches had run.
    texts = [words(3)] * 5 + [words(65)]
    ran: list[Any] = []
    with ProbedModel(gpt2_with_short_context(), build_tokenizer(), batch_size=2,
                     on_result=ran.append, spec=[ExtractionPoint(
                         name="p", layers=(0,), tensor_type="residual_stream",
                         position="prompt[-1]", probe_type="capture",
                         probe_kind="single_shot")]) as pm:
        run = getattr(pm, call)
        with pytest.raises(ValueError, match=r"^prompt 5 has 65 tokens"):
            run(texts, **({"max_new_tokens": 1} if call == "generate" else {}))
        assert ran == []
        # capture() calls generate() once per chunk: every prompt of the part is
        # checked before the store is made
        with pytest.raises(ValueError, match=r"^prompt 5 has 65 tokens"):
            pm.capture(texts, tmp_path / "store", max_new_tokens=1, batch_size=2,
                       progress=False)
        assert ran == [] and not (tmp_path / "store").exists()


def test_closing_a_probed_model_ends_its_open_stream_and_lets_the_model_go() -> None:
    # close() waited for the generation only: the stream left open held the model,
    # and every other ProbedModel of it was refused "already generating".
    model = gpt2_with_short_context()
    first = ProbedModel(model, build_tokenizer())
    events = first.stream(words(3), max_new_tokens=4)
    next(events)
    first.close()
    with ProbedModel(model, build_tokenizer()) as second:
        assert len(second.generate([words(3)], max_new_tokens=2)[0].token_ids) == 2


# -- context length -------------------------------------------------------------

@pytest.mark.parametrize(("prompt_len", "max_new_tokens"),
                         [(60, 5), (60, 6), (63, 2), (63, 3), (64, 1), (64, 2), (65, 1),
                          (1, 64), (1, 65), (100, 1)])
def test_context_check_accepts_exactly_what_plain_generate_runs(
        probed, prompt_len, max_new_tokens) -> None:
    text = words(prompt_len)
    assert len(probed.backend.encode(text)) == prompt_len
    runs = plain_generate_runs(prompt_len, max_new_tokens)
    if runs:
        out = probed.generate([text], max_new_tokens=max_new_tokens)[0]
        assert len(out.token_ids) == max_new_tokens
    else:
        with pytest.raises(ValueError, match="the model's context is 64"):
            probed.generate([text], max_new_tokens=max_new_tokens)


@pytest.mark.parametrize(("prompt_len", "max_new_tokens"),
                         [(100, 16), (63, 16), (60, 6), (64, 2), (65, 1), (30, 200)])
def test_context_advice_works_when_followed(probed, prompt_len, max_new_tokens) -> None:
    """Doing what the message says gives a call that runs (and plain generate agrees)."""
    with pytest.raises(ValueError) as caught:
        probed.generate([words(prompt_len)], max_new_tokens=max_new_tokens)
    advice = str(caught.value).rsplit(": ", 1)[1]
    shorter = re.search(r"shorten the prompt to at most (\d+) tokens", advice)
    fewer = re.search(r"max_new_tokens(?: <= |=)(\d+)", advice)
    if shorter:
        prompt_len = int(shorter.group(1))
    if fewer:
        max_new_tokens = int(fewer.group(1))
    assert shorter or fewer, advice
    assert plain_generate_runs(prompt_len, max_new_tokens)
    out = probed.generate([words(prompt_len)], max_new_tokens=max_new_tokens)[0]
    assert len(out.token_ids) == max_new_tokens
    # the advice is the tightest that works: one more token is refused
    if fewer and not shorter:
        assert not plain_generate_runs(prompt_len, max_new_tokens + 1)
    elif shorter and not fewer:
        assert not plain_generate_runs(prompt_len + 1, max_new_tokens)


def test_capture_last_token_counts_its_extra_forward() -> None:
    """capture_last_token feeds the last sampled token too: one position more (past
    it, the extra forward would index past the position table)."""
    from undercurrent.spec.types import ExtractionPoint

    point = ExtractionPoint(name="every", layers=(0,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="capture",
                            probe_kind="trajectory")
    with ProbedModel(gpt2_with_short_context(), build_tokenizer(), spec=[point]) as pm:
        assert pm.generate([words(60)], max_new_tokens=5)[0].token_ids
        with pytest.raises(ValueError, match="use max_new_tokens <= 4"):
            pm.generate([words(60)], max_new_tokens=5, capture_last_token=True)
        out = pm.generate([words(60)], max_new_tokens=4, capture_last_token=True,
                          records=True)[0]
    assert [r.generated_index for r in out.records] == [0, 1, 2, 3]


# -- from_pretrained --------------------------------------------------------------

@pytest.mark.parametrize("path", ["/tmp/undercurrent-no-such/model", "./no-such-model",
                                  "~/no-such-model", "a/b/c"])
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_missing_model_path_is_named(tmp_path, path, backend) -> None:
    """Before any engine loads (transformers said "Repo id must be in the form ...")."""
    with pytest.raises(FileNotFoundError) as caught:
        ProbedModel.from_pretrained(path, backend=backend)
    message = str(caught.value)
    assert message.startswith(f"model path {path!r} does not exist"), message
    assert "config.json" in message and "undercurrent/tiny" in message


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_model_path_that_is_a_file_is_refused(backend) -> None:
    """The model's own config.json or weights file is not a model path: transformers
    read it as a checkpoint (torch's UnpicklingError, or "not a valid JSON file")."""
    directory = tiny_model_path()
    for path in (directory / "config.json", directory / "model.safetensors"):
        with pytest.raises(NotADirectoryError) as caught:
            ProbedModel.from_pretrained(str(path), backend=backend)
        message = str(caught.value)
        assert message.startswith(f"model path {str(path)!r} is a file, not a directory")
        assert "pass the directory holding config.json" in message, message


def test_the_hf_backend_names_a_missing_model_path_too() -> None:
    from undercurrent.adapters.hf.backend import HFBackend

    with pytest.raises(FileNotFoundError, match="model path '/tmp/undercurrent-no-such'"):
        HFBackend.from_pretrained("/tmp/undercurrent-no-such")


@pytest.mark.parametrize(("dtype", "error", "fragment"), [
    ("float33", ValueError, "dtype='float33' is not a torch dtype"),
    ("int8", ValueError, "dtype='int8' is not a floating-point dtype"),
    ("Tensor", ValueError, "dtype='Tensor' is not a torch dtype"),
    (3, TypeError, "dtype must be a string or a torch.dtype, got int"),
])
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_wrong_dtype_is_named_with_what_would_be_right(dtype, error, fragment,
                                                         backend) -> None:
    with pytest.raises(error) as caught:
        ProbedModel.from_pretrained("undercurrent/tiny", backend=backend, dtype=dtype)
    message = str(caught.value)
    assert fragment in message
    assert "'auto' (the dtype in the model's config.json), 'float32', 'bfloat16'" in message


@pytest.mark.parametrize("dtype", ["bfloat16", "torch.bfloat16", torch.bfloat16])
def test_dtype_spellings_load_the_model_in_that_dtype(dtype) -> None:
    with ProbedModel.from_pretrained("undercurrent/tiny", dtype=dtype) as pm:
        assert pm.backend.model.dtype == torch.bfloat16
    with ProbedModel.from_pretrained("undercurrent/tiny") as pm:
        assert pm.backend.model.dtype == torch.float32


@pytest.mark.parametrize(("setting", "value"), [
    ("num_beams", 2), ("num_return_sequences", 2), ("prompt_lookup_num_tokens", 3),
    ("prefill_chunk_size", 4), ("guidance_scale", 1.5), ("assistant_early_exit", 1)])
def test_a_generation_config_that_decodes_otherwise_is_refused_naming_it(setting, value):
    # Plain generate() would search beams, return several rows per prompt, accept
    # several tokens per step (prompt lookup, early-exit drafts: this one failed with
    # a misleading error) or prefill in chunks: records and stops would follow the
    # wrong rows. Classifier-free guidance runs a second, unconditional forward
    # per token through the hooks: every generated token was recorded twice. Refused
    # for any spec (an empty one too) and stream alike.
    from undercurrent.adapters.base import BackendError

    model = gpt2_with_short_context()
    with ProbedModel(model, build_tokenizer(), spec=[]) as pm:
        before = pm.generate(words(6), max_new_tokens=3)[0].token_ids
        setattr(model.generation_config, setting, value)
        try:
            with pytest.raises(BackendError, match=re.escape(
                    f"generation_config sets {setting}={value}")) as refused:
                pm.generate([words(6), words(7)], max_new_tokens=3)
            assert f"model.generation_config.{setting} = " in str(refused.value)
            with pytest.raises(BackendError, match=setting):
                list(pm.stream(words(6), max_new_tokens=3))
        finally:
            setattr(model.generation_config, setting, 1 if setting.startswith("num_") else None)
        assert pm.generate(words(6), max_new_tokens=3)[0].token_ids == before


def test_gradient_checkpointing_in_train_mode_is_refused_naming_both_ways_out() -> None:
    # Checkpointed layers in train mode run without the cache: a kv point failed
    # with an internal error, others recorded from steps that fed the whole
    # sequence again.
    import copy

    from undercurrent.adapters.base import BackendError

    model = copy.deepcopy(build_model("llama"))
    points = [ExtractionPoint(name="kv", layers=(0,), tensor_type="kv",
                              position="generated[*]", probe_type="capture",
                              probe_kind="trajectory"),
              ExtractionPoint(name="resid", layers=(1,), tensor_type="residual_stream",
                              position="prompt[-1]", probe_type="capture",
                              probe_kind="single_shot")]
    with ProbedModel(model, build_tokenizer(), spec=points) as pm:
        before = pm.generate([words(6), words(3)], max_new_tokens=3, records=True)
        model.gradient_checkpointing_enable()
        model.train()
        refusal = re.escape("gradient checkpointing in train mode turns the KV cache off, "
                            "which undercurrent generates with: call model.eval() or "
                            "model.gradient_checkpointing_disable()")
        for call in (lambda: pm.generate([words(6), words(3)], max_new_tokens=3),
                     lambda: list(pm.stream(words(6), max_new_tokens=3)),
                     lambda: pm.prompt_activations([words(6)])):
            with pytest.raises(BackendError, match=refusal):
                call()
        for way_out in (model.eval, model.gradient_checkpointing_disable):
            way_out()
            after = pm.generate([words(6), words(3)], max_new_tokens=3, records=True)
            for output, reference in zip(after, before, strict=True):
                assert output.token_ids == reference.token_ids
                assert [(r.extraction_point_name, r.layer, r.token_index) for r in output.records
                        ] == [(r.extraction_point_name, r.layer, r.token_index)
                              for r in reference.records]
            model.gradient_checkpointing_enable()
            model.train()


def _refused_for_its_generation_config(pm: ProbedModel, name: str, value: Any,
                                      message: str) -> None:
    """With the model's generation_config setting ``name`` to ``value``, generate()
    and stream() are refused with ``message`` and the way to unset it; then unset."""
    from undercurrent.adapters.base import BackendError

    config = pm.backend.model.generation_config
    setattr(config, name, value)
    try:
        with pytest.raises(BackendError, match=re.escape(message)) as refused:
            pm.generate([words(6), words(7)], max_new_tokens=4)
        assert f"model.generation_config.{name} = None" in str(refused.value)
        with pytest.raises(BackendError, match=re.escape(message)):
            list(pm.stream(words(6), max_new_tokens=4))
    finally:
        setattr(config, name, None)


def test_stop_strings_in_the_generation_config_are_refused_pointing_to_stop() -> None:
    # A checkpoint's generation_config may ship stop_strings: every call failed with
    # transformers' "pass the tokenizer to generate()". undercurrent matches stop
    # strings itself (stop=): the setting is refused, naming it and the way out.
    model = gpt2_with_short_context()
    with ProbedModel(model, build_tokenizer(), spec=[]) as pm:
        tokens = pm.generate(words(6), max_new_tokens=4)[0].token_ids
        stop = build_tokenizer().decode([tokens[0]])
        _refused_for_its_generation_config(
            pm, "stop_strings", [stop], f"generation_config sets stop_strings={[stop]!r}, "
            "which undercurrent does not read: pass them to the call as stop=")
        (output,) = pm.generate(words(6), max_new_tokens=4, stop=[stop])
        assert output.finish_reason == "stop" and output.token_ids == tokens[:1]


@pytest.mark.parametrize(("setting", "value"), [
    ("num_beams", 4), ("num_return_sequences", 2), ("prompt_lookup_num_tokens", 3),
    ("prefill_chunk_size", 2), ("guidance_scale", 1.5), ("assistant_early_exit", 1),
    ("stop_strings", ["w5"]), ("max_time", 1e-9)])
def test_prompt_activations_runs_whatever_the_generation_config_decodes(setting, value):
    # A prompt-only call is the prefill forward alone, its token dropped: it was
    # refused for settings of decoding ("undercurrent does not run beam search").
    # Its records are the ones it gives with the setting off.
    import copy

    model = copy.deepcopy(build_model("llama"))
    # (transformers takes several sequences per prompt only when sampling)
    model.generation_config.do_sample = setting == "num_return_sequences"
    points = [ExtractionPoint(name=f"resid{at}", layers=(0, 2), tensor_type="residual_stream",
                              position=f"prompt[{at}]", probe_type="capture",
                              probe_kind="single_shot") for at in (0, -1)]
    prompts = [words(6), words(3)]
    with ProbedModel(model, build_tokenizer(), spec=points) as pm:
        before = pm.prompt_activations(prompts)
        setattr(model.generation_config, setting, value)
        try:
            after = pm.prompt_activations(prompts)
        finally:
            setattr(model.generation_config, setting, 1 if setting.startswith("num_") else None)
    for output, reference in zip(after, before, strict=True):
        assert output.finish_reason == "forward"
        assert len(output.records) == 4
        assert [(r.layer, r.token_index) for r in output.records] == [
            (r.layer, r.token_index) for r in reference.records]
        for record, expected in zip(output.records, reference.records, strict=True):
            torch.testing.assert_close(record.tensor, expected.tensor)


def test_max_time_in_the_generation_config_is_refused_naming_it() -> None:
    # generate() cut every row off after max_time seconds, and the outputs said
    # finish_reason="length" with fewer than max_new_tokens tokens (their tokens
    # depending on the machine's speed); the vllm backend refuses it too.
    model = gpt2_with_short_context()
    with ProbedModel(model, build_tokenizer(), spec=[]) as pm:
        before = pm.generate(words(6), max_new_tokens=4)[0]
        _refused_for_its_generation_config(
            pm, "max_time", 1e-9, "generation_config sets max_time=1e-09 (ends generation "
            "after a time), which undercurrent does not apply")
        after = pm.generate(words(6), max_new_tokens=4)[0]
    assert (after.token_ids, after.finish_reason) == (before.token_ids, "length")


def test_a_guidance_scale_of_one_guides_nothing_and_is_run() -> None:
    model = gpt2_with_short_context()
    with ProbedModel(model, build_tokenizer(), spec=[]) as pm:
        before = pm.generate(words(6), max_new_tokens=3)[0].token_ids
        model.generation_config.guidance_scale = 1
        try:
            assert pm.generate(words(6), max_new_tokens=3)[0].token_ids == before
        finally:
            model.generation_config.guidance_scale = None


def test_a_text_prompt_encoding_to_a_token_the_model_has_no_embedding_for_is_named():
    # The tokenizer has 64 tokens, the model 64 embeddings; a special token added to
    # the tokenizer alone (id 64) reached the embedding as an IndexError (vLLM read
    # a padding row). Refused like the same ids given as input_ids.
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert tokenizer.convert_tokens_to_ids("<extra>") == 64
    with ProbedModel(gpt2_with_short_context(), tokenizer) as pm:
        refused = re.escape("('w1 <extra> w2') encodes to token id 64 (token 2), outside "
                            "this model's vocabulary [0, 64)")
        with pytest.raises(ValueError, match=r"prompts\[1\] " + refused):
            pm.generate([words(3), "w1 <extra> w2"], max_new_tokens=2)
        with pytest.raises(ValueError, match=r"prompts\[0\] " + refused):
            pm.prompt_activations(["w1 <extra> w2"])
        assert len(pm.generate(words(3), max_new_tokens=2)[0].token_ids) == 2


def _added_pad_token(model: Any, tokenizer: Any) -> None:
    # (a Llama checkpoint has no pad: one is added, the embeddings not resized)
    model.generation_config.pad_token_id = None
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    assert tokenizer.pad_token_id == 64


def _no_pad_but_a_negative_one(model: Any, tokenizer: Any) -> None:
    tokenizer.pad_token = None
    model.generation_config.pad_token_id = -1  # (as some old Llama checkpoints ship)


@pytest.mark.parametrize("unusable_pad", [_added_pad_token, _no_pad_but_a_negative_one])
def test_a_pad_id_the_model_has_no_embedding_for_pads_with_one_it_has(unusable_pad) -> None:
    # Uneven prompts are left-padded with the pad id: one outside the vocabulary
    # failed with a bare IndexError from the embedding. The padding sits under a
    # zero attention mask, so another id (the eos, here) serves, and the outputs
    # are those of a usable pad.
    import copy

    model = copy.deepcopy(build_model("llama", eos=True))
    point = ExtractionPoint(name="resid", layers=(0, 2), tensor_type="residual_stream",
                            position="generated[*]", probe_type="capture",
                            probe_kind="trajectory")
    prompts = [words(7), words(3), words(5)]
    with ProbedModel(model, build_tokenizer(), spec=[point]) as pm:
        expected = pm.generate(prompts, max_new_tokens=4, records=True)
    tokenizer = build_tokenizer()
    unusable_pad(model, tokenizer)
    with ProbedModel(model, tokenizer, spec=[point]) as pm:
        outputs = pm.generate(prompts, max_new_tokens=4, records=True)
        assert pm.backend.pad_token_id == 2  # (the eos)
    for output, reference in zip(outputs, expected, strict=True):
        assert output.token_ids == reference.token_ids
        assert len(output.records) == len(reference.records) > 0
        for record, reference_record in zip(output.records, reference.records, strict=True):
            assert (record.layer, record.token_index) == (reference_record.layer,
                                                          reference_record.token_index)
            torch.testing.assert_close(record.tensor, reference_record.tensor)


def test_a_prompt_activations_refusal_names_no_max_new_tokens(probed) -> None:
    # prompt_activations takes no max_new_tokens: its refusal said "with max_new_tokens=1"
    with pytest.raises(ValueError) as caught:
        probed.prompt_activations([words(POSITIONS + 1)])
    message = str(caught.value)
    assert message == (f"prompt 0 has {POSITIONS + 1} tokens but the model's context is "
                       f"{POSITIONS}: shorten the prompt to at most {POSITIONS} tokens"), message
    assert probed.prompt_activations([words(POSITIONS)])[0].finish_reason == "forward"
