"""The worker extension vLLM mixes into its worker class (``worker_extension_cls``).

At the start of each forward it maps the step's flat token batch to (request, token
index) from the runner's input batch (:func:`~undercurrent.adapters.vllm.rows.step_windows`)
and plans, with the same matching code as every backend
(:class:`~undercurrent.adapters.session.StepPlan`), which rows each site keeps. Only
the sites the open requests can still capture or edit carry a forward hook (a
decoder layer, its attention or MLP block, the final norm, or for ``kv`` vLLM's
``Attention`` layer); they are re-hooked when that set changes. Each hooked site
gathers its rows with one index operation (none when they are consecutive) straight
into the step's bank of rows. At the end of the forward the worker sends one
:class:`~undercurrent.adapters.vllm.wire.StepBatch` to the driver and waits for the
reply, so inline probes run (and can abort) before the step's tokens are sampled (in
the driver's own process, the in-process engine, it calls the driver's server instead).
When no reply can change a step (in a ``generate()`` call whose probes cannot abort,
with no edits and no async points: the driver says so when it opens the requests),
the batches wait in the worker and go several steps at a time, the rest when the
driver asks once the engine is done.

Only the capturing rank (tensor-parallel rank 0) captures; the tensors it captures
are the full, all-reduced ones, identical on every rank (the driver refuses a site
whose block leaves its output unreduced, Falcon's parallel attention and MLP: see
``undercurrent_describe``'s ``unreduced``). An attention or MLP block that returns
its bias beside its output (``skip_bias_add``) is captured and edited as
``out + bias``, the output the Hugging Face backend sees. Live edits run on every
rank (each rank's copy of the residual stream must change the same way): every
rank hooks the model and plans the same edits from the same runner state; rank 0
reports the edits it applied with the step's batch, and learns from the reply which
triggered edits a signal switched on, which it shares with the other ranks at the
start of the next step. Every method the driver calls is prefixed ``undercurrent_``
so it cannot clash with vLLM's own.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import signal
import threading
import time
from collections.abc import Collection
from multiprocessing.connection import Client
from typing import Any, cast

import numpy as np
import torch

from undercurrent.adapters.session import (
    NEVER,
    PairKey,
    RequestState,
    StepPlan,
    one_token_later,
    quiet_steps,
)
from undercurrent.adapters.vllm import layout as layouts
from undercurrent.adapters.vllm import wire
from undercurrent.adapters.vllm.channel import local_server
from undercurrent.adapters.vllm.interrupts import HeldCtrlC
from undercurrent.adapters.vllm.rows import TokenWindow, engine_request_id, step_windows
from undercurrent.spec.types import TensorType
from undercurrent.steering.kernels import EditKernels

logger = logging.getLogger("undercurrent.vllm.worker")


class MirrorState(RequestState):
    """The worker's copy of a request: its points (``point_index``: by name, the
    index the wire names a point by), where capture has reached (so recomputed
    tokens after a preemption are not captured twice) and how many generated token
    ids the driver already has."""

    # (the driver switches its triggered edits on, and the worker's _arm works
    # the request's steady steps out again, as RequestState.arm does)

    def __init__(self, engine_id: str, prompt_len: int, points: list[Any],
                 edits: list[Any] | None = None, bounds: dict[int, Any] | None = None,
                 worked: dict[tuple[Any, ...], Any] | None = None) -> None:
        # (``bounds``: shared by the requests of these very points; ``worked``, by
        # those opened together: see RequestState)
        super().__init__(engine_id, "", range(prompt_len), points, edits=edits or (),
                         bounds=bounds, worked=worked)
        self.point_index = {point.name: index for index, point in enumerate(self.points)}
        self.next_token = 0
        self.generated_sent = 0
        self.applied.record()  # (replayed on the driver: see _Capture._applied_edits)
        # Recomputed windows (after a preemption) need their edits again.
        self.retire_edits = False
        self.has_triggers = any(resolved.edit.when is not None for resolved in self.edits)


def match_columns(plan: StepPlan, reached: Collection[PairKey]
                  ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A plan of :class:`MirrorState` s as the wire's columns (see
    :class:`~undercurrent.adapters.vllm.wire.StepBatch`): the request table, one row
    per match, and the rows of every match's layers one after another, a layer whose
    site was not ``reached`` (whose rows are not sent) as ``NOT_CAPTURED``."""
    requests: dict[str, int] = {}
    columns: list[tuple[int, int, int, int]] = []
    rows: list[int] = []
    for match in plan.matches:
        state = cast(MirrorState, match.state)
        request = requests.get(state.request_id)
        if request is None:
            request = requests[state.request_id] = len(requests)
        columns.append((request, state.point_index[match.point.name], match.token_index,
                        len(match.rows)))
        rows += match.rows
    if any(key not in reached for key in plan.groups):
        index = 0
        for match in plan.matches:
            tensor_type = match.point.tensor_type
            for layer in match.layers:
                if (layer, tensor_type) not in reached:
                    rows[index] = wire.NOT_CAPTURED
                index += 1
    return list(requests), wire.match_array(columns), wire.row_array(rows)


class _Steady:
    """A step whose every request was steady: its plan, where each request was fed
    ((state, token, flat position), ``shift`` steps before the step now), the
    sites it wanted, how many requests were live and which were open, the
    requests' stride (a strided layout's steady step is one it captured: the
    steps between plan nothing, and the next captured one is its plan a stride
    later), and ``limit``: the steps from this one within which every request
    is before its slice's end (None: no slice ends); a step at or past it is
    planned from the windows."""

    __slots__ = ("plan", "places", "shift", "wanted", "live", "keys", "stride", "limit")

    def __init__(self, plan: StepPlan, places: list[tuple[MirrorState, int, int]],
                 wanted: set[PairKey], live: int, keys: set[str], shift: int = 0,
                 stride: int = 1, limit: int | None = None) -> None:
        self.plan, self.places, self.wanted, self.live, self.keys = (plan, places, wanted,
                                                                     live, keys)
        self.shift = shift
        self.stride = stride
        self.limit = limit

    def within(self) -> bool:
        """Whether the next step is before every request's slice end."""
        return self.limit is None or self.shift + 1 < self.limit


class _Cycle:
    """Decode steps that repeat with a period of several steps (points of several
    strides, no edit): per step of the period (the worker's forward count
    modulo ``period``), its last plan, the sites it wanted, how many requests
    were live and which were open (a :class:`_Steady`). Every step of the
    cycle feeds the requests fed at the ``first`` th forward (``places``:
    (state, token, flat position)) at the same positions, each one token on
    per forward; a step that does is its plan a period later. ``last``: the
    last forward that followed the cycle (a step repeated from the runner's
    arrays alone follows it where the step before it did)."""

    __slots__ = ("period", "phases", "places", "first", "last")

    def __init__(self, period: int, places: list[tuple[MirrorState, int, int]],
                 forward: int) -> None:
        self.period = period
        self.phases: dict[int, _Steady] = {}
        self.places, self.first, self.last = places, forward, forward

    def follows(self, places: list[tuple[MirrorState, int, int]], forward: int) -> bool:
        """Whether a step at the ``forward`` th forward feeding ``places`` feeds the
        cycle's requests at their positions, each a token on per forward."""
        return _later(self.places, places, forward - self.first)


#: The most base plans whose wire columns the worker keeps (a cycle's, to send
#: each repeat's columns as its last ones moved on).
KEPT_COLUMNS = 8


class _Feed:
    """The runner's batch as a steady step saw it, to tell with a few array
    comparisons whether the next step feeds every slot its next token: the same
    request ids in the same slots (``req_ids``), the same rows (``starts``, the
    runner's ``query_start_loc``), each slot one token on (``computed``: the
    tokens in its KV cache), and no request opened, released or aborted since
    (``version``). ``states`` are the requests fed, in slot order (``slots``),
    each of which has sent the driver every generated token it fed: a repeated
    step sends each the one token it feeds.

    What the repeated steps move on is counted here, not in each request's state:
    ``repeated`` steps fed each state a token (its ``next_token``), ``sent`` of
    them sent it (its ``generated_sent``); :meth:`settle` puts the counts on the
    states before anything reads them (a step that does not repeat).

    An ``idle`` feed is a step that planned nothing, where no request's token
    reached its first point or edit left
    (:attr:`~undercurrent.adapters.session.RequestState.quiet_until`): a later
    step that feeds each slot its next token, before the ``idle`` th from it,
    plans nothing either, and sends nothing (``states``: the requests it fed,
    their tokens sent later). A request with nothing left
    (:attr:`~undercurrent.adapters.session.RequestState.exhausted`) is quiet
    for good."""

    __slots__ = ("version", "req_ids", "starts", "computed", "states", "slots",
                 "prompt_lens", "engine_ids", "repeated", "sent", "idle")

    def __init__(self, version: int, req_ids: list[str], starts: np.ndarray,
                 computed: np.ndarray, states: list[MirrorState], slots: list[int],
                 idle: int = 0) -> None:
        self.idle = idle  # (the steps from this one that plan nothing: 0, not idle)
        self.version, self.req_ids = version, req_ids
        # Copies: the runner reuses its buffers from step to step.
        self.starts, self.computed = starts.copy(), computed.copy()
        self.states = states
        self.slots = np.array(slots, dtype=np.int64)
        # (what a repeated step sends of each one's token: an idle one sends none)
        self.prompt_lens = np.array([] if idle else [state.prompt_len for state in states],
                                    dtype=np.int64)
        self.engine_ids = [] if idle else [state.request_id for state in states]
        self.repeated = self.sent = 0

    def next_computed(self, runner: Any, version: int) -> np.ndarray | None:
        """The runner's KV lengths now (its buffer) where its batch feeds every
        slot of this step its next token and no request was opened, released or
        aborted since (``version``); else None. (``count`` entries and
        ``count + 1`` starts: compared with ndarray operations, not
        numpy.array_equal, as this runs at every step.)"""
        batch = runner.input_batch
        count = batch.num_reqs
        computed: np.ndarray = batch.num_computed_tokens_cpu[:count]
        if (self.version != version
                or count != len(self.req_ids)
                or not (computed == self.computed + 1).all()
                or not (runner.query_start_loc.np[:count + 1] == self.starts).all()
                or batch.req_ids[:count] != self.req_ids):
            return None
        return computed

    def settle(self) -> None:
        """Move each state fed on by the repeated steps' counts."""
        repeated, sent = self.repeated, self.sent
        if repeated or sent:
            for state in self.states:
                state.next_token += repeated
                state.generated_sent += sent
            self.repeated = self.sent = 0


class _Capture:
    """Hooks, per-request plans and the driver connection of one worker.

    Only the (layer, tensor type) sites some open request can still capture or edit
    carry a hook: at the start of every forward the wanted sites are compared with
    the hooked ones, new ones are hooked and those no request wants any more are
    unhooked (a request's points retire once their positions are past, and finished
    requests are released by the driver).
    """

    def __init__(self, worker: Any, address: str | None, authkey: bytes | None,
                 tensor_parallel_size: int = 1) -> None:
        self.worker = worker
        self.runner = worker.model_runner
        self.model = self.runner.get_model()
        self.layout = layouts.locate(self.model, worker.vllm_config.model_config.hf_config)
        # Ranks other than 0 only edit: no connection, no points.
        self.capturing = address is not None
        # The driver's server itself when it lives in this process (the in-process
        # engine): each step is a call, not a message.
        self.local = local_server(address) if address is not None else None
        self.connection: Any = (Client(address, family="AF_UNIX", authkey=authkey)
                                if address is not None and self.local is None else None)
        self.tensor_parallel_size = tensor_parallel_size
        self.kernels = EditKernels()
        self.armed_outbox: list[tuple[str, str, int]] = []
        self.handles: list[Any] = []
        self.site_handles: dict[tuple[int, TensorType], Any] = {}
        self.states: dict[str, MirrorState] = {}
        self.steered: dict[str, MirrorState] = {}  # the states with edits: only they apply any
        # The journals of applied edits the steered requests' logs follow, sent
        # to the driver (see _applied_edits): by id, [journal, number, entries sent].
        self.journals: dict[int, list[Any]] = {}
        self.journal_count = 0
        self.plan: StepPlan | None = None
        self.pending_tokens: list[tuple[MirrorState, int, int, int]] = []
        # Per step: where each planned group's rows go, the row banks they fill
        # (hidden-size rows, kv rows) and which rows each hooked site gathers.
        self.slices: dict[tuple[int, TensorType], tuple[int, int, int]] = {}
        self.bank_rows: list[int] = [0, 0]
        self.banks: list[Any] = [None, None]
        self.indices: dict[tuple[int, TensorType], Any] = {}
        self.filled: set[tuple[int, TensorType]] = set()
        self.step = 0
        # While every request fed is steady: the last plan, where each was fed, and
        # the step's wire columns with the base plan and shift they were made at
        # (see _begin_step and _end_step: the steady plan moves on in place).
        self.steady: _Steady | None = None
        # Per base plan (the steady one, or a cycle's), the last wire columns sent
        # for it: the shift they were made at, the request table, the matches and
        # their rows, and the groups; and the base plan of the last batch sent.
        self.columns: dict[int, tuple[StepPlan, int, list[str], np.ndarray, np.ndarray,
                                      list[wire.GroupRows]]] = {}
        self.last_sent: StepPlan | None = None
        # Points of several strides: the cycle of plans (see _Cycle), its steps
        # counted in the forwards that find a request open.
        self.cycle: _Cycle | None = None
        self.forwards = 0
        # The runner's batch of a steady step (see _repeat_step), what a repeated
        # step sends of its tokens, and the version of ``states`` (bumped when a
        # request is opened, released or aborted).
        self.feed: _Feed | None = None
        self.fed_tokens: tuple[_Feed, np.ndarray] | None = None
        self.version = 0
        self.placed: StepPlan | None = None  # the plan whose layout _place made last
        # Batches held back (see open's ``hold``) and the bytes of their rows.
        self.hold = False
        # A stream's requests (see open's ``each_step``): a step's edits go at once.
        self.each_step = False
        self.held: list[wire.StepBatch] = []
        self.held_bytes = 0
        self.handles.append(self.model.register_forward_pre_hook(self._begin_step))
        self.handles.append(self.model.register_forward_hook(self._end_step))

    # -- hooks -------------------------------------------------------------
    def _site(self, layer: int, tensor_type: TensorType) -> Any | None:
        """The module a (layer, tensor type) is captured from (None: not on this model;
        the driver refuses such points before they reach the worker)."""
        lay = self.layout
        if tensor_type is TensorType.FINAL_NORM:
            return lay.final_norm if layer == lay.num_layers else None
        if not 0 <= layer < lay.num_layers:
            return None
        if tensor_type is TensorType.RESIDUAL_STREAM:
            return lay.layers[layer]
        if tensor_type is TensorType.ATTN_OUT:
            return lay.attention[layer]
        if tensor_type is TensorType.MLP_OUT:
            return lay.mlp[layer]
        return lay.kv_attention[layer]

    def _hook_site(self, layer: int, tensor_type: TensorType) -> Any | None:
        module = self._site(layer, tensor_type)
        if module is None:
            return None
        if tensor_type is TensorType.KV:
            return module.register_forward_pre_hook(self._kv_hook(layer, module),
                                                    with_kwargs=True)
        return module.register_forward_hook(self._output_hook(layer, tensor_type))

    def _rehook(self, wanted: set[tuple[int, TensorType]]) -> None:
        """Hook exactly the ``wanted`` sites (unhook the rest)."""
        hooked = self.site_handles
        if hooked.keys() == wanted:
            return
        for key in [key for key in hooked if key not in wanted]:
            handle = hooked.pop(key)
            if handle is not None:
                handle.remove()
        for key in wanted - hooked.keys():
            hooked[key] = self._hook_site(*key)

    def _bank_slice(self, key: tuple[int, TensorType], like: Any,
                    row_shape: tuple[int, ...]) -> Any:
        """The rows of this step's bank that ``key``'s captured rows go to (the bank is
        made on the first use of a step, with ``like``'s dtype and device)."""
        bank, offset, count = self.slices[key]
        self.filled.add(key)
        rows = self.banks[bank]
        if rows is None:
            rows = self.banks[bank] = torch.empty((self.bank_rows[bank], *row_shape),
                                                  dtype=like.dtype, device=like.device)
        elif tuple(rows.shape[1:]) != row_shape or rows.dtype != like.dtype:
            raise RuntimeError(
                f"undercurrent: layer {key[0]} {key[1].value} gives rows of shape {row_shape} "
                f"({like.dtype}), other sites of this step {tuple(rows.shape[1:])} "
                f"({rows.dtype}); this vLLM model's layout is not supported")
        return rows[offset:offset + count]

    def _apply_edits(self, tensor_type: TensorType, output: Any, edits: Any) -> None:
        """Change the planned rows of a module's output in place. A split residual
        stream (hidden, residual) gets each edit's change added to ``hidden`` only, so
        the sum the next layer reads changes exactly once; so does a block's output
        whose bias comes beside it (see :func:`layouts.output_bias`): the edit reads
        ``out + bias`` and its change goes to ``out``."""
        split = (tensor_type is TensorType.RESIDUAL_STREAM and isinstance(output, tuple)
                 and len(output) > 1 and output[1] is not None)
        bias = _block_bias(tensor_type, output)
        target = layouts.first_tensor(output)
        for entry in edits:
            index = torch.tensor(entry.slots, dtype=torch.long, device=target.device)
            rows = target.index_select(0, index)
            if split:
                rows = rows + output[1].index_select(0, index)
            elif bias is not None:
                rows = rows + bias
            target.index_add_(0, index, self.kernels.delta(entry.resolved, rows))

    def _output_hook(self, layer: int, tensor_type: TensorType) -> Any:
        key = (layer, tensor_type)

        def hook(module: Any, args: Any, output: Any) -> None:
            plan = self.plan
            if plan is None:
                return
            edits = plan.get_edits(layer, tensor_type)
            if edits is not None:
                self._apply_edits(tensor_type, output, edits)
            rows = self.indices.get(key)
            if rows is None:
                return
            source = layouts.first_tensor(output)
            out = self._bank_slice(key, source, tuple(source.shape[1:]))
            if tensor_type is TensorType.RESIDUAL_STREAM:
                if isinstance(output, tuple) and len(output) > 1 and output[1] is not None:
                    # Select first, then add: the next layer's fused add-norm rewrites
                    # both tensors in place, and only a few rows are wanted.
                    torch.add(_gather(output[0], rows), _gather(output[1], rows), out=out)
                    return
            elif (bias := _block_bias(tensor_type, output)) is not None:
                # (the block's output is out + bias: the decoder layer adds it later)
                torch.add(_gather(source, rows), bias, out=out)
                return
            if isinstance(rows, slice):
                out.copy_(source[rows])
            else:
                torch.index_select(source, 0, rows, out=out)
        return hook

    def _kv_hook(self, layer: int, module: Any) -> Any:
        num_kv_heads = int(module.num_kv_heads)
        head_size = int(module.head_size)
        key_of_site = (layer, TensorType.KV)

        def hook(mod: Any, args: Any, kwargs: Any) -> None:
            if self.plan is None:
                return
            rows = self.indices.get(key_of_site)
            if rows is None:
                return
            key = args[1] if len(args) > 1 else kwargs["key"]
            value = args[2] if len(args) > 2 else kwargs["value"]
            out = self._bank_slice(key_of_site, key, (2, num_kv_heads, head_size))
            out[:, 0].copy_(_gather(key, rows).reshape(-1, num_kv_heads, head_size))
            out[:, 1].copy_(_gather(value, rows).reshape(-1, num_kv_heads, head_size))
        return hook

    # -- per step ----------------------------------------------------------
    def _windows(self) -> list[TokenWindow]:
        batch = self.runner.input_batch
        count = batch.num_reqs
        return step_windows(batch.req_ids[:count], batch.num_computed_tokens_cpu[:count],
                            self.runner.query_start_loc.np[:count + 1], count)

    def _share_armed(self) -> None:
        """Tensor parallelism: rank 0 tells every rank which triggered edits its last
        reply switched on, before any rank plans this step. Every rank runs this at
        the same forward (the condition depends on state all ranks share)."""
        from vllm.distributed.parallel_state import get_tp_group

        armed = get_tp_group().broadcast_object(
            self.armed_outbox if self.capturing else None, src=0)
        self.armed_outbox = []
        if not self.capturing:
            self._arm(armed or [])

    def _arm(self, armed: list[tuple[str, str, int]]) -> None:
        """Switch on the triggered edits the driver's reply names (each from the
        token after its signal's): each request's steady steps are worked out
        again, and the plans kept to repeat (which lack the edit) are dropped."""
        switched = False
        for engine_id, name, token_index in armed:
            state = self.states.get(engine_id)
            if state is not None and name not in state.armed:
                state.armed[name] = int(token_index)
                state.switched_on(int(token_index))
                switched = True
        if switched:
            self.steady = self.cycle = None

    #: Repeat a steady step from the runner's arrays (False: plan every step from
    #: each request's window, the path the repeats are tested against).
    repeat_feeds = True
    #: Plan the windows of requests alike at once: a step of whole prompts, and
    #: a decode step no faster path plans (:meth:`StepPlan.add_alike_windows`;
    #: False: each request from its window, the path that is tested against).
    batch_windows = True

    def _begin_step(self, module: Any, args: Any) -> None:
        self.plan = None
        self.pending_tokens = []
        self.fed_tokens = None
        if not self.states:
            self._rehook(set())
            return
        if self.tensor_parallel_size > 1 and any(s.has_triggers for s in self.states.values()):
            self._share_armed()
        forward = self.forwards
        self.forwards += 1
        feed, self.feed = self.feed, None
        if feed is not None:
            if self.repeat_feeds and (self._idle_step(feed) if feed.idle
                                      else self._repeat_step(feed, forward)):
                return
            feed.settle()
        plan = StepPlan()
        fed: list[tuple[MirrorState, int, int, Any]] = []  # (state, start, stop, window)
        spent: list[MirrorState] = []  # (those fed with nothing left)
        skipped = False  # (a window recomputed after a preemption, captured already)
        for window in self._windows():
            state = self.states.get(engine_request_id(window.request_id))
            if state is None or not state.live:
                continue
            token_stop = window.token_stop
            start = max(window.token_start, state.next_token)
            if start > window.token_start and state.edits:
                # Recomputed after a preemption: its edits again, reported once already.
                plan.add_edit_window(state, window.token_start, min(start, token_stop),
                                     window.row_of, log=False)
            if start >= token_stop:
                skipped = True
                continue  # recomputed after a preemption: captured already
            state.next_token = token_stop
            if state._edit_marks and state._edit_marks[0] <= start:
                state.pass_edit_marks(start)  # (steady from this token, maybe)
            if not state.exhausted:
                # (else no point nor edit is left to plan: it is left out of the
                # step's layout, and only its tokens are sent, at the steps not
                # repeated; the driver takes the engine's tokens when it ends)
                fed.append((state, start, token_stop, window))
            else:
                spent.append(state)
            fed_generated = token_stop - state.prompt_len
            if fed_generated > state.generated_sent:
                self.pending_tokens.append((state, window.slot, state.generated_sent,
                                            fed_generated))
        places = [(state, start, window.row_of(start)) for state, start, _, window in fed]
        steady = self.steady
        live = sum(state.live for state in self.states.values())
        between = False  # (a strided layout's step between its captured ones)
        cycle = self.cycle
        phase = None if cycle is None else cycle.phases.get(forward % cycle.period)
        alike = False  # (planned afresh, for requests alike: a cycle's step, maybe)
        quiet = 0  # (the steps from this one before a request fed reaches its first
        # point or edit left)
        if (steady is not None and not plan and steady.within()
                and all(stop - start == 1 for _, start, stop, _ in fed)
                and one_token_later(steady.places if not steady.shift else
                                    [(state, start + steady.shift, row)
                                     for state, start, row in steady.places], places)):
            # The same requests at the same positions, each one token on, all steady:
            # the last plan again a token later (a stride later, for a strided
            # layout, and nothing between); the sites wanted are the same too
            # when the live requests are (nothing retires while steady).
            wanted = steady.wanted if (steady.live == live and
                                       self.states.keys() == steady.keys) else None
            if steady.stride == 1:
                plan = steady.plan.shifted(1)
            elif (steady.shift + 1) % steady.stride:
                steady.shift += 1
                between = True
            else:
                plan = steady.plan.shifted(steady.stride)
        elif (phase is not None and cycle is not None and not plan
              and all(stop - start == 1 for _, start, stop, _ in fed)
              and cycle.follows(places, forward)):
            # The requests this step of the cycle was planned for, at the same
            # positions, each a period on: its plan again, a period later.
            plan = phase.plan = phase.plan.advanced(cycle.period)
            cycle.last = forward
            wanted = phase.wanted if (phase.live == live and
                                      self.states.keys() == phase.keys) else None
        else:
            # (a decode step of requests each steady from its token on, or of
            # requests alike, points of several strides among them: planned at
            # once, as each request's window would plan it)
            decode = (bool(fed) and not plan
                      and all(stop - start == 1 for _, start, stop, _ in fed))
            # (no request's token reaches its first point or edit left: nothing
            # to plan, and the steps after it before the nearest are idle)
            if decode and self.repeat_feeds:
                quiet = quiet_steps([(state, start) for state, start, _, _ in fed])
            at_once = quiet > 0 or (decode and plan.add_steady_tokens(places))
            alike = decode and not at_once and plan.add_alike_tokens(places)
            if (not decode and self.batch_windows and fed
                    and all(start == 0 and stop == state.prompt_len
                            for state, start, stop, _ in fed)):
                # (each request's whole prompt, none chunked: planned at once
                # for requests alike, as each one's window would plan it)
                at_once = plan.add_prompts([(state, window.row_of)
                                            for state, _, _, window in fed])
            elif decode and not at_once and not alike and self.batch_windows:
                # (a decode step no faster path plans: a slice that ends, say)
                at_once = plan.add_alike_windows([(state, start, stop, window.row_of)
                                                  for state, start, stop, window in fed])
            if not alike and not at_once:
                for state, start, stop, window in fed:
                    plan.add_window(state, start, stop, window.row_of)
            if not alike:
                self.cycle = None
            wanted = None
        if wanted is None and quiet:
            # (what each request fed wants is what it wanted when last planned:
            # nothing retired since; the sites stay as they are until it is due)
            wanted = set(self.site_handles)
        if wanted is None:
            wanted = plan.pairs()
            # (requests of the very same points and edits left want the same
            # sites: asked once for them)
            asked: set[tuple[int, int]] = set()
            for state in self.states.values():
                if state.live and not state.exhausted:  # (else it wants no site)
                    mine = (id(state._live_points), id(state._live_edits))
                    if mine not in asked:
                        asked.add(mine)
                        wanted |= state.wanted_pairs()
        if not between:
            stride = fed[0][0].steady_stride if fed else 1
            steady_now = all(
                stop - start == 1 and state.steady_from is not None
                and start >= state.steady_from and state.steady_stride == stride
                and not (start - state.steady_from) % stride
                and (state.steady_until is None or start < state.steady_until)
                for state, start, stop, _ in fed)
            if steady_now and plan.edits:
                steady_now = _edits_repeat(plan, fed)
            # (the steps before any request leaves its slice, from this one)
            limit = min((state.steady_until - start for state, start, _, _ in fed
                         if state.steady_until is not None), default=None) if steady_now else None
            self.steady = _Steady(plan, places, wanted, live, set(self.states), stride=stride,
                                  limit=limit) if steady_now else None
            if steady_now:
                self.cycle = None
            elif alike:
                self.cycle = self._cycled(_Steady(plan, places, wanted, live, set(self.states)),
                                          fed, forward)
        self._rehook(wanted)
        if not plan:
            if (quiet or not fed) and self.repeat_feeds and not skipped:
                self._go_idle(quiet if fed else NEVER,
                              [state for state, _, _, _ in fed] + spent)
            return
        self._place(plan)
        self.plan = plan
        cycled = self.cycle is not None and self.cycle.last == forward
        if (((self.steady is not None and self.steady.stride == 1) or cycled)
                and self.capturing and plan.groups
                and all(stop - state.prompt_len >= state.generated_sent
                        for state, _, stop, _ in fed)):
            # After this step each request fed has sent every generated token it
            # fed (none was sent ahead by a replay): the next step may repeat it.
            batch = self.runner.input_batch
            count = batch.num_reqs
            self.feed = _Feed(self.version, batch.req_ids[:count],
                              self.runner.query_start_loc.np[:count + 1],
                              batch.num_computed_tokens_cpu[:count],
                              [state for state, _, _, _ in fed],
                              [window.slot for _, _, _, window in fed])

    def _cycled(self, phase: _Steady, fed: list[tuple[MirrorState, int, int, Any]],
                forward: int) -> _Cycle | None:
        """The cycle with this step (``phase``: its plan, planned at once for the
        requests ``fed``, at the ``forward`` th forward) in it, where each request
        fed matches again a period later and at every token from then on
        (:meth:`RequestState.repeats_every`, the same period of several steps
        for each) and the plan has no edit; else None."""
        if phase.plan.edits or not fed:
            return None
        periods = {state.repeats_every(start) for state, start, _, _ in fed}
        if len(periods) != 1:
            return None
        (period,) = periods
        if period is None or period < 2:
            return None
        cycle = self.cycle
        if cycle is None or cycle.period != period or not cycle.follows(phase.places, forward):
            cycle = _Cycle(period, phase.places, forward)  # (the steps planned before: stale)
        cycle.phases[forward % period] = phase
        cycle.last = forward
        return cycle

    def _repeat_step(self, feed: _Feed, forward: int) -> bool:
        """Plan this step (the ``forward`` th) as the last steady one a token later,
        or as its step of the cycle a period later, when the runner's batch says
        it feeds each request of the last step the next token (see
        :class:`_Feed`): the plan shifted, nothing per request but each one's
        next token (read from the runner's token table in one index operation,
        sent as columns). False: plan it from the windows."""
        steady = self.steady
        cycle = self.cycle if steady is None else None
        phase = None
        if cycle is not None and cycle.last == forward - 1:
            phase = cycle.phases.get(forward % cycle.period)
            if phase is not None and not phase.plan.groups:
                phase = None  # (it sends nothing: its tokens go with a later step's)
        if phase is None and (steady is None or not steady.within()):
            return False
        computed = feed.next_computed(self.runner, self.version)
        if computed is None:
            return False
        # Each request fed feeds the token at its KV length (read when the step
        # ends, as the windows' tokens are).
        self.fed_tokens = (feed, computed[feed.slots])
        feed.repeated += 1
        feed.computed = computed.copy()
        self.feed = feed
        # (the last plan itself moved on where it was sent: see StepPlan.advanced)
        if phase is not None and cycle is not None:
            plan = phase.plan = phase.plan.advanced(cycle.period)
            cycle.last = forward
            self._rehook(phase.wanted)
        else:
            assert steady is not None
            plan = steady.plan = steady.plan.advanced(1)
            steady.shift += 1
            self._rehook(steady.wanted)
        self._place(plan)
        self.plan = plan
        return True

    def _go_idle(self, quiet: int, states: list[MirrorState]) -> None:
        """After a step that planned nothing, where none of the requests it fed
        (``states``) reaches its first point or edit left before the ``quiet``
        th step from this one: if it fed each request one token, keep the
        runner's batch, so that the steps after it that feed each the next
        token, before that one, plan nothing without walking the windows
        (:meth:`_idle_step`)."""
        runner = self.runner
        batch = runner.input_batch
        count = batch.num_reqs
        starts = runner.query_start_loc.np[:count + 1]
        if quiet < 2 or not count or not (np.diff(starts) == 1).all():
            return  # (a prefill, or nothing fed: planned from the windows next time)
        self.feed = _Feed(self.version, batch.req_ids[:count], starts,
                          batch.num_computed_tokens_cpu[:count], states, [], idle=quiet)

    def _idle_step(self, feed: _Feed) -> bool:
        """Plan nothing for this step when the runner's batch feeds every
        request of the ``idle`` feed's step its next token, and it comes before
        the ``idle`` th step from there: no token is one a point left may match
        or an edit left may apply to, and a retired point or edit never comes
        back (see :class:`_Feed`). Its tokens are sent with the next step that
        sends rows, or taken from the engine when it ends. False: plan it from
        the windows."""
        if feed.repeated + 1 >= feed.idle:
            return False
        computed = feed.next_computed(self.runner, self.version)
        if computed is None:
            return False
        feed.computed = computed.copy()
        feed.repeated += 1
        self.feed = feed
        return True

    def _place(self, plan: StepPlan) -> None:
        """Lay this step's groups out in the banks and say which rows each site
        gathers: a slice where its rows are consecutive (a decode step capturing
        every request), else one index tensor. A plan that repeats the last one
        placed (:meth:`StepPlan.shifted`: the same slots) keeps its layout."""
        self.banks = [None, None]
        self.filled = set()
        base = plan if plan.base is None else plan.base
        if base is self.placed:
            return
        self.placed = base
        device = self.runner.device
        self.indices = {}
        self.slices = {}
        self.bank_rows = [0, 0]
        for key, group in plan.groups.items():
            slots = cast(list[int], group.slots)  # flat token positions in vLLM's batch
            first = slots[0]
            if slots == list(range(first, first + len(slots))):
                self.indices[key] = slice(first, first + len(slots))
            else:
                self.indices[key] = torch.tensor(slots, dtype=torch.long, device=device)
            bank = 1 if key[1] is TensorType.KV else 0
            self.slices[key] = (bank, self.bank_rows[bank], len(slots))
            self.bank_rows[bank] += len(slots)

    def _applied_edits(self) -> wire.AppliedEdits:
        """Edits applied since the last batch, for the driver (then forgotten
        here): each steered request's log's tape (``EditLog.take_tape``: its
        entries as tuples, its journals by number), and the entries each journal
        gained since (a steady step's edits: one shift for every request that
        follows it)."""
        ops: list[tuple[str, list[tuple[Any, ...]]]] = []
        steered = self.steered
        # (only the logs whose tape has something, told in C: at a steady step,
        # whose edits are journal shifts, none has)
        for engine_id, state in itertools.compress(steered.items(),
                                                   map(_TAPE, steered.values())):
            tape = state.applied.take_tape()
            wired: list[tuple[Any, ...]] = []
            for step in tape:
                kind = step[0]
                if kind == "entry":
                    entry = step[1]
                    wired.append(("entry", entry.edit_name, entry.tensor_type, entry.layer,
                                  entry.token_index))
                elif kind == "follow":
                    wired.append(("follow", self._journal_number(step[1]), step[2],
                                  list(step[3])))
                else:
                    wired.append(step)
            ops.append((engine_id, wired))
        journals: list[tuple[int, list[int]]] = []
        current = self._current_journal()
        for key, known in list(self.journals.items()):
            journal, number, sent = known
            if len(journal) > sent:
                journals.append((number, journal[sent:]))
                known[2] = len(journal)
            elif journal is not current:  # (sent, and no step adds to it now)
                del self.journals[key]
        return journals, ops

    def _journal_number(self, journal: list[int]) -> int:
        known = self.journals.get(id(journal))
        if known is None:
            self.journal_count += 1
            known = self.journals[id(journal)] = [journal, self.journal_count, 0]
        return int(known[1])

    def _current_journal(self) -> list[int] | None:
        """The journal the steady plan's repeats add to, if any."""
        steady = self.steady
        if steady is None:
            return None
        plan = steady.plan
        return (plan.base if plan.base is not None else plan).edit_steps

    def _end_step(self, module: Any, args: Any, output: Any) -> None:
        plan, self.plan = self.plan, None
        if plan is None:
            return
        try:
            self._send_step(plan)
        finally:
            # Gathered: nothing here reads a plan through its groups again, so
            # they let go of it (no cycle left for the collector). A steady plan
            # is still shifted for later steps: that reads its slots.
            plan.delivered()

    def _send_step(self, plan: StepPlan) -> None:
        """Ship the rows gathered in this step (``plan`` 's) to the driver and apply
        its reply."""
        if not self.capturing:
            for state in self.steered.values():
                state.applied.clear()  # only rank 0 reports what was applied
            return
        banks, self.banks = self.banks, [None, None]
        if not plan.groups:
            # Edits alone need no round trip: what they changed rides with the next
            # batch (before its records are built) or is taken at the end; a
            # stream's go now, for the event of the token this step samples.
            if self.each_step:
                edits = self._applied_edits()
                if edits[0] or edits[1]:
                    self.step += 1
                    self._ship(wire.StepBatch(step=self.step, edits=edits), 0)
            return
        self.step += 1
        whole = len(self.filled) == len(plan.groups)  # (always, on a whole forward)
        base = plan if plan.base is None else plan.base
        columns = self.columns.get(id(base))  # (each entry holds its base: no id reused)
        later = 0 if columns is None else plan.delta - columns[1]
        if columns is not None and plan.base is not None and later >= 1 and whole:
            # An earlier step's plan some tokens later (the last step's a token
            # later, or a strided layout's stride; a cycle's, its period): its
            # columns as many tokens later, and the same groups in the same
            # banks (the driver is told a shift of one from the last batch; it
            # finds any other from the columns).
            matches = columns[3].copy()
            matches[:, 2] += later
            requests, match_rows, groups = columns[2], columns[4], columns[5]
            shifted = later == 1 and self.last_sent is base
        else:
            shifted = False
            requests, matches, match_rows = match_columns(plan, self.filled)
            number = {bank: len([rows for rows in banks[:bank] if rows is not None])
                      for bank, rows in enumerate(banks) if rows is not None}
            groups = []
            for key in plan.groups:
                if key in self.filled:
                    bank, offset, count = self.slices[key]
                    groups.append(wire.GroupRows(key[0], key[1].value, number[bank], offset,
                                                 count))
        if whole:
            if id(base) not in self.columns and len(self.columns) >= KEPT_COLUMNS:
                self.columns.clear()
            self.columns[id(base)] = (base, plan.delta, requests, matches, match_rows, groups)
        else:
            self.columns.pop(id(base), None)
        self.last_sent = base
        # One device-to-host copy per row shape (hidden-size rows, kv rows).
        wired = [rows.cpu() if self.local is not None else _wire_bank(rows.cpu())
                 for rows in banks if rows is not None]
        batch = wire.StepBatch(step=self.step, groups=groups, banks=wired,
                               edits=self._applied_edits(), requests=requests,
                               matches=matches, match_rows=match_rows, shifted=shifted,
                               captured=time.time())
        token_ids = self.runner.input_batch.token_ids_cpu
        for state, slot, first, stop in self.pending_tokens:
            ids = token_ids[slot, state.prompt_len + first:state.prompt_len + stop].tolist()
            batch.tokens.append((state.request_id, first, [int(t) for t in ids]))
            state.generated_sent = stop
        if self.fed_tokens is not None:  # a repeated step: one token per request fed
            feed, positions = self.fed_tokens
            batch.token_columns = (feed.engine_ids, positions - feed.prompt_lens,
                                   token_ids[feed.slots, positions])
            feed.sent += 1
        self._ship(batch, sum(int(bank.nbytes) for bank in wired))

    def _ship(self, batch: wire.StepBatch, nbytes: int) -> None:
        """Send ``batch`` (``nbytes`` of rows) with the batches held before it, or
        hold it too (see :meth:`open`)."""
        if self.hold:
            # Nothing in the reply can change this step: the batch waits for the next
            # one sent (or for flush()), unless enough wait already.
            self.held.append(batch)
            self.held_bytes += nbytes
            if len(self.held) < HOLD_STEPS and self.held_bytes < HOLD_BYTES:
                return
        elif self.held:  # (a hold ended by a later open: what waited goes first)
            self.held.append(batch)
        self._exchange(self._take_held() if self.held else batch)

    def _take_held(self) -> wire.StepBatch:
        """The batches held, as one to send: the last, the others before it."""
        held, self.held, self.held_bytes = self.held, [], 0
        batch = held.pop()
        batch.earlier = held
        return batch

    def flush(self) -> None:
        """Send the batches held, if any (the driver asks before it reads its results)."""
        if self.held:
            self._exchange(self._take_held())

    def _exchange(self, batch: wire.StepBatch) -> None:
        """Send ``batch`` to the driver and apply its reply."""
        reply: wire.StepBatch | wire.StepReply
        try:
            # A Ctrl-C is held until the exchange is complete (inside generate(),
            # the driver holds it for the whole generation, between steps).
            with HeldCtrlC():
                if self.local is not None:
                    reply = self.local.answer(batch)
                else:
                    self.connection.send_bytes(wire.encode(batch))
                    reply = wire.decode(self.connection.recv_bytes())
        except (EOFError, OSError) as error:
            # The driver went away: stop capturing rather than take the engine down.
            logger.warning("undercurrent: lost the driver connection (%s); capture stops",
                           error)
            self.states.clear()
            self.held, self.held_bytes = [], 0
            self.version += 1
            return
        assert isinstance(reply, wire.StepReply)
        for engine_id in reply.aborted:
            aborted = self.states.get(engine_id)
            if aborted is not None:
                aborted.finish_reason = "abort"
                self.version += 1
        if reply.armed:
            self._arm(reply.armed)
            if self.tensor_parallel_size > 1:
                self.armed_outbox.extend(reply.armed)

    # -- requests ----------------------------------------------------------
    def open(self, points: list[dict[str, Any]], requests: list[list[Any]],
             edits: list[dict[str, Any]] | None = None, hold: bool = False,
             each_step: bool = False) -> None:
        """Track ``requests`` (see ``undercurrent_open``). ``hold``: no reply can
        change a step, so step batches wait here (:data:`HOLD_STEPS`,
        :data:`HOLD_BYTES`) and go to the driver several at once, the rest when
        it asks (:meth:`flush`); each is routed as if sent alone. ``each_step``:
        a stream, whose events carry the edits of the step that sampled their
        token: a step that edits and captures nothing sends its edits too."""
        self.hold = bool(hold) and self.capturing
        self.each_step = bool(each_step) and self.capturing
        resolved = [wire.point_from_wire(point) for point in points] if self.capturing else []
        edit_list = [wire.edit_from_wire(edit) for edit in edits or ()]
        # (where each set of points matches, by prompt length; what requests opened
        # together work out alike: see RequestState)
        bounds: dict[tuple[int, ...], dict[int, Any]] = {}
        worked: dict[tuple[Any, ...], Any] = {}
        for engine_id, prompt_len, point_indices, first_token, *rest in requests:
            indices = tuple(map(int, point_indices)) if self.capturing else ()
            chosen = [resolved[i] for i in indices]
            chosen_edits = [edit_list[int(i)] for i in (rest[0] if rest else ())]
            state = MirrorState(str(engine_id), int(prompt_len), chosen, chosen_edits,
                                bounds.setdefault(indices, {}), worked)
            # A replay (capture of the last token) starts capture past tokens seen before.
            state.next_token = int(first_token)
            state.generated_sent = max(0, int(first_token) - int(prompt_len))
            self.states[str(engine_id)] = state
            self.steered.pop(str(engine_id), None)
            if state.edits:
                self.steered[str(engine_id)] = state
        self.version += 1

    def release(self, engine_ids: list[str]) -> None:
        for engine_id in engine_ids:
            self.states.pop(engine_id, None)
            self.steered.pop(engine_id, None)
        self.version += 1
        if not self.steered:
            # Each open() resolves its edits anew, so their device copies, cached
            # by edit, would pile up (one set per call) until close().
            self.kernels.clear()
        if not self.states:
            self._rehook(set())
            # (and nothing of the steps of these requests is repeated for the next
            # call's: its first step is planned from its windows)
            self.cycle, self.last_sent, self.steady, self.feed = None, None, None, None
            self.columns.clear()
            # (held steps the driver did not ask for: it gave up on the generation)
            self.held, self.held_bytes, self.hold, self.each_step = [], 0, False, False

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._rehook(set())
        self.states.clear()
        self.steered.clear()
        self.held, self.held_bytes, self.hold, self.each_step = [], 0, False, False
        self.version += 1
        self.plan = None
        self.kernels.clear()
        if self.connection is None:
            return
        try:
            self.connection.close()
        except OSError:
            pass


#: With ``hold`` (see :meth:`_Capture.open`), at most this many step batches wait
#: in the worker before they go to the driver together...
HOLD_STEPS = 16
#: ... holding at most this many bytes of rows.
HOLD_BYTES = 32 << 20

_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


_TAPE = operator.attrgetter("applied._tape")  # a request's log's tape (None: not kept)


def _later(before: list[tuple[MirrorState, int, int]], now: list[tuple[MirrorState, int, int]],
           delta: int) -> bool:
    """Whether a step feeding ``now`` ((state, token, flat position) per request)
    feeds the requests ``before`` fed, at the same positions, each ``delta``
    tokens on."""
    return len(before) == len(now) and all(
        fed[0] is was[0] and fed[1] == was[1] + delta and fed[2] == was[2]
        for fed, was in zip(now, before, strict=True))


def _edits_repeat(plan: StepPlan, fed: list[tuple[MirrorState, int, int, Any]]) -> bool:
    """Whether the edits of a steady step's ``plan`` repeat with it: a plan shifted
    from one whose edits do, or a fresh one, whose requests' logs of applied
    edits then follow its shifts (:attr:`StepPlan.edit_steps`; each request fed
    is steady, so the edits that apply to its token (on, and selecting it)
    apply at every steady step of its stretch, the same sites each step)."""
    if plan.base is not None:
        return plan.base.edit_steps is not None
    if plan.edit_steps is not None:
        return True  # (planned at once: its requests' logs follow its journal already)
    journal: list[int] = []
    plan.edit_steps = journal
    for state, start, _, _ in fed:
        # (a triggered edit not switched on yet applies nowhere: its request is
        # steady as if it had none, and a switch drops this plan, see _arm; nor
        # does one done, a prompt token's, kept live here for recomputed windows)
        sites = state.edit_sites_at(start)
        if sites:
            state.applied.follow(journal, start, state.prompt_len, sites)
    return True


def _wire_bank(rows: Any) -> Any:
    """A bank of rows as it crosses to the driver: a numpy view where numpy has the
    dtype (it pickles several times faster than a tensor; the driver makes it a
    tensor again without a copy), else the tensor itself (bfloat16)."""
    return rows.numpy() if rows.dtype in _NUMPY_DTYPES else rows


def _block_bias(tensor_type: TensorType, output: Any) -> Any | None:
    """The bias an attention or MLP block's ``output`` carries beside it, not yet
    added (see :func:`layouts.output_bias`); None for other sites."""
    if tensor_type is TensorType.ATTN_OUT or tensor_type is TensorType.MLP_OUT:
        return layouts.output_bias(output)
    return None


def _gather(tensor: Any, rows: Any) -> Any:
    """``tensor``'s ``rows`` (a slice: a view; an index tensor: one gather)."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no distributed state means a single worker
        return 0


def _leave_ctrl_c_to_the_driver(worker: Any, driver_pid: int) -> None:
    """Ignore SIGINT in an engine process that is not the driver's.

    A terminal's Ctrl-C (and Jupyter's "interrupt kernel") reaches the whole process
    group, so with the engine core in its own process the core gets it too, and vLLM
    shuts the core down on it: the engine is gone, and the driver waits for outputs
    that never come. The driver alone handles the interrupt (it aborts its requests
    and keeps the engine reusable); closing the backend still shuts the engine down.
    """
    if not driver_pid or driver_pid == os.getpid():
        return
    if threading.current_thread() is not threading.main_thread():
        logger.debug("undercurrent: not on the main thread; SIGINT left as it is")
        return
    worker._undercurrent_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)


class UndercurrentWorkerExtension:
    """Mixed into vLLM's worker: the driver calls these through ``collective_rpc``."""

    _undercurrent: _Capture | None = None

    def undercurrent_describe(self) -> dict[str, Any]:
        """The model's shape as this worker sees it (per-rank head counts)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lay = layouts.locate(
            model, self.vllm_config.model_config.hf_config)  # type: ignore[attr-defined]
        kv = next((m for m in lay.kv_attention if m is not None), None)
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return {
            "model_class": lay.model_class,
            "num_layers": lay.num_layers,
            "has_final_norm": lay.final_norm is not None,
            "kv_heads_per_rank": None if kv is None else int(kv.num_kv_heads),
            "head_dim": None if kv is None else int(kv.head_size),
            "tensor_parallel_size": int(parallel.tensor_parallel_size),
            "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
            "tensor_parallel_rank": _tensor_parallel_rank(),
            # (tensor types whose blocks leave their output unreduced: under tensor
            # parallelism each rank holds only its partial sum)
            "unreduced": [tensor_type.value for tensor_type, blocks in
                          ((TensorType.ATTN_OUT, lay.attention), (TensorType.MLP_OUT, lay.mlp))
                          if any(layouts.leaves_unreduced(block) for block in blocks)],
        }

    def undercurrent_attach(self, address: str, authkey: bytes, driver_pid: int = 0) -> bool:
        """Install the hooks and connect to the driver on the capturing rank (rank 0);
        in a process other than the driver's (``driver_pid``), leave Ctrl-C to the driver.
        Other ranks hook the model too, to apply live edits.

        Returns whether this worker captures."""
        self.undercurrent_detach()
        _leave_ctrl_c_to_the_driver(self, driver_pid)
        ranks = int(self.vllm_config.parallel_config.tensor_parallel_size)  # type: ignore[attr-defined]
        if _tensor_parallel_rank() != 0:
            self._undercurrent = _Capture(self, None, None, ranks)
            return False
        self._undercurrent = _Capture(self, address, bytes(authkey), ranks)
        return True

    def undercurrent_open(self, points: list[dict[str, Any]], requests: list[list[Any]],
                          edits: list[dict[str, Any]] | None = None,
                          hold: bool = False, each_step: bool = False) -> None:
        """Start capturing (and editing) for ``requests``: ``[engine id, prompt length,
        point indices, first token index to capture, edit indices]``; ``edits`` are
        resolved edits in wire form. ``hold``: no reply can change a step (the
        driver's call: no probe may abort, no edits), so the capturing worker sends
        its step batches together, several steps at a time (:data:`HOLD_STEPS`), and
        the rest when :meth:`undercurrent_flush` asks. ``each_step``: a stream (a
        step that only edits sends its edits at once: see ``_Capture.open``)."""
        capture = getattr(self, "_undercurrent", None)
        if capture is not None:
            capture.open(points, requests, edits, hold, each_step)

    def undercurrent_flush(self) -> None:
        """Send the step batches held (see :meth:`undercurrent_open`) to the driver."""
        capture = getattr(self, "_undercurrent", None)
        if capture is not None and capture.capturing:
            capture.flush()

    def undercurrent_take_edits(self) -> wire.AppliedEdits:
        """The edits applied since the last batch (capturing rank; others: none)."""
        capture = self._undercurrent
        if capture is None or not capture.capturing:
            return [], []
        return capture._applied_edits()

    def undercurrent_release(self, engine_ids: list[str]) -> None:
        """Forget finished requests."""
        capture = getattr(self, "_undercurrent", None)
        if capture is not None:
            capture.release(list(engine_ids))

    def undercurrent_detach(self) -> None:
        """Remove every hook and close the driver connection."""
        capture = getattr(self, "_undercurrent", None)
        if capture is not None:
            capture.close()
            self._undercurrent = None
        previous = getattr(self, "_undercurrent_sigint", None)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            self._undercurrent_sigint = None
