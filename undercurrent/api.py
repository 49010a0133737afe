"""The high-level API: :class:`ProbedModel`, backend-agnostic.

>>> from undercurrent import ProbedModel                       # doctest: +SKIP
>>> pm = ProbedModel.from_pretrained("undercurrent/tiny", spec="probes.yaml")  # doctest: +SKIP
>>> outs = pm.generate(["prompt a", "prompt b"], max_new_tokens=16)   # doctest: +SKIP
>>> outs[0].text, outs[0].aborted, outs[0].results            # doctest: +SKIP

``ProbedModel`` owns a router (unless you bring one) and a backend (``"hf"`` or
``"vllm"``); each ``generate``/``stream`` call opens a
:class:`~undercurrent.adapters.session.CaptureSession` that the backend feeds.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from undercurrent.adapters.arguments import check_device, check_model_path, dtype_name
from undercurrent.adapters.base import (
    Backend,
    BackendError,
    SamplingParams,
    backend_class,
    check_batch_size,
    known_backends,
    stop_strings,
)
from undercurrent.adapters.capabilities import Capabilities, check_points
from undercurrent.adapters.outputs import (
    AbortInfo,
    AppliedEdit,
    GenerationOutput,
    StreamEvent,
    TokenSignal,
)
from undercurrent.adapters.prompts import check_prompts, prompt_inputs
from undercurrent.adapters.session import CaptureSession
from undercurrent.arguments import check_flag
from undercurrent.models import model_name_for, resolve_model_path
from undercurrent.records import ProbeResult
from undercurrent.router import Router
from undercurrent.spec import check_extraction_points, load_yaml_file, parse_dict, parse_yaml
from undercurrent.spec.errors import SpecValidationError
from undercurrent.spec.loader import is_file, is_yaml_text, version_problems
from undercurrent.spec.messages import did_you_mean
from undercurrent.spec.types import Edit, ExtractionPoint, ProbeSpec
from undercurrent.steering.registration import as_edits, placed, register_edits
from undercurrent.store.capture import CaptureSummary, capture_activations

__all__ = ["AbortInfo", "AppliedEdit", "GenerationOutput", "ProbedModel", "StreamEvent",
           "TokenSignal", "check_prompts", "load_spec"]

SpecLike = ProbeSpec | str | os.PathLike[str] | Mapping[str, Any] | Iterable[ExtractionPoint]


def load_spec(spec: SpecLike | None) -> ProbeSpec:
    """Accept a ``ProbeSpec``, a YAML file path, YAML text, a spec dict, a list of
    ``ExtractionPoint``s or None (no points). Hand-built points (a list, or a
    ``ProbeSpec`` of them) are held to the YAML rules by :func:`check_extraction_points`."""
    if spec is None:
        return ProbeSpec(())
    if isinstance(spec, ProbeSpec):
        problems = version_problems(spec.version)
        if problems:  # (ProbeSpec(version="9"): what the loader refuses)
            raise SpecValidationError(problems)
        check_extraction_points(spec)
        return spec
    if isinstance(spec, Mapping):
        return parse_dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if is_yaml_text(spec):
            return parse_yaml(text)
        if not is_file(text):
            raise FileNotFoundError(
                f"spec {text!r} is not a file; pass a YAML file path, YAML text, a dict, "
                "a ProbeSpec or a list of ExtractionPoint")
        return load_yaml_file(text)
    accepted = ("pass a YAML file path, YAML text, a dict, a ProbeSpec or a list of "
                "ExtractionPoint")
    if isinstance(spec, ExtractionPoint):
        raise TypeError(f"spec is a single ExtractionPoint; wrap it in a list ({accepted})")
    if isinstance(spec, (bytes, bytearray)):
        raise TypeError(f"spec is bytes; decode YAML text first ({accepted})")
    if not isinstance(spec, Iterable):
        raise TypeError(f"spec must be a spec: {accepted}; got {type(spec).__name__} "
                        f"({spec!r:.40})")
    points = list(spec)
    bad = [type(p).__name__ for p in points if not isinstance(p, ExtractionPoint)]
    if bad:
        raise TypeError(f"spec list must hold ExtractionPoint objects, got {bad[:3]}")
    check_extraction_points(points)
    return ProbeSpec(tuple(points))


def _check_request_id(request_id: Any, name: str) -> None:
    """A request id is a non-empty string: results, records and frames carry it."""
    if not isinstance(request_id, str) or not request_id:
        shown = "an empty string" if request_id == "" else (
            f"{type(request_id).__name__} ({request_id!r:.40})")
        raise TypeError(f"{name} must be a non-empty string, got {shown}")


def _is_backend(obj: Any) -> bool:
    return all(callable(getattr(obj, name, None))
               for name in ("capabilities", "generate", "stream", "close"))


def _takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` can be called with the keyword argument ``name``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: do not guess
        return False
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD or (
        parameter.name == name and parameter.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for parameter in parameters)


def _router_check(router: Any, points: list[ExtractionPoint], hidden_size: int | None) -> None:
    """Run the router's registration checks on ``points`` with the model's hidden size.

    A router's ``check(points, hidden_size=None)`` gets the size; a ``check(points)``
    that takes none (a subclass written before the keyword, or a router of your
    own) is called without it, and the size is then checked on its own by the
    router's ``check_hidden_size(points, hidden_size)`` where it has one (every
    :class:`Router` does). A router with no ``check`` is not checked here."""
    check = getattr(router, "check", None)
    if check is None:
        return
    if _takes_keyword(check, "hidden_size"):
        check(points, hidden_size=hidden_size)
        return
    check(points)
    size_check = getattr(router, "check_hidden_size", None)
    if size_check is not None and hidden_size is not None:
        size_check(points, hidden_size)


# What a capture session calls on a router (router.protocol.SessionRouter).
_ROUTER_METHODS = ("register_request", "route_columns", "end_request")


def _check_construction(backend: str, router: Any, on_result: Any) -> None:
    """Refuse, when a ``ProbedModel`` is built, what would otherwise fail at
    generate(): an on_result only after the whole batch was generated."""
    if backend not in known_backends():
        raise BackendError(
            f"unknown backend {backend!r}; known backends: {', '.join(known_backends())}")
    if on_result is not None and not callable(on_result):
        raise TypeError(f"on_result must be a function taking a ProbeResult, or None, got "
                        f"{type(on_result).__name__} ({on_result!r:.40})")
    missing = [name for name in _ROUTER_METHODS if not callable(getattr(router, name, None))]
    if router is not None and missing:
        raise TypeError(
            f"router must be an undercurrent Router (or an object with the methods "
            f"{', '.join(_ROUTER_METHODS)}), got {type(router).__name__} ({router!r:.40}), "
            f"which lacks {', '.join(missing)}")


# Per-call options of generate() that a capture takes elsewhere, and where.
_CAPTURE_OPTIONS_ELSEWHERE = {
    "edits": "steering edits belong in the spec (its edits: list, spec version \"2\"), "
             "which the store records",
    "capture_last_token": "set it on the model, ProbedModel(..., capture_last_token=True), "
                          "which the store records",
    "records": "a capture writes every record to the store; read them with "
               "undercurrent.open_activations",
    "request_ids": "a capture names each prompt's request itself, by its index",
}


def _check_capture_options(options: Mapping[str, Any]) -> None:
    """Refuse an option ``ProbedModel.capture`` does not take, saying where it
    belongs if it belongs elsewhere and listing the options it takes."""
    accepted = [name for name, parameter in inspect.signature(capture_activations).parameters
                .items() if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    for name in options:
        if name not in accepted:
            where = _CAPTURE_OPTIONS_ELSEWHERE.get(name)
            raise TypeError(
                f"capture() takes no {name}= option" + (f": {where}" if where else
                                                       did_you_mean(name, accepted))
                + f"; it takes: {', '.join(accepted)}")


class ProbedModel:
    """A model with probes attached: generate text and probe it live.

    ``model`` is an already-loaded transformers model (with ``tokenizer``) or an
    already-built backend object. ``spec`` is anything :func:`load_spec` takes.
    ``probes`` adds probe classes by name; ``probe_defaults`` gives router-level
    ``probe_args`` per probe type; ``router`` brings your own
    :class:`~undercurrent.router.Router` (it is not shut down by :meth:`close`);
    ``on_result`` is called with every ``ProbeResult`` as its request ends.

    Registration-time checks: a spec asking for a tensor type or layer the
    backend cannot capture raises ``CapabilityError`` here, before any
    generation; an unknown ``probe_type``, ``probe_args`` the probe does not
    accept, or a point the probe refuses raise ``RouterError`` here too.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        spec: SpecLike | None = None,
        backend: str = "hf",
        probes: Any = None,
        probe_defaults: Mapping[str, Mapping[str, Any]] | None = None,
        router: Router | None = None,
        on_result: Callable[[ProbeResult], Any] | None = None,
        batch_size: int = 8,
        capture_last_token: bool = False,
        model_name: str | None = None,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            raise TypeError(
                f"ProbedModel(model) takes a loaded model or backend, got the path {model!r}; "
                "load it with ProbedModel.from_pretrained(path, spec=...)"
            )
        check_batch_size(batch_size, optional=False)
        capture_last_token = check_flag("capture_last_token", capture_last_token)
        _check_construction(backend, router, on_result)
        self.backend: Backend
        if _is_backend(model):
            self.backend = model
        elif backend == "hf":
            cls = backend_class("hf")
            self.backend = cls(model, tokenizer, model_name=model_name, batch_size=batch_size)
        else:
            raise BackendError(
                f"backend={backend!r} loads its engine itself: use "
                f"ProbedModel.from_pretrained(path, backend={backend!r})")
        self.spec = load_spec(spec)
        capabilities = self.backend.capabilities()
        check_points(capabilities, self.spec)
        self._spec_edits = self._register_edits((), "edits", self.spec.edits)
        backend_check = getattr(self.backend, "check", None)
        if backend_check is not None:
            # Engine-specific refusals (e.g. prompt positions under vLLM prefix
            # caching) surface here, at registration, not at the first generate().
            backend_check(list(self.spec))
        self._probes = probes
        self._probe_defaults = probe_defaults
        self._router = router
        self._owns_router = router is None
        self.on_result = on_result
        self.batch_size = batch_size
        self.capture_last_token = capture_last_token
        self._ids = itertools.count()
        self._closed = False
        if self.spec:
            # Unknown probe types, bad probe_args and points a probe refuses (a probe
            # file fitted on another layer, an SAE of another hidden size) are
            # refused here, not at generate().
            _router_check(self.router, list(self.spec), capabilities.hidden_size)

    @classmethod
    def from_pretrained(
        cls,
        model_or_path: Any,
        *,
        spec: SpecLike | None = None,
        backend: str = "hf",
        device: str | None = None,
        dtype: Any = None,
        probes: Any = None,
        probe_defaults: Mapping[str, Mapping[str, Any]] | None = None,
        router: Router | None = None,
        on_result: Callable[[ProbeResult], Any] | None = None,
        batch_size: int = 8,
        capture_last_token: bool = False,
        **backend_kwargs: Any,
    ) -> ProbedModel:
        """Load a model by path or hub id (``"undercurrent/tiny"`` / ``"tiny"`` is the
        bundled model) with the chosen backend; extra keyword arguments go to the
        backend's loader (for ``"hf"``: ``AutoModelForCausalLM.from_pretrained``).

        ``dtype`` (None or ``"auto"``: the dtype the model's ``config.json`` declares,
        on every backend) may be a torch dtype or its name (``"bfloat16"``). A path
        that does not exist, or a dtype torch does not know, is refused here with an
        error naming the argument, before any engine loads.

        ``tokenizer=`` (default: the one saved with the model) is a loaded tokenizer
        (the hf backend only) or the path or hub id of one.

        An already-loaded model is taken as ``ProbedModel(model, tokenizer)`` takes it:
        ``tokenizer=`` and ``model_name=`` apply; ``device=``, ``dtype=`` and loader
        arguments are refused (a ``TypeError`` naming them), since they load a model
        from a path: move or cast the model (``model.to(device, dtype)``) first."""
        if not isinstance(model_or_path, (str, os.PathLike)):
            tokenizer = backend_kwargs.pop("tokenizer", None)
            model_name = backend_kwargs.pop("model_name", None)
            loading = {name: value for name, value in (("device", device), ("dtype", dtype))
                       if value is not None}
            loading.update(backend_kwargs)
            if loading:
                given = ", ".join(f"{name}={value!r:.40}" for name, value in loading.items())
                raise TypeError(
                    f"from_pretrained(<a loaded {type(model_or_path).__name__}>) cannot apply "
                    f"{given}: these load a model from a path; move or cast the loaded model "
                    "yourself (model.to(device, dtype)) before passing it")
            return cls(model_or_path, tokenizer, spec=spec, backend=backend, probes=probes,
                       probe_defaults=probe_defaults, router=router, on_result=on_result,
                       batch_size=batch_size, capture_last_token=capture_last_token,
                       model_name=model_name)

        name = os.fspath(model_or_path)
        check_batch_size(batch_size, optional=False)  # (before any engine loads)
        check_flag("capture_last_token", capture_last_token)
        _check_construction(backend, router, on_result)
        loader = backend_class(backend)
        path = resolve_model_path(name)
        check_model_path(path)
        if backend == "hf":  # (vLLM places its engine itself)
            check_device(device)
        dtype = dtype_name(dtype)
        if backend == "hf":
            backend_kwargs.setdefault("batch_size", batch_size)
        elif not isinstance(backend_kwargs.get("tokenizer", ""), (str, os.PathLike)):
            raise TypeError(
                f"from_pretrained(path, backend={backend!r}) cannot apply a loaded tokenizer "
                f"({type(backend_kwargs['tokenizer']).__name__}): the {backend} engine loads "
                "its own; pass tokenizer= the path or hub id of one, or leave it out")
        # The bundled model keeps its short name (reprs, results, stores), not this
        # machine's path, however it was named.
        backend_kwargs.setdefault("model_name", model_name_for(path))
        loaded = loader.from_pretrained(path, device=device, dtype=dtype, **backend_kwargs)
        try:
            return cls(loaded, spec=spec, backend=backend, probes=probes,
                       probe_defaults=probe_defaults, router=router, on_result=on_result,
                       batch_size=batch_size, capture_last_token=capture_last_token)
        except BaseException:
            loaded.close()
            raise

    # -- introspection -----------------------------------------------------
    @property
    def points(self) -> tuple[ExtractionPoint, ...]:
        return tuple(self.spec)

    @property
    def spec_edits(self) -> tuple[Any, ...]:
        """The spec's steering edits as this model applies them
        (:class:`~undercurrent.steering.vectors.ResolvedEdit`: each vector read,
        when the model was built, from its list, file or SAE)."""
        return tuple(self._spec_edits)

    @property
    def router(self) -> Router:
        """The router (built on first use when none was given)."""
        if self._router is None:
            self._router = Router(self._probes, probe_defaults=self._probe_defaults)
        return self._router

    def capabilities(self) -> Capabilities:
        """Tensor types this backend captures and the valid layers for each."""
        return self.backend.capabilities()

    def __repr__(self) -> str:
        caps = self.capabilities()
        return (f"ProbedModel({self.backend.model_name!r}, backend={self.backend.name!r}, "
                f"layers={caps.num_layers}, points={list(self.spec.names)})")

    # -- generation --------------------------------------------------------
    def _register_edits(self, registered: Sequence[tuple[str, Sequence[Any]]], section: str,
                        more: Sequence[Any]) -> list[Any]:
        """Resolve the ``more`` edits on this model, checked next to the ``registered``
        ones (names unique) and the spec's points; no edits, nothing imported.

        ``registered`` is (list name, edits) per list already checked and
        ``section`` names the list ``more`` came from, so a problem names the edit
        where the user wrote it (``prompt_edits[1][0]``, a duplicate's first use
        in ``the spec's edits[2]``), not its place in the merged list."""
        if not more:
            return []
        earlier = [(name, index, edit) for name, edits in registered
                   for index, edit in enumerate(as_edits(edits))]
        try:
            added = as_edits(more)
        except SpecValidationError as error:
            raise SpecValidationError(
                placed(error.problems, lambda index: (section, index))) from None
        places = [(name, index) for name, index, _ in earlier]
        places += [(section, index) for index in range(len(added))]
        combined = [*(edit for _, _, edit in earlier), *added]
        resolved = register_edits(combined, list(self.spec), self.backend.capabilities(),
                                  places, self.backend.dtype)
        return resolved[len(earlier):]

    def _call_edits(self, edits: Sequence[Any] | None, prompt_edits: Sequence[Any] | None,
                    request_ids: Sequence[str]) -> tuple[list[Any], dict[str, list[Any]]]:
        """Resolved edits for every prompt of a call, and per request id."""
        spec_edits = ("the spec's edits", [resolved.edit for resolved in self._spec_edits])
        shared = self._register_edits([spec_edits], "edits", edits or ())
        if prompt_edits is None:
            return shared, {}
        accepted = (f"prompt_edits must be a list with one entry per prompt "
                    f"({len(request_ids)}), each a list of edits or None")
        if isinstance(prompt_edits, (str, bytes, Mapping)) or not isinstance(prompt_edits,
                                                                              Iterable):
            raise TypeError(f"{accepted}, got {type(prompt_edits).__name__} "
                            f"({prompt_edits!r:.40})")
        prompt_edits = list(prompt_edits)  # (a generator is read once)
        if len(prompt_edits) != len(request_ids):
            raise ValueError(f"{accepted}, got {len(prompt_edits)} entries")
        for index, extra in enumerate(prompt_edits):
            if isinstance(extra, (Mapping, Edit)):
                raise TypeError(f"{accepted}; prompt_edits[{index}] is a single "
                                f"{type(extra).__name__}: wrap it in a list")
            if isinstance(extra, (str, bytes)) or not isinstance(extra, (Iterable, type(None))):
                raise TypeError(f"{accepted}; prompt_edits[{index}] is "
                                f"{type(extra).__name__} ({extra!r:.40})")
        call_edits = ("edits", [resolved.edit for resolved in shared])
        per_request: dict[str, list[Any]] = {}
        problems = []  # (every prompt's, reported at once)
        for index, (request_id, extra) in enumerate(zip(request_ids, prompt_edits,
                                                        strict=True)):
            if not extra:
                continue
            try:
                per_request[request_id] = self._register_edits(
                    [spec_edits, call_edits], f"prompt_edits[{index}]", extra)
            except SpecValidationError as error:
                problems += error.problems
        if problems:
            raise SpecValidationError(problems)
        return shared, per_request

    def _session(self, records: bool, edits: Sequence[Any] = (),
                 request_edits: Mapping[str, Sequence[Any]] | None = None, *,
                 windows: bool = False) -> CaptureSession:
        if self._closed:
            raise BackendError("this ProbedModel is closed")
        router = self.router if self.spec else self._router
        return CaptureSession(router, self.points, model_name=self.backend.model_name,
                              keep_records=records, on_result=self.on_result,
                              edits=[*self._spec_edits, *edits], request_edits=request_edits,
                              windows=windows)

    def _params(self, max_new_tokens: int, temperature: float, top_p: float,
                top_k: int | None, seed: int | None, stop: str | Sequence[str] | None,
                capture_last_token: bool | None) -> SamplingParams:
        if capture_last_token is None:
            capture_last_token = self.capture_last_token
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, stop=stop_strings(stop),
                              capture_last_token=capture_last_token)

    def _new_id(self) -> str:
        return self._new_ids(1)[0]

    def _new_ids(self, count: int) -> list[str]:
        """``count`` fresh request ids (made in C: a call makes one per prompt)."""
        return list(map(f"req-{id(self):x}-".__add__, map(str, itertools.islice(self._ids, count))))

    def _prompts(self, prompts: Any, input_ids: Any) -> list[Any]:
        return prompt_inputs(prompts, input_ids, getattr(self.backend, "vocab_size", None))

    def _request_ids(self, count: int, request_ids: Sequence[str] | None) -> list[str]:
        if request_ids is None:
            return self._new_ids(count)
        if isinstance(request_ids, (str, bytes)):  # (not one id per character)
            raise TypeError(f"request_ids must be a list of strings, one per prompt, got "
                            f"the {type(request_ids).__name__} {request_ids!r:.40}")
        ids = list(request_ids)
        for index, request_id in enumerate(ids):
            _check_request_id(request_id, f"request_ids[{index}]")
        if len(ids) != count or len(set(ids)) != len(ids):
            raise ValueError("request_ids must be unique and one per prompt")
        return ids

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        *,
        input_ids: Any = None,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        records: bool = False,
        capture_last_token: bool | None = None,
        batch_size: int | None = None,
        request_ids: Sequence[str] | None = None,
        edits: Sequence[Any] | None = None,
        prompt_edits: Sequence[Sequence[Any] | None] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for each prompt (batched) with the probes attached.

        Returns one :class:`GenerationOutput` per prompt, in order (a single
        string prompt gives a list of one). ``input_ids`` replaces ``prompts`` with
        token ids already encoded (a list of token-id lists, one list for one
        prompt, or a 1-D/2-D tensor without padding), fed to the model as they are;
        give exactly one of the two. ``temperature=0`` is greedy; ``seed`` makes
        sampling reproducible; ``stop`` strings end a prompt's generation;
        ``records=True`` keeps the captured ``ActivationRecord``s on each output;
        ``capture_last_token=True`` runs one extra forward step so the last sampled
        token (never fed back to the model) is captured too.

        ``edits`` (``Edit`` objects or spec-form mappings) apply to every prompt of
        this call, after the spec's own; ``prompt_edits`` gives one entry per
        prompt (a list of edits, or None), so one request can be steered while
        another in the same batch is untouched. See ``docs/steering.md``.
        """
        inputs = self._prompts(prompts, input_ids)
        ids = self._request_ids(len(inputs), request_ids)
        params = self._params(max_new_tokens, temperature, top_p, top_k, seed, stop,
                              capture_last_token)
        batch_size = check_batch_size(batch_size)
        shared, per_request = self._call_edits(edits, prompt_edits, ids)
        # Nothing reads a signal before its request ends: steps may be judged in windows.
        session = self._session(check_flag("records", records), shared, per_request,
                                windows=True)
        return self.backend.generate(inputs, ids, params, session,
                                     batch_size=batch_size or self.batch_size)

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Any = None,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        records: bool = False,
        capture_last_token: bool | None = None,
        request_id: str | None = None,
        edits: Sequence[Any] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield a :class:`StreamEvent` per generated token (its id, its text piece
        and the inline probe signals that arrived since the previous event), then
        a final event (``finished=True``) carrying the complete output. The pieces
        joined equal ``output.text`` (a stop string is never streamed).
        ``input_ids`` (one prompt's token ids) replaces ``prompt``. ``edits`` apply to
        this prompt, after the spec's own."""
        if (prompt is not None or input_ids is None) and not isinstance(prompt, str):
            raise TypeError(f"stream() takes one prompt string, got {type(prompt).__name__}; "
                            "use generate() for a list of prompts, or input_ids= for one "
                            "prompt's token ids")
        inputs = self._prompts(prompt, input_ids)
        if len(inputs) != 1:
            raise ValueError(f"stream() takes one prompt, got {len(inputs)} rows of input_ids; "
                             "use generate() for several")
        params = self._params(max_new_tokens, temperature, top_p, top_k, seed, stop,
                              capture_last_token)
        if request_id is not None:
            _check_request_id(request_id, "request_id")
        shared, _ = self._call_edits(edits, None, ())
        session = self._session(check_flag("records", records), shared)
        return self.backend.stream(inputs[0], request_id or self._new_id(), params, session)

    def prompt_activations(
        self,
        prompts: str | Sequence[str] | None = None,
        *,
        input_ids: Any = None,
        batch_size: int | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[GenerationOutput]:
        """The spec's activations for each prompt, from one forward pass, without
        generating: undercurrent's ``run_with_cache``.

        Returns one :class:`GenerationOutput` per prompt with ``records`` (every
        record the spec's points select among the prompt tokens; positions of
        generated tokens match nothing), the probes' ``results`` and ``signals``,
        ``text=""``, ``token_ids=()`` and ``finish_reason="forward"`` (``"abort"``
        when an inline probe aborted on a prompt token). ``records_frame`` and
        ``fit_linear_probe`` take the outputs directly.

        >>> outs = pm.prompt_activations(["a prompt", "another"])      # doctest: +SKIP
        >>> frame = records_frame(outs)                                # doctest: +SKIP
        """
        inputs = self._prompts(prompts, input_ids)
        ids = self._request_ids(len(inputs), request_ids)
        # One token with nothing fed back is exactly the prefill forward: every
        # backend captures the prompt there, and the sampled token is dropped.
        params = SamplingParams(max_new_tokens=1, prompt_only=True)
        batch_size = check_batch_size(batch_size)
        session = self._session(True)
        outputs = self.backend.generate(inputs, ids, params, session,
                                        batch_size=batch_size or self.batch_size)
        return [dataclasses.replace(output, text="", token_ids=(),
                                    finish_reason="abort" if output.aborted else "forward")
                for output in outputs]

    def capture(
        self,
        prompts: Sequence[str],
        out_dir: str | os.PathLike[str],
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        batch_size: int | None = None,
        storage_dtype: str | None = None,
        resume: bool = True,
        progress: bool = True,
        **options: Any,
    ) -> CaptureSummary:
        """Generate for every prompt and write every record of the spec's points to
        an activation store in ``out_dir``, as generation runs; returns a
        :class:`~undercurrent.store.CaptureSummary` (path, requests, vectors, bytes).

        Memory stays flat in the number of prompts (one batch of records at a
        time); a killed run started again with ``resume=True`` skips the prompts
        already committed. ``storage_dtype`` (``"float16"``, ``"bfloat16"``,
        ``"float32"``; default the model's) sets what is stored. ``options``:
        ``reduce={point: "last_token" | "mean_generated" | "project:K"}``,
        ``shard="i/N"`` (write part i of N of the prompt list, so N processes can
        share one directory), ``shard_prompts`` (prompts per committed shard),
        ``top_p``, ``top_k`` and ``stop``. Every argument is checked before anything
        is written: a call refused for a bad value (an empty prompt list included)
        leaves ``out_dir`` as it found it. Read it with
        :func:`undercurrent.open_activations`; see ``docs/store.md``. An option it
        does not take is a ``TypeError`` listing those it does (``edits`` belong in
        the spec and ``capture_last_token`` on the ``ProbedModel``: both are part
        of what the store was captured with).
        """
        _check_capture_options(options)
        return capture_activations(
            self, prompts, out_dir, max_new_tokens=max_new_tokens, temperature=temperature,
            seed=seed, batch_size=batch_size, storage_dtype=storage_dtype, resume=resume,
            progress=progress, **options)

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        """Remove every hook (the model behaves exactly as before) and shut down the
        router this object built. Idempotent. A generation running in another thread
        ends first (the HF backend waits for it); from inside this model's own
        generation (a probe or a callback, an async probe's worker included) it is
        refused."""
        if self._closed:
            return
        check_closable = getattr(self.backend, "check_closable", None)
        if check_closable is not None:
            check_closable()  # (inside its own generation: refused, nothing closed)
        self._closed = True
        try:
            self.backend.close()
        finally:
            if self._owns_router and self._router is not None:
                self._router.shutdown()

    def __enter__(self) -> ProbedModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
