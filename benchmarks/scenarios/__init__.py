"""Benchmark scenarios: one class per way of generating (and capturing) on a model.

``SCENARIOS`` lists them in table order; the plain ``generate()`` baseline is
first, and every overhead ratio is relative to it.
"""

from __future__ import annotations

from benchmarks.scenarios.alternatives import NnsightCapture, TransformerLensCapture
from benchmarks.scenarios.base import Batch, Scenario
from benchmarks.scenarios.baselines import HiddenStatesCapture, PlainGenerate, RawHooksCapture
from benchmarks.scenarios.probed import (
    ProbedAllLayers,
    ProbedAsyncTrajectory,
    ProbedBlockUntilSignal,
    ProbedCaptureOnly,
    ProbedEmptySpec,
    ProbedGuardAndObserver,
    ProbedInlineLinear,
    ProbedInlineLinearGuard,
    ProbedInlineNorm,
    ProbedInlineTrajectory,
    ProbedInlineTrajectoryGuard,
    ProbedMixedStrides,
    ProbedMixedStridesWithEdit,
    ProbedPromptLast,
    ProbedSaeFeatures,
    ProbedSlice,
    ProbedStrided,
    ProbedWithEdit,
    ProbedWithEndingEdits,
    ProbedWithPromptRead,
    ProbedWithSwitchedEdit,
    ProbedWithTriggeredEdit,
)

SCENARIOS: tuple[type[Scenario], ...] = (
    PlainGenerate,
    HiddenStatesCapture,
    RawHooksCapture,
    NnsightCapture,
    TransformerLensCapture,
    ProbedEmptySpec,
    ProbedInlineNorm,
    ProbedCaptureOnly,
    ProbedAsyncTrajectory,
    ProbedAllLayers,
    ProbedBlockUntilSignal,
)
BASELINE = PlainGenerate.name
#: Scenarios only the scaling set runs (``benchmarks.scaling``), not the main tables.
SCALING_ONLY: tuple[type[Scenario], ...] = (ProbedInlineLinear, ProbedInlineTrajectory)
#: Scenarios no table runs, for the tools that time or profile one scenario
#: (``benchmarks.ab``, ``benchmarks.stage_timers``, ``benchmarks.profile``).
ON_REQUEST: tuple[type[Scenario], ...] = (ProbedInlineLinearGuard, ProbedGuardAndObserver,
                                          ProbedSaeFeatures, ProbedStrided, ProbedSlice,
                                          ProbedWithPromptRead, ProbedInlineTrajectoryGuard,
                                          ProbedMixedStrides, ProbedWithEdit,
                                          ProbedWithTriggeredEdit, ProbedWithSwitchedEdit,
                                          ProbedMixedStridesWithEdit, ProbedWithEndingEdits,
                                          ProbedPromptLast)


def scenario_by_name(name: str) -> type[Scenario]:
    """The scenario class registered under ``name``."""
    for scenario in (*SCENARIOS, *SCALING_ONLY, *ON_REQUEST):
        if scenario.name == name:
            return scenario
    known = ", ".join(s.name for s in (*SCENARIOS, *SCALING_ONLY, *ON_REQUEST))
    raise KeyError(f"unknown benchmark scenario {name!r}; known: {known}")


__all__ = ["BASELINE", "ON_REQUEST", "SCALING_ONLY", "SCENARIOS", "Batch", "Scenario",
           "scenario_by_name"]
