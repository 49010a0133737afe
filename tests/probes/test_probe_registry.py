"""The registry, @probe, and third-party probes from entry points."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
from probe_helpers import activation

from undercurrent.probes import (
    ENTRY_POINT_GROUP,
    Probe,
    ProbeRegistry,
    RequestContext,
    UnknownProbeError,
    default_registry,
    get_probe,
    probe,
    register_probe,
)
from undercurrent.records import ProbeSignal, SignalAction
from undercurrent.spec.types import ProbeKind


class Quiet(Probe):
    probe_kind = ProbeKind.TRAJECTORY

    def on_activation(self, record):
        return None


def test_unknown_names_list_the_known_ones_and_the_closest_match():
    with pytest.raises(UnknownProbeError) as info:
        get_probe("norm_prob")
    message = str(info.value)
    assert "did you mean 'norm_probe'" in message and "linear_probe" in message
    assert info.value.closest == "norm_probe"


def test_registering_a_different_class_under_a_taken_name_needs_replace():
    registry = ProbeRegistry()
    registry.register("quiet", Quiet)
    registry.register("quiet", Quiet)  # same class: fine
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        registry.register("quiet", type("Other", (Quiet,), {}))
    with pytest.raises(TypeError, match="must be a class"):
        registry.register("bad", lambda record: None)
    with pytest.raises(TypeError, match="declares probe_kind 'sometimes'"):
        registry.register("bad", type("Bad", (Quiet,), {"probe_kind": "sometimes"}))


def test_register_probe_decorates_into_the_default_registry():
    try:
        @register_probe("test_quiet_probe")
        class Registered(Quiet):
            pass

        assert get_probe("test_quiet_probe") is Registered
    finally:
        default_registry.unregister("test_quiet_probe")


def test_probe_decorator_turns_return_values_into_signals():
    registry = ProbeRegistry()

    @probe(registry=registry)
    def first_value(record, *, scale=1.0):
        value = float(record.tensor[0]) * scale
        if value < 0:
            return None
        if value > 100:
            return ProbeSignal(action="abort", score=value)
        return value

    cls = registry.get("first_value")
    assert cls is first_value and cls.supported_kinds() == (ProbeKind.SINGLE_SHOT,)
    instance = cls(scale=2.0, threshold=5.0, action="flag")
    instance.on_start(RequestContext("r"))
    signals = [instance.on_activation(activation(np.array([v]), token=i))
               for i, v in enumerate([1.0, 3.0, -1.0, 60.0])]
    assert signals[0].score == 2.0 and signals[0].action is SignalAction.CONTINUE
    assert signals[1].action is SignalAction.FLAG  # 6.0 >= threshold 5.0
    assert signals[2] is None
    assert signals[3].action is SignalAction.ABORT and signals[3].score == 120.0
    verdict = instance.on_end(RequestContext("r"))
    assert verdict["count"] == 4 and verdict["max_score"] == 120.0
    assert verdict["first_crossing_token_index"] == 1


def test_bool_returning_function_flags_or_aborts_on_true():
    registry = ProbeRegistry()

    @probe("is_big", registry=registry)
    def big(record):
        return np.abs(record.tensor).max() > 1  # a numpy bool

    instance = registry.get("is_big")(action="abort")
    assert instance.on_activation(activation(np.array([0.5]))).action is SignalAction.CONTINUE
    hit = instance.on_activation(activation(np.array([2.0])))
    assert hit.action is SignalAction.ABORT and hit.score == 1.0


def test_decorated_probe_options_are_checked_by_name():
    @probe(register=False)
    def needs_scale(record, *, scale):
        return 1.0

    with pytest.raises(TypeError, match=r"needs probe_args \['scale'\]"):
        needs_scale()
    with pytest.raises(TypeError, match=r"unknown probe_args \['sacle'\].*'scale'"):
        needs_scale(scale=1, sacle=2)

    @probe(register=False)
    def wrong_type(record):
        return "high"

    with pytest.raises(TypeError, match="returned str; expected bool, a number"):
        wrong_type().on_activation(activation(np.zeros(1)))


@pytest.mark.parametrize("text", ["0.9", b"0.9", bytearray(b"1"), np.str_("0.9")],
                         ids=["str", "bytes", "bytearray", "numpy-str"])
def test_a_decorated_probe_that_returns_a_number_as_text_is_refused(text):
    """A string that reads as a number is not a score (only bool, a number,
    ProbeSignal or None are)."""
    @probe(register=False)
    def textual(record):
        return text

    with pytest.raises(TypeError, match=f"returned {type(text).__name__}; expected bool, a "
                                        "number, ProbeSignal or None"):
        textual().on_activation(activation(np.zeros(1)))


def test_redefining_a_decorated_function_replaces_its_registration():
    registry = ProbeRegistry()
    source = "def again(record):\n    return 1.0\n"
    for _ in range(2):  # like re-running a notebook cell
        namespace: dict = {}
        exec(source, {"__name__": "notebook_cell"}, namespace)
        probe(namespace["again"], registry=registry)
    assert registry.get("again").function is namespace["again"]


def test_probe_decorator_arguments_are_checked_naming_them():
    # (name="" fell back to the function's name, probe(5) and registry={} were
    # AttributeErrors, name=["x"] an unhashable-type TypeError, register="no" registered)
    def scored(record, *, scale=1.0):
        return 0.0

    registry = ProbeRegistry()
    for name in ("", "  ", ["x"], 5):
        with pytest.raises(ValueError, match=r"@probe: name must be a non-empty string or "
                                             r"None \(the function's name\), got"):
            probe(scored, name=name, registry=registry)
    with pytest.raises(ValueError, match="@probe: name must be a non-empty string"):
        probe("")
    with pytest.raises(TypeError, match=r"@probe must decorate a function .* got int \(5\)"):
        probe(5)
    with pytest.raises(TypeError, match=r"@probe: registry must be a ProbeRegistry or None "
                                        r"\(the default one\), got dict"):
        probe(scored, name="g", registry={})
    with pytest.raises(TypeError, match=r"@probe: register must be True or False, got str"):
        probe(scored, name="h", registry=registry, register="no")
    assert registry.names() == ()
    probe(scored, name="kept", registry=registry, register=np.bool_(True))
    assert registry.names() == ("kept",)


def test_third_party_probes_load_from_the_entry_point_group(tmp_path, monkeypatch):
    (tmp_path / "acme_probes.py").write_text(textwrap.dedent("""
        from undercurrent.probes import Probe

        class AcmeProbe(Probe):
            probe_kind = "trajectory"

            def on_activation(self, record):
                return None
    """))
    dist = tmp_path / "acme_probes-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-probes\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nacme = acme_probes:AcmeProbe\nbroken = acme_probes:Missing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        registry = ProbeRegistry(entry_point_group=ENTRY_POINT_GROUP)
        assert registry.get("acme").__name__ == "AcmeProbe"
        assert "broken" not in registry and "Missing" in registry.entry_point_errors["broken"]
    finally:
        sys.modules.pop("acme_probes", None)
