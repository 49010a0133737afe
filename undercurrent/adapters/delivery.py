"""One forward pass's captured rows, routed as columns: the delivery step of
:meth:`~undercurrent.adapters.session.CaptureSession.deliver`.

The hooks hand over one gathered tensor per (layer, tensor type) with the
targets each row serves. Here they become one
:class:`~undercurrent.records.ActivationBatch` per extraction point across every
request (rows grouped by request, in layer order), routed with one
:meth:`~undercurrent.router.Router.route_columns` call. A forward that feeds
several tokens of a request (a prefill) is delivered in *waves*: wave ``k``
holds the ``k``-th fed token of each request, so a request's tokens reach its
probes in order and an abort stops the tokens after it, as routing record by
record would. A decode step is one wave.

Nothing per vector is built here beyond the index columns: signals stay
columns (:class:`SignalLog` materialises ``TokenSignal`` s when read) and
records are built only for ``records=True`` (:class:`RecordLog`).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from undercurrent.adapters.outputs import AbortInfo, TokenSignal
from undercurrent.records import (
    ABORT_CODE,
    ACTION_CODES,
    CODE_ACTIONS,
    NO_SIGNAL,
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    ProbeSignal,
    SignalAction,
    as_list,
    concat_rows,
)

Entry = tuple[int, int, int, Any, int, int]
"""One captured vector: (token index, layer, arrival order, point, source, slot)."""

_CONTINUE = ACTION_CODES[SignalAction.CONTINUE]
_ENTRY_KEY = operator.itemgetter(0, 1, 2)


class RoutedPoint:
    """One point's batch of one wave and the signals routing it returned."""

    __slots__ = ("batch", "signals", "_located")

    def __init__(self, batch: ActivationBatch, signals: BatchSignals) -> None:
        self.batch = batch
        self.signals = signals
        self._located: list[ProbeSignal | None] | None = None

    def located(self) -> list[ProbeSignal | None]:
        """Every row's signal as an object, located (built once, shared by the
        requests of the batch)."""
        if self._located is None:
            self._located = self.signals.signals(self.batch)
        return self._located


class SignalLog(Sequence[TokenSignal]):
    """A request's inline signals in routing order, kept as references to routed
    batches and built into ``TokenSignal`` s only when read."""

    def __init__(self) -> None:
        self._built: list[TokenSignal] = []
        # Per (wave, request): the rows of each routed point, as
        # (routed point, start, stop, arrival orders of the rows).
        self._pending: list[list[tuple[RoutedPoint, int, int, list[int]]]] = []

    def add(self, runs: list[tuple[RoutedPoint, int, int, list[int]]]) -> None:
        """Signals of one token: each point's rows (run order: by point)."""
        self._pending.append(runs)

    def _flush(self) -> list[TokenSignal]:
        if self._pending:
            pending, self._pending = self._pending, []
            for runs in pending:
                self._built.extend(_token_signals(runs))
        return self._built

    def __len__(self) -> int:
        return len(self._flush())

    def __getitem__(self, index: Any) -> Any:
        return self._flush()[index]

    def __iter__(self) -> Iterator[TokenSignal]:
        return iter(self._flush())


def _token_signals(runs: list[tuple[RoutedPoint, int, int, list[int]]]
                   ) -> list[TokenSignal]:
    """One token's TokenSignals, in (layer, arrival) order across its points."""
    found: list[tuple[int, int, TokenSignal]] = []
    for routed, start, stop, orders in runs:
        signals = routed.located()
        batch = routed.batch
        for offset, row in enumerate(range(start, stop)):
            signal = signals[row]
            if signal is None:
                continue
            layer = int(batch.layers[row])
            found.append((layer, orders[offset], TokenSignal(
                batch.point_names[row], layer, int(batch.token_indices[row]),
                batch.generated_indices[row], signal)))
    if len(runs) > 1:
        found.sort(key=lambda item: item[:2])
    return [located for _, _, located in found]


class RecordLog(Sequence[ActivationRecord]):
    """A request's captured activations (``records=True``), as (batch, row)
    references; the records are built when read (``len`` builds nothing). It
    compares equal to a list of the same records, and ``+`` gives a list."""

    def __init__(self) -> None:
        self._built: list[ActivationRecord] = []
        self._pending: list[tuple[ActivationBatch, int]] = []

    def add(self, refs: Iterable[tuple[ActivationBatch, int]]) -> None:
        self._pending.extend(refs)

    def _flush(self) -> list[ActivationRecord]:
        if self._pending:
            pending, self._pending = self._pending, []
            self._built.extend(batch.records()[row] for batch, row in pending)
        return self._built

    def clear(self) -> None:
        """Forget every record (as ``list.clear``: a consumer frees the memory)."""
        self._built, self._pending = [], []

    def __len__(self) -> int:
        return len(self._built) + len(self._pending)  # counting builds nothing

    def __getitem__(self, index: Any) -> Any:
        return self._flush()[index]

    def __iter__(self) -> Iterator[ActivationRecord]:
        return iter(self._flush())

    def __repr__(self) -> str:
        return repr(self._flush())

    def __add__(self, other: Iterable[ActivationRecord]) -> list[ActivationRecord]:
        return [*self._flush(), *other]

    def __radd__(self, other: Iterable[ActivationRecord]) -> list[ActivationRecord]:
        return [*other, *self._flush()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, RecordLog)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def gather(sources: Sequence[Any], picks: Sequence[tuple[int, int]]) -> Any:
    """The rows ``sources[source][slot]`` for each (source, slot), stacked: the
    source itself when it is exactly that, else one concatenation (several
    sources) and one index operation."""
    used = sorted({source for source, _ in picks})
    if len(used) == 1:
        base = sources[used[0]]
        flat = [slot for _, slot in picks]
    else:
        offsets, total = {}, 0
        for source in used:
            offsets[source] = total
            total += len(sources[source])
        base = concat_rows([sources[source] for source in used])
        flat = [offsets[source] + slot for source, slot in picks]
    if len(flat) == len(base) and flat == list(range(len(flat))):
        return base
    if hasattr(base, "detach"):  # torch (imported already): one index_select
        return base.index_select(0, base.new_tensor(flat, dtype=sys.modules["torch"].long))
    if hasattr(base, "__array__"):
        return base[flat]
    return [base[i] for i in flat]


def deliver_forward(session: Any, batches: Iterable[tuple[Any, Sequence[Any], Any]]) -> None:
    """Route one forward pass's captures (see the module docstring)."""
    sources: list[Any] = []
    per_request: dict[str, tuple[Any, list[Entry]]] = {}
    order = 0
    for _, targets, rows in batches:
        source = len(sources)
        sources.append(rows)
        for target in targets:
            state = target.state
            found = per_request.get(state.request_id)
            if found is None:
                found = per_request[state.request_id] = (state, [])
            found[1].append((target.token_index, target.layer, order, target.point, source,
                             target.slot_index))
            order += 1
    queues: list[tuple[Any, list[list[Entry]]]] = []
    for state, entries in per_request.values():
        if state.closed:
            continue  # nothing is routed after the request ended
        entries.sort(key=_ENTRY_KEY)  # (token, layer, arrival): unique
        tokens: list[list[Entry]] = []
        for entry in entries:
            if tokens and tokens[-1][0][0] == entry[0]:
                tokens[-1].append(entry)
            else:
                tokens.append([entry])
        queues.append((state, tokens))
    wave = 0
    while True:
        current = [(state, tokens[wave]) for state, tokens in queues if wave < len(tokens)]
        if not current:
            return
        _deliver_wave(session, current, sources)
        wave += 1


def _deliver_wave(session: Any, current: list[tuple[Any, list[Entry]]],
                  sources: Sequence[Any]) -> None:
    """Route one token of each request in ``current``: one batch per point."""
    by_point: dict[str, list[tuple[Any, list[Entry]]]] = {}
    live: list[tuple[Any, list[Entry]]] = []
    for state, entries in current:
        if state.closed:
            continue
        abort = state.abort
        if abort is not None and entries[0][0] > abort.token_index:
            # Tokens after the abort are never probed; the aborting token's other
            # records still reach every point, so observers see what the guard saw.
            continue
        live.append((state, entries))
        groups: dict[str, list[Entry]] = {}
        for entry in entries:
            name = entry[3].name
            group = groups.get(name)
            if group is None:
                group = groups[name] = []
            group.append(entry)
        for name, group in groups.items():
            rows = by_point.get(name)
            if rows is None:
                rows = by_point[name] = []
            rows.append((state, group))
    if not live:
        return
    router = session.router
    registered = session.registered
    where: dict[int, tuple[ActivationBatch, int]] = {}
    runs: dict[str, list[tuple[RoutedPoint, int, int, list[int]]]] = {}
    aborts: dict[str, tuple[int, int, RoutedPoint, int]] = {}
    for requests in by_point.values():
        batch, spans = _point_batch(requests, sources)
        if session.keep_records:
            kept = batch.without_cache()  # the activations, not what probes derived
            row = 0
            for _, group in requests:
                for entry in group:
                    where[entry[2]] = (kept, row)
                    row += 1
        if router is None:
            continue
        routed_spans = [(state.request_id, start, stop) for state, start, stop in spans
                        if state.request_id in registered]
        if not routed_spans:
            continue
        signals = router.route_columns(batch, routed_spans)  # a row each, spans or not
        codes = as_list(signals.actions)
        if all(code == NO_SIGNAL for code in codes):
            continue
        routed = RoutedPoint(batch.index_view(), signals)  # the tensor may go
        for (state, start, stop), (_, group) in zip(spans, requests, strict=True):
            orders = [entry[2] for entry in group]
            runs.setdefault(state.request_id, []).append((routed, start, stop, orders))
            if ABORT_CODE in codes[start:stop]:
                for offset, row in enumerate(range(start, stop)):
                    if codes[row] == ABORT_CODE:
                        key = (group[offset][1], orders[offset], routed, row)
                        best = aborts.get(state.request_id)
                        if best is None or key[:2] < best[:2]:
                            aborts[state.request_id] = key
                        break
            if state.edits:
                for row in range(start, stop):
                    if codes[row] not in (NO_SIGNAL, _CONTINUE):
                        state.arm(batch.point_names[row], CODE_ACTIONS[codes[row]],
                                  int(batch.token_indices[row]))
    for state, entries in live:
        if state.records is not None:
            state.records.add(where[entry[2]] for entry in entries)
        found = runs.get(state.request_id)
        if found is not None:
            state.signals.add(found)
        abort = aborts.get(state.request_id)
        if abort is not None and state.abort is None:
            _, _, routed, row = abort
            batch = routed.batch
            signal = routed.located()[row]
            assert signal is not None
            state.abort = AbortInfo(batch.point_names[row], int(batch.layers[row]),
                                    int(batch.token_indices[row]),
                                    batch.generated_indices[row], signal)
            state.finish_reason = "abort"


def _point_batch(requests: Sequence[tuple[Any, list[Entry]]], sources: Sequence[Any]
                 ) -> tuple[ActivationBatch, list[tuple[Any, int, int]]]:
    """One point's rows of one wave as a batch: grouped by request, in layer
    order; with (request state, start, stop) per request."""
    ids: list[str] = []
    layers: list[int] = []
    tokens: list[int] = []
    is_generated: list[bool] = []
    generated: list[int | None] = []
    token_ids: list[int | None] = []
    edits: list[tuple[str, ...]] | None = None
    picks: list[tuple[int, int]] = []
    spans: list[tuple[Any, int, int]] = []
    point = requests[0][1][0][3]
    for state, group in requests:
        start = len(layers)
        count = len(group)
        token_index = group[0][0]
        after_prompt = token_index >= state.prompt_len
        ids += [state.request_id] * count
        tokens += [token_index] * count
        is_generated += [after_prompt] * count
        generated += [token_index - state.prompt_len if after_prompt else None] * count
        token_ids += [state.token_id_at(token_index)] * count
        sites = state.edited_sites
        for entry in group:
            layers.append(entry[1])
            picks.append((entry[4], entry[5]))
        if sites:
            site_edits = [sites.get((entry[1], point.tensor_type, token_index), ())
                          for entry in group]
            if any(site_edits):
                if edits is None:
                    edits = [()] * start
                edits += site_edits
            elif edits is not None:
                edits += [()] * count
        elif edits is not None:
            edits += [()] * count
        spans.append((state, start, start + count))
    batch = ActivationBatch(
        gather(sources, picks),
        request_ids=ids,
        point_names=[point.name] * len(layers),
        layers=layers,
        tensor_type=point.tensor_type.value,
        token_indices=tokens,
        is_generated=is_generated,
        generated_indices=generated,
        token_ids=token_ids,
        edits=edits,
    )
    return batch, spans
