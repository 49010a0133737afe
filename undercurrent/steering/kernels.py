"""The edit ops on torch rows: one function every backend's hook calls.

``rows`` is ``(n, hidden)``: the activations of the tokens an edit applies to in
one forward. The arithmetic runs in the rows' own dtype on their device (the
vector is converted once per device and dtype and cached), so an edit costs one
small fused expression per (edit, site) and forward.

- ``add``: ``h + c*v`` (``norm_match``: ``v`` rescaled to ``|h|`` per row first)
- ``project_out``: ``h - c*(h.u)u``
- ``clamp``: ``h + (c - h.u)u`` (the component along ``u`` becomes ``c``)
- ``scale``: ``h + (c - 1)*(h.u)u`` (the component along ``u`` is multiplied by ``c``)
- ``clamp`` on an SAE feature ``i``: ``h + (c - f_i(h))*W_dec[i]``, with ``f_i`` the
  SAE encoder's activation of feature ``i`` (:func:`sae_clamp_delta`): the feature's
  activation becomes ``c`` in the SAE's code and the reconstruction error
  ``h - decode(encode(h))`` is kept. The encoder runs in float64 on the CPU (the
  SAE's own numpy code, the one ``sae_probe`` uses), so this op copies the edited
  rows to the host and back once per forward.

Each op is written as the change it makes (:func:`edit_delta`), so a backend whose
stream is split in two summands (vLLM's hidden + residual) adds it to one of them:
the sum changes exactly once.
"""

from __future__ import annotations

from typing import Any

import torch

from undercurrent.spec.types import EditOp, SaeFeature
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
        return rows + self.delta(resolved, rows)

    def delta(self, resolved: ResolvedEdit, rows: torch.Tensor) -> torch.Tensor:
        """What the edit adds to ``rows`` (to add to one summand of a split stream)."""
        vector = resolved.edit.vector
        if resolved.sae_clamp and isinstance(vector, SaeFeature):
            feature = vector.feature
            return sae_clamp_delta(resolved.sae, rows, feature, resolved.edit.coefficient)
        return edit_delta(resolved.edit.op, rows, *self._tensors(resolved, rows),
                          resolved.edit.coefficient, resolved.edit.norm_match)

    def clear(self) -> None:
        """Forget every device copy."""
        self._vectors.clear()


def edit_delta(op: EditOp, rows: torch.Tensor, vector: torch.Tensor, unit: torch.Tensor,
               coefficient: float, norm_match: bool = False) -> torch.Tensor:
    """The change one op makes to ``(n, hidden)`` rows (``rows + delta`` is the edited
    value); ``unit`` is ``vector`` normalised."""
    if op is EditOp.ADD:
        if norm_match:
            scaled: torch.Tensor = coefficient * rows.norm(dim=-1, keepdim=True) * unit
            return scaled
        return (coefficient * vector).expand_as(rows)
    along = rows @ unit  # (n,)
    if op is EditOp.PROJECT_OUT:
        return -(coefficient * along).unsqueeze(-1) * unit
    if op is EditOp.CLAMP:
        return (coefficient - along).unsqueeze(-1) * unit
    if op is EditOp.SCALE:
        return ((coefficient - 1.0) * along).unsqueeze(-1) * unit
    raise ValueError(f"unknown edit op {op!r}")


def sae_clamp_delta(sae: Any, rows: torch.Tensor, feature: int, value: float) -> torch.Tensor:
    """``(value - f_i(h)) * W_dec[i]`` for each row ``h``, as a tensor like ``rows``:
    what to add so SAE feature ``feature`` has activation ``value`` in the SAE's code
    while the error term ``h - decode(encode(h))`` stays as it was (see
    :meth:`~undercurrent.probes.sae_files.SparseAutoencoder.clamp_delta`)."""
    host = rows.detach().to(device="cpu", dtype=torch.float64).numpy()
    delta = torch.from_numpy(sae.clamp_delta(host, feature, value))
    return delta.to(device=rows.device, dtype=rows.dtype)
