"""Forward hooks on a transformers model, located through the architecture table.

A :class:`ModelHooks` installs one hook per (layer, tensor type) pair some live
request wants, and nothing else. Each hook looks its pair up in the current
:class:`~undercurrent.adapters.session.StepPlan`; when the pair is not wanted in
this forward it returns at once. Otherwise it gathers every wanted (row, column)
with one indexing op and one device-to-host copy (non-blocking from CUDA, into
pinned memory), and queues the rows; :meth:`ModelHooks.flush` routes them after
the forward: on the generation thread after one stream sync, or, when every
point is async (:meth:`ModelHooks.start_delivery`), on a
:class:`~undercurrent.adapters.hf.offload.DeliveryThread` that waits on a CUDA
event instead, so generation never waits for the copies.

A pair some live edit applies to is hooked the same way: the hook first
rewrites the planned (row, column) entries of the module's output in place (so
the next module receives the edited value), then captures, so a capture at the
same site sees what the model saw.

Only the generation's own forwards are acted on: the hooks belong to the thread
that generates (:meth:`ModelHooks.own`) and, on it, to the model's outermost
forward until its routing starts. A forward of the same model on another thread
(a reference computation, another ProbedModel's capability check) or one a probe
runs while the forward's records are routed (a logit lens calling the final norm)
passes through them untouched: not captured, not steered, not planned.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from threading import get_ident
from typing import Any, cast

import torch

from undercurrent.adapters.base import BackendError
from undercurrent.adapters.capabilities import Capabilities
from undercurrent.adapters.hf.architectures import (
    PARALLEL_BLOCKS,
    UnsupportedArchitectureError,
    check_hookable_layout,
    config_dimensions,
    find_architecture,
    resolve_path,
    runs_in_parallel,
)
from undercurrent.adapters.hf.offload import DeliveryThread, all_async
from undercurrent.adapters.session import CaptureGroup, CaptureSession, PairKey, StepPlan
from undercurrent.spec.types import TensorType
from undercurrent.steering.kernels import EditKernels

_INDEX_CACHE_SIZE = 64

_CACHE_TYPES: tuple[type, ...]
try:  # the cache base class moved between releases; the hook only needs isinstance
    from transformers.cache_utils import Cache

    _CACHE_TYPES = (Cache,)
except ImportError:  # pragma: no cover - very old transformers
    _CACHE_TYPES = ()

# Cache layers whose ``keys``/``values`` do not hold the full-precision tokens
# just written: a quantized layer moves them into packed storage.
_UNREADABLE_CACHE_LAYERS: tuple[type, ...]
try:
    from transformers.cache_utils import QuantizedLayer

    _UNREADABLE_CACHE_LAYERS = (QuantizedLayer,)
except ImportError:  # pragma: no cover - older transformers: no per-layer classes
    _UNREADABLE_CACHE_LAYERS = ()


def model_device(model: Any) -> torch.device:
    """The device ``model``'s forward runs on: for a model whose weights accelerate
    offloads (``cpu_offload``, ``device_map`` with offload; its parameters then sit
    on the meta device), accelerate's execution device; else its first parameter's."""
    found: torch.device = next(model.parameters()).device
    if found.type != "meta":
        return found
    for module in model.modules():  # (cpu_offload hooks each module, not the model)
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device(device)
    return found


def _first_tensor(output: Any) -> torch.Tensor:
    """Modules return a tensor, a tuple (tensor first) or a ModelOutput."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    first = getattr(output, "last_hidden_state", None)
    if isinstance(first, torch.Tensor):
        return first
    raise TypeError(f"cannot find the hidden-state tensor in a {type(output).__name__} output")


def _find_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # The cache reaches a decoder layer under different names ("past_key_values",
    # "layer_past", "cache" in newer releases) or positionally (GPT-2), so look
    # for the object itself rather than a keyword.
    for value in list(kwargs.values()) + list(args):
        if _CACHE_TYPES and isinstance(value, _CACHE_TYPES):
            return value
    return None


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a long tensor on ``device``. To CUDA the copy goes from pinned
    memory, non-blocking: it does not wait for the device (a copy from pageable
    memory syncs the stream); torch's pinned allocator keeps the source alive
    until the copy has run."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _cell(slot: Hashable) -> tuple[int, int]:
    """A slot of the HF backend: (row, column) in the padded batch."""
    return cast("tuple[int, int]", slot)


class ModelHooks:
    """The capture sites of one model and the hooks currently installed on them."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.entry = find_architecture(model)
        check_hookable_layout(model, self.entry)
        self.layers = list(resolve_path(model, self.entry.layers, model=model,
                                        what="decoder layer list"))
        self.num_layers = len(self.layers)
        self.final_norm = resolve_path(model, self.entry.final_norm, model=model,
                                       what="final norm")
        for index, layer in enumerate(self.layers):
            resolve_path(layer, self.entry.attention, model=model,
                         what=f"attention block of layer {index}")
            resolve_path(layer, self.entry.mlp, model=model, what=f"MLP block of layer {index}")
        self._handles: list[Any] = []
        self._installed: set[PairKey] = set()
        self.plan: StepPlan | None = None
        self.width = 0
        self._pending: list[tuple[TensorType, CaptureGroup | list[Any], Any]] = []
        # Gather indices by (slots, device), kept across forwards: decode steps
        # capture the same (row, 0) slots again and again.
        self._indices: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._needs_sync = False
        self._delivery: DeliveryThread | None = None
        self.kernels = EditKernels()
        self._kv_problem: str | None = None
        self._kv_checked = False
        #: The model's key/value heads per layer (what a kv record holds).
        self.num_kv_heads: int | None = config_dimensions(model.config)["num_kv_heads"]
        # Columns fed to the model since its cache was created (new_cache()), and
        # those fed before the current forward: where a preallocated (static)
        # cache layer writes this forward's tokens.
        self._columns_fed = 0
        self._columns_cached = 0
        # The generating thread (None: none), the model forwards running on it, the
        # thread while its outermost forward runs and is not routed yet (None
        # otherwise: what every hook compares with), and whether that forward's
        # records are being routed (see own()).
        self._owner: int | None = None
        self._depth = 0
        self._active: int | None = None
        self._routing = False

    def own(self, thread: int | None) -> None:
        """Act on the forwards of ``thread`` only (a thread id; None: on none). Set by
        the backend for each call it runs: another thread's forward of the model, or
        one a probe runs while a forward's records are routed, is not the
        generation's, and the hooks let it through untouched."""
        self._owner = thread
        self._depth = 0
        self._active = None
        self._routing = False

    # -- capability ------------------------------------------------------
    def capabilities(self) -> Capabilities:
        dims = config_dimensions(self.model.config)
        notes = {"_architecture": self.entry.family}
        table = self.entry.notes
        if PARALLEL_BLOCKS not in table and runs_in_parallel(self.entry, self.model.config):
            table = "; ".join(filter(None, (table, PARALLEL_BLOCKS)))  # (a config setting)
        if table:
            notes["_table"] = table
        return Capabilities.standard(
            "hf", str(getattr(self.model.config, "model_type", type(self.model).__name__)),
            self.num_layers, hidden_size=dims["hidden_size"], num_kv_heads=dims["num_kv_heads"],
            head_dim=dims["head_dim"], notes=notes,
        )

    def kv_cache_problem(self) -> str | None:
        """Why ``kv`` cannot be read on this model, or None when it can.

        The kv hook reads the keys and values a decoder layer has just written to
        the cache object it was passed. One forward of one token with
        ``use_cache=True`` (run once, before any generation, by the backend's
        capability check) looks for that object and its per-layer tensors, so a
        model that lacks them refuses kv points at registration instead of failing
        in a hook while it generates.
        """
        if not self._kv_checked:
            self._kv_problem = self._check_kv_cache()
            self._kv_checked = True
        return self._kv_problem

    def _check_kv_cache(self) -> str | None:
        found: list[Any] = []
        thread = get_ident()

        def look(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            if get_ident() == thread:  # (not a generation running on another thread)
                found.append(_find_cache(args, kwargs))

        handle = self.layers[0].register_forward_hook(look, with_kwargs=True)
        try:
            ids = torch.zeros((1, 1), dtype=torch.long, device=model_device(self.model))
            with torch.no_grad():
                self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        finally:
            handle.remove()
        name = type(self.model).__name__
        cache = found[0] if found else None
        if cache is None:
            return (f"{name}'s decoder layers are passed no cache object with use_cache=True, "
                    "and kv is read from that cache")
        layers = getattr(cache, "layers", None)
        keys = getattr(layers[0], "keys", None) if layers else None
        if not isinstance(keys, torch.Tensor):
            return (f"{name}'s cache ({type(cache).__name__}) has no per-layer keys/values "
                    "tensors to read kv from")
        return self._kv_heads_problem(keys)

    def _kv_heads_problem(self, keys: torch.Tensor) -> str | None:
        """Why the cache's heads cannot be read as the config's kv heads, or None.
        A cache may hold each kv head once per query head of its group (Falcon's
        new decoder architecture broadcasts them before caching): the copies must
        be equal, and the capture keeps the first of each group."""
        heads = int(keys.shape[1])
        kv_heads = self.num_kv_heads
        if heads == kv_heads:
            return None
        name = type(self.model).__name__
        if not kv_heads or heads % kv_heads:
            return (f"{name}'s cache holds {heads} key heads per layer, which is not a "
                    f"multiple of the config's {kv_heads} kv heads")
        grouped = keys.reshape(keys.shape[0], kv_heads, heads // kv_heads, *keys.shape[2:])
        if not torch.equal(grouped, grouped[:, :, :1].expand_as(grouped)):
            return (f"{name}'s cache holds {heads} distinct key heads per layer, but its "
                    f"config says {kv_heads} kv heads")
        return None

    def module_for(self, layer: int, tensor_type: TensorType) -> Any:
        """The module whose output is ``tensor_type`` at ``layer``."""
        if tensor_type is TensorType.FINAL_NORM:
            return self.final_norm
        if not 0 <= layer < self.num_layers:
            raise UnsupportedArchitectureError(
                f"layer {layer} out of range for {tensor_type.value} "
                f"(model has {self.num_layers} decoder layers)")
        decoder_layer = self.layers[layer]
        if tensor_type is TensorType.ATTN_OUT:
            return resolve_path(decoder_layer, self.entry.attention, model=self.model,
                                what="attention block")
        if tensor_type is TensorType.MLP_OUT:
            return resolve_path(decoder_layer, self.entry.mlp, model=self.model, what="MLP block")
        return decoder_layer  # residual_stream and kv

    # -- installation ----------------------------------------------------
    @property
    def installed(self) -> frozenset[PairKey]:
        return frozenset(self._installed)

    def install(self, pairs: Iterable[PairKey]) -> None:
        """Hook every pair not hooked yet, plus the model's per-forward hooks (before
        it, and after it)."""
        pairs = set(pairs) - self._installed
        if not pairs:
            return
        try:
            if not self._installed:
                self._handles.append(self.model.register_forward_pre_hook(
                    self._before_forward, with_kwargs=True))
                self._handles.append(self.model.register_forward_hook(self._after_forward))
            for layer, tensor_type in sorted(pairs, key=lambda p: (p[0], p[1].value)):
                module = self.module_for(layer, tensor_type)
                hook = self._make_hook(layer, tensor_type)
                self._handles.append(module.register_forward_hook(
                    hook, with_kwargs=tensor_type is TensorType.KV))
                self._installed.add((layer, tensor_type))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook this object installed (safe to call twice)."""
        self.finish_delivery(raise_errors=False)
        while self._handles:
            self._handles.pop().remove()
        self._installed.clear()
        self._pending.clear()
        self._indices.clear()
        self.kernels.clear()
        self.plan = None

    # -- delivery thread -------------------------------------------------
    offload = "auto"
    """Where :meth:`flush` delivers when every point is async: ``"auto"`` (off the
    generation thread on CUDA only), ``"always"`` (on CPU too: tests) or
    ``"never"``. On CPU the copies are no-ops and handing over costs more than
    delivering, so ``auto`` keeps CPU on the generation thread."""

    def start_delivery(self, session: CaptureSession, states: Iterable[Any]) -> bool:
        """Deliver this batch's forwards on a :class:`DeliveryThread` when every
        point of ``states`` is async and :attr:`offload` allows it on this device;
        True when it does. :meth:`finish_delivery` must follow."""
        if self.offload not in ("auto", "always", "never"):
            raise ValueError(f"ModelHooks.offload must be 'auto', 'always' or 'never', "
                             f"got {self.offload!r}")
        self.finish_delivery(raise_errors=False)
        on_cuda = model_device(self.model).type == "cuda"
        wanted = self.offload == "always" or (self.offload == "auto" and on_cuda)
        if wanted and all_async(list(states)):
            self._delivery = DeliveryThread(session)
        return self._delivery is not None

    @property
    def delivering(self) -> bool:
        """True while forwards are delivered off the generation thread."""
        return self._delivery is not None

    def drain(self) -> None:
        """Wait until every forward flushed so far was delivered (raises what a
        delivery raised); a no-op when delivering on the generation thread."""
        if self._delivery is not None:
            self._delivery.drain()

    def finish_delivery(self, *, raise_errors: bool = True) -> None:
        """Drain and stop the delivery thread, if any. ``raise_errors=False`` after
        another error: the forwards not delivered yet are skipped (never routed, so
        the accounting stays exact) and a delivery error is dropped, the first
        error being what the caller sees."""
        delivery, self._delivery = self._delivery, None
        if delivery is None:
            return
        try:
            delivery.close(discard=not raise_errors)
        except BaseException:
            if raise_errors:
                raise

    # -- per forward -----------------------------------------------------
    on_forward: Any = None  # set by the generation driver: called with the input width
    #: Set by the generation driver: called after each forward of the model, before
    #: the next token is sampled (its hooks have all run: what they captured is
    #: routed then).
    on_forward_done: Any = None

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if get_ident() != self._owner:
            return
        self._active = None
        if self._depth != 1:  # a nested forward ended
            self._depth -= 1
            if self._depth == 1 and not self._routing:
                self._active = self._owner  # (back in the generation's forward)
            return
        # The generation's forward ended. Its records are routed now, at depth 1: a
        # forward a probe runs meanwhile (or a hooked module it calls) is not the
        # generation's.
        self._routing = True
        try:
            if self.on_forward_done is not None:
                self.on_forward_done()
        finally:
            self._routing = False
            self._depth = 0

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if get_ident() != self._owner:
            return  # another thread's forward of the model: not the generation's
        self._depth += 1
        if self._depth != 1:
            self._active = None  # a forward inside the generation's own
            return
        self._active = self._owner
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            embeds = kwargs.get("inputs_embeds")
            self.width = int(embeds.shape[1]) if embeds is not None else 0
        else:
            self.width = int(input_ids.shape[1])
        self._columns_cached = self._columns_fed
        self._columns_fed += self.width
        if self.on_forward is not None:
            self.plan = self.on_forward(self.width)

    def new_cache(self) -> None:
        """The model's next forward starts a new cache (each ``generate()`` call
        creates one, a forward without ``past_key_values`` too): nothing is cached
        before it."""
        self._columns_fed = 0

    def set_plan(self, plan: StepPlan | None, width: int) -> None:
        """Use ``plan`` for the next forward (when no generation driver is attached)."""
        self.plan = plan
        self.width = width

    def _index(self, slots: list[Any],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, *slots)
        cached = self._indices.get(key)
        if cached is None:
            if len(self._indices) >= _INDEX_CACHE_SIZE:
                self._indices.clear()
            cached = (_on_device([slot[0] for slot in slots], device),
                      _on_device([slot[1] for slot in slots], device))
            self._indices[key] = cached
        return cached

    def _queue(self, tensor_type: TensorType, targets: CaptureGroup | list[Any],
               gathered: torch.Tensor) -> None:
        if gathered.requires_grad:  # generate() runs without grad: then nothing to cut
            gathered = gathered.detach()
        if gathered.is_cuda:
            # Non-blocking into pinned memory (what a non-blocking copy from CUDA
            # to the CPU allocates): the copy is only enqueued on the stream, in
            # one call; flush() makes the reader wait for it (a stream sync, or a
            # CUDA event the delivery thread waits on). Freed pinned blocks are
            # reused by torch's caching host allocator once their copies are done.
            # ``gathered`` may be a view of the module's output: kernels enqueued
            # later on the stream (the next layers, in-place edits) run after it.
            host = gathered.to("cpu", non_blocking=True, memory_format=torch.contiguous_format)
            self._needs_sync = True
        else:
            host = gathered  # already a fresh CPU tensor (indexing copies)
        self._pending.append((tensor_type, targets, host))

    def _make_hook(self, layer: int, tensor_type: TensorType) -> Any:
        if tensor_type is TensorType.KV:
            def kv_hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
                if get_ident() != self._active:
                    return
                group = self.plan.get(layer, tensor_type) if self.plan else None
                if group is not None:
                    self._capture_kv(layer, group, args, kwargs)
            return kv_hook

        key = (layer, tensor_type)

        def hook(module: Any, args: Any, output: Any) -> None:
            if get_ident() != self._active:
                return  # not the generation's forward (see own())
            plan = self.plan
            if plan is None:
                return
            # (plan.get and plan.get_edits, read directly: per hook and forward)
            group = plan.groups.get(key)
            edits = plan.get_edits(layer, tensor_type) if plan.edits else None
            if group is None and edits is None:
                return
            hidden = output if type(output) is torch.Tensor else _first_tensor(output)
            if hidden.dim() == 2:  # some blocks (OPT's fc2) see the batch flattened
                hidden = hidden.view(-1, self.width, hidden.shape[-1])
            if edits is not None:
                # In place: the module's output tensor is what flows on. (Kept on
                # the entry: the plans of later steps that repeat it share it.)
                for entry in edits:
                    where: Any = entry.index_cache.get(hidden.device)
                    if where is None:
                        where = entry.index_cache[hidden.device] = self._gather_plan(
                            entry.slots, hidden)
                    if type(where) is int:  # every row at one column: through a view
                        view = hidden.select(1, where)
                        view.copy_(self.kernels.apply(entry.resolved, view.contiguous()))
                    else:
                        rows, cols = where
                        hidden[rows, cols] = self.kernels.apply(entry.resolved,
                                                                hidden[rows, cols])
            if group is not None:
                # Kept on the group: the plans of later steps that repeat it share it.
                index = group.index_cache.get(hidden.device)
                if index is None:
                    index = group.index_cache[hidden.device] = self._gather_plan(group.slots,
                                                                                 hidden)
                if type(index) is int:
                    rows = hidden.select(1, index)
                    if not rows.is_cuda:  # a fresh copy: the module's output flows on
                        rows = rows.clone(memory_format=torch.contiguous_format)
                    # (on CUDA, _queue's copy to the host is the fresh copy)
                else:
                    rows = hidden[index]
                if rows.requires_grad or rows.is_cuda:
                    self._queue(tensor_type, group, rows)
                else:  # (_queue's CPU path without grad, inline: per hook and forward)
                    self._pending.append((tensor_type, group, rows))
        return hook

    def _gather_plan(self, slots: list[Any], hidden: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | int:
        """How a hook gathers ``slots`` from ``hidden`` (batch, width, ...): the
        column, when the slots are every row in order at that one column (a
        decode step: one copy of the column, no index tensors), else the row and
        column index tensors."""
        column = _cell(slots[0])[1]
        if len(slots) == hidden.shape[0] and slots == list(
                zip(range(len(slots)), itertools.repeat(column))):  # (compared in C)
            return column
        return self._index(slots, hidden.device)

    def _capture_kv(self, layer: int, group: CaptureGroup, args: Any, kwargs: Any) -> None:
        cache = _find_cache(args, kwargs)
        if cache is None:  # kv_cache_problem() found one before kv points were accepted
            raise BackendError(
                f"internal error: kv capture at layer {layer} of {type(self.model).__name__} "
                "found no cache object, although the registration-time check found one")
        cache_layer = cache.layers[layer]
        if isinstance(cache_layer, _UNREADABLE_CACHE_LAYERS):
            raise BackendError(
                f"kv cannot be read from {type(self.model).__name__}'s "
                f"{type(cache_layer).__name__} at layer {layer}: a quantized cache keeps "
                "the keys and values quantized, not as the layer wrote them; generate "
                "with a dynamic or static cache (generation_config.cache_implementation "
                "None, 'dynamic' or 'static') to capture kv")
        keys, values = cache_layer.keys, cache_layer.values
        if keys.shape[1] != self.num_kv_heads:  # each kv head once per query head
            repeats = int(keys.shape[1]) // (self.num_kv_heads or 1)
            keys, values = keys[:, ::repeats], values[:, ::repeats]
        stored = int(keys.shape[-2])
        # The layer wrote this forward's `width` tokens after the `_columns_cached`
        # ones before it. A dynamic layer holds just those: they end its tensor.
        # A static one is preallocated (cache_implementation="static") and they
        # end where the count does. A sliding-window layer, full, keeps its
        # latest tokens at the end, and may have dropped the oldest of these.
        end = min(self._columns_cached + self.width, stored)
        positions = [end - self.width + _cell(slot)[1] for slot in group.slots]
        targets: CaptureGroup | list[Any] = group
        if min(positions) < 0:
            keep = {i for i, pos in enumerate(positions) if pos >= 0}
            remap = {old: new for new, old in enumerate(sorted(keep))}
            targets = [t for t in group.targets if t.slot_index in keep]
            targets = [type(t)(t.state, t.point, t.layer, t.token_index, remap[t.slot_index])
                       for t in targets]
            slots = [group.slots[i] for i in sorted(keep)]
            positions = [positions[i] for i in sorted(keep)]
            if not slots:
                return
            rows = _on_device([_cell(s)[0] for s in slots], keys.device)
        else:
            rows, _ = self._index(group.slots, keys.device)
        pos = _on_device(positions, keys.device)
        # keys: (batch, kv_heads, seq, head_dim) -> (n, kv_heads, head_dim)
        gathered = torch.stack([keys[rows, :, pos], values[rows, :, pos]], dim=1)
        self._queue(TensorType.KV, targets, gathered)

    def flush_outside(self, session: CaptureSession) -> None:
        """:meth:`flush`, called after a forward rather than from it (the last rows
        of ``generate()``, the last-token replay): routed as a forward's are, so a
        forward a probe runs meanwhile is not taken for the generation's."""
        self._routing, self._depth, self._active = True, 1, None
        try:
            self.flush(session)
        finally:
            self._routing, self._depth = False, 0

    def flush(self, session: CaptureSession) -> None:
        """Route everything captured in the forward that just ran."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        needs_sync, self._needs_sync = self._needs_sync, False
        if self._delivery is not None:
            event = None
            if needs_sync:  # the delivery thread waits on it; this thread goes on
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            self._delivery.submit(pending, event)
            return
        if needs_sync:  # the non-blocking copies must land before anyone reads them
            torch.cuda.current_stream().synchronize()
        window = session.window
        if window is not None and window.take(session, pending):
            return  # (a steady decode step held as it came: see delivery._Window.take)
        session.deliver(pending)
