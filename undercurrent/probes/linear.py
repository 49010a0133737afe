"""Linear readouts: ``linear_probe`` and ``dual_position_probe``.

Both compute ``z = W . x + b`` on the flattened activation and map it through a
link (``sigmoid``, ``softmax`` or ``identity``) to one score per activation.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from undercurrent.arguments import check_flag
from undercurrent.probes.arrays import (
    as_float_matrix,
    batch_matrix,
    float32_rows,
    map_rows,
    numpy_module,
    row_dots,
)
from undercurrent.probes.base import (
    ABORT_ONLY,
    Probe,
    RequestContext,
    ScoresRows,
    TellsSignals,
    shallow_copy,
)
from undercurrent.probes.scoring import (
    ScoreSummary,
    ThresholdRule,
    end_summaries,
    judge_summaries,
    never_signals,
    parse_threshold,
    start_summaries,
    threshold_signal_test,
)
from undercurrent.probes.weights import (
    LINKS,
    LinearWeights,
    ProbeFileError,
    apply_link,
    linear_weights,
    load_linear_weights,
)
from undercurrent.records import (
    ActivationBatch,
    ActivationRecord,
    BatchSignals,
    ProbeSignal,
    SignalAction,
    as_list,
)
from undercurrent.spec.types import ExtractionPoint, ProbeKind


class LinearReadout:
    """``link(W . x + b)`` reduced to one score, from a file or inline arrays.

    Give either ``path`` (``.safetensors``/``.npz``) or both ``weight`` and
    ``bias``. ``link`` defaults to the file's ``link`` metadata, else ``sigmoid``
    for a ``(hidden,)`` weight and ``softmax`` for ``(classes, hidden)``.
    ``class_index`` (an int, or a name from the file's ``label_names``) picks the
    class whose value is the score; it defaults to 0 for one class and 1 for two,
    and is required beyond that.
    """

    def __init__(
        self,
        *,
        path: str | os.PathLike[str] | None = None,
        weight: Any = None,
        bias: Any = None,
        link: str | None = None,
        class_index: int | str | None = None,
    ) -> None:
        self.weights = _resolve_weights(path, weight, bias)
        source = self.weights.source
        classes = self.weights.classes
        chosen = link if link is not None else self.weights.metadata.get("link")
        if chosen is None:
            chosen = "sigmoid" if classes is None else "softmax"
        if chosen not in LINKS:
            raise ValueError(f"{source}: link must be one of {', '.join(LINKS)}, got {chosen!r}")
        if chosen == "softmax" and classes is None:
            raise ValueError(
                f"{source}: link 'softmax' needs a (classes, hidden) weight; this one is "
                f"({self.weights.hidden},), use 'sigmoid' or 'identity'"
            )
        self.link: str = chosen
        self.label_names = self.weights.label_names
        names = self.label_names
        if names is not None and classes is not None and len(names) != classes:
            raise ProbeFileError(
                f"{source}: label_names has {len(names)} names for {classes} classes"
            )
        self.class_index = self._resolve_class_index(class_index)
        self._key: tuple[Any, ...] | None = None

    def check_hidden_size(self, hidden_size: int) -> None:
        """Raise ValueError when the weight reads activations of another size than
        the model's hidden size."""
        if self.weights.hidden != hidden_size:
            raise ValueError(
                f"{self.source}: the weight has {self.weights.hidden} numbers "
                f"per activation but the model's hidden size is {hidden_size}; it must have "
                "one number per hidden unit"
            )

    @property
    def source(self) -> str:
        """Where the weights came from (for messages and verdicts)."""
        return self.weights.source

    def _resolve_class_index(self, class_index: int | str | None) -> int | None:
        classes = self.weights.classes
        source = self.weights.source
        if classes is None:
            if class_index not in (None, 0):
                raise ValueError(f"{source}: class_index {class_index!r} given for a binary probe")
            return None
        if isinstance(class_index, str):
            if not self.label_names or class_index not in self.label_names:
                known = ", ".join(self.label_names or ()) or "none in the file"
                raise ValueError(
                    f"{source}: class_index {class_index!r} is not a label name (labels: {known})"
                )
            return self.label_names.index(class_index)
        if class_index is None:
            if classes <= 2:
                return classes - 1
            raise ValueError(
                f"{source}: a {classes}-class probe needs class_index (0..{classes - 1}"
                + (f" or one of {', '.join(self.label_names)})" if self.label_names else ")")
            )
        if isinstance(class_index, bool) or not isinstance(class_index, int):
            raise ValueError(f"{source}: class_index must be an int or a label name")
        if not 0 <= class_index < classes:
            raise ValueError(
                f"{source}: class_index {class_index} out of range for {classes} classes"
            )
        return class_index

    def score(self, tensor: Any) -> tuple[float, dict[str, Any]]:
        """The score of one activation, and metadata describing it."""
        return self.score_many([tensor])[0]

    def score_many(self, tensors: Sequence[Any]) -> list[tuple[float, dict[str, Any]]]:
        """:meth:`score` for several activations, with one matrix product."""
        shape = getattr(tensors[0], "shape", None)
        values, meta = self.score_matrix(as_float_matrix(tensors),
                                         None if shape is None else tuple(shape))
        columns = {key: as_list(column) for key, column in meta.items()}
        return [(value, {key: column[i] for key, column in columns.items()})
                for i, value in enumerate(values.tolist())]

    def score_matrix(self, matrix: Any, row_shape: tuple[int, ...] | None = None
                     ) -> tuple[Any, dict[str, Any]]:
        """Scores of the rows of a float64 matrix (one flattened activation per row),
        with one matrix product: (float64 array of scores, metadata columns).
        ``row_shape`` (an activation's own shape) is only used in messages."""
        return self._scores(self._logits(matrix, row_shape))

    def _logits(self, matrix: Any, row_shape: tuple[int, ...] | None = None) -> Any:
        """``W . x + b`` for each row of a float64 matrix (per row: the same bits
        whatever the matrix's height)."""
        np = numpy_module()
        if matrix.shape[1] != self.weights.hidden:
            shape = row_shape if row_shape is not None else tuple(matrix.shape[1:])
            raise ValueError(
                f"{self.source}: expects activations of size {self.weights.hidden}, got a "
                f"tensor of shape {shape} ({matrix.shape[1]} values once flattened)"
            )
        # row_dots, not ``@``: each row's dot product on this thread, the same
        # whatever the matrix's height. A threaded BLAS product would busy-wait
        # for its helper threads, which a loaded machine (or an engine's own
        # threads) may not run at once: milliseconds on a generation thread, for
        # a product of a few hundred microseconds.
        product = row_dots(matrix, self.weights.weight)
        return np.asarray(product + self.weights.bias, np.float64)

    def _scores(self, logits: Any) -> tuple[Any, dict[str, Any]]:
        """(scores, metadata columns) from the rows' logits."""
        np = numpy_module()
        values = apply_link(self.link, logits)
        if self.weights.classes is None:
            return values, {"logit": logits}  # (a column: each row's read as a float)
        index = self.class_index
        assert index is not None
        count = len(logits)
        tops = np.argmax(logits, axis=1).tolist()
        meta: dict[str, Any] = {"class_index": [index] * count, "top_class": tops}
        if self.label_names:
            names = self.label_names
            meta["label"] = [names[index]] * count
            meta["top_label"] = [names[top] for top in tops]
        return values[:, index], meta

    def score_batch(self, batch: ActivationBatch) -> tuple[Any, dict[str, Any]]:
        """:meth:`score_matrix` of a batch's rows (one matrix product for the whole
        batch it was sliced from, shared by every readout with the same weights)."""
        return batch.shared(self.key, self._score_whole)  # type: ignore[no-any-return]

    def _score_whole(self, batch: ActivationBatch) -> tuple[Any, dict[str, Any]]:
        try:
            logits = map_rows(batch, self._logits)
        except ValueError:  # the width refused: say so with the activations' own shape
            shape = getattr(batch.tensor, "shape", None)
            try:
                self._logits(batch_matrix(batch), None if shape is None else tuple(shape[1:]))
            except ValueError as refused:
                raise refused from None
            raise
        return self._scores(logits)

    @property
    def key(self) -> tuple[Any, ...]:
        """Equal for readouts that score every activation the same way (same
        weights, bias, link and class) and name its labels alike."""
        if self._key is None:
            self._key = ("linear_readout", self.link, self.class_index, self.weights.digest,
                         tuple(self.label_names or ()))
        return self._key


class LogitScreen:
    """Whether some row of a step may reach a binary readout's abort threshold,
    computed cheaply: ``W . x`` in float32 on the captured pieces (no float64
    matrix, no batch), compared with the threshold's logit less a margin that
    covers what float32 may miss. ``screen(pieces)`` is True ("may abort":
    the step's exact scores then decide) where the best float32 logit is
    within the margin of the threshold's logit or above it, where a value is
    not finite, or where the pieces are not CPU float tensors of the
    readout's width; False only where no exact score reaches the threshold.

    The margin: the exact score is computed in float64 from float64 weights;
    float32 rounds each weight and each value (relative error 2^-24 each) and
    each step of a dot product of ``n`` terms, so the float32 logit differs
    from the exact one by at most about ``(n + 2) * 2^-24 * sum |w_i x_i|``,
    and ``sum |w_i x_i|`` is at most ``sum |w_i| * max |x_i|``. The margin is
    four times that, plus ``1e-9 * (1 + |threshold logit|)`` for the float64
    logit and, for a sigmoid, what the float64 sigmoid may round up by
    (``1e-15 / (t * (1 - t))`` in logits, at threshold ``t``)."""

    __slots__ = ("weight", "bias", "limit", "hidden", "scale", "slack")

    def __init__(self, weights: LinearWeights, limit: float, slack: float) -> None:
        np = numpy_module()
        self.weight = np.ascontiguousarray(weights.weight, dtype=np.float32)
        self.bias = float(weights.bias)
        self.limit = limit  # the logit (W . x + b) a score must reach
        self.hidden = weights.hidden
        self.scale = 4.0 * (self.hidden + 2) * 2.0 ** -24 * float(np.abs(weights.weight).sum())
        self.slack = slack + 1e-9 * (1.0 + abs(limit))

    @classmethod
    def of(cls, readout: LinearReadout, rule: ThresholdRule,
           actions: frozenset[SignalAction] = ABORT_ONLY
           ) -> Callable[[Sequence[Any]], bool] | None:
        """The screen of a binary ``readout`` with a ``sigmoid`` or ``identity``
        link, judged by ``rule`` (which may give one of ``actions``); None for
        any other (a class of several, a ``softmax``, a threshold every score
        reaches)."""
        threshold = rule.threshold
        if (readout.weights.classes is None and threshold is not None
                and rule.gives(actions)):
            if readout.link == "identity" and math.isfinite(threshold):
                return cls(readout.weights, threshold, 0.0)
            if readout.link == "sigmoid" and threshold > 1.0:
                return _never_reached  # (no sigmoid reaches it, not even of inf)
            if readout.link == "sigmoid" and threshold >= 1.0:
                # A float64 sigmoid is below 1 - 1e-13 at every logit below 30.
                return cls(readout.weights, 30.0, 0.0)
            if readout.link == "sigmoid" and threshold > 0.0:
                return cls(readout.weights, math.log(threshold) - math.log1p(-threshold),
                           1e-15 / (threshold * (1.0 - threshold)))
        return None

    def __call__(self, pieces: Sequence[Any]) -> bool:
        with numpy_module().errstate(all="ignore"):  # (NaN and overflow are answered)
            return self._may_reach(pieces)

    def _may_reach(self, pieces: Sequence[Any]) -> bool:
        best = amax = -math.inf
        for piece in pieces:
            rows = float32_rows(piece)
            if rows is None or rows.shape[1] != self.hidden:
                return True  # (the exact path decides, or says what is wrong)
            # (on this thread, whatever the BLAS: see LinearReadout._logits)
            top = float(row_dots(rows, self.weight).max())
            low, high = float(rows.min()), float(rows.max())
            if not (math.isfinite(top) and math.isfinite(low) and math.isfinite(high)):
                return True  # (NaN or infinity: the exact scores decide)
            best, amax = max(best, top), max(amax, high, -low)
        margin = self.scale * amax + self.slack
        return not math.isfinite(margin) or best + self.bias >= self.limit - margin


def _never_reached(pieces: Sequence[Any]) -> bool:
    return False


def _resolve_weights(
    path: str | os.PathLike[str] | None, weight: Any, bias: Any
) -> LinearWeights:
    if path is not None:
        if weight is not None or bias is not None:
            raise ValueError("give either path or weight/bias, not both")
        return load_linear_weights(path)
    if weight is None or bias is None:
        raise ValueError(
            "a linear readout needs path (a .safetensors/.npz file) or both weight and bias"
        )
    return linear_weights(weight, bias)


class LinearProbe(TellsSignals):
    """``linear_probe``: score each activation with ``link(W . x + b)``.

    probe_args:

    - ``path``: ``.safetensors``/``.npz`` probe file, or inline ``weight`` and ``bias``;
    - ``link``: ``sigmoid`` | ``softmax`` | ``identity`` (default: the file's, else
      sigmoid for a binary probe, softmax for a multi-class one);
    - ``class_index``: which class is the score (int or label name; see
      :class:`LinearReadout`);
    - ``threshold``: a score at or above it triggers ``action`` (default: the file's
      ``threshold`` metadata, else none: signals only carry the score);
    - ``action``: ``flag`` (default) or ``abort``;
    - ``check_metadata``: when true (default) and the file names a ``layer`` or
      ``tensor_type``, ``on_start`` fails if the extraction point does not match.

    Each activation gets a signal whose score is the probe's value (metadata:
    ``logit``, or ``class_index``/``top_class``/``label``). The verdict is a
    :class:`~undercurrent.probes.scoring.ScoreSummary` dict plus ``link`` and ``source``.
    Serves both probe kinds: it judges each activation alone, and its verdict
    summarises the request.
    """

    probe_kind: ClassVar[ProbeKind | tuple[ProbeKind, ...]] = (
        ProbeKind.SINGLE_SHOT,
        ProbeKind.TRAJECTORY,
    )

    def __init__(
        self,
        *,
        path: str | os.PathLike[str] | None = None,
        weight: Any = None,
        bias: Any = None,
        link: str | None = None,
        class_index: int | str | None = None,
        threshold: float | None = None,
        action: str = "flag",
        check_metadata: bool = True,
    ) -> None:
        self.readout = LinearReadout(
            path=path, weight=weight, bias=bias, link=link, class_index=class_index
        )
        if threshold is None:
            threshold = _file_threshold(self.readout.weights)
        self.rule = ThresholdRule.from_options(threshold, action)
        self.check_metadata = check_flag("check_metadata", check_metadata)
        self.summary = ScoreSummary(self.rule.threshold)

    def check_point(self, point: ExtractionPoint) -> None:
        """With ``check_metadata``, refuse a point whose layers or tensor type differ
        from the ``layer`` / ``tensor_type`` the probe file was fitted on."""
        if self.check_metadata:
            check_point_matches_file(self.readout.weights, point)

    def check_hidden_size(self, hidden_size: int) -> None:
        """Raise ValueError when the weight reads activations of another size than
        the model's hidden size (whatever ``check_metadata`` says)."""
        self.readout.check_hidden_size(hidden_size)

    def on_start(self, ctx: RequestContext) -> None:
        self.summary = ScoreSummary(self.rule.threshold)
        if ctx.extraction_point is not None:  # the router checked; direct callers may not
            self.check_point(ctx.extraction_point)

    @classmethod
    def start_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]) -> bool:
        """Every instance's :meth:`on_start` at once: the point checked once, a
        fresh summary each. Only for this class's own ``on_start`` and
        ``check_point``, on instances sharing one readout, one ``check_metadata``
        and one point (a call's copies of one probe do)."""
        if cls.on_start is not LinearProbe.on_start or (
                cls.check_point is not LinearProbe.check_point):
            return False
        first = probes[0]
        assert isinstance(first, LinearProbe)
        point = contexts[0].extraction_point
        if any(ctx.extraction_point is not point for ctx in contexts) or any(
                probe.readout is not first.readout  # type: ignore[attr-defined]
                or probe.check_metadata is not first.check_metadata  # type: ignore[attr-defined]
                for probe in probes):
            return False
        if point is not None:  # (raises before any instance is changed)
            first.check_point(point)
        start_summaries(probes)
        return True

    def copy_for_request(self) -> LinearProbe | None:
        # The readout and rule are read-only; on_start makes the summary.
        return shallow_copy(self) if type(self) is LinearProbe else None

    def may_abort(self) -> bool:
        # A subclass may judge otherwise: it is taken at its word only through its own.
        return type(self) is not LinearProbe or self.rule.can_abort

    @classmethod
    def signal_test(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                    ) -> Callable[[Any], bool] | None:
        # A signal is a score at or above the threshold (a subclass: not told).
        if any(type(probe) is not LinearProbe for probe in probes):
            return None
        reaches = threshold_signal_test(probes, actions)
        if reaches is None or reaches is never_signals:
            return reaches
        return lambda values: reaches(values[0])

    @classmethod
    def signal_screen(cls, probes: Sequence[ScoresRows], actions: frozenset[SignalAction]
                      ) -> Callable[[Sequence[Any]], bool] | None:
        # Where signal_test tells, a binary readout with a monotone link: the
        # step's logits in float32 on the captured pieces, against the
        # threshold's logit less what float32 may miss (see LogitScreen).
        if cls.signal_test(probes, actions) is None:
            return None
        first = probes[0]
        assert isinstance(first, LinearProbe)
        return LogitScreen.of(first.readout, first.rule, actions)

    def group_key(self) -> Any:
        # A subclass that judges each activation itself is not judged in groups.
        return self.readout.key if type(self).judge is LinearProbe.judge else None

    def row_values(self, batch: ActivationBatch) -> tuple[Any, dict[str, Any]]:
        """(scores, metadata columns) of the batch's rows, one matrix product."""
        return self.readout.score_batch(batch)

    def judge_rows(self, values: Any, token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals:
        scores, meta = values
        return self.summary.batch_signals(self.rule, scores, token_indices, layers, meta)

    @classmethod
    def judge_many(cls, probes: Sequence[ScoresRows], values: Any,
                   spans: Sequence[tuple[int, int]], token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals | None:
        """Every request's rows judged in one pass (one comparison with the
        threshold), when all ``probes`` are this very class with one rule."""
        if cls.judge_rows is not LinearProbe.judge_rows or cls.judge is not LinearProbe.judge:
            return None
        scores, meta = values
        return judge_summaries(probes, scores, spans, token_indices, layers, meta)

    def on_batch(self, batch: ActivationBatch) -> BatchSignals:
        """Score the batch with one matrix product; a subclass that overrides
        :meth:`judge` gets it called per activation, in order."""
        if type(self).judge is LinearProbe.judge:
            return super().on_batch(batch)
        scores, meta = self.readout.score_batch(batch)
        columns = {key: as_list(column) for key, column in meta.items()}
        return BatchSignals.from_signals([
            self.judge(record, score, {key: column[i] for key, column in columns.items()})
            for i, (record, score) in enumerate(zip(batch.records(), scores.tolist(),
                                                    strict=True))
        ])

    def judge(self, record: ActivationRecord, score: float, meta: dict[str, Any]) -> ProbeSignal:
        """The signal for one scored activation (and the summary updated)."""
        signal = self.rule.signal(score, meta)
        self.summary.add(score, record, self.rule.crossed(score))
        return signal

    def on_end(self, ctx: RequestContext) -> Any:
        verdict = self.summary.verdict()
        verdict.update(link=self.readout.link, source=self.readout.source)
        return verdict

    @classmethod
    def end_many(cls, probes: Sequence[Probe], contexts: Sequence[RequestContext]
                 ) -> list[Any] | None:
        """Every instance's :meth:`on_end` verdict at once (this class's own
        ``on_end`` only)."""
        verdicts = end_summaries(probes) if cls.on_end is LinearProbe.on_end else None
        for verdict, probe in zip(verdicts or (), probes, strict=False):
            readout = probe.readout  # type: ignore[attr-defined]
            verdict["link"], verdict["source"] = readout.link, readout.source
        return verdicts


def _file_threshold(weights: LinearWeights) -> float | None:
    """The ``threshold`` metadata of a probe file (None: it has none), refused
    naming the file when it is not a finite number."""
    try:
        return parse_threshold(weights.metadata.get("threshold"))
    except ValueError as error:
        raise ValueError(f"{weights.source}: its threshold metadata is unusable ({error}); "
                         "pass threshold=... in probe_args, or save the probe again") from None


def check_point_matches_file(weights: LinearWeights, point: ExtractionPoint) -> None:
    """Raise ValueError when ``point`` captures none of the layer, or another tensor
    type than, the ``layer`` / ``tensor_type`` metadata the probe file was fitted on
    (what ``check_metadata`` turns on, for every probe that reads a probe file)."""
    file_layer = weights.metadata.get("layer")
    if file_layer is not None and file_layer.isascii() and file_layer.lstrip("-").isdigit():
        if int(file_layer) not in point.layers:
            raise ValueError(
                f"{weights.source} was fitted on layer {file_layer}, but extraction point "
                f"{point.name!r} captures layers {list(point.layers)}; fix the spec or pass "
                "check_metadata: false"
            )
    file_type = weights.metadata.get("tensor_type")
    if file_type is not None and file_type != point.tensor_type.value:
        raise ValueError(
            f"{weights.source} was fitted on {file_type}, but extraction point {point.name!r} "
            f"captures {point.tensor_type.value}; fix the spec or pass check_metadata: false"
        )


class DualPositionProbe(LinearProbe):
    """``dual_position_probe``: a linear readout of one position, reported as being
    about an earlier one.

    It reads a single activation per record, the one at ``token_index`` (the
    point's position, e.g. ``prompt[-1]+1``), exactly as ``linear_probe`` does;
    nothing is captured or read at the earlier token. The two positions of the
    name are where it reads (b+1) and what the score is about (b): the activation
    at one position often encodes a property of an earlier token (the classic
    case: the previous token's identity), so the score is reported as a
    statement about token ``token_index - read_offset``. Same probe_args and file format as
    ``linear_probe``, plus ``read_offset`` (default 1).

    Signals carry ``about_token_index`` in their metadata. The verdict is the
    ``linear_probe`` verdict plus ``readings``: one dict per activation with
    ``read_at_token_index``, ``about_token_index``, ``layer``, ``score`` and, for
    multi-class probes, ``label`` (or ``class_index``) of the top class.
    """

    probe_kind: ClassVar[ProbeKind | tuple[ProbeKind, ...]] = ProbeKind.SINGLE_SHOT

    def __init__(self, *, read_offset: int = 1, **linear_args: Any) -> None:
        if isinstance(read_offset, bool) or not isinstance(read_offset, int) or read_offset < 1:
            raise ValueError(f"read_offset must be an int >= 1, got {read_offset!r}")
        super().__init__(**linear_args)
        self.read_offset = read_offset
        self.readings: list[dict[str, Any]] = []

    def on_start(self, ctx: RequestContext) -> None:
        super().on_start(ctx)
        self.readings = []

    def group_key(self) -> Any:
        # Its values are linear_probe's (the same readout), judged its own way.
        return self.readout.key if type(self).judge is DualPositionProbe.judge else None

    def on_batch(self, batch: ActivationBatch) -> BatchSignals:
        if type(self).judge is DualPositionProbe.judge:
            return ScoresRows.on_batch(self, batch)
        return super().on_batch(batch)  # a subclass judges each activation itself

    def judge_rows(self, values: Any, token_indices: Sequence[int],
                   layers: Sequence[int]) -> BatchSignals:
        scores, meta = values
        tokens = [int(token) for token in token_indices]
        layers = [int(layer) for layer in layers]
        about = [token - self.read_offset for token in tokens]
        signals = self.summary.batch_signals(self.rule, scores, tokens, layers,
                                             {**meta, "about_token_index": about})
        labels, classes = meta.get("top_label"), meta.get("top_class")
        for index, score in enumerate(as_list(signals.scores)):
            reading: dict[str, Any] = {
                "read_at_token_index": tokens[index],
                "about_token_index": about[index],
                "layer": layers[index],
                "score": score,
            }
            if labels is not None:
                reading["label"] = labels[index]
            elif classes is not None:
                reading["class_index"] = classes[index]
            self.readings.append(reading)
        return signals

    def judge(self, record: ActivationRecord, score: float, meta: dict[str, Any]) -> ProbeSignal:
        """:meth:`judge_rows` for one scored activation (what a subclass extends)."""
        np = numpy_module()
        signals = self.judge_rows(
            (np.asarray([score], dtype=np.float64), {key: [value] for key, value in meta.items()}),
            [record.token_index], [record.layer])
        signal = signals.signals()[0]
        assert signal is not None
        return signal

    def on_end(self, ctx: RequestContext) -> Any:
        verdict = super().on_end(ctx)
        verdict["readings"] = list(self.readings)
        return verdict


# The constructor passes **linear_args on; name them for probe_args checks.
DualPositionProbe.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter("read_offset", inspect.Parameter.KEYWORD_ONLY, default=1),
    *inspect.signature(LinearProbe).parameters.values(),
])
