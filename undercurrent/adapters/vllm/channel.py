"""The driver end of the worker connection: receive each step's batch, route it, reply.

A thread accepts the capturing worker's connection and serves one
:class:`~undercurrent.adapters.vllm.wire.StepBatch` at a time: it turns the rows into
records through the generation's :class:`~undercurrent.adapters.session.CaptureSession`
(the same code every backend uses), lets the router run inline probes, hands aborts to
the engine and answers the worker, which has been waiting so that the step's tokens
are sampled only after the probes have spoken.

A worker in the driver's own process (the in-process engine) finds the server by its
address (:func:`local_server`) and hands each batch over with a call
(:meth:`StepServer.answer`): no pickling, no socket, no thread switch.

The batch's columns become the step's plan again (:func:`step_deliveries`): one
:class:`~undercurrent.adapters.session.PlanMatch` per (request, token, point) and one
group per (layer, tensor type), handed to the session whole, so it delivers them
without building anything per captured vector.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import secrets
import shutil
import socket
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener
from typing import Any, cast

import numpy as np

from undercurrent.adapters.session import (
    CaptureGroup,
    CaptureSession,
    PairKey,
    RequestState,
    StepPlan,
)
from undercurrent.adapters.vllm import wire
from undercurrent.records import captured_at
from undercurrent.spec.types import ExtractionPoint, TensorType

logger = logging.getLogger("undercurrent.vllm")

AbortSink = Callable[[list[str]], None]
Delivery = tuple[TensorType, CaptureGroup, Any]


def step_deliveries(batch: wire.StepBatch, table: Sequence[RequestState | None]
                    ) -> list[Delivery]:
    """The step's plan rebuilt from ``batch``'s columns, as
    :meth:`~undercurrent.adapters.session.CaptureSession.deliver` takes it: every
    group of the plan with its rows. ``table[i]`` is the request state of
    ``batch.requests[i]`` (None: not tracked, its matches are left out).

    A match's rows are its point's layers in ascending order (as the worker
    planned them); a layer whose site the worker did not reach
    (:data:`~undercurrent.adapters.vllm.wire.NOT_CAPTURED`) is left out of it.
    """
    plan = StepPlan()
    plan.edits_logged = True  # (the worker's edits are in the requests' logs)
    deliveries: list[Delivery] = []
    banks = [_as_tensor(bank) for bank in batch.banks]
    for group in batch.groups:
        tensor_type = TensorType(group.tensor_type)
        gathered = banks[group.bank][group.offset:group.offset + group.count]
        deliveries.append((tensor_type, plan.add_gathered((group.layer, tensor_type),
                                                          group.count), gathered))
    rows: list[int] = batch.match_rows.tolist()  # per match: a row per layer
    partial = bool(rows) and min(rows) < 0
    layouts: dict[int, tuple[int, ...]] = {}
    start = 0
    for request, point_index, token_index, count in batch.matches.tolist():
        stop = start + count
        state = table[request]
        if state is not None:
            point = state.points[point_index]
            layers = layouts.get(id(point))
            if layers is None:
                layers = layouts[id(point)] = _layers(point, plan, partial)
            if len(layers) != count:
                raise RuntimeError(
                    f"undercurrent: the vLLM worker sent {count} rows for point {point.name!r} "
                    f"of request {state.request_id!r} at token {token_index}, which has "
                    f"{len(layers)} layers {list(layers)}; the worker and the driver disagree "
                    f"on the point")
            mine = rows[start:stop]
            if partial and wire.NOT_CAPTURED in mine:
                kept = [(layer, row) for layer, row in zip(layers, mine, strict=True)
                        if row != wire.NOT_CAPTURED]
                if kept:
                    plan.add_match(state, point, token_index, tuple(k[0] for k in kept),
                                   [k[1] for k in kept])
            else:
                plan.add_match(state, point, token_index, layers, mine)
        start = stop
    return deliveries


#: How many of the last steps' plans the driver keeps to repeat (a cycle of
#: layouts, points of several strides, repeats within this many batches).
CYCLE_STEPS = 8


class _Seen:
    """A step the driver delivered: its plan (moved on as it repeats), its
    groups' keys, its request table, its matches and their rows, and per
    group its key and tensor type, resolved once; ``left``: how many tokens
    on from its step the steered requests' edits stay the same (None: for
    good), counted down as it repeats."""

    __slots__ = ("plan", "keys", "table", "matches", "rows", "layout", "left")

    def __init__(self, plan: StepPlan, keys: list[tuple[int, str, int]],
                 table: list[RequestState | None], matches: np.ndarray, rows: np.ndarray,
                 layout: list[tuple[tuple[int, TensorType], TensorType]],
                 left: int | None = None) -> None:
        self.plan, self.keys, self.table = plan, keys, table
        self.matches, self.rows, self.layout = matches, rows, layout
        self.left = left


class _Repeat:
    """Steps that repeat an earlier one some tokens later: the same requests
    (the same states, each steered one getting the same edits at every token
    from here on, or up to a token where one changes: ``_steady_edits``), the
    same groups and the same matches,
    each the same number of tokens on (the last step's one token on; a
    strided layout's, its stride; a cycle of layouts', points of several
    strides, its period). Such a step's plan is the earlier plan shifted
    (:meth:`~undercurrent.adapters.session.StepPlan.shifted`): nothing is
    planned per match, and delivery reuses the layout it kept for the first.

    The last :data:`CYCLE_STEPS` steps' plans are kept. A step repeating one
    before the last (a cycle) repeats it where that plan alternates
    (:attr:`~undercurrent.adapters.session.StepPlan.alternates`: delivery hands
    each request its rows, as the plans of a cycle take turns); where it does
    not yet, the step is planned from its columns once more as a plan that
    alternates, repeated from its next turn on."""

    def __init__(self) -> None:
        self._seen: list[_Seen] = []  # (oldest first; the last step's last)
        self._arms = 0  # the session's triggered edits switched on, when last asked

    def deliveries(self, batch: wire.StepBatch, table: list[RequestState | None],
                   arms: int = 0) -> list[Delivery]:
        """:func:`step_deliveries` of ``batch``, from an earlier plan shifted
        when ``batch`` repeats an earlier step some tokens later. ``arms``: the
        session's count of triggered edits switched on (a plan kept from
        before one was lacks its edit at the rows it applies to now)."""
        keys = [(group.layer, group.tensor_type, group.count) for group in batch.groups]
        if arms != self._arms:
            self._arms, self._seen = arms, []
        seen = self._seen
        found, delta, alternates = None, 0, False
        if seen:
            last = seen[-1]
            delta = self._repeats(batch, keys, table, last, claimed=True)
            if delta:
                found = last
            else:
                for earlier in reversed(seen[:-1]):
                    delta = self._repeats(batch, keys, table, earlier, claimed=False)
                    if delta:  # (a cycle: plans of several layouts take turns)
                        found, alternates = earlier, True
                        break
        if found is not None and (not alternates or (found.plan.base or found.plan).alternates):
            seen.remove(found)
            # (the earlier plan moved on, once it is delivered)
            plan = found.plan = found.plan.advanced(delta)
            if found.left is not None:
                found.left -= delta
            banks = [_as_tensor(bank) for bank in batch.banks]
            groups = plan.groups
            deliveries: list[Delivery] = [
                (tensor_type, groups[key],
                 banks[group.bank][group.offset:group.offset + group.count])
                for (key, tensor_type), group in zip(found.layout, batch.groups, strict=True)]
            found.matches, found.rows = batch.matches, batch.match_rows
            seen.append(found)
            return deliveries
        if found is not None:
            seen.remove(found)  # (planned again below, as a plan that alternates)
        deliveries = step_deliveries(batch, table)
        made = deliveries[0][1].plan if deliveries else None
        if made is None or None in table:  # (an untracked request: planned every step)
            self._seen = []
            return deliveries
        left = _steady_edits(batch, table)
        made.repeatable = True
        made.alternates = alternates
        if left == 1:
            # (its edits differ from the next step's: delivered from a layout of
            # its own, held in a window as a repeat would be, but not repeated)
            self._seen = []
            return deliveries
        layout = [(key, key[1]) for key in (
            cast(PairKey, group.key) for _, group, _ in deliveries)]
        seen.append(_Seen(made, keys, table, batch.matches, batch.match_rows, layout, left))
        if len(seen) > CYCLE_STEPS:
            del seen[0]
        return deliveries

    @staticmethod
    def _repeats(batch: wire.StepBatch, keys: list[tuple[int, str, int]],
                 table: list[RequestState | None], earlier: _Seen, *, claimed: bool) -> int:
        """How many tokens after ``earlier`` 's step ``batch`` repeats it, for the
        same requests (0: it does not): one where the worker says so of the last
        batch (``claimed``: :attr:`~undercurrent.adapters.vllm.wire.StepBatch.shifted`),
        else as the columns show (every match the same number of tokens on: a
        strided layout's captured steps come its stride apart, a cycle's its
        period), and not so far on that a steered request's edits have
        changed (:attr:`_Seen.left`)."""
        if keys != earlier.keys or table != earlier.table or not len(batch.matches):
            return 0
        left = earlier.left
        if claimed and batch.shifted:
            return 1 if left is None or left > 1 else 0
        # (ndarray comparisons, not numpy.array_equal: this runs at every step)
        before, rows, now = earlier.matches, earlier.rows, batch.matches
        if now.shape != before.shape or batch.match_rows.shape != rows.shape:
            return 0
        delta = int(now[0, 2] - before[0, 2])
        if delta < 1 or (left is not None and delta >= left):
            return 0
        following = before.copy()
        following[:, 2] += delta
        return delta if bool((batch.match_rows == rows).all()
                             and (now == following).all()) else 0


def _steady_edits(batch: wire.StepBatch, table: list[RequestState | None]) -> int | None:
    """How many tokens on from the one each steered request of ``batch``
    captures now it gets the edits it got at this one (the fewest of them;
    :meth:`~undercurrent.adapters.session.RequestState.edits_same_until`;
    None: every token from it on, or no request steered; 1: this one alone):
    up to there a repeat of this step's layout has its rows' edits right
    (read from the requests' logs once, see ``StepPlan.edits_logged``)."""
    steered = [index for index, state in enumerate(table)
               if state is not None and state.edits]
    if not steered:
        return None
    firsts: dict[int, int] = {}
    for request, _, token_index, _ in batch.matches.tolist():
        firsts.setdefault(request, token_index)
    left = None
    for index in steered:
        token_index = firsts.get(index)
        state = table[index]
        assert state is not None
        if token_index is None:
            return 1
        until = state.edits_same_until(token_index)
        if until is not None:
            left = until - token_index if left is None else min(left, until - token_index)
    return left


def _take_tokens(tokens: Iterable[tuple[RequestState | None, int, int]]) -> None:
    """Put each (request state, generated index, token id) in the request's
    generated tokens (the index is the next one, or one the driver has already;
    a state None is a request not tracked)."""
    for state, index, token_id in tokens:
        if state is None:
            continue
        generated = state.generated
        if index < len(generated):
            generated[index] = token_id
        elif index == len(generated):
            generated.append(token_id)


def _take_columns(states: list[RequestState | None], firsts: list[int],
                  token_ids: list[int]) -> None:
    """:func:`_take_tokens` of token columns: ``states[i]`` generated ``token_ids[i]``
    at index ``firsts[i]``. Where each is the next token of its request (a steady
    step's), every one is appended in a single pass."""
    if None not in states:
        lists = list(map(_GENERATED, cast(list[RequestState], states)))
        if list(map(len, lists)) == firsts:
            list(map(list.append, lists, token_ids))
            return
    _take_tokens(zip(states, firsts, token_ids, strict=True))


_GENERATED = operator.attrgetter("generated")


def _as_tensor(bank: Any) -> Any:
    """A bank that crossed as a numpy array, as the torch tensor the worker gathered
    (sharing its memory), so records hold tensors whatever the dtype."""
    if isinstance(bank, np.ndarray):
        import torch

        return torch.from_numpy(bank)
    return bank


def _layers(point: ExtractionPoint, plan: StepPlan, partial: bool) -> tuple[int, ...]:
    """``point``'s layers in ascending order, checked to have a group in ``plan``
    (unless some sites were not reached: ``partial``)."""
    layers = tuple(sorted(set(point.layers)))
    missing = [layer for layer in layers if (layer, point.tensor_type) not in plan.groups]
    if missing and not partial:
        raise RuntimeError(
            f"undercurrent: the vLLM worker's step has rows for point {point.name!r} but "
            f"none at its layer(s) {missing} ({point.tensor_type.value})")
    return layers


_LOCAL_SERVERS: dict[str, tuple[int, StepServer]] = {}
_LOCAL_LOCK = threading.Lock()


def local_server(address: str) -> StepServer | None:
    """The open server listening at ``address`` when it lives in this process (a
    forked child's copy does not count), else None."""
    with _LOCAL_LOCK:
        found = _LOCAL_SERVERS.get(address)
    if found is None or found[0] != os.getpid():
        return None
    return found[1]


def _remove_socket(listener: Listener, directory: str) -> None:
    """Close ``listener`` (which unlinks its socket) and remove its folder."""
    try:
        listener.close()
    except OSError:
        pass
    shutil.rmtree(directory, ignore_errors=True)


class StepServer:
    """Listens for the capturing worker and routes its step batches.

    ``on_abort`` receives the engine request ids an inline probe aborted in a step,
    before the worker is answered (so the engine can drop them before sampling).
    """

    def __init__(self, on_abort: AbortSink) -> None:
        self._directory = tempfile.mkdtemp(prefix="undercurrent-")
        self.address = os.path.join(self._directory, "steps.sock")
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        # (removed by close(); else at exit, for a script that never closes its model)
        self._remove_directory = weakref.finalize(self, _remove_socket, self._listener,
                                                  self._directory)
        self._on_abort = on_abort
        self.lock = threading.RLock()
        self._session: CaptureSession | None = None
        self._states: dict[str, RequestState] = {}
        self._steered: dict[str, RequestState] = {}  # the states with edits
        self._stopping: dict[str, RequestState] = {}  # the states with stop strings
        self._connection: Any = None
        self.error: BaseException | None = None
        self._armed: list[tuple[str, str, int]] = []
        # The driver's copies of the worker's journals of applied edits, by number.
        self._journals: dict[int, list[int]] = {}
        self._repeat = _Repeat()
        # The request states of the last request table and token columns read,
        # while ``_states`` is as it was then (``_version``).
        self._version = 0
        self._table: tuple[list[str], int, list[RequestState | None]] | None = None
        self._fed: tuple[list[str], int, list[RequestState | None]] | None = None
        self.steps = 0
        self.rows = 0
        self._thread = threading.Thread(target=self._serve, name="undercurrent-vllm-steps",
                                        daemon=True)
        self._thread.start()
        with _LOCAL_LOCK:
            _LOCAL_SERVERS[self.address] = (os.getpid(), self)

    # -- generation bookkeeping (main thread) ----------------------------------
    def take_edits(self, edits: wire.AppliedEdits) -> None:
        """Log the edits the worker says it applied (lock held): each journal
        copied on, then each request's tape replayed in order."""
        journals, tapes = edits
        copies = self._journals
        for number, shifts in journals:
            copy = copies.get(number)
            if copy is None:
                copies[number] = list(shifts)
            else:
                copy.extend(shifts)
        states = self._states
        for engine_id, tape in tapes:
            state = states.get(engine_id)
            if state is not None:
                state.replay_edits(tape, copies)

    def begin(self, session: CaptureSession) -> None:
        with self.lock:
            self._session = session
            self._states = {}
            self._steered = {}
            self._stopping = {}
            self._journals = {}
            self._repeat = _Repeat()
            self._version += 1
            self.error = None

    def track(self, engine_id: str, state: RequestState, *, replay: bool = False) -> None:
        """Route the rows of engine request ``engine_id`` to ``state``. ``replay``:
        the request feeds ``state`` 's finished sequence once more to capture its
        last token (``capture_last_token``), past where a stop string ended it."""
        with self.lock:
            self._states[engine_id] = state
            self._version += 1
            if state.edits:
                self._steered[engine_id] = state
            if state.stop_match is not None and not replay:
                self._stopping[engine_id] = state

    def end(self) -> None:
        with self.lock:
            self._session = None
            self._states = {}
            self._steered = {}
            self._stopping = {}
            self._repeat = _Repeat()  # let go of the last step's plan and states
            self._version += 1
            self._table = self._fed = None
            self._journals = {}

    def take_error(self) -> BaseException | None:
        with self.lock:
            error, self.error = self.error, None
            return error

    # -- serving (channel thread) ----------------------------------------------
    def _serve(self) -> None:
        try:
            self._connection = self._listener.accept()
        except OSError:
            return  # closed before a worker connected
        connection = self._connection
        while True:
            try:
                payload = connection.recv_bytes()
            except (EOFError, OSError):
                return
            batch = wire.decode(payload)
            assert isinstance(batch, wire.StepBatch)
            reply = self.answer(batch)
            try:
                connection.send_bytes(wire.encode(reply))
            except OSError:
                return

    def answer(self, batch: wire.StepBatch) -> wire.StepReply:
        """Route one step's batch (after the earlier ones it carries) and say what
        the worker must know before it samples: the requests an inline probe
        aborted and the triggered edits switched on."""
        aborted = []
        for earlier in batch.earlier:
            aborted += self._handle(earlier)
        reply = wire.StepReply(step=batch.step, aborted=aborted + self._handle(batch))
        reply.armed, self._armed = self._armed, []
        return reply

    def _handle(self, batch: wire.StepBatch) -> list[str]:
        with self.lock:
            session = self._session
            if session is None:
                return []
            try:
                return self._route(session, batch)
            except BaseException as error:  # noqa: BLE001 - surfaced on the main thread
                logger.exception("undercurrent: routing a vLLM step failed")
                if self.error is None:
                    self.error = error
                return []

    def _route(self, session: CaptureSession, batch: wire.StepBatch) -> list[str]:
        self.steps += 1
        self.rows += batch.num_rows
        states = self._states
        _take_tokens((states.get(engine_id), first + offset, token_id)
                     for engine_id, first, token_ids in batch.tokens
                     for offset, token_id in enumerate(token_ids))
        if batch.token_columns is not None:
            engine_ids, firsts, token_ids = batch.token_columns
            self._fed = fed = self._states_of(engine_ids, self._fed)
            _take_columns(fed[2], firsts.tolist(), token_ids.tolist())
        self.take_edits(batch.edits)
        if not batch.groups:  # (a stream's step that only edited: its edits alone)
            return []
        if self._stopping:
            batch = self._before_stops(batch)
        armed_before = {engine_id: set(state.armed)
                        for engine_id, state in self._steered.items()}
        aborts = len(session.aborted)
        # The batch's request table, resolved once: its matches index it.
        self._table = known = self._states_of(batch.requests, self._table)
        deliveries = self._repeat.deliveries(batch, known[2], session.arms)
        with captured_at(batch.captured):  # (a step held back: when it was captured)
            session.deliver(deliveries)
        for engine_id, before in armed_before.items():
            armed = states[engine_id].armed
            self._armed += [(engine_id, name, armed[name]) for name in armed
                            if name not in before]
        if len(session.aborted) == aborts:
            return []
        fresh = {id(state) for state in session.aborted[aborts:]}
        aborted = [engine_id for engine_id, state in states.items() if id(state) in fresh]
        if aborted:
            self._on_abort(aborted)
        return aborted

    def _before_stops(self, batch: wire.StepBatch) -> wire.StepBatch:
        """``batch`` without its matches at or past the token that completed a stop
        string of their request. The engine ends such a request only once the
        driver reads that token, and an engine core in its own process runs
        ahead of the driver: the worker may capture it, and tokens after it,
        which the HF backend never feeds to the model."""
        ends = {}
        for engine_id, state in self._stopping.items():
            assert state.stop_match is not None
            index = state.stop_match.scan(state.generated)
            if index is not None:
                ends[engine_id] = state.prompt_len + index
        table = [(position, ends[engine_id]) for position, engine_id in enumerate(batch.requests)
                 if engine_id in ends]
        matches = batch.matches
        if not table or not len(matches):
            return batch
        keep = np.ones(len(matches), dtype=bool)
        for position, end in table:
            keep &= (matches[:, 0] != position) | (matches[:, 2] < end)
        if keep.all():
            return batch
        rows = np.repeat(keep, matches[:, 3])
        return dataclasses.replace(batch, matches=matches[keep],
                                   match_rows=batch.match_rows[rows], shifted=False)

    def _states_of(self, engine_ids: list[str],
                   last: tuple[list[str], int, list[RequestState | None]] | None
                   ) -> tuple[list[str], int, list[RequestState | None]]:
        """The state of each of ``engine_ids`` (None: not tracked), as ``last`` has
        them when it was made for the same ids since ``_states`` last changed (a
        steady generation sends the same ids every step)."""
        if last is not None and last[1] == self._version and (
                last[0] is engine_ids or last[0] == engine_ids):
            return last
        states = self._states
        return engine_ids, self._version, [states.get(engine_id) for engine_id in engine_ids]

    def close(self) -> None:
        with _LOCAL_LOCK:
            if _LOCAL_SERVERS.get(self.address, (0, None))[1] is self:
                del _LOCAL_SERVERS[self.address]
        if self._connection is None and self._thread.is_alive():
            # No worker connected (an in-process one calls instead): closing the
            # listener does not wake a thread blocked in accept(), a connection does.
            try:
                Client(self.address, family="AF_UNIX", authkey=self.authkey).close()
            except (OSError, EOFError, AuthenticationError):
                pass
        if self._connection is not None:
            # Closing the connection does not wake the thread blocked reading it (a
            # worker that stopped talking: its engine core died mid-step); shutting
            # the socket down does.
            try:
                with socket.socket(fileno=os.dup(self._connection.fileno())) as wake:
                    wake.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                self._connection.close()
            except OSError:
                pass
        self._remove_directory()  # (the listener, its socket and its folder)
        self._thread.join(timeout=5)
