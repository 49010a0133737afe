"""The linear probe file format: load (and save) ``weight`` and ``bias`` safely.

A probe file is ``.safetensors`` or ``.npz`` (never pickle) holding:

- ``weight``: shape ``(hidden,)`` for a binary probe, or ``(classes, hidden)``;
- ``bias``: shape ``()`` or ``(1,)`` for a binary probe, ``(classes,)`` otherwise;
- optional string metadata (safetensors header metadata, or 0-d string arrays in
  an ``.npz``): ``format`` (``"undercurrent.linear_probe/1"``), ``link``
  (``sigmoid``/``softmax``/``identity``), ``threshold``, ``layer``,
  ``tensor_type``, ``label_names`` (a JSON list).

Standardisation is never applied at read time: a fitter that standardised its
inputs folds ``mean``/``scale`` into ``weight``/``bias`` before saving, and a file
that still carries ``mean`` or ``scale`` arrays is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undercurrent.paths import shipped_or_user_path, user_path
from undercurrent.probes.arrays import as_float_array, numpy_module
from undercurrent.probes.scoring import parse_threshold

LINEAR_PROBE_FORMAT = "undercurrent.linear_probe/1"
LINKS = ("sigmoid", "softmax", "identity")
SUFFIXES = (".safetensors", ".npz")
_UNFOLDED = ("mean", "scale")


def apply_link(link: str, logits: Any) -> Any:
    """The link applied to an array of logits (float64): ``sigmoid`` element-wise,
    ``softmax`` over the last axis, ``identity`` unchanged. Stable for any
    magnitude (neither overflows).

    >>> apply_link("sigmoid", [0.0, 1000.0, -1000.0]).tolist()
    [0.5, 1.0, 0.0]
    >>> apply_link("softmax", [[0.0, 0.0]]).tolist()
    [[0.5, 0.5]]
    """
    np = numpy_module()
    z = np.asarray(logits, dtype=np.float64)
    if link == "sigmoid":
        # exp of -|z| never overflows: 1 / (1 + e) for z >= 0, e / (1 + e) below
        # (one division, by the shared denominator, for both signs)
        small = np.exp(-np.abs(z))
        return np.where(z >= 0, 1.0, small) / (1.0 + small)
    if link == "softmax":
        shifted = np.exp(z - z.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)
    if link == "identity":
        return z
    raise ValueError(f"link must be one of {', '.join(LINKS)}, got {link!r}")


class ProbeFileError(ValueError):
    """A probe file that is missing, unreadable, or not what it claims to be."""


@dataclass(frozen=True)
class LinearWeights:
    """A validated ``weight``/``bias`` pair (float64, read-only) and its metadata.

    ``weight`` is ``(hidden,)`` (binary) or ``(classes, hidden)``; ``bias`` is a
    0-d array (binary) or ``(classes,)``. ``source`` names where they came from
    (a path, or ``"inline probe_args"``) so errors can say so.
    """

    weight: Any
    bias: Any
    source: str
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def hidden(self) -> int:
        """The activation size the probe expects."""
        return int(self.weight.shape[-1])

    @property
    def classes(self) -> int | None:
        """Number of output classes; None for a binary ``(hidden,)`` probe."""
        return None if self.weight.ndim == 1 else int(self.weight.shape[0])

    @functools.cached_property
    def digest(self) -> bytes:
        """A digest of the weight and bias (shapes, dtypes and values): equal for
        equal weights. Computed once per weights object (a file's is shared by
        every probe that loads it)."""
        digest = hashlib.blake2b(digest_size=16)
        for array in (self.weight, self.bias):
            digest.update(repr((array.shape, array.dtype.str)).encode())
            digest.update(array.tobytes())
        return digest.digest()

    @functools.cached_property
    def label_names(self) -> tuple[str, ...] | None:
        """Class names from the ``label_names`` metadata, when present."""
        raw = self.metadata.get("label_names")
        if raw is None:
            return None
        try:
            names = json.loads(raw)
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ProbeFileError(
                f"{self.source}: metadata 'label_names' must be a JSON list of strings, "
                f"got {raw!r}"
            )
        return tuple(names)


def linear_weights(weight: Any, bias: Any, *, source: str = "inline probe_args",
                   metadata: Mapping[str, str] | None = None) -> LinearWeights:
    """Validate a weight/bias pair (any array-like) into :class:`LinearWeights`.

    >>> linear_weights([0.5, -1.0], 0.25).hidden
    2
    """
    np = numpy_module()
    try:
        # (copies: the arrays are made read-only below, the caller's must not be)
        w = np.array(as_float_array(weight))
        b = np.array(as_float_array(bias))
    except (TypeError, ValueError) as exc:
        raise ProbeFileError(f"{source}: weight and bias must be numeric arrays ({exc})") from None
    if w.ndim not in (1, 2) or w.shape[-1] == 0 or (w.ndim == 2 and w.shape[0] == 0):
        raise ProbeFileError(
            f"{source}: weight must have shape (hidden,) or (classes, hidden), got {w.shape}"
        )
    expected_bias = () if w.ndim == 1 else (w.shape[0],)
    if b.shape != expected_bias:
        if b.size == 1 and (w.ndim == 1 or w.shape[0] == 1):
            b = b.reshape(expected_bias)
        else:
            shape_text = "() or (1,)" if w.ndim == 1 else f"({w.shape[0]},)"
            raise ProbeFileError(
                f"{source}: bias shape {b.shape} does not match weight shape {w.shape}; "
                f"expected {shape_text}"
            )
    if not (np.isfinite(w).all() and np.isfinite(b).all()):
        raise ProbeFileError(f"{source}: weight and bias must be finite (found NaN or inf)")
    w.setflags(write=False)
    b.setflags(write=False)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    declared = meta.get("format")
    if declared is not None and declared != LINEAR_PROBE_FORMAT:
        raise ProbeFileError(
            f"{source}: declares format {declared!r}; expected {LINEAR_PROBE_FORMAT!r}"
        )
    return LinearWeights(weight=w, bias=b, source=source, metadata=meta)


def resolve_probe_path(path: str | os.PathLike[str]) -> Path:
    """Where a probe file lives. ``undercurrent:REL`` names a file shipped inside the
    package (``undercurrent:models/tiny/probe.safetensors`` is the bundled probe), so
    a spec can point at it wherever the package is installed; anything else is an
    ordinary path (``~`` expanded)."""
    return shipped_or_user_path(path, resolve=True)


def load_linear_weights(path: str | os.PathLike[str]) -> LinearWeights:
    """Read a ``.safetensors`` or ``.npz`` linear probe file (cached by path and mtime).

    Raises :class:`ProbeFileError` naming the path when the file is missing, is
    not the format its suffix says, lacks ``weight``/``bias``, or has shapes that
    do not fit together.
    """
    resolved = resolve_probe_path(path)
    if resolved.suffix not in SUFFIXES:
        raise ProbeFileError(
            f"linear probe file {str(path)!r}: unsupported suffix {resolved.suffix!r}; "
            f"expected one of {', '.join(SUFFIXES)} (pickled files are never loaded)"
        )
    try:
        stat = resolved.stat()
    except OSError:
        raise ProbeFileError(f"linear probe file {str(path)!r} does not exist") from None
    return _load_cached(str(resolved), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime_ns: int, size: int) -> LinearWeights:
    source = f"linear probe file {path!r}"
    if path.endswith(".safetensors"):
        arrays, metadata = _read_safetensors(path, source)
    else:
        arrays, metadata = _read_npz(path, source)
    unfolded = [name for name in _UNFOLDED if name in arrays or name in metadata]
    if unfolded:
        raise ProbeFileError(
            f"{source}: holds {', '.join(unfolded)}; standardisation is not applied at read "
            "time, fold it into weight and bias (w' = w / scale, b' = b - w' . mean)"
        )
    missing = [name for name in ("weight", "bias") if name not in arrays]
    if missing:
        raise ProbeFileError(
            f"{source}: missing array(s) {', '.join(missing)}; found {sorted(arrays) or 'none'}"
        )
    return linear_weights(arrays["weight"], arrays["bias"], source=source, metadata=metadata)


def read_array_file(path: str | os.PathLike[str],
                    what: str = "array file") -> tuple[dict[str, Any], dict[str, str]]:
    """Every array of a ``.safetensors`` / ``.npz`` file and its string metadata, read
    safely (never pickle); ``undercurrent:`` names a file inside the package.

    Raises :class:`ProbeFileError` naming the path when it is missing or malformed.
    """
    resolved = resolve_probe_path(path)
    source = f"{what} {str(path)!r}"
    if resolved.suffix not in SUFFIXES:
        raise ProbeFileError(f"{source}: unsupported suffix {resolved.suffix!r}; expected one "
                             f"of {', '.join(SUFFIXES)} (pickled files are never loaded)")
    if not resolved.is_file():
        raise ProbeFileError(f"{source} does not exist (resolved to {str(resolved)!r})")
    if resolved.suffix == ".safetensors":
        return _read_safetensors(str(resolved), source)
    return _read_npz(str(resolved), source)


def _read_safetensors(path: str, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - safetensors ships with the hf extra
        raise ImportError(
            f"{source}: reading .safetensors needs the safetensors package; "
            "install it with `pip install undercurrent[hf]`"
        ) from exc
    try:
        arrays = safetensors_arrays(path)
        with safe_open(path, framework="numpy") as handle:
            metadata = dict(handle.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types
        raise ProbeFileError(f"{source} is not a valid safetensors file ({exc})") from None
    return arrays, metadata


def safetensors_arrays(path: str) -> dict[str, Any]:
    """Every tensor of a ``.safetensors`` file as a numpy array. A tensor of a dtype
    numpy lacks (bfloat16, what a bfloat16 model's tensors are saved as) is read
    through torch, imported only then, and widened to float64; the others keep
    their dtype. Raises what safetensors raises on reading it with numpy (the
    safetensors package, or torch where the fallback needs it, missing: ImportError)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as handle:
            return {name: handle.get_tensor(name)
                    for name in handle.keys()}  # noqa: SIM118 - not a mapping
    except Exception as exc:  # safetensors raises its own error types
        first_error = exc
    try:  # numpy has no bfloat16: torch reads such files
        with safe_open(path, framework="pt") as handle:
            return {name: _numpy_of(handle.get_tensor(name))
                    for name in handle.keys()}  # noqa: SIM118 - not a mapping
    except Exception:
        raise first_error from None


def _numpy_of(tensor: Any) -> Any:
    """A CPU torch tensor as a numpy array; float64 where numpy lacks its dtype."""
    try:
        return tensor.numpy()
    except TypeError:  # (bfloat16, float8: no numpy dtype)
        return tensor.double().numpy()


def _read_npz(path: str, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    np = numpy_module()
    arrays: dict[str, Any] = {}
    metadata: dict[str, str] = {}
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not hasattr(archive, "files"):
                raise ProbeFileError(f"{source} is a single .npy array, not an .npz archive")
            for name in archive.files:
                value = archive[name]
                if name not in ("weight", "bias") and value.ndim == 0:
                    item = value[()]
                    metadata[name] = item.decode() if isinstance(item, bytes) else str(item)
                else:
                    arrays[name] = value
    except ProbeFileError:
        raise
    except Exception as exc:  # zipfile / numpy format errors, pickled objects
        raise ProbeFileError(f"{source} is not a valid .npz archive ({exc})") from None
    return arrays, metadata


def _label_names(label_names: Any, classes: int | None) -> list[str]:
    """``label_names`` as a list of strings, one per class (two for a binary probe:
    the negative label, then the one it scores); a single string is refused, not
    read one name per character."""
    if isinstance(label_names, str | bytes) or not isinstance(label_names, Iterable):
        raise TypeError(f"label_names must be a list of class names, got "
                        f"{type(label_names).__name__} ({label_names!r:.40})")
    names = [str(name) for name in label_names]
    wanted = 2 if classes is None else classes
    if len(names) != wanted:
        kind = ("a binary probe (one weight row) has two: the negative label, then the one "
                "it scores" if classes is None else f"the weight has {classes} class rows")
        raise ValueError(f"label_names has {len(names)} name(s) {names[:5]}; {kind}")
    return names


def save_linear_weights(
    path: str | os.PathLike[str],
    weight: Any,
    bias: Any,
    *,
    link: str | None = None,
    threshold: float | None = None,
    layer: int | None = None,
    tensor_type: str | None = None,
    label_names: list[str] | tuple[str, ...] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a probe file that :func:`load_linear_weights` reads (suffix picks the format).

    Returns the path written. Use it from fitting code so the format lives in one place.
    """
    np = numpy_module()
    target = user_path(path, "save_linear_weights: path", what="a .safetensors or .npz file")
    checked = linear_weights(weight, bias, source=f"probe to save at {str(path)!r}")
    if link is not None and link not in LINKS:
        raise ValueError(f"link must be one of {', '.join(LINKS)}, got {link!r}")
    meta: dict[str, str] = {"format": LINEAR_PROBE_FORMAT}
    optional = {"link": link, "layer": layer, "tensor_type": tensor_type}
    meta.update({key: str(value) for key, value in optional.items() if value is not None})
    # (checked as a probe reading the file checks it: a NaN or infinite threshold
    # would be written, then refused at every load)
    threshold = parse_threshold(threshold, option=f"threshold of the probe to save at "
                                                  f"{str(path)!r}")
    if threshold is not None:
        meta["threshold"] = repr(threshold)
    if label_names is not None:
        meta["label_names"] = json.dumps(_label_names(label_names, checked.classes))
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    if target.suffix not in SUFFIXES:
        raise ProbeFileError(
            f"cannot save a linear probe to {str(path)!r}: suffix must be one of "
            f"{', '.join(SUFFIXES)}"
        )
    # float32 on disk, and a binary probe's bias stays 0-d, as the format says.
    w = np.array(checked.weight, dtype=np.float32, order="C")
    b = np.array(checked.bias, dtype=np.float32, order="C")  # ascontiguousarray would make 0-d 1-d
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file({"weight": w, "bias": b}, str(target), metadata=meta)
    else:
        strings = {key: np.array(value) for key, value in meta.items()}
        with open(target, "wb") as handle:  # a handle stops numpy renaming the file
            np.savez(handle, weight=w, bias=b, **strings)
    return target
