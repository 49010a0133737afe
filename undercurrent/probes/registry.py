"""Which probe class a ``probe_type`` name means.

The default registry holds the built-ins and, loaded on first use, the probes
third-party packages publish under the entry-point group ``undercurrent.probes``
(each entry point names a :class:`~undercurrent.probes.base.Probe` subclass).
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

from undercurrent.probes.base import supported_kinds
from undercurrent.probes.capture import CaptureProbe
from undercurrent.probes.linear import DualPositionProbe, LinearProbe
from undercurrent.probes.sae import SaeProbe
from undercurrent.probes.statistics import MeanProbe, NormProbe
from undercurrent.probes.trajectory import TrajectoryProbe

ENTRY_POINT_GROUP = "undercurrent.probes"

logger = logging.getLogger(__name__)


class UnknownProbeError(LookupError):
    """A ``probe_type`` that names no registered probe. ``known`` lists the names."""

    def __init__(self, name: str, known: tuple[str, ...], closest: str | None) -> None:
        self.name = name
        self.known = known
        self.closest = closest
        hint = f"; did you mean {closest!r}?" if closest else ""
        super().__init__(
            f"unknown probe_type {name!r}{hint} Known probe types: {', '.join(known) or 'none'}"
        )

    def __str__(self) -> str:
        return str(self.args[0])


def check_probe_class(name: str, cls: Any) -> None:
    """Raise TypeError unless ``cls`` is a usable probe class."""
    if not isinstance(cls, type):
        raise TypeError(f"probe {name!r} must be a class, got {cls!r}")
    if not callable(getattr(cls, "on_activation", None)):
        raise TypeError(f"probe class {cls.__name__} (for {name!r}) has no on_activation method")
    supported_kinds(cls)


class ProbeRegistry:
    """A mapping from ``probe_type`` names to probe classes.

    >>> from undercurrent.probes import Probe
    >>> registry = ProbeRegistry()
    >>> @registry.register("constant")
    ... class Constant(Probe):
    ...     def on_activation(self, record):
    ...         return None
    >>> registry.get("constant") is Constant
    True
    """

    def __init__(
        self,
        probes: Mapping[str, type] | None = None,
        *,
        entry_point_group: str | None = None,
    ) -> None:
        self._probes: dict[str, type] = {}
        self._lock = threading.Lock()
        self._entry_point_group = entry_point_group
        self._entry_points_loaded = entry_point_group is None
        self.entry_point_errors: dict[str, str] = {}
        for name, cls in (probes or {}).items():
            self.register(name, cls)

    @overload
    def register(self, name: str, cls: None = None, *, replace: bool = False) -> Callable[[type], type]: ...  # noqa: E501

    @overload
    def register(self, name: str, cls: type, *, replace: bool = False) -> type: ...

    def register(self, name: str, cls: type | None = None, *, replace: bool = False) -> Any:
        """Register ``cls`` under ``name``; without ``cls``, return a class decorator.

        Registering a different class under a taken name raises ValueError unless
        ``replace`` is true.
        """
        if cls is None:
            return lambda decorated: self.register(name, decorated, replace=replace)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"probe name must be a non-empty string, got {name!r}")
        check_probe_class(name, cls)
        with self._lock:
            existing = self._probes.get(name)
            if existing is not None and existing is not cls and not replace:
                raise ValueError(
                    f"probe type {name!r} is already registered to {existing.__qualname__}; "
                    "pass replace=True to override it"
                )
            self._probes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Forget ``name`` (no error if it is not registered)."""
        with self._lock:
            self._probes.pop(name, None)

    def get(self, name: str) -> type:
        """The class registered as ``name``; :class:`UnknownProbeError` otherwise."""
        self._load_entry_points()
        with self._lock:
            cls = self._probes.get(name)
            known = () if cls is not None else tuple(sorted(self._probes))
        if cls is None:
            close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
            raise UnknownProbeError(str(name), known, close[0] if close else None)
        return cls

    def names(self) -> tuple[str, ...]:
        """All registered names, sorted."""
        self._load_entry_points()
        with self._lock:
            return tuple(sorted(self._probes))

    def copy(self) -> ProbeRegistry:
        """An independent registry with the same entries (entry points included)."""
        self._load_entry_points()
        with self._lock:
            return ProbeRegistry(dict(self._probes))

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        with self._lock:
            return name in self._probes

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            group = self._entry_point_group
        assert group is not None
        from importlib.metadata import entry_points

        for entry in entry_points(group=group):
            try:
                cls = entry.load()
                check_probe_class(entry.name, cls)
            except Exception as exc:  # a broken plugin must not break the registry
                message = f"entry point {entry.value!r} ({type(exc).__name__}: {exc})"
                self.entry_point_errors[entry.name] = message
                logger.warning("could not load probe %r from %s", entry.name, message)
                continue
            with self._lock:
                self._probes.setdefault(entry.name, cls)


def _builtin_probes() -> dict[str, type]:
    return {
        "linear_probe": LinearProbe,
        "trajectory_probe": TrajectoryProbe,
        "dual_position_probe": DualPositionProbe,
        "norm_probe": NormProbe,
        "mean_probe": MeanProbe,
        "sae_probe": SaeProbe,
        "capture": CaptureProbe,
    }


BUILTIN_PROBE_TYPES = ("linear_probe", "trajectory_probe", "dual_position_probe",
                       "norm_probe", "mean_probe", "sae_probe", "capture")

default_registry = ProbeRegistry(_builtin_probes(), entry_point_group=ENTRY_POINT_GROUP)


def register_probe(name: str, cls: type | None = None, *, replace: bool = False) -> Any:
    """Register a probe class in the default registry (also usable as a decorator).

    >>> from undercurrent.probes import Probe
    >>> @register_probe("always_quiet_example")
    ... class AlwaysQuiet(Probe):
    ...     def on_activation(self, record):
    ...         return None
    >>> get_probe("always_quiet_example") is AlwaysQuiet
    True
    """
    return default_registry.register(name, cls, replace=replace)


def get_probe(name: str) -> type:
    """The class the default registry has under ``name`` (UnknownProbeError otherwise)."""
    return default_registry.get(name)


def list_probes() -> tuple[str, ...]:
    """The names in the default registry, sorted."""
    return default_registry.names()
