"""SAELens's on-disk sparse autoencoder format, read without importing SAELens.

A folder holds ``cfg.json`` (the SAE config as SAELens writes it) and
``sae_weights.safetensors`` with ``W_enc`` ``(d_in, d_sae)``, ``b_enc``
``(d_sae,)``, ``W_dec`` ``(d_sae, d_in)``, ``b_dec`` ``(d_in,)`` and, for
JumpReLU, ``threshold`` ``(d_sae,)`` (older files hold ``log_threshold``).

:class:`SparseAutoencoder` encodes a batch of activations with one matrix
product, following the config's own fields as SAELens's inference classes do:

- ``architecture``: ``standard`` (ReLU), ``jumprelu`` (ReLU where the
  pre-activation is above ``threshold``, else 0) or ``topk`` (the ``k`` largest
  pre-activations, ReLU'd; with ``rescale_acts_by_decoder_norm`` the
  pre-activations are first multiplied by the decoder rows' norms);
- ``normalize_activations``: ``constant_norm_rescale`` scales each input to
  norm ``sqrt(d_in)``; ``layer_norm`` subtracts the input's mean and divides by
  its (unbiased) standard deviation plus 1e-5; ``none``,
  ``expected_average_only_in`` and ``covariance_whitening`` leave the input as
  it is (SAELens folds those into the weights before saving, and its inference
  SAE applies nothing for them);
- ``apply_b_dec_to_input``: subtract ``b_dec`` before the encoder;
- ``activation_fn`` (``activation_fn_str`` before 6.0), where given, must be
  the architecture's own (``relu``; ``relu`` or ``jumprelu``; ``topk``): any
  other is refused, not read as ReLU.

Pre-6.0 configs (``hook_point``, ``activation_fn: topk`` with
``activation_fn_kwargs.k``, ``architecture: topk`` with ``k`` only in
``activation_fn_kwargs``) are read the way SAELens upgrades them; one whose
hook name holds ``hook_z`` is a per-head SAE to SAELens (as
``reshape_activations: hook_z`` is) and is refused at load, like those.
Arithmetic is float64 whatever the file's dtype.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undercurrent.probes.arrays import numpy_module
from undercurrent.probes.sparse import SparseRows, row_products, top_columns
from undercurrent.probes.weights import ProbeFileError, resolve_probe_path, safetensors_arrays

SAE_CONFIG_FILE = "cfg.json"
SAE_WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk")
# The activation functions a config may name for each architecture (SAELens < 6
# wrote activation_fn_str "relu" for JumpReLU SAEs; a TopK SAE also needs its k).
_ACTIVATION_FUNCTIONS = {
    "standard": ("relu",),
    "jumprelu": ("relu", "jumprelu"),
    "topk": ("topk",),
}
_BOOLEAN_FIELDS = ("apply_b_dec_to_input", "rescale_acts_by_decoder_norm")
# What SAELens's inference SAE does to its input for each normalize_activations value.
_INPUT_NORMALISATIONS = {
    "none": "none",
    "expected_average_only_in": "none",
    "covariance_whitening": "none",
    "constant_norm_rescale": "constant_norm_rescale",
    "layer_norm": "layer_norm",
}
_LAYER_NORM_EPS = 1e-5


class SaeFileError(ProbeFileError):
    """An SAE folder that is missing, unreadable, or not in SAELens's format."""


#: Rows :meth:`SparseAutoencoder.encode_sparse` encodes at a time (their
#: features' matrix stays in the CPU's cache).
ENCODE_ROWS = 64


@dataclass(frozen=True)
class SparseAutoencoder:
    """A loaded SAE (float64, read-only arrays) and the config fields it follows.

    ``source`` names the folder for messages; ``hook_name`` is where SAELens says
    the SAE reads activations (``blocks.3.hook_resid_post``), or None.
    """

    source: str
    folder: Path
    architecture: str
    W_enc: Any
    b_enc: Any
    W_dec: Any
    b_dec: Any
    threshold: Any = None
    k: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    rescale_acts_by_decoder_norm: bool = False
    hook_name: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def decoder_norms(self) -> Any:
        """The L2 norm of each decoder row, ``(d_sae,)`` (computed once)."""
        return numpy_module().linalg.norm(self.W_dec, axis=1)

    @property
    def rescales_by_decoder_norm(self) -> bool:
        """Whether ``rescale_acts_by_decoder_norm`` applies: to a topk SAE only
        (SAELens's other inference SAEs have no such field and ignore it, in
        encode and decode alike)."""
        return self.architecture == "topk" and self.rescale_acts_by_decoder_norm

    @property
    def d_in(self) -> int:
        """The activation size the SAE reads."""
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """The number of features."""
        return int(self.W_enc.shape[1])

    def _normalised_input(self, matrix: Any) -> tuple[Any, Any]:
        """The encoder's input and, per row, the factor decode multiplies back by."""
        np = numpy_module()
        mode = _INPUT_NORMALISATIONS[self.normalize_activations]
        ones = np.ones((matrix.shape[0], 1))
        if mode == "constant_norm_rescale":
            norms = np.linalg.norm(matrix, axis=1, keepdims=True)
            return matrix * (math.sqrt(self.d_in) / norms), norms / math.sqrt(self.d_in)
        if mode == "layer_norm":
            centred = matrix - matrix.mean(axis=1, keepdims=True)
            spread = centred.std(axis=1, ddof=1, keepdims=True)
            # decode multiplies back by the standard deviation alone, without the eps
            return centred / (spread + _LAYER_NORM_EPS), spread
        return matrix, ones

    def encode(self, matrix: Any) -> Any:
        """Feature activations ``(rows, d_sae)`` for activations ``(rows, d_in)``."""
        return self._encode(self._checked(matrix))[0]

    def encode_sparse(self, matrix: Any) -> SparseRows:
        """:meth:`encode` kept by its nonzero activations
        (:class:`~undercurrent.probes.sparse.SparseRows`), computed
        :data:`ENCODE_ROWS` rows at a time: no matrix of every row's features
        is made."""
        matrix = self._checked(matrix)
        blocks = [self._encode_block(matrix[start:start + ENCODE_ROWS])
                  for start in range(0, max(len(matrix), 1), ENCODE_ROWS)]
        return SparseRows.join_rows(blocks)

    def _encode_block(self, matrix: Any) -> SparseRows:
        if self.architecture != "topk":
            return SparseRows.from_dense(self._encode(matrix)[0])
        # (a topk SAE's active features are known: no matrix of every feature)
        top, values = self._top(self._pre_activations(matrix)[0])
        return SparseRows.from_columns(top, values, self.d_sae)

    def _checked(self, matrix: Any) -> Any:
        np = numpy_module()
        matrix = np.asarray(matrix, dtype=np.float64)
        if matrix.ndim == 1:
            matrix = matrix[None, :]
        if matrix.ndim != 2 or matrix.shape[1] != self.d_in:
            raise ValueError(
                f"{self.source}: expects activations of size d_in={self.d_in}, got "
                f"{matrix.shape[-1] if matrix.ndim else 'a scalar'} values per activation"
            )
        return matrix

    def _encode(self, matrix: Any) -> tuple[Any, Any]:
        np = numpy_module()
        pre, out_scale = self._pre_activations(matrix)
        if self.architecture == "standard":
            return np.maximum(pre, 0.0), out_scale
        if self.architecture == "jumprelu":
            # (NaN stays NaN, as in SAELens: a NaN activation is not a silent one)
            return np.where((pre > self.threshold) | np.isnan(pre), np.maximum(pre, 0.0),
                            0.0), out_scale
        top, values = self._top(pre)
        acts = np.zeros_like(pre)
        np.put_along_axis(acts, top, values, 1)
        return acts, out_scale

    def _pre_activations(self, matrix: Any) -> tuple[Any, Any]:
        """The encoder's pre-activations (scaled by the decoder norms where a
        topk config says so), and the factor decode multiplies back by."""
        inputs, out_scale = self._normalised_input(matrix)
        if self.apply_b_dec_to_input:
            inputs = inputs - self.b_dec
        # (each row's product the same bits whatever batch it is in: row_products)
        pre = row_products(inputs, self.W_enc) + self.b_enc
        if self.rescales_by_decoder_norm:
            pre = pre * self.decoder_norms
        return pre, out_scale

    def _top(self, pre: Any) -> tuple[Any, Any]:
        """A topk SAE's active features of each row, in column order, and their
        activations (the pre-activation, or 0 where it is negative)."""
        np = numpy_module()
        assert self.k is not None
        top = np.sort(top_columns(pre, min(self.k, self.d_sae)), axis=1)
        return top, np.maximum(np.take_along_axis(pre, top, axis=1), 0.0)

    def activation_bounds(self, matrix: Any, features: Sequence[int]) -> Any:
        """For activations ``(rows, d_in)``, a bound at or above each of
        ``features`` ' activations in each row, ``(rows, len(features))``,
        computed from those features' encoder columns alone: every architecture
        gives a feature 0 or its pre-activation (scaled by its decoder norm where
        the config says so), and 1e-9 of the magnitude of the product's terms
        is added for the rounding of another order of summation. For an abort
        screen (``sae_probe``)."""
        np = numpy_module()
        inputs, _ = self._normalised_input(self._checked(matrix))
        if self.apply_b_dec_to_input:
            inputs = inputs - self.b_dec
        weights, bias = self.W_enc[:, list(features)], self.b_enc[list(features)]
        pre = inputs @ weights + bias
        size = np.abs(inputs) @ np.abs(weights) + np.abs(bias)
        if self.rescales_by_decoder_norm:
            scale = self.decoder_norms[list(features)]
            pre, size = pre * scale, size * scale
        return np.maximum(pre + 1e-9 * size, 0.0)

    def decoder_direction(self, feature: int) -> Any:
        """What one unit of ``feature`` adds to the reconstruction, in the SAE's input
        space: ``W_dec[feature]`` (divided by its norm when a topk SAE's config
        sets ``rescale_acts_by_decoder_norm``, as SAELens's decode does; other
        architectures ignore that field, as SAELens does)."""
        np = numpy_module()
        index = self.feature_index(feature)
        row = np.array(self.W_dec[index], dtype=np.float64)
        if self.rescales_by_decoder_norm:
            row = row / self.decoder_norms[index]
        return row

    def clamp_delta(self, activations: Any, feature: int, value: float) -> Any:
        """``(value - f_i(h)) * d_i`` per row: what to add to ``h`` so the SAE's
        reconstruction has feature ``i`` at ``value``, leaving the error term
        ``h - decode(encode(h))`` exactly as it was.

        ``d_i`` is :meth:`decoder_direction`, mapped back through the input
        normalisation the config declares (``layer_norm`` multiplies by the row's
        standard deviation, ``constant_norm_rescale`` by ``|h| / sqrt(d_in)``), as
        SAELens's decode does. Returns ``(rows, d_in)`` float64.
        """
        matrix = self._checked(activations)
        acts, out_scale = self._encode(matrix)
        index = self.feature_index(feature)
        gap = float(value) - acts[:, index : index + 1]
        return gap * out_scale * self.decoder_direction(index)[None, :]

    def feature_index(self, feature: Any) -> int:
        """``feature`` as a checked index in ``0..d_sae-1``."""
        if isinstance(feature, bool) or not isinstance(feature, int):
            try:
                as_int = int(feature)
            except (TypeError, ValueError):
                as_int = None
            if as_int is None or as_int != feature or isinstance(feature, bool):
                raise ValueError(f"{self.source}: feature ids are ints, got {feature!r}")
            feature = as_int
        assert isinstance(feature, int)
        if not 0 <= feature < self.d_sae:
            raise ValueError(
                f"{self.source}: feature {feature} out of range; this SAE has d_sae="
                f"{self.d_sae} features (0..{self.d_sae - 1})"
            )
        return feature


def resolve_sae_folder(path: str | os.PathLike[str]) -> Path:
    """The SAE folder ``path`` names (``undercurrent:`` package paths included);
    a path to its ``cfg.json`` or weights file means the folder holding it."""
    resolved = resolve_probe_path(path)
    if resolved.name in (SAE_CONFIG_FILE, SAE_WEIGHTS_FILE):
        return resolved.parent
    return resolved


def load_sae(path: str | os.PathLike[str]) -> SparseAutoencoder:
    """Read an SAE folder in SAELens's format (cached by path and file times).

    Raises :class:`SaeFileError` naming the folder when a file is missing, the
    config asks for something unsupported, or the arrays do not fit the config.
    """
    folder = resolve_sae_folder(path)
    stamps = []
    for name in (SAE_CONFIG_FILE, SAE_WEIGHTS_FILE):
        try:
            stat = (folder / name).stat()
        except OSError:
            raise SaeFileError(
                f"SAE folder {str(path)!r}: no {name} (an SAELens SAE folder holds "
                f"{SAE_CONFIG_FILE} and {SAE_WEIGHTS_FILE}; looked in {str(folder)!r})"
            ) from None
        stamps.append((stat.st_mtime_ns, stat.st_size))
    return _load_cached(str(folder), tuple(stamps))


def sae_decoder_direction(path: str | os.PathLike[str], feature: int) -> Any:
    """Feature ``feature``'s decoder direction for the SAE folder at ``path``
    (see :meth:`SparseAutoencoder.decoder_direction`), float64 ``(d_in,)``."""
    return load_sae(path).decoder_direction(feature)


def sae_clamp_delta(
    sae: SparseAutoencoder | str | os.PathLike[str], activations: Any, feature: int, value: float
) -> Any:
    """``(c - f_i(h)) * W_dec[i]`` for each row ``h`` of ``activations``; add it to ``h``
    to clamp feature ``i`` to ``c`` while keeping the SAE's error term (see
    :meth:`SparseAutoencoder.clamp_delta`; ``sae`` is a loaded SAE or a folder)."""
    loaded = sae if isinstance(sae, SparseAutoencoder) else load_sae(sae)
    return loaded.clamp_delta(activations, feature, value)


@functools.lru_cache(maxsize=8)
def _load_cached(folder: str, stamps: tuple[tuple[int, int], ...]) -> SparseAutoencoder:
    source = f"SAE folder {folder!r}"
    try:
        config = json.loads((Path(folder) / SAE_CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise SaeFileError(f"{source}: {SAE_CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise SaeFileError(f"{source}: {SAE_CONFIG_FILE} must hold a JSON object")
    _refuse_pre_6_hook_z(source, config)
    config = _upgraded_config(config)
    arrays = _read_weights(Path(folder) / SAE_WEIGHTS_FILE, source)
    return _build(source, Path(folder), config, arrays)


def _written_before_6(config: dict[str, Any]) -> bool:
    """Whether SAELens before 6.0 wrote ``config`` (no ``sae_lens_version``, at the
    top level or in ``metadata``, or one below 6): SAELens then reads it with its
    pre-6 defaults."""
    metadata = config.get("metadata")
    version = config.get("sae_lens_version") or (
        metadata.get("sae_lens_version") if isinstance(metadata, dict) else None)
    if not version:
        return True
    major = str(version).lstrip("v").split(".", 1)[0]
    return not major.isdigit() or int(major) < 6


def _refuse_pre_6_hook_z(source: str, config: dict[str, Any]) -> None:
    """Refuse a pre-6.0 config whose hook is attention's ``hook_z`` and which has no
    ``reshape_activations``: SAELens reads it as a per-head hook_z SAE (its
    ``d_in`` is ``n_heads * d_head``, fed z flattened from ``[n_heads, d_head]``:
    ``reshape_activations`` defaults to ``hook_z`` when the hook name holds
    ``hook_z``), which sae_probe cannot feed, not as a plain SAE on ``attn_out``."""
    if "reshape_activations" in config or not _written_before_6(config):
        return
    for field_name in ("hook_name", "hook_point"):
        hook = config.get(field_name)
        if isinstance(hook, str) and "hook_z" in hook:
            raise SaeFileError(
                f"{source}: {SAE_CONFIG_FILE} field {field_name} is {hook!r} and the file "
                "has no reshape_activations (written before SAELens 6.0): SAELens reads it "
                "as a per-head hook_z SAE (reshape_activations 'hook_z': attention's z, "
                "[n_heads, d_head] flattened, before the output projection), which is not "
                "supported; undercurrent captures attention after its output projection "
                "(attn_out)"
            )


def _upgraded_config(config: dict[str, Any]) -> dict[str, Any]:
    """Pre-6.0 SAELens configs, read with the 6.x field names."""
    upgraded = dict(config)
    if "hook_point" in upgraded and "hook_name" not in upgraded:
        upgraded["hook_name"] = upgraded["hook_point"]
    activation_fn = upgraded.get("activation_fn", upgraded.get("activation_fn_str"))
    kwargs = upgraded.get("activation_fn_kwargs")
    kwargs_k = kwargs.get("k") if isinstance(kwargs, dict) else None
    if kwargs_k is not None:
        # SAELens < 6 kept a TopK SAE's k in activation_fn_kwargs, whether its
        # architecture said "standard" (or nothing) with activation_fn topk, or "topk"
        if activation_fn == "topk" and upgraded.get("architecture", "standard") == "standard":
            upgraded["architecture"] = "topk"
        if upgraded.get("architecture") == "topk":
            upgraded.setdefault("k", kwargs_k)
    upgraded.setdefault("architecture", "standard")
    if isinstance(upgraded.get("normalize_activations"), bool):
        upgraded["normalize_activations"] = (
            "expected_average_only_in" if upgraded["normalize_activations"] else "none"
        )
    if upgraded.get("normalize_activations") is None:
        upgraded["normalize_activations"] = "none"
    return upgraded


def _read_weights(path: Path, source: str) -> dict[str, Any]:
    np = numpy_module()
    try:
        import safetensors  # noqa: F401
    except ImportError as exc:  # pragma: no cover - safetensors ships with the hf extra
        raise ImportError(
            f"{source}: reading SAE weights needs the safetensors package; "
            "install it with `pip install undercurrent[hf]`"
        ) from exc
    try:
        arrays = safetensors_arrays(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise SaeFileError(
            f"{source}: {path.name} is not a readable safetensors file ({exc})"
        ) from None
    return {name: np.asarray(array, dtype=np.float64) for name, array in arrays.items()}


def _build(
    source: str, folder: Path, config: dict[str, Any], arrays: dict[str, Any]
) -> SparseAutoencoder:
    np = numpy_module()
    architecture = config.get("architecture")
    if architecture not in ARCHITECTURES:
        raise SaeFileError(
            f"{source}: architecture {architecture!r} is not supported; sae_probe reads "
            f"{', '.join(ARCHITECTURES)}"
        )
    _check_activation_function(source, config, architecture)
    for name in _BOOLEAN_FIELDS:
        if name in config and not isinstance(config[name], bool):
            raise SaeFileError(
                f"{source}: {SAE_CONFIG_FILE} field {name} must be true or false, got "
                f"{config[name]!r}"
            )
    normalisation = config.get("normalize_activations", "none")
    if not isinstance(normalisation, str) or normalisation not in _INPUT_NORMALISATIONS:
        raise SaeFileError(
            f"{source}: normalize_activations {normalisation!r} is not one SAELens defines "
            f"({', '.join(_INPUT_NORMALISATIONS)})"
        )
    if config.get("reshape_activations", "none") not in ("none", None):
        raise SaeFileError(
            f"{source}: reshape_activations {config['reshape_activations']!r} (per-head "
            "hook_z SAEs) is not supported; undercurrent captures attention after its "
            "output projection (attn_out)"
        )
    scaling = arrays.pop("scaling_factor", None)
    if scaling is not None and not np.allclose(scaling, 1.0):
        raise SaeFileError(
            f"{source}: holds a finetuning scaling_factor, which sae_probe does not apply"
        )
    if "log_threshold" in arrays and "threshold" not in arrays:
        arrays["threshold"] = np.exp(arrays.pop("log_threshold"))
    needed = ["W_enc", "b_enc", "W_dec", "b_dec"] + (
        ["threshold"] if architecture == "jumprelu" else []
    )
    missing = [name for name in needed if name not in arrays]
    if missing:
        raise SaeFileError(
            f"{source}: {SAE_WEIGHTS_FILE} lacks {', '.join(missing)} for a {architecture} "
            f"SAE; it holds {sorted(arrays) or 'nothing'}"
        )
    w_enc, w_dec = arrays["W_enc"], arrays["W_dec"]
    if w_enc.ndim != 2:
        raise SaeFileError(f"{source}: W_enc must be (d_in, d_sae), got shape {w_enc.shape}")
    d_in, d_sae = w_enc.shape
    expected = {
        "W_dec": (d_sae, d_in),
        "b_enc": (d_sae,),
        "b_dec": (d_in,),
        "threshold": (d_sae,),
    }
    for name, shape in expected.items():
        if name in arrays and arrays[name].shape != shape:
            raise SaeFileError(
                f"{source}: {name} has shape {arrays[name].shape}; with W_enc {w_enc.shape} "
                f"it must be {shape}"
            )
    declared = {"d_in": d_in, "d_sae": d_sae}
    for name, actual in declared.items():
        value = config.get(name)  # (a whole float, 128.0, as some writers give, is 128)
        if name in config and (isinstance(value, bool) or not (
                isinstance(value, int) or (isinstance(value, float) and value.is_integer()))):
            raise SaeFileError(
                f"{source}: {SAE_CONFIG_FILE} field {name} must be an integer, got "
                f"{type(config[name]).__name__} ({config[name]!r:.40})"
            )
        if name in config and config[name] != actual:
            raise SaeFileError(
                f"{source}: {SAE_CONFIG_FILE} says {name}={config[name]} but the weights "
                f"have {actual}"
            )
    k = None
    if architecture == "topk":
        k = config.get("k")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise SaeFileError(f"{source}: a topk SAE needs k, an int >= 1, got {k!r}")
        if k > d_sae:
            raise SaeFileError(
                f"{source}: k={k} is more than the SAE's d_sae={d_sae} features; a topk "
                f"SAE keeps k of them (1..{d_sae})"
            )
    for name in needed:
        if not np.isfinite(arrays[name]).all():
            raise SaeFileError(f"{source}: {name} holds NaN or inf")
    for array in arrays.values():
        array.setflags(write=False)
    found = config.get("metadata")
    metadata: dict[str, Any] = found if isinstance(found, dict) else {}
    hook_name = metadata.get("hook_name", config.get("hook_name"))
    return SparseAutoencoder(
        source=source,
        folder=folder,
        architecture=architecture,
        W_enc=w_enc,
        b_enc=arrays["b_enc"],
        W_dec=w_dec,
        b_dec=arrays["b_dec"],
        threshold=arrays.get("threshold") if architecture == "jumprelu" else None,
        k=k,
        apply_b_dec_to_input=config.get("apply_b_dec_to_input", True),
        normalize_activations=normalisation,
        rescale_acts_by_decoder_norm=config.get("rescale_acts_by_decoder_norm", False),
        hook_name=str(hook_name) if hook_name is not None else None,
        config=config,
    )


def _check_activation_function(source: str, config: dict[str, Any], architecture: str) -> None:
    """Refuse an activation function other than the one ``architecture`` computes
    (SAELens < 6 named it in ``activation_fn_str``; it is not read as ReLU)."""
    allowed = _ACTIVATION_FUNCTIONS[architecture]
    for name in ("activation_fn", "activation_fn_str"):
        value = config.get(name)
        if value is None or value in allowed:
            continue
        if value == "topk" and architecture == "standard":
            raise SaeFileError(
                f"{source}: {SAE_CONFIG_FILE} field {name} is 'topk' but gives no k; a TopK "
                "SAE names it in activation_fn_kwargs.k (SAELens < 6) or as k with "
                "architecture 'topk'"
            )
        supported = "; ".join(f"{arch}: {' or '.join(functions)}"
                              for arch, functions in _ACTIVATION_FUNCTIONS.items())
        raise SaeFileError(
            f"{source}: {SAE_CONFIG_FILE} field {name} {value!r} is not supported for a "
            f"{architecture} SAE; the supported ones, by architecture: {supported} (with k)"
        )
