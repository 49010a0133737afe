"""Which threads run probes for a router: its async workers and the helper
threads of its blocking inline probes.

A backend asks (:func:`on_probe_thread`) before it lets ``close()`` wait for its
generation: a probe on a thread of the router that generation uses, calling
``close()`` while the model generates, would wait for a generation that waits
for it (the drain at the end of a request, or an inline probe's timeout). A
probe of another router (another model's) is not waited for by that generation:
its ``close()`` waits as from any other thread.
"""

from __future__ import annotations

import threading
import weakref

_LOCAL = threading.local()


def mark_probe_thread(router: object | None) -> None:
    """Mark the calling thread as one that runs ``router``'s probes (for its
    lifetime; held weakly, so an idle worker keeps no router alive)."""
    _LOCAL.router = None if router is None else weakref.ref(router)


def on_probe_thread(router: object | None) -> bool:
    """True on a thread that runs ``router``'s probes, other than a generation's own."""
    mark = getattr(_LOCAL, "router", None)
    return router is not None and mark is not None and mark() is router
