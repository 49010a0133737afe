"""Builders for the notebook-layer tests: hand-made records and results."""

from __future__ import annotations

import numpy as np

from undercurrent.records import (
    ActivationRecord,
    ProbeResult,
    ProbeSignal,
    ProbeStats,
    SignalAction,
)


def make_records(
    requests: int = 2,
    layers: tuple[int, ...] = (0, 1),
    prompt_len: int = 3,
    generated: int = 4,
    hidden: int = 6,
    seed: int = 0,
    point: str = "resid",
) -> list[ActivationRecord]:
    """Records for every (request, layer, token) with seeded random float32 tensors."""
    rng = np.random.default_rng(seed)
    records = []
    for r in range(requests):
        for token in range(prompt_len + generated):
            for layer in layers:
                is_generated = token >= prompt_len
                records.append(
                    ActivationRecord(
                        request_id=f"req{r}",
                        extraction_point_name=point,
                        layer=layer,
                        tensor_type="residual_stream",
                        token_index=token,
                        is_generated=is_generated,
                        generated_index=token - prompt_len if is_generated else None,
                        token_id=10 + token,
                        tensor=rng.normal(size=hidden).astype(np.float32),
                        timestamp=1000.0 + token,
                    )
                )
    return records


def make_result(
    request: str,
    point: str,
    scores: list[float | None],
    actions: list[str] | None = None,
    with_location: bool = True,
    verdict: object = None,
) -> ProbeResult:
    """A ProbeResult whose signals carry ``scores`` and (optionally) token locations."""
    actions = actions or ["continue"] * len(scores)
    signals = tuple(
        ProbeSignal(
            action=SignalAction(action),
            score=score,
            metadata={"generated_index": i, "token_index": 5 + i, "layer": 1}
            if with_location
            else {},
            timestamp=2000.0 + i,
        )
        for i, (score, action) in enumerate(zip(scores, actions, strict=True))
    )
    return ProbeResult(
        request_id=request,
        extraction_point_name=point,
        verdict=verdict,
        signals=signals,
        stats=ProbeStats(received=len(scores), processed=len(scores), mean_latency_s=0.001),
    )
