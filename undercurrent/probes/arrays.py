"""Turn whatever tensors an adapter captured into float64 numpy arrays.

numpy is imported lazily (it comes with the ``hf`` extra, not the core install),
and torch is never imported here: a torch tensor is recognised by its ``detach``
method and converted by torch itself (so bfloat16 works too); a batch of them
is stacked by torch first and converted once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def numpy_module() -> Any:
    """The numpy module, or an ImportError saying which extra provides it."""
    try:
        import numpy
    except ImportError as exc:  # pragma: no cover - numpy ships with every extra we test
        raise ImportError(
            "the built-in probes need numpy; install it with `pip install undercurrent[hf]` "
            "or `pip install numpy`"
        ) from exc
    return numpy


def as_float_array(tensor: Any) -> Any:
    """A float64 numpy view or copy of ``tensor`` (numpy array, torch tensor, or list).

    >>> as_float_array([1, 2]).dtype.name
    'float64'
    """
    np = numpy_module()
    if hasattr(tensor, "detach"):
        tensor = tensor.detach()
        if hasattr(tensor, "float"):
            tensor = tensor.float()
        if hasattr(tensor, "cpu"):
            tensor = tensor.cpu()
        tensor = tensor.numpy()
    return np.asarray(tensor, dtype=np.float64)


def as_flat_vector(tensor: Any) -> Any:
    """``as_float_array`` flattened to one dimension (``kv`` records are 3-D)."""
    return as_float_array(tensor).reshape(-1)


def as_float_matrix(tensors: Sequence[Any]) -> Any:
    """The tensors, each flattened, as the rows of one float64 numpy matrix.

    Torch tensors are stacked by torch first, so a batch costs one conversion,
    not one per tensor. Every tensor must have the same number of elements.

    >>> as_float_matrix([[1, 2], [3, 4]]).shape
    (2, 2)
    """
    np = numpy_module()
    first = tensors[0]
    if hasattr(first, "detach"):
        torch = sys.modules["torch"]  # a tensor with ``detach`` comes from an imported torch
        stacked = torch.stack(list(tensors)).detach()
        if stacked.dim() != 2:  # kv records are (2, heads, head_dim)
            stacked = stacked.reshape(len(tensors), -1)
        return stacked.to("cpu", torch.float64).numpy()
    return np.stack([as_flat_vector(tensor) for tensor in tensors])


def batch_matrix(batch: Any) -> Any:
    """The rows of an :class:`~undercurrent.records.ActivationBatch`, each flattened,
    as one float64 numpy matrix (one conversion, kept on the batch for the next
    probe that asks).

    >>> from undercurrent.records import ActivationBatch
    >>> batch = ActivationBatch([[1, 2], [3, 4]], request_ids=["r"] * 2, point_names=["p"] * 2,
    ...     layers=[0, 1], tensor_type="mlp_out", token_indices=[3, 3], is_generated=[True] * 2,
    ...     generated_indices=[0, 0], token_ids=[5, 5])
    >>> batch_matrix(batch).tolist()
    [[1.0, 2.0], [3.0, 4.0]]
    """
    cached = batch.cache.get("float64")
    if cached is not None:
        return cached
    tensor = batch.tensor
    if hasattr(tensor, "detach"):
        torch = sys.modules["torch"]
        matrix = tensor.detach().reshape(len(batch), -1).to("cpu", torch.float64).numpy()
    elif hasattr(tensor, "__array__"):
        matrix = numpy_module().asarray(tensor, dtype="float64").reshape(len(batch), -1)
    else:
        matrix = as_float_matrix(list(tensor))
    batch.cache["float64"] = matrix
    return matrix
