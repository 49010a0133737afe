"""The edit ops on torch rows: one function every backend's hook calls.

``rows`` is ``(n, hidden)``: the activations of the tokens an edit applies to in
one forward. The arithmetic runs in the rows' own dtype on their device (the
vector is converted once per device and dtype and cached), so an edit costs one
small fused expression per (edit, site) and forward. Some steps are widened so a
float16 or bfloat16 model neither overflows nor rounds twice: ``add``'s ``c*v`` is
computed in float64 and cast once (a large vector times a small coefficient stays
finite, and the added value is the nearest one in the rows' dtype), and
``norm_match``'s ``|h|`` and the other ops' change along ``u`` (``h.u`` and what
multiplies ``u``) are computed in float32 at least and cast once (a float16 row's
norm, or its component along ``u``, may pass 65504 while every element is finite).

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

from typing import Any, NamedTuple

import torch

from undercurrent.spec.types import EditOp, SaeFeature
from undercurrent.steering.vectors import ResolvedEdit


class EditVectors(NamedTuple):
    """One resolved edit's vectors on one device, for rows of one dtype."""

    added: torch.Tensor
    """``coefficient * vector``, computed in float64 and cast once to the rows' dtype."""
    wide_unit: torch.Tensor
    """The unit in the dtype norms and components along it are taken in (float32
    at least)."""

    @classmethod
    def of(cls, vector: Any, coefficient: float, device: Any, dtype: torch.dtype
           ) -> EditVectors:
        """The tensors for ``vector`` (float64 values) and ``coefficient`` on
        ``device``, for rows of ``dtype``."""
        exact = torch.tensor(vector, dtype=torch.float64)
        unit = exact / exact.norm()
        return cls(added=(coefficient * exact).to(device=device, dtype=dtype),
                   wide_unit=unit.to(device=device, dtype=_norm_dtype(dtype)))


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype row norms are taken in: float32, or the rows' own when wider."""
    return torch.promote_types(dtype, torch.float32)


class EditKernels:
    """Device copies of resolved edits' vectors, and the op applied to rows."""

    def __init__(self) -> None:
        # (id of the resolved edit, device, dtype) -> (the edit, its vectors); the
        # entry holds the edit itself, so its id cannot be reused while cached.
        self._vectors: dict[tuple[int, Any, Any], tuple[ResolvedEdit, EditVectors]] = {}

    def _tensors(self, resolved: ResolvedEdit, rows: torch.Tensor) -> EditVectors:
        key = (id(resolved), rows.device, rows.dtype)
        cached = self._vectors.get(key)
        if cached is None:
            cached = (resolved, EditVectors.of(resolved.vector, resolved.edit.coefficient,
                                               rows.device, rows.dtype))
            self._vectors[key] = cached
        return cached[1]

    def apply(self, resolved: ResolvedEdit, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` with the edit applied (a new tensor)."""
        return rows + self.delta(resolved, rows)

    def delta(self, resolved: ResolvedEdit, rows: torch.Tensor) -> torch.Tensor:
        """What the edit adds to ``rows`` (to add to one summand of a split stream)."""
        vector = resolved.edit.vector
        if resolved.sae_clamp and isinstance(vector, SaeFeature):
            feature = vector.feature
            return sae_clamp_delta(resolved.sae, rows, feature, resolved.edit.coefficient)
        return edit_delta(resolved.edit.op, rows, self._tensors(resolved, rows),
                          resolved.edit.coefficient, resolved.edit.norm_match)

    def clear(self) -> None:
        """Forget every device copy."""
        self._vectors.clear()


def edit_delta(op: EditOp, rows: torch.Tensor, vectors: EditVectors,
               coefficient: float, norm_match: bool = False) -> torch.Tensor:
    """The change one op makes to ``(n, hidden)`` rows (``rows + delta`` is the edited
    value); ``vectors`` are the edit's (:meth:`EditVectors.of`, for ``coefficient``)
    on the rows' device and for their dtype."""
    if op is EditOp.ADD:
        if norm_match:
            norms = rows.to(vectors.wide_unit.dtype).norm(dim=-1, keepdim=True)
            scaled: torch.Tensor = (coefficient * norms * vectors.wide_unit).to(rows.dtype)
            return scaled
        return vectors.added.expand_as(rows)
    wide = vectors.wide_unit
    along = rows.to(wide.dtype) @ wide  # (n,), in float32 at least
    if op is EditOp.PROJECT_OUT:
        change = -(coefficient * along).unsqueeze(-1) * wide
    elif op is EditOp.CLAMP:
        change = (coefficient - along).unsqueeze(-1) * wide
    elif op is EditOp.SCALE:
        change = ((coefficient - 1.0) * along).unsqueeze(-1) * wide
    else:
        raise ValueError(f"unknown edit op {op!r}")
    return change.to(rows.dtype)


def sae_clamp_delta(sae: Any, rows: torch.Tensor, feature: int, value: float) -> torch.Tensor:
    """``(value - f_i(h)) * W_dec[i]`` for each row ``h``, as a tensor like ``rows``:
    what to add so SAE feature ``feature`` has activation ``value`` in the SAE's code
    while the error term ``h - decode(encode(h))`` stays as it was (see
    :meth:`~undercurrent.probes.sae_files.SparseAutoencoder.clamp_delta`)."""
    host = rows.detach().to(device="cpu", dtype=torch.float64).numpy()
    delta = torch.from_numpy(sae.clamp_delta(host, feature, value))
    return delta.to(device=rows.device, dtype=rows.dtype)
