"""What crosses from the vLLM worker to the driver: one message per engine step.

A :class:`StepBatch` carries every captured row of one step: the rows of all
(layer, tensor type) groups are gathered into a few tensors (one per row shape,
one device-to-host copy each), each group says where its rows sit in them, and
two contiguous integer arrays say what the rows are: one row per (request,
token, point) match (:data:`MATCH_COLUMNS`) and, per match, the row of each of
its point's layers in that layer's group. The driver rebuilds the step's plan
from them (:func:`undercurrent.adapters.vllm.channel.step_plan`), with nothing
built per captured vector. The driver answers every batch with a
:class:`StepReply` naming the requests its inline probes aborted; the worker waits for
that reply, so an abort is applied before the engine samples the next token.

The connection is a local ``multiprocessing.connection`` socket with a random key,
set up by the driver (a worker in the driver's own process hands the batch over with a
call instead); nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from undercurrent.probes.sae_files import load_sae
from undercurrent.spec.declarations import wire_field_names
from undercurrent.spec.loader import parse_edit
from undercurrent.spec.serialize import edit_to_dict, extraction_point_to_dict
from undercurrent.spec.types import ExtractionPoint, SaeFeature
from undercurrent.steering.vectors import ResolvedEdit

PROTOCOL_VERSION = 7

MATCH_COLUMNS = ("request", "point", "token_index", "layers")
"""The columns of :attr:`StepBatch.matches`."""

NOT_CAPTURED = -1
"""A row in :attr:`StepBatch.match_rows` for a layer whose site was not reached."""


def match_array(matches: Any) -> np.ndarray:
    """``(request, point index, token index, layer count)`` tuples (or an array of
    them) as the contiguous ``int64`` array of shape ``(n, 4)`` of
    :attr:`StepBatch.matches`."""
    return np.ascontiguousarray(np.asarray(matches, dtype=np.int64).reshape(-1, 4))


def row_array(rows: Any) -> np.ndarray:
    """Row numbers as the contiguous one-dimensional ``int64`` array of
    :attr:`StepBatch.match_rows`."""
    return np.ascontiguousarray(np.asarray(rows, dtype=np.int64).reshape(-1))


@dataclass
class GroupRows:
    """Rows of one (layer, tensor type) in a step: ``count`` rows from ``offset``
    in ``StepBatch.banks[bank]`` (a match's row ``r`` there is ``offset + r``)."""

    layer: int
    tensor_type: str
    bank: int
    offset: int
    count: int


#: What the worker's logs of applied edits did since the last batch:
#: ``(journals, tapes)``. ``journals``: ``(number, shifts)`` for each journal
#: (a steady layout's list of shifts, one a step, see ``StepPlan.edit_steps``)
#: that gained entries, those entries. ``tapes``: ``(engine request id,
#: steps)``, each request's ``EditLog.take_tape`` with every entry as
#: ``("entry", edit name, tensor type, layer, token index)`` and every journal
#: by its number (``("follow", number, token index, sites)``, ``("stop",
#: entries read)``); the driver replays them in order
#: (``RequestState.replay_edits``), its journals copies of the worker's.
AppliedEdits = tuple[list[tuple[int, list[int]]], list[tuple[str, list[tuple[Any, ...]]]]]


@dataclass
class StepBatch:
    """Everything one engine step captured, for every request in it.

    ``matches`` is an ``int64`` array of shape ``(m, 4)``, one row per (request,
    token, point) the step served, in planning order, with the columns
    :data:`MATCH_COLUMNS`: the request (an index into :attr:`requests`), the
    point (an index into that request's points), the absolute token index, and
    how many layers the point has: the match's entries of ``match_rows``, one
    per layer in ascending order, each the row in the group of (that layer,
    the point's tensor type), or :data:`NOT_CAPTURED`. ``match_rows`` holds the
    matches' entries one after another.

    ``tokens`` holds ``(engine request id, first generated index, token ids)``: the
    generated tokens fed to the model since the previous batch, so the driver
    knows each record's token id before the step's output reaches it. A step
    that repeats the last one a token later sends them as ``token_columns``
    instead: (engine request ids, each one's generated index, each one's token
    id), one token per request, the two arrays of integers. ``edits``
    says which live edits the steps since the last batch applied (the records
    of an edited site say so), as :data:`AppliedEdits`.
    ``requests`` is the table of engine request ids the matches index.

    ``shifted``: this batch's columns are the previous batch's a token later
    (the same requests, groups and rows, every match's token one on), which
    the driver then need not compare to know.

    ``earlier``: the batches of earlier steps the worker held back (when no
    reply could change a step: see ``undercurrent_open``'s ``hold``), in step
    order; the driver routes them before this one, and its reply answers all.

    ``captured``: when the worker gathered the step's rows (``time.time()``, on
    the driver's machine); its records carry it, not the time they reached the
    driver (None: that time).
    """

    step: int
    groups: list[GroupRows] = field(default_factory=list)
    banks: list[Any] = field(default_factory=list)
    """The gathered rows: numpy arrays, or torch tensors for a dtype numpy lacks."""
    tokens: list[tuple[str, int, list[int]]] = field(default_factory=list)
    version: int = PROTOCOL_VERSION
    edits: AppliedEdits = field(default_factory=lambda: ([], []))
    requests: list[str] = field(default_factory=list)
    matches: np.ndarray = field(default_factory=lambda: match_array([]))
    match_rows: np.ndarray = field(default_factory=lambda: row_array([]))
    token_columns: tuple[list[str], np.ndarray, np.ndarray] | None = None
    shifted: bool = False
    earlier: list[StepBatch] = field(default_factory=list)
    captured: float | None = None

    def rows(self, group: GroupRows) -> Any:
        """The rows of ``group`` (a view into its bank, as it crossed)."""
        return self.banks[group.bank][group.offset:group.offset + group.count]

    @property
    def num_rows(self) -> int:
        return sum(group.count for group in self.groups)


@dataclass
class StepReply:
    """The driver's answer to a step: requests to stop capturing (aborted), and
    triggered edits a signal of this step switched on, as ``(engine request id,
    edit name, token index of the signal)``: they apply from the next step."""

    step: int
    aborted: list[str] = field(default_factory=list)
    armed: list[tuple[str, str, int]] = field(default_factory=list)


def encode(message: StepBatch | StepReply) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> StepBatch | StepReply:
    message = pickle.loads(payload)  # noqa: S301 - a local socket authenticated by a random key
    if not isinstance(message, (StepBatch, StepReply)):
        raise TypeError(f"unexpected message on the undercurrent channel: {type(message)!r}")
    if isinstance(message, StepBatch) and message.version != PROTOCOL_VERSION:
        raise RuntimeError(
            f"undercurrent worker speaks protocol {message.version}, the driver "
            f"{PROTOCOL_VERSION}: the engine and the driver import different undercurrent versions"
        )
    return message


POINT_WIRE_FIELDS = wire_field_names(ExtractionPoint)
"""The point fields a worker needs to match tokens (declared ``wire=True``)."""


def point_to_wire(point: ExtractionPoint) -> dict[str, Any]:
    """The fields of an ``ExtractionPoint`` the worker needs to match tokens, in spec
    form (plain data: vLLM's RPC layer carries msgpack-able values only)."""
    return {key: value for key, value in extraction_point_to_dict(point).items()
            if key in POINT_WIRE_FIELDS}


def point_from_wire(data: dict[str, Any]) -> ExtractionPoint:
    """Rebuild the matching-relevant ``ExtractionPoint`` in the worker (fields the
    wire leaves out take their defaults)."""
    return ExtractionPoint(**{key: data[key] for key in POINT_WIRE_FIELDS if key in data})


def edit_to_wire(resolved: ResolvedEdit) -> dict[str, Any]:
    """A resolved edit as plain data: its spec form with the vector already resolved
    to a list of floats (the worker reads no vector files; only an SAE feature's
    folder, whose encoder ``clamp`` needs)."""
    data = edit_to_dict(resolved.edit)
    data.pop("vector_key", None)
    sae_feature = data["vector"] if resolved.sae is not None else None
    data["vector"] = [float(x) for x in resolved.vector]
    # an SAE feature's clamp needs the SAE's encoder: the worker loads the folder
    return {"edit": data, "source": resolved.source, "sae_feature": sae_feature}


def edit_from_wire(data: dict[str, Any]) -> ResolvedEdit:
    """Rebuild a resolved edit in the worker."""
    import numpy as np

    edit = parse_edit(data["edit"])
    vector = np.array(edit.vector, dtype=np.float64)
    sae = None
    if data.get("sae_feature") is not None:
        feature = SaeFeature(**data["sae_feature"])
        edit = dataclasses.replace(edit, vector=feature)
        sae = load_sae(feature.sae)
    return ResolvedEdit(edit, vector, str(data["source"]), sae)
