"""What flows through undercurrent: activation records in, probe signals and results out.

No torch import here: ``tensor`` is whatever array the adapter captured (a detached
CPU ``torch.Tensor`` from the shipped adapters, or a numpy array in tests).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


def _now() -> float:
    return time.time()


_capture = threading.local()


def capture_time() -> float:
    """When the activations being batched were captured: now, unless the
    backend routes them later than it captured them and says when, in this
    thread (:func:`captured_at`)."""
    stamp = getattr(_capture, "stamp", None)
    return time.time() if stamp is None else stamp


@contextlib.contextmanager
def captured_at(stamp: float | None) -> Iterator[None]:
    """Within the block, batches made in this thread without a timestamp take
    ``stamp`` (None: now): the vLLM driver routes a step the worker held back
    with the time the worker captured it."""
    before = getattr(_capture, "stamp", None)
    _capture.stamp = stamp
    try:
        yield
    finally:
        _capture.stamp = before


@dataclass(frozen=True, eq=False, init=False)
class ActivationRecord:
    """One captured activation: one (request, extraction point, layer, token).

    ``token_index`` is absolute within the request's own prompt + generated
    sequence (padding never counts); ``generated_index`` counts generated tokens
    from 0 and is None for prompt tokens. ``tensor`` is detached, on the CPU, in the
    model's dtype; its shape is ``(hidden,)`` for most tensor types and
    ``(2, num_kv_heads, head_dim)`` for ``kv``. ``edits`` names the live edits
    applied at this very site (layer, tensor type, token) before it was captured,
    so the tensor is the edited value; it is empty for an unedited activation
    (edits at earlier layers change it too, but are not listed here).
    """

    request_id: str
    extraction_point_name: str
    layer: int
    tensor_type: str
    token_index: int
    is_generated: bool
    generated_index: int | None
    token_id: int | None
    tensor: Any
    timestamp: float = field(default_factory=_now)
    edits: tuple[str, ...] = ()

    def __init__(
        self,
        request_id: str,
        extraction_point_name: str,
        layer: int,
        tensor_type: str,
        token_index: int,
        is_generated: bool,
        generated_index: int | None,
        token_id: int | None,
        tensor: Any,
        timestamp: float | None = None,
        edits: tuple[str, ...] = (),
    ) -> None:
        # One record per captured activation, built on the generation thread: one
        # dict update instead of a frozen dataclass's setattr call per field.
        self.__dict__.update(
            request_id=request_id,
            extraction_point_name=extraction_point_name,
            layer=layer,
            tensor_type=tensor_type,
            token_index=token_index,
            is_generated=is_generated,
            generated_index=generated_index,
            token_id=token_id,
            tensor=tensor,
            timestamp=_now() if timestamp is None else timestamp,
            edits=edits,
        )

    @property
    def edited(self) -> bool:
        """True when an edit changed this activation at its own site."""
        return bool(self.edits)

    def key(self) -> tuple[str, str, int, int]:
        """(request, point, layer, token): unique per record within a generation."""
        return (self.request_id, self.extraction_point_name, self.layer, self.token_index)


class SignalAction(str, enum.Enum):
    """What a probe asks of generation."""

    CONTINUE = "continue"
    FLAG = "flag"
    ABORT = "abort"


@dataclass(frozen=True, init=False)
class ProbeSignal:
    """A probe's judgement on one activation.

    ``action`` accepts the enum or its string value; ``score`` is stored as a
    float; ``metadata`` defaults to an empty dict and ``timestamp`` to now.

    ``request_id``, ``extraction_point_name``, ``layer``, ``token_index`` and
    ``generated_index`` say which activation the signal judged (the
    :class:`ActivationRecord` fields of the same names). A probe leaves them None;
    the router fills them in on the signals it keeps (``ProbeResult.signals``)
    and returns, so a signal can be placed on the token axis without its record.
    """

    action: SignalAction = SignalAction.CONTINUE
    score: float | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    timestamp: float = field(default_factory=_now)
    request_id: str | None = None
    extraction_point_name: str | None = None
    layer: int | None = None
    token_index: int | None = None
    generated_index: int | None = None

    def __init__(
        self,
        action: SignalAction | str = SignalAction.CONTINUE,
        score: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        timestamp: float | None = None,
        request_id: str | None = None,
        extraction_point_name: str | None = None,
        layer: int | None = None,
        token_index: int | None = None,
        generated_index: int | None = None,
    ) -> None:
        # Built per activation (when read), like ActivationRecord.
        self.__dict__.update(
            action=action if type(action) is SignalAction else SignalAction(action),
            score=None if score is None else float(score),
            metadata={} if metadata is None else metadata,
            timestamp=_now() if timestamp is None else timestamp,
            request_id=request_id,
            extraction_point_name=extraction_point_name,
            layer=layer,
            token_index=token_index,
            generated_index=generated_index,
        )

    @property
    def located(self) -> bool:
        """True when the signal says which activation it judged."""
        return self.token_index is not None

    def at(self, request_id: str, extraction_point_name: str, layer: int,
           token_index: int, generated_index: int | None) -> ProbeSignal:
        """This signal placed at an activation: itself when already there, else a copy
        with the location filled in (a probe's own object is never changed)."""
        if (self.token_index == token_index and self.layer == layer
                and self.request_id == request_id
                and self.extraction_point_name == extraction_point_name
                and self.generated_index == generated_index):
            return self
        return ProbeSignal(self.action, self.score, self.metadata, self.timestamp,
                           request_id, extraction_point_name, layer, token_index,
                           generated_index)


class LazySequence(Sequence[T], Generic[T]):
    """A read-only sequence whose items are built on first use, then kept.

    It stands where a tuple of per-activation objects would (``ProbeResult.signals``,
    ``GenerationOutput.signals``), so that generation never builds them: a
    caller who reads it pays once. It compares equal to a tuple or list with the
    same items.

    >>> items = LazySequence(lambda: [1, 2])
    >>> items == (1, 2), len(items), items[-1]
    (True, 2, 2)
    """

    __slots__ = ("_build", "_items")

    def __init__(self, build: Callable[[], Iterable[T]]) -> None:
        self._build: Callable[[], Iterable[T]] | None = build
        self._items: tuple[T, ...] | None = None

    def _get(self) -> tuple[T, ...]:
        if self._items is None:
            assert self._build is not None
            self._items = tuple(self._build())
            self._build = None
        return self._items

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...

    def __getitem__(self, index: int | slice) -> T | tuple[T, ...]:
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[T]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazySequence):
            return self._get() == other._get()
        if isinstance(other, (tuple, list)):
            return self._get() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return repr(self._get())

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (and deep-copied) as the tuple of its items.
        return (tuple, (self._get(),))


class IntColumn(Sequence[int]):
    """An index column of an :class:`ActivationBatch` (``layers``,
    ``token_indices``, ``generated_indices``, ``token_ids``) held as a numpy
    integer array: it
    reads as a sequence of Python ints (an item, iteration, :meth:`tolist`),
    a slice is another column over a view of the array, and it compares equal
    to a list or tuple of the same ints. A batch of many rows (a window of
    decode steps) keeps its columns so, instead of making a Python int per row
    that nothing may read.

    >>> import numpy as np
    >>> column = IntColumn(np.array([4, 5, 6]))
    >>> column[1], column[1:] == [5, 6], list(column), column.tolist()
    (5, True, [4, 5, 6], [4, 5, 6])
    """

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> IntColumn: ...

    def __getitem__(self, index: int | slice) -> int | IntColumn:
        if isinstance(index, slice):
            return IntColumn(self.array[index])
        return int(self.array[index])

    def __len__(self) -> int:
        return len(self.array)

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def tolist(self) -> list[int]:
        """The column as a list of Python ints."""
        result: list[int] = self.array.tolist()
        return result

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return self.array if dtype is None else self.array.astype(dtype)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IntColumn):
            return self.tolist() == other.tolist()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"IntColumn({self.tolist()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (and deep-copied) as the list of its ints.
        return (list, (self.tolist(),))


_Built = TypeVar("_Built")


def built(cls: type[_Built], fields: dict[str, Any]) -> _Built:
    """An instance of the frozen dataclass ``cls`` holding ``fields`` (every field,
    in order, each already what ``__init__`` and ``__post_init__`` would keep):
    the instance ``cls(**fields)`` gives, equal to it, made without the frozen
    ``__init__`` (which sets each field with a call to ``object.__setattr__``).
    For the objects made once per request and point on the generation path."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made


@dataclass(frozen=True)
class ProbeStats:
    """Accounting for one binding (one probe instance on one request and point).

    Always ``received == processed + dropped``.
    """

    received: int = 0
    processed: int = 0
    dropped: int = 0
    errors: int = 0
    timeouts: int = 0
    mean_latency_s: float = 0.0

    @classmethod
    def of(cls, received: int, processed: int, dropped: int, errors: int, timeouts: int,
           mean_latency_s: float) -> ProbeStats:
        """``ProbeStats(...)`` with every field given, built without the frozen
        ``__init__`` 's one ``object.__setattr__`` per field (the router makes one
        per request and point)."""
        return built(cls, {"received": received, "processed": processed, "dropped": dropped,
                           "errors": errors, "timeouts": timeouts,
                           "mean_latency_s": mean_latency_s})

    def as_dict(self) -> dict[str, float]:
        return {
            "received": self.received,
            "processed": self.processed,
            "dropped": self.dropped,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "mean_latency_s": self.mean_latency_s,
        }


@dataclass(frozen=True)
class ProbeResult:
    """What one probe concluded about one request at one extraction point.

    ``verdict`` is whatever the probe's ``on_end`` returned; ``signals`` are the
    signals it emitted, in order, each located at its activation (a tuple, or a
    :class:`LazySequence` built when first read); ``error`` describes the first
    failure, if any.
    """

    request_id: str
    extraction_point_name: str
    verdict: Any
    signals: Sequence[ProbeSignal]
    stats: ProbeStats
    error: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.signals, LazySequence):
            object.__setattr__(self, "signals", tuple(self.signals))

    @classmethod
    def of(cls, request_id: str, extraction_point_name: str, verdict: Any,
           signals: tuple[ProbeSignal, ...] | LazySequence[ProbeSignal], stats: ProbeStats,
           error: str | None, metadata: Mapping[str, Any]) -> ProbeResult:
        """``ProbeResult(...)`` with every field given and ``signals`` a tuple or a
        :class:`LazySequence` (what ``__post_init__`` makes of them), built without
        the frozen ``__init__`` 's one ``object.__setattr__`` per field."""
        return built(cls, {"request_id": request_id,
                           "extraction_point_name": extraction_point_name,
                           "verdict": verdict, "signals": signals, "stats": stats,
                           "error": error, "metadata": metadata})

    @property
    def flagged(self) -> bool:
        """True when any signal was a flag or an abort."""
        return any(s.action is not SignalAction.CONTINUE for s in self.signals)

    @property
    def scores(self) -> list[float | None]:
        return [s.score for s in self.signals]


# -- columns: many activations and their signals at once --------------------------------

NO_SIGNAL = -1
"""Action code of a row that got no signal (the probe returned None)."""

ACTION_CODES: Mapping[SignalAction, int] = {
    SignalAction.CONTINUE: 0, SignalAction.FLAG: 1, SignalAction.ABORT: 2,
}
"""``SignalAction`` -> the small int a :class:`BatchSignals` column holds."""

CODE_ACTIONS = (SignalAction.CONTINUE, SignalAction.FLAG, SignalAction.ABORT)
"""Action code -> ``SignalAction`` (indexed by code)."""

ABORT_CODE = ACTION_CODES[SignalAction.ABORT]


def as_list(column: Any) -> list[Any]:
    """A column (list, tuple or numpy array) as a list of Python values.

    >>> as_list((1, 2))
    [1, 2]
    """
    tolist = getattr(column, "tolist", None)
    return list(tolist()) if tolist is not None else list(column)


def stack_rows(rows: Sequence[Any]) -> Any:
    """Stack per-activation tensors into one ``[n, ...]`` tensor: torch stacks torch
    tensors, numpy stacks arrays; anything else (lists) stays a list of rows."""
    first = rows[0]
    if hasattr(first, "detach"):  # a torch tensor: torch is imported already
        return sys.modules["torch"].stack(list(rows))
    if hasattr(first, "__array__") and "numpy" in sys.modules:
        return sys.modules["numpy"].stack(list(rows))
    return list(rows)


def concat_rows(tensors: Sequence[Any]) -> Any:
    """Concatenate ``[n_i, ...]`` tensors (torch, numpy, or lists of rows) along rows."""
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0]
    if hasattr(first, "detach"):
        return sys.modules["torch"].cat(list(tensors))
    if hasattr(first, "__array__") and "numpy" in sys.modules:
        return sys.modules["numpy"].concatenate(list(tensors))
    return [row for tensor in tensors for row in tensor]


class DeferredRows:
    """A batch's tensor made when first read (``make()``, once): the adapters
    defer stacking rows that a probe judging without them (``capture``) never
    reads. Slices defer too, and share the one stacked tensor.

    ``pieces``, when given, are what ``make()`` stacks on dim 1: tensors of one
    row per request each, so that row ``r * len(pieces) + p`` of the made
    tensor is row ``r`` of ``pieces[p]``. A probe whose values are per row
    computes them piece by piece (:func:`undercurrent.probes.arrays.map_rows`)
    without the stacked tensor ever being made."""

    __slots__ = ("make", "value", "lock", "pieces")

    def __init__(self, make: Callable[[], Any], pieces: list[Any] | None = None) -> None:
        self.make: Callable[[], Any] | None = make
        self.value: Any = None
        self.lock = threading.Lock()  # async workers may read slices of one batch at once
        self.pieces = pieces

    def get(self) -> Any:
        if self.value is None:
            with self.lock:
                if self.make is not None:
                    self.value = self.make()
                    self.make = self.pieces = None  # what they held (the rows) can go
        return self.value

    def rows(self, start: int, stop: int) -> Any:
        """Rows ``start:stop``: a view when made already, else deferred too."""
        if self.value is not None:
            return self.value[start:stop]
        return DeferredRows(lambda: self.get()[start:stop])


class ActivationBatch:
    """Many captured activations of one tensor type: one stacked tensor plus index
    columns, the unit the capture path carries from the hook to the probe.

    ``tensor`` is ``[n, ...]`` (a torch tensor from the shipped adapters, a numpy
    array, or a list of rows), row ``i`` being what
    ``ActivationRecord.tensor`` would hold. Each index column has one entry per row,
    with the meaning of the :class:`ActivationRecord` field of the same name
    (singular): ``request_ids``, ``point_names``, ``layers``, ``token_indices``,
    ``is_generated``, ``generated_indices`` (None for prompt tokens),
    ``token_ids`` (None when unknown) and ``edits`` (None: no row was edited).
    ``tensor_type`` is one string for the whole batch; ``timestamp`` is when it
    was captured, and ``timestamps``, where its rows were captured at different
    times (the decode steps of a window, batches joined by :meth:`concat`), each
    row's (None: every row at ``timestamp``).

    Built by the adapters once per forward pass and extraction point (rows grouped
    by request, in token then layer order), routed whole, and sliced per request
    without copying the tensor. :meth:`records` gives the per-vector view, built
    only when asked (``records=True``, a probe written per record); the built-in
    probes never ask.

    >>> batch = ActivationBatch([[3.0, 4.0], [0.0, 1.0]], request_ids=["r", "r"],
    ...     point_names=["p", "p"], layers=[0, 1], tensor_type="mlp_out",
    ...     token_indices=[5, 5], is_generated=[True, True], generated_indices=[0, 0],
    ...     token_ids=[9, 9])
    >>> len(batch), batch.records()[1].layer, batch[1:].records()[0].tensor
    (2, 1, [0.0, 1.0])
    """

    __slots__ = ("_tensor", "request_ids", "point_names", "layers", "tensor_type",
                 "token_indices", "is_generated", "generated_indices", "token_ids", "edits",
                 "timestamp", "timestamps", "_records", "cache", "root", "offset", "parts")

    def __init__(
        self,
        tensor: Any,
        *,
        request_ids: Sequence[str],
        point_names: Sequence[str],
        layers: Sequence[int],
        tensor_type: str,
        token_indices: Sequence[int],
        is_generated: Sequence[bool],
        generated_indices: Sequence[int | None],
        token_ids: Sequence[int | None],
        edits: Sequence[tuple[str, ...]] | None = None,
        timestamp: float | None = None,
        timestamps: Sequence[float] | None = None,
        records: Sequence[ActivationRecord] | None = None,
    ) -> None:
        self._tensor = tensor
        self.request_ids = request_ids
        self.point_names = point_names
        self.layers = layers
        self.tensor_type = tensor_type
        self.token_indices = token_indices
        self.is_generated = is_generated
        self.generated_indices = generated_indices
        self.token_ids = token_ids
        self.edits = edits
        self.timestamp = capture_time() if timestamp is None else timestamp
        self.timestamps = timestamps
        self._records: list[ActivationRecord] | None = (
            None if records is None else list(records))
        self.cache: dict[Any, Any] = {}
        """Derived arrays (e.g. the float64 matrix the built-in probes read), kept
        with the batch so that several probes convert it once."""
        self.root: ActivationBatch | None = None
        """The batch this one is a row range of (None for a batch built whole)."""
        self.offset = 0
        """Where this batch's first row sits in ``root``."""
        self.parts: list[tuple[ActivationBatch, int, int]] | None = None
        """For a batch made by :meth:`concat`: (root, offset, rows) of each piece,
        so that :meth:`shared` values come from the pieces' roots."""

    @classmethod
    def from_records(cls, records: Sequence[ActivationRecord]) -> ActivationBatch:
        """A batch over existing records (one tensor type): :meth:`records` returns
        these very objects; the tensor is stacked only when read."""
        if not records:
            raise ValueError("ActivationBatch.from_records needs at least one record")
        return cls(
            None,
            request_ids=[r.request_id for r in records],
            point_names=[r.extraction_point_name for r in records],
            layers=[r.layer for r in records],
            tensor_type=records[0].tensor_type,
            token_indices=[r.token_index for r in records],
            is_generated=[r.is_generated for r in records],
            generated_indices=[r.generated_index for r in records],
            token_ids=[r.token_id for r in records],
            edits=[r.edits for r in records] if any(r.edits for r in records) else None,
            timestamp=records[0].timestamp,
            records=records,
        )

    @classmethod
    def concat(cls, batches: Sequence[ActivationBatch]) -> ActivationBatch:
        """The rows of several batches of one tensor type, in order (one copy of
        the tensors; records already built are kept)."""
        if len(batches) == 1:
            return batches[0]
        first = batches[0]
        records = None
        if all(batch._records is not None for batch in batches):
            records = [r for batch in batches for r in batch.records()]
        tensor = None
        if all(batch._tensor is not None for batch in batches):
            tensor = concat_rows([batch._rows() for batch in batches])
        if tensor is None and records is None:
            records = [r for batch in batches for r in batch.records()]
        edits = None
        if any(batch.edits is not None for batch in batches):
            edits = [e for batch in batches for e in batch.column_edits()]
        timestamps = None  # each row's capture time, where the batches' differ
        if any(batch.timestamps is not None or batch.timestamp != first.timestamp
               for batch in batches):
            timestamps = [stamp for batch in batches for stamp in batch.column_timestamps()]

        def joined(name: str) -> list[Any]:
            return [value for batch in batches for value in getattr(batch, name)]

        joint = cls(
            tensor,
            request_ids=joined("request_ids"),
            point_names=joined("point_names"),
            layers=joined("layers"),
            tensor_type=first.tensor_type,
            token_indices=joined("token_indices"),
            is_generated=joined("is_generated"),
            generated_indices=joined("generated_indices"),
            token_ids=joined("token_ids"),
            edits=edits,
            timestamp=first.timestamp,
            timestamps=timestamps,
            records=records,
        )
        if tensor is not None:
            joint.parts = [(batch if batch.root is None else batch.root, batch.offset, len(batch))
                           for batch in batches]
        return joint

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def tensor(self) -> Any:
        """The ``[n, ...]`` tensor (stacked from the records on first read when the
        batch was built from records)."""
        if self._tensor is None:
            if self._records is None:
                raise ValueError("this ActivationBatch keeps its index columns only "
                                 "(see index_view): it holds no tensor")
            self._tensor = stack_rows([record.tensor for record in self._records])
        return self._rows()

    def stacked_pieces(self) -> Sequence[Any] | None:
        """The pieces this batch's rows will be stacked from (see
        :class:`DeferredRows`), while they are not stacked yet; else None."""
        tensor = self._tensor
        if type(tensor) is DeferredRows and tensor.value is None:
            return tensor.pieces
        return None

    def _rows(self) -> Any:
        """The tensor held (made now when deferred, see :class:`DeferredRows`)."""
        tensor = self._tensor
        if type(tensor) is DeferredRows:
            tensor = self._tensor = tensor.get()
        return tensor

    def _like(self, tensor: Any, rows: slice | None = None) -> ActivationBatch:
        """A batch of this one's index columns (their ``rows``, when given) over
        ``tensor``, with no records and an empty cache; built without
        :meth:`__init__` (no argument handling, the timestamp kept): the hot
        path makes one per request and step."""
        made = object.__new__(ActivationBatch)
        made._tensor = tensor
        if rows is None:
            made.request_ids, made.point_names = self.request_ids, self.point_names
            made.layers, made.token_indices = self.layers, self.token_indices
            made.is_generated, made.generated_indices = (self.is_generated,
                                                         self.generated_indices)
            made.token_ids, made.edits = self.token_ids, self.edits
            made.timestamps = self.timestamps
        else:
            made.request_ids, made.point_names = self.request_ids[rows], self.point_names[rows]
            made.layers, made.token_indices = self.layers[rows], self.token_indices[rows]
            made.is_generated, made.generated_indices = (self.is_generated[rows],
                                                         self.generated_indices[rows])
            made.token_ids = self.token_ids[rows]
            made.edits = None if self.edits is None else self.edits[rows]
            made.timestamps = None if self.timestamps is None else self.timestamps[rows]
        made.tensor_type, made.timestamp = self.tensor_type, self.timestamp
        made._records, made.cache, made.root, made.offset, made.parts = None, {}, None, 0, None
        return made

    def index_view(self) -> ActivationBatch:
        """The same rows' index columns alone: no tensor, no records, no cache. What
        locating signals later needs, without keeping the activations alive."""
        return self._like(None)

    def without_cache(self) -> ActivationBatch:
        """The same rows (tensor and records shared) with an empty :attr:`cache`:
        what keeping the activations needs, without the arrays probes derived."""
        kept = self._like(self._tensor)
        kept._records = self._records
        return kept

    def column_timestamps(self) -> list[float]:
        """Each row's capture time, as Python floats."""
        if self.timestamps is None:
            return [self.timestamp] * len(self)
        return as_list(self.timestamps)

    def column_edits(self) -> Sequence[tuple[str, ...]]:
        """The ``edits`` column with an entry per row (empty tuples when None)."""
        return self.edits if self.edits is not None else [()] * len(self)

    def __getitem__(self, rows: slice) -> ActivationBatch:
        """Rows ``start:stop`` (step 1): the tensor is a view, the columns short copies."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("an ActivationBatch is sliced by a row range (batch[start:stop])")
        start, stop, _ = rows.indices(len(self))
        if start == 0 and stop == len(self):
            return self
        tensor = self._tensor
        if tensor is not None:
            tensor = (tensor.rows(start, stop) if type(tensor) is DeferredRows
                      else tensor[start:stop])
        piece = self._like(tensor, slice(start, stop))
        if self._records is not None:
            piece._records = self._records[start:stop]
        piece.root = self if self.root is None else self.root
        piece.offset = self.offset + start
        return piece

    def shared(self, key: Any, compute: Callable[[ActivationBatch], Any]) -> Any:
        """``compute(batch)`` for this batch's rows, computed once for the whole
        batch it was sliced from and kept there under ``key``: the probes of many
        requests, each given its own slice, then share one matrix operation.

        ``compute`` must be per row (row ``i`` of its result depends on row ``i``
        of the batch only) and return a row-sliceable value: an array or list, or
        a tuple or dict of them, or rows kept another way that slice and join
        (``join_rows``) as an array does (``probes.sparse.SparseRows``).
        """
        root = self if self.root is None else self.root
        found = root._whole_values(key, compute)
        if root is self:
            return found
        return _rows_of(found, self.offset, self.offset + len(self))

    def _whole_values(self, key: Any, compute: Callable[[ActivationBatch], Any]) -> Any:
        """``compute`` on this whole (root) batch, kept in :attr:`cache`; for a
        batch joined by :meth:`concat`, the pieces' rows of their own roots'
        values, joined (so the batches queued for many requests and joined per
        request still share one computation per routed batch)."""
        found = self.cache.get(key)
        if found is None:
            if self.parts is not None:
                found = join_values([
                    _rows_of(root._whole_values(key, compute), offset, offset + count)
                    for root, offset, count in self.parts])
            else:
                found = compute(self)
            self.cache[key] = found
        return found

    def own_rows(self, spans: Sequence[tuple[int, int]]) -> ActivationBatch | None:
        """The rows of ``spans`` (ascending, disjoint ``(start, stop)`` ranges) as a
        batch of their own: its tensor a copy (one per call), not a view of this
        batch's, with no records, cache or root, so that it keeps alive its own
        rows only. None where there is nothing to gain: the spans are every row
        of a tensor that holds no more, or the batch holds no tensor or rows of
        another kind (a list's rows are its own already)."""
        if self._tensor is None:
            return None
        whole = self._rows()
        if not hasattr(whole, "detach") and not hasattr(whole, "__array__"):
            return None
        if list(spans) == [(0, len(self))] and not _holds_more(whole):
            return None
        pieces = [self[start:stop] for start, stop in spans]
        if len(pieces) > 1:
            own = ActivationBatch.concat(pieces)  # (one copy of the rows)
            own._records, own.parts = None, None
            return own
        rows = pieces[0]._rows()
        return pieces[0]._like(rows.clone() if hasattr(rows, "detach") else rows.copy())

    def records(self) -> list[ActivationRecord]:
        """One :class:`ActivationRecord` per row, built on the first call and kept
        (each record's tensor is a view of the batch's row)."""
        if self._records is None:
            tensor = self._rows()
            unbind = getattr(tensor, "unbind", None)  # torch: every row view in one call
            rows = unbind(0) if unbind is not None else tensor
            edits = self.column_edits()
            ids, names = as_list(self.request_ids), as_list(self.point_names)
            layers, tokens = as_list(self.layers), as_list(self.token_indices)
            generated, is_generated = as_list(self.generated_indices), as_list(
                self.is_generated)
            token_ids, kind = as_list(self.token_ids), self.tensor_type
            stamps = self.column_timestamps()
            self._records = [
                ActivationRecord(ids[i], names[i], layers[i], kind, tokens[i],
                                 is_generated[i], generated[i], token_ids[i], rows[i],
                                 stamps[i], tuple(edits[i]))
                for i in range(len(layers))
            ]
        return self._records

    def spans(self) -> list[tuple[str, int, int]]:
        """(request id, start, stop) for each run of consecutive rows of one request."""
        found: list[tuple[str, int, int]] = []
        ids = self.request_ids
        start = 0
        for index in range(1, len(ids) + 1):
            if index == len(ids) or ids[index] != ids[start]:
                found.append((ids[start], start, index))
                start = index
        return found

    def located(self, index: int) -> tuple[str, str, int, int, int | None]:
        """(request, point, layer, token index, generated index) of row ``index``."""
        generated = self.generated_indices[index]
        return (self.request_ids[index], self.point_names[index], int(self.layers[index]),
                int(self.token_indices[index]), None if generated is None else int(generated))


def _holds_more(tensor: Any) -> bool:
    """Whether ``tensor`` (torch or numpy) is a view of more memory than its own."""
    if hasattr(tensor, "detach"):
        return bool(tensor.untyped_storage().nbytes() > tensor.nelement() * tensor.element_size())
    return getattr(tensor, "base", None) is not None


def rows_of(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a row-sliceable value (an array or list, or a tuple or
    dict of them), as :meth:`ActivationBatch.shared` keeps them."""
    return _rows_of(value, start, stop)


def _rows_of(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, tuple):
        return tuple(_rows_of(item, start, stop) for item in value)
    if isinstance(value, dict):
        return {key: item[start:stop] for key, item in value.items()}
    return value[start:stop]


def join_values(pieces: Sequence[Any]) -> Any:
    """Row-sliceable values (as :meth:`ActivationBatch.shared` keeps them) of
    consecutive row ranges joined into one: the inverse of :func:`rows_of`."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if isinstance(first, tuple):
        return tuple(join_values([piece[index] for piece in pieces])
                     for index in range(len(first)))
    if isinstance(first, dict):
        return {key: join_values([piece[key] for piece in pieces]) for key in first}
    if isinstance(first, list):
        return [item for piece in pieces for item in piece]
    join = getattr(type(first), "join_rows", None)  # (rows kept another way: SparseRows)
    if join is not None:
        return join(pieces)
    return concat_rows(pieces)


class BatchSignals:
    """A probe's signals on an :class:`ActivationBatch`, one row each, as columns.

    ``actions`` holds an action code per row (``ACTION_CODES``; ``NO_SIGNAL`` for a
    row with no signal); ``scores`` a float per row, NaN meaning "no score" unless
    ``all_scored`` (then every row with a signal has its score, NaN included);
    ``metadata`` maps a key to a column of per-row values (every signalled row's
    metadata holds every key). ``objects``, when given, are the signals
    themselves (from a probe written per record) and the columns are derived
    from them. :meth:`signals` materialises ``ProbeSignal`` objects, only when
    asked.
    """

    __slots__ = ("actions", "scores", "metadata", "all_scored", "timestamp", "objects")

    def __init__(
        self,
        actions: Sequence[int],
        scores: Sequence[float] | None = None,
        metadata: Mapping[str, Sequence[Any]] | None = None,
        *,
        all_scored: bool = False,
        timestamp: float | None = None,
        objects: Sequence[ProbeSignal | None] | None = None,
    ) -> None:
        self.actions = actions
        self.scores = scores
        self.metadata = metadata
        self.all_scored = all_scored
        self.timestamp = _now() if timestamp is None else timestamp
        self.objects = objects

    @classmethod
    def none(cls, count: int) -> BatchSignals:
        """``count`` rows without a signal."""
        return cls([NO_SIGNAL] * count)

    @classmethod
    def from_signals(cls, signals: Sequence[ProbeSignal | None]) -> BatchSignals:
        """Columns over signal objects (a per-record probe's, or the router's
        fallbacks); :meth:`signals` returns these very objects."""
        codes = ACTION_CODES
        return cls([NO_SIGNAL if s is None else codes[s.action] for s in signals],
                   objects=list(signals))

    def __len__(self) -> int:
        return len(self.actions)

    def any_signal(self) -> bool:
        """True when some row has a signal."""
        actions: Any = self.actions
        if hasattr(actions, "tolist"):  # a numpy column: compared at once
            return bool((actions != NO_SIGNAL).any())
        if isinstance(actions, (list, tuple)):  # counted in C, not a row at a time
            return actions.count(NO_SIGNAL) != len(actions)
        return any(code != NO_SIGNAL for code in actions)

    def any_abort(self) -> bool:
        """True when some row's signal is an abort."""
        actions: Any = self.actions
        if hasattr(actions, "tolist"):  # a numpy column: compared at once
            return bool((actions == ABORT_CODE).any())
        return ABORT_CODE in actions

    def signals(self, batch: ActivationBatch | None = None) -> list[ProbeSignal | None]:
        """One ``ProbeSignal`` (or None) per row; with ``batch`` (the rows these
        signals judged), each is located at its row."""
        if self.objects is not None:
            found = list(self.objects)
            if batch is not None:
                for index, signal in enumerate(found):
                    if signal is not None:
                        found[index] = signal.at(*batch.located(index))
            return found
        codes = as_list(self.actions)
        scores = as_list(self.scores) if self.scores is not None else None
        columns = ({key: as_list(column) for key, column in self.metadata.items()}
                   if self.metadata else None)
        locate = batch is not None
        if locate:
            assert batch is not None
            ids, names = as_list(batch.request_ids), as_list(batch.point_names)
            layers, tokens = as_list(batch.layers), as_list(batch.token_indices)
            generated = as_list(batch.generated_indices)
        stamp, keep_nan, actions = self.timestamp, self.all_scored, CODE_ACTIONS
        found = []
        for index, code in enumerate(codes):
            if code == NO_SIGNAL:
                found.append(None)
                continue
            score = None if scores is None else scores[index]
            if score is not None and score != score and not keep_nan:  # NaN: no score
                score = None
            meta = ({key: column[index] for key, column in columns.items()}
                    if columns else None)
            if locate:
                found.append(ProbeSignal(actions[code], score, meta, stamp, ids[index],
                                         names[index], layers[index], tokens[index],
                                         generated[index]))
            else:
                found.append(ProbeSignal(actions[code], score, meta, stamp))
        return found

    def __getitem__(self, rows: slice) -> BatchSignals:
        """Rows ``start:stop`` (step 1)."""
        start, stop, _ = rows.indices(len(self))
        if start == 0 and stop == len(self):
            return self
        return BatchSignals(
            self.actions[start:stop],
            None if self.scores is None else self.scores[start:stop],
            None if self.metadata is None else {
                key: column[start:stop] for key, column in self.metadata.items()},
            all_scored=self.all_scored,
            timestamp=self.timestamp,
            objects=None if self.objects is None else self.objects[start:stop],
        )

    @classmethod
    def assemble(cls, count: int, pieces: Sequence[tuple[int, BatchSignals]]) -> BatchSignals:
        """``count`` rows from (first row, signals) pieces that do not overlap; rows
        no piece covers get no signal."""
        if len(pieces) == 1 and pieces[0][0] == 0 and len(pieces[0][1]) == count:
            return pieces[0][1]
        parts: list[BatchSignals] = []
        position = 0
        for start, signals in sorted(pieces, key=lambda piece: piece[0]):
            if start > position:
                parts.append(cls.none(start - position))
            parts.append(signals)
            position = start + len(signals)
        if position < count:
            parts.append(cls.none(count - position))
        return cls.concat(parts) if parts else cls.none(0)

    @classmethod
    def concat(cls, parts: Sequence[BatchSignals]) -> BatchSignals:
        """The rows of several parts, in order."""
        if len(parts) == 1:
            return parts[0]
        codes = list(itertools.chain.from_iterable(as_list(part.actions) for part in parts))
        # Parts with no signal at all (async rows, a late request) only pad the columns.
        full = [part for part in parts if part.objects is not None or part.scores is not None
                or part.metadata is not None or part.any_signal()]
        if not full:
            return cls(codes)
        first = full[0]
        keys = None if first.metadata is None else set(first.metadata)
        if any(part.objects is not None or part.all_scored != first.all_scored
               or (None if part.metadata is None else set(part.metadata)) != keys
               for part in full):
            return cls(codes, objects=[s for part in parts for s in part.signals()])
        nan = float("nan")
        scores: list[float] | None = None
        if any(part.scores is not None for part in full):
            scores = [value for part in parts for value in (
                as_list(part.scores) if part.scores is not None else [nan] * len(part))]
        metadata = None
        if keys is not None:
            metadata = {key: [value for part in parts for value in (
                as_list(part.metadata[key]) if part.metadata is not None
                else [None] * len(part))] for key in keys}
        return cls(codes, scores, metadata, all_scored=first.all_scored,
                   timestamp=first.timestamp)
