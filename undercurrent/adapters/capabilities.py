"""What a backend can capture on a loaded model, and the registration-time check.

Every backend describes itself with a :class:`Capabilities` object: which tensor
types it captures and, for each, the valid layer indices (``final_norm`` lives at
layer N, the number of decoder layers). :func:`check_points` turns a spec into a
clear error, listing every problem at once, before any generation starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from undercurrent.errors import ErrorDetail, ProblemsError, plain_details
from undercurrent.spec.types import ExtractionPoint, TensorType


class CapabilityError(ProblemsError):
    """A spec asks for something the loaded backend/model cannot capture.

    ``problems`` lists every problem found (one line each); :meth:`errors` gives
    them as pydantic-shaped dicts (located at the point and field when the
    problems came from :func:`check_points`).
    """

    error_type = "capability"

    def __init__(
        self, problems: list[str] | str, details: list[ErrorDetail] | None = None
    ) -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems:\n" + "\n".join(
                f"  - {problem}" for problem in self.problems
            )
        if details is None or len(details) != len(self.problems):
            details = plain_details(self.problems, self.error_type)
        super().__init__(message, details)


class UnsupportedArchitectureError(CapabilityError):
    """The model is not one undercurrent knows how to hook, on either backend.

    Hugging Face: its ``config.model_type`` is not in the architecture table, or
    its modules are not where the table says; vLLM: its decoder layers, attention
    or MLP blocks cannot be located. Raised when the backend is built (or, for a
    tensor type the model cannot serve, by the registration-time capability
    check), never from a hook while a model generates.
    """

    error_type = "architecture"


def _layer_ranges(layers: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3)`` -> ``"0..3"``; gaps are listed."""
    if not layers:
        return "none"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return str(layers[0]) if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"
    return ", ".join(str(layer) for layer in layers)


@dataclass(frozen=True)
class Capabilities:
    """What one backend captures on one model.

    ``layers`` maps each supported tensor type to its valid layer indices;
    a tensor type absent from it is not captured by this backend.

    >>> caps = Capabilities.standard("hf", "llama", num_layers=2)
    >>> caps.valid_layers("final_norm")
    (2,)
    >>> caps.supports("residual_stream", 1)
    True
    """

    backend: str
    model_type: str
    num_layers: int
    layers: Mapping[TensorType, tuple[int, ...]]
    hidden_size: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    notes: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def standard(
        cls,
        backend: str,
        model_type: str,
        num_layers: int,
        tensor_types: Iterable[TensorType | str] = tuple(TensorType),
        **kwargs: Any,
    ) -> Capabilities:
        """Per-layer tensor types at layers ``0..N-1``, ``final_norm`` at layer N."""
        layers: dict[TensorType, tuple[int, ...]] = {}
        for tensor_type in tensor_types:
            tensor_type = TensorType(tensor_type)
            if tensor_type is TensorType.FINAL_NORM:
                layers[tensor_type] = (num_layers,)
            else:
                layers[tensor_type] = tuple(range(num_layers))
        return cls(backend=backend, model_type=model_type, num_layers=num_layers,
                   layers=layers, **kwargs)

    @property
    def tensor_types(self) -> tuple[TensorType, ...]:
        """The tensor types this backend captures, in vocabulary order."""
        return tuple(t for t in TensorType if t in self.layers)

    def valid_layers(self, tensor_type: TensorType | str) -> tuple[int, ...]:
        """Valid layer indices for ``tensor_type`` (empty when unsupported)."""
        return tuple(self.layers.get(TensorType(tensor_type), ()))

    def supports(self, tensor_type: TensorType | str, layer: int | None = None) -> bool:
        """Whether ``tensor_type`` (at ``layer``, when given) can be captured."""
        valid = self.valid_layers(tensor_type)
        return bool(valid) if layer is None else layer in valid

    def problems(self, points: Iterable[ExtractionPoint]) -> list[str]:
        """Every reason these points cannot be captured (empty when all is fine)."""
        return [detail["msg"] for detail in self.problem_details(points)]

    def problem_details(self, points: Iterable[ExtractionPoint]) -> list[ErrorDetail]:
        """:meth:`problems`, each located: ``loc`` is ``("extraction_points", index,
        "tensor_type" or "layers")``."""
        found: list[ErrorDetail] = []
        supported = ", ".join(t.value for t in self.tensor_types) or "none"
        for index, point in enumerate(points):
            where: tuple[str | int, ...] = ("extraction_points", index)
            tensor_type = TensorType(point.tensor_type)
            valid = self.valid_layers(tensor_type)
            if not valid:
                note = self.notes.get(tensor_type.value)
                found.append(ErrorDetail(
                    loc=(*where, "tensor_type"), type=CapabilityError.error_type,
                    msg=f"extraction point {point.name!r}: tensor_type {tensor_type.value!r} is "
                    f"not captured by the {self.backend} backend on {self.model_type!r} "
                    f"(supported: {supported})" + (f"; {note}" if note else ""),
                ))
                continue
            bad = [layer for layer in point.layers if layer not in valid]
            if bad:
                hint = ""
                if tensor_type is TensorType.FINAL_NORM:
                    hint = f"; final_norm is addressed as layer N = {self.num_layers}"
                elif self.num_layers in bad and self.supports(TensorType.FINAL_NORM):
                    hint = (f"; layer {self.num_layers} is the final norm, use tensor_type "
                            "'final_norm' for it")
                found.append(ErrorDetail(
                    loc=(*where, "layers"), type=CapabilityError.error_type,
                    msg=f"extraction point {point.name!r}: layer(s) {bad} out of range for "
                    f"{tensor_type.value} on {self.model_type!r} with {self.num_layers} decoder "
                    f"layers (valid: {_layer_ranges(valid)}){hint}",
                ))
        return found

    def without(self, tensor_type: TensorType | str, note: str) -> Capabilities:
        """A copy that does not capture ``tensor_type``; ``note`` (why) is added to
        the refusal of any point that asks for it."""
        tensor_type = TensorType(tensor_type)
        layers = {t: v for t, v in self.layers.items() if t is not tensor_type}
        notes = {**self.notes, tensor_type.value: note}
        return dataclasses.replace(self, layers=layers, notes=notes)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for ``inspect-model --format json``)."""
        return {
            "backend": self.backend,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tensor_types": {t.value: list(self.layers[t]) for t in self.tensor_types},
            "notes": dict(self.notes),
        }


def check_points(capabilities: Capabilities, points: Iterable[ExtractionPoint]) -> None:
    """Raise :class:`CapabilityError` listing every point the backend cannot serve."""
    details = capabilities.problem_details(points)
    if details:
        raise CapabilityError([detail["msg"] for detail in details], details)
