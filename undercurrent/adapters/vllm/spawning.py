"""Whether an engine that starts processes can start them from the calling script.

vLLM's CPU build starts its processes (the engine core of ``multiprocess=True``,
the tensor-parallel workers) with ``spawn``, which imports the main script again
in each new process. A script that loads the model outside an ``if __name__ ==
"__main__":`` block loads it again there, and that load's own process start fails
("An attempt has been made to start a new process before the current process has
finished its bootstrapping phase"); the engine then reports only "Engine core
initialization failed". :func:`check_spawnable` says so before anything starts.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from types import FrameType

from undercurrent.adapters.base import BackendError


def _is_main_guard(node: ast.If) -> bool:
    """Whether the test of ``node`` reads ``__name__`` (``if __name__ ==
    "__main__":``, combined with other conditions, or negated with the code in its
    ``else``) or the process's name (``current_process().name ==
    "MainProcess"``): either keeps a spawned process from running the block, so
    its whole span (body and ``else``) counts as guarded. Lenient on purpose: a
    guard this misses would refuse a script that runs."""
    for found in ast.walk(node.test):
        if isinstance(found, ast.Name) and found.id == "__name__":
            return True
        if isinstance(found, ast.Constant) and found.value in ("__main__", "MainProcess"):
            return True
    return False


def _main_script_frame(frame: FrameType | None) -> FrameType | None:
    """The frame running the main script's own top-level code, if this call came from
    it (not from a notebook, ``python -c`` or an interactive prompt: no file to import
    again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            same = os.path.realpath(frame.f_code.co_filename) == os.path.realpath(path)
            return frame if same else None
        frame = frame.f_back
    return None


def unguarded_main_line() -> tuple[str, int] | None:
    """``(script, line)`` of the main script's top-level statement this call runs in
    when that statement is outside every ``if __name__ == "__main__":`` block; None
    when it is inside one, or when the call does not come from a script's top level."""
    frame = _main_script_frame(sys._getframe(1))
    if frame is None:
        return None
    script = frame.f_code.co_filename
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and _is_main_guard(node)
                and node.lineno <= line <= (node.end_lineno or node.lineno)):
            return None
    return script, line


def check_spawnable(what: str) -> None:
    """Refuse to start an engine whose processes (``what``: "multiprocess=True") are
    spawned when the call comes from a script's unguarded top-level code."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
        return  # (forked processes do not import the script again)
    unguarded = unguarded_main_line()
    if unguarded is None:
        return
    script, line = unguarded
    raise BackendError(
        f"{script}, line {line}, loads a vLLM engine with {what} outside an "
        "`if __name__ == \"__main__\":` block: vLLM's CPU build starts the engine's "
        "processes with spawn, which imports the script again in each of them, where "
        "this line would load the model again and fail ('An attempt has been made to "
        "start a new process before the current process has finished its bootstrapping "
        "phase'). Put the script's main code under `if __name__ == \"__main__\":`")
