"""undercurrent's own scenarios: ``ProbedModel`` on the HF backend with various specs.

Probes are configured never to abort (no threshold), so every scenario must
generate exactly the baseline's tokens; the captured data is counted from each
``ProbeResult``'s stats.
"""

from __future__ import annotations

from typing import Any, ClassVar

from benchmarks.measure import GenerationRun
from benchmarks.scenarios.base import Batch, Scenario


def three_layer_point(layers: tuple[int, ...], **fields: Any) -> dict[str, Any]:
    """A residual_stream point on ``generated[*]`` at ``layers`` (spec-dict form)."""
    point = {
        "name": "residual",
        "layers": list(layers),
        "tensor_type": "residual_stream",
        "position": "generated[*]",
        "probe_type": "norm_probe",
        "probe_kind": "single_shot",
        "execution_mode": "inline",
    }
    point.update(fields)
    return point


class _Probed(Scenario):
    """Shared driver: build a ``ProbedModel`` once, generate, count probe records."""

    family: ClassVar[str] = "undercurrent"
    own_model: ClassVar[bool] = True

    def unavailable_reason(self) -> str | None:
        try:
            from undercurrent.api import ProbedModel  # noqa: F401
        except ImportError as error:
            return f"undercurrent.api.ProbedModel is not importable: {error}"
        return None

    def points(self) -> list[dict[str, Any]]:
        """The spec's extraction points for the chosen layers."""
        raise NotImplementedError

    def edits(self) -> list[dict[str, Any]]:
        """The spec's live edits (spec-dict form; none by default)."""
        return []

    keep_records: ClassVar[bool] = False

    def probe_classes(self) -> dict[str, type] | None:
        """Probe classes to register on top of the built-ins (by probe_type name)."""
        return None

    def setup(self, bundle: Any, model: Any, layers: tuple[int, ...]) -> None:
        super().setup(bundle, model, layers)
        from undercurrent.api import ProbedModel
        from undercurrent.spec import ProbeSpec, parse_dict

        points, edits = self.points(), self.edits()
        spec = (
            parse_dict({"version": "2", "extraction_points": points, "edits": edits}) if edits
            else parse_dict({"version": "1", "extraction_points": points}) if points
            else ProbeSpec()
        )
        self.probed = ProbedModel(model, bundle.tokenizer, spec=spec, backend="hf",
                                  probes=self.probe_classes())

    def generate(self, batch: Batch, max_new_tokens: int) -> GenerationRun:
        # One generate() call for the whole batch, like the baselines (ProbedModel's
        # default batch_size of 8 would split a larger batch into sequential calls).
        outputs = self.probed.generate(input_ids=batch.token_lists,
                                       max_new_tokens=max_new_tokens,
                                       temperature=0.0, records=self.keep_records,
                                       batch_size=batch.size)
        records = dropped = errors = timeouts = 0
        for output in outputs:
            for result in output.results.values():
                records += result.stats.received
                dropped += result.stats.dropped
                errors += result.stats.errors
                timeouts += result.stats.timeouts
        if self.keep_records:  # the product is the records on the outputs: count those
            records = sum(len(output.records or ()) for output in outputs)
        hidden = self.model.config.hidden_size
        element = next(self.model.parameters()).element_size()
        return GenerationRun(
            [list(output.token_ids) for output in outputs],
            records=records,
            captured_bytes=records * hidden * element,
            notes={"dropped": dropped, "probe_errors": errors, "timeouts": timeouts,
                   "aborted": sum(1 for output in outputs if output.aborted)},
        )

    def close(self) -> None:
        close = getattr(getattr(self, "probed", None), "close", None)
        if close is not None:
            close()


class ProbedEmptySpec(_Probed):
    """``ProbedModel`` with an empty spec: the machinery alone."""

    name: ClassVar[str] = "uc_empty_spec"
    captures: ClassVar[str] = "nothing (machinery only)"

    def points(self) -> list[dict[str, Any]]:
        return []


class ProbedInlineNorm(_Probed):
    """Residual stream at three layers on ``generated[*]`` to an inline ``norm_probe``."""

    name: ClassVar[str] = "uc_3_layers_inline_norm"
    captures: ClassVar[str] = (
        "residual stream at 3 layers for every generated token, each probed inline "
        "(norm_probe) while generating"
    )

    def points(self) -> list[dict[str, Any]]:
        return [three_layer_point(self.layers)]


class ProbedCaptureOnly(_Probed):
    """The same capture kept as records on each output, with no probe work:
    what raw hooks, nnsight and TransformerLens deliver (the tensors in hand)."""

    name: ClassVar[str] = "uc_3_layers_capture_only"
    captures: ClassVar[str] = (
        "residual stream at 3 layers for every generated token, returned as "
        "ActivationRecords (records=True) to the built-in capture probe (judges nothing)"
    )
    keep_records: ClassVar[bool] = True

    def points(self) -> list[dict[str, Any]]:
        return [three_layer_point(self.layers, probe_type="capture")]


class ProbedAsyncTrajectory(_Probed):
    """The same capture to an async ``trajectory_probe`` (running EWMA of the norm)."""

    name: ClassVar[str] = "uc_3_layers_async_trajectory"
    captures: ClassVar[str] = (
        "residual stream at 3 layers for every generated token, probed off the hot path "
        "by an async trajectory_probe"
    )

    def points(self) -> list[dict[str, Any]]:
        return [
            three_layer_point(
                self.layers,
                probe_type="trajectory_probe",
                probe_kind="trajectory",
                execution_mode="async",
                probe_args={"source": "norm"},
            )
        ]


class ProbedInlineTrajectory(ProbedAsyncTrajectory):
    """The async trajectory scenario's point, inline: the same capture and the
    same probe, judged on the generation thread (what the async path is
    compared with, probe for probe)."""

    name: ClassVar[str] = "uc_inline_trajectory"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, judged inline by "
        "the same trajectory_probe as the async scenario"
    )

    def points(self) -> list[dict[str, Any]]:
        return [{**point, "execution_mode": "inline"} for point in super().points()]


class ProbedInlineTrajectoryGuard(ProbedInlineTrajectory):
    """:class:`ProbedInlineTrajectory` as a guard: ``action: abort`` on its
    running EWMA at a threshold no norm reaches, so it may abort a request at
    any step but never does (its steps are held while the probes' running
    bound stays below it: ``RunningBound``)."""

    name: ClassVar[str] = "uc_inline_trajectory_guard"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, judged inline by "
        "the trajectory_probe with action: abort on its running EWMA (a threshold no "
        "statistic reaches)"
    )

    def points(self) -> list[dict[str, Any]]:
        return [{**point, "probe_args": {**point["probe_args"], "threshold": 1e9,
                                         "action": "abort"}}
                for point in super().points()]


class ProbedInlineLinear(_Probed):
    """The capture to an inline ``linear_probe`` reading the bundled probe file
    (its metadata check off, so any layer set may use it; the file's threshold
    only flags, it never aborts). On a model of another width (``--model
    large``) the probe is the same product with inline weights of that width (a
    uniform readout, no threshold): the bundled file would refuse every row."""

    name: ClassVar[str] = "uc_inline_linear"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe (the bundled probe.safetensors) while generating"
    )

    def points(self) -> list[dict[str, Any]]:
        bundle = getattr(self, "bundle", None)  # (a vLLM job sets a stand-in: its config)
        hidden = None if bundle is None else int(bundle.model.config.hidden_size)
        args: dict[str, Any] = dict(LINEAR_PROBE_ARGS)
        if hidden is not None and hidden != BUNDLED_PROBE_WIDTH:
            args = {"weight": [1.0 / hidden] * hidden, "bias": 0.0}
        return [three_layer_point(self.layers, probe_type="linear_probe", probe_args=args)]


class ProbedInlineLinearGuard(ProbedInlineLinear):
    """:class:`ProbedInlineLinear` as a guard: ``action: abort`` at a threshold
    above any score its sigmoid link gives (1.01), so it may abort a request
    at any step but never does, and every scenario generates the same tokens.
    What a live guard costs while it lets everything through."""

    name: ClassVar[str] = "uc_inline_linear_guard"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe with action: abort (a threshold no score reaches)"
    )

    def points(self) -> list[dict[str, Any]]:
        return [{**point, "probe_args": {**point["probe_args"], "threshold": GUARD_THRESHOLD,
                                         "action": "abort"}}
                for point in super().points()]


class ProbedGuardAndObserver(ProbedInlineLinearGuard):
    """The demo spec's shape (``undercurrent:models/demo.yaml``) on the chosen layers: the
    guard of :class:`ProbedInlineLinearGuard` and, on the same rows, an async
    ``trajectory_probe`` that only flags. Two points of one capture: what a
    spec of several points costs."""

    name: ClassVar[str] = "uc_guard_and_observer"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe with action: abort (a threshold no score reaches) and observed by an "
        "async trajectory_probe (flag only)"
    )

    def points(self) -> list[dict[str, Any]]:
        guard = super().points()[0]
        observer = {**guard, "name": "observer", "probe_type": "trajectory_probe",
                    "probe_kind": "trajectory", "execution_mode": "async",
                    "probe_args": {"source": "norm"}}
        return [{**guard, "name": "guard"}, observer]


#: Above any score of a sigmoid link: the guard scenario never aborts.
GUARD_THRESHOLD = 1.01


#: The bundled probe file, usable at any layer: the scaling scenarios put it on
#: every layer, which its layer metadata (layer 3) would otherwise refuse.
LINEAR_PROBE_ARGS: dict[str, Any] = {
    "path": "undercurrent:models/tiny/probe.safetensors",
    "check_metadata": False,
}
#: The activation width the bundled probe file reads (the bundled model's hidden size).
BUNDLED_PROBE_WIDTH = 128


class ProbedAllLayers(_Probed):
    """Residual stream at every decoder layer to an inline ``norm_probe``."""

    name: ClassVar[str] = "uc_all_layers_inline_norm"
    captures: ClassVar[str] = "residual stream at every layer for every generated token, inline"

    def points(self) -> list[dict[str, Any]]:
        return [three_layer_point(tuple(range(self.bundle.num_layers)))]


class ProbedBlockUntilSignal(_Probed):
    """Three layers inline under ``block_until_signal`` with a fast probe (norm)."""

    name: ClassVar[str] = "uc_3_layers_block_until_signal"
    captures: ClassVar[str] = (
        "residual stream at 3 layers for every generated token; generation waits for "
        "each signal (block_until_signal, timeout 1000 ms)"
    )

    def points(self) -> list[dict[str, Any]]:
        return [
            three_layer_point(
                self.layers,
                intervention={"mode": "block_until_signal", "timeout_ms": 1000},
            )
        ]


class ProbedSaeFeatures(_Probed):
    """The shipped SAE spec's shape (``specs/sae_features.yaml``) on the chosen
    layers: an inline ``sae_probe`` guard watching one feature (``action:
    abort`` at a threshold no activation reaches, so every scenario generates
    the same tokens) and, on the same rows, an async ``sae_probe`` reporting
    each activation's top 8 features. The bundled SAE reads the bundled
    model's width; its hook check is off, so any layer set may use it."""

    name: ClassVar[str] = "uc_sae_features"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, encoded by the "
        "bundled SAE: an inline sae_probe guard on one feature (action: abort, a threshold "
        "no activation reaches) and an async sae_probe reporting the top 8 features"
    )

    def points(self) -> list[dict[str, Any]]:
        bundle = getattr(self, "bundle", None)  # (a vLLM job sets a stand-in: its config)
        hidden = None if bundle is None else int(bundle.model.config.hidden_size)
        if hidden is not None and hidden != BUNDLED_PROBE_WIDTH:
            raise ValueError(f"{self.name} runs on models of the bundled width only: the "
                             f"bundled SAE reads activations of {BUNDLED_PROBE_WIDTH} values, "
                             f"this model's have {hidden}")
        sae = {"path": "undercurrent:models/tiny/sae", "check_hook": False}
        guard = three_layer_point(self.layers, probe_type="sae_probe",
                                  probe_args={**sae, "features": [2], "threshold": 1e9,
                                              "action": "abort"})
        features = {**guard, "name": "features", "probe_kind": "trajectory",
                    "execution_mode": "async", "queue_depth": 64,
                    "probe_args": {**sae, "top_k": 8}}
        return [{**guard, "name": "guard"}, features]


class ProbedStrided(ProbedInlineLinear):
    """:class:`ProbedInlineLinear` on every second generated token (``stride:
    2``): a layout whose captures repeat every other step."""

    name: ClassVar[str] = "uc_inline_linear_stride_2"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every second generated token, scored "
        "inline by linear_probe"
    )

    def points(self) -> list[dict[str, Any]]:
        return [{**point, "stride": 2} for point in super().points()]


class ProbedMixedStrides(ProbedInlineLinear):
    """:class:`ProbedInlineLinear` as two points: the lower half of the chosen
    layers on every generated token, the upper half on every second one. No
    plan repeats from one step to the next, so each decode step is planned and
    routed as it comes (the general path)."""

    name: ClassVar[str] = "uc_inline_linear_mixed_strides"
    captures: ClassVar[str] = (
        "residual stream at the lower half of the chosen layers for every generated token "
        "and at the upper half for every second one, scored inline by linear_probe"
    )

    def points(self) -> list[dict[str, Any]]:
        point = super().points()[0]
        layers = list(point["layers"])
        half = max(1, len(layers) // 2)
        if len(layers) < 2:
            raise ValueError(f"{self.name} needs two layers or more, got {layers}")
        return [{**point, "name": "every", "layers": layers[:half]},
                {**point, "name": "second", "layers": layers[half:], "stride": 2}]


class ProbedWithEdit(ProbedInlineLinear):
    """:class:`ProbedInlineLinear` beside a live edit on every generated token
    (``op: add`` of the bundled probe's direction at the middle chosen layer,
    coefficient 0, so the tokens stay the baseline's while the edit is planned,
    applied and logged as any other). The edit gives every generated token the
    same change, so the decode steps repeat their plan with it, held in windows
    beside the probe."""

    name: ClassVar[str] = "uc_inline_linear_and_edit"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe, beside an add edit (coefficient 0) on every generated token"
    )

    def edits(self) -> list[dict[str, Any]]:
        bundle = getattr(self, "bundle", None)
        hidden = None if bundle is None else int(bundle.model.config.hidden_size)
        vector: Any = ("undercurrent:models/tiny/probe.safetensors"
                       if hidden in (None, BUNDLED_PROBE_WIDTH) else [1.0] * hidden)
        return [{"name": "steer", "layers": self.layers[len(self.layers) // 2],
                 "tensor_type": "residual_stream", "position": "generated[*]", "op": "add",
                 "vector": vector, "coefficient": 0.0}]


class ProbedMixedStridesWithEdit(ProbedMixedStrides):
    """:class:`ProbedMixedStrides` beside :class:`ProbedWithEdit` 's edit on every
    generated token (coefficient 0): the steps of a period differ in what they
    capture, and each applies the edit."""

    name: ClassVar[str] = "uc_inline_linear_mixed_strides_and_edit"
    captures: ClassVar[str] = (
        "residual stream at the lower half of the chosen layers for every generated token "
        "and at the upper half for every second one, scored inline by linear_probe, beside "
        "an add edit (coefficient 0) on every generated token"
    )

    edits = ProbedWithEdit.edits


class ProbedWithTriggeredEdit(ProbedWithEdit):
    """:class:`ProbedWithEdit` with the edit switched on by the probe's flag
    (``when``), at a threshold no score reaches: the edit is never switched on,
    so the tokens stay the baseline's while every step's signals are read for
    the flag that would arm it. What a guard that steers when it fires costs
    while it does not."""

    name: ClassVar[str] = "uc_inline_linear_and_triggered_edit"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe, beside an add edit switched on by the probe's flag (a threshold no "
        "score reaches: never switched on)"
    )

    def points(self) -> list[dict[str, Any]]:
        (point,) = super().points()
        return [{**point, "probe_args": {**point["probe_args"], "threshold": 1e9,
                                         "action": "flag"}}]

    def edits(self) -> list[dict[str, Any]]:
        return [{**edit, "when": {"point": "residual", "action": "flag"}}
                for edit in super().edits()]


class ProbedWithSwitchedEdit(ProbedWithTriggeredEdit):
    """:class:`ProbedWithTriggeredEdit` at a threshold every score passes: each
    request's first generated token flags and switches the edit on, so it
    applies from the second generated token on (coefficient 0: the tokens stay
    the baseline's). What a guard that steers costs once it has fired."""

    name: ClassVar[str] = "uc_inline_linear_and_switched_edit"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe, beside an add edit switched on by the probe's flag (every score "
        "flags: on from each request's second generated token)"
    )

    def points(self) -> list[dict[str, Any]]:
        (point,) = super().points()
        return [{**point, "probe_args": {**point["probe_args"], "threshold": -1e9}}]


class ProbedWithEndingEdits(ProbedWithEdit):
    """:class:`ProbedInlineLinear` beside three edits that end (coefficient 0,
    so the tokens stay the baseline's): :class:`ProbedWithEdit` 's on the last
    prompt token, on generated tokens 2 to 11, and on generated token 16. The
    steps between, within the slice and after the last repeat their plans."""

    name: ClassVar[str] = "uc_inline_linear_and_ending_edits"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe, beside add edits (coefficient 0) on the last prompt token, on "
        "generated tokens 2 to 11 and on generated token 16"
    )

    def edits(self) -> list[dict[str, Any]]:
        (edit,) = super().edits()
        return [{**edit, "name": name, "position": position}
                for name, position in (("prompt", "prompt[-1]"), ("slice", "generated[2:12]"),
                                       ("once", "generated[16]"))]


class ProbedSlice(ProbedInlineLinear):
    """:class:`ProbedInlineLinear` on a bounded slice of the generated tokens
    (``generated[2:20]``): a layout that ends before the generation does."""

    name: ClassVar[str] = "uc_inline_linear_slice"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for generated tokens 2 to 19, scored inline "
        "by linear_probe"
    )

    def points(self) -> list[dict[str, Any]]:
        return [{**point, "position": "generated[2:20]"} for point in super().points()]


class ProbedPromptLast(ProbedInlineLinear):
    """:class:`ProbedInlineLinear` on the last prompt token only
    (``prompt[-1]``): the usual probing study's capture, one vector per
    request and layer from the prefill, and nothing left to capture once the
    prompt is read (the decode steps plan nothing)."""

    name: ClassVar[str] = "uc_inline_linear_prompt_last"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for the last prompt token only, scored inline "
        "by linear_probe"
    )

    def points(self) -> list[dict[str, Any]]:
        return [{**point, "position": "prompt[-1]"} for point in super().points()]


class ProbedWithPromptRead(ProbedInlineLinear):
    """:class:`ProbedInlineLinear` beside a point reading the last prompt token
    at the last chosen layer (an inline ``norm_probe``): a spec with a point
    that ends after one token."""

    name: ClassVar[str] = "uc_inline_linear_and_prompt_read"
    captures: ClassVar[str] = (
        "residual stream at the chosen layers for every generated token, scored inline by "
        "linear_probe, and the last prompt token at the last chosen layer, to norm_probe"
    )

    def points(self) -> list[dict[str, Any]]:
        (point,) = super().points()
        read = three_layer_point((max(self.layers),), position="prompt[-1]")
        return [point, {**read, "name": "prompt_read"}]
