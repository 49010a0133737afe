"""The Hugging Face backend: batched ``model.generate()`` with live capture.

Why ``generate()`` and not an own decode loop: it already handles every cache
layout, position-id scheme and sampling option of the architectures in the
table, and probing must not change what it produces. Two small callbacks plug
into it:

- a forward hook on the model, which runs after each forward: it routes the
  records that forward captured, so an inline probe sees token ``t`` before
  token ``t+1`` is sampled (a logits processor would run at the same point, but
  transformers inspects each processor's signature at every step: about 45 µs a
  step inside a generation);
- a stopping criterion, which runs after each sampled token: it records the
  token for its request, applies ``eos`` / stop strings / ``max_new_tokens`` per
  row, emits stream events, and marks finished or aborted rows done. A row
  aborted by a probe of the forward just run is marked done at the token
  sampled after it, which its request never records; ``generate()`` pads the
  row from then on.

Each row of a left-padded batch is its own request; the plan for each forward
maps a request's absolute token indices to (row, column) of the batch.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import inspect
import itertools
import operator
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch._dynamo.eval_frame import OptimizedModule

from undercurrent.adapters.arguments import check_device, check_model_path, dtype_name
from undercurrent.adapters.base import BackendError, SamplingParams, call_seed
from undercurrent.adapters.capabilities import Capabilities
from undercurrent.adapters.context import context_problem
from undercurrent.adapters.generation_config import OTHER_DECODING, other_decoding
from undercurrent.adapters.hf.architectures import text_config
from undercurrent.adapters.hf.hooks import ModelHooks, model_device
from undercurrent.adapters.hf.unpadded import unpadded_settings
from undercurrent.adapters.open_streams import OpenStream
from undercurrent.adapters.outputs import GenerationOutput, StreamEvent
from undercurrent.adapters.prompts import (
    PromptInput,
    byte_runs,
    decode_reach,
    text_decoder,
    tokenize_prompts,
)
from undercurrent.adapters.session import (
    NEVER,
    CaptureSession,
    RequestState,
    StepPlan,
    StopMatch,
    StreamText,
    one_token_later,
    quiet_steps,
    stop_position,
)
from undercurrent.errors import one_line
from undercurrent.models import model_name_for
from undercurrent.router.threads import on_probe_thread
from undercurrent.spec.types import TensorType

EventSink = Callable[[StreamEvent], None]


def _padded_slot(row: int, pad: int) -> Callable[[int], Hashable]:
    """Token ``t`` of a row left-padded by ``pad`` sits at ``(row, pad + t)``."""
    return lambda token_index: (row, pad + token_index)


def _fixed_slot(row: int, column: int) -> Callable[[int], Hashable]:
    """The one token a row feeds in a forward sits at ``(row, column)``."""
    return lambda token_index: (row, column)


#: ``generate()`` keyword arguments that turn off every generation_config setting
#: :meth:`HFBackend._check_decoding` refuses: a prompt-only call (one forward, its
#: token dropped) decodes nothing, so it runs whatever the config sets.
_FORWARD_ONLY: dict[str, Any] = {
    **{name: 1 if name.startswith("num_") else None for name in OTHER_DECODING},
    "stop_strings": None, "max_time": None}

_GENERATED = operator.attrgetter("generated")
_REQUEST_ID = operator.attrgetter("request_id")
_FINISH_REASON = operator.attrgetter("finish_reason")


class _Phase:
    """A step of a cycle of plans (see ``_RowDriver._cycle``): its last plan (None:
    nothing planned), what its first plan fed and at which forward, and whether
    that was every request of the call."""

    __slots__ = ("plan", "fed", "forward", "every")

    def __init__(self, plan: StepPlan | None, fed: list[tuple[RequestState, int, int]],
                 forward: int, every: bool) -> None:
        self.plan, self.fed, self.forward, self.every = plan, fed, forward, every


class _RowDriver:
    """Per-batch generation state shared by the generate() callbacks."""

    #: Repeat the last decode plan one token later while every request is steady
    #: (False: plan every step, the path the repeats are tested against).
    repeat_plans = True
    #: Plan the windows of requests alike at once, with what each prompt length
    #: and window matches worked out once: the prefill's prompts, and a decode
    #: step no faster path plans, where a slice ends say
    #: (:meth:`StepPlan.add_alike_windows`; False: each request's window planned
    #: alone, the path that is tested against).
    batch_windows = True

    def __init__(self, backend: HFBackend, states: list[RequestState], width: int,
                 params: SamplingParams, session: CaptureSession,
                 on_event: EventSink | None, cancel: threading.Event | None) -> None:
        self.backend = backend
        self.states = states
        self.width = width
        self.params = params
        self.session = session
        self.on_event = on_event
        self.cancel = cancel
        self.forwards = 0
        # The last decode plan and what an earlier one fed, (state, token index,
        # row) per request, the steps between them, the stride of the requests'
        # points and the steps from that one before a slice of theirs ends (None:
        # none ends), while every one of them is steady (see plan_forward).
        self._steady: tuple[StepPlan, list[tuple[RequestState, int, int]], int, int,
                            int | None] | None = None
        # Where the decode steps repeat with a period of several steps (points of
        # several strides): the period and, per step of it (the forward's index
        # modulo the period), the last plan made for it (None: nothing planned),
        # what it fed at the forward it was planned for, that forward, and
        # whether it fed every request (see plan_forward and _cycled); and,
        # where the plans have edits, the list of shifts their repeats append,
        # once each request's log of applied edits follows it (_follow_cycle;
        # None: not yet).
        self._cycle: tuple[int, dict[int, _Phase], list[int] | None] | None = None
        # Set by after_token when every request was live and got one token: with
        # every request still live, the next decode step feeds each the token
        # after the one fed last (plan_forward then shifts the plan, comparing nothing).
        self._advanced = False
        self._none_done: torch.Tensor | None = None  # after_token's answer while all go on
        # No request has ended since the start (after_token ended none, no probe
        # aborted one: the session's aborts are as many as at the start).
        self._none_ended = True
        self._aborts = len(session.aborted)
        self._arms = session.arms  # (a triggered edit switched on since: plan again)
        # Set once no request has a point left that may match, nor an edit that
        # may apply (points that matched their prompt tokens, slices that
        # ended, edits done): every later forward plans nothing.
        self._spent = False
        # The decode steps still to come that plan nothing: no request's token
        # reaches its first point or edit left (RequestState.quiet_until) while
        # each takes one token a step.
        self._quiet = 0
        # The longest request's generated tokens, while every request takes one a
        # step (after_token's first path); None: not counted.
        self._longest: int | None = None
        self._generated = [state.generated for state in states]  # the lists themselves
        self.eos = backend.eos_token_ids  # (read once per batch, not per step)
        # (stop strings or a stream: each row's token looked at on its own)
        self.per_row = bool(params.stop) or on_event is not None
        if on_event is not None:
            for state in states:
                state.stream_text = StreamText(params.stop, backend.decode,
                                               backend.decode_reach, backend.byte_runs)
        if params.stop:
            for state in states:
                state.stop_match = StopMatch(params.stop, backend.decode, self.eos,
                                             backend.decode_reach)

    # called by ModelHooks before every forward
    def plan_forward(self, width: int) -> StepPlan | None:
        index = self.forwards
        self.forwards += 1
        if not self.session.points and not self.session.has_edits:
            return None
        if index == 0:
            plan = StepPlan()
            if width != self.width:
                raise BackendError(
                    f"expected the prefill forward to see {self.width} tokens, it saw {width}")
            prompts = [(state, _padded_slot(row, self.width - state.prompt_len))
                       for row, state in enumerate(self.states)
                       # (else its points match generated tokens only, and no edit
                       # applies to its prompt: nothing in its prompt to plan)
                       if state.steady_from is None or state.edits_prompt()]
            if not (self.batch_windows and plan.add_prompts(prompts)):
                for state, slot_of in prompts:
                    plan.add_window(state, 0, state.prompt_len, slot_of)
            return plan
        if width != 1:
            raise BackendError(
                f"expected decode step {index} to feed one token per row, it fed {width}; "
                "run generation with use_cache=True")
        if self._spent:
            return None
        if self.session.arms != self._arms:
            # A signal switched on a triggered edit: the plans kept lack it.
            self._arms = self.session.arms
            self._steady = self._cycle = None
        if self._quiet:
            if self._advanced and self._all_live():  # (each a token on: still before)
                self._advanced = False
                self._quiet -= 1
                return None
            self._quiet = 0
        steady = self._steady if self.repeat_plans else None
        states = self.states
        if (steady is not None and self._advanced and len(steady[1]) == len(states)
                and (steady[4] is None or steady[2] + 1 < steady[4]) and self._all_live()):
            # Every request fed last step, each one token on (after_token saw to
            # it) and still live, and before a slice's end: the last plan again,
            # a stride later (between, the tokens no point matches: nothing to
            # plan).
            self._advanced = False
            plan, fed, steps, stride, limit = steady
            steps += 1
            if steps % stride:
                self._steady = (plan, fed, steps, stride, limit)
                return None
            shifted = plan.advanced(stride)
            self._steady = (shifted, fed, steps, stride, limit)
            return shifted
        cycle = self._cycle if self.repeat_plans else None
        period, entry = (0, None) if cycle is None else (cycle[0], cycle[1].get(index % cycle[0]))
        if (entry is not None and cycle is not None and cycle[2] is None
                and entry.plan is not None and entry.plan.edits):
            # (a cycle with edits repeats once each request's log follows its steps)
            self._cycle = self._follow_cycle(cycle, index)
            if self._cycle is None:
                entry = None
        if entry is not None and entry.every and self._advanced and self._all_live():
            # Every request fed last step, each one token on, and still live: where
            # this step of the period was planned for every request, that plan
            # again, a period later.
            self._advanced = False
            return self._repeat_phase(entry, period)
        self._advanced = False
        # (``finish_reason is None`` is ``state.live``, read directly: per request and step)
        fed = [(state, state.prompt_len + len(state.generated) - 1, row)
               for row, state in enumerate(states)
               if state.finish_reason is None and state.generated]
        if fed and self.repeat_plans:
            quiet = quiet_steps([(state, index) for state, index, _ in fed])
            if quiet > 0:
                # No request's token reaches its first point or edit left (the
                # steps before a slice starts, say): nothing to plan, nor at the
                # steps after this one before the nearest of them.
                self._steady = self._cycle = None
                self._quiet = quiet - 1
                if quiet > NEVER // 2 and all(state.exhausted for state in states):
                    self._spent = True
                return None
        if (steady is not None and (steady[4] is None or steady[2] + 1 < steady[4])
                and one_token_later(
                    [(state, index + steady[2], row) for state, index, row in steady[1]], fed)):
            # The same rows, each one token on, every request steady: the last
            # plan again, a stride later (nothing planned per request).
            plan, _, steps, stride, limit = steady
            steps += 1
            if steps % stride:
                self._steady = (plan, steady[1], steps, stride, limit)
                return None
            shifted = plan.shifted(stride)
            self._steady = (shifted, fed, 0, stride, None if limit is None else limit - steps)
            return shifted
        if (entry is not None and one_token_later(
                [(state, token + index - entry.forward - 1, row)
                 for state, token, row in entry.fed], fed)):
            # The requests this step of the period was planned for, at the same
            # rows, each as many tokens on as steps have passed: its plan again.
            return self._repeat_phase(entry, period)
        plan = StepPlan()
        # (planned at once: every request fed is steady, so the plan repeats)
        tokens = [(state, index, (row, 0)) for state, index, row in fed]
        repeats = plan.add_steady_tokens(tokens)
        alike = not repeats and plan.add_alike_tokens(tokens)
        if not repeats and not alike:
            due = [(state, index, index + 1, _fixed_slot(row, 0)) for state, index, row in fed
                   if not state.exhausted]  # (else no point nor edit is left to plan)
            if not (self.batch_windows and due and plan.add_alike_windows(due)):
                for state, start, stop, slot_of in due:
                    plan.add_window(state, start, stop, slot_of)
            repeats = not plan.edits and bool(fed) and all(
                state.steady_from is not None and index >= state.steady_from
                and not (index - state.steady_from) % state.steady_stride
                and (state.steady_until is None or index < state.steady_until)
                for state, index, _ in fed) and len(
                    {state.steady_stride for state, _, _ in fed}) == 1
        if not plan and all(state.exhausted for state in states):
            # Nothing planned, and no request has a point or edit left (each
            # retires for good): no later step plans anything either.
            self._spent = True
            return None
        if repeats:
            # (the steps from this one before which every request is in its slice)
            limit = min((state.steady_until - index for state, index, _ in fed
                         if state.steady_until is not None), default=None)
            self._steady = (plan, fed, 0, fed[0][0].steady_stride, limit)
            self._cycle = None
        else:
            self._steady = None
            # (a plan of requests alike: none of its points retired planning it)
            self._cycle = self._cycled(plan, fed, index) if alike else None
        plan.repeatable = repeats or self._cycle is not None
        return plan

    def _cycled(self, plan: StepPlan, fed: list[tuple[RequestState, int, int]],
                forward: int) -> tuple[int, dict[int, _Phase], list[int] | None] | None:
        """The cycle of plans with this decode step's (``plan``, planned at once
        for the tokens ``fed``, at the ``forward`` th forward) in it, where each
        request fed matches again a period later, and at every token from then
        on (:meth:`RequestState.repeats_every`, the same period for each); else
        None. Within a period each step's plan differs (points of several
        strides: the lower layers every token, the upper every second one, with
        the same edits at every step); each is repeated a period later
        (:meth:`StepPlan.advanced`) for the same requests."""
        if not self.repeat_plans or not fed:
            return None
        periods = {state.repeats_every(token) for state, token, _ in fed}
        if len(periods) != 1:
            return None
        (period,) = periods
        if period is None:
            return None
        cycle = self._cycle
        if cycle is None or cycle[0] != period or cycle[2] is not None:
            # (a cycle whose repeats were followed is not added to: a new one)
            cycle = (period, {}, None)
        cycle[1][forward % period] = _Phase(plan if plan else None, fed, forward,
                                            len(fed) == len(self.states) and self._all_live())
        plan.alternates = period > 1
        return cycle

    def _follow_cycle(self, cycle: tuple[int, dict[int, _Phase], list[int] | None],
                      forward: int) -> tuple[int, dict[int, _Phase], list[int] | None] | None:
        """``cycle`` ready to repeat plans with edits at the ``forward`` th forward,
        or None (plan this step afresh). Each step of the period must have been
        planned for the requests fed now, at the same rows, each as many tokens
        before as forwards have passed, every plan with the edits (each applies
        to every token: :meth:`RequestState.repeats_every`). The plans then
        share one list of shifts (:attr:`StepPlan.edit_steps`, each plan's
        shifted by its :attr:`StepPlan.edit_offset` to count from this step),
        which each request's log of applied edits follows from its token now:
        one entry a step for every request, however the plans alternate."""
        period, phases, _ = cycle
        fed = [(state, state.prompt_len + len(state.generated) - 1, row)
               for row, state in enumerate(self.states)
               if state.finish_reason is None and state.generated]
        if len(phases) != period or not fed:
            return None
        for phase in phases.values():
            gap = forward - phase.forward
            if (phase.plan is None or not phase.plan.edits or len(phase.fed) != len(fed)
                    or not all(state is now and row == row_now and token + gap == token_now
                               for (state, token, row), (now, token_now, row_now)
                               in zip(phase.fed, fed, strict=True))):
                return None
        journal: list[int] = []
        for phase in phases.values():
            assert phase.plan is not None
            base = phase.plan.base if phase.plan.base is not None else phase.plan
            base.edit_steps, base.edit_offset = journal, phase.forward - forward
        # (a triggered edit in a cycle is not switched on yet: it applies nowhere;
        # nor does one done, a prompt token's)
        for state, token, _ in fed:
            state.applied.follow(journal, token, state.prompt_len, state.edit_sites_at(token))
        return (period, phases, journal)

    @staticmethod
    def _repeat_phase(entry: _Phase, period: int) -> StepPlan | None:
        """The plan of a step of the period (``entry``) a period later (None where
        it planned nothing)."""
        if entry.plan is None:
            return None
        entry.plan = shifted = entry.plan.advanced(period)
        return shifted

    def _all_live(self) -> bool:
        """Every request still generating: known at once while none has ended."""
        if self._none_ended and len(self.session.aborted) == self._aborts:
            return True
        self._none_ended = False
        # (``finish_reason is None`` is ``state.live``, read directly: per request and step)
        return all(state.finish_reason is None for state in self.states)

    # called by ModelHooks after every forward
    def after_forward(self) -> None:
        self.backend.hooks.flush(self.session)

    # generate()'s stopping criterion, called after each token is sampled (a
    # StoppingCriteria's shape: ``(input_ids, scores, **kwargs) -> bool per row``)
    def after_token(self, input_ids: torch.Tensor, scores: Any = None,
                    **kwargs: Any) -> torch.Tensor:
        cancelled = self.cancel is not None and self.cancel.is_set()
        tokens = input_ids[:, -1].tolist()
        eos = self.eos
        states = self.states
        if not cancelled and not self.per_row and self._all_live():
            # Every request live, no stop strings, nobody streaming: each takes
            # its token and may end on EOS or length (what the loop below does
            # for such a request), and the next step feeds each the next token.
            limit = self.params.max_new_tokens
            # (each request's list takes its token: one C-level pass, no Python per request)
            assert len(tokens) == len(self._generated)
            collections.deque(map(list.append, self._generated, tokens), maxlen=0)
            # (Each took one token: the longest is one longer than at the last step
            # that came this way, counted once.)
            longest = self._longest = (max(map(len, self._generated)) if self._longest is None
                                       else self._longest + 1)
            # (Checked for the whole batch at once: most steps end no request.)
            ended = not eos.isdisjoint(tokens) or longest >= limit
            if ended:
                for state, token in zip(states, tokens, strict=True):
                    if token in eos:
                        state.finish_reason = "eos"
                    elif len(state.generated) >= limit:
                        state.finish_reason = "length"
            self._advanced = True
            if ended:
                self._none_ended = False
            else:  # generate() combines it into a new tensor: one can serve each step
                if self._none_done is None:
                    self._none_done = torch.zeros(len(states), dtype=torch.bool,
                                                  device=input_ids.device)
                return self._none_done
            return torch.tensor([state.finish_reason is not None for state in states],
                                dtype=torch.bool, device=input_ids.device)
        self._advanced = False
        self._none_ended = False  # (this path does not tell: look at each request from now)
        self._longest = None
        for row, state in enumerate(states):
            if state.finish_reason is not None:  # not live
                continue
            if cancelled:
                state.finish_reason = "cancelled"
                continue
            token = int(tokens[row])
            self.session.add_token(state, token)
            match = state.stop_match
            if token in eos:
                state.finish_reason = "eos"
            elif match is not None and match.scan(state.generated) is not None:
                state.finish_reason = "stop"
            elif len(state.generated) >= self.params.max_new_tokens:
                state.finish_reason = "length"
            if self.on_event is not None and state.stream_text is not None:
                generated_index = len(state.generated) - 1
                self.on_event(StreamEvent(
                    request_id=state.request_id, token_id=token,
                    text=state.stream_text.next_piece(state.generated),
                    token_index=state.prompt_len + generated_index,
                    generated_index=generated_index, signals=state.unread_signals(),
                    edits=state.unread_edits()))
        done = [state.finish_reason is not None for state in self.states]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


_GENERATION_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = (
    weakref.WeakKeyDictionary())
_LOCKS_LOCK = threading.Lock()


def _generation_lock(model: Any) -> threading.Lock:
    """The one lock of ``model``'s generations, shared by every backend wrapping it
    (two ProbedModels on one model would mix their hooks' captures)."""
    with _LOCKS_LOCK:
        lock = _GENERATION_LOCKS.get(model)
        if lock is None:
            lock = _GENERATION_LOCKS[model] = threading.Lock()
        return lock


#: The open streams' (cancel, worker) pairs. A stream left open when the
#: interpreter exits (a generator held in a variable) has its generation cancelled
#: and waited for first: a daemon thread still inside torch while Python finalises
#: aborts the process ("terminate called without an active exception").
_LIVE_STREAMS: set[tuple[threading.Event, threading.Thread]] = set()


@atexit.register
def _end_live_streams() -> None:
    for cancel, worker in list(_LIVE_STREAMS):
        cancel.set()
        worker.join()


#: ProbedModel.from_pretrained's own keywords and those the hf backend takes
#: (tests/test_api.py checks this against the signatures).
_FROM_PRETRAINED_ARGUMENTS = ("spec", "backend", "device", "dtype", "probes", "probe_defaults",
                              "router", "on_result", "batch_size", "capture_last_token",
                              "model_name", "tokenizer")


#: Loader keywords that say where a checkpoint's config is read from.
_CONFIG_SOURCE_ARGUMENTS = ("revision", "subfolder", "cache_dir", "token", "local_files_only",
                            "trust_remote_code")


def _config_for(path: str, model_kwargs: dict[str, Any]) -> Any:
    """The config ``from_pretrained`` will load the model with (None where it cannot
    be read: loading the model then says why)."""
    config = model_kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            os.fspath(config) if config is not None else path,
            **{key: model_kwargs[key] for key in _CONFIG_SOURCE_ARGUMENTS if key in model_kwargs})
    except (OSError, ValueError, TypeError):
        return None


def _softcaps_attention(config: Any) -> bool:
    """Whether the model caps its attention logits (Gemma2's
    ``attn_logit_softcapping``): transformers' eager, flash and flex attention apply
    the cap, its sdpa attention silently does not."""
    return config is not None and getattr(
        text_config(config), "attn_logit_softcapping", None) is not None


def _warn_if_softcap_is_ignored(model: Any) -> None:
    """Warn where a model that caps its attention logits runs sdpa attention: its
    records are then not the model's own activations."""
    config = model.config
    implementation = str(getattr(text_config(config), "_attn_implementation", None)
                         or getattr(config, "_attn_implementation", None))
    if _softcaps_attention(config) and "sdpa" in implementation:
        warnings.warn(
            f"{type(model).__name__} runs attn_implementation={implementation!r}, which "
            "ignores its config.attn_logit_softcapping="
            f"{text_config(config).attn_logit_softcapping}: generations and records are not "
            "the model's reference forward (nor the vllm backend's); load it with "
            "attn_implementation='eager' (ProbedModel.from_pretrained(path) does)",
            UserWarning, stacklevel=4)


def _unknown_loader_argument(key: str) -> str:
    """What to say of a keyword ``from_pretrained`` passed on to transformers'
    loader, which the model's class did not take (a misspelt argument)."""
    import difflib

    close = difflib.get_close_matches(key, _FROM_PRETRAINED_ARGUMENTS, n=1)
    hint = f"; did you mean {close[0]}=?" if close else ""
    return (f"from_pretrained got an unexpected keyword argument {key!r}: neither "
            "from_pretrained nor transformers' AutoModelForCausalLM.from_pretrained (which "
            f"the hf backend passes other keywords to) nor the model takes it{hint}")


class HFBackend:
    """Live capture on a transformers ``*ForCausalLM`` model and its tokenizer.

    >>> backend = HFBackend(model, tokenizer)          # doctest: +SKIP
    >>> backend.capabilities().num_layers              # doctest: +SKIP
    """

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, *, model_name: str | None = None,
                 batch_size: int = 8) -> None:
        if tokenizer is None:
            raise BackendError("the hf backend needs a tokenizer: ProbedModel(model, tokenizer)")
        if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
            # (refused here: it failed at the first generate(), "'int' object is not
            # callable" from inside prompt encoding)
            raise TypeError(
                "the hf backend's tokenizer must be a tokenizer (callable on text, with "
                "decode(), as transformers' AutoTokenizer.from_pretrained(path) gives), got "
                f"{type(tokenizer).__name__} ({tokenizer!r:.40})")
        model = _uncompiled(model)
        can_generate = getattr(model, "can_generate", None)  # (a transformers model's)
        if callable(can_generate) and not can_generate():
            raise BackendError(
                f"{type(model).__name__} cannot generate text: the hf backend needs a "
                "*ForCausalLM model (a language-model head and generate()); load the "
                "checkpoint with AutoModelForCausalLM.from_pretrained(path), or pass the "
                "path to ProbedModel.from_pretrained(path)")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._model_name = model_name or model_name_for(str(
            getattr(model.config, "_name_or_path", "") or type(model).__name__))
        self.hooks = ModelHooks(model)
        _warn_if_softcap_is_ignored(model)
        self._closed = False
        # The thread generating with this backend (None: idle): close() waits for
        # it, so a generation is never cut short by its hooks going away.
        self._generating: int | None = None
        # The router that generation's probes run on (a probe on its threads may
        # not close() the model then: the generation may wait for that probe).
        self._generating_router: object | None = None
        self._idle = threading.Condition()
        self._streams: weakref.WeakSet[OpenStream] = weakref.WeakSet()  # (see close())
        self.context_length = context_length(model.config)
        self._decode = text_decoder(tokenizer)
        self.decode_reach = decode_reach(tokenizer)
        """How many characters before a token's text :meth:`decode` may change."""
        self.byte_runs = byte_runs(tokenizer)
        """The byte fallback tokens where :meth:`decode` reads a run of them as one."""
        self._lock = _generation_lock(model)

    @classmethod
    def from_pretrained(cls, path: str, *, device: str | None = None, dtype: Any = None,
                        batch_size: int = 8, model_name: str | None = None,
                        tokenizer: Any = None, **model_kwargs: Any) -> HFBackend:
        """Load a model and tokenizer from a local path (or a reachable hub id);
        ``model_name`` (default: the path) is what reprs and probe contexts show.
        ``tokenizer`` (default: the one saved at ``path``) is a loaded tokenizer, or
        the path or hub id of one."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        check_model_path(path)
        check_device(device)
        if model_kwargs.get("output_loading_info"):
            raise TypeError(
                "from_pretrained cannot take output_loading_info=True (transformers' loader "
                "would return the model and the loading info, not a model); load with "
                "AutoModelForCausalLM.from_pretrained(path, output_loading_info=True) and "
                "pass the model and its tokenizer: ProbedModel(model, tokenizer)")
        name = dtype_name(dtype)
        config = _config_for(path, model_kwargs)
        if (model_kwargs.get("attn_implementation") is None and _softcaps_attention(config)
                # (one chosen in a config= given: kept, and warned of as a keyword is)
                and getattr(config, "_attn_implementation_internal", None) is None):
            # (transformers' default, sdpa, drops the softcap: not the model's forward)
            model_kwargs["attn_implementation"] = "eager"
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, name) if name not in (None, "auto") else "auto",
                **model_kwargs)
        except TypeError as error:
            unknown = [key for key in model_kwargs if f"argument '{key}'" in str(error)]
            if not unknown:
                raise
            raise TypeError(_unknown_loader_argument(unknown[0])) from error
        except OSError as error:
            if os.path.exists(path):
                raise
            raise FileNotFoundError(
                f"model path {path!r} is not a directory on this machine, and loading it as a "
                f"hub id failed ({error}); pass a directory holding config.json and the weights, "
                "or 'undercurrent/tiny' for the bundled model") from error
        if device is not None:
            model = model.to(device)
        model.eval()
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            source = path if tokenizer is None else os.fspath(tokenizer)
            try:
                tokenizer = AutoTokenizer.from_pretrained(source)
            except (OSError, ValueError, TypeError) as error:
                raise ValueError(
                    f"model path {str(path)!r} has no tokenizer transformers can load "
                    f"({one_line(error)}); save one beside the weights "
                    "(tokenizer.save_pretrained(path)), or pass the model and its "
                    "tokenizer: ProbedModel(model, tokenizer)" if tokenizer is None else
                    f"tokenizer {source!r} is not a tokenizer transformers can load "
                    f"({one_line(error)}); pass a loaded tokenizer or the directory "
                    "holding one") from error
        return cls(model, tokenizer, model_name=model_name or model_name_for(str(path)),
                   batch_size=batch_size)

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    # (Read at each batch, as plain generate() reads them: a generation_config or
    # tokenizer changed after this backend was built applies to the next call.)
    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a row: the model's ``generation_config``'s, else
        the tokenizer's."""
        return frozenset(self._eos_ids())

    @property
    def pad_token_id(self) -> int:
        """The id left padding (and ``generate()``'s rows once done) are filled
        with: the first of the tokenizer's, the ``generation_config``'s and the eos
        ids that the model has an embedding for, else 0. Padding sits under a zero
        attention mask and a done row's tokens are never recorded, so any such id
        serves (a pad token added to the tokenizer alone, or a config's
        ``pad_token_id=-1``, reached the embedding as an IndexError)."""
        vocab = self.vocab_size
        candidates = (getattr(self.tokenizer, "pad_token_id", None),
                      getattr(self.model.generation_config, "pad_token_id", None),
                      *self._eos_ids())
        return next((int(pad) for pad in candidates
                     if pad is not None and 0 <= int(pad) < vocab), 0)

    def capabilities(self) -> Capabilities:
        """What this model captures; ``kv`` only when its decoder layers are passed
        a cache to read it from (:meth:`ModelHooks.kv_cache_problem`)."""
        capabilities = self.hooks.capabilities()
        if capabilities.supports(TensorType.KV):
            problem = self.hooks.kv_cache_problem()
            if problem is not None:
                return capabilities.without(TensorType.KV, problem)
        return capabilities

    def decode(self, token_ids: Sequence[int]) -> str:
        """Generated token ids as text, special tokens skipped (what
        ``tokenizer.decode(ids, skip_special_tokens=True)`` gives)."""
        return self._decode(list(token_ids))

    def encode(self, prompt: str) -> list[int]:
        return [int(t) for t in self.tokenizer(prompt)["input_ids"]]

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: token ids must be below it."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    # -- generation --------------------------------------------------------
    def generate(self, prompts: Sequence[PromptInput], request_ids: Sequence[str],
                 params: SamplingParams, session: CaptureSession, *,
                 batch_size: int | None = None) -> list[GenerationOutput]:
        """Batched generation (``batch_size`` prompts per ``generate()`` call)."""
        size = batch_size or self.batch_size
        if len(prompts) > size:  # (one batch checks itself, in _run_batch)
            self.check_context(prompts, params)  # (every batch's, before any runs)
        outputs: list[GenerationOutput] = []
        with self._one_call(session):
            for start in range(0, len(prompts), size):
                # A seeded call seeds the batch starting at prompt i with seed + i: the
                # same call gives the same samples, and batches do not repeat each
                # other's random draws (repeated prompts get different samples).
                batch_params = params if params.seed is None or not start else (
                    dataclasses.replace(params, seed=call_seed(params.seed, start)))
                outputs.extend(self._run_batch(list(prompts[start:start + size]),
                                               list(request_ids[start:start + size]),
                                               batch_params, session, None, None))
        return outputs

    def _take_model(self) -> None:
        """Take the model's lock (caller holds ``_idle``): refused when this backend
        is closed or the model already generates, or is held by an open stream."""
        if self._closed:
            raise BackendError("this HFBackend is closed; load the model again")
        if not self._lock.acquire(blocking=False):
            raise BackendError("this model is already generating (one call at a time "
                               "per model, whichever ProbedModel wraps it: hooks are "
                               "per model; a stream holds the model until its "
                               "final event is read, or it is closed)")

    def _let_go_of_model(self) -> None:
        with self._idle:
            self._lock.release()
            self._idle.notify_all()

    @contextlib.contextmanager
    def _one_call(self, session: CaptureSession, *, held: bool = False) -> Iterator[None]:
        """Hold the model for one call (every batch of it): refused when this backend
        is closed or the model already generates; close() waits for it to end.
        ``held``: the model's lock is held already, and kept after (a stream's)."""
        with self._idle:
            if held:
                if self._closed:
                    raise BackendError("this HFBackend is closed; load the model again")
            else:
                self._take_model()
            self._generating = threading.get_ident()
            self._generating_router = session.router
            # (the hooks act on this thread's forwards only: see ModelHooks.own)
            self.hooks.own(self._generating)
        try:
            yield
        finally:
            with self._idle:
                self.hooks.own(None)
                self._generating = self._generating_router = None
                if not held:
                    self._lock.release()
                self._idle.notify_all()

    def stream(self, prompt: PromptInput, request_id: str, params: SamplingParams,
               session: CaptureSession) -> Iterator[StreamEvent]:
        """One prompt, one event per token, then a final event with the output
        (see :meth:`_stream`); close(), on any thread, ends it if it is still open
        then (see :class:`OpenStream`)."""
        cancel = threading.Event()
        events = OpenStream(self._stream(prompt, request_id, params, session, cancel), cancel)
        self._streams.add(events)
        return events

    def _stream(self, prompt: PromptInput, request_id: str, params: SamplingParams,
                session: CaptureSession, cancel: threading.Event
                ) -> Generator[StreamEvent, None, None]:
        """One prompt, one event per token, then a final event with the output.

        Generation runs in a worker thread; closing the iterator early (or an
        interrupt in the consumer) cancels it and waits for its cleanup. The stream
        holds the model from its first ``next()`` until its final event is read, or
        it is closed (as on vLLM): a call started meanwhile is refused, even once
        the generation has ended; close() ends it.
        """
        with self._idle:
            self._take_model()
        # The model is let go by the last of this generator and its worker to end:
        # the generator, unless it is finalised on the worker itself (a garbage
        # collection a probe set off there), while the worker still generates.
        holders = [2]
        holders_lock = threading.Lock()

        def let_go() -> None:
            with holders_lock:
                holders[0] -= 1
                last = holders[0] == 0
            if last:
                self._let_go_of_model()

        events: queue.Queue[Any] = queue.Queue()
        done = object()

        def work() -> None:
            try:
                with self._one_call(session, held=True):
                    (output,) = self._run_batch([prompt], [request_id], params, session,
                                                events.put, cancel)
                state = session.requests[request_id]
                rest = state.stream_text.rest(output.text) if state.stream_text else ""
                events.put(StreamEvent(
                    request_id=request_id, token_id=None, text=rest, token_index=None,
                    generated_index=None, signals=state.unread_signals(),
                    edits=state.unread_edits(), aborted=output.aborted, finished=True,
                    output=output))
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                events.put(error)
            finally:
                events.put(done)
                let_go()

        worker = threading.Thread(target=work, name=f"undercurrent-stream-{request_id}",
                                  daemon=True)
        live = (cancel, worker)
        try:
            _LIVE_STREAMS.add(live)
            worker.start()
        except BaseException:
            _LIVE_STREAMS.discard(live)
            self._let_go_of_model()
            raise
        ended = False

        def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            cancel.set()
            try:
                # (finalised on its own worker, by a garbage collection a probe set
                # off there: the generation ends at its next token, unwaited)
                if worker is not threading.current_thread():
                    worker.join()
            finally:
                _LIVE_STREAMS.discard(live)
                let_go()

        try:
            while True:
                item = events.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    # The last event: nothing is left to generate, so the model is let
                    # go before it is handed over (a stream read to its final event
                    # and left with ``break`` holds nothing).
                    end()
                yield item
        finally:
            end()

    def _tokenize(self, prompts: list[PromptInput]) -> tuple[list[str], list[tuple[int, ...]]]:
        """Each prompt's text and token ids (token-id prompts are kept as given)."""
        return tokenize_prompts(prompts, self.tokenizer, self.vocab_size)

    def _left_padded(self, encoded: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``attention_mask`` of token-id rows, left-padded to the
        longest, on the model's device (generation and the last-token replay)."""
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        width = int(lengths.max())
        # Each row's ids fill its last len(ids) columns: the mask's True cells, row
        # by row, are the ids laid end to end (one assignment, not one per row).
        kept = np.arange(width) >= (width - lengths)[:, None]
        input_ids = np.full((len(encoded), width), self.pad_token_id, dtype=np.int64)
        input_ids[kept] = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64,
                                      count=int(lengths.sum()))
        return (torch.from_numpy(input_ids).to(self.device),
                torch.from_numpy(kept.astype(np.int64)).to(self.device))

    def _encode_batch(self, prompts: list[PromptInput]
                      ) -> tuple[list[tuple[int, ...]], torch.Tensor, torch.Tensor]:
        """Token ids, left-padded ``input_ids`` and ``attention_mask`` of a batch."""
        _, encoded = self._tokenize(prompts)
        return (encoded, *self._left_padded(encoded))

    def _check_decoding(self, decodes: bool = True) -> None:
        """Refuse a ``generation_config`` that would make ``generate()`` decode
        otherwise than one row per prompt and one new token per forward pass,
        which every record and stop rests on (the call itself has no such option),
        or decoder layers that would run without the KV cache. ``decodes=False``: a
        prompt-only call, which decodes nothing and turns those settings off
        (:data:`_FORWARD_ONLY`), is refused only the latter."""
        if any(getattr(layer, "gradient_checkpointing", False) and layer.training
               for layer in self.hooks.layers):
            # (transformers then drops each layer's cache: every step recomputes the
            # whole sequence, and kv has no cache to read from)
            raise BackendError(
                "gradient checkpointing in train mode turns the KV cache off, which "
                "undercurrent generates with: call model.eval() or "
                "model.gradient_checkpointing_disable() before generating")
        if not decodes:
            return
        config = self.model.generation_config
        other = other_decoding(lambda name: getattr(config, name, None))
        if other is not None:
            name, value, what, off = other
            raise BackendError(
                f"the model's generation_config sets {name}={value!r} ({what}), which "
                "undercurrent does not run: it decodes one sequence per prompt, one "
                "token per forward pass (greedy or sampling). Set "
                f"model.generation_config.{name} = {off}")
        stop_strings = getattr(config, "stop_strings", None)
        if stop_strings is not None:
            # (generate() would match them itself, given the tokenizer, and keep
            # them in the text: stop= is undercurrent's own, on both backends)
            raise BackendError(
                f"the model's generation_config sets stop_strings={stop_strings!r}, which "
                "undercurrent does not read: pass them to the call as stop= (matched "
                "and cut from the text by undercurrent) and set "
                "model.generation_config.stop_strings = None")
        max_time = getattr(config, "max_time", None)
        if max_time is not None:
            # (generate() would end every row at once, mid-generation, with no finish
            # reason of its own: the outputs said "length")
            raise BackendError(
                f"the model's generation_config sets max_time={max_time!r} (ends generation "
                "after a time), which undercurrent does not apply: the tokens would depend "
                "on the machine's speed, and the rows it cuts off have no finish reason of "
                "their own (the vllm backend refuses it too); bound the generation with "
                "max_new_tokens and set model.generation_config.max_time = None")

    def sampling_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """The ``generate()`` keyword arguments for ``params`` (tests reuse them
        to run plain ``generate()`` as the oracle)."""
        kwargs: dict[str, Any] = {"max_new_tokens": params.max_new_tokens,
                                  "pad_token_id": self.pad_token_id,
                                  "eos_token_id": sorted(self.eos_token_ids) or None}
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k or 0)
        return kwargs

    def _run_batch(self, prompts: list[PromptInput], request_ids: list[str],
                   params: SamplingParams,
                   session: CaptureSession, on_event: EventSink | None,
                   cancel: threading.Event | None) -> list[GenerationOutput]:
        """One batch, generated; the caller holds the model (:meth:`_one_call`)."""
        try:
            self._check_decoding(decodes=not params.prompt_only)
            texts, encoded = self._tokenize(prompts)
            input_ids, attention_mask = self._left_padded(encoded)
            self._check_context(encoded, params)
            states: list[RequestState] = []
            try:
                states = session.open_requests(list(zip(request_ids, texts, encoded,
                                                        strict=True)))
                driver = _RowDriver(self, states, input_ids.shape[1], params, session,
                                    on_event, cancel)
                self.hooks.install(session.wanted_pairs())
                self.hooks.on_forward = driver.plan_forward
                self.hooks.on_forward_done = driver.after_forward
                # Async-only points: delivery off this thread (see ModelHooks.offload).
                self.hooks.start_delivery(session, states)
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                self.hooks.new_cache()
                kwargs = self.sampling_kwargs(params)
                # (settings that read the earlier tokens: each row without its padding)
                off, unpadded = unpadded_settings(self.model.generation_config, input_ids,
                                                  attention_mask, kwargs["eos_token_id"] or [])
                kwargs.update(off)
                if params.prompt_only:
                    kwargs.update(_FORWARD_ONLY)
                with torch.no_grad():
                    self.model.generate(
                        input_ids=input_ids, attention_mask=attention_mask,
                        stopping_criteria=[driver.after_token],
                        logits_processor=[] if unpadded is None else [unpadded],
                        use_cache=True, **kwargs)
                    self.hooks.flush_outside(session)
                    if params.capture_last_token:
                        self._capture_last_tokens(states, session)
                # Every forward reaches the router before any request is closed.
                self.hooks.finish_delivery()
            except BaseException:
                self.hooks.finish_delivery(raise_errors=False)
                session.abandon()
                raise
            finally:
                self.hooks.on_forward = self.hooks.on_forward_done = None
                self.hooks.remove()
            try:
                for state in states:
                    if state.finish_reason is None:
                        state.finish_reason = "length"
                # (no stop strings: each text as decoded, all of them at once)
                texts = (list(map(self._decode, map(_GENERATED, states))) if not params.stop
                         else [self._final_text(state, params) for state in states])
                outputs = session.close_requests(list(zip(
                    map(_REQUEST_ID, states), texts, map(_FINISH_REASON, states), strict=True)))
            except BaseException:
                # An on_result callback (or an interrupt) failed part-way: end the
                # requests not closed yet, so the router holds no live request.
                session.abandon()
                raise
            return outputs
        finally:
            session.release_plans()  # every request is closed: nothing reads the plans now

    def check_context(self, prompts: Sequence[PromptInput], params: SamplingParams,
                      indices: Sequence[int] | None = None) -> None:
        """Refuse, before anything runs, a prompt of ``prompts`` that cannot fit the
        model's context with ``max_new_tokens`` after it, naming it by its place in
        ``indices`` (default: in ``prompts``): a call of several batches, or a
        capture of several calls, checks every prompt before the first runs."""
        if not prompts:  # (a capture part may have none)
            return
        _, encoded = self._tokenize(list(prompts))
        self._check_context(encoded, params, indices)

    def _check_context(self, encoded: Sequence[Sequence[int]], params: SamplingParams,
                       indices: Sequence[int] | None = None) -> None:
        """Refuse, before anything runs, a prompt that cannot fit the model's context
        with ``max_new_tokens`` after it (past it, learned position embeddings fail
        with an index error and rotary ones silently degrade)."""
        limit = self.context_length
        if limit is None or context_problem(max(map(len, encoded)), params, limit) is None:
            return  # (the longest prompt fits: every one does)
        for index, ids in enumerate(encoded):
            problem = context_problem(len(ids), params, limit)
            if problem is not None:
                raise ValueError(f"prompt {index if indices is None else indices[index]} "
                                 f"{problem}")

    def _final_text(self, state: RequestState, params: SamplingParams) -> str:
        text = self._decode(state.generated)  # (decode(), without its copy: a list already)
        if state.finish_reason == "stop":
            cut = stop_position(text, params.stop)
            if cut is not None:
                text = text[:cut]
        return text

    def _capture_last_tokens(self, states: list[RequestState], session: CaptureSession) -> None:
        """One extra forward over each request's whole sequence to capture the last
        sampled token, which generation never feeds back to the model."""
        rows = [s for s in states if s.generated and not s.aborted]
        if not rows:
            return
        sequences = [list(s.prompt_token_ids) + s.generated for s in rows]
        width = max(len(seq) for seq in sequences)
        input_ids, attention_mask = self._left_padded(sequences)
        plan = StepPlan()
        for row, (state, seq) in enumerate(zip(rows, sequences, strict=True)):
            last = len(seq) - 1
            # The replay recomputes every position: apply again the edits generation
            # applied (without logging them twice), then plan the last token.
            replayed = list(state.applied)
            by_name = {resolved.edit.name: resolved for resolved in state.edits}
            for applied in replayed:
                plan.add_edit(state, by_name[applied.edit_name], applied.layer,
                              applied.token_index,
                              (row, width - len(seq) + applied.token_index), log=False)
            plan.add_window(state, last, last + 1, _fixed_slot(row, width - 1))
        if not plan.groups:
            return
        self.hooks.install(session.wanted_pairs() | plan.pairs())
        self.hooks.on_forward = self.hooks.on_forward_done = None
        self.hooks.set_plan(plan, width)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": True}
        if "position_ids" in _forward_parameters(self.model):
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.hooks.plan = plan
        self.hooks.new_cache()
        self.model(input_ids=input_ids, **kwargs)
        self.hooks.flush_outside(session)
        self.hooks.plan = None

    def check_closable(self) -> None:
        """Refuse a close() from inside this backend's own generation (a probe or a
        callback on the generating thread, or, while the model generates, a probe on
        a thread of the router that generation uses: an async worker, a blocking
        probe's helper): waiting there would wait for itself, or for a generation
        that waits for it. Another router's probe (another model's) waits."""
        generating, router = self._generating, self._generating_router
        if generating is not None and on_probe_thread(router):
            raise BackendError(
                "close() was called from a probe's thread (an async worker or a blocking "
                "probe's helper) while this model generates: the generation may wait for "
                "that probe, so close() cannot wait for it; close it once the call has "
                "returned")
        if generating is not None and generating == threading.get_ident():
            raise BackendError("close() was called from inside this model's own "
                               "generation (a probe or a callback); close it once the "
                               "call has returned")

    def close(self) -> None:
        """Remove every hook; the model behaves exactly as before. A stream still
        open is ended (as on vLLM: :meth:`OpenStream.end`, its reader given the
        events left, the last ``finish_reason="cancelled"``); a generation running
        in another thread ends first: close() waits for it, and no call starts
        after. Called from inside this backend's own generation (a probe or a
        callback), it is refused."""
        self.check_closable()
        for stream in list(self._streams):
            # (its generation is cancelled and joined, and the model let go: a stream
            # left open would hold it for every other ProbedModel; its reader, on any
            # thread, gets the events left, the last with finish_reason="cancelled")
            stream.end()
        with self._idle:
            self.check_closable()
            self._closed = True
            while self._generating is not None:
                self._idle.wait()
        self.hooks.remove()


def _uncompiled(model: Any) -> Any:
    """The module ``torch.compile(model)`` wraps (``model`` itself otherwise). The
    wrapper's ``generate()`` is the wrapped module's own, which runs the uncompiled
    forward: hooks put on the wrapper would never run there, so every call
    captured nothing. Probing the wrapped module records what that generation
    computes."""
    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")


def context_length(config: Any) -> int | None:
    """The model's context length (positions it was built for), when its config says."""
    config = text_config(config)
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


_FORWARD_PARAMS: dict[type, frozenset[str]] = {}


def _forward_parameters(model: Any) -> frozenset[str]:
    cls = type(model)
    if cls not in _FORWARD_PARAMS:
        _FORWARD_PARAMS[cls] = frozenset(inspect.signature(model.forward).parameters)
    return _FORWARD_PARAMS[cls]


