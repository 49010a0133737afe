"""The scenario interface the harness drives, and the prompt batch it passes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from benchmarks.measure import GenerationRun
from benchmarks.models import ModelBundle


@dataclass
class Batch:
    """Prompts as strings, as encoded tensors (left-padded), and as each
    prompt's token ids without padding (what ``ProbedModel.generate`` takes as
    ``input_ids``: every scenario starts from the same token ids, none pays
    for tokenizing)."""

    prompts: list[str]
    input_ids: Any
    attention_mask: Any
    token_lists: list[list[int]]

    @property
    def size(self) -> int:
        """Number of prompts."""
        return len(self.prompts)

    @property
    def prompt_length(self) -> int:
        """Padded prompt length in tokens."""
        return int(self.input_ids.shape[1])


def make_batch(bundle: ModelBundle, prompts: list[str]) -> Batch:
    """Tokenize ``prompts`` with left padding, the way every scenario sees them, as
    tensors on the model's device (and as plain id lists)."""
    encoded = bundle.tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    lists = [row[kept.bool()].tolist() for row, kept in zip(ids, mask, strict=True)]
    device = next(bundle.model.parameters()).device  # the baselines' tensors go there
    return Batch(list(prompts), ids.to(device), mask.to(device), lists)


def new_tokens(sequences: Any, prompt_length: int) -> list[list[int]]:
    """Generated ids per row of a ``(batch, prompt + new)`` id tensor, read to the
    host in one copy (one per row would sync a GPU once per row: a baseline must
    not pay what a probed run, whose outputs are host lists already, does not)."""
    ids: list[list[int]] = sequences[:, prompt_length:].tolist()
    return ids


class Scenario:
    """One way of generating on a model, optionally capturing activations.

    The harness calls ``setup`` once per process (untimed), then ``generate``
    for each timed repeat, then ``close``. ``captures`` and ``limits`` end up in
    the report: what the scenario captured and what it could not.
    """

    name: ClassVar[str]
    family: ClassVar[str]
    captures: ClassVar[str]
    limits: ClassVar[str] = ""
    #: Scenarios that wrap or hook the model permanently get their own copy so
    #: they cannot slow down or change the others run in the same process.
    own_model: ClassVar[bool] = False

    def unavailable_reason(self) -> str | None:
        """Why this scenario cannot run here (missing package, ...), or None."""
        return None

    def setup(self, bundle: ModelBundle, model: Any, layers: tuple[int, ...]) -> None:
        """Prepare to generate on ``model`` capturing ``layers`` (untimed)."""
        self.bundle = bundle
        self.model = model
        self.layers = layers

    def generate(self, batch: Batch, max_new_tokens: int) -> GenerationRun:
        """Generate greedily (timed by the harness) and return tokens and captures."""
        raise NotImplementedError

    def close(self) -> None:
        """Release whatever ``setup`` installed."""


def hf_generate_kwargs(bundle: ModelBundle, max_new_tokens: int) -> dict[str, Any]:
    """Greedy, fixed-length generation arguments shared by every HF-driven scenario."""
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens,
        "do_sample": False,
        "pad_token_id": bundle.tokenizer.pad_token_id,
    }
