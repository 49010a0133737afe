"""A steady heap for timing runs: glibc's malloc keeps the memory it frees.

By default glibc serves a large block with fresh ``mmap`` pages (above a
threshold it moves at run time) and gives the top of its heap back to the
system once enough of it is free. A generation's KV cache grows by one
``torch.cat`` per layer and step, so plain ``generate()`` on the bundled model
at batch 64 takes 2,000 to 7,000 page faults per generation, 4 to 16 ms of
system time on a generation of about 85 ms. How many it takes depends on the
state the allocator was left in, not on the scenario: that noise is larger
than the probing cost being measured.

:func:`steady_allocator` asks glibc (``mallopt``) to serve every block from its
heap and to keep what is freed, so after a warm-up a generation takes almost
no page fault, and each scenario is timed on its own work. Timing jobs call it
(``python -m benchmarks.run``, ``quick_scaling``, ``stage_timers``; each has
``--default-allocator`` to leave glibc's defaults); the peak-RSS jobs do not,
since a heap that keeps its memory reads higher there.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

#: ``mallopt`` parameters (glibc's ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

#: What is asked: no block from ``mmap``, a heap given back only above 1 GiB
#: free, and the heap grown 64 MiB at a time.
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))

#: The same for processes started afresh (spawned vLLM engines, a forkserver):
#: glibc reads these when a process starts.
ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
               "MALLOC_TOP_PAD_": str(64 << 20)}

DEFAULT = "glibc defaults"
STEADY = "steady heap (glibc mallopt: no mmap blocks, trim above 1 GiB, 64 MiB top pad)"


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


def allocator_label(steady: bool) -> str:
    """What timing jobs asked to run with, for a run's report."""
    if not steady:
        return DEFAULT
    return STEADY if _mallopt() is not None else f"{DEFAULT} (the C library is not glibc)"


def steady_allocator() -> bool:
    """Keep this process's freed heap memory, and its children's, where the C
    library is glibc: whether glibc took every setting."""
    mallopt = _mallopt()
    if mallopt is None or not all([mallopt(parameter, value) == 1
                                   for parameter, value in SETTINGS]):
        return False
    os.environ.update(ENVIRONMENT)
    return True
