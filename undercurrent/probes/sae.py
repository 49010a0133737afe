"""``sae_probe``: watch a sparse autoencoder's features live, in SAELens's format.

Each batch of captured activations is encoded with one matrix product (see
:mod:`undercurrent.probes.sae_files` for the format and the arithmetic); signals
carry the watched (or most active) features and their activations, and the
verdict summarises every reported feature over the request.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

from undercurrent.arguments import check_flag
from undercurrent.probes.arrays import float64_rows, map_rows, numpy_module
from undercurrent.probes.base import (
    Probe,
    RequestContext,
    ScoresRows,
    TellsSignals,
    shallow_copy,
)
from undercurrent.probes.sae_files import ENCODE_ROWS, SparseAutoencoder, load_sae
from undercurrent.probes.scoring import (
    ScoreSummary,
    ThresholdRule,
    never_signals,
    summary_verdicts,
)
from undercurrent.probes.sparse import RaggedColumn, SparseRows, top_columns
from undercurrent.records import ActivationBatch, BatchSignals, SignalAction, as_list
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


class SaeProbe(TellsSignals):
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
        if isinstance(features, numbers.Integral) and not isinstance(features, bool):
            features = [features]  # (a numpy integer too, as np.argmax gives)
        elif hasattr(features, "ndim") and hasattr(features, "tolist"):
            # (a 1-D array of ids, as np.argsort gives; a 0-d one is one id)
            array: Any = features
            features = [array.tolist()] if array.ndim == 0 else array.tolist()
        if features is not None:
            if isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
                raise ValueError(f"features must be a list of feature ids (or one id), got "
                                 f"{features!r}")
            if not features:
                raise ValueError("features must name at least one feature id")
            self.features: tuple[int, ...] | None = tuple(
                dict.fromkeys(self.sae.feature_index(f) for f in features)
            )
            self.top_k = len(self.features)
        else:
            self.features = None
            chosen = DEFAULT_TOP_K if top_k is None else top_k
            if (isinstance(chosen, bool) or not isinstance(chosen, numbers.Integral)
                    or chosen < 1):  # (a numpy integer too, as features= takes)
                raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
            self.top_k = min(int(chosen), self.sae.d_sae)
        self.rule = ThresholdRule.from_options(threshold, action)
        self.check_hook = check_flag("check_hook", check_hook)
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
        # Set while the arrays above are rows of a call's stacked states (see
        # _accumulate_many): updated there in place, for every request at once.
        self._stack: _Stacked | None = None

    def check_point(self, point: Any) -> None:
        """With ``check_hook``, raise ValueError when ``point`` contradicts the SAE's
        ``hook_name`` (its layer or tensor type). A router that calls ``check_point``
        at registration refuses such a point before generation starts."""
        if self.check_hook:
            check_point_matches_hook(self.sae, point)

    def check_hidden_size(self, hidden_size: int) -> None:
        """Raise ValueError when the SAE reads activations of another size than
        the model's hidden size (whatever ``check_hook`` says)."""
        if self.sae.d_in != hidden_size:
            raise ValueError(
                f"{self.sae.source} reads activations of size d_in={self.sae.d_in} but the "
                f"model's hidden size is {hidden_size}"
            )

    def on_start(self, ctx: RequestContext) -> None:
        self._reset()
        if ctx.extraction_point is not None:  # for callers that did not check the point
            self.check_point(ctx.extraction_point)

    def copy_for_request(self) -> SaeProbe | None:
        # The SAE and the settings are read-only; on_start makes the rest.
        return shallow_copy(self) if type(self) is SaeProbe else None

    # -- judged in groups (ScoresRows) ------------------------------------------
    def group_key(self) -> Any:
        """Instances reading one SAE encode every row the same way."""
        return ("sae_probe", id(self.sae))

    def row_values(self, batch: ActivationBatch) -> tuple[SparseRows, list[int | None]]:
        """Each row's feature activations, kept by the active ones
        (:class:`~undercurrent.probes.sparse.SparseRows`; a product per block of
        rows, each row's the same bits whatever batch it comes in), and its
        generated index (a signal's metadata names it)."""
        return map_rows(batch, self.sae.encode_sparse), as_list(batch.generated_indices)

    def may_abort(self) -> bool:
        return type(self) is not SaeProbe or self.rule.can_abort

    @classmethod
    def signal_test(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                    ) -> Callable[[Any], bool] | None:
        # A signal is a row whose score (its largest watched, or top,
        # activation) reaches the threshold: each row's own.
        first = probes[0]
        if not isinstance(first, SaeProbe) or not all(map(first._judges_as, probes)):
            return None
        rule = first.rule
        if not rule.gives(actions):
            return never_signals
        threshold = rule.threshold

        def reaches(values: Any) -> bool:
            return bool((first._scores(values[0]) >= threshold).any())

        return reaches

    @classmethod
    def signal_screen(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                      ) -> Callable[[Sequence[Any]], bool] | None:
        # Watched features only: a bound on each from its encoder column alone,
        # against the threshold (under top_k any feature may signal: none).
        if cls.signal_test(probes, actions) is None:
            return None
        first = probes[0]
        assert isinstance(first, SaeProbe)
        rule = first.rule
        if (not rule.gives(actions) or first.features is None or rule.threshold is None
                or not math.isfinite(rule.threshold)):
            return None
        return SaeScreen(first.sae, first.features, rule.threshold)

    def _judges_as(self, other: Any) -> bool:
        """Whether ``other`` judges rows as this one does (this very class, the
        same SAE, rule and features)."""
        return (type(other) is SaeProbe and type(self) is SaeProbe and other.sae is self.sae
                and other.rule == self.rule and other.features == self.features
                and other.top_k == self.top_k)

    def judge_rows(self, values: Any, token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals:
        acts, generated = values
        tokens, layer_list = as_ints(token_indices), as_ints(layers)
        SaeProbe._accumulate_many([self], acts, [(0, len(acts))], tokens, layer_list)
        features, activations, scores = self._chosen(acts)
        metadata: dict[str, Sequence[Any]] = {
            "features": features, "activations": activations, "layer": layer_list,
            "token_index": tokens, "generated_index": list(generated)}
        return self.summary.batch_signals(self.rule, scores, tokens, layer_list, metadata)

    @classmethod
    def judge_many(cls, probes: Sequence[ScoresRows], values: Any,
                   spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals | None:
        """Every request's rows judged in one pass, where all ``probes`` judge
        alike: the requests' running totals added together, and the reported
        features of the rows found once."""
        first = probes[0]
        if not isinstance(first, SaeProbe) or not all(map(first._judges_as, probes)):
            return None
        start, stop = spans[0][0], spans[-1][1]
        acts, generated = values
        acts = acts[start:stop]
        tokens = as_ints(token_indices[start:stop])
        layer_list = as_ints(layers[start:stop])
        local = [(begin - start, end - start) for begin, end in spans]
        SaeProbe._accumulate_many(probes, acts, local, tokens, layer_list)  # type: ignore[arg-type]
        features, activations, scores = first._chosen(acts)
        metadata: dict[str, Sequence[Any]] = {
            "features": features, "activations": activations, "layer": layer_list,
            "token_index": tokens, "generated_index": list(generated[start:stop])}
        return ScoreSummary.batch_signals_many(
            [probe.summary for probe in probes], first.rule, scores,  # type: ignore[attr-defined]
            local, tokens, layer_list, metadata)

    def _chosen(self, acts: SparseRows) -> tuple[Any, Any, Any]:
        """For each row of ``acts``: the features reported (every watched one,
        or the active ones among the top ``top_k``, most active first, equal
        activations by feature id), their activations, and the row's score
        (what :meth:`_scores` gives, from the same work). The first two are
        columns of per-row lists kept as arrays (a 2-D array, or a
        :class:`~undercurrent.probes.sparse.RaggedColumn`): lists are made only
        when a signal is read."""
        np = numpy_module()
        if self.features is not None:
            watched = self._watched(acts)
            ids = np.broadcast_to(np.array(self.features, dtype=np.intp), watched.shape)
            return ids, watched, watched.max(axis=1)
        indptr, columns, values, tops = _ranked_positives(acts, self.top_k)
        return RaggedColumn(indptr, columns), RaggedColumn(indptr, values), tops

    def _watched(self, acts: SparseRows) -> Any:
        """The watched features' activations, ``(rows, len(features))``."""
        np = numpy_module()
        assert self.features is not None
        place = np.full(acts.width, -1, dtype=np.intp)
        place[list(self.features)] = np.arange(len(self.features))
        where = place[acts.columns]
        kept = where >= 0
        watched = np.zeros((len(acts), len(self.features)))
        watched[acts.entry_rows()[kept], where[kept]] = acts.values[kept]
        return watched

    def _scores(self, acts: SparseRows) -> Any:
        """Each row's score, a float64 array: its largest watched activation
        (NaN where one is), or under ``top_k`` its top activation (0.0 where
        none is active, NaN where any activation is NaN)."""
        np = numpy_module()
        if self.features is not None:
            return self._watched(acts).max(axis=1)
        best = np.zeros(len(acts))
        active = acts.values > 0
        np.maximum.at(best, acts.entry_rows()[active], acts.values[active])
        best[_rows_with_nan(acts)] = np.nan
        return best

    @staticmethod
    def _accumulate_many(probes: Sequence[SaeProbe], acts: SparseRows,
                         spans: Sequence[tuple[int, int]], tokens: Sequence[int],
                         layers: Sequence[int]) -> None:
        """Each feature's peak, total and first activation (and crossing) over
        rows ``spans[i]`` of ``acts`` added to ``probes[i]`` 's, for every
        probe at once (one rule for all): what a loop over each probe's rows,
        each feature's activation in turn, gives (an inactive feature adds 0.0,
        which changes no total). The probes' states are stacked, so one
        operation updates every request; entries keep their row order within
        each (request, feature), so each total is summed in the same order."""
        np = numpy_module()
        if not len(acts):
            return
        width = acts.width
        owner = np.full(len(acts), -1, dtype=np.intp)  # (rows outside every span: none)
        for index, (begin, end) in enumerate(spans):
            owner[begin:end] = index
        rows = acts.entry_rows()
        entry_owner = owner[rows]
        columns, values = acts.columns, acts.values
        if (entry_owner < 0).any():
            inside = entry_owner >= 0
            rows, entry_owner = rows[inside], entry_owner[inside]
            columns, values = columns[inside], values[inside]
        keys = entry_owner * width + columns  # (a request's feature, in the stacked states)
        stack = _Stacked.of(probes)
        with np.errstate(invalid="ignore"):  # (a NaN activation: a NaN peak, as a loop gives)
            np.maximum.at(stack.peaks.reshape(-1), keys, values)
            np.add.at(stack.totals.reshape(-1), keys, values)  # (entry by entry, row by row)
        where = np.array([list(tokens), list(layers)])
        _first_entries(keys, rows, values > 0, where, stack.active.reshape(2, -1))
        threshold = probes[0].rule.threshold
        if threshold is not None and threshold > 0:  # (an inactive feature does not cross it)
            _first_entries(keys, rows, values >= threshold, where, stack.crossing.reshape(2, -1))
        for probe, (begin, end) in zip(probes, spans, strict=True):
            probe._rows += end - begin
            if threshold is not None and threshold <= 0:
                probe._first_crossings(acts[begin:end], where[:, begin:end], threshold)

    def _first_crossings(self, acts: SparseRows, where: Any, threshold: float) -> None:
        """The first crossing of each feature in ``acts`` where every activation,
        zeros included, may cross ``threshold``: row by row, a block at a time."""
        for start in range(0, len(acts), ENCODE_ROWS):
            block = acts[start:start + ENCODE_ROWS]
            _first_hits(block.dense() >= threshold, where[:, start:start + len(block)],
                        self._first_crossing)

    def on_end(self, ctx: RequestContext) -> Any:
        return _verdicts([self], [self.summary.verdict()])[0]

    @classmethod
    def end_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]
                 ) -> list[Any] | None:
        """Every instance's :meth:`on_end` verdict at once (this class's own
        only): the reported features of every request ranked at once."""
        if cls.on_end is not SaeProbe.on_end or any(type(p) is not cls for p in probes):
            return None
        saes = cast("Sequence[SaeProbe]", probes)
        return _verdicts(saes, summary_verdicts([probe.summary for probe in saes]))


class SaeScreen:
    """Whether some row of a step may reach an ``sae_probe`` abort threshold on
    its watched features, computed cheaply: a bound on each watched feature's
    activation from its encoder column alone
    (:meth:`~undercurrent.probes.sae_files.SparseAutoencoder.activation_bounds`),
    on the captured pieces in float64 (the values the exact path reads). True
    ("may abort": the step's encoding then decides) where a bound reaches the
    threshold or is not a number, or where the pieces are not CPU float
    tensors of the SAE's width; False only where no watched activation can
    reach it."""

    __slots__ = ("sae", "features", "threshold")

    def __init__(self, sae: SparseAutoencoder, features: Sequence[int], threshold: float) -> None:
        self.sae = sae
        self.features = list(features)
        self.threshold = threshold

    def __call__(self, pieces: Sequence[Any]) -> bool:
        np = numpy_module()
        blocks = []
        for piece in pieces:
            rows = float64_rows(piece)
            if rows is None or rows.shape[1] != self.sae.d_in:
                return True
            blocks.append(rows)
        if not blocks:
            return True
        matrix = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        with np.errstate(all="ignore"):  # (NaN and overflow are answered: "may abort")
            bounds = self.sae.activation_bounds(matrix, self.features)
            return not bool((bounds < self.threshold).all())


class _Stacked:
    """The states of instances judged together (a call's copies), stacked: one
    row per instance of ``probes`` (in that order) in ``peaks`` and
    ``totals``, and ``active`` and ``crossing`` (``(2, instances, d_sae)``).
    While an instance's ``_stack`` is this object, its own arrays are views of
    its rows, so what updates these updates them."""

    __slots__ = ("probes", "peaks", "totals", "active", "crossing")

    def __init__(self, probes: tuple[SaeProbe, ...]) -> None:
        np = numpy_module()
        self.probes = probes
        self.peaks = np.stack([probe._peak for probe in probes])
        self.totals = np.stack([probe._total for probe in probes])
        self.active = np.stack([probe._first_active for probe in probes], axis=1)
        self.crossing = np.stack([probe._first_crossing for probe in probes], axis=1)
        for index, probe in enumerate(probes):
            probe._peak, probe._total = self.peaks[index], self.totals[index]
            probe._first_active = self.active[:, index]
            probe._first_crossing = self.crossing[:, index]
            probe._stack = self

    @classmethod
    def of(cls, probes: Sequence[SaeProbe]) -> _Stacked:
        """The stack holding exactly ``probes`` (in order), each still in it;
        else a new one, made from their arrays."""
        stack = probes[0]._stack
        if (stack is not None and len(stack.probes) == len(probes)
                and all(map(operator.is_, stack.probes, probes))
                and all(probe._stack is stack for probe in probes)):
            return stack
        return cls(tuple(probes))


def _verdicts(probes: Sequence[SaeProbe], verdicts: list[dict[str, Any]]
              ) -> list[dict[str, Any]]:
    """Each probe's ``verdicts[i]`` (its summary's) with its reported features
    and the SAE's own keys: every watched feature, or the features among its
    ``top_k`` highest peaks that are active (most first, equal peaks by
    feature id), each with its peak, mean and first activation and crossing.
    Instances alike (a call's copies, each with rows) are read at once:
    their states stacked, their top features selected together."""
    np = numpy_module()
    head = probes[0]
    alike = all(probe.features == head.features and probe.top_k == head.top_k
                and probe._rows for probe in probes)
    if len(probes) > 1 and not alike:
        return [_verdicts([probe], [verdict])[0]
                for probe, verdict in zip(probes, verdicts, strict=True)]
    if not head._rows:  # (nothing seen: every watched feature, its values None)
        features = [] if head.features is None else list(head.features)
        verdicts[0].update(features=[{**dict.fromkeys(_FEATURE_KEYS), "feature": feature}
                                     for feature in features], **_sae_keys(head.sae))
        return verdicts
    stack = _Stacked.of(probes)
    peaks = stack.peaks
    if head.features is not None:
        order = np.broadcast_to(np.array(head.features, dtype=np.intp),
                                (len(probes), len(head.features)))
        counts = [len(head.features)] * len(probes)
    else:  # (the same order as a stable sort of every peak, NaN last: only > 0 kept)
        order = top_columns(peaks, head.top_k)
        counts = (np.take_along_axis(peaks, order, axis=1) > 0).sum(axis=1).tolist()
    rows = np.array([probe._rows for probe in probes], dtype=np.float64)[:, None]
    columns = {
        "feature": order.tolist(),
        "max": np.take_along_axis(peaks, order, axis=1).tolist(),
        "mean": (np.take_along_axis(stack.totals, order, axis=1) / rows).tolist()}
    for name, firsts in (("first_crossing", stack.crossing), ("first_active", stack.active)):
        where = np.take_along_axis(firsts, np.broadcast_to(order, firsts.shape[:1] + order.shape),
                                   axis=2)  # ((token, layer), probes, features)
        tokens, layers = where[0].tolist(), where[1].tolist()
        columns[f"{name}_token_index"] = [[None if t < 0 else t for t in row] for row in tokens]
        columns[f"{name}_layer"] = [[None if t < 0 else la for t, la in zip(tr, lr, strict=True)]
                                    for tr, lr in zip(tokens, layers, strict=True)]
    names = list(_FEATURE_KEYS)
    found = []
    for index, (probe, verdict) in enumerate(zip(probes, verdicts, strict=True)):
        values = [columns[name][index][:counts[index]] for name in names]
        verdict.update(features=[dict(zip(names, entry, strict=True))
                                 for entry in zip(*values, strict=True)],
                       **_sae_keys(probe.sae))
        found.append(verdict)
    return found


#: A verdict's feature entry, key by key.
_FEATURE_KEYS = ("feature", "max", "mean", "first_crossing_token_index",
                 "first_crossing_layer", "first_active_token_index", "first_active_layer")


def _sae_keys(sae: SparseAutoencoder) -> dict[str, Any]:
    return {"source": sae.source, "architecture": sae.architecture,
            "hook_name": sae.hook_name, "d_sae": sae.d_sae}


def _ranked_positives(acts: SparseRows, k: int) -> tuple[Any, Any, Any, Any]:
    """For each row of ``acts``, its ``k`` largest positive entries, most
    first, equal values by column (each row's positive entries laid out in
    column order, then sorted, stably): the rows' boundaries (``indptr``),
    the entries' columns and values, row after row, and each row's largest
    value (0.0 where none is positive, NaN where any entry is NaN: a NaN is
    not ranked, but the row is not "nothing active")."""
    np = numpy_module()
    rows = len(acts)
    active = acts.values > 0
    row_of, column_of = acts.entry_rows()[active], acts.columns[active]
    counts = np.bincount(row_of, minlength=rows)
    kept = np.minimum(counts, k)
    indptr = np.zeros(rows + 1, dtype=np.intp)
    np.cumsum(kept, out=indptr[1:])
    tops = np.zeros(rows)
    tops[_rows_with_nan(acts)] = np.nan
    if not len(row_of):
        return indptr, np.zeros(0, dtype=np.intp), np.zeros(0), tops
    slot = np.arange(len(row_of)) - np.repeat(np.cumsum(counts) - counts, counts)
    values = np.full((rows, int(counts.max())), -np.inf)
    columns = np.zeros(values.shape, dtype=np.intp)
    values[row_of, slot] = acts.values[active]
    columns[row_of, slot] = column_of
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    ranked = np.take_along_axis(values, order, axis=1)
    within = np.arange(order.shape[1]) < kept[:, None]  # (row by row: entries in order)
    has = (kept > 0) & ~np.isnan(tops)
    tops[has] = ranked[has, 0]
    return indptr, np.take_along_axis(columns, order, axis=1)[within], ranked[within], tops


def _rows_with_nan(acts: SparseRows) -> Any:
    """A bool per row of ``acts``: whether any of its activations is NaN."""
    np = numpy_module()
    poisoned = np.zeros(len(acts), dtype=bool)
    poisoned[acts.entry_rows()[np.isnan(acts.values)]] = True
    return poisoned


def as_ints(column: Any) -> list[int]:
    """A column of indices as a list of Python ints."""
    return [int(value) for value in as_list(column)]


def _first_entries(keys: Any, rows: Any, hit: Any, where: Any, firsts: Any) -> None:
    """Record, for each key (a feature, or a request's feature in stacked
    states) with an entry in ``hit`` (entries in row order) and not hit
    before, the (token_index, layer) of its first hitting row (``where`` is
    2 x rows, ``firsts`` 2 x keys)."""
    np = numpy_module()
    hit_keys = keys[hit]
    fresh = firsts[0, hit_keys] < 0  # (most features seen are seen again: left out first)
    if not fresh.any():
        return
    found, first = np.unique(hit_keys[fresh], return_index=True)  # (first occurrences)
    firsts[:, found] = where[:, rows[hit][fresh][first]]


def _first_hits(mask: Any, where: Any, firsts: Any) -> None:
    """Record, for each feature hit in ``mask`` (rows x features) and not hit before,
    the (token_index, layer) of its first hitting row (``where`` is 2 x rows)."""
    fresh = mask.any(axis=0) & (firsts[0] < 0)
    if fresh.any():
        rows = mask.argmax(axis=0)[fresh]
        firsts[:, fresh] = where[:, rows]
