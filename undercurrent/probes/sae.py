"""``sae_probe``: watch a sparse autoencoder's features live, in SAELens's format.

Each batch of captured activations is encoded with one matrix product (see
:mod:`undercurrent.probes.sae_files` for the format and the arithmetic); signals
carry the watched (or most active) features and their activations, and the
verdict summarises every reported feature over the request.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from undercurrent.probes.arrays import batch_matrix, numpy_module
from undercurrent.probes.base import Probe, RequestContext
from undercurrent.probes.sae_files import SparseAutoencoder, load_sae
from undercurrent.probes.scoring import ScoreSummary, ThresholdRule
from undercurrent.records import ActivationBatch, ActivationRecord, BatchSignals, ProbeSignal
from undercurrent.spec.types import ProbeKind

DEFAULT_TOP_K = 5

# SAELens hook names (TransformerLens and transformers module paths) -> the
# (layer offset, tensor type) undercurrent captures there; layer None = final_norm.
_HOOKS: tuple[tuple[re.Pattern[str], int | None, str], ...] = (
    (re.compile(r"blocks\.(\d+)\.hook_resid_post"), 0, "residual_stream"),
    (re.compile(r"blocks\.(\d+)\.hook_resid_pre"), -1, "residual_stream"),
    (re.compile(r"blocks\.(\d+)\.hook_attn_out"), 0, "attn_out"),
    (re.compile(r"blocks\.(\d+)\.hook_mlp_out"), 0, "mlp_out"),
    (re.compile(r"ln_final\.hook_normalized"), None, "final_norm"),
    (re.compile(r"(?:model\.)?layers\.(\d+)"), 0, "residual_stream"),
    (re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn"), 0, "attn_out"),
    (re.compile(r"(?:model\.)?layers\.(\d+)\.mlp"), 0, "mlp_out"),
    (re.compile(r"(?:model\.)?norm"), None, "final_norm"),
)
_HOOK_FORMS = (
    "blocks.L.hook_resid_post, blocks.L.hook_resid_pre, blocks.L.hook_attn_out, "
    "blocks.L.hook_mlp_out, ln_final.hook_normalized, model.layers.L[.self_attn|.mlp], "
    "model.norm"
)


def hook_site(hook_name: str) -> tuple[int | None, str] | None:
    """``(layer, tensor_type)`` that an SAELens ``hook_name`` reads, in undercurrent's
    numbering (layer None for ``final_norm``, whose layer is the model's layer
    count); None when the name is none of the understood forms.

    >>> hook_site("blocks.3.hook_resid_post"), hook_site("blocks.3.hook_resid_pre")
    ((3, 'residual_stream'), (2, 'residual_stream'))
    """
    for pattern, offset, tensor_type in _HOOKS:
        match = pattern.fullmatch(hook_name.strip())
        if match is None:
            continue
        if offset is None:
            return None, tensor_type
        return int(match.group(1)) + offset, tensor_type
    return None


def check_point_matches_hook(sae: SparseAutoencoder, point: Any) -> None:
    """Raise ValueError when ``point`` captures something other than what the SAE's
    ``hook_name`` says it was trained on (layer or tensor type); a SAE without a
    ``hook_name`` is not checked."""
    hook = sae.hook_name
    if hook is None:
        return
    advice = "fix the spec or pass check_hook: false"
    site = hook_site(hook)
    if site is None:
        raise ValueError(
            f"{sae.source} reads hook_name {hook!r}, which undercurrent cannot map to a "
            f"layer and tensor type (understood: {_HOOK_FORMS}); {advice}"
        )
    layer, tensor_type = site
    captured = point.tensor_type.value
    if layer is not None and layer < 0:
        raise ValueError(
            f"{sae.source} reads {hook!r} (the embeddings), which no extraction point "
            f"captures; {advice}"
        )
    if tensor_type != captured:
        raise ValueError(
            f"{sae.source} was trained on {tensor_type} ({hook!r}), but extraction point "
            f"{point.name!r} captures {captured}; {advice}"
        )
    wrong = [lay for lay in point.layers if layer is not None and lay != layer]
    if wrong:
        raise ValueError(
            f"{sae.source} was trained on layer {layer} ({hook!r}), but extraction point "
            f"{point.name!r} captures layers {list(point.layers)}; {advice}"
        )


class SaeProbe(Probe):
    """``sae_probe``: encode each activation with an SAE and report its features.

    probe_args:

    - ``path``: the SAE folder (``cfg.json`` + ``sae_weights.safetensors``, as
      SAELens saves it); ``undercurrent:models/tiny/sae`` is the bundled one;
    - ``features``: the feature ids to watch (a list, or one id); or ``top_k``: report the k most
      active features of each activation (default 5 when neither is given);
    - ``threshold``: a watched feature (any feature, under ``top_k``) at or above
      it triggers ``action``; default none;
    - ``action``: ``flag`` (default) or ``abort``;
    - ``check_hook``: when true (default), :meth:`check_point` (and ``on_start``)
      refuses a point whose layer or tensor type contradicts the SAE's ``hook_name``.

    Each activation gets a signal whose score is the largest watched (or top)
    activation; its metadata holds ``features`` and ``activations`` (parallel
    lists: all watched features, or the top ones that are active, most active
    first), and ``layer``, ``token_index``, ``generated_index``.

    The verdict is a :class:`~undercurrent.probes.scoring.ScoreSummary` dict of
    those scores, plus ``features``: one dict per watched feature (under
    ``top_k``: per feature among the request's top ``top_k`` by peak) with
    ``feature``, ``max``, ``mean`` (over every activation of the request),
    ``first_crossing_token_index``/``first_crossing_layer`` (None without a
    threshold or a crossing) and ``first_active_token_index``/``first_active_layer``
    (first activation > 0); and ``source``, ``architecture``, ``hook_name``, ``d_sae``.
    """

    probe_kind: ClassVar[ProbeKind | tuple[ProbeKind, ...]] = (
        ProbeKind.SINGLE_SHOT,
        ProbeKind.TRAJECTORY,
    )

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        features: Sequence[int] | int | None = None,
        top_k: int | None = None,
        threshold: float | None = None,
        action: str = "flag",
        check_hook: bool = True,
    ) -> None:
        self.sae = load_sae(path)
        if features is not None and top_k is not None:
            raise ValueError("give either features (ids to watch) or top_k, not both")
        if isinstance(features, int) and not isinstance(features, bool):
            features = [features]
        if features is not None:
            if isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
                raise ValueError(f"features must be a list of feature ids, got {features!r}")
            if not features:
                raise ValueError("features must name at least one feature id")
            self.features: tuple[int, ...] | None = tuple(
                dict.fromkeys(self.sae.feature_index(f) for f in features)
            )
            self.top_k = len(self.features)
        else:
            self.features = None
            chosen = DEFAULT_TOP_K if top_k is None else top_k
            if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < 1:
                raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
            self.top_k = min(chosen, self.sae.d_sae)
        self.rule = ThresholdRule.from_options(threshold, action)
        self.check_hook = bool(check_hook)
        self._reset()

    def _reset(self) -> None:
        np = numpy_module()
        d_sae = self.sae.d_sae
        self.summary = ScoreSummary(self.rule.threshold)
        self._peak = np.zeros(d_sae)
        self._total = np.zeros(d_sae)
        self._rows = 0
        # (token_index, layer) of each feature's first crossing / activation; -1 = none yet
        self._first_crossing = np.full((2, d_sae), -1, dtype=np.int64)
        self._first_active = np.full((2, d_sae), -1, dtype=np.int64)

    def check_point(self, point: Any) -> None:
        """With ``check_hook``, raise ValueError when ``point`` contradicts the SAE's
        ``hook_name`` (its layer or tensor type). A router that calls ``check_point``
        at registration refuses such a point before generation starts."""
        if self.check_hook:
            check_point_matches_hook(self.sae, point)

    def on_start(self, ctx: RequestContext) -> None:
        self._reset()
        if ctx.extraction_point is not None:  # for callers that did not check the point
            self.check_point(ctx.extraction_point)

    def on_activation(self, record: ActivationRecord) -> ProbeSignal | None:
        return self.on_activations((record,))[0]

    def on_activations(self, records: Sequence[ActivationRecord]) -> list[ProbeSignal | None]:
        return self.on_batch(ActivationBatch.from_records(records)).signals()

    def on_batch(self, batch: ActivationBatch) -> BatchSignals:
        """Encode the batch's rows with one matrix product; one signal per row."""
        np = numpy_module()
        acts = self.sae.encode(batch_matrix(batch))
        tokens = [int(token) for token in batch.token_indices]
        layers = [int(layer) for layer in batch.layers]
        self._accumulate(acts, tokens, layers)
        if self.features is not None:
            ids = list(self.features)
            chosen_rows = [(list(ids), acts[row, ids].tolist()) for row in range(len(batch))]
        else:
            chosen_rows = [self._top(row) for row in acts]
        scores = [max(values) if values else 0.0 for _, values in chosen_rows]
        metadata = {
            "features": [ids for ids, _ in chosen_rows],
            "activations": [values for _, values in chosen_rows],
            "layer": layers,
            "token_index": tokens,
            "generated_index": list(batch.generated_indices),
        }
        return self.summary.batch_signals(self.rule, np.asarray(scores, dtype=np.float64),
                                          tokens, layers, metadata)

    def _top(self, row: Any) -> tuple[list[int], list[float]]:
        np = numpy_module()
        k = self.top_k
        top = np.argpartition(-row, k - 1)[:k]
        top = top[np.argsort(-row[top], kind="stable")]
        kept = [int(i) for i in top if row[i] > 0]
        return kept, [float(row[i]) for i in kept]

    def _accumulate(self, acts: Any, tokens: Sequence[int], layers: Sequence[int]) -> None:
        np = numpy_module()
        self._peak = np.maximum(self._peak, acts.max(axis=0)) if self._rows else acts.max(axis=0)
        self._total += acts.sum(axis=0)
        self._rows += acts.shape[0]
        where = np.array([list(tokens), list(layers)])
        _first_hits(acts > 0, where, self._first_active)
        if self.rule.threshold is not None:
            _first_hits(acts >= self.rule.threshold, where, self._first_crossing)

    def _reported_features(self) -> list[int]:
        np = numpy_module()
        if self.features is not None:
            return list(self.features)
        if not self._rows:
            return []
        order = np.argsort(-self._peak, kind="stable")[: self.top_k]
        return [int(i) for i in order if self._peak[i] > 0]

    def on_end(self, ctx: RequestContext) -> Any:
        verdict = self.summary.verdict()
        rows = []
        for feature in self._reported_features():
            crossing = _first(self._first_crossing, feature)
            active = _first(self._first_active, feature)
            rows.append({
                "feature": feature,
                "max": float(self._peak[feature]) if self._rows else None,
                "mean": float(self._total[feature] / self._rows) if self._rows else None,
                "first_crossing_token_index": crossing[0],
                "first_crossing_layer": crossing[1],
                "first_active_token_index": active[0],
                "first_active_layer": active[1],
            })
        verdict.update(
            features=rows,
            source=self.sae.source,
            architecture=self.sae.architecture,
            hook_name=self.sae.hook_name,
            d_sae=self.sae.d_sae,
        )
        return verdict


def _first_hits(mask: Any, where: Any, firsts: Any) -> None:
    """Record, for each feature hit in ``mask`` (rows x features) and not hit before,
    the (token_index, layer) of its first hitting row (``where`` is 2 x rows)."""
    fresh = mask.any(axis=0) & (firsts[0] < 0)
    if fresh.any():
        rows = mask.argmax(axis=0)[fresh]
        firsts[:, fresh] = where[:, rows]


def _first(firsts: Any, feature: int) -> tuple[int | None, int | None]:
    token, layer = int(firsts[0, feature]), int(firsts[1, feature])
    return (None, None) if token < 0 else (token, layer)
