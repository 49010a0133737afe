"""Probes that change the tensors they are handed in place, and one that keeps a
copy of each: the HF and vLLM tests that each point's tensors are its own."""

from __future__ import annotations

from typing import Any

from undercurrent.probes import Probe
from undercurrent.spec import ProbeKind


class CenterInPlace(Probe):
    """A plausible user probe: centres each activation in place (then judges it)."""

    probe_kind = ProbeKind.TRAJECTORY

    def on_start(self, ctx: Any) -> None:
        pass

    def on_activation(self, record: Any) -> None:
        record.tensor.sub_(record.tensor.mean())

    def on_end(self, ctx: Any) -> None:
        return None


class AddOne(CenterInPlace):
    def on_activation(self, record: Any) -> None:
        record.tensor.add_(1.0)


class Received(Probe):
    """Keeps a copy of every tensor it is handed, by (token, layer): its verdict."""

    probe_kind = ProbeKind.TRAJECTORY

    def on_start(self, ctx: Any) -> None:
        self.seen: dict[tuple[int, int], Any] = {}

    def on_activation(self, record: Any) -> None:
        self.seen[(record.token_index, record.layer)] = record.tensor.clone()

    def on_end(self, ctx: Any) -> dict[tuple[int, int], Any]:
        return self.seen


PROBES = {"center": CenterInPlace, "add_one": AddOne, "received": Received}
"""The probe types the tests' points name."""
