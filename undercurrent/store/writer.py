"""Write captured generations into a store, one committed shard at a time.

:class:`StoreWriter` is fed whole generations (``GenerationOutput``s with their
records) batch by batch. Each batch's vectors are converted, reduced and
appended to the open shard's ``.bin`` files right away, so memory holds one batch
of records plus the small index rows of the open shard, however many prompts the
capture has. After ``shard_prompts`` prompts the shard's index, outputs and
results are written and its directory is renamed into place (the commit).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from undercurrent.analysis.frames import results_frame
from undercurrent.arguments import check_number
from undercurrent.store.format import (
    INDEX_SCHEMA,
    MANIFEST,
    OUTPUT_SCHEMA,
    RESULT_SCHEMA,
    SHARDS,
    STORE_FORMAT,
    TMP_PREFIX,
    VERDICT_KEYS,
    Reduction,
    StoreError,
    StoreExistsError,
    StoreOverflowWarning,
    arrow_schema,
    committed_shards,
    fsync_dir,
    overflowed_rows,
    read_json,
    read_shard_meta,
    to_storage,
    verdict_to_json,
    write_json,
)

# What must agree between the parts of one store (and between a run and its resume).
IDENTITY_KEYS = ("model", "points", "reductions", "storage_dtype", "sampling", "prompts",
                 "generation")


def _as_older_edits(existing: Mapping[str, Any], wanted: dict[str, Any]) -> None:
    """Drop the digest of the edits' vectors from ``wanted`` when the store was
    written before it was recorded (its edits are then compared as written)."""
    old, new = ((manifest.get("generation") or {}).get("edits") for manifest in (existing,
                                                                                  wanted))
    if isinstance(old, dict) and isinstance(new, dict) and "vectors_sha256" not in old:
        new.pop("vectors_sha256", None)


def check_shard_prompts(shard_prompts: Any) -> int:
    """``shard_prompts`` as a plain int >= 1: a ``TypeError`` naming it for None, a
    bool, a float or a string (``True`` is not 1 prompt; ``2.5`` is no count), a
    ``ValueError`` for a value below 1."""
    name = "shard_prompts (prompts per committed shard)"
    count: int = check_number(name, shard_prompts, integer=True)
    if count < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {count}")
    return count


def _as_older_storage_dtype(existing: Mapping[str, Any], wanted: dict[str, Any]) -> None:
    """Compare a store written when ``store.json`` recorded the ``storage_dtype``
    argument (null: the model's dtype) with the dtype it resolves to now."""
    model_dtype = (existing.get("generation") or {}).get("dtype")
    if existing.get("storage_dtype") is None and wanted.get("storage_dtype") == model_dtype:
        wanted["storage_dtype"] = None


def _without_greedy_seed(sampling: Any) -> Any:
    """``sampling`` as compared between captures: a seed does not change greedy
    decoding (temperature 0), so there it is left out."""
    if isinstance(sampling, dict) and sampling.get("temperature") == 0:
        return {key: value for key, value in sampling.items() if key != "seed"}
    return sampling


def _difference(key: str, stored: Any, wanted: Any) -> str:
    """``key`` and how it differs, for the refusal: the differing fields of a
    mapping, both values of a short one, the name alone for a long one."""
    if isinstance(stored, dict) and isinstance(wanted, dict):
        fields = sorted(name for name in stored.keys() | wanted.keys()
                        if stored.get(name) != wanted.get(name))
        parts = [_difference(name, stored.get(name), wanted.get(name)) for name in fields]
        return f"{key} ({', '.join(parts)})"
    shown = (json.dumps(stored, default=str), json.dumps(wanted, default=str))
    if max(map(len, shown)) > 80:
        return key
    return f"{key} {shown[0]} in the store, {shown[1]} now"


class StoreWriter:
    """One writer (one part of the prompt list) of a store directory.

    ``identity`` describes the capture (see ``IDENTITY_KEYS``); the first writer
    creates ``store.json`` from it and every later writer (another part, or a
    resumed run) must match it. ``resume=False`` refuses a directory that already
    holds shards of this part. A lock file keeps a second live writer off the
    same part.
    """

    def __init__(self, root: str | os.PathLike[str], identity: Mapping[str, Any], part: str,
                 *, resume: bool = True, shard_prompts: int = 256) -> None:
        self.shard_prompts = check_shard_prompts(shard_prompts)
        self.root = Path(root)
        self.part = part
        self.reductions = {name: Reduction.parse(value)
                           for name, value in identity["reductions"].items()}
        self.storage_dtype: str | None = identity["storage_dtype"]
        self.point_order = [point["name"] for point in identity["points"]]
        # (what this writer makes, removed where nothing is stored: see abandon)
        self._made = [path for path in (self.root, self.root / SHARDS) if not path.exists()]
        (self.root / SHARDS).mkdir(parents=True, exist_ok=True)
        self._lock = _lock_part(self.root / SHARDS / f".lock-{part}", part)
        try:
            if _ensure_manifest(self.root, {"format": STORE_FORMAT, **identity}):
                self._made.append(self.root / MANIFEST)
            mine = [p for p in committed_shards(self.root) if p.name.startswith(part + "-")]
            if mine and not resume:
                raise StoreExistsError(str(self.root), part, len(mine))
            for stale in (self.root / SHARDS).glob(f"{TMP_PREFIX}{part}-*"):
                # A shard a killed run left half-written: never committed, so dropped.
                shutil.rmtree(stale, ignore_errors=True)
            # {prompt index: its committed shard}, of the shards read so far
            self._committed: dict[int, str] = {}
            self._read_shards: set[str] = set()
            self._read_committed(check=True)
            self.completed = set(self._committed)
            self._seq = 1 + max((int(p.name.rsplit("-", 1)[1]) for p in mine), default=-1)
        except BaseException:
            self._lock.close()
            raise
        self._open: _OpenShard | None = None
        self.requests = 0
        self.vectors = 0
        self.bytes = 0
        self._projections: dict[tuple[str, int], Any] = {}

    # -- writing -----------------------------------------------------------------------
    def add(self, outputs: Sequence[Any], prompt_indices: Sequence[int]) -> int:
        """Append one batch of generations (with ``records``); returns vectors written.

        The records are taken out of the outputs (their ``records`` lists are
        emptied) so memory is released point by point as they are written.
        Commits the open shard when it reaches ``shard_prompts`` prompts.
        """
        if self._open is None:
            self._open = _OpenShard(self.root, f"{self.part}-{self._seq:06d}")
        shard = self._open
        shard.whole = False  # until this batch is fully in: a failure now discards it
        written = 0
        entries = _point_entries(outputs, prompt_indices)
        for name in self.point_order:
            # Popped, so each point's records (and the captured tensors they view)
            # are freed once written: the batch's peak is one point, not all.
            found = entries.pop(name, None)
            if not found:
                continue
            captured = list(found[0][3].tensor.shape)
            rows, array = self._vectors(name, found)
            del found
            if not rows:
                continue
            # (a projected point's captured shape rebuilds its projection matrix)
            shard.append(self.point_order.index(name), name, rows, array,
                         captured if self.reductions[name].project is not None else None)
            written += len(rows)
            self.bytes += array.nbytes
            del rows, array
        shard.add_outputs(outputs, prompt_indices)
        shard.whole = True
        self.vectors += written
        self.requests += len(outputs)
        if len(shard.prompt_indices) >= self.shard_prompts:
            self.commit()
        return written

    def _vectors(self, name: str, found: list[tuple[Any, ...]]) -> tuple[list[Any], Any]:
        """The entries the stored rows describe, and their stored array, for one
        point's entries ``(layer, prompt index, token index, record)`` in one batch."""
        import numpy as np

        reduction = self.reductions[name]
        found.sort(key=lambda entry: entry[:3])
        groups = None
        if reduction.tokens == "mean_generated":
            found = [entry for entry in found if entry[3].is_generated]
        if reduction.tokens != "all":
            groups = _group_runs(found)
        if reduction.tokens == "last_token" and groups is not None:
            found = [found[stop - 1] for _, stop in groups]
            groups = None
        if not found:
            return [], None
        array, dtype = _stack([entry[3].tensor for entry in found])
        # Reductions compute in float32 at least, and in float64 for a float64
        # model: its stored float64 vectors are then the float64 reduction.
        compute = np.result_type(array.dtype, np.float32)
        if groups is not None:  # mean over each (layer, prompt) run of generated tokens
            starts = np.array([start for start, _ in groups], dtype=np.intp)
            counts = np.array([stop - start for start, stop in groups], dtype=compute)
            sums = np.add.reduceat(array.astype(compute), starts, axis=0)
            array = sums / counts.reshape((-1,) + (1,) * (array.ndim - 1))
            found = [found[stop - 1] for _, stop in groups]
        if reduction.project is not None:
            flat = np.asarray(array, dtype=compute).reshape(len(array), -1)
            key = (name, flat.shape[1])
            if key not in self._projections:
                self._projections[key] = reduction.projection(flat.shape[1])
            array = flat @ self._projections[key]
        stored = to_storage(array, self.storage_dtype or dtype)
        lost = overflowed_rows(array, stored)
        if lost is not None:
            layers = sorted({found[row][0] for row in np.flatnonzero(lost)})
            warnings.warn(StoreOverflowWarning(
                f"point {name!r}, layer(s) {layers}: {int(lost.sum())} captured value(s) "
                f"past {self.storage_dtype or dtype}'s range (largest "
                f"{float(np.nanmax(np.abs(array))):.4g}) were stored as infinity; capture "
                "with storage_dtype='bfloat16' or 'float32' to keep them"), stacklevel=2)
        return found, stored

    def commit(self) -> None:
        """Finish the open shard and make it visible (an atomic rename)."""
        if self._open is None:
            return
        shard, self._open = self._open, None
        try:
            self._refuse_committed_meanwhile(shard)
            shard.commit(self.storage_dtype)
        except BaseException:
            # (a full disk, say: its temporary directory would hold the space
            # until the next run of this part)
            shard.discard()
            raise
        self._read_shards.add(shard.name)
        self._committed.update(dict.fromkeys(shard.prompt_indices, shard.name))
        self._seq += 1

    def _read_committed(self, *, check: bool = False) -> None:
        """Note the prompts of the committed shards not read yet (``check``: refuse
        a damaged one, naming it: its prompts are neither readable nor to be
        captured twice)."""
        for path in committed_shards(self.root):
            if path.name not in self._read_shards:
                meta = read_shard_meta(path) if check else read_json(path / "meta.json")
                self._committed.update(dict.fromkeys(meta["prompt_indices"], path.name))
                self._read_shards.add(path.name)

    def _refuse_committed_meanwhile(self, shard: _OpenShard) -> None:
        """Refuse to commit prompts another writer committed since this one started:
        a writer of another ``--shard`` split (``0/1`` while ``0/2`` runs) takes
        prompts of this part, and the store would hold them twice."""
        self._read_committed()
        taken = sorted(k for k in shard.prompt_indices if k in self._committed)
        if taken:
            others = sorted({self._committed[k] for k in taken})
            raise StoreError(
                f"prompt(s) {taken[:5]}{' ...' if len(taken) > 5 else ''} of shard "
                f"{shard.name!r} were committed meanwhile by shard(s) {others} of "
                f"another writer of {str(self.root)!r} (another --shard split?); this "
                "shard is dropped so that no prompt is stored twice. Give every writer "
                "of a store the same split, and run the capture again to resume")

    def close(self) -> None:
        """Commit what is open and release this part's lock."""
        try:
            self.commit()
        finally:
            self._lock.close()

    def abandon(self) -> None:
        """After an error or interrupt: commit the open shard if it holds only whole
        batches (they are complete prompts), else drop it; release the lock. A call
        that stored nothing (one the model refused at its first batch, e.g. past
        its context) leaves the directory as it found it: what this writer made
        there is removed, unless another writer has begun there."""
        try:
            if self._open is not None:
                if self._open.whole and self._open.prompt_indices:
                    self.commit()
                else:
                    self._open.discard()
                    self._open = None
        finally:
            self._lock.close()
        lock = self.root / SHARDS / f".lock-{self.part}"
        if (self.requests == 0 and self.root / MANIFEST in self._made
                and [p.name for p in lock.parent.iterdir()] == [lock.name]):
            # (no other writer has begun: its lock file would be there)
            with contextlib.suppress(OSError):
                lock.unlink()
                for path in reversed(self._made):
                    if path.is_dir():
                        path.rmdir()  # (empty, or left as it is)
                    else:
                        path.unlink()


def _point_entries(outputs: Sequence[Any], prompt_indices: Sequence[int]
                   ) -> dict[str, list[tuple[Any, ...]]]:
    """Per point: ``(layer, prompt index, token index, record)`` of every record."""
    entries: dict[str, list[tuple[Any, ...]]] = {}
    for output, prompt_index in zip(outputs, prompt_indices, strict=True):
        if output.records is None:
            raise StoreError("the writer needs outputs generated with records=True")
        for record in output.records:
            entries.setdefault(record.extraction_point_name, []).append(
                (record.layer, prompt_index, record.token_index, record))
        output.records.clear()
    return entries


def _group_runs(found: list[tuple[Any, ...]]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of entries sharing (layer, prompt) (``found`` is sorted)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for position in range(1, len(found) + 1):
        if position == len(found) or found[position][:2] != found[start][:2]:
            runs.append((start, position))
            start = position
    return runs


def _stack(tensors: list[Any]) -> tuple[Any, str]:
    """One numpy array ``(n, *shape)`` from torch tensors or arrays, and the source
    dtype name (dtypes numpy lacks, such as bfloat16, come back as float32)."""
    import numpy as np

    first = tensors[0]
    if hasattr(first, "detach"):
        import torch

        stacked = torch.stack([t.detach() for t in tensors]).cpu()
        name = str(stacked.dtype).removeprefix("torch.")
        if name not in ("float32", "float16", "float64"):
            stacked = stacked.float()
        return stacked.numpy(), name
    array = np.stack([np.asarray(t) for t in tensors])
    return array, array.dtype.name


class _ParquetAppender:
    """A parquet file written one row group per call, with a fixed schema, so the
    open shard keeps none of its rows in memory."""

    def __init__(self, path: Path, columns: Sequence[tuple[str, str]]) -> None:
        self.path = path
        self.columns = columns
        self.writer: Any = None

    def write(self, data: Mapping[str, Sequence[Any]]) -> int:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = arrow_schema(self.columns)
        table = pa.table({name: pa.array(data[name], type=schema.field(name).type)
                          for name, _ in self.columns}, schema=schema)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, schema)
        self.writer.write_table(table)
        return len(table)

    def close(self) -> None:
        if self.writer is None:
            self.write({name: [] for name, _ in self.columns})
        self.writer.close()
        self.writer = None



class _OpenShard:
    """A shard being written in its temporary directory."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.tmp = root / SHARDS / f"{TMP_PREFIX}{name}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        self.files: dict[str, Any] = {}
        self.points: dict[str, dict[str, Any]] = {}
        self.index = _ParquetAppender(self.tmp / "index.parquet", INDEX_SCHEMA)
        self.outputs = _ParquetAppender(self.tmp / "outputs.parquet", OUTPUT_SCHEMA)
        self.results = _ParquetAppender(self.tmp / "results.parquet", RESULT_SCHEMA)
        self.vectors = 0
        self.prompt_indices: list[int] = []
        self.whole = True

    def append(self, point_number: int, name: str, entries: list[tuple[Any, ...]],
               array: Any, captured_shape: list[int] | None = None) -> None:
        """Write one point's rows; ``captured_shape``: the shape of the tensors a
        ``project:K`` reduction projected (recorded, so a fit on the projected
        vectors can be folded back onto the captured ones)."""
        info = self.points.get(name)
        shape = list(array.shape[1:])
        dtype = "bfloat16" if array.dtype.name == "uint16" else array.dtype.name
        if info is None:
            info = self.points[name] = {"file": f"p{point_number}.bin", "rows": 0,
                                        "shape": shape, "dtype": dtype}
            if captured_shape is not None:
                info["captured_shape"] = captured_shape
            self.files[name] = open(self.tmp / info["file"], "wb")  # noqa: SIM115
        elif info["shape"] != shape or info["dtype"] != dtype:
            raise StoreError(f"point {name!r} captured vectors of shape {shape} ({dtype}) "
                             f"after {info['shape']} ({info['dtype']}) in one shard")
        self.files[name].write(memoryview(array).cast("B"))
        first = info["rows"]
        info["rows"] += len(entries)
        records = [entry[3] for entry in entries]
        kind = str(getattr(records[0].tensor_type, "value", records[0].tensor_type))
        self.vectors += self.index.write({
            "request_id": [record.request_id for record in records],
            "prompt_index": [entry[1] for entry in entries],
            "extraction_point_name": [name] * len(records),
            "layer": [record.layer for record in records],
            "tensor_type": [kind] * len(records),
            "token_index": [record.token_index for record in records],
            "is_generated": [record.is_generated for record in records],
            "generated_index": [record.generated_index for record in records],
            "token_id": [record.token_id for record in records],
            "edits": [list(record.edits) for record in records],
            "shard": [self.name] * len(records),
            "row": range(first, first + len(records)),
        })

    def add_outputs(self, outputs: Sequence[Any], prompt_indices: Sequence[int]) -> None:
        aborts = [output.abort for output in outputs]
        self.outputs.write({
            "prompt_index": [int(index) for index in prompt_indices],
            "request_id": [output.request_id for output in outputs],
            "prompt": [output.prompt for output in outputs],
            "text": [output.text for output in outputs],
            "token_ids": [list(output.token_ids) for output in outputs],
            "prompt_token_ids": [list(output.prompt_token_ids) for output in outputs],
            "finish_reason": [output.finish_reason for output in outputs],
            "aborted": [abort is not None for abort in aborts],
            "abort_point": [None if a is None else a.extraction_point_name for a in aborts],
            "abort_layer": [None if a is None else a.layer for a in aborts],
            "abort_token_index": [None if a is None else a.token_index for a in aborts],
            "abort_score": [None if a is None else a.signal.score for a in aborts],
        })
        frame = results_frame(list(outputs))
        prompt_of = dict(zip((o.request_id for o in outputs), prompt_indices, strict=True))
        columns = {name: frame[name].tolist() for name, _ in RESULT_SCHEMA[1:]}
        columns["prompt_index"] = [int(prompt_of[request]) for request in frame["request"]]
        columns["verdict"] = [verdict_to_json(v) for v in frame["verdict"]]
        columns["error"] = [None if e is None else str(e) for e in frame["error"]]
        self.results.write(columns)
        self.prompt_indices.extend(int(index) for index in prompt_indices)

    def commit(self, storage_dtype: str | None) -> None:
        self._close([handle.close for handle in self.files.values()]
                    + [table.close for table in (self.index, self.outputs, self.results)])
        write_json(self.tmp / "meta.json", {
            "format": STORE_FORMAT, "shard": self.name, "points": self.points,
            "prompt_indices": self.prompt_indices, "vectors": self.vectors,
            "storage_dtype": storage_dtype, "verdict_keys": VERDICT_KEYS})
        fsync_dir(self.tmp)
        os.rename(self.tmp, self.root / SHARDS / self.name)
        fsync_dir(self.root / SHARDS)

    def discard(self) -> None:
        """Close every file (errors ignored: the shard is dropped) and remove it."""
        for close in [handle.close for handle in self.files.values()] + [
                table.writer.close for table in (self.index, self.outputs, self.results)
                if table.writer is not None]:
            with contextlib.suppress(Exception):
                close()
        for table in (self.index, self.outputs, self.results):
            table.writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    @staticmethod
    def _close(closers: list[Any]) -> None:
        """Call every closer, even after one fails; then raise the first failure."""
        failure: BaseException | None = None
        for close in closers:
            try:
                close()
            except BaseException as error:
                failure = failure or error
        if failure is not None:
            raise failure


class _PartLock:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file releases the flock
            self.handle = None


def _lock_part(path: Path, part: str) -> _PartLock:
    """An exclusive, non-blocking lock on one part's lock file."""
    handle = open(path, "a+")  # noqa: SIM115 - held for the writer's life
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on this platform
        return _PartLock(handle)
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise StoreError(
            f"another writer is capturing {part} into {str(path.parent.parent)!r}; "
            "each --shard i/N part needs its own process") from None
    return _PartLock(handle)


def _ensure_manifest(root: Path, manifest: Mapping[str, Any]) -> bool:
    """Create ``store.json`` atomically, or check that the existing one matches;
    True where this call created it."""
    target = root / MANIFEST
    made = False
    if not target.exists():
        # A name no other writer uses: a pid alone is shared by threads, and by
        # processes of other machines or containers on a shared filesystem.
        tmp = root / f"{TMP_PREFIX}{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex}"
        write_json(tmp, dict(manifest))
        try:
            os.link(tmp, target)  # fails if another writer created it first
            made = True
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    existing = read_json(target)
    if existing.get("format") != STORE_FORMAT:
        raise StoreError(f"{str(target)!r} is not an activation store manifest "
                         f"(format {existing.get('format')!r}, expected {STORE_FORMAT!r})")
    wanted = json.loads(json.dumps(dict(manifest)))
    _as_older_edits(existing, wanted)
    _as_older_storage_dtype(existing, wanted)
    compared = dict(existing, sampling=_without_greedy_seed(existing.get("sampling")))
    wanted["sampling"] = _without_greedy_seed(wanted.get("sampling"))
    differ = [key for key in IDENTITY_KEYS if compared.get(key) != wanted.get(key)]
    if differ:
        older = ("; it was written before undercurrent recorded the generation settings "
                 "(model dtype, capture_last_token, steering edits)"
                 if "generation" in differ and "generation" not in existing else "")
        raise StoreError(
            f"{str(root)!r} holds a capture with a different "
            f"{'; '.join(_difference(key, compared.get(key), wanted.get(key)) for key in differ)}"
            f"{older}; a "
            "store (every --shard part, every resume) needs the same model, model dtype, "
            "spec (its edits included), capture_last_token, reductions, storage dtype, "
            "sampling settings (and, for seeded sampling on the HF backend, batch size) "
            "and prompt list. Use another directory.")
    return made

