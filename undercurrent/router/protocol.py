"""What a capture session needs of a router, as a :class:`typing.Protocol`.

:class:`~undercurrent.router.Router` satisfies it; so may a test double. The
adapters (:class:`~undercurrent.adapters.session.CaptureSession` and the
delivery of a forward's activations) type their router with it instead of
``Any``. A router may also offer ``step()``, a context manager around one
forward's routing (:meth:`~undercurrent.router.Router.step`); the session uses
it when present, so it is not part of the protocol. Likewise
``register_requests`` and ``end_requests`` (several requests in one call): a
session uses them when present and otherwise registers or ends each request in
turn. And ``may_abort(request_ids)``: without it, a session takes any request
to be one a probe may stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from undercurrent.probes.base import RequestContext
from undercurrent.records import ActivationBatch, BatchSignals, ProbeResult
from undercurrent.spec.types import ExtractionPoint


class SessionRouter(Protocol):
    """The router as a capture session sees it: register a request's points,
    route a forward's rows in columns, end the request for its results."""

    def register_request(self, request_id: str, points: Iterable[ExtractionPoint],
                         ctx: RequestContext | None = None) -> None:
        """Bind the request's points to fresh probes (see
        :meth:`~undercurrent.router.Router.register_request`)."""

    def route_columns(self, batch: ActivationBatch,
                      spans: Sequence[tuple[str, int, int]] | None = None) -> BatchSignals:
        """Route one extraction point's rows; one signal row per batch row (see
        :meth:`~undercurrent.router.Router.route_columns`)."""

    def end_request(self, request_id: str) -> Mapping[str, ProbeResult]:
        """End the request: its probe results by point name (see
        :meth:`~undercurrent.router.Router.end_request`)."""
