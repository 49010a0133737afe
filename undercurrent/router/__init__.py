"""The router: inline and async dispatch of activation records to probes.

See ``docs/router.md``. Nothing here imports torch; records may carry numpy
arrays or torch tensors.
"""

from __future__ import annotations

from undercurrent.probes.base import RequestContext
from undercurrent.router.errors import OverflowPolicy, RouterError
from undercurrent.router.protocol import SessionRouter
from undercurrent.router.router import RequestHandle, Router

__all__ = ["OverflowPolicy", "RequestContext", "RequestHandle", "Router", "RouterError",
           "SessionRouter"]
