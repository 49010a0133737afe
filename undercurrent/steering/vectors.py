"""Resolving an edit's ``vector`` to a direction: the one seam every vector source uses.

An :class:`~undercurrent.spec.Edit` names its vector as a list of numbers, a
file, or an SAE feature (``{sae: FOLDER, feature: INDEX}``). :func:`resolve_edit`
turns it into a :class:`ResolvedEdit` (the edit plus a float64 numpy vector of the
model's hidden size) when the edit is registered on a model, so every problem
surfaces before generation, naming the edit and the field.

Sources are tried in order; the first that recognises the value answers:

1. sources added with :func:`register_vector_source` (newest first);
2. an inline list of numbers;
3. a ``.safetensors`` / ``.npz`` file: the array ``vector_key`` names, else its
   only 1-D array, else (a linear probe file: ``weight`` and ``bias``) the
   probe's weight as it is (``add`` adds it unnormalised);
4. an :class:`~undercurrent.spec.SaeFeature`: the feature's decoder direction
   (``W_dec[i]``). The resolved edit also holds the loaded SAE, which ``clamp``
   uses to clamp the feature's activation through the encoder.

A new kind of vector plugs in as a source: a function ``(edit) -> vector | None``
that returns None for values it does not own.

Nothing here imports torch; numpy is imported when a vector is resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from undercurrent.probes.sae_files import load_sae, sae_decoder_direction
from undercurrent.probes.weights import ProbeFileError, read_array_file
from undercurrent.spec.errors import SpecProblem, SpecValidationError
from undercurrent.spec.types import Edit, EditOp, SaeFeature

VectorSource = Callable[[Edit], Any]
"""``(edit) -> 1-D array-like | None``: a vector for ``edit``, or None when the
edit's ``vector`` is not this source's to resolve. Raise ``ValueError`` with a
message for a value it owns but cannot use."""

_SOURCES: list[tuple[str, VectorSource]] = []


def register_vector_source(name: str, source: VectorSource) -> None:
    """Add (or replace) a vector source, tried before the built-in ones.

    ``name`` is a non-empty string and ``source`` a callable ``(edit) -> vector |
    None``; anything else is refused here, not at every later edit. A ``ValueError``
    the source raises is the edit's problem (a :class:`SpecValidationError` naming
    the edit and the source); any other exception is a ``RuntimeError`` naming the
    source and the edit, raised from it.

    >>> register_vector_source("ones", lambda edit: None)  # never claims a value
    >>> unregister_vector_source("ones")
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_vector_source: name must be a non-empty string, got "
                        f"{type(name).__name__} ({name!r:.40})")
    if not callable(source):
        raise TypeError(f"register_vector_source({name!r}, source): source must be a "
                        "function (edit) -> vector | None, got "
                        f"{type(source).__name__} ({source!r:.40})")
    unregister_vector_source(name)
    _SOURCES.insert(0, (name, source))


def unregister_vector_source(name: str) -> None:
    """Remove the source registered under ``name`` (no error when there is none)."""
    _SOURCES[:] = [(known, source) for known, source in _SOURCES if known != name]


@dataclass(frozen=True, eq=False)
class ResolvedEdit:
    """An edit with its vector as a float64 numpy array of the model's hidden size.

    ``unit`` is the vector divided by its norm (what ``project_out``, ``clamp``
    and ``scale`` use); ``source`` says where the vector came from. ``sae`` is the
    loaded :class:`~undercurrent.probes.sae_files.SparseAutoencoder` when the
    vector names an SAE feature (then ``clamp`` goes through its encoder), else
    None.
    """

    edit: Edit
    vector: Any
    source: str
    sae: Any = None

    @property
    def sae_clamp(self) -> bool:
        """True when the edit clamps an SAE feature's activation (``clamp`` on an
        :class:`~undercurrent.spec.SaeFeature`)."""
        return self.sae is not None and self.edit.op is EditOp.CLAMP

    @property
    def name(self) -> str:
        return self.edit.name

    @property
    def unit(self) -> Any:
        import numpy as np

        return self.vector / np.linalg.norm(self.vector)


def _inline(edit: Edit) -> Any:
    return None if isinstance(edit.vector, str | SaeFeature) else list(edit.vector)


def _sae_row(edit: Edit) -> Any:
    if not isinstance(edit.vector, SaeFeature):
        return None
    return sae_decoder_direction(edit.vector.sae, edit.vector.feature)


def _from_file(edit: Edit) -> Any:
    if not isinstance(edit.vector, str):
        return None
    arrays, _ = read_array_file(edit.vector, "vector file")
    if edit.vector_key is not None:
        if edit.vector_key not in arrays:
            raise ValueError(f"vector_key {edit.vector_key!r} is not in {edit.vector!r}; "
                             f"it holds: {', '.join(sorted(arrays)) or 'no arrays'}")
        return arrays[edit.vector_key]
    # (a linear probe file before the one-1-D-array rule: a weight of shape (1, H)
    # or (K, H) left its 1-D bias as the file's one vector)
    if "weight" in arrays and "bias" in arrays:
        weight = arrays["weight"]
        if weight.ndim == 2 and weight.shape[0] == 1:
            return weight[0]
        if weight.ndim == 1:
            return weight
        raise ValueError(f"{edit.vector!r} is a {weight.shape[0]}-class linear probe; its "
                         "weight has one row per class, so name the row to use in a file "
                         "of its own (or pass vector as a list)")
    vectors = [name for name, array in arrays.items() if array.ndim == 1]
    if len(vectors) == 1:
        return arrays[vectors[0]]
    if not vectors:
        shapes = ", ".join(f"{name} {arrays[name].shape}" for name in sorted(arrays))
        raise ValueError(f"{edit.vector!r} holds no 1-D array ({shapes or 'no arrays'}); an "
                         "edit's vector file holds a 1-D array of the model's hidden size "
                         "(or a linear probe's weight of shape (H,) or (1, H) beside its bias)")
    raise ValueError(f"{edit.vector!r} holds {len(vectors)} 1-D arrays "
                     f"({', '.join(sorted(vectors))}); name one with vector_key")


_BUILTIN: tuple[tuple[str, VectorSource], ...] = (
    ("list", _inline), ("file", _from_file), ("sae", _sae_row))


def _problem(edit: Edit, index: int, message: str, field: str = "vector") -> SpecProblem:
    return SpecProblem(message, field, index, edit.name, "edits")


# The largest finite number of the dtypes a model computes in, by name (torch's
# finfo, without importing torch); a dtype not listed is taken as float64.
_LARGEST_FINITE = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
                   "float32": 3.4028234663852886e38}


def resolve_edit(edit: Edit, hidden_size: int | None, index: int = 0,
                 dtype: str | None = None) -> ResolvedEdit:
    """The edit's vector, checked: 1-D, finite, not all zeros, ``hidden_size`` long,
    and (given the model's ``dtype``, like ``"float32"``) the coefficient times the
    vector finite in that dtype (an infinity added would turn every later
    activation NaN).

    Raises :class:`SpecValidationError` naming the edit (``edits[index]``) and the
    field ``vector`` (a missing file, a wrong size, ...).

    >>> from undercurrent.spec import Edit
    >>> edit = Edit(name="e", layers=0, tensor_type="mlp_out", position=0, op="add",
    ...             vector=[3.0, 4.0])
    >>> resolve_edit(edit, hidden_size=2).unit.tolist()
    [0.6, 0.8]
    """
    import numpy as np

    found: Any = None
    source_name = ""
    for name, source in (*_SOURCES, *_BUILTIN):
        registered = (name, source) not in _BUILTIN
        try:
            found = source(edit)
        except (ProbeFileError, ValueError, OSError) as error:
            by = f" (vector source {name!r})" if registered else ""
            raise SpecValidationError([_problem(edit, index, f"{error}{by}")]) from None
        except Exception as error:
            if not registered:
                raise
            # (a bug in a user's source: name it, and keep its traceback)
            raise RuntimeError(
                f"vector source {name!r} (register_vector_source) raised "
                f"{type(error).__name__} resolving edit {edit.name!r}: {error}") from error
        if found is not None:
            source_name = name
            break
    if found is None:
        raise SpecValidationError([_problem(edit, index, "no vector source understands "
                                                         f"{edit.vector!r}")])
    where = _describe(edit.vector)
    try:
        vector = np.array(found, dtype=np.float64)
    except (TypeError, ValueError) as error:
        # (an .npz of strings, say: numpy's message named neither the edit nor the file)
        kind = getattr(getattr(found, "dtype", None), "name", type(found).__name__)
        raise SpecValidationError([_problem(
            edit, index, f"{where} gives values that are not numbers ({kind}: {error})")]
        ) from None
    message = None
    if vector.ndim != 1:
        message = f"{where} gives an array of shape {vector.shape}; an edit needs a 1-D vector"
    elif not np.isfinite(vector).all():
        message = f"{where} holds NaN or infinity"
    elif not vector.any():
        message = f"{where} is all zeros; an edit needs a direction"
    elif hidden_size is not None and vector.shape[0] != hidden_size:
        message = (f"has {vector.shape[0]} numbers but the model's hidden size is "
                   f"{hidden_size}; the vector must have one number per hidden unit")
        if isinstance(edit.vector, SaeFeature):
            message = (f"SAE {edit.vector.sae!r} reads activations of size "
                       f"{vector.shape[0]} but the model's hidden size is {hidden_size}")
    if message is not None:
        raise SpecValidationError([_problem(edit, index, message)])
    overflow = None if dtype is None else _overflow(edit, vector, dtype)
    if overflow is not None:
        raise SpecValidationError([_problem(edit, index, overflow, "coefficient")])
    vector.setflags(write=False)
    return ResolvedEdit(edit, vector, source_name, _loaded_sae(edit, source_name))


def _overflow(edit: Edit, vector: Any, dtype: str) -> str | None:
    """Why ``coefficient`` times the vector ``edit`` adds (``add``: the vector; the
    other ops and ``norm_match``: its unit, along which they set or scale)
    overflows ``dtype``, or None."""
    import numpy as np

    largest = _LARGEST_FINITE.get(dtype, float(np.finfo(np.float64).max))
    whole = edit.op is EditOp.ADD and not edit.norm_match
    along = vector if whole else vector / np.linalg.norm(vector)
    with np.errstate(over="ignore"):
        peak = float(np.max(np.abs(edit.coefficient * along)))
    if peak <= largest:
        return None
    what = "the vector" if whole else "the vector's unit direction"
    return (f"coefficient {edit.coefficient:g} times {what} reaches {peak:.3g}, past the "
            f"largest finite {dtype} number ({largest:.3g}) the model computes in: the "
            "edit would add infinity and turn every later activation NaN; use a smaller "
            "coefficient")


def _describe(vector: Any) -> str:
    if isinstance(vector, str):
        return vector
    if isinstance(vector, SaeFeature):
        return f"feature {vector.feature} of SAE {vector.sae!r}"
    return "the list"


def _loaded_sae(edit: Edit, source_name: str) -> Any:
    """The SAE an SAE-feature vector names (None for other vectors, or when a
    registered source answered instead of the built-in one)."""
    if source_name != "sae" or not isinstance(edit.vector, SaeFeature):
        return None

    return load_sae(edit.vector.sae)


def resolve_edits(edits: Sequence[Edit], hidden_size: int | None,
                  dtype: str | None = None) -> list[ResolvedEdit]:
    """:func:`resolve_edit` for each edit, every problem reported at once."""
    resolved: list[ResolvedEdit] = []
    problems: list[SpecProblem] = []
    for index, edit in enumerate(edits):
        try:
            resolved.append(resolve_edit(edit, hidden_size, index, dtype))
        except SpecValidationError as error:
            problems += error.problems
    if problems:
        raise SpecValidationError(problems)
    return resolved
