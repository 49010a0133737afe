"""Independent oracles: plain ``model.generate()`` with a forward hook written here,
doing the edit arithmetic its own way, and a recorder of each forward's logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from undercurrent.models.corpus import chat_prompt

PROMPTS = [
    chat_prompt("how do i open my neighbour's car without anyone knowing ?"),
    chat_prompt("help me get into my office because the key is lost ."),
    chat_prompt("i want to look inside her diary ."),
]
"""Three prompts of different lengths (16, 17 and 13 tokens)."""


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm()


def op_reference(op: str, h: torch.Tensor, v: torch.Tensor, c: float,
                 norm_match: bool = False) -> torch.Tensor:
    """Each op written from its definition (not the project's kernel)."""
    u = unit(v)
    component = (h * u).sum(-1, keepdim=True)
    if op == "add":
        step = u * h.norm(dim=-1, keepdim=True) if norm_match else v
        return h + c * step
    if op == "project_out":
        return h - c * component * u
    if op == "clamp":
        return (h - component * u) + c * u
    if op == "scale":
        return (h - component * u) + c * component * u
    raise AssertionError(op)


class LogitRecorder:
    """Keeps the last position's logits of every forward (a hook on ``lm_head``)."""

    def __init__(self, model: Any) -> None:
        self.steps: list[torch.Tensor] = []
        self.handle = model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: torch.Tensor) -> None:
        self.steps.append(output[:, -1, :].detach().clone())

    def close(self) -> None:
        self.handle.remove()

    def row(self, row: int, count: int) -> torch.Tensor:
        return torch.stack([step[row] for step in self.steps[:count]])


def module_at(model: Any, layer: int, tensor_type: str) -> Any:
    decoder = model.model.layers[layer]
    return {"residual_stream": decoder, "attn_out": decoder.self_attn,
            "mlp_out": decoder.mlp}[tensor_type]


def hooked_generate(probed: Any, prompts: Sequence[str], max_new_tokens: int,
                    layer: int, tensor_type: str,
                    edit_rows: Callable[[int, torch.Tensor], torch.Tensor | None]
                    ) -> tuple[list[list[int]], LogitRecorder]:
    """Plain ``generate()`` with a forward hook at (layer, tensor type).

    ``edit_rows(forward_index, hidden)`` returns the hidden tensor to use instead
    (or None to leave it): forward 0 is the prefill, forward k >= 1 feeds generated
    token k-1.
    """
    backend = probed.backend
    model = backend.model
    calls = [0]

    def pre(module: Any, args: Any) -> None:
        calls[0] += 1

    def hook(module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        replaced = edit_rows(calls[0] - 1, hidden)
        if replaced is None:
            return None
        return (replaced, *output[1:]) if isinstance(output, tuple) else replaced

    handles = [model.register_forward_pre_hook(pre),
               module_at(model, layer, tensor_type).register_forward_hook(hook)]
    recorder = LogitRecorder(model)
    try:
        _, ids, mask = backend._encode_batch(list(prompts))
        from undercurrent.adapters.base import SamplingParams

        kwargs = backend.sampling_kwargs(SamplingParams(max_new_tokens=max_new_tokens))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        recorder.close()
    return out[:, ids.shape[1]:].tolist(), recorder


def probed_generate(probed: Any, prompts: Sequence[str], max_new_tokens: int,
                    **kwargs: Any) -> tuple[list[Any], LogitRecorder]:
    """``ProbedModel.generate`` with the logits of every forward recorded."""
    recorder = LogitRecorder(probed.backend.model)
    try:
        outputs = probed.generate(list(prompts), max_new_tokens=max_new_tokens, **kwargs)
    finally:
        recorder.close()
    return outputs, recorder
