"""The on-disk layout of an activation store, shared by the writer and the reader.

A store is a directory::

    store.json                    what was captured: model, spec, sampling, prompts hash
    shards/<part>-<seq>/          one committed shard (written whole, then renamed)
        meta.json                 prompt indices, and per point: file, rows, shape, dtype
                                  (and captured_shape, a project:K point's tensors')
        p<k>.bin                  point k's vectors: C-contiguous (rows, *shape), no header
        index.parquet             one row per vector (``INDEX_COLUMNS``)
        outputs.parquet           one row per prompt (``OUTPUT_COLUMNS``)
        results.parquet           the results frame of the shard's prompts
    shards/.tmp-<part>-<seq>/     a shard being written (ignored by readers)

A shard becomes visible only through the atomic rename of its finished
directory, so a reader (or a resumed writer) never sees a partial one. Each
writer (one per ``--shard i/N`` part) names its shards after its part, so
several processes can write into one directory without touching each other's
files. A ``.bin`` file is appended batch by batch, and each batch's rows are
ordered by (layer, prompt, token), so one layer of one point is one contiguous
run per batch (the reader copies run by run).

Vectors are stored in the model's dtype or in ``storage_dtype``; numpy has no
bfloat16, so bfloat16 vectors are stored as their raw 16-bit patterns (``uint16``
on disk) and widened to float32 when read.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STORE_FORMAT = "undercurrent.activation_store/1"
MANIFEST = "store.json"
SHARDS = "shards"
TMP_PREFIX = ".tmp-"

INDEX_COLUMNS: tuple[str, ...] = (
    "request_id",
    "prompt_index",
    "extraction_point_name",
    "layer",
    "tensor_type",
    "token_index",
    "is_generated",
    "generated_index",
    "token_id",
    "edits",
    "shard",
    "row",
)
"""Columns of ``ActivationStore.index``: one row per stored vector.

``row`` is the vector's row in its shard's file for its point; ``generated_index``
and ``token_id`` are nullable (``<NA>`` for prompt tokens / unknown ids);
``edits`` lists the names of the live edits applied at the vector's very site
(its record's ``edits``, a tuple; empty when none, and in stores written before
undercurrent stored it). The string columns read back as pandas' Arrow-backed
``str`` (see ``undercurrent.store.index_frame``). For a
point stored with a token reduction (``last_token`` or ``mean_generated``) the
token columns describe the last token the row covers.
"""

OUTPUT_COLUMNS: tuple[str, ...] = (
    "prompt_index",
    "request_id",
    "prompt",
    "text",
    "token_ids",
    "prompt_token_ids",
    "finish_reason",
    "aborted",
    "abort_point",
    "abort_layer",
    "abort_token_index",
    "abort_score",
)
"""Columns of ``ActivationStore.outputs``: one row per prompt."""

_INDEX_KINDS = {"request_id": "str", "extraction_point_name": "str", "tensor_type": "str",
                "shard": "str", "is_generated": "bool", "edits": "strs"}
INDEX_SCHEMA = tuple((name, _INDEX_KINDS.get(name, "int")) for name in INDEX_COLUMNS)
"""``(column, kind)`` of ``index.parquet`` (kinds: see :func:`arrow_schema`)."""
_OUTPUT_KINDS = {"prompt_index": "int", "token_ids": "ints", "prompt_token_ids": "ints",
                 "aborted": "bool", "abort_layer": "int", "abort_token_index": "int",
                 "abort_score": "float"}
OUTPUT_SCHEMA = tuple((name, _OUTPUT_KINDS.get(name, "str")) for name in OUTPUT_COLUMNS)
"""``(column, kind)`` of ``outputs.parquet``."""
RESULT_SCHEMA = (
    ("prompt_index", "int"), ("request", "str"), ("point", "str"), ("verdict", "str"),
    ("flagged", "bool"), ("aborted", "bool"), ("n_signals", "int"), ("n_flags", "int"),
    ("max_score", "float"), ("mean_score", "float"), ("last_score", "float"),
    ("error", "str"), ("received", "int"), ("processed", "int"), ("dropped", "int"),
    ("errors", "int"), ("timeouts", "int"), ("mean_latency_s", "float"),
)
"""``(column, kind)`` of ``results.parquet``: the results frame, plus ``prompt_index``
(``verdict`` as JSON)."""

STORAGE_DTYPES = ("float32", "float16", "bfloat16")


class StoreError(RuntimeError):
    """A store directory cannot be written or read as asked (wrong layout, another
    capture's directory, a second writer on the same part)."""


class StoreExistsError(StoreError):
    """A capture with ``resume=False`` found shards of its part already committed in
    its directory. ``path``, ``part`` and ``shards`` (how many) say where; the
    message's advice is in the caller's terms (:meth:`advised`: the CLI names its
    ``--no-resume`` flag, not the Python argument)."""

    def __init__(self, path: str, part: str, shards: int, *,
                 resume: str = "pass resume=True",
                 elsewhere: str = "use an empty directory") -> None:
        self.path, self.part, self.shards = path, part, shards
        super().__init__(f"{path!r} already holds {shards} shard(s) of {part}; {resume} "
                         f"to continue that capture, or {elsewhere}")

    def advised(self, resume: str, elsewhere: str) -> StoreExistsError:
        """The same refusal, advising ``resume`` to continue and ``elsewhere`` to start
        afresh."""
        return StoreExistsError(self.path, self.part, self.shards, resume=resume,
                                elsewhere=elsewhere)


def _ascii_digits(text: str) -> bool:
    """Whether ``text`` is digits 0-9 only (``str.isdigit`` also takes "²", "٣")."""
    return text.isascii() and text.isdigit()


class StoreOverflowWarning(UserWarning):
    """Captured values too large for the storage dtype (float16 holds at most
    65504) were stored as infinity: the warning names the point, the layers and
    how many values, and the dtype that holds them."""


# -- reductions ----------------------------------------------------------------------------

_TOKEN_REDUCTIONS = ("all", "last_token", "mean_generated")


@dataclass(frozen=True)
class Reduction:
    """What to keep of one point's vectors.

    ``tokens``: ``"all"`` (every captured token), ``"last_token"`` (only each
    request's last captured token, per layer) or ``"mean_generated"`` (the mean over
    the request's captured generated tokens, per layer). ``project``: a number of
    dimensions ``k`` for a fixed random projection (Gaussian, scaled by
    ``1/sqrt(k)``, drawn from ``seed``; ``store.json`` records the seed, and
    :meth:`projection` rebuilds the matrix).

    As a string: ``"last_token"``, ``"mean_generated"``, ``"project:64"`` or a
    combination joined by ``+`` (``"mean_generated+project:64"``): at most one
    token reduction and one projection (two of a kind are refused).
    """

    tokens: str = "all"
    project: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens not in _TOKEN_REDUCTIONS:
            raise ValueError(
                f"reduction tokens={self.tokens!r} is not one of {list(_TOKEN_REDUCTIONS)}")
        if self.project is not None and (isinstance(self.project, bool)
                                         or not isinstance(self.project, int)
                                         or self.project < 1):
            raise ValueError(f"reduction project={self.project!r}: give a number of "
                             "dimensions >= 1 (or None for no projection)")

    @classmethod
    def parse(cls, value: Reduction | str | Mapping[str, Any] | None) -> Reduction:
        """A ``Reduction`` from itself, None, a dict of its fields or its string form."""
        if value is None:
            return cls()
        if isinstance(value, Reduction):
            return value
        if isinstance(value, Mapping):
            return cls(**dict(value))
        if not isinstance(value, str):
            raise TypeError(f"a reduction is a string such as 'last_token' or "
                            f"'project:64', got {type(value).__name__}")
        # (at most one part of each kind: a second would contradict the first,
        # or repeat it, and the last one would win silently)
        chosen: dict[str, str] = {}
        for part in (p.strip() for p in value.split("+")):
            if part in _TOKEN_REDUCTIONS:
                kind = "token reduction"
            elif part.startswith("project:") and _ascii_digits(part[len("project:"):]):
                kind = "projection"
            else:
                raise ValueError(
                    f"unknown reduction {part!r} in {value!r}; use 'last_token', "
                    "'mean_generated', 'project:K' or several joined by '+'")
            if kind in chosen:
                raise ValueError(
                    f"reduction {value!r} gives two {kind}s, {chosen[kind]!r} and "
                    f"{part!r}; keep one (at most one of 'all', 'last_token', "
                    "'mean_generated', and one 'project:K', e.g. "
                    "'mean_generated+project:64')")
            chosen[kind] = part
        project = chosen.get("projection")
        return cls(tokens=chosen.get("token reduction", "all"),
                   project=None if project is None else int(project[len("project:"):]))

    @property
    def is_identity(self) -> bool:
        return self.tokens == "all" and self.project is None

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "project": self.project, "seed": self.seed}

    def projection(self, features: int) -> Any:
        """The ``(features, project)`` float32 projection matrix (deterministic)."""
        import numpy as np

        if self.project is None:
            raise ValueError("this reduction has no projection")
        if self.project > features:  # (it would store more than the vectors hold)
            raise ValueError(f"project:{self.project} asks for more dimensions than the "
                             f"{features} features projected; give K <= {features}")
        rng = np.random.default_rng(self.seed)
        matrix = rng.standard_normal((features, self.project), dtype=np.float64)
        return (matrix / np.sqrt(self.project)).astype(np.float32)


def parse_reductions(reduce: Mapping[str, Any] | None,
                     point_names: Sequence[str] | None) -> dict[str, Reduction]:
    """``{point name: Reduction}`` for every point (identity where none was asked).

    ``point_names`` None checks only the reductions' form, before a spec is loaded,
    and gives the named points alone.
    """
    if reduce is not None and not isinstance(reduce, Mapping):
        raise TypeError(f"reduce must be a dict {{point name: reduction}} (e.g. "
                        f"{{'resid': 'last_token'}}), got {type(reduce).__name__} ({reduce!r:.60})")
    chosen = dict(reduce or {})
    if point_names is None:
        return {name: _parse_reduction(name, value) for name, value in chosen.items()}
    unknown = sorted(set(chosen) - set(point_names))
    if unknown:
        raise ValueError(f"reduce names unknown point(s) {unknown}; the spec's points are "
                         f"{list(point_names)}")
    return {name: _parse_reduction(name, chosen.get(name)) for name in point_names}


def _parse_reduction(point_name: str, value: Any) -> Reduction:
    try:
        return Reduction.parse(value)
    except ValueError as error:
        raise ValueError(f"reduce[{point_name!r}]: {error}") from None


# -- parts (scale-out) ----------------------------------------------------------------------

def parse_part(shard: str | tuple[int, int] | None) -> tuple[int, int]:
    """``"i/N"`` (or ``(i, N)``, or None for ``0/1``) as ``(i, N)``, checked."""
    if shard is None:
        return 0, 1
    if isinstance(shard, str):
        pieces = shard.split("/")
        if len(pieces) != 2 or not all(_ascii_digits(p.strip()) for p in pieces):
            raise ValueError(f"shard {shard!r} must look like 'i/N' (e.g. '0/4'), "
                             "with 0 <= i < N")
        index, count = int(pieces[0]), int(pieces[1])
    else:
        index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: need 0 <= i < N")
    return index, count


def part_range(index: int, count: int, n_prompts: int, grid: int = 1) -> range:
    """The prompt indices of part ``index`` of ``count``: contiguous, disjoint,
    covering; each bound a multiple of ``grid`` (or the end)."""
    cells = -(-n_prompts // grid)
    return range(min(index * cells // count * grid, n_prompts),
                 min((index + 1) * cells // count * grid, n_prompts))


def part_name(index: int, count: int) -> str:
    return f"part{index:04d}of{count:04d}"


# -- files ---------------------------------------------------------------------------------

def prompts_digest(prompts: Sequence[str]) -> str:
    """A hash of the whole prompt list (every part of a store must share it)."""
    digest = hashlib.sha256()
    for prompt in prompts:
        encoded = prompt.encode()
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{str(path)!r} is missing: is this an activation store?") from None
    except json.JSONDecodeError as error:
        raise StoreError(f"{str(path)!r} is not valid JSON ({error})") from None


def committed_shards(root: Path) -> list[Path]:
    """The committed shard directories of a store, in name order."""
    folder = root / SHARDS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


SHARD_TABLES = ("index.parquet", "outputs.parquet")
"""The parquet files every committed shard holds (``results.parquet`` too, except in
shards of early writers that had no results to store)."""


def read_shard_meta(shard: Path) -> dict[str, Any]:
    """A committed shard's ``meta.json``, checked against the files it describes.

    A shard missing one of them, or whose vector file has another size than its
    rows say (a copy cut short, a file removed by hand), is a ``StoreError`` naming
    the shard and the file: read as it is, it would be half-present (its vectors
    counted, its rows or outputs not) and a resume would never recapture it.
    """
    import numpy as np

    meta: dict[str, Any] = read_json(shard / "meta.json")
    advice = (f"copy the shard again, or remove {str(shard)!r} and run the capture "
              "again (resume=True) to recapture its prompts")
    for name in SHARD_TABLES:
        if not (shard / name).is_file():
            raise StoreError(f"shard {shard.name!r} is damaged: {name} is missing; {advice}")
    for point, info in meta.get("points", {}).items():
        path = shard / info["file"]
        if not path.is_file():
            raise StoreError(f"shard {shard.name!r} is damaged: {info['file']} (the vectors "
                             f"of point {point!r}) is missing; {advice}")
        expected = info["rows"] * disk_dtype(info["dtype"]).itemsize * int(
            np.prod(info["shape"], dtype=np.int64))
        if path.stat().st_size != expected:
            raise StoreError(f"shard {shard.name!r} is damaged: {info['file']} (the vectors "
                             f"of point {point!r}) has {path.stat().st_size} bytes, its "
                             f"meta.json says {expected}; {advice}")
    return meta


_INT_KEYS = "__int_keys__"
"""The tag of a dict with integer keys in a stored verdict (JSON keys are strings)."""

_ITEMS = "__items__"
"""The tag of any other dict JSON would not give back: one with a key that is not a
string (mixed with strings, a bool, a float, None), or a verdict's own dict whose
one key is a tag's name; it is stored as its ``[key, value]`` pairs."""


def verdict_to_json(verdict: Any) -> str:
    """A probe's verdict as the JSON ``results.parquet`` stores, such that
    :func:`verdict_from_json` gives it back equal: a dict whose keys are all
    integers (the trajectory probe's ``final_by_layer``, keyed by layer) is tagged,
    ``{"__int_keys__": {"3": ...}}``; any other dict with a key that is not a string
    (``{3: 0.4, "mean": 0.5}``), and a dict of one key named like a tag, is stored
    as its pairs, ``{"__items__": [[3, 0.4], ["mean", 0.5]]}``. numpy values become
    plain ones, NaN null, other objects their ``repr``; a key JSON cannot hold (a
    tuple) is refused."""
    return json.dumps(_tag_keys(verdict), default=_plain)


VERDICT_KEYS = "tagged+items"
"""A shard's ``meta.json`` ``verdict_keys``: how its verdicts' dict keys are stored
(see :func:`verdict_to_json`). Earlier shards say ``"tagged"`` (integer-keyed dicts
tagged, other keys made strings by JSON) or nothing (every key a string)."""


def verdict_from_json(text: str, *, written_as: str | None = VERDICT_KEYS) -> Any:
    """The verdict :func:`verdict_to_json` stored (tuples come back as lists).

    ``written_as`` is the shard's ``verdict_keys``: ``"tagged"`` reads a shard
    whose only tag was ``__int_keys__``; None reads a shard written before any tag:
    JSON had made every integer key a string, so a dict whose keys are all decimal
    digits gets integer keys back, as the tag would give (a verdict keyed by such
    strings of its own could not be told apart there)."""
    if written_as is None:
        return json.loads(text, object_hook=_digit_keys)
    if written_as == "tagged":
        return json.loads(text, object_hook=_untag_int_keys)
    if written_as != VERDICT_KEYS:
        raise StoreError(f"verdicts stored with verdict_keys={written_as!r} are not "
                         f"known to this version (it reads {VERDICT_KEYS!r}, 'tagged' "
                         "and none); read the store with the version that wrote it")
    return json.loads(text, object_hook=_untag_keys)


def _tag_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        items = [(_json_key(key), _tag_keys(item)) for key, item in value.items()]
        if items and all(type(key) is int for key, _ in items):
            return {_INT_KEYS: {str(key): item for key, item in items}}
        if (any(not isinstance(key, str) for key, _ in items)
                or (len(items) == 1 and items[0][0] in (_INT_KEYS, _ITEMS))):
            return {_ITEMS: [[key, item] for key, item in items]}
        return dict(items)
    if isinstance(value, list | tuple):
        return [_tag_keys(item) for item in value]
    return value


def _json_key(key: Any) -> Any:
    """A verdict dict's key as the JSON value it is stored as (numpy scalars plain)."""
    if isinstance(key, str | bool) or key is None:
        return key
    if isinstance(key, numbers.Integral):
        return int(key)
    if isinstance(key, numbers.Real):
        return float(key)
    if hasattr(key, "item") and getattr(key, "shape", None) == ():  # a numpy bool
        return _json_key(key.item())
    raise TypeError(f"a verdict's dict key {key!r} ({type(key).__name__}) cannot be "
                    "stored: JSON holds keys that are strings, numbers, booleans or None")


def _untag_keys(value: dict[str, Any]) -> Any:
    if len(value) == 1 and isinstance(value.get(_ITEMS), list):
        return {key: item for key, item in value[_ITEMS]}
    return _untag_int_keys(value)


def _untag_int_keys(value: dict[str, Any]) -> Any:
    if len(value) == 1 and isinstance(value.get(_INT_KEYS), dict):
        return {int(key): item for key, item in value[_INT_KEYS].items()}
    return value


def _digit_keys(value: dict[str, Any]) -> Any:
    if value and all(key.isascii() and key.isdigit() for key in value):
        return {int(key): item for key, item in value.items()}
    return value


def _plain(value: Any) -> Any:
    """JSON for verdict values that are not plain JSON (numpy scalars, arrays, objects)."""
    if hasattr(value, "tolist"):
        return _tag_keys(value.tolist())
    if isinstance(value, float) and math.isnan(value):
        return None
    return repr(value)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def arrow_schema(columns: Sequence[tuple[str, str]]) -> Any:
    """The pyarrow schema of ``(column, kind)`` pairs (kinds ``str``, ``int``,
    ``float``, ``bool``, ``ints``, ``strs``)."""
    import pyarrow as pa

    types = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(),
             "bool": pa.bool_(), "ints": pa.list_(pa.int64()), "strs": pa.list_(pa.string())}
    return pa.schema([(name, types[kind]) for name, kind in columns])


def empty_frame(columns: Sequence[tuple[str, str]]) -> Any:
    """A pandas frame with no rows and the columns (and dtypes) a parquet file of
    ``columns`` reads back as: what a store with no committed shard answers."""
    return arrow_schema(columns).empty_table().to_pandas()


# -- dtypes --------------------------------------------------------------------------------

def to_storage(array: Any, dtype_name: str) -> Any:
    """``array`` (numpy, float) converted to the stored representation of ``dtype_name``."""
    import numpy as np

    if dtype_name == "bfloat16":
        return float32_to_bfloat16_bits(np.asarray(array, dtype=np.float32))
    with np.errstate(over="ignore"):  # (overflow is counted by overflowed_rows)
        return np.ascontiguousarray(array, dtype=np.dtype(dtype_name))


def overflowed_rows(array: Any, stored: Any) -> Any:
    """Per row of ``array``, how many of its finite values ``stored`` (its
    :func:`to_storage` form) holds as infinity: the values past the storage
    dtype's range. None when there are none (the usual case, checked first)."""
    import numpy as np

    if stored.dtype == np.uint16 or np.isfinite(stored).all():  # (bfloat16: float32's range)
        return None
    rows = len(stored)
    lost = np.isinf(stored).reshape(rows, -1) & np.isfinite(array).reshape(rows, -1)
    counts = lost.sum(axis=1)
    return counts if counts.any() else None


def disk_dtype(dtype_name: str) -> Any:
    """The numpy dtype of the bytes on disk for a stored dtype name."""
    import numpy as np

    return np.dtype(np.uint16) if dtype_name == "bfloat16" else np.dtype(dtype_name)


def float32_to_bfloat16_bits(array: Any) -> Any:
    """Round float32 to bfloat16 (nearest, ties to even) and return the 16-bit patterns."""
    import numpy as np

    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    nan = np.isnan(array)
    out = (rounded >> 16).astype(np.uint16)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bfloat16_bits_to_float32(bits: Any) -> Any:
    """Widen stored bfloat16 patterns to float32 (exact)."""
    import numpy as np

    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
