"""The ``generation_config`` settings that read a row's earlier tokens, applied to
each row of a left-padded batch as to that prompt alone.

``generate()`` hands its logits processors the batch's ``input_ids``, left padding
included: ``repetition_penalty`` penalises the pad id in a padded row (the eos id,
where the tokenizer has no pad token), ``min_length`` counts the padding, and the
n-gram and sequence settings match it. A prompt's tokens then depend on the other
prompts of its batch. In a batch with padding the HF backend turns these settings
off in ``generate()`` and applies them here, each as transformers' own processor
does, to each row without its padding; a batch without padding leaves them to
``generate()``, which stays token-identical to plain ``generate()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The settings applied here, in the order ``generate()`` applies them, with the
#: value that turns each off in ``generate()``.
SETTINGS: dict[str, Any] = {
    "sequence_bias": None,
    "encoder_repetition_penalty": 1.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
}


def _on(name: str, value: Any) -> bool:
    """Whether ``generate()`` applies setting ``name`` at ``value``."""
    if value is None:
        return False
    if name.endswith("repetition_penalty"):
        return bool(value != 1.0)
    if name.endswith("_size") or name == "min_length":
        return bool(value > 0)
    return True


def unpadded_settings(config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      eos_token_ids: list[int]) -> tuple[dict[str, Any], LogitsProcessor | None]:
    """``(generate() keyword arguments that turn the settings off, the processor that
    applies them row by row without the padding)`` for the left-padded batch
    ``input_ids`` / ``attention_mask`` of a model with generation config ``config``;
    ``({}, None)`` where no row is padded or none of :data:`SETTINGS` is on."""
    if bool(attention_mask[:, 0].all()):  # (left padding: the first column holds every pad)
        return {}, None
    values = {name: getattr(config, name, None) for name in SETTINGS}
    if getattr(config, "min_new_tokens", None) is not None:
        # (generate() then replaces min_length with min_new_tokens plus the padded
        # width: a count of new tokens, the same in every row)
        values["min_length"] = None
    if not eos_token_ids:  # (generate() bars no eos without one)
        values["min_length"] = None
    on = {name: value for name, value in values.items() if _on(name, value)}
    if not on:
        return {}, None
    return ({name: SETTINGS[name] for name in on},
            _UnpaddedRows(on, input_ids, attention_mask, eos_token_ids))


class _UnpaddedRows(LogitsProcessor):
    """Applies settings of :data:`SETTINGS` to each row of a left-padded batch as
    to its prompt alone."""

    def __init__(self, settings: dict[str, Any], input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, eos_token_ids: list[int]) -> None:
        self.width = input_ids.shape[1]
        mask = attention_mask.bool()
        #: Each row's pad columns (its first ``starts[row]``).
        self.starts = (~mask).sum(dim=1).tolist()
        # The penalties read a row's tokens as a set: each pad column takes a token
        # of its own row (the last column always holds one), so the set is the
        # row's, and the gather/scatter of every real token is as without padding.
        self.filled = cast(torch.LongTensor, torch.where(mask, input_ids, input_ids[:, -1:]))
        self.steps: list[Step] = []
        for name, value in settings.items():
            if name == "repetition_penalty":
                self.steps.append(self._filled(RepetitionPenaltyLogitsProcessor(float(value))))
            elif name == "encoder_repetition_penalty":
                # (the penalty of a decoder-only model reads the prompt: its filled ids)
                self.steps.append(EncoderRepetitionPenaltyLogitsProcessor(
                    float(value), encoder_input_ids=self.filled))
            elif name == "min_length":
                self.steps.append(self._min_length(int(value), mask, eos_token_ids))
            elif name == "encoder_no_repeat_ngram_size":
                rows = [EncoderNoRepeatNGramLogitsProcessor(
                            int(value), cast(torch.LongTensor, input_ids[row:row + 1, start:]))
                        for row, start in enumerate(self.starts)]
                self.steps.append(self._each_row(rows))
            else:
                processor = (SequenceBiasLogitsProcessor(value) if name == "sequence_bias"
                             else NoRepeatNGramLogitsProcessor(int(value))
                             if name == "no_repeat_ngram_size"
                             else NoBadWordsLogitsProcessor(value, eos_token_ids or None))
                self.steps.append(self._each_row([processor] * len(self.starts)))

    def _filled(self, processor: LogitsProcessor) -> Step:
        def step(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            ids = torch.cat((self.filled, input_ids[:, self.width:]), dim=1)
            return processor(ids, scores)  # type: ignore[no-any-return]
        return step

    def _each_row(self, processors: Sequence[LogitsProcessor]) -> Step:
        """A step that runs ``processors[row]`` on each row alone, without its padding."""
        def step(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return torch.cat([processor(input_ids[row:row + 1, start:], scores[row:row + 1])
                              for row, (processor, start)
                              in enumerate(zip(processors, self.starts, strict=True))])
        return step

    def _min_length(self, min_length: int, mask: torch.Tensor, eos_token_ids: list[int]) -> Step:
        """``min_length`` counted as for each prompt alone: a row's eos ids are barred
        until its prompt (without padding) and new tokens reach it."""
        needed = min_length - mask.sum(dim=1)  # (new tokens each row needs)
        eos = torch.zeros(1, 0, dtype=torch.bool)  # (built at the first step: the vocab size)

        def step(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            nonlocal eos
            if eos.shape[1] != scores.shape[1]:
                eos = torch.zeros(1, scores.shape[1], dtype=torch.bool, device=scores.device)
                eos[0, eos_token_ids] = True
            barred = (needed > input_ids.shape[1] - self.width)[:, None] & eos
            return scores.masked_fill(barred, -float("inf"))
        return step

    def __call__(self, input_ids: torch.LongTensor,
                 scores: torch.FloatTensor) -> torch.FloatTensor:
        for step in self.steps:
            scores = step(input_ids, scores)  # type: ignore[assignment]
        return scores
