"""Probes: the base class, the registry, ``@probe``, and the built-in probes.

Built-ins (registered by default): ``linear_probe``, ``trajectory_probe``,
``dual_position_probe``, ``norm_probe``, ``mean_probe``, ``sae_probe``, and
``capture`` for capture-only points; see ``docs/probes.md`` and ``docs/sae.md``.
Nothing here imports torch; numpy is imported only when a built-in runs.
"""

from __future__ import annotations

from undercurrent.probes.base import Probe, RequestContext, supported_kinds
from undercurrent.probes.capture import CaptureProbe
from undercurrent.probes.decorator import probe
from undercurrent.probes.linear import DualPositionProbe, LinearProbe, LinearReadout
from undercurrent.probes.registry import (
    BUILTIN_PROBE_TYPES,
    ENTRY_POINT_GROUP,
    ProbeRegistry,
    UnknownProbeError,
    default_registry,
    get_probe,
    list_probes,
    register_probe,
)
from undercurrent.probes.sae import SaeProbe
from undercurrent.probes.sae_files import (
    SaeFileError,
    SparseAutoencoder,
    load_sae,
    sae_clamp_delta,
    sae_decoder_direction,
)
from undercurrent.probes.scoring import ScoreSummary, ThresholdRule
from undercurrent.probes.statistics import MeanProbe, NormProbe
from undercurrent.probes.trajectory import TrajectoryProbe
from undercurrent.probes.weights import (
    LINEAR_PROBE_FORMAT,
    LinearWeights,
    ProbeFileError,
    linear_weights,
    load_linear_weights,
    save_linear_weights,
)

__all__ = [
    "BUILTIN_PROBE_TYPES",
    "CaptureProbe",
    "DualPositionProbe",
    "ENTRY_POINT_GROUP",
    "LINEAR_PROBE_FORMAT",
    "LinearProbe",
    "LinearReadout",
    "LinearWeights",
    "MeanProbe",
    "NormProbe",
    "Probe",
    "ProbeFileError",
    "ProbeRegistry",
    "RequestContext",
    "SaeFileError",
    "SaeProbe",
    "ScoreSummary",
    "SparseAutoencoder",
    "ThresholdRule",
    "TrajectoryProbe",
    "UnknownProbeError",
    "default_registry",
    "get_probe",
    "linear_weights",
    "list_probes",
    "load_linear_weights",
    "load_sae",
    "probe",
    "register_probe",
    "sae_clamp_delta",
    "sae_decoder_direction",
    "save_linear_weights",
    "supported_kinds",
]
