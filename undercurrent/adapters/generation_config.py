"""The settings of a model's ``generation_config`` that change which tokens come out,
as transformers' ``generate()`` applies them: read by both backends.

The HF backend runs ``generate()``, which applies every one of them but the call's
own (``temperature``, ``top_p``, ``top_k``, ``do_sample`` and ``max_new_tokens``
come from the call). Some decode otherwise than one sequence per prompt, one token
per forward pass (:data:`OTHER_DECODING`): both backends refuse those. The vLLM
backend applies the others that vLLM's sampling can express and refuses the rest
(:mod:`undercurrent.adapters.vllm.generation`). Settings that change no token
(special token ids, cache and output options, ``renormalize_logits``) are not
listed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``generation_config`` settings that decode otherwise than one row per prompt and
#: one token per forward pass (``num_*``: above 1; ``guidance_scale``: other than
#: 1; the others: set at all).
OTHER_DECODING = {
    "num_beams": "beam search",
    "num_beam_groups": "group beam search",
    "num_return_sequences": "several sequences per prompt",
    "prompt_lookup_num_tokens": "prompt-lookup (assisted) decoding",
    "assistant_early_exit": "self-speculative (assisted) decoding from an early layer",
    "prefill_chunk_size": "a prompt prefilled in chunks",
    "guidance_scale": "classifier-free guidance: a second, unconditional forward of the "
                      "model per token",
}


def other_decoding(read: Callable[[str], Any]) -> tuple[str, Any, str, Any] | None:
    """The first :data:`OTHER_DECODING` setting ``read`` (a setting's name to its
    value, None when unset) gives a value that decodes otherwise, as ``(name,
    value, what it does, the value that turns it off)``; None when there is none."""
    for name, what in OTHER_DECODING.items():
        value = read(name)
        counted = name.startswith("num_")
        if value is None or (counted and value <= 1) or (
                name == "guidance_scale" and value == 1):  # (1: no guidance)
            continue
        return name, value, what, 1 if counted else None
    return None
