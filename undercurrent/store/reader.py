"""Read an activation store: the index, memory-mapped vectors, outputs and results.

>>> store = open_activations("acts/")                       # doctest: +SKIP
>>> rows = store.index.query("layer == 2 and is_generated")  # doctest: +SKIP
>>> X = store.vectors(rows)                                  # doctest: +SKIP
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from undercurrent.analysis._inputs import (
    is_default_index,
    missing_labels,
    reads_by_position,
    request_groups,
    series_by_row,
)
from undercurrent.analysis.frames import ACTIVATIONS_KEY, RECORD_COLUMNS, Activations
from undercurrent.paths import user_path
from undercurrent.store.format import (
    MANIFEST,
    OUTPUT_SCHEMA,
    RESULT_SCHEMA,
    STORE_FORMAT,
    Reduction,
    StoreError,
    bfloat16_bits_to_float32,
    committed_shards,
    disk_dtype,
    empty_frame,
    read_json,
    read_shard_meta,
    verdict_from_json,
)
from undercurrent.store.index_frame import index_filter, read_index, stored_values

POSITIONS = ("all", "prompt", "generated", "last", "last_prompt")
"""Row filters of :meth:`ActivationStore.select`: every row, prompt or generated tokens
only, each request's last captured token, or its last captured prompt token (per
point and layer)."""


def layer_indices(layers: Any, argument: str = "layer") -> list[int]:
    """``layers`` (one layer index, or an iterable of them) as a list of plain ints.

    numpy integers count as layer indices; a bool does not (``True`` is not layer
    1), nor does a string: either is a ``TypeError`` naming ``argument``.
    """
    if _is_layer_index(layers):
        return [int(layers)]
    if isinstance(layers, (str, bytes, bool)) or not isinstance(layers, Iterable):
        raise TypeError(f"{argument} must be a layer index (an integer, not a bool) or a "
                        f"list of them, got {type(layers).__name__} ({layers!r:.40})")
    found = list(layers)
    for position, item in enumerate(found):
        if not _is_layer_index(item):
            raise TypeError(f"{argument}[{position}] is {type(item).__name__} ({item!r:.40}); "
                            "a layer index is an integer (not a bool)")
    return [int(item) for item in found]


def _refuse_missing(labels: Any, keys: Any, column: str) -> None:
    """Raise naming the ``keys`` (request ids, prompt indices or rows) whose label
    is missing (None or NaN), checked before numpy turns a NaN among strings into
    the string ``"nan"``."""
    missing = missing_labels(labels)
    if missing.any():
        named = sorted({str(key) for key, gone in zip(keys, missing, strict=True) if gone})
        raise ValueError(f"no label (None or NaN) for {column} value(s) {named[:5]}"
                         + (" ..." if len(named) > 5 else "")
                         + "; label them, or select rows without them first")


def _is_layer_index(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def open_activations(path: str | os.PathLike[str]) -> ActivationStore:
    """Open the store at ``path`` (every part written into it, committed shards only)."""
    return ActivationStore(path)


class ActivationStore:
    """A captured activation dataset on disk.

    ``index`` is a pandas frame with one row per vector (``INDEX_COLUMNS``);
    :meth:`vectors` gives the vectors of any subset of its rows, memory-mapped
    from the shard files (nothing else is read); ``outputs`` has one row per
    prompt; ``results`` is the results frame (``RESULT_COLUMNS`` plus
    ``prompt_index``). Join them on ``prompt_index`` (or ``request_id`` /
    ``request``). :meth:`select` narrows the store to a point, layers or
    positions; :meth:`records_frame` gives a frame in ``records_frame`` form for
    the notebook helpers.
    """

    def __init__(self, path: str | os.PathLike[str], *, _index: Any = None,
                 _parent: ActivationStore | None = None) -> None:
        self.path = user_path(path, "open_activations: path", what="a store's directory")
        self.manifest: dict[str, Any]
        self._shards: dict[str, dict[str, Any]]
        self._maps: dict[tuple[str, str], Any]
        self._outputs: Any
        self._results: Any
        self._view = _parent is not None
        if _parent is not None:
            self.manifest = _parent.manifest
            self._shards = _parent._shards
            self._maps = _parent._maps
            self._outputs = _parent._outputs
            self._results = _parent._results
            self._index = _index
            return
        if not (self.path / MANIFEST).is_file():
            raise StoreError(f"{str(self.path)!r} is not an activation store (no {MANIFEST}); "
                             "write one with ProbedModel.capture(prompts, out_dir)")
        self.manifest = read_json(self.path / MANIFEST)
        if self.manifest.get("format") != STORE_FORMAT:
            raise StoreError(f"{str(self.path / MANIFEST)!r} has format "
                             f"{self.manifest.get('format')!r}, expected {STORE_FORMAT!r}")
        self._shards = {shard.name: read_shard_meta(shard)
                        for shard in committed_shards(self.path)}
        _refuse_shared_prompts(self.path, self._shards)
        self._maps = {}
        self._outputs = None
        self._results = None
        self._index = None

    # -- frames ------------------------------------------------------------------------
    @property
    def index(self) -> Any:
        """One row per vector; see ``undercurrent.store.INDEX_COLUMNS``.

        ``request_id``, ``extraction_point_name``, ``tensor_type`` and ``shard``
        are pandas' Arrow-backed ``str`` and ``edits`` tuples of names shared
        between rows, so the index of a large store holds no Python object per
        row; :meth:`records_frame` gives them as the live frames hold them
        (``object``)."""
        if self._index is None:
            self._index = read_index(self._index_files())
        return self._index

    def _index_files(self) -> list[Path]:
        return [self.path / "shards" / shard / "index.parquet" for shard in self._shards]

    @property
    def outputs(self) -> Any:
        """One row per prompt (``OUTPUT_COLUMNS``), ordered by ``prompt_index``."""
        if self._outputs is None:
            frame = self._concat("outputs.parquet", OUTPUT_SCHEMA)
            # (nullable integers: NA for the requests that ran on, not float NaN)
            frame = frame.astype({"abort_layer": "Int64", "abort_token_index": "Int64"})
            self._outputs = frame.sort_values("prompt_index", ignore_index=True)
        return self._outputs

    @property
    def results(self) -> Any:
        """The probes' results frame, one row per (prompt, point), with ``prompt_index``;
        ``verdict`` is decoded from the JSON it was stored as."""
        import pandas as pd

        if self._results is None:
            def decoded(frame: Any, meta: dict[str, Any]) -> Any:
                # (a shard written before verdicts tagged their keys: read as the
                # tags would have, so every row of a mixed store reads alike)
                written_as = meta.get("verdict_keys")
                try:
                    verdicts = [verdict_from_json(v, written_as=written_as)
                                for v in frame["verdict"]]
                except StoreError as error:
                    raise StoreError(f"shard {meta.get('shard')!r}: {error}") from None
                frame["verdict"] = pd.Series(verdicts, index=frame.index, dtype=object)
                return frame

            self._results = self._concat("results.parquet", RESULT_SCHEMA, decoded)
        return self._results

    def _concat(self, name: str, schema: Sequence[tuple[str, str]],
                each: Callable[[Any, dict[str, Any]], Any] | None = None) -> Any:
        """The shards' ``name`` frames, one after another (``each``: applied to each
        shard's frame with its meta first)."""
        import pandas as pd

        # (every shard has its index and outputs, checked at open; results.parquet
        # is missing from shards of early writers that had no results)
        frames = []
        for shard, meta in self._shards.items():
            path = self.path / "shards" / shard / name
            if path.exists():
                frame = pd.read_parquet(path)
                frames.append(frame if each is None else each(frame, meta))
        if not frames:  # (no committed shard yet: no rows, the same columns)
            return _object_strings(empty_frame(schema))
        return _object_strings(pd.concat(frames, ignore_index=True))

    # -- vectors -----------------------------------------------------------------------
    def vectors(self, rows: Any = None, *, dtype: Any = None) -> Any:
        """The vectors of ``rows``, in their order, as an ndarray ``(len(rows), *shape)``.

        ``rows`` is a frame whose rows come from :attr:`index` (any filter, sort or
        join of it that keeps the ``shard``, ``extraction_point_name`` and ``row``
        columns), a boolean mask or positions over :attr:`index`, or None for every
        row (of a store narrowed by :meth:`select`). Only the asked rows are read:
        a selection that is one contiguous block of one shard file comes back as a
        read-only ``numpy.memmap`` view (no copy); anything else is gathered block by
        block. bfloat16 vectors are widened to float32; ``dtype`` converts.
        """
        import numpy as np

        frame = self._rows_frame(rows, "vectors()")
        if frame.empty:
            raise ValueError("vectors(): no rows selected")
        # Positions of the rows of each (shard, point) file, grouped in C by pandas.
        groups = {(str(shard), str(point)): positions for (shard, point), positions in
                  frame.groupby(["shard", "extraction_point_name"], observed=True,
                                sort=False).indices.items()}
        shapes = {tuple(self._point_meta(*key)["shape"]) for key in groups}
        if len(shapes) > 1:
            raise ValueError(f"vectors(): the rows hold vectors of different shapes "
                             f"{sorted(shapes)}; select one point (and tensor type) first")
        (shape,) = shapes
        stored = {self._point_meta(*key)["dtype"] for key in groups}
        wanted = np.dtype("float32") if "bfloat16" in stored else np.result_type(
            *[np.dtype(s) for s in stored])
        row_numbers = frame["row"].to_numpy(dtype=np.int64)
        if len(groups) == 1 and dtype is None:
            key = next(iter(groups))
            first, last = int(row_numbers[0]), int(row_numbers[-1])
            if (last - first + 1 == len(row_numbers)
                    and (len(row_numbers) == 1 or (np.diff(row_numbers) == 1).all())):
                block = self._memmap(key)[first:last + 1]
                return self._decode(block, self._point_meta(*key)["dtype"])
        out = np.empty((len(frame), *shape), dtype=np.dtype(dtype) if dtype else wanted)
        for key, positions in groups.items():
            where = np.asarray(positions, dtype=np.int64)
            self._gather(key, row_numbers[where], where, out)
        return out

    def _gather(self, key: tuple[str, str], rows: Any, where: Any, out: Any) -> None:
        """Copy ``rows`` of one file into ``out[where]``, one slice per contiguous run."""
        import numpy as np

        data = self._memmap(key)
        stored = self._point_meta(*key)["dtype"]
        order = np.argsort(rows, kind="stable")
        rows, where = rows[order], where[order]
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for run_rows, run_where in zip(np.split(rows, breaks), np.split(where, breaks),
                                       strict=True):
            block = data[run_rows[0]:run_rows[-1] + 1]
            out[run_where] = self._decode(block, stored)

    @staticmethod
    def _decode(block: Any, stored: str) -> Any:
        return bfloat16_bits_to_float32(block) if stored == "bfloat16" else block

    def _point_meta(self, shard: str, point: str) -> Mapping[str, Any]:
        try:
            meta: Mapping[str, Any] = self._shards[shard]["points"][point]
            return meta
        except KeyError:
            raise KeyError(f"no vectors of point {point!r} in shard {shard!r} of "
                           f"{str(self.path)!r}") from None

    def _memmap(self, key: tuple[str, str]) -> Any:
        import numpy as np

        data = self._maps.get(key)
        if data is None:
            meta = self._point_meta(*key)  # (its file's size was checked at open)
            data = np.memmap(self.path / "shards" / key[0] / meta["file"],
                             dtype=disk_dtype(meta["dtype"]), mode="r",
                             shape=(meta["rows"], *meta["shape"]))
            self._maps[key] = data
        return data

    def _rows_frame(self, rows: Any, caller: str) -> Any:
        """The rows of :attr:`index` that ``rows`` names: a frame of its rows as it
        is, a boolean mask of its length, or positions in it; anything else is
        refused naming ``caller`` (pandas said "positional indexers are
        out-of-bounds" or "Item wrong length", a scalar failed on a missing
        'shard' column, and a float position was read as its integer part)."""
        import numpy as np
        import pandas as pd

        if rows is None:
            return self.index
        if isinstance(rows, pd.DataFrame):
            missing = [c for c in ("shard", "extraction_point_name", "row") if c not in rows]
            if missing:
                raise ValueError(f"{caller}: the frame lacks index columns {missing}; pass "
                                 "rows of store.index (filtered, sorted or joined)")
            return rows
        accepted = ("pass rows of store.index (a frame), a boolean mask over it or a list "
                    "of row positions")
        if isinstance(rows, str | bytes | Mapping) or np.ndim(rows) != 1:
            hint = f"; for one row pass [{rows!r}]" if np.ndim(rows) == 0 and isinstance(
                rows, numbers.Integral) and not isinstance(rows, bool) else ""
            raise TypeError(f"{caller}: rows is {type(rows).__name__} ({rows!r:.40}); "
                            f"{accepted}{hint}")
        selector = np.asarray(rows)
        count = len(self.index)
        if selector.size == 0:
            return self.index.iloc[:0]
        if selector.dtype == bool:
            if len(selector) != count:
                raise ValueError(f"{caller}: a boolean mask of {len(selector)} values for "
                                 f"{count} rows; a mask has one value per row of store.index")
            return self.index[selector]
        if not np.issubdtype(selector.dtype, np.integer):
            raise TypeError(f"{caller}: rows holds {selector.dtype} values "
                            f"({selector[:3].tolist()!r:.60}); row positions are integers "
                            f"({accepted})")
        outside = selector[(selector < -count) | (selector >= count)]
        if outside.size:
            raise ValueError(f"{caller}: row position {int(outside[0])} is out of range; "
                             f"the store{' view' if self._view else ''} has {count} rows "
                             f"(positions 0 to {count - 1})")
        return self.index.iloc[selector]

    # -- narrowing ---------------------------------------------------------------------
    def select(self, *, point: str | None = None, layer: int | Sequence[int] | None = None,
               tensor_type: str | None = None, positions: str = "all",
               rows: Any = None) -> ActivationStore:
        """A view of this store restricted to some rows (the files are shared).

        ``positions`` is one of ``POSITIONS``; ``"last"``/``"last_prompt"`` keep each
        request's last captured (prompt) token per point and layer.
        """
        self._check_held(point, layer, tensor_type)
        keep = index_filter(point, None if layer is None else layer_indices(layer),
                            tensor_type)
        if rows is None and self._index is None and keep is not None:
            # (only the asked rows reach pandas: the whole index is never built)
            index = read_index(self._index_files(), keep)
        else:
            index = self._rows_frame(rows, "select(rows=)")
        if point is not None:
            index = index[index["extraction_point_name"] == point]
        if layer is not None:
            index = index[index["layer"].isin(layer_indices(layer))]
        if tensor_type is not None:
            index = index[index["tensor_type"] == tensor_type]
        index = _positions(index, positions)
        return ActivationStore(self.path, _index=index, _parent=self)

    def _check_held(self, point: str | None, layer: int | Sequence[int] | None,
                    tensor_type: str | None) -> None:
        """Refuse a point, layer or tensor type the capture has none of (a typo
        would otherwise select nothing, silently), naming what it holds."""
        if point is not None:
            self._check_point(point, "select")
        points = [p for p in self.manifest["points"] if point is None or p["name"] == point]
        where = "" if point is None else f" of point {point!r}"
        types = sorted({p["tensor_type"] for p in points})
        if tensor_type is not None and tensor_type not in types:
            raise ValueError(f"select: no {tensor_type!r} rows{where}: the store holds "
                             + ", ".join(map(repr, types)))
        if layer is None:
            return
        held = sorted({int(found) for p in points for found in (
            p["layers"] if isinstance(p["layers"], list) else [p["layers"]])})
        wanted = layer_indices(layer)
        if not wanted:
            raise ValueError(f"select: layer={layer!r} names no layer, which would select "
                             f"nothing; give a layer or a list of them (the store{where} "
                             f"holds layers {held}), or leave layer out for all")
        missing = [found for found in wanted if found not in held]
        if missing:
            raise ValueError(f"select: no layer {', '.join(map(str, missing))} in the "
                             f"store{where}: it holds layers {held}")

    def _check_point(self, point: str, caller: str) -> None:
        """Refuse a point name the capture has none of, naming what it holds."""
        names = [p["name"] for p in self.manifest["points"]]
        if point not in names:
            raise ValueError(f"{caller}: this store has no point {point!r}; it holds "
                             + ", ".join(map(repr, names)))

    def records_frame(self, rows: Any = None, *, tensors: bool = True) -> Any:
        """The rows in ``records_frame`` form (index columns ``request``, ``point``,
        ... ``row``, plus ``prompt_index``) with their vectors as the frame's
        activation matrices, read once per point (a point's vectors that are one
        block of its shard file stay a memory-mapped view); ``activation_matrix``,
        ``select_rows``, ``label_rows`` and ``fit_linear_probe`` take it as they take
        a records frame (a ``project:K`` point's reduction rides on the activations,
        ``Activations.projected``, so a probe fitted on it folds the projection as
        one fitted on the store). ``tensors=False`` reads no vectors."""
        import numpy as np
        import pandas as pd

        frame = self._rows_frame(rows, "records_frame()")
        out = frame.rename(columns={"request_id": "request", "extraction_point_name": "point"})
        for column in ("request", "point", "tensor_type"):  # (the index's str columns)
            if out[column].dtype != object:
                out[column] = out[column].astype(object)
        out = out.drop(columns=["row"]).reset_index(drop=True)
        out["token_text"] = None
        out["timestamp"] = float("nan")
        # (the captured tensors' dtype, as in a live frame: the model's, which a
        # store records; a store written before it did says what it stores)
        computed = (self.manifest.get("generation") or {}).get("dtype")
        out["dtype"] = pd.Series([computed] * len(out) if computed else [
            self._point_meta(s, p)["dtype"] for s, p in
            zip(frame["shard"].astype(str), frame["extraction_point_name"], strict=True)],
            dtype=object)
        out["shape"] = [tuple(self._point_meta(s, p)["shape"]) for s, p in
                        zip(frame["shard"].astype(str), frame["extraction_point_name"],
                            strict=True)]
        # (a list per row as parquet reads it back; a store written before the
        # column was stored says none)
        stored = frame["edits"] if "edits" in frame else [None] * len(frame)
        out["edits"] = [tuple(names) if isinstance(names, list | tuple | np.ndarray) else ()
                        for names in stored]
        positions = np.arange(len(frame), dtype=np.int64)
        blocks: dict[int, list[Any]] = {}
        if tensors and len(frame):
            points = frame["extraction_point_name"].to_numpy()
            for name in dict.fromkeys(points.tolist()):  # one shape per point
                where = (points == name).nonzero()[0]
                vectors = self.vectors(frame.iloc[where])
                flat = vectors.reshape(len(where), -1)
                parts = blocks.setdefault(flat.shape[1], [])
                positions[where] = sum(len(part) for part in parts) + np.arange(len(where))
                parts.append(flat)
        out["row"] = positions
        # (a project:K point's rows are marked so a fit on the frame folds the
        # projection as a fit on the store does)
        marks = {name: self.projected(name) for name in
                 dict.fromkeys(out["point"].tolist())} if tensors else {}
        activations = Activations({
            size: parts[0] if len(parts) == 1 else np.concatenate(parts)
            for size, parts in blocks.items()},
            projected={name: mark for name, mark in marks.items() if mark is not None})
        out["activations_id"] = activations.id
        out = out[list(RECORD_COLUMNS) + ["prompt_index"]]
        if tensors:
            out.attrs[ACTIVATIONS_KEY] = activations
        return out

    # -- analysis ----------------------------------------------------------------------
    def probe_design(self, y: Any, *, point: str | None = None, layer: int | None = None,
                     tensor_type: str | None = None, group_by: Any = "auto",
                     caller: str = "fit_linear_probe"
                     ) -> tuple[Any, Any, Any, int, str, str]:
        """``(X, labels, groups, layer, tensor_type, point)`` for ``fit_linear_probe``
        (or ``fit_steering_vector``; ``caller`` names it in messages).

        Reads only the vectors of one point and layer (float32). ``y`` maps request
        ids or prompt indices to labels, or gives one label per prompt (indexed by
        ``prompt_index``) or one per selected row; a pandas Series is read by its
        index (the rows' own labels, even of more rows than are selected; else
        prompt indices or request ids; see ``_series_labels``). ``group_by="auto"``
        groups by request id, as a fit on a records frame does (see
        ``request_groups``): where some request has several rows the held-out split
        keeps each generation on one side; with one row per request
        (``positions="last"``) it splits rows, so this view and its
        ``records_frame()`` hold out the same rows.
        """
        import numpy as np

        index = self.select(point=point, layer=layer, tensor_type=tensor_type).index
        if index.empty:
            raise ValueError(f"{caller}: the store has no rows for point={point!r}, "
                             f"layer={layer!r}, tensor_type={tensor_type!r}; it has points "
                             f"{self.points} and layers {self.layers}")
        for column, argument in (("extraction_point_name", "point"), ("layer", "layer"),
                                 ("tensor_type", "tensor_type")):
            values = sorted(index[column].unique().tolist())
            if len(values) > 1:
                raise ValueError(f"{caller}: the store mixes {argument}s {values}; a "
                                 f"fit reads one, so pass {argument}=... (e.g. "
                                 f"{argument}={values[0]!r})")
        labels = self.row_labels(y, index)
        X = np.asarray(self.vectors(index), dtype=np.float32).reshape(len(index), -1)
        # A list, not an array: fit_linear_probe compares group_by with None/"auto".
        # ("auto" is the frames' rule, so a fit on this view and one on its
        # records_frame() hold out the same rows)
        if isinstance(group_by, str) and group_by == "auto":
            requests = request_groups(index["request_id"].to_numpy())
            groups = None if requests is None else requests.tolist()
        elif isinstance(group_by, str):
            groups = index[group_by].tolist()
        else:
            groups = None if group_by is None else list(group_by)
        return (X, labels, groups, int(index["layer"].iloc[0]),
                str(index["tensor_type"].iloc[0]), str(index["extraction_point_name"].iloc[0]))

    def projection(self, point: str) -> Any:
        """The ``(captured features, K)`` float32 matrix a ``project:K`` reduction
        multiplied ``point``'s vectors by (stored vector = captured vector @ matrix),
        or None when the point is not projected. A store written before shards
        recorded the captured shape cannot rebuild it: a ``ValueError`` says so."""
        import math

        self._check_point(point, "projection")  # (None would read as "not projected")
        reduction = self.reductions.get(point)
        if reduction is None or reduction.project is None:
            return None
        shapes = {tuple(meta["points"][point]["captured_shape"])
                  for meta in self._shards.values()
                  if "captured_shape" in meta["points"].get(point, {})}
        if len(shapes) != 1:
            raise ValueError(
                f"point {point!r} of {str(self.path)!r} is stored projected "
                f"({reduction.project} random features), but the store does not record "
                "the captured vectors' size (written by an earlier version), so the "
                "projection cannot be rebuilt; capture again to fold it")
        (shape,) = shapes
        return reduction.projection(math.prod(shape))

    def projected(self, point: str) -> tuple[str, Any] | None:
        """``(reduction, matrix)`` for a point stored with a ``project:K`` reduction
        (``("project:K", store.projection(point))``, the matrix None when this store
        cannot rebuild it: written by an earlier version), else None."""
        self._check_point(point, "projected")
        reduction = self.reductions.get(point)
        if reduction is None or reduction.project is None:
            return None
        try:
            matrix = self.projection(point)
        except ValueError:  # (a store of an earlier version: no captured size)
            matrix = None
        return f"project:{reduction.project}", matrix

    def row_labels(self, y: Any, index: Any = None) -> Any:
        """One label per row of ``index`` (default: this store's) from per-request,
        per-prompt or per-row labels (see :meth:`probe_design`)."""
        import numpy as np

        index = self.index if index is None else index
        if y is None:
            raise ValueError("give labels: {request_id or prompt_index: label}, one per "
                             "prompt, or one per row")
        if isinstance(y, str):
            if y not in self.outputs.columns:
                raise ValueError(f"no outputs column {y!r} to take labels from")
            y = dict(zip(self.outputs["prompt_index"], self.outputs[y], strict=True))
        if isinstance(y, Mapping):
            keys = list(y)
            column = "request_id" if keys and isinstance(keys[0], str) else "prompt_index"
            values = index[column].tolist()
            missing = sorted({str(v) for v in values if v not in y})
            if missing:
                raise KeyError(f"no label for {column} value(s) {missing[:5]}"
                               + (" ..." if len(missing) > 5 else ""))
            given = [y[v] for v in values]
            _refuse_missing(given, values, column)
            return np.asarray(given)
        if hasattr(y, "reindex") and hasattr(y.index, "equals"):  # a pandas Series
            stored = sum(int(shard["vectors"]) for shard in self._shards.values())
            read = _series_labels(y, index, self.manifest["prompts"]["count"], stored)
            if read is not None:
                return read
        if not hasattr(y, "__len__"):
            y = list(y)
        n_prompts = self.manifest["prompts"]["count"]
        prompt_index = index["prompt_index"].to_numpy()
        if len(y) == len(index) == n_prompts and not (
                prompt_index == np.arange(n_prompts)).all():
            # (one per row and one per prompt read the same only where the rows are
            # the prompts, in order)
            raise ValueError(
                f"{len(y)} labels for {n_prompts} prompts and {len(index)} rows, whose "
                "rows are not one per prompt in order: give one label per prompt as "
                "{prompt_index: label} (dict(enumerate(labels))) or {request_id: label}, "
                "or one per row as a pandas Series indexed like the rows "
                "(pd.Series(labels, index=index.index))")
        if len(y) == len(index):
            _refuse_missing(y, range(len(y)), "row")
            return np.asarray(y)
        if len(y) == n_prompts:
            _refuse_missing(y, range(n_prompts), "prompt_index")
            return np.asarray(y)[prompt_index]
        raise ValueError(f"{len(y)} labels: give one per prompt ({n_prompts}), one per "
                         f"row ({len(index)}), or a {{request_id: label}} mapping")

    # -- summary -----------------------------------------------------------------------
    # (a view from select() reports its own rows: points, layers, prompts, bytes)
    @property
    def points(self) -> list[str]:
        """Point names in the spec's order (a view: those it holds rows of)."""
        names = [point["name"] for point in self.manifest["points"]]
        return self.held_points if self._view else names

    @property
    def held_points(self) -> list[str]:
        """The points this store (or view) holds rows of, in the spec's order (a
        store whose index is not loaded reads that one column to answer)."""
        if self._index is None:
            held = set(stored_values(self._index_files(), "extraction_point_name"))
        else:
            held = set(self._index["extraction_point_name"].unique().tolist())
        return [point["name"] for point in self.manifest["points"]
                if point["name"] in held]

    @property
    def layers(self) -> list[int]:
        return sorted(int(v) for v in self.index["layer"].unique())

    @property
    def reductions(self) -> dict[str, Reduction]:
        return {name: Reduction.parse(value)
                for name, value in self.manifest["reductions"].items()}

    @property
    def nbytes(self) -> int:
        """Vector bytes on disk of the whole store (a view: of its rows)."""
        import numpy as np

        def size(meta: Mapping[str, Any]) -> int:
            itemsize: int = disk_dtype(meta["dtype"]).itemsize
            return itemsize * int(np.prod(meta["shape"], dtype=np.int64))

        if not self._view:
            return sum(meta["rows"] * size(meta) for shard in self._shards.values()
                       for meta in shard["points"].values())
        counts = self.index.groupby([self.index["shard"].astype(str),
                                     "extraction_point_name"], observed=True).size()
        return sum(int(n) * size(self._point_meta(shard, point))
                   for (shard, point), n in counts.items())

    @property
    def n_prompts(self) -> int:
        """Prompts committed in this store, all parts (a view: those it holds rows
        of)."""
        if self._view:
            return int(self.index["prompt_index"].nunique())
        return sum(len(shard["prompt_indices"]) for shard in self._shards.values())

    def __len__(self) -> int:
        if self._index is None:
            return sum(int(shard["vectors"]) for shard in self._shards.values())
        return len(self._index)

    def __repr__(self) -> str:
        kind = "ActivationStore view" if self._view else "ActivationStore"
        return (f"{kind}({str(self.path)!r}, model={self.manifest['model']!r}, "
                f"prompts={self.n_prompts}/{self.manifest['prompts']['count']}, "
                f"vectors={len(self)}, points={self.points}, shards={len(self._shards)}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


def _series_labels(y: Any, index: Any, n_prompts: int, n_stored: int) -> Any:
    """The labels a pandas Series ``y`` gives the rows of ``index`` (of a store of
    ``n_prompts`` prompts and ``n_stored`` rows, labelled ``0 .. n_stored - 1``),
    read by its index, or None for a Series with a default index (0, 1, ...) that
    is not the rows' own and is as long as a list of labels may be (one per
    selected row or per prompt): that one is read by position, as a list, first
    (see ``reads_by_position``).

    A Series whose index holds each selected row's label once is read per row, by
    label (``y.reindex(index.index)``), as a records frame reads it: also one built
    over more rows than are selected (every layer of a point, fit one at a time).
    Any other is a mapping by its index: prompt indices or request ids (one label
    per prompt). An index that is neither is refused, and so is one that is both,
    not exactly the selected rows', whose two readings differ, where it may well be
    per prompt: it holds only prompt indices, or it counts 0, 1, ... (a dataset of
    more prompts than were captured) without being every row of the store. The
    rows' labels can be prompt indices too, and guessing would be silent."""
    import numpy as np
    import pandas as pd

    labels = y.index
    if reads_by_position(y, index.index, (len(index), n_prompts)):
        return None
    by_row = series_by_row(y, index.index)
    if by_row is not None:
        _refuse_missing(by_row, range(len(by_row)), "row")
        prompts = index["prompt_index"]
        # (0, 1, ... k-1, not every row of the store: a list's positions or a
        # dataset's rows, read per prompt as well as per row)
        counted = labels.isin(range(len(labels))).all() and len(labels) != n_stored
        if (len(y) != len(index) and pd.api.types.is_integer_dtype(labels)
                and (counted or labels.isin(range(n_prompts)).all())
                and prompts.isin(labels).all()
                and by_row.tolist() != y.reindex(prompts).tolist()):
            raise ValueError(
                f"the labels Series' index ({labels[:3].tolist()}"
                f"{' ...' if len(labels) > 3 else ''}; {len(labels)} values) holds both "
                f"the labels of the {len(index)} selected rows and their prompt indices "
                f"(this store has {n_prompts} prompts and {n_stored} rows), and the two "
                "readings give "
                "different labels: give one label per prompt as {prompt_index: label} "
                "(series.to_dict()), or one per selected row as a list or array "
                "(series.reindex(view.index.index).to_numpy(), view being the rows "
                "fitted: store.select(point=..., layer=...))")
        return np.asarray(by_row.tolist())
    if is_default_index(labels):
        return None
    if not labels.is_unique:
        repeated = labels[labels.duplicated()].unique().tolist()
        raise ValueError(f"the labels Series repeats index value(s) {repeated[:5]}: its "
                         "index says which prompt_index or request_id each label is for")
    if pd.api.types.is_integer_dtype(labels):
        column = "prompt_index"
    elif pd.api.types.is_string_dtype(labels) or labels.dtype == object:
        column = "request_id"
    else:
        column = ""
    keys = index[column] if column else None
    if keys is None or not keys.isin(labels).all():
        missing = [] if keys is None else sorted(set(keys[~keys.isin(labels)].tolist()))
        raise ValueError(
            f"the labels Series' index ({labels[:3].tolist()}"
            f"{' ...' if len(labels) > 3 else ''}; {len(labels)} values) is neither the "
            f"rows' own ({len(index)} rows) nor prompt indices or request ids covering the "
            "selected rows"
            + (f" (no label for {column} value(s) {missing[:5]}"
               f"{' ...' if len(missing) > 5 else ''})" if missing else "")
            + "; index it by prompt_index or request_id, or pass a list to read the "
            "labels by position")
    given = y.reindex(keys).tolist()
    _refuse_missing(given, keys, column)
    return np.asarray(given)


def _refuse_shared_prompts(path: Path, shards: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a store in which two shards hold one prompt (two writers of different
    ``--shard`` splits at once): its frames would hold the prompt twice."""
    owner: dict[int, str] = {}
    shared: dict[tuple[str, str], list[int]] = {}
    for name, meta in shards.items():
        for prompt in meta["prompt_indices"]:
            first = owner.setdefault(prompt, name)
            if first != name:
                shared.setdefault((first, name), []).append(prompt)
    if shared:
        (first, second), prompts = next(iter(shared.items()))
        raise StoreError(
            f"{str(path)!r}: shards {first!r} and {second!r} both hold prompt(s) "
            f"{sorted(prompts)[:5]}{' ...' if len(prompts) > 5 else ''}"
            + (f" (and {len(shared) - 1} more pair(s) of shards)" if len(shared) > 1 else "")
            + ": two writers with different --shard splits captured them twice; remove "
            "one of the two shard directories (a resume captures what is then missing)")


def _positions(index: Any, positions: str) -> Any:
    if positions not in POSITIONS:
        raise ValueError(f"positions={positions!r} is not one of {list(POSITIONS)}")
    if positions == "all":
        return index
    if positions == "prompt":
        return index[~index["is_generated"]]
    if positions == "generated":
        return index[index["is_generated"]]
    if positions == "last_prompt":
        index = index[~index["is_generated"]]
    keys = ["request_id", "extraction_point_name", "layer"]
    last = index.groupby(keys, observed=True, sort=False)["token_index"].transform("max")
    return index[index["token_index"] == last]


def _object_strings(frame: Any) -> Any:
    """``frame`` with its string columns as the live frames hold them: ``object``,
    None where a value is missing. pandas 3 reads parquet strings as its ``str``
    dtype (NaN for missing), so a store's frame would not equal the live frame of
    the same outputs (``records_frame``, ``results_frame``)."""
    import pandas as pd

    for column in frame.columns:
        values = frame[column]
        if isinstance(values.dtype, pd.StringDtype):
            strings = values.astype(object)
            strings[values.isna().to_numpy()] = None
            frame[column] = strings
    return frame

