"""``@probe``: turn a plain function into a single-shot probe class."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from undercurrent.arguments import check_flag
from undercurrent.probes.base import Probe, RequestContext
from undercurrent.probes.registry import ProbeRegistry, default_registry
from undercurrent.probes.scoring import ScoreSummary, ThresholdRule
from undercurrent.records import ActivationRecord, ProbeSignal, SignalAction
from undercurrent.spec.types import ProbeKind

_RULE_OPTIONS = ("threshold", "action")


def probe(
    function: Callable[..., Any] | str | None = None,
    *,
    name: str | None = None,
    registry: ProbeRegistry | None = None,
    register: bool = True,
) -> Any:
    """Make a single-shot probe class from ``function(record, *, options...)``.

    The function returns ``bool`` (True = ``action``), a number (the score),
    a :class:`~undercurrent.records.ProbeSignal`, or None. Its keyword-only
    parameters become probe_args; two more are always accepted: ``threshold``
    (a score at or above it triggers ``action``) and ``action`` (``flag`` default,
    or ``abort``). The class is registered under ``name`` (default: the
    function's name) in ``registry`` (default: the global one) unless
    ``register=False``. The verdict is a
    :class:`~undercurrent.probes.scoring.ScoreSummary` dict.

    >>> @probe(register=False)
    ... def first_value(record, *, scale=1.0):
    ...     return scale * float(record.tensor[0])
    >>> first_value.probe_kind.value
    'single_shot'
    """
    if isinstance(function, str):
        return probe(name=function, registry=registry, register=register)
    # (checked before the function is wrapped: a bad argument is named here, not
    # met as an AttributeError or an unhashable key inside the registry)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"@probe: name must be a non-empty string or None (the "
                         f"function's name), got {name!r:.40}")
    if registry is not None and not isinstance(registry, ProbeRegistry):
        raise TypeError(f"@probe: registry must be a ProbeRegistry or None (the default "
                        f"one), got {type(registry).__name__} ({registry!r:.40})")
    register = check_flag("@probe: register", register)
    if function is None:
        return lambda fn: probe(fn, name=name, registry=registry, register=register)
    if not callable(function):
        raise TypeError("@probe must decorate a function (record, *, options...) -> "
                        f"verdict, got {type(function).__name__} ({function!r:.40})")
    probe_name = getattr(function, "__name__", None) if name is None else name
    if probe_name is None:
        raise TypeError(f"@probe: {function!r:.40} has no __name__; give the probe a name=")
    cls = _build_class(function, probe_name)
    if register:
        target = registry if registry is not None else default_registry
        replace = _is_redefinition(target, probe_name, function)
        target.register(probe_name, cls, replace=replace)
    return cls


def _is_redefinition(registry: ProbeRegistry, name: str, function: Callable[..., Any]) -> bool:
    # Re-running a notebook cell redefines the same function: let it replace itself.
    if name not in registry:
        return False
    previous = getattr(registry.get(name), "function", None)
    return previous is not None and (
        getattr(previous, "__module__", None),
        getattr(previous, "__qualname__", None),
    ) == (function.__module__, function.__qualname__)


def _function_options(function: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """(all keyword-only option names, the required ones)."""
    params = inspect.signature(function).parameters.values()
    keyword_only = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    names = {p.name for p in keyword_only}
    required = {p.name for p in keyword_only if p.default is inspect.Parameter.empty}
    return names, required


def _options_signature(function: Callable[..., Any]) -> inspect.Signature:
    """The probe class's constructor signature: the function's keyword-only
    options, then the rule options it does not declare itself."""
    params = [p for p in inspect.signature(function).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY]
    declared = {p.name for p in params}
    defaults = {"threshold": None, "action": "flag"}
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name])
               for name in _RULE_OPTIONS if name not in declared]
    return inspect.Signature(params)


def _build_class(function: Callable[..., Any], probe_name: str) -> type[Probe]:
    options, required = _function_options(function)

    class FunctionProbe(Probe):
        probe_kind = ProbeKind.SINGLE_SHOT

        def __init__(self, **probe_args: Any) -> None:
            allowed = options | set(_RULE_OPTIONS)
            unknown = sorted(set(probe_args) - allowed)
            if unknown:
                raise TypeError(
                    f"probe {probe_name!r} got unknown probe_args {unknown}; "
                    f"it accepts {sorted(allowed)}"
                )
            missing = sorted(required - set(probe_args))
            if missing:
                raise TypeError(f"probe {probe_name!r} needs probe_args {missing}")
            self.rule = ThresholdRule.from_options(
                probe_args.get("threshold"), probe_args.get("action", "flag"),
                scores_only=False)  # (a True is a hit whatever the threshold)
            # Options the function declares itself are passed through, rule ones included.
            self.options = {k: v for k, v in probe_args.items() if k in options}
            self.summary = ScoreSummary(self.rule.threshold)

        def on_start(self, ctx: RequestContext) -> None:
            self.summary = ScoreSummary(self.rule.threshold)

        def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
            signal = self._to_signal(function(record, **self.options))
            if signal is None:
                self.summary.add(None, record, False)
            else:
                crossed = signal.action is not SignalAction.CONTINUE
                self.summary.add(signal.score, record, crossed)
            return signal

        def _to_signal(self, value: Any) -> ProbeSignal | None:
            if value is None or isinstance(value, ProbeSignal):
                return value
            if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
                hit = bool(value)
                action = self.rule.action if hit else SignalAction.CONTINUE
                return ProbeSignal(action=action, score=1.0 if hit else 0.0)
            try:
                if isinstance(value, (str, bytes, bytearray)):  # (float() would parse it)
                    raise TypeError
                score = float(value)
            except (TypeError, ValueError):
                raise TypeError(
                    f"probe function {function.__qualname__} returned {type(value).__name__}; "
                    "expected bool, a number, ProbeSignal or None"
                ) from None
            return self.rule.signal(score)

        def on_end(self, ctx: RequestContext) -> Any:
            return self.summary.verdict()

    FunctionProbe.function = staticmethod(function)  # type: ignore[attr-defined]
    # What the constructor accepts, for probe_args checks (it takes **probe_args).
    FunctionProbe.__signature__ = _options_signature(function)  # type: ignore[attr-defined]
    FunctionProbe.__name__ = FunctionProbe.__qualname__ = f"{function.__name__}_probe"
    FunctionProbe.__module__ = function.__module__
    FunctionProbe.__doc__ = function.__doc__ or f"Single-shot probe from {function.__qualname__}."
    return FunctionProbe
