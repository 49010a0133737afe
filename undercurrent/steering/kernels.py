"""The edit ops on torch rows: one function every backend's hook calls.

``rows`` is ``(n, hidden)``: the activations of the tokens an edit applies to in
one forward. The arithmetic runs in the rows' own dtype on their device (the
vector is converted once per device and dtype and cached), so an edit costs one
small fused expression per (edit, site) and forward.

- ``add``: ``h + c*v`` (``norm_match``: ``v`` rescaled to ``|h|`` per row first)
- ``project_out``: ``h - c*(h.u)u``
- ``clamp``: ``h + (c - h.u)u`` (the component along ``u`` becomes ``c``)
- ``scale``: ``h + (c - 1)*(h.u)u`` (the component along ``u`` is multiplied by ``c``)
"""

from __future__ import annotations

from typing import Any

import torch

from undercurrent.spec.types import EditOp
from undercurrent.steering.vectors import ResolvedEdit


class EditKernels:
    """Device copies of resolved edits' vectors, and the op applied to rows."""

    def __init__(self) -> None:
        # (id of the resolved edit, device, dtype) -> (the edit, vector, unit); the
        # entry holds the edit itself, so its id cannot be reused while cached.
        self._vectors: dict[tuple[int, Any, Any],
                            tuple[ResolvedEdit, torch.Tensor, torch.Tensor]] = {}

    def _tensors(self, resolved: ResolvedEdit, rows: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(resolved), rows.device, rows.dtype)
        cached = self._vectors.get(key)
        if cached is None:
            vector = torch.tensor(resolved.vector, dtype=torch.float64)
            unit = vector / vector.norm()
            cached = (resolved, vector.to(device=rows.device, dtype=rows.dtype),
                      unit.to(device=rows.device, dtype=rows.dtype))
            self._vectors[key] = cached
        return cached[1], cached[2]

    def apply(self, resolved: ResolvedEdit, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` with the edit applied (a new tensor)."""
        return apply_op(resolved.edit.op, rows, *self._tensors(resolved, rows),
                        resolved.edit.coefficient, resolved.edit.norm_match)

    def clear(self) -> None:
        """Forget every device copy."""
        self._vectors.clear()


def apply_op(op: EditOp, rows: torch.Tensor, vector: torch.Tensor, unit: torch.Tensor,
             coefficient: float, norm_match: bool = False) -> torch.Tensor:
    """One op on ``(n, hidden)`` rows; ``unit`` is ``vector`` normalised."""
    if op is EditOp.ADD:
        if norm_match:
            return rows + coefficient * rows.norm(dim=-1, keepdim=True) * unit
        return rows + coefficient * vector
    along = rows @ unit  # (n,)
    if op is EditOp.PROJECT_OUT:
        return rows - (coefficient * along).unsqueeze(-1) * unit
    if op is EditOp.CLAMP:
        return rows + (coefficient - along).unsqueeze(-1) * unit
    if op is EditOp.SCALE:
        return rows + ((coefficient - 1.0) * along).unsqueeze(-1) * unit
    raise ValueError(f"unknown edit op {op!r}")
