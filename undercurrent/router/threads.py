"""Which threads run probes for the router: its async workers and the helper
threads of blocking inline probes.

A backend asks (:func:`on_probe_thread`) before it lets ``close()`` wait for its
generation: a probe on such a thread calling ``close()`` while the model
generates would wait for a generation that waits for it (the drain at the end of
a request, or an inline probe's timeout).
"""

from __future__ import annotations

import threading

_LOCAL = threading.local()


def mark_probe_thread() -> None:
    """Mark the calling thread as one that runs probes (for its lifetime)."""
    _LOCAL.probe = True


def on_probe_thread() -> bool:
    """True on a thread the router runs probes on, other than a generation's own."""
    return getattr(_LOCAL, "probe", False)
