"""``ProbedModel.capture``: generate over a prompt list and write every record to a store.

The seam: capture drives the model's own ``generate(records=True)`` over chunks
of the prompt list (``batch_size`` prompts for Hugging Face, one ``generate()``
batch; a larger chunk of concurrent requests for vLLM) and hands each chunk's
outputs to the :class:`~undercurrent.store.writer.StoreWriter`, which writes
them before the next chunk starts. The records of one chunk are the only ones in
memory, so memory is flat in the number of prompts, and the stored values are by
construction those ``generate(records=True)`` returns.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from undercurrent.adapters.base import (
    Backend,
    SamplingParams,
    call_seed,
    check_batch_size,
    stop_strings,
)
from undercurrent.adapters.capabilities import Capabilities
from undercurrent.adapters.outputs import GenerationOutput
from undercurrent.adapters.prompts import check_prompts
from undercurrent.arguments import check_flag
from undercurrent.paths import user_path
from undercurrent.spec import edit_to_dict, extraction_point_to_dict
from undercurrent.spec.types import ExtractionPoint, TensorType
from undercurrent.store.format import (
    STORAGE_DTYPES,
    Reduction,
    parse_part,
    parse_reductions,
    part_name,
    part_range,
    prompts_digest,
)
from undercurrent.store.writer import StoreWriter, check_shard_prompts

VLLM_CHUNK = 256
"""Prompts per ``generate()`` call under vLLM (all concurrent in the engine)."""


class CapturingModel(Protocol):
    """What :func:`capture_activations` needs of a model:
    :class:`~undercurrent.api.ProbedModel` is one."""

    backend: Backend
    batch_size: int

    @property
    def points(self) -> tuple[ExtractionPoint, ...]:
        """The extraction points whose records are stored."""
        ...

    def generate(
        self, prompts: Sequence[str], *, request_ids: Sequence[str], records: bool,
        max_new_tokens: int, temperature: float, top_p: float, top_k: int | None,
        seed: int | None, stop: str | Sequence[str] | None, batch_size: int | None,
    ) -> list[GenerationOutput]:
        """One output per prompt, with its records."""
        ...


@dataclass(frozen=True)
class CaptureSummary:
    """What one ``capture()`` call wrote.

    ``requests``, ``vectors`` and ``bytes`` (vector bytes) count this call's
    writing only; ``skipped`` counts prompts of this part a previous run had
    already committed (``resume=True``).
    """

    path: Path
    requests: int
    vectors: int
    bytes: int
    skipped: int = 0
    seconds: float = 0.0


def request_id_for(prompt_index: int) -> str:
    """The request id a store gives prompt ``prompt_index`` (stable across runs and parts)."""
    return f"p{prompt_index:06d}"


def generation_identity(model: CapturingModel) -> dict[str, Any]:
    """What else makes a capture's vectors what they are: the dtype the model
    computes in, ``capture_last_token`` and the spec's steering edits (their
    names, a digest of them as written, and one of the vectors the model
    applies: a store would otherwise take steered and plain generations, or
    generations steered by two versions of one vector file, as parts of one
    capture)."""
    spec = getattr(model, "spec", None)
    edits = [edit_to_dict(edit) for edit in getattr(spec, "edits", ())]
    if not edits:
        return {"dtype": getattr(model.backend, "dtype", None),  # (a backend may not say)
                "capture_last_token": bool(getattr(model, "capture_last_token", False)),
                "edits": None}
    digest = hashlib.sha256(json.dumps(edits, sort_keys=True, default=str).encode())
    described = {"names": [edit["name"] for edit in edits], "sha256": digest.hexdigest()}
    resolved = getattr(model, "spec_edits", None)
    if resolved is not None:
        described["vectors_sha256"] = vectors_digest(resolved)
    return {"dtype": getattr(model.backend, "dtype", None),
            "capture_last_token": bool(getattr(model, "capture_last_token", False)),
            "edits": described}


def vectors_digest(resolved: Sequence[Any]) -> str:
    """A digest of what resolved edits apply: each vector's float64 values and,
    for an SAE feature's edit, the SAE's encoder (a clamp goes through it), so a
    vector file or SAE saved again at the same path reads as a different edit."""
    import numpy as np

    digest = hashlib.sha256()
    for edit in resolved:
        digest.update(np.ascontiguousarray(edit.vector, dtype=np.float64).tobytes())
        sae = edit.sae
        if sae is not None:  # (its arrays as loaded, hashed in place: no copy)
            digest.update(json.dumps(sae.config, sort_keys=True, default=str).encode())
            for array in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, sae.threshold):
                if array is not None:
                    array = np.ascontiguousarray(array)
                    digest.update(str(array.dtype).encode())
                    digest.update(array.data.cast("B"))
        digest.update(b"\x00")
    return digest.hexdigest()


def check_out_dir(out_dir: str | os.PathLike[str], argument: str = "out_dir") -> Path:
    """``out_dir`` as a ``Path``, ``~`` expanded; a ``ValueError`` naming ``argument``
    when it is empty (the store would be written into the working directory), a
    ``NotADirectoryError`` naming it and the file in the way when it, or a folder
    above it, is a file (a store is a directory; the system's own "[Errno 20] Not a
    directory" names neither)."""
    path = user_path(out_dir, argument, what="the store's directory")
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                where = ("is a file" if place == path
                         else f"is inside {str(place)!r}, which is a file")
                raise NotADirectoryError(
                    f"{argument} {str(path)!r} {where}: a store is a directory; give a "
                    "new directory or an existing store's")
            break
    return path


def capture_activations(
    model: CapturingModel,
    prompts: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    batch_size: int | None = None,
    storage_dtype: str | None = None,
    reduce: Mapping[str, Any] | None = None,
    shard: str | tuple[int, int] | None = None,
    shard_prompts: int = 256,
    resume: bool = True,
    progress: bool = True,
) -> CaptureSummary:
    """Implementation of :meth:`undercurrent.api.ProbedModel.capture` (see there)."""
    # Every argument is checked before the writer touches out_dir: a call refused
    # for a bad value leaves the directory as it found it, so the corrected call
    # is not refused as "a different capture".
    resume = check_flag("resume", resume)
    progress = check_flag("progress", progress)
    prompts = check_prompts(prompts)
    if not prompts:
        raise ValueError("capture needs at least one prompt; no prompts were given (the "
                         "prompt list is empty)")
    if not model.points:
        raise ValueError("capture needs a spec with at least one extraction point")
    out_dir = check_out_dir(out_dir)
    names = [point.name for point in model.points]
    settings = capture_settings(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=seed, stop=stop, batch_size=batch_size, storage_dtype=storage_dtype,
        reduce=reduce, shard=shard, shard_prompts=shard_prompts, point_names=names)
    check_point_reductions(model.points, settings.reductions, model.backend.capabilities())
    index, count = settings.part
    batch_size = settings.batch_size
    if batch_size is None:
        batch_size = VLLM_CHUNK if model.backend.name == "vllm" else model.batch_size
    # Seeded sampling on the HF backend draws each batch from one generator seeded
    # for the batch (vLLM seeds each prompt): the batches are then part of what is
    # stored. Every part and resume takes the batches generate() would, the prompts
    # [k * batch_size, (k + 1) * batch_size), and the batch size is recorded.
    grid = (batch_size if model.backend.name != "vllm" and seed is not None
            and settings.sampling["temperature"] > 0 else None)
    sampling = settings.sampling if grid is None else {**settings.sampling, "batch_size": grid}
    generation = generation_identity(model)
    identity = {
        "model": model.backend.model_name,
        "points": [extraction_point_to_dict(point) for point in model.points],
        "reductions": {name: r.as_dict() for name, r in settings.reductions.items()},
        # The dtype stored, not the argument: None and the model's own dtype are
        # one capture (a resume naming it was refused as a different one).
        "storage_dtype": settings.storage_dtype or generation["dtype"],
        "sampling": sampling,
        "prompts": {"count": len(prompts), "sha256": prompts_digest(prompts)},
        "generation": generation,
    }
    mine = part_range(index, count, len(prompts), grid or 1)
    check_context = getattr(model.backend, "check_context", None)
    if check_context is not None:  # (each chunk is a call of its own: all, before any)
        fed = SamplingParams(max_new_tokens=max_new_tokens,
                             capture_last_token=generation["capture_last_token"])
        check_context([prompts[k] for k in mine], fed, list(mine))
    started = time.perf_counter()
    writer = StoreWriter(out_dir, identity, part_name(index, count), resume=resume,
                         shard_prompts=settings.shard_prompts)
    todo = [k for k in mine if k not in writer.completed]
    bar = _progress(len(todo), len(mine) - len(todo), progress)
    try:
        for chunk in _chunks(todo, batch_size, grid):
            # Seeded as generate() seeds the batch starting at prompt chunk[0] of the
            # whole list (seed + chunk[0]; with a grid, its batch's first prompt; a
            # chunk without a grid is consecutive, so vLLM's seed + i is each prompt's
            # seed + index): the store holds what generate() returns.
            first = chunk[0] if grid is None else chunk[0] - chunk[0] % grid
            outputs = model.generate(
                [prompts[k] for k in chunk], request_ids=[request_id_for(k) for k in chunk],
                records=True, max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, top_k=top_k, stop=stop, batch_size=len(chunk),
                seed=None if seed is None else call_seed(seed, first))
            tokens = sum(len(output.token_ids) for output in outputs)
            vectors = writer.add(outputs, chunk)
            del outputs
            release_freed_memory()
            if bar is not None:
                bar.advance(len(chunk), tokens, vectors)
        writer.close()
    except BaseException:
        writer.abandon()
        raise
    finally:
        if bar is not None:
            bar.close()
    return CaptureSummary(path=out_dir, requests=writer.requests, vectors=writer.vectors,
                          bytes=writer.bytes, skipped=len(mine) - len(todo),
                          seconds=time.perf_counter() - started)


def check_point_reductions(points: Sequence[ExtractionPoint], reduce: Mapping[str, Any],
                           capabilities: Capabilities | None = None) -> dict[str, Reduction]:
    """The reductions ``reduce`` asks of the spec's ``points`` (see
    :func:`parse_reductions`), refusing what would store nothing: a mean of the
    generated tokens of a point on prompt tokens only; and, where the model's
    ``capabilities`` give its sizes, a ``project:K`` onto more dimensions than
    the point's vectors have (it would store more than the vectors themselves,
    and a huge K failed allocating the matrix, inside the writer)."""
    reductions = parse_reductions(reduce, [point.name for point in points])
    for point in points:
        reduction = reductions[point.name]
        if reduction.tokens == "mean_generated" and point.position.prompt_only:
            raise ValueError(
                f"reduce[{point.name!r}]='mean_generated' averages a request's generated "
                f"tokens, but point {point.name!r} (position {str(point.position)!r}) "
                "selects prompt tokens only: nothing would be stored; use 'last_token' "
                "or no reduction")
        features = None if capabilities is None else point_features(point, capabilities)
        if reduction.project is not None and features is not None and (
                reduction.project > features):
            raise ValueError(
                f"reduce[{point.name!r}]='project:{reduction.project}' asks for more "
                f"dimensions than point {point.name!r} captures ({features} features "
                f"of {point.tensor_type.value}); give K <= {features}")
    return reductions


def point_features(point: ExtractionPoint, capabilities: Capabilities) -> int | None:
    """How many values one captured vector of ``point`` holds (``kv``: keys and
    values, ``2 * num_kv_heads * head_dim``; the others: the hidden size), or None
    where the capabilities do not say."""
    if point.tensor_type is TensorType.KV:
        heads, size = capabilities.num_kv_heads, capabilities.head_dim
        return None if heads is None or size is None else 2 * heads * size
    return capabilities.hidden_size


def _chunks(todo: list[int], batch_size: int, grid: int | None) -> Iterator[list[int]]:
    """The batches of prompt indices ``todo``: runs of consecutive indices,
    ``batch_size`` at a time, or, on a ``grid``, those of each
    ``[k * grid, (k + 1) * grid)`` together.

    A batch never spans a gap (prompts a resume skips): vLLM seeds a call's i-th
    request ``seed + i``, so the call seeded ``seed + chunk[0]`` seeds prompt
    ``chunk[i]`` with ``seed + chunk[i]`` only where the chunk is consecutive."""
    if grid is None:
        for _, run in itertools.groupby(enumerate(todo), key=lambda pair: pair[1] - pair[0]):
            indices = [k for _, k in run]
            for start in range(0, len(indices), batch_size):
                yield indices[start:start + batch_size]
        return
    for _, cell in itertools.groupby(todo, key=lambda k: k // grid):
        yield list(cell)


@dataclass(frozen=True)
class CaptureSettings:
    """The checked arguments of one capture (all but the prompts).

    ``sampling`` is what ``store.json`` records of the sampling settings (plain
    JSON values); ``batch_size`` None means the backend's default; ``part`` is
    ``(i, N)`` of ``shard="i/N"``; ``reductions`` maps each point (or, when no
    point names were given, each point ``reduce`` names) to its reduction;
    ``shard_prompts`` is how many prompts each committed shard holds.
    """

    sampling: dict[str, Any]
    batch_size: int | None
    storage_dtype: str | None
    part: tuple[int, int]
    reductions: dict[str, Reduction]
    shard_prompts: int = 256


def capture_settings(
    *,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    batch_size: int | None = None,
    storage_dtype: str | None = None,
    reduce: Mapping[str, Any] | None = None,
    shard: str | tuple[int, int] | None = None,
    shard_prompts: int = 256,
    point_names: Sequence[str] | None = None,
) -> CaptureSettings:
    """Check the arguments of a capture without touching the disk or the model.

    A bad value is a ``ValueError`` (or ``TypeError`` for a wrong type) naming the
    argument and what it accepts. ``point_names`` None checks only the form of each
    reduction (the CLI does that before loading the spec's model).
    """
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=seed, stop=stop_strings(stop))
    # Plain values: store.json is JSON, and a numpy scalar must not fail its writing.
    sampling = {"max_new_tokens": int(params.max_new_tokens),
                "temperature": float(params.temperature), "top_p": float(params.top_p),
                "top_k": None if params.top_k is None else int(params.top_k),
                "seed": None if params.seed is None else int(params.seed),
                "stop": list(params.stop)}
    batch_size = check_batch_size(batch_size)
    if storage_dtype is not None:
        storage_dtype = str(storage_dtype).removeprefix("torch.")
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype={storage_dtype!r}: use one of "
                             f"{list(STORAGE_DTYPES)} or None (the model's dtype)")
    return CaptureSettings(sampling=sampling, batch_size=batch_size,
                           storage_dtype=storage_dtype, part=parse_part(shard),
                           reductions=parse_reductions(reduce, point_names),
                           shard_prompts=check_shard_prompts(shard_prompts))


def release_freed_memory() -> None:
    """Hand memory freed by the last batch back to the OS (glibc's ``malloc_trim``).

    Each batch allocates and frees many mid-sized tensors and record objects;
    glibc keeps the freed pages in its arenas, where fragmentation lets RSS creep
    up batch after batch although nothing is alive. Trimming after each batch
    keeps RSS flat. A no-op where glibc is not the allocator.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_TRIM: list[Any] = []


def _malloc_trim() -> Any:
    if not _TRIM:
        function = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                function = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                function = None
        _TRIM.append(function)
    return _TRIM[0]


class _Progress:
    """A tqdm bar (terminal or notebook) counting prompts, with tokens/s and vectors/s."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.started = time.perf_counter()
        self.tokens = 0
        self.vectors = 0

    def advance(self, prompts: int, tokens: int, vectors: int) -> None:
        self.tokens += tokens
        self.vectors += vectors
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s, "
                                 f"{self.vectors / elapsed:,.0f} vectors/s", refresh=False)
        self.bar.update(prompts)

    def close(self) -> None:
        self.bar.close()


def _progress(total: int, done: int, enabled: bool) -> _Progress | None:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="prompt", desc="capture", dynamic_ncols=True)
    if done:
        bar.set_description(f"capture (resumed: {done} done)")
    return _Progress(bar)
