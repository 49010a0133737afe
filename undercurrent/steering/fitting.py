"""Steering directions from captured activations, and from linear probe files.

:func:`fit_steering_vector` takes the difference of the class means of a records
frame (or records, outputs, or an array with one label per row), the standard
"contrastive activation" direction; :func:`probe_direction` reads the weight
direction of a linear probe file. Both give vectors an :class:`~undercurrent.spec.Edit`
can use directly.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undercurrent.analysis.fitting import _design, _sorted_classes
from undercurrent.arguments import check_flag
from undercurrent.paths import user_path
from undercurrent.probes.weights import load_linear_weights
from undercurrent.spec.loader import parse_edit
from undercurrent.spec.types import Edit, EditOp


@dataclass(frozen=True)
class SteeringVector:
    """A direction in activation space, and where it was measured.

    ``vector`` is a float64 numpy array (``positive`` mean minus ``negative``
    mean, unit length when fitted with ``normalize=True``); ``counts`` is the
    number of rows behind each mean; ``layer`` / ``tensor_type`` say where the
    activations came from (None for a bare array).
    """

    vector: Any
    positive: Any
    negative: Any
    layer: int | None = None
    tensor_type: str | None = None
    counts: dict[Any, int] = field(default_factory=dict)

    @property
    def norm(self) -> float:
        import numpy as np

        return float(np.linalg.norm(self.vector))

    def edit(self, name: str, *, coefficient: float = 1.0, op: EditOp | str = "add",
             layers: int | Sequence[int] | None = None, tensor_type: str | None = None,
             position: str | int = "generated[*]", **fields: Any) -> Edit:
        """An :class:`Edit` carrying this vector (defaults: the layer and tensor type
        it was measured at, every generated token, ``add``).

        >>> sv.edit("away_from_harm", coefficient=-4.0)   # doctest: +SKIP
        """
        layers = self.layer if layers is None else layers
        if layers is None:
            raise ValueError("this vector was fitted on a bare array: pass layers=...")
        if isinstance(layers, Iterable) and not isinstance(layers, str):
            layers = list(layers)  # (a range or a generator too)
        # (layers and op go to the spec's checks as given: they take a numpy integer
        # layer and name a wrong layer or op, with the accepted values)
        return parse_edit({
            "name": name, "layers": layers,
            "tensor_type": tensor_type or self.tensor_type or "residual_stream",
            "position": position, "op": op.value if isinstance(op, EditOp) else op,
            "vector": [float(x) for x in self.vector], "coefficient": coefficient, **fields,
        })

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the vector to a ``.safetensors`` or ``.npz`` file as the single array
        ``vector`` (an edit's ``vector:`` can name the file)."""
        import numpy as np

        target = user_path(path, "SteeringVector.save: path", what="a .safetensors or .npz file")
        if target.suffix not in (".safetensors", ".npz"):
            # (checked before the folder is made: a refused save leaves nothing behind)
            raise ValueError(f"cannot save a steering vector to {str(path)!r}: use a "
                             ".safetensors or .npz suffix")
        array = np.ascontiguousarray(self.vector, dtype=np.float32)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix == ".safetensors":
            from safetensors.numpy import save_file

            save_file({"vector": array}, str(target),
                      metadata={"format": "undercurrent.steering_vector/1",
                                "layer": str(self.layer), "tensor_type": str(self.tensor_type)})
        else:
            with open(target, "wb") as handle:
                np.savez(handle, vector=array)
        return target


def fit_steering_vector(
    data: Any,
    labels: Any = None,
    *,
    normalize: bool = False,
    positive: Any = None,
    layer: int | None = None,
    point: str | None = None,
    tensor_type: str | None = None,
) -> SteeringVector:
    """Difference of means: ``mean(rows labelled positive) - mean(the other rows)``.

    ``data`` and ``labels`` are what :func:`~undercurrent.analysis.fitting.fit_linear_probe`
    takes (a records frame with per-row labels, a column name or a ``{request:
    label}`` mapping; records; outputs; an ``(n, hidden)`` array with one label
    per row; or an activation store or ``select()`` view), filtered by ``point`` /
    ``layer`` / ``tensor_type`` the same way, and refused the same way when a
    label is missing (None or NaN) or an activation is NaN or infinite (a mean
    over it would be NaN). Exactly two distinct labels are needed; ``positive``
    picks the one the vector points towards (default: the larger of the two when
    sorted, so ``1`` over ``0``, ``"harmful"`` over ``"benign"``).
    ``normalize=True`` returns a unit vector.

    >>> import numpy as np
    >>> sv = fit_steering_vector(np.array([[1., 0.], [3., 0.], [0., 2.]]), [1, 1, 0])
    >>> sv.vector.tolist()
    [2.0, -2.0]
    """
    import numpy as np

    normalize = check_flag("fit_steering_vector: normalize", normalize)
    X, y, _, layer, tensor_type, projected = _design(data, labels, layer, point, tensor_type,
                                                     None, caller="fit_steering_vector")
    if projected is not None:
        raise ValueError(
            f"fit_steering_vector: the store holds this point's vectors projected "
            f"({projected[0]}): a difference of their means is a direction among the "
            "random features, not in the model's activations, and no edit could add it; "
            "capture the point without project:K to fit a steering vector")
    if len(X) != len(y):
        raise ValueError(f"fit_steering_vector: {len(X)} activation rows but {len(y)} labels; "
                         "give one label per row (or a {request: label} mapping)")
    classes = _sorted_classes(y)
    if len(classes) != 2:
        raise ValueError("fit_steering_vector: needs exactly two distinct labels (a "
                         f"difference of two means), got {classes!r}")
    if positive is None:
        positive = classes[1]
    if positive not in classes:
        raise ValueError(f"fit_steering_vector: positive={positive!r} is not one of the "
                         f"labels {classes!r}")
    negative = classes[0] if positive == classes[1] else classes[1]
    chosen = y == positive
    vector = X[chosen].mean(axis=0) - X[~chosen].mean(axis=0)
    if normalize:
        norm = np.linalg.norm(vector)
        if norm == 0:
            raise ValueError("fit_steering_vector: the two class means are identical; there "
                             "is no direction to normalise")
        vector = vector / norm
    return SteeringVector(vector=vector, positive=positive, negative=negative, layer=layer,
                          tensor_type=tensor_type,
                          counts={positive: int(chosen.sum()), negative: int((~chosen).sum())})


def probe_direction(path: str | os.PathLike[str], *, normalize: bool = True) -> Any:
    """The weight direction of a binary linear probe file, as a float64 numpy array;
    unit length unless ``normalize=False``.

    An edit whose ``vector:`` names such a file uses the raw weight, not the unit
    direction: ``add`` adds ``coefficient`` times ``probe_direction(path,
    normalize=False)`` (so the coefficient's scale depends on the weight's norm),
    while ``project_out``, ``clamp`` and ``scale`` use its unit direction, this
    function's default. To add ``coefficient`` times the unit direction, give the
    edit ``probe_direction(path).tolist()``.

    >>> probe_direction("undercurrent:models/tiny/probe.safetensors").shape  # doctest: +SKIP
    (128,)
    """
    import numpy as np

    normalize = check_flag("probe_direction: normalize", normalize)
    weights = load_linear_weights(path)
    if weights.classes not in (None, 1):
        raise ValueError(f"{weights.source} has {weights.classes} classes; a direction needs a "
                         "binary probe")
    vector = np.array(weights.weight, dtype=np.float64).reshape(-1)
    return vector / np.linalg.norm(vector) if normalize else vector
