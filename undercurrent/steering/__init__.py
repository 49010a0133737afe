"""Live activation edits: resolving vectors, registering edits, fitting directions.

Nothing here imports torch at import time (the ops on tensors live in
:mod:`undercurrent.steering.kernels`, imported by the backends).

>>> from undercurrent.steering import fit_steering_vector   # doctest: +SKIP
>>> direction = fit_steering_vector(frame, labels, layer=3)  # doctest: +SKIP
"""

from __future__ import annotations

from undercurrent.steering.fitting import SteeringVector, fit_steering_vector, probe_direction
from undercurrent.steering.frames import EDIT_COLUMNS, edits_frame
from undercurrent.steering.registration import as_edits, register_edits
from undercurrent.steering.vectors import (
    ResolvedEdit,
    VectorSource,
    register_vector_source,
    resolve_edit,
    resolve_edits,
    unregister_vector_source,
)

__all__ = [
    "EDIT_COLUMNS",
    "ResolvedEdit",
    "SteeringVector",
    "VectorSource",
    "as_edits",
    "edits_frame",
    "fit_steering_vector",
    "probe_direction",
    "register_edits",
    "register_vector_source",
    "resolve_edit",
    "resolve_edits",
    "unregister_vector_source",
]
