"""The probe contract: what the router calls, and the context it passes.

A probe instance serves one (request, extraction point) pair. The router calls
``check_point(point)`` at registration, ``on_start(ctx)`` once,
``on_activation(record)`` for each matching activation
(in token order, never two at once), then ``on_end(ctx)`` once; it wraps what
``on_end`` returns (the *verdict*) into a :class:`~undercurrent.records.ProbeResult`.
A probe that can score several activations more cheaply at once (one matrix
product instead of many) also overrides ``on_activations(records)``; one that
scores a whole :class:`~undercurrent.records.ActivationBatch` with array
operations overrides ``on_batch(batch)`` instead (the built-ins do), and is
then never handed per-record objects.
"""

from __future__ import annotations

import difflib
import inspect
import operator
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from undercurrent.records import ActivationBatch, BatchSignals, SignalAction, built
from undercurrent.spec.types import ProbeKind

if TYPE_CHECKING:  # pragma: no cover
    from undercurrent.records import ActivationRecord, ProbeSignal
    from undercurrent.spec.types import ExtractionPoint


#: The metadata of every context given none: one read-only empty mapping, shared.
_NO_METADATA: Mapping[str, Any] = types.MappingProxyType({})
#: The actions :meth:`ScoresRows.abort_test` asks about, as ``signal_test`` takes them.
ABORT_ONLY = frozenset({SignalAction.ABORT})


@dataclass(frozen=True)
class RequestContext:
    """What a probe knows about the request it serves.

    The adapter fills ``prompt``, ``prompt_len``, ``model_name`` and, when it has
    them, ``prompt_token_ids``; the router sets ``extraction_point`` to the point
    the probe instance is bound to. ``metadata`` is free-form (e.g. sampling
    parameters) and read-only.
    """

    request_id: str
    prompt: str | None = None
    prompt_len: int | None = None
    model_name: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    extraction_point: ExtractionPoint | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not isinstance(self.metadata, types.MappingProxyType):
            object.__setattr__(self, "metadata", types.MappingProxyType(dict(self.metadata))
                               if self.metadata else _NO_METADATA)

    @classmethod
    def of_prompt(cls, request_id: str, prompt: str | None, prompt_len: int | None,
                  model_name: str | None, prompt_token_ids: tuple[int, ...] | None
                  ) -> RequestContext:
        """``RequestContext(...)`` of these fields, no point and no metadata, for a
        ``prompt_token_ids`` tuple: what the constructor makes, without its one
        ``object.__setattr__`` per field (an adapter makes one per request)."""
        return built(cls, {"request_id": request_id, "prompt": prompt,
                           "prompt_len": prompt_len, "model_name": model_name,
                           "prompt_token_ids": prompt_token_ids, "extraction_point": None,
                           "metadata": _NO_METADATA})

    def at_point(self, point: ExtractionPoint) -> RequestContext:
        """This context with ``extraction_point`` set to ``point`` (what
        ``dataclasses.replace`` gives; the other fields, checked already, are
        shared, not checked again: the router makes one per probe it binds)."""
        made: RequestContext = object.__new__(type(self))
        fields = made.__dict__
        fields.update(self.__dict__)
        fields["extraction_point"] = point
        return made


class Probe:
    """Base class for probes. Subclass it and implement :meth:`on_activation`.

    ``probe_kind`` declares which spec ``probe_kind`` the class serves: one
    :class:`~undercurrent.spec.types.ProbeKind` or a tuple of them (a probe that
    scores each activation alone can serve both). The router refuses a point whose
    ``probe_kind`` the class does not declare. Constructor keyword arguments are
    the point's ``probe_args`` (merged over the router's ``probe_defaults``).

    >>> from undercurrent.records import ProbeSignal
    >>> class LastValue(Probe):
    ...     probe_kind = ProbeKind.TRAJECTORY
    ...     def on_start(self, ctx):
    ...         self.last = None
    ...     def on_activation(self, record):
    ...         self.last = float(record.tensor[0])
    ...         return ProbeSignal(score=self.last)
    ...     def on_end(self, ctx):
    ...         return {"last": self.last}
    """

    probe_kind: ClassVar[ProbeKind | tuple[ProbeKind, ...]] = ProbeKind.SINGLE_SHOT

    def check_point(self, point: ExtractionPoint) -> None:
        """Refuse an extraction point this instance cannot serve: raise ``ValueError``
        saying why and what would fix it.

        The router calls it on a fresh instance when a request is registered (and
        :class:`~undercurrent.api.ProbedModel` when it is built), before
        ``on_start``; a refusal refuses the whole registration, so a probe never
        runs on a point it rejects. The default accepts every point.
        """

    def check_hidden_size(self, hidden_size: int) -> None:
        """Refuse a model whose hidden size (the size of a ``residual_stream``,
        ``attn_out``, ``mlp_out`` or ``final_norm`` activation) this instance
        cannot read: raise ``ValueError`` saying what size it reads.

        :class:`~undercurrent.api.ProbedModel` calls it when it is built, after
        :meth:`check_point`, for each point of those tensor types (not ``kv``),
        when the backend knows the hidden size; a refusal refuses the spec. The
        default accepts every size.
        """

    def on_start(self, ctx: RequestContext) -> None:
        """Called once, before the first activation of the request.

        If it raises, the router records the error and the probe gets no
        activations for that request (they count as dropped) and no ``on_end``.
        """

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        """Judge one activation; return a signal, or None for "nothing to say"."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_activation(record)")

    def on_activations(self, records: Sequence[ActivationRecord]) -> Sequence[ProbeSignal | None]:
        """Judge several activations at once: one signal (or None) per record, in order.

        Inline, the router passes one token's records for this point (its layers,
        in layer order); async, whatever is queued (up to the scheduler's batch).
        Override it only to do the same work faster: it must return what calling
        :meth:`on_activation` on each record in order would, and leave the same
        state. The router calls it only on classes that override it (others get
        ``on_activation`` per record, so an exception costs one record); an
        exception raised here counts as an error for every record of the batch.
        """
        return [self.on_activation(record) for record in records]

    def on_batch(self, batch: ActivationBatch) -> BatchSignals:
        """Judge a whole batch: one signal per row, as columns (a
        :class:`~undercurrent.records.BatchSignals`).

        ``batch`` holds this probe's rows only (one request, one point), in
        token then layer order. The default builds the records
        (``batch.records()``) and calls :meth:`on_activations`, so a probe
        written per record needs nothing else. Override it to score the
        stacked ``batch.tensor`` at once; it must then return what calling
        :meth:`on_activation` on each record in order would, and leave the same
        state. The router calls an override (one call per batch; an exception
        counts as an error for every row) only when the class that defines it
        also defines, or inherits unchanged, ``on_activation`` and
        ``on_activations``; a subclass that overrides either of those is served
        per record again.
        """
        return BatchSignals.from_signals(list(self.on_activations(batch.records())))

    def on_end(self, ctx: RequestContext) -> Any:
        """Called once after the last activation; the return value is the verdict."""
        return None

    @classmethod
    def start_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]) -> bool:
        """:meth:`on_start` of several instances of this class at once (``probes[i]``
        with ``contexts[i]``: one point's probes, one per request of a call), or
        False, with nothing done, when this class starts each alone (the
        default). The router asks when it binds a call's requests together. A
        class may do it only when the result is the state :meth:`on_start` would
        leave in each instance; when it raises, it must have changed nothing:
        the router then calls :meth:`on_start` of each, which notes each failure."""
        return False

    @classmethod
    def end_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]
                 ) -> list[Any] | None:
        """The verdicts :meth:`on_end` gives each instance (``probes[i]`` with
        ``contexts[i]``), computed at once, or None, with nothing done, when this
        class ends each alone (the default). The router asks when it ends a
        call's requests together and none has work left. When it raises, it
        must have changed nothing: the router then calls :meth:`on_end` of each.
        It does so too when the answer is not one verdict per probe, and each
        result's error says so."""
        return None

    def copy_for_request(self) -> Probe | None:
        """A new instance configured as this one, for another request of the same
        point, or None (the default): the router then calls the constructor
        again. The router registers the requests of one generation together
        (:meth:`~undercurrent.router.Router.register_requests`) and asks the
        first request's probe for the others'. A class may return a copy only
        when its configuration never changes after construction and
        :meth:`on_start` makes all of its per-request state; the built-ins
        (their own classes, not subclasses) do, so a probe file is read once
        per generation, not once per request."""
        return None

    @classmethod
    def supported_kinds(cls) -> tuple[ProbeKind, ...]:
        """The probe kinds this class declares, as a tuple."""
        return supported_kinds(cls)


class ScoresRows(Probe):
    """A probe whose judgement of a batch splits in two: per-row values that depend
    on the row alone (:meth:`row_values`, one matrix operation), then the
    instance's own judgement of them, in order (:meth:`judge_rows`, which updates
    its state). The built-ins are written this way.

    Instances with the same :meth:`group_key` compute the same values, so the
    router computes them once for a whole routed batch (every request's rows of a
    point) and hands each instance its rows; :meth:`on_batch` (one instance, its
    own rows) shares them the same way through
    :meth:`~undercurrent.records.ActivationBatch.shared`.
    """

    def group_key(self) -> Any:
        """Hashable, equal for instances whose :meth:`row_values` agree on every
        row; None when an instance must compute its own."""
        return None

    def row_values(self, batch: ActivationBatch) -> Any:
        """Per-row values for the batch: an array or list with one entry per row,
        or a tuple or dict of them, or rows kept another way that slice and join
        as an array does (:class:`~undercurrent.probes.sparse.SparseRows`). Row
        ``i`` depends on row ``i`` only."""
        raise NotImplementedError

    def may_abort(self) -> bool:
        """Whether this instance's signals may ever abort its request. For an
        inline point whose probes cannot, and a ``generate()`` call that reads
        no signal before the end, the capture session judges several decode
        steps' rows in one call (see :mod:`undercurrent.adapters.delivery`).
        The default, for any class that does not say otherwise: True."""
        return True

    @classmethod
    def abort_screen(cls, probes: Sequence[ScoresRows]
                     ) -> Callable[[Sequence[Any]], bool] | None:
        """For ``probes`` that have an :meth:`abort_test`: a cheaper test of a
        decode step's rows, given as the pieces they are stacked from (one
        tensor per layer, a row per request), that may err only towards "may
        abort". False must mean that judging those rows gives no row
        ``abort``; True sends the step to :meth:`abort_test` on its values.
        A step it clears is held without its values, which are computed with
        its window's. None (the default): every step's values are computed
        as it comes, for :meth:`abort_test`."""
        return None

    @classmethod
    def abort_test(cls, probes: Sequence[ScoresRows]) -> Callable[[Any], bool] | None:
        """For ``probes`` (one instance per request, of one point): a function of
        the values :meth:`row_values` gives for a batch of their rows (a
        decode step's) that says whether judging them would give some row
        ``abort``, judging nothing (no state changes). None where it cannot
        tell: the default. With one, a ``generate()`` call holds the decode
        steps of a probe that may abort in windows too, and routes a step at
        once only where it would abort (see :mod:`undercurrent.adapters.delivery`).

        Where ``abort`` depends on each row's own value, the function answers
        exactly. Where it depends on the state earlier rows left (a running
        statistic), it may err only towards "would abort", and must allow for
        the steps held since: it is asked of each step of the point in turn,
        and the steps it cleared are judged later, in order, after the state
        the instances hold when it is asked (it may keep what it needs of them,
        as :class:`~undercurrent.probes.trajectory.RunningBound` does). Such a
        function may carry its own screen (a ``screen`` attribute, used where
        :meth:`abort_screen` gives none), which then sees the steps it clears."""
        return None

    @classmethod
    def signal_test(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                    ) -> Callable[[Any], bool] | None:
        """:meth:`abort_test` for any of ``actions``: whether judging the values
        would give some row one of them, with the same contract. A decode step
        that may give a signal switching on a triggered edit (``when``) is
        routed at once, so the edit applies from the next step; the steps it
        clears are held in windows (see :mod:`undercurrent.adapters.delivery`).
        The default answers only for ``abort`` alone, with :meth:`abort_test`;
        the built-ins answer for ``flag`` too."""
        return cls.abort_test(probes) if actions == ABORT_ONLY else None

    @classmethod
    def signal_screen(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                      ) -> Callable[[Sequence[Any]], bool] | None:
        """:meth:`abort_screen` for :meth:`signal_test` with ``actions`` (the
        default: :meth:`abort_screen` for ``abort`` alone, else None)."""
        return cls.abort_screen(probes) if actions == ABORT_ONLY else None

    def judge_rows(self, values: Any, token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals:
        """Judge rows given their values (those :meth:`row_values` computed) and
        where they sit; update the state as :meth:`on_activation` would, row by row."""
        raise NotImplementedError

    @classmethod
    def judge_many(cls, probes: Sequence[ScoresRows], values: Any,
                   spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals | None:
        """Judge several instances at once: ``probes[i]`` judges rows
        ``spans[i]`` of ``values`` (the whole routed batch's values, one instance
        per request). Returns the signals of rows ``spans[0][0]:spans[-1][1]``
        as one set of columns, with every instance's state updated exactly as
        :meth:`judge_rows` on its own rows would; None when this class does not
        judge in one pass (the router then calls :meth:`judge_rows` per instance).
        Spans are contiguous and in order. The default: None."""
        return None

    def on_batch(self, batch: ActivationBatch) -> BatchSignals:
        """The values shared with the batch this one was sliced (or joined) from
        (or, when computing them for those whole batches fails, for this batch's
        own rows, so a failure is this instance's alone), then :meth:`judge_rows`."""
        key = shared_key(self)
        if key is None:
            values = self.row_values(batch)
        else:
            try:
                values = batch.shared(key, self.row_values)
            except Exception:
                if batch.root is None and batch.parts is None:
                    raise  # computed for these very rows: the failure is this call's
                values = self.row_values(batch)
        return self.judge_rows(values, batch.token_indices, batch.layers)

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        return self.on_activations((record,))[0]

    def on_activations(self, records: Sequence[ActivationRecord]) -> Sequence[ProbeSignal | None]:
        return self.on_batch(ActivationBatch.from_records(records)).signals()


class TellsSignals(ScoresRows):
    """A :class:`ScoresRows` class that answers :meth:`signal_test` and
    :meth:`signal_screen` for any actions (the built-ins): its
    :meth:`abort_test` and :meth:`abort_screen` are those for ``abort`` alone."""

    @classmethod
    def signal_test(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                    ) -> Callable[[Any], bool] | None:
        return None

    @classmethod
    def signal_screen(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                      ) -> Callable[[Sequence[Any]], bool] | None:
        return None

    @classmethod
    def abort_test(cls, probes: Sequence[ScoresRows]) -> Callable[[Any], bool] | None:
        return cls.signal_test(probes, ABORT_ONLY)

    @classmethod
    def abort_screen(cls, probes: Sequence[ScoresRows]
                     ) -> Callable[[Sequence[Any]], bool] | None:
        return cls.signal_screen(probes, ABORT_ONLY)


def _owner(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


#: What makes a :class:`ScoresRows` probe's values, or scores its batches its way.
_VALUE_METHODS = ("row_values", "statistics", "on_batch")
#: _makes_own_values' answers, by class (held weakly: a class redefined in a
#: notebook cell goes with its old definition).
_OWN_VALUES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def shared_key(probe: Any) -> Any:
    """The key under which ``probe`` shares its row values (its
    :meth:`ScoresRows.group_key`), or None: where a class of its own, below the
    one whose ``group_key`` it inherits, redefines ``row_values``, ``statistics``
    or ``on_batch`` (a user's subclass of a built-in that computes other values,
    or scores batches its own way), it computes its own values, never the
    parent's shared ones nor shares its own as theirs. Such a class that does
    mean to share defines ``group_key`` too."""
    cls = type(probe)
    own = _OWN_VALUES.get(cls)
    if own is None:
        own = _OWN_VALUES[cls] = _makes_own_values(cls)
    return None if own else probe.group_key()


def _makes_own_values(cls: type) -> bool:
    owner = _owner(cls, "group_key")
    for klass in cls.__mro__:
        if klass is owner:
            return False
        # (the built-ins split their values across their own classes)
        if not klass.__module__.startswith("undercurrent.") and any(
                name in vars(klass) for name in _VALUE_METHODS):
            return True
    return False


#: scores_batches' answer for a class and the methods it depends on (a class
#: patched since is answered again) is kept on the class itself, under this
#: name: the methods may hold their class (``super()``'s cell), so a table of
#: them would keep every class redefined in a notebook cell alive.
_SCORES_BATCHES = "_undercurrent_scores_batches"


def scores_batches(probe: Any) -> bool:
    """Whether the router hands ``probe`` whole batches (:meth:`Probe.on_batch`):
    its class overrides ``on_batch``, and no subclass below that override
    redefines ``on_activation`` / ``on_activations``."""
    cls = type(probe)
    methods = (getattr(cls, "on_batch", None), getattr(cls, "on_activation", None),
               getattr(cls, "on_activations", None))
    kept = vars(cls).get(_SCORES_BATCHES)
    if kept is not None and kept[0] == methods:
        return bool(kept[1])
    found = _class_scores_batches(cls)
    try:
        setattr(cls, _SCORES_BATCHES, (methods, found))
    except (AttributeError, TypeError):  # (a class that takes no attributes: asked each time)
        pass
    return found


def _class_scores_batches(cls: type) -> bool:
    owner = _owner(cls, "on_batch")
    if owner is None or owner is Probe:
        return False
    for name in ("on_activation", "on_activations"):
        defined = _owner(cls, name)
        if defined is not None and defined is not owner and issubclass(defined, owner):
            return False
    return True


def scores_records_at_once(probe: Any) -> bool:
    """Whether the router hands ``probe`` a call's records in one
    :meth:`Probe.on_activations` call: its class overrides ``on_activations``,
    and no subclass below that override redefines ``on_activation`` (a built-in's
    subclass with its own ``on_activation`` is served per record)."""
    cls = type(probe)
    many = _owner(cls, "on_activations")
    if many is None or many is Probe:
        return False
    one = _owner(cls, "on_activation")
    return one is None or one is many or not issubclass(one, many)


def supported_kinds(cls: type) -> tuple[ProbeKind, ...]:
    """The ``probe_kind`` a probe class declares, normalised to a tuple of enums.

    Raises TypeError when the class declares something that is not a probe kind.
    """
    declared = getattr(cls, "probe_kind", None)
    if declared is None:
        raise TypeError(f"probe class {cls.__name__} declares no probe_kind")
    items = declared if isinstance(declared, (tuple, list, frozenset, set)) else (declared,)
    try:
        return tuple(ProbeKind(item) for item in items)
    except ValueError as exc:
        allowed = ", ".join(kind.value for kind in ProbeKind)
        raise TypeError(
            f"probe class {cls.__name__} declares probe_kind {declared!r}; expected one of "
            f"{allowed} (or a tuple of them)"
        ) from exc


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def probe_args_problem(cls: type, args: Mapping[str, Any]) -> str | None:
    """Why ``cls(**args)`` would be refused for its argument names alone, or None.

    Compares the names with the constructor's signature: an unknown ``probe_arg``
    (with the closest accepted name) or a required one missing. Nothing is built
    and no user code runs, so ``undercurrent validate`` can use it; the values are
    only checked by the constructor itself. A constructor that takes ``**kwargs``
    accepts any name (a class can narrow that by setting ``__signature__``).

    >>> class Scaled(Probe):
    ...     def __init__(self, *, scale, offset=0.0):
    ...         self.scale, self.offset = scale, offset
    >>> probe_args_problem(Scaled, {"scale": 2.0})
    >>> probe_args_problem(Scaled, {"scael": 2.0, "scale": 1.0})
    "unknown probe_arg 'scael' (did you mean 'scale'?); Scaled takes offset, scale"
    >>> probe_args_problem(Scaled, {})
    "missing required probe_arg 'scale'"
    """
    # Only the names matter, so the answer is kept per (class, names): a request
    # registered per prompt does not read the constructor's signature again.
    names = tuple(sorted(args, key=str))
    answers = _ARGS_PROBLEMS.get(cls)
    if answers is None:
        answers = _ARGS_PROBLEMS[cls] = {}
    elif names in answers:
        return answers[names]
    if len(answers) >= _ARGS_PROBLEMS_PER_CLASS:
        answers.clear()
    found = answers[names] = _args_problem(cls, names)
    return found


#: probe_args_problem's answers, by class (held weakly: a class redefined in a
#: notebook cell goes with its old definition), then by argument names.
_ARGS_PROBLEMS: weakref.WeakKeyDictionary[type, dict[tuple[Any, ...], str | None]] = (
    weakref.WeakKeyDictionary())
#: At most this many sets of names are kept per class.
_ARGS_PROBLEMS_PER_CLASS = 512


def _args_problem(cls: type, names: tuple[Any, ...]) -> str | None:
    args = dict.fromkeys(names)
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature: the constructor decides
        return None
    named = [p for p in parameters if p.kind in _NAMED]
    accepted = sorted(p.name for p in named)
    problems: list[str] = []
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        for name in sorted(set(args) - set(accepted), key=str):
            close = difflib.get_close_matches(str(name), accepted, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            takes = ", ".join(accepted) if accepted else "no probe_args"
            problems.append(f"unknown probe_arg {name!r}{hint}; {cls.__name__} takes {takes}")
    missing = [p.name for p in named
               if p.default is inspect.Parameter.empty and p.name not in args]
    if missing:
        noun = "probe_arg" if len(missing) == 1 else "probe_args"
        problems.append(f"missing required {noun} {', '.join(repr(m) for m in missing)}")
    return "; ".join(problems) or None


def shallow_copy(instance: Any) -> Any:
    """A new instance of ``instance`` 's class sharing its attributes (for a
    probe, :meth:`Probe.on_start` then replaces the per-request ones)."""
    made = object.__new__(type(instance))
    made.__dict__.update(instance.__dict__)
    return made



_STATE = operator.attrgetter("__dict__")
# A context's fields, in the order of_prompt gives them.
_CONTEXT_FIELDS = ("request_id", "prompt", "prompt_len", "model_name", "prompt_token_ids",
                   "extraction_point", "metadata")
