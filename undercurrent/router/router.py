"""The Router: binds probes to requests and dispatches activation records to them."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import numbers
import operator
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from undercurrent.probes.base import ABORT_ONLY, RequestContext
from undercurrent.probes.registry import ProbeRegistry, UnknownProbeError, default_registry
from undercurrent.probes.scoring import never_signals
from undercurrent.records import (
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    ProbeResult,
    ProbeSignal,
    SignalAction,
)
from undercurrent.router.binding import Binding, describe_error, logger
from undercurrent.router.errors import OverflowPolicy, RouterError
from undercurrent.router.inline import GroupMembers, judge_group, run_inline
from undercurrent.router.scheduler import AsyncScheduler
from undercurrent.router.validation import (
    CheckedPoint,
    check_request_points,
    default_policy_problems,
    merged_probe_args,
    point_problem,
)
from undercurrent.spec.errors import SpecProblem
from undercurrent.spec.types import InterventionPolicy, OnTimeout, TensorType

_RECENTLY_ENDED = 4096
_CHECKED_KEPT = 16  # point lists remembered as checked (see Router._check_points)
_COUNTERS = ("received", "processed", "dropped", "errors", "timeouts")


class _Request:
    __slots__ = ("request_id", "bindings", "abort_requested")

    def __init__(self, request_id: str, bindings: dict[str, Binding]) -> None:
        self.request_id = request_id
        self.bindings = bindings
        self.abort_requested = False


class RequestHandle:
    """What :meth:`Router.request` yields: route records, then read ``results``."""

    def __init__(self, router: Router, request_id: str) -> None:
        self.router = router
        self.request_id = request_id
        self.results: dict[str, ProbeResult] = {}

    def route(self, record: ActivationRecord) -> ProbeSignal | None:
        """Same as :meth:`Router.route`."""
        return self.router.route(record)

    @property
    def abort_requested(self) -> bool:
        """True once an inline probe (or its fallback) asked to abort this request."""
        return self.router.abort_requested(self.request_id)


def _refusal(item: CheckedPoint, check: Callable[[Any], Any] | None, argument: Any
             ) -> SpecProblem | None:
    """The problem when a probe's ``check`` (``check_point`` or ``check_hidden_size``,
    None when the probe has none) refuses ``argument``; None when it accepts it."""
    if check is None:
        return None
    try:
        check(argument)
    except Exception as exc:  # a refusal, or a check that failed: both refuse
        return point_problem(item.index, item.point,
                             f"probe_type {item.point.probe_type!r} refuses it: {exc}")
    return None


def _resolve_registry(probes: Any) -> ProbeRegistry:
    if probes is None:
        return default_registry
    if isinstance(probes, ProbeRegistry):
        return probes
    if isinstance(probes, Mapping):
        registry = default_registry.copy()
        for name, cls in probes.items():
            registry.register(name, cls, replace=True)
        return registry
    raise TypeError(
        "probes must be None, a ProbeRegistry, or a mapping of probe_type names to probe "
        f"classes; got {type(probes).__name__}"
    )


def _positive_int(name: str, value: Any) -> int:
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)  # (numpy's too)
            or value < 1):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _positive_seconds(name: str, value: Any, *, zero: bool = False) -> float:
    # A bad value would otherwise surface only in the scheduler's supervisor
    # thread, which would die at the first async record (stall protection off).
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)  # (numpy's too)
            or not math.isfinite(value) or value < 0 or (value == 0 and not zero)):
        raise ValueError(f"{name} must be a finite number of seconds "
                         f"{'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


#: How many spans lists' routes :meth:`Router.route_columns` keeps.
_ROUTES_KEPT = 8


@dataclasses.dataclass
class _Routes:
    """Where the spans of one routed batch go: ``each`` in span order,
    (request, binding, start, stop), binding None for a request not live
    (then ``request`` is its id); ``grouped``, the inline bindings judged
    together, by group key. Valid for equal ``spans`` (a copy) while the
    router's version is ``version``."""

    spans: list[tuple[str, int, int]]
    name: str
    version: int
    each: list[tuple[Any, Binding | None, int, int]]
    grouped: dict[Any, GroupMembers]
    queued: tuple[list[Binding], list[int], list[int]] | None = None
    """When every span goes to an async binding: (the bindings, the starts,
    the stops), queued together (:meth:`Binding.enqueue_together`)."""


_STATS = operator.attrgetter("stats")
_BINDINGS = operator.attrgetter("bindings")
_IS_ASYNC = operator.attrgetter("is_async")
_SPAN_ID, _SPAN_START, _SPAN_STOP = (operator.itemgetter(i) for i in range(3))
_COUNTS = tuple(operator.attrgetter(name)
                for name in ("received", "processed", "dropped", "errors", "timeouts"))


def _idle_prefix(requests: Sequence[_Request]) -> int:
    """How many of ``requests``, from the first, have every binding idle now
    (:meth:`Binding.looks_idle`: a hint, checked again when they are ended)."""
    for index, request in enumerate(requests):
        if not all(binding.looks_idle() for binding in request.bindings.values()):
            return index
    return len(requests)


class AbortGuard:
    """Whether routing a batch would abort a request (:meth:`Router.abort_guard`),
    or give one a signal of the actions asked (:meth:`Router.signal_guard`):
    ``guard(batch)`` computes the probes' values (kept in ``batch.cache`` under
    :attr:`key`) and asks their class's ``signal_test``; True as well where
    computing them fails (routing the batch then counts the error).
    :attr:`screen`, where the class has one (``signal_screen``), tells from a
    step's captured pieces, before any batch is made, that it cannot give
    such a signal (False), or that the guard must be asked (True). A test or
    screen that raises answers True (the step is routed as it comes), and
    ``failed(hook, exc)`` notes it on the bindings."""

    __slots__ = ("key", "values_of", "test", "screen", "failed")

    def __init__(self, key: Any, values_of: Callable[[ActivationBatch], Any],
                 test: Callable[[Any], bool],
                 screen: Callable[[Sequence[Any]], bool] | None = None,
                 failed: Callable[[str, Exception], None] | None = None) -> None:
        self.key = key
        self.values_of = values_of
        self.test = test
        self.failed = failed
        self.screen = screen if screen is None else self._screened(screen)

    def _screened(self, screen: Callable[[Sequence[Any]], bool]
                  ) -> Callable[[Sequence[Any]], bool]:
        def screened(pieces: Sequence[Any]) -> bool:
            try:
                return bool(screen(pieces))
            except Exception as exc:  # noqa: BLE001 - noted; the step is routed as it comes
                if self.failed is not None:
                    self.failed("screen", exc)
                return True
        return screened

    def __call__(self, batch: ActivationBatch) -> bool:
        try:
            values = batch.shared(self.key, self.values_of)
        except Exception:  # noqa: BLE001 - routed now: judging it counts the error
            return True
        try:
            return bool(self.test(values))
        except Exception as exc:  # noqa: BLE001 - noted; the step is routed as it comes
            if self.failed is not None:
                self.failed("test", exc)
            return True


def _copies_problem(instance: Any, copies: Sequence[Any]) -> str | None:
    """What is wrong with ``copies`` (``copy_for_request``'s answers for other
    requests), or None: each must be None or a new instance of ``instance``'s
    class, none given twice, so that each request's probe keeps its own state."""
    kind = type(instance).__name__
    made = [copy for copy in copies if copy is not None]
    for copy in made:
        if copy is instance:
            return ("it returned the instance itself, so every request would share one "
                    f"probe and its state; return a new {kind}, or None to have the "
                    "constructor build one")
        if not isinstance(copy, type(instance)) and not _same_class_defined_again(
                type(copy), type(instance)):
            made_kind = type(copy).__name__
            if made_kind == kind:  # (a class of the same name from another module)
                made_kind, kind = _full_name(type(copy)), _full_name(type(instance))
            return (f"it returned {made_kind} {copy!r:.60}; it must return a new "
                    f"{kind}, or None to have the constructor build one")
    if len(set(map(id, made))) != len(made):
        return ("it returned one instance for several requests, so they would share its "
                f"state; return a new {kind} each time, or None")
    return None


def _full_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _same_class_defined_again(made: type, kind: type) -> bool:
    """Whether ``made`` is ``kind``'s class statement run again (a notebook cell
    re-run, a module reloaded after the model was built): same module, same
    qualified name. A ``copy_for_request`` naming its class globally then
    builds the new class's instance, a copy all the same."""
    return (made.__module__, made.__qualname__) == (kind.__module__, kind.__qualname__)


def _default_policy(value: Any) -> InterventionPolicy:
    """``default_intervention_policy`` as a checked policy: None (``reject``), an
    :class:`InterventionPolicy`, or a mapping of its fields. Anything else, an
    unknown field or a value the spec refuses is an error naming the argument."""
    accepted = ("an InterventionPolicy, a mapping of its fields (mode, timeout_ms, "
                "on_timeout), or None (reject)")
    if value is None:
        policy = InterventionPolicy()
    elif isinstance(value, InterventionPolicy):
        policy = value
    elif isinstance(value, Mapping):
        fields = [field.name for field in dataclasses.fields(InterventionPolicy)]
        unknown = [key for key in value if key not in fields]
        if unknown:
            raise TypeError(
                f"default_intervention_policy has unknown field(s) "
                f"{', '.join(map(repr, unknown))}; a mapping takes {', '.join(fields)}"
            )
        try:
            policy = InterventionPolicy(**value)
        except ValueError as error:  # (its message lists the values each field takes)
            raise ValueError(f"default_intervention_policy: {error}") from None
    else:
        hint = ""
        if isinstance(value, str):
            hint = f"; for a mode alone pass {{'mode': {value!r:.40}}}"
        raise TypeError(
            f"default_intervention_policy must be {accepted}, got "
            f"{type(value).__name__} {value!r:.60}{hint}"
        )
    problems = default_policy_problems(policy)
    if problems:
        raise ValueError("default_intervention_policy: " + "; ".join(problems))
    return policy


class Router:
    """Dispatches :class:`~undercurrent.records.ActivationRecord` s to probes.

    One probe instance is built per (request, extraction point) at
    :meth:`register_request`. Inline points run on the caller's thread under their
    intervention policy; async points go through a bounded queue to a shared pool
    of ``workers`` threads. :meth:`end_request` drains, calls every probe's
    ``on_end`` and returns ``{point name: ProbeResult}``.

    ``probes``: None (the default registry), a :class:`ProbeRegistry`, or a mapping
    ``name -> class`` added on top of the default registry. ``probe_defaults``:
    ``{probe_type: kwargs}`` that a point's ``probe_args`` override.
    ``breaker_threshold``: after that many consecutive fallbacks, a
    ``block_until_signal`` point stops being waited on for the rest of its request.

    >>> from undercurrent.spec.types import ExtractionPoint
    >>> point = ExtractionPoint(name="n", layers=(0,), tensor_type="mlp_out",
    ...     position="generated[*]", probe_type="norm_probe", probe_kind="trajectory")
    >>> with Router() as router:
    ...     with router.request([point], request_id="r") as handle:
    ...         _ = handle.route(ActivationRecord("r", "n", 0, "mlp_out", 3, True, 0, 7,
    ...                                           [3.0, 4.0]))
    >>> handle.results["n"].verdict["max_score"]
    5.0
    """

    def __init__(
        self,
        probes: ProbeRegistry | Mapping[str, type] | None = None,
        *,
        probe_defaults: Mapping[str, Mapping[str, Any]] | None = None,
        default_queue_depth: int = 32,
        default_overflow: OverflowPolicy | str = OverflowPolicy.DROP_OLDEST,
        default_intervention_policy: InterventionPolicy | Mapping[str, Any] | None = None,
        workers: int | None = None,
        breaker_threshold: int | None = None,
        drain_timeout_s: float = 10.0,
        stall_timeout_s: float = 1.0,
    ) -> None:
        self.registry = _resolve_registry(probes)
        if probe_defaults is not None and not isinstance(probe_defaults, Mapping):
            raise TypeError("probe_defaults must be a mapping {probe_type: {argument: value}}"
                            f" or None, got {type(probe_defaults).__name__} "
                            f"({probe_defaults!r:.40})")
        defaults = dict(probe_defaults or {})
        for probe_type, kwargs in defaults.items():
            if not isinstance(kwargs, Mapping):
                raise TypeError(
                    f"probe_defaults[{probe_type!r}] must be a mapping of probe_args, "
                    f"got {type(kwargs).__name__}"
                )
            try:  # (a misspelled probe type would be ignored without a word)
                self.registry.get(probe_type)
            except UnknownProbeError as error:
                raise ValueError(
                    f"probe_defaults names an {error}; register a probe of your own "
                    "before the router is built, or pass it in probes={name: class}"
                ) from None
        self.probe_defaults = {name: dict(kwargs) for name, kwargs in defaults.items()}
        self.default_queue_depth: int = _positive_int("default_queue_depth", default_queue_depth)
        self.default_overflow = OverflowPolicy.parse(default_overflow)
        self.default_intervention_policy = _default_policy(default_intervention_policy)
        self.breaker_threshold = (
            None if breaker_threshold is None
            else _positive_int("breaker_threshold", breaker_threshold)
        )
        if workers is None:
            workers = max(1, min(4, os.cpu_count() or 1))
        self.workers: int = _positive_int("workers", workers)
        self.drain_timeout_s = _positive_seconds("drain_timeout_s", drain_timeout_s, zero=True)
        stall_timeout_s = _positive_seconds("stall_timeout_s", stall_timeout_s)
        self._scheduler = AsyncScheduler(self.workers, stall_timeout_s=stall_timeout_s,
                                         owner=self)
        # A router dropped without shutdown() (a notebook cell that builds a new
        # ProbedModel) stops its scheduler: the workers' threads hold the
        # scheduler, not the router, and would wait for work for good. stop()
        # without waiting joins no thread, so it is safe on whichever thread the
        # collector runs it (a worker's own among them); at exit the scheduler's
        # own hook stops and joins every running scheduler.
        weakref.finalize(self, self._scheduler.stop, False).atexit = False
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._version = 0  # bumped whenever _requests changes (cached routes then go)
        # route_columns' routes for a spans list given again, by the list's id.
        self._routes: dict[int, _Routes] = {}
        # _point_bindings' answers, by point name and request ids (with the version
        # they were found at): a window asks of the same requests at each of its
        # checks for room.
        self._points: dict[tuple[str, tuple[str, ...]], tuple[int, list[Binding]]] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._results_after_shutdown: dict[str, dict[str, ProbeResult]] = {}
        self._totals = dict.fromkeys(_COUNTERS, 0)
        self._late_records = 0
        self._closed = False
        self._step = threading.local()  # bindings whose wake-up waits for the step's end
        # Point lists that passed the checks (see _check_points), by point identity.
        self._checked: dict[Any, tuple[tuple[Any, ...], tuple[CheckedPoint, ...]]] = {}

    # -- requests -------------------------------------------------------------------

    def register_request(
        self,
        request_id: str,
        points: Iterable[Any],
        ctx: RequestContext | None = None,
    ) -> None:
        """Bind a fresh probe instance to each point for this request (all or nothing).

        Raises :class:`RouterError` listing every problem: every rule
        :func:`~undercurrent.spec.check_extraction_points` enforces (with the same
        messages), an async point inheriting a blocking default policy, an unknown
        ``probe_type`` (with the known names and the closest match), a
        ``probe_kind`` the probe class does not serve,
        ``probe_args`` the probe's constructor does not accept (or one that
        raises), a probe whose ``check_point`` refuses its point, or a
        ``request_id`` that is already live. Then every probe's ``on_start`` runs;
        one that raises is recorded on its result and that probe gets no records
        for the request.
        """
        label = f"cannot register request {request_id!r}"
        if self._closed:
            raise RouterError(f"{label}: the router is shut down")
        if ctx is None:
            ctx = RequestContext(request_id=request_id)
        elif ctx.request_id != request_id:
            raise RouterError(
                f"{label}: ctx.request_id is {ctx.request_id!r}; it must equal the request_id"
            )
        self._register([ctx], points, label)

    def register_requests(self, contexts: Sequence[RequestContext],
                          points: Iterable[Any]) -> None:
        """:meth:`register_request` for several requests with the same points, each
        named by its context's ``request_id``, all or nothing: nothing is
        registered when any request would be refused (the points, as
        :meth:`register_request` checks them, or an id that is live already or
        given twice), and every probe's ``on_start`` runs once all are bound.

        The points are checked once, and each point's probe is built once by its
        class and copied for the other requests when its class builds a fresh
        instance by copying (:meth:`~undercurrent.probes.base.Probe.copy_for_request`:
        the built-ins): a probe file is read once per call, not once per request.
        """
        contexts = list(contexts)
        if not contexts:
            return
        ids = [ctx.request_id for ctx in contexts]
        shown = ", ".join(repr(request_id) for request_id in ids[:3])
        label = (f"cannot register request {shown}" if len(ids) == 1 else
                 f"cannot register requests {shown}"
                 + (f" and {len(ids) - 3} more" if len(ids) > 3 else ""))
        if len(set(ids)) != len(ids):  # (checked in C; named below)
            repeated = sorted(request_id for request_id, count
                              in collections.Counter(ids).items() if count > 1)
            raise RouterError(f"{label}: request id(s) {repeated} given more than once")
        self._register(contexts, points, label, ids)

    def _register(self, contexts: list[RequestContext], points: Iterable[Any],
                  label: str, ids: list[str] | None = None) -> None:
        """Bind fresh probes to ``points`` for each context's request (``ids``:
        their request ids, when listed already), all or nothing."""
        if self._closed:
            raise RouterError(f"{label}: the router is shut down")
        if ids is None:
            ids = [ctx.request_id for ctx in contexts]
        with self._lock:
            self._refuse_live(ids, label)
        points = list(points)
        checked, problems = self._check_points(points)
        first, refused = self._instantiate(checked)
        problems += refused
        copies: list[list[Any]] = [[] for _ in first]  # per point, the other requests' probes
        if not problems and len(contexts) > 1:
            copies, problems = self._fresh(first, len(contexts) - 1)
        if problems:
            raise RouterError(label, problems)
        # The first request's bindings are made; the others' are their siblings,
        # made a point at a time.
        firsts = [
            Binding(point=item.point, probe=instance, probe_type=item.point.probe_type,
                    ctx=contexts[0].at_point(item.point), policy=item.policy,
                    queue_capacity=item.queue_capacity, overflow=self.default_overflow,
                    breaker_threshold=self.breaker_threshold, owner=self)
            for item, instance in first
        ]
        names = [binding.name for binding in firsts]
        others = contexts[1:]
        columns = [binding.siblings(probes, [ctx.at_point(item.point) for ctx in others])
                   for binding, (item, _), probes in zip(firsts, first, copies, strict=True)]
        rows = (zip(*columns, strict=True) if columns  # (each request's bindings)
                else [()] * len(others))
        requests = [_Request(contexts[0].request_id, dict(zip(names, firsts, strict=True)))]
        requests += [_Request(ctx.request_id, dict(zip(names, bindings, strict=True)))
                     for ctx, bindings in zip(others, rows, strict=True)]
        # A point's probes whose class starts them together are started in one
        # call; the others one by one, request by request.
        started = ([Binding.start_together([first, *column])
                    for first, column in zip(firsts, columns, strict=True)]
                   if others else [False] * len(firsts))
        if not all(started):
            for request in requests:
                for binding, done in zip(request.bindings.values(), started, strict=True):
                    if not done:
                        binding.start()
        with self._lock:
            if self._closed:
                raise RouterError(f"{label}: the router is shut down")
            self._refuse_live(ids, label)
            self._requests.update(zip(ids, requests, strict=True))
            if not self._ended.keys().isdisjoint(ids):  # (ended moments ago: live again)
                for request_id in ids:
                    self._ended.pop(request_id, None)
            self._requests_changed()

    def _refuse_live(self, ids: list[str], label: str) -> None:
        """Raise when one of the requests is live already (lock held)."""
        if self._requests.keys().isdisjoint(ids):
            return  # (none live: the usual case, checked in C)
        live = [request_id for request_id in ids if request_id in self._requests]
        if len(ids) == 1:
            raise RouterError(f"{label}: a request with this id is already live")
        raise RouterError(f"{label}: request id(s) {live[:10]} already live")

    def _fresh(self, built: list[tuple[CheckedPoint, Any]], count: int
               ) -> tuple[list[list[Any]], list[SpecProblem]]:
        """``count`` probes like each of ``built`` 's, for other requests: copied
        when its class copies (:meth:`~undercurrent.probes.base.Probe.copy_for_request`),
        else built again. Returns them per point, and the problems, the first of
        each point (then no probe is returned): a ``copy_for_request`` that raised
        or gave anything but new instances of the class, a probe built again
        that was refused."""
        fresh: list[list[Any]] = []
        problems: list[SpecProblem] = []
        for item, instance in built:
            copy_for_request = getattr(instance, "copy_for_request", None)
            if copy_for_request is None:
                made = [None] * count
            else:
                try:
                    made = [copy_for_request() for _ in range(count)]
                    wrong = _copies_problem(instance, made)
                except Exception as exc:
                    wrong = f"it raised {describe_error(exc)}"
                if wrong is not None:
                    problems.append(point_problem(
                        item.index, item.point,
                        f"copy_for_request of probe_type {item.point.probe_type!r} "
                        f"({type(instance).__name__}): {wrong}", "probe_type"))
                    continue
            if None in made:  # (a class that builds anew, or declined to copy)
                for index, probe in enumerate(made):
                    if probe is None:
                        probe, problem = self._build(item)
                        if problem is not None:  # (one problem per point)
                            problems.append(problem)
                            break
                        made[index] = probe
            fresh.append(made)
        return ([], problems) if problems else (fresh, problems)

    def check(self, points: Iterable[Any], hidden_size: int | None = None) -> None:
        """Run every registration check on ``points`` without registering a request.

        Builds each point's probe (and lets it refuse the point, see
        :meth:`~undercurrent.probes.Probe.check_point`), then discards it. Raises
        :class:`RouterError` listing every problem :meth:`register_request` would
        refuse (``ProbedModel`` calls it when built, so a bad spec fails there,
        not at the first ``generate()``). With the model's ``hidden_size``, a
        probe that cannot read activations of that size is refused too (see
        :meth:`~undercurrent.probes.Probe.check_hidden_size`; not on ``kv``
        points, whose activations have another size).
        """
        checked, problems = self._check_points(list(points))
        problems += self._instantiate(checked, hidden_size)[1]
        if problems:
            raise RouterError("extraction points refused", problems)

    def _instantiate(
        self, checked: list[CheckedPoint], hidden_size: int | None = None
    ) -> tuple[list[tuple[CheckedPoint, Any]], list[SpecProblem]]:
        """Build one probe per checked point; returns (each point that got one with
        its probe, the problems of those that did not: a constructor that raised,
        a probe that refused its point or, given, the model's hidden size)."""
        problems: list[SpecProblem] = []
        built: list[tuple[CheckedPoint, Any]] = []
        for item in checked:
            instance, problem = self._build(item, hidden_size)
            if problem is not None:
                problems.append(problem)
            else:
                built.append((item, instance))
        return built, problems

    def _build(self, item: CheckedPoint, hidden_size: int | None = None
               ) -> tuple[Any, SpecProblem | None]:
        """A probe for a checked point, by its class's constructor: (the probe,
        None), or (None, the problem) when the constructor raised or the probe
        refused the point (or, given, the model's hidden size)."""
        probe_type = item.point.probe_type
        args = merged_probe_args(self.probe_defaults, item.point)
        try:
            instance = item.probe_class(**args)
        except Exception as exc:
            return None, point_problem(
                item.index, item.point,
                f"could not build probe_type {probe_type!r} with probe_args "
                f"{sorted(args)}: {describe_error(exc)}",
                "probe_args",
            )
        checks: list[tuple[Any, Any]] = [(getattr(instance, "check_point", None), item.point)]
        if hidden_size is not None and item.point.tensor_type != TensorType.KV:
            checks.append((getattr(instance, "check_hidden_size", None), hidden_size))
        for check, argument in checks:
            problem = _refusal(item, check, argument)
            if problem is not None:
                return None, problem
        return instance, None

    def check_hidden_size(self, points: Iterable[Any], hidden_size: int) -> None:
        """Refuse the points whose probe cannot read activations of ``hidden_size``
        (:meth:`~undercurrent.probes.Probe.check_hidden_size`; not ``kv`` points),
        and nothing else: raises :class:`RouterError` listing them.

        It is the part of :meth:`check` that needs the model. ``ProbedModel``
        calls it after a ``check(points)`` that takes no ``hidden_size`` (a
        subclass that overrides :meth:`check`), so the model's size is still
        checked. Points refused for another reason, or whose probe cannot be
        built, are left to :meth:`check` and :meth:`register_request`.
        """
        checked, _ = self._check_points(list(points))
        problems: list[SpecProblem] = []
        for item in checked:
            if item.point.tensor_type == TensorType.KV:
                continue
            try:
                instance = item.probe_class(**merged_probe_args(self.probe_defaults, item.point))
            except Exception:
                continue  # not a size problem: register_request names it
            problem = _refusal(item, getattr(instance, "check_hidden_size", None), hidden_size)
            if problem is not None:
                problems.append(problem)
        if problems:
            raise RouterError("extraction points refused", problems)

    def _check_points(self, points: list[Any]) -> tuple[list[CheckedPoint], list[SpecProblem]]:
        """:func:`check_request_points` with this router's defaults. Points that
        passed are remembered by identity (points are frozen), so the requests
        of one generation, which share their point objects, are checked once;
        a remembered answer stands while the registry still maps each probe
        type to the class it was checked with."""
        key = (tuple(map(id, points)), self.default_intervention_policy,
               self.default_queue_depth)
        found = self._checked.get(key)
        if found is not None:
            _, checked = found  # the points themselves are kept, so no id is reused
            if all(self._still_maps(item) for item in checked):
                return list(checked), []
        fresh, problems = check_request_points(
            points,
            self.registry,
            self.default_intervention_policy,
            self.default_queue_depth,
            self.probe_defaults,
        )
        if not problems:
            if len(self._checked) >= _CHECKED_KEPT:
                self._checked.clear()
            self._checked[key] = (tuple(points), tuple(fresh))
        return fresh, problems

    def _still_maps(self, item: CheckedPoint) -> bool:
        """Whether the registry still maps the point's probe type to its class."""
        try:
            return self.registry.get(item.point.probe_type) is item.probe_class
        except UnknownProbeError:
            return False

    def abort_requested(self, request_id: str) -> bool:
        """True once an inline probe (or its fallback) returned ``abort`` for the request."""
        request = self._requests.get(request_id)
        return request is not None and request.abort_requested

    def live_requests(self) -> tuple[str, ...]:
        """The ids of the registered, not yet ended requests."""
        with self._lock:
            return tuple(self._requests)

    def window_rows(self, name: str, request_ids: Iterable[str]) -> int:
        """How many rows of point ``name`` per request may wait to be routed
        together, several decode steps at a time, when nothing reads a signal
        before its request ends: 0 when each step's rows must be routed as they
        come. Every request must be live, and its binding either

        - judged in a group (inline, ``reject``; see :func:`judge_group`) by a
          probe whose signals cannot abort
          (:meth:`~undercurrent.probes.base.ScoresRows.may_abort`): no limit;
        - or async: at most half its queue capacity, so that a window's rows
          find room beside what is still queued.

        Routing the rows later changes no signal, verdict or count, only when
        they are computed."""
        bindings = self._point_bindings(name, request_ids)
        if bindings is None:
            return 0
        return min(map(Binding.window_limit, bindings), default=sys.maxsize)

    def window_room(self, name: str, request_ids: Iterable[str]) -> int:
        """How many more rows of point ``name`` per request the async queues of
        these requests take now without dropping one: the least
        :attr:`~undercurrent.router.binding.Binding.room` over their async
        bindings (``sys.maxsize`` when none is async; 0 when a request is not
        live or lacks the point).

        Only routing adds to a queue, and the workers only make room, so rows
        held back while the queues are as they are now, up to this many per
        request, find room when they are routed: a window of an async point
        may grow past :meth:`window_rows` (half a queue) to this, where the
        workers have kept up."""
        bindings = self._point_bindings(name, request_ids)
        if bindings is None:
            return 0
        return Binding.least_room(bindings)

    def abort_guard(self, name: str, request_ids: Iterable[str]) -> AbortGuard | None:
        """For point ``name`` of these live requests, where :meth:`window_rows`
        holds no row back because their probes may abort, but each binding is
        judged in one group (inline, ``reject``) by probes of one class that
        tell from a batch's values whether judging it would abort
        (:meth:`~undercurrent.probes.base.ScoresRows.abort_test`): a
        :class:`AbortGuard`, a function of a batch of these requests' rows of the
        point (as :meth:`route_columns` takes it) that says whether routing it
        would abort one of them. None otherwise.

        The values are kept on the batch (under ``guard.key``), so routing it
        computes them once.
        Rows of a decode step that would not abort may then wait in a window
        as the steps of a probe that cannot abort do (see
        :mod:`undercurrent.adapters.delivery`): judging them later gives the
        same signals, verdicts and counts."""
        return self.signal_guard(name, request_ids, ABORT_ONLY)

    def signal_guard(self, name: str, request_ids: Iterable[str],
                     actions: frozenset[SignalAction]) -> AbortGuard | None:
        """:meth:`abort_guard` for a signal of any of ``actions``: whether routing
        a batch would give one of these requests such a signal (a ``flag``
        that switches on a triggered edit, say), from the probes'
        :meth:`~undercurrent.probes.base.ScoresRows.signal_test`. None where
        a binding is not judged inline in one group, or the probes cannot
        tell."""
        bindings = self._point_bindings(name, request_ids)
        if not bindings:
            return None
        key = bindings[0].group
        probes = [binding.probe for binding in bindings]
        signal_test = getattr(type(probes[0]), "signal_test", None)
        if (key is None or signal_test is None
                or any(binding.is_async or binding.group != key for binding in bindings)):
            return None
        signal_screen = getattr(type(probes[0]), "signal_screen", None)
        # (named as the user's class defines them: the defaults answer for abort alone)
        asked, screen_name = (("abort_test", "abort_screen") if actions == ABORT_ONLY
                              else ("signal_test", "signal_screen"))
        try:
            test = signal_test(probes, actions)
            if test is None:
                return None
            asked = screen_name
            screen = None if signal_screen is None else signal_screen(probes, actions)
        except Exception as exc:
            for binding in bindings:
                binding.hook_failed(asked, exc, "every decode step is routed as it comes")
            return None
        if screen is None:  # (a test that keeps state may screen with it: RunningBound)
            screen = never_signals if test is never_signals else getattr(test, "screen", None)
        test_name = "abort_test" if actions == ABORT_ONLY else "signal_test"

        def failed(part: str, exc: Exception) -> None:
            # (the function the probe's abort_test / abort_screen returned raised)
            hook = test_name if part == "test" else screen_name
            for binding in bindings:
                binding.hook_failed(f"{hook}'s function", exc,
                                    "the steps it was asked of are routed as they come")

        return AbortGuard(key, probes[0].row_values, test, screen, failed)

    def _requests_changed(self) -> None:
        """A request was registered or ended (lock held): the routes and bindings
        found before are stale, and let go of."""
        self._version += 1
        self._routes.clear()
        self._points.clear()

    def _point_bindings(self, name: str, request_ids: Iterable[str]) -> list[Binding] | None:
        """The bindings of point ``name`` of these requests, in order; None when
        one of them is not live or lacks the point."""
        key = (name, tuple(request_ids))
        with self._lock:  # (looked up in C: map over the ids, then over the requests)
            version = self._version
            found = self._points.get(key)
            if found is not None and found[0] == version:
                return found[1]
            requests = list(map(self._requests.get, key[1]))
        if None in requests:
            return None
        bindings = list(map(operator.methodcaller("get", name), map(_BINDINGS, requests)))
        if None in bindings:
            return None
        with self._lock:
            if self._version == version:  # (still live: kept until one is registered or ended)
                if len(self._points) >= _ROUTES_KEPT:
                    self._points.clear()
                self._points[key] = (version, bindings)
        return bindings

    def may_abort(self, request_ids: Iterable[str]) -> bool:
        """Whether a probe may stop one of these live requests before it ends.
        That is an inline binding whose probe may return ``abort`` (a probe
        that does not say so, through
        :meth:`~undercurrent.probes.base.ScoresRows.may_abort`, is taken to),
        or whose policy falls back to ``abort`` on a timeout or an error. Async
        bindings only observe. A request that is not live has no binding."""
        with self._lock:
            requests = [self._requests.get(request_id) for request_id in request_ids]
        for request in requests:  # (the probes are asked without the router's lock)
            for binding in () if request is None else request.bindings.values():
                if binding.is_async:
                    continue
                if binding.policy.on_timeout is OnTimeout.ABORT or binding.may_abort():
                    return True
        return False

    # -- the hot path -------------------------------------------------------------

    def route(self, record: ActivationRecord) -> ProbeSignal | None:
        """Hand one record to its binding.

        Inline points: returns the signal that applies to generation (the probe's,
        or the intervention's fallback), located at the record, None when the
        probe has nothing to say or raised under ``reject``. Async points: queues
        the record and returns None. A record for a request that ended moments
        ago is ignored (counted in ``metrics()["late_records"]``); one for a
        request never registered raises :class:`RouterError`.
        """
        return self.route_batch((record,))[0]

    def route_batch(self, records: Sequence[ActivationRecord]) -> list[ProbeSignal | None]:
        """Hand several records of one request and one extraction point to its
        binding at once; returns one entry per record, as :meth:`route` would.

        The records travel as one :class:`~undercurrent.records.ActivationBatch`
        (see :meth:`route_columns`): the binding is looked up and locked once,
        and the probe judges them in one call. Inline, the batch is one call
        under the point's intervention (``block_until_signal``: one wait, one
        deadline). Records of different requests or points raise
        :class:`RouterError`.
        """
        if not records:
            return []
        first = records[0]
        for record in records:
            if (record.request_id != first.request_id
                    or record.extraction_point_name != first.extraction_point_name):
                raise RouterError(
                    "route_batch: every record must belong to one request and one extraction "
                    f"point; got ({first.request_id!r}, {first.extraction_point_name!r}) and "
                    f"({record.request_id!r}, {record.extraction_point_name!r})"
                )
        batch = ActivationBatch.from_records(records)
        return self.route_columns(batch).signals(batch)

    def route_columns(
        self, batch: ActivationBatch, spans: Sequence[tuple[str, int, int]] | None = None
    ) -> BatchSignals:
        """Route a batch of ONE extraction point's rows for any number of requests;
        returns, per row, the signal that applies to generation (as columns).

        Rows must be grouped by request, each request's rows in token then layer
        order (what the adapters build once per forward pass). ``spans`` lists
        (request id, start, stop) for each request's rows to route (computed from
        ``batch.request_ids`` when None); rows outside them are not routed and get
        no signal (the result always has one row per batch row). Each request's
        rows go to its binding as one slice of the batch (no copy): one lookup, one
        accounting update, one probe call (inline) or one queue entry (async) per
        binding. Async rows get no signal. A request whose inline rows produced
        an ``abort`` is marked (:meth:`abort_requested`). Rows of a request that ended moments
        ago are ignored (``late_records``); a request never registered, or a
        point the request does not have, raises :class:`RouterError`.
        """
        count = len(batch)
        if not count:
            return BatchSignals.none(0)
        names = batch.point_names
        name = names[0]
        # (a list's count compares by identity first: the adapters' rows share one name)
        if (names.count(name) != count if isinstance(names, (list, tuple))
                else len(set(names)) > 1):
            raise RouterError(
                "route_columns: every row must belong to one extraction point; got "
                f"{sorted(set(names))}"
            )
        routes = None if spans is None else self._routes.get(id(spans))
        if (routes is None or routes.version != self._version or routes.name != name
                or routes.spans != spans):
            routes = self._find_routes(batch.spans() if spans is None else spans, name)
            if spans is not None:  # given again (a steady decode step): kept
                if len(self._routes) >= _ROUTES_KEPT:
                    self._routes.clear()
                self._routes[id(spans)] = routes
        pieces: list[tuple[int, BatchSignals]] = []
        if routes.queued is not None:  # every span async: queued at once where nothing drops
            bindings, starts, stops = routes.queued
            handed = Binding.enqueue_together(bindings, batch, starts, stops)
            if handed is not None:
                self._hand_over(handed)
                return BatchSignals.assemble(count, pieces)
        for request, binding, start, stop in routes.each:
            if binding is None:
                self._route_unknown(request, stop - start)
            elif binding.is_async:
                self._enqueue(binding, batch, start, stop)
            else:
                signals = run_inline(binding, batch[start:stop])
                if signals.any_abort():
                    request.abort_requested = True
                pieces.append((start, signals))
        for key, members in routes.grouped.items():
            pieces.extend(judge_group(batch, key, members))
        return BatchSignals.assemble(count, pieces)

    def _find_routes(self, spans: Sequence[tuple[str, int, int]], name: str) -> _Routes:
        """Where each span of a batch of point ``name`` goes, as of now."""
        version = self._version  # read first: a change meanwhile makes these stale
        # Every request live with the point, its bindings all judged in one group
        # or none in a group (the usual cases): looked up in C.
        requests = list(map(self._requests.get, map(_SPAN_ID, spans)))
        if None not in requests:
            bindings = list(map(operator.methodcaller("get", name), map(_BINDINGS, requests)))
            shared, key = (False, None) if None in bindings else Binding.shared_group(bindings)
            if shared:
                starts, stops = list(map(_SPAN_START, spans)), list(map(_SPAN_STOP, spans))
                routed = zip(requests, bindings, starts, stops, strict=True)
                if key is None:
                    queued = ((bindings, starts, stops) if bindings and all(
                        map(_IS_ASYNC, bindings)) else None)
                    return _Routes(list(spans), name, version, list(routed), {}, queued)
                together = GroupMembers()
                together.extend(routed)
                return _Routes(list(spans), name, version, [], {key: together})
        each: list[tuple[Any, Binding | None, int, int]] = []
        grouped: dict[Any, GroupMembers] = {}
        for request_id, start, stop in spans:
            request = self._requests.get(request_id)
            if request is None:
                each.append((request_id, None, start, stop))
                continue
            binding = request.bindings.get(name)
            if binding is None:
                raise RouterError(
                    f"route: request {request_id!r} has no extraction point named "
                    f"{name!r}; its points are {sorted(request.bindings)}"
                )
            if binding.group is not None and not binding.is_async:
                members = grouped.get(binding.group)
                if members is None:
                    members = grouped[binding.group] = GroupMembers()
                members.append((request, binding, start, stop))
            else:
                each.append((request, binding, start, stop))
        return _Routes(list(spans), name, version, each, grouped)

    def _enqueue(self, binding: Binding, batch: ActivationBatch, start: int, stop: int
                 ) -> None:
        """Queue rows ``start:stop`` of a batch on an async binding, handing it to
        the workers as needed.

        Under ``block`` the hand-over happens as soon as vectors are queued, before
        waiting for room for the rest: only a worker that holds the binding can
        make room. (Handing over once, after the whole batch, left the generation
        thread waiting on a queue no worker would ever drain.) The other policies
        never wait, so inside a :meth:`step` their hand-over waits for the end of
        the step.
        """
        if binding.overflow is OverflowPolicy.BLOCK:
            binding.enqueue_blocking(batch, self._scheduler.schedule, start, stop)
            return
        if binding.enqueue_batch(batch, start, stop):
            self._hand_over((binding,))

    def _hand_over(self, bindings: Sequence[Binding]) -> None:
        """Hand bindings with newly queued rows to the workers: now, or at the end
        of the :meth:`step` under way."""
        if not bindings:
            return
        deferred = getattr(self._step, "bindings", None)
        if deferred is None:
            self._scheduler.schedule_many(bindings)
        else:
            deferred.extend(bindings)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Route one engine step's records inside this block: async bindings that
        get records wake the workers once, at the end, instead of once each, so
        the worker threads do not contend with the generation thread mid-step.
        Inline routing is unaffected. The adapters wrap each forward's delivery
        in it; nesting is allowed (the outermost block wakes the workers).
        """
        if getattr(self._step, "bindings", None) is not None:
            yield
            return
        self._step.bindings = []
        try:
            yield
        finally:
            bindings, self._step.bindings = self._step.bindings, None
            self._scheduler.schedule_many(bindings)

    def _route_unknown(self, request_id: str, count: int = 1) -> None:
        with self._lock:
            if request_id in self._ended:
                self._late_records += count
                return
            live = sorted(self._requests)
        raise RouterError(
            f"route: no live request {request_id!r} (live requests: {live[:10]}); "
            "call register_request first"
        )

    # -- ending ---------------------------------------------------------------------

    def end_request(
        self, request_id: str, *, timeout_s: float | None = None
    ) -> dict[str, ProbeResult]:
        """Drain the request's async queues (at most ``timeout_s``, default the router's
        ``drain_timeout_s``), call every probe's ``on_end``, return ``{point: result}``.

        Records still queued at the deadline count as dropped and the result's
        ``error`` says so. A probe still inside ``on_activation`` at the deadline
        is not sent ``on_end`` (its verdict is None).
        """
        with self._lock:
            if request_id not in self._requests and request_id not in self._results_after_shutdown:
                raise RouterError(
                    f"end_request: no live request {request_id!r}; it was never registered "
                    "or has already ended"
                )
            requests, stored = self._take([request_id])
        if stored:
            return stored[request_id]
        timeout = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        return self._finish_all(requests, timeout)[0]

    def end_requests(self, request_ids: Iterable[str], *, timeout_s: float | None = None
                     ) -> list[dict[str, ProbeResult]]:
        """:meth:`end_request` for each id, in order, with the router's lock taken
        once for all of them: one ``{point: result}`` per id, the results that
        ending them one by one gives (each request's drain starts when its turn
        comes and lasts at most ``timeout_s``).

        All or nothing: when an id is not live (and was not ended by
        :meth:`shutdown`) or is given twice, none is ended.
        """
        ids = list(request_ids)
        with self._lock:
            # (set operations in C: every id live, each once, is the usual case)
            missing = set(ids).difference(self._requests, self._results_after_shutdown)
            unknown = [request_id for request_id in ids if request_id in missing]
            repeated = [] if len(set(ids)) == len(ids) else sorted(
                request_id for request_id, count in collections.Counter(ids).items()
                if count > 1)
            if unknown or repeated:
                raise RouterError(
                    "end_requests: "
                    + (f"no live request(s) {unknown[:10]} (never registered or already "
                       "ended)" if unknown else f"request id(s) {repeated[:10]} given twice")
                    + "; no request was ended"
                )
            requests, stored = self._take(ids)
        timeout = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        if not stored:  # every one was live: its results, in order
            return self._finish_all(requests, timeout)
        finished = iter(self._finish_all(requests, timeout))
        return [stored[request_id] if request_id in stored else next(finished)
                for request_id in ids]

    def _take(self, ids: list[str]) -> tuple[list[_Request], dict[str, dict[str, ProbeResult]]]:
        """Take the requests ``ids`` out of the live ones, each known to be live or
        ended by :meth:`shutdown` (lock held): the live ones' requests, in order,
        and the results shutdown stored for the others."""
        requests = []
        stored = {}
        if self._requests.keys() >= set(ids):  # every one live: taken in C
            requests = list(map(self._requests.pop, ids))
            self._ended.update(dict.fromkeys(ids))
        else:
            for request_id in ids:
                request = self._requests.pop(request_id, None)
                if request is None:
                    stored[request_id] = self._results_after_shutdown.pop(request_id)
                else:
                    requests.append(request)
                    self._ended[request_id] = None
        while len(self._ended) > _RECENTLY_ENDED:
            self._ended.popitem(last=False)
        self._requests_changed()
        return requests, stored

    def _finish_all(self, requests: Sequence[_Request], timeout: float,
                    shared: bool = False) -> list[dict[str, ProbeResult]]:
        """End each request's bindings in turn (drain, ``on_end``, result) and add
        their counts to the totals. Each request's drain lasts at most ``timeout``
        (``shared``: at most what the drains before it left of ``timeout``). The
        requests not ended yet are ended together where all their bindings are
        idle (:meth:`_end_together`: what ending each in turn gives them), tried
        at the start, after each request that had to wait for its bindings (the
        others' workers went on meanwhile) and after 1, 2, 4... requests ended in
        turn since the last try; where some are not idle yet (a worker's turn
        still settles them), the requests before the first of them are ended
        together. An interrupt part-way ends every binding not ended yet without waiting
        (their queued rows count as dropped), so none stays open, then
        propagates."""
        finished: list[dict[str, ProbeResult]] = []
        try:
            waited, countdown, backoff = True, 0, 1
            while len(finished) < len(requests):
                rest = requests[len(finished):]
                if waited or not countdown:
                    together = self._end_together(rest)
                    if together is None:  # (a worker still settles some: the idle ones first)
                        idle = _idle_prefix(rest)
                        together = self._end_together(rest[:idle]) if idle < len(rest) else None
                    if together is not None:
                        finished += together
                        continue
                    # (tried again after 1, 2, 4... requests ended in turn, or one that waited)
                    countdown, backoff = backoff, backoff * 2
                started = time.monotonic() if shared else 0.0
                ended, waited = self._end_bindings(rest[0], timeout)
                if shared and waited:
                    timeout = max(0.0, timeout - (time.monotonic() - started))
                finished.append(ended)
                countdown -= 1
        except BaseException:
            # (the interrupted request's bindings ended before the interrupt are
            # final: only their counts are read)
            self._add_totals([binding.result(None) if binding.finalised else binding.end(0.0)
                              for request in requests[len(finished):]
                              for binding in request.bindings.values()])
            raise
        finally:
            self._add_totals(list(itertools.chain.from_iterable(map(dict.values, finished))))
        return finished

    @staticmethod
    def _end_together(requests: Sequence[_Request]) -> list[dict[str, ProbeResult]] | None:
        """Each request's results when the requests have the same points (in the
        same order) and every binding is idle: all ended at once
        (:meth:`Binding.end_idle_together`). None, with nothing done, otherwise."""
        if len(requests) < 2:
            return None
        tables = list(map(_BINDINGS, requests))
        names = tuple(tables[0])
        if not names or set(map(tuple, tables)) != {names}:  # (keys compared in C)
            return None
        columns = list(zip(*map(dict.values, tables), strict=True))
        ended = Binding.end_idle_together(columns)
        if ended is None:
            return None
        return [dict(zip(names, row, strict=True)) for row in zip(*ended, strict=True)]

    @staticmethod
    def _end_bindings(request: _Request, timeout: float
                      ) -> tuple[dict[str, ProbeResult], bool]:
        """The request's results, and whether ending it waited for a binding."""
        # Most bindings are idle by now (inline ones always, unless a late
        # block_until_signal call still runs): each ends at once, in order.
        ended: dict[str, ProbeResult] = {}
        items = list(request.bindings.items())
        for name, binding in items:
            result = binding.end_if_idle()
            if result is None:
                break
            ended[name] = result
        else:
            return ended, False
        # The others: close all, wait for each, end each.
        bindings = [binding for _, binding in items[len(ended):]]
        for binding in bindings:
            binding.close()
        now = time.monotonic()
        # Each binding's wait starts now and lasts at most its limit: the drain
        # timeout, or an inline blocking point's shorter grace (Binding.end_grace_s).
        limits = [min(timeout, binding.end_grace_s) for binding in bindings]
        for binding, limit in zip(bindings, limits, strict=True):
            binding.wait_idle(now + limit)
        ended.update((binding.name, binding.end(limit))
                     for binding, limit in zip(bindings, limits, strict=True))
        return ended, True

    def _add_totals(self, results: Sequence[ProbeResult]) -> None:
        stats = list(map(_STATS, results))  # (summed in C: one result per request)
        received, processed, dropped, errors, timeouts = (
            sum(map(count, stats)) for count in _COUNTS)
        with self._lock:
            totals = self._totals
            totals["received"] += received
            totals["processed"] += processed
            totals["dropped"] += dropped
            totals["errors"] += errors
            totals["timeouts"] += timeouts

    @contextmanager
    def request(
        self,
        points: Iterable[Any],
        ctx: RequestContext | None = None,
        *,
        request_id: str | None = None,
    ) -> Iterator[RequestHandle]:
        """Register a request for the ``with`` block; its results land on the handle.

        The id is ``request_id``, else ``ctx.request_id``, else a fresh uuid.
        """
        if request_id is None:
            request_id = ctx.request_id if ctx is not None else uuid.uuid4().hex
        self.register_request(request_id, points, ctx)
        handle = RequestHandle(self, request_id)
        try:
            yield handle
        finally:
            handle.results = self.end_request(request_id)

    def shutdown(
        self, wait: bool = True, *, timeout_s: float | None = None
    ) -> dict[str, dict[str, ProbeResult]]:
        """Stop the router; end every live request and return their results by id.

        ``wait=True`` drains async queues first, then joins the workers, all within
        ``timeout_s`` (default the router's ``drain_timeout_s``): each request's
        drain, and then the join, gets what the ones before left of it (a worker
        still stuck in a probe call at the deadline is left to finish on its own,
        its thread a daemon); ``wait=False`` discards queued records
        (counted as dropped). Later ``route`` calls for those requests are ignored,
        and ``end_request`` on them returns the results computed here. Idempotent.
        """
        with self._lock:
            if self._closed:
                return {}
            self._closed = True
            live = list(self._requests.values())
            self._requests.clear()
            self._requests_changed()
            for request in live:
                self._ended[request.request_id] = None
        timeout = 0.0 if not wait else (
            self.drain_timeout_s if timeout_s is None else float(timeout_s))
        # One deadline for all of it: each request's drain, then joining the
        # workers (one stuck in a probe call), get what is left of timeout_s.
        deadline = time.monotonic() + timeout
        results = dict(zip((request.request_id for request in live),
                           self._finish_all(live, timeout, shared=True), strict=True))
        if live:
            logger.info("router shut down with %d live request(s) ended", len(live))
        with self._lock:
            self._results_after_shutdown.update(results)
        self._scheduler.stop(wait=wait, timeout_s=max(0.0, deadline - time.monotonic()))
        return results

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- observability ----------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """A snapshot: per live binding, and totals over every request so far.

        ``bindings`` is a list of dicts with ``request_id``, ``point``,
        ``probe_type``, ``execution_mode``, ``intervention``, ``received``,
        ``processed``, ``dropped``, ``errors``, ``timeouts``, ``queue_depth``
        (records waiting now), ``queue_capacity``, ``mean_latency_s``,
        ``max_latency_s``, ``breaker_open``. ``totals`` sums the counters over
        ended and live bindings. Also ``live_requests``, ``workers``,
        ``ready_bindings`` and ``late_records``.
        """
        with self._lock:
            live = list(self._requests.values())
            totals = dict(self._totals)
            late = self._late_records
        bindings = [b.snapshot() for request in live for b in request.bindings.values()]
        for snapshot in bindings:
            for counter in _COUNTERS:
                totals[counter] += snapshot[counter]
        return {
            "live_requests": len(live),
            "workers": self._scheduler.worker_count(),
            "ready_bindings": self._scheduler.ready_count(),
            "late_records": late,
            "totals": totals,
            "bindings": bindings,
        }
