"""Baselines: plain ``generate()``, ``output_hidden_states``, raw forward hooks.

The raw-hook scenario is the floor for hook-based capture: a forward hook on
each chosen decoder layer that copies the new token's hidden state into a list.
"""

from __future__ import annotations

from typing import Any, ClassVar

from benchmarks.measure import GenerationRun, tensor_bytes
from benchmarks.scenarios.base import Batch, Scenario, hf_generate_kwargs, new_tokens


class PlainGenerate(Scenario):
    """transformers ``generate()`` with nothing attached: the baseline."""

    name: ClassVar[str] = "plain_generate"
    family: ClassVar[str] = "baseline"
    captures: ClassVar[str] = "nothing"

    def generate(self, batch: Batch, max_new_tokens: int) -> GenerationRun:
        # generate() runs under torch.no_grad() itself: called as a researcher would.
        out = self.model.generate(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            **hf_generate_kwargs(self.bundle, max_new_tokens),
        )
        return GenerationRun(new_tokens(out, batch.prompt_length))


class HiddenStatesCapture(Scenario):
    """``generate(output_hidden_states=True)``: transformers' own capture."""

    name: ClassVar[str] = "hf_output_hidden_states"
    family: ClassVar[str] = "alternative"
    captures: ClassVar[str] = (
        "residual stream of every layer (plus embeddings) at every prompt position and "
        "every generated step, returned after generate() ends"
    )
    limits: ClassVar[str] = (
        "cannot select layers or positions (captures all of them, so far more data than "
        "3 layers); no access while generating, so no live probe and no abort; no "
        "attention/MLP outputs"
    )

    def generate(self, batch: Batch, max_new_tokens: int) -> GenerationRun:
        out = self.model.generate(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            output_hidden_states=True,
            return_dict_in_generate=True,
            **hf_generate_kwargs(self.bundle, max_new_tokens),
        )
        tensors = [layer for step in out.hidden_states for layer in step]
        records = sum(t.shape[0] * t.shape[1] for t in tensors)
        return GenerationRun(
            new_tokens(out.sequences, batch.prompt_length),
            records=records,
            captured_bytes=tensor_bytes(tensors),
        )


def decoder_layers(model: Any) -> Any:
    """The decoder layer list of a Llama-style transformers model."""
    return model.model.layers


class RawHooksCapture(Scenario):
    """Forward hooks on the chosen decoder layers appending the new token's state."""

    name: ClassVar[str] = "raw_forward_hooks"
    family: ClassVar[str] = "alternative"
    captures: ClassVar[str] = "residual stream at the chosen layers for every generated token"
    limits: ClassVar[str] = (
        "no probes, routing, per-request isolation or abort: a list of tensors the caller "
        "must map back to requests and positions itself"
    )

    def generate(self, batch: Batch, max_new_tokens: int) -> GenerationRun:
        captured: list[Any] = []

        def keep_new_token(module: Any, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.shape[1] == 1:  # a decode step: the input is a generated token
                captured.append(hidden[:, -1].detach().clone())

        layers = decoder_layers(self.model)
        handles = [layers[i].register_forward_hook(keep_new_token) for i in self.layers]
        try:
            out = self.model.generate(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                **hf_generate_kwargs(self.bundle, max_new_tokens),
            )
        finally:
            for handle in handles:
                handle.remove()
        return GenerationRun(
            new_tokens(out, batch.prompt_length),
            records=sum(t.shape[0] for t in captured),
            captured_bytes=tensor_bytes(captured),
        )
