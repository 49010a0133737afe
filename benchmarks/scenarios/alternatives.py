"""The tools researchers use today: nnsight and TransformerLens (benchmark-only extras).

Both capture exactly what the three-layer undercurrent scenarios capture: the
residual stream (decoder layer output) at the chosen layers for every
generated token that passes through the model.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any, ClassVar

from benchmarks.measure import GenerationRun, tensor_bytes
from benchmarks.scenarios.base import Batch, Scenario, hf_generate_kwargs, new_tokens


def _missing(module: str, package: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{package} is not installed (make bench installs it in .venv-bench)"
    return None


TRANSFORMER_LENS_COMPARED = (4, 3)
"""The TransformerLens release the comparison is written for (the bench extra's pin).
sae-lens (the sae extra) pins transformer-lens<4, so the main environment may hold
an older one; `make bench` installs the bench extra in its own environment."""


def _too_old(package: str, wanted: tuple[int, ...]) -> str | None:
    from importlib.metadata import version

    installed = version(package)
    parts = tuple(int(p) for p in installed.split(".")[:len(wanted)] if p.isdigit())
    if parts < wanted:
        needed = ".".join(map(str, wanted))
        return (f"{package} {installed} is installed (sae-lens pins <4); the comparison "
                f"needs >={needed}: run `make bench`, which uses its own environment")
    return None


class NnsightCapture(Scenario):
    """nnsight ``TransformersModel.generate`` saving layer outputs at every decode step."""

    name: ClassVar[str] = "nnsight"
    family: ClassVar[str] = "alternative"
    captures: ClassVar[str] = "residual stream at the chosen layers for every generated token"
    limits: ClassVar[str] = (
        "values are read after the trace ends, not handed to a probe while generating; "
        "stopping a request mid-generation means writing interventions in its tracing "
        "language; per-request positions are the caller's job under batching"
    )
    own_model: ClassVar[bool] = True

    def unavailable_reason(self) -> str | None:
        return _missing("nnsight", "nnsight")

    def setup(self, bundle: Any, model: Any, layers: tuple[int, ...]) -> None:
        super().setup(bundle, model, layers)
        from nnsight import TransformersModel

        self.wrapped = TransformersModel(model, tokenizer=bundle.tokenizer)

    def generate(self, batch: Batch, max_new_tokens: int) -> GenerationRun:
        wrapped, layers = self.wrapped, self.layers
        kwargs = hf_generate_kwargs(self.bundle, max_new_tokens)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with wrapped.generate(
                batch.input_ids, attention_mask=batch.attention_mask, **kwargs
            ) as tracer:
                saved = list().save()
                # Call 0 is the prompt's prefill; calls 1.. take one generated token each.
                for _step in tracer.iter[1:max_new_tokens]:
                    for layer in layers:
                        saved.append(wrapped.model.layers[layer].output[:, -1].clone())
                sequences = tracer.result.save()
        return GenerationRun(
            new_tokens(sequences, batch.prompt_length),
            records=sum(t.shape[0] for t in saved),
            captured_bytes=tensor_bytes(saved),
        )


class TransformerLensCapture(Scenario):
    """TransformerLens ``TransformerBridge`` over the HF model, hooks on ``blocks.L.hook_out``."""

    name: ClassVar[str] = "transformer_lens"
    family: ClassVar[str] = "alternative"
    captures: ClassVar[str] = "residual stream at the chosen layers for every generated token"
    limits: ClassVar[str] = (
        "TransformerBridge forces eager attention on the wrapped model and runs its own "
        "Python generation loop; hooks see batched tensors, mapping rows to requests and "
        "stopping one request is the caller's job"
    )
    own_model: ClassVar[bool] = True

    def unavailable_reason(self) -> str | None:
        missing = _missing("transformer_lens", "transformer-lens")
        if missing is not None:
            return missing
        return _too_old("transformer-lens", TRANSFORMER_LENS_COMPARED)

    def setup(self, bundle: Any, model: Any, layers: tuple[int, ...]) -> None:
        super().setup(bundle, model, layers)
        from transformer_lens.model_bridge import TransformerBridge

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.bridge = TransformerBridge.boot_transformers(
                "benchmark-model", hf_model=model, tokenizer=bundle.tokenizer
            )

    def generate(self, batch: Batch, max_new_tokens: int) -> GenerationRun:
        captured: list[Any] = []

        def keep_new_token(activation: Any, hook: Any) -> Any:
            if activation.shape[1] == 1:  # a decode step: the input is a generated token
                captured.append(activation[:, -1].detach().clone())
            return activation

        hooks = [(f"blocks.{layer}.hook_out", keep_new_token) for layer in self.layers]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.bridge.hooks(fwd_hooks=hooks):
                sequences = self.bridge.generate(
                    batch.input_ids,
                    attention_mask=batch.attention_mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    stop_at_eos=False,
                    use_past_kv_cache=True,
                    return_type="tokens",
                    verbose=False,
                )
        return GenerationRun(
            new_tokens(sequences, batch.prompt_length),
            records=sum(t.shape[0] for t in captured),
            captured_bytes=tensor_bytes(captured),
        )
