"""Whether a vLLM engine's processes are alive, and waking the driver when one dies.

vLLM notices a dead process, but a driver waiting for it is not always told:

- Engine core in its own process (``multiprocess=True``): when that process dies
  (killed, out of memory), vLLM's client shuts its output thread down without a word
  on the queue ``engine.step()`` reads, so a driver waiting there waits for good, and
  so does one waiting for the answer of a ``collective_rpc``. :func:`watch_engine_core`
  waits on the process's sentinel and, unless ``close()`` is shutting it down, hands
  both an error.
- Tensor parallelism in this process: a worker process that dies fails vLLM's
  executor; the running step ends with ``RuntimeError('cancelled')`` and every later
  call with an ``AssertionError`` from deep inside vLLM. :func:`engine_death` says
  what died, so the backend can say it instead.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from multiprocessing import connection
from typing import Any


def _ending(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _ended(processes: Iterable[Any]) -> list[str]:
    """``"NAME (pid N) killed by SIGKILL"`` for each of ``processes`` that ended."""
    return [f"{process.name} (pid {process.pid}) {_ending(process.exitcode)}"
            for process in processes if process.exitcode is not None]


def core_processes(engine: Any) -> list[Any]:
    """The engine core process(es) of an engine run with ``multiprocess=True``."""
    manager = getattr(getattr(engine.engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or ())


def engine_death(engine: Any, multiprocess: bool) -> str | None:
    """What of ``engine`` died, in words (``"its engine core process EngineCore
    (pid 12) killed by SIGKILL"``), or None while it is alive (as far as vLLM knows:
    see :func:`watch_engine_core`)."""
    core = engine.engine_core
    if multiprocess:
        ended = _ended(core_processes(engine))
        if ended:
            return "its engine core process " + ", ".join(ended)
        if getattr(getattr(core, "resources", None), "engine_dead", False):
            return "its engine core reported a fatal error (logged above)"
        return None
    executor = getattr(getattr(core, "engine_core", None), "model_executor", None)
    if not getattr(executor, "is_failed", False):
        return None
    ended = _ended(handle.proc for handle in getattr(executor, "workers", None) or ()
                   if getattr(handle, "proc", None) is not None)
    if ended:
        return "its worker processes ended: " + ", ".join(ended)
    return "a worker process of its executor died"


def watch_engine_core(engine: Any, on_death: Callable[[], None]) -> None:
    """Call ``on_death`` on a daemon thread once an engine core process of ``engine``
    has ended (for any reason: ``on_death`` tells a crash from a close)."""
    processes = core_processes(engine)
    if not processes:
        return

    def watch() -> None:
        try:
            ended = connection.wait([process.sentinel for process in processes])
        except (OSError, ValueError):  # (a sentinel closed under us: nothing to tell)
            return
        for process in processes:
            if process.sentinel in ended:
                # (its sentinel fires as it dies, a moment before its exit code is
                # known: reaped here, the code can name how it ended)
                process.join(timeout=10)
        on_death()

    threading.Thread(target=watch, name="undercurrent-vllm-core-watch", daemon=True).start()
