"""``capture``: the built-in for capture-only points.

A point whose only job is to collect activations (for ``generate(...,
records=True)``, ``records_frame``, ``ProbedModel.run_with_cache`` or fitting a
probe) needs no judgement. ``capture`` takes no ``probe_args``, serves either
probe kind, computes nothing, emits no signal and returns no verdict; its
``ProbeResult.stats`` still count the activations it was handed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from undercurrent.probes.base import (
    Probe,
    RequestContext,
    ScoresRows,
    shallow_copy,
)
from undercurrent.records import ActivationBatch, ActivationRecord, BatchSignals, ProbeSignal
from undercurrent.spec.types import ProbeKind


class CaptureProbe(ScoresRows):
    """Accepts every activation and says nothing (verdict None, no signals).

    >>> from undercurrent.spec.types import ExtractionPoint
    >>> point = ExtractionPoint(name="keep", layers=(0, 1), tensor_type="residual_stream",
    ...                         position="generated[*]", probe_type="capture",
    ...                         probe_kind="trajectory")
    """

    probe_kind = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        return None

    def on_activations(self, records: Sequence[ActivationRecord]) -> list[ProbeSignal | None]:
        return [None] * len(records)

    def group_key(self) -> Any:
        return ("capture",)

    def copy_for_request(self) -> CaptureProbe | None:
        # No state at all.
        return shallow_copy(self) if type(self) is CaptureProbe else None


    @classmethod
    def start_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]) -> bool:
        # No state: nothing to start, unless a subclass starts its own way.
        return cls.on_start is Probe.on_start

    @classmethod
    def end_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]
                 ) -> list[Any] | None:
        # No verdict, unless a subclass gives its own.
        return [None] * len(probes) if cls.on_end is Probe.on_end else None

    def may_abort(self) -> bool:
        return type(self) is not CaptureProbe

    def row_values(self, batch: ActivationBatch) -> Any:
        return ()

    def judge_rows(self, values: Any, token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals:
        return BatchSignals.none(len(layers))

    @classmethod
    def judge_many(cls, probes: Sequence[ScoresRows], values: Any,
                   spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals | None:
        if cls.judge_rows is not CaptureProbe.judge_rows:
            return None
        return BatchSignals.none(spans[-1][1] - spans[0][0])

    def on_batch(self, batch: ActivationBatch) -> BatchSignals:
        return BatchSignals.none(len(batch))
