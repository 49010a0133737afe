"""Records for probe tests."""

from __future__ import annotations

from typing import Any

from undercurrent.records import ActivationRecord


def activation(tensor: Any, token: int = 0, layer: int = 0, request_id: str = "r",
               name: str = "p") -> ActivationRecord:
    return ActivationRecord(
        request_id=request_id,
        extraction_point_name=name,
        layer=layer,
        tensor_type="residual_stream",
        token_index=token,
        is_generated=True,
        generated_index=token,
        token_id=token,
        tensor=tensor,
    )
