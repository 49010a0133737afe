"""The timing jobs' steady heap (``benchmarks.allocator``): with it, glibc serves
a large block from its heap and keeps it once freed; without it, from fresh
``mmap`` pages. Each case runs in a fresh interpreter, where glibc's defaults
hold until it is called."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Allocates and frees 64 MiB with glibc's malloc and prints, as JSON, the
#: bytes in mmapped blocks it added and the heap's size once it is freed
#: (``mallinfo2``, glibc 2.33 and later).
PROBE = """
import ctypes, json, os, sys
from benchmarks.allocator import ENVIRONMENT, steady_allocator

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
took = steady_allocator() if sys.argv[1] == "steady" else None
before = libc.mallinfo2().hblkhd
block = libc.malloc(64 << 20)
mmapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(json.dumps({"took": took, "mmapped": mmapped, "heap_after_free": libc.mallinfo2().arena,
                  "environment": {key: os.environ.get(key) for key in ENVIRONMENT}}))
"""


def _allocate(mode: str) -> dict:
    from benchmarks.allocator import ENVIRONMENT

    # (glibc's defaults: none of the settings a steady heap hands its children)
    env = {key: value for key, value in os.environ.items() if key not in ENVIRONMENT}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_a_steady_heap_serves_a_large_block_from_the_heap_and_keeps_it():
    from benchmarks.allocator import ENVIRONMENT

    default = _allocate("default")
    assert default["mmapped"] >= 64 << 20  # glibc's default: fresh pages for the block
    steady = _allocate("steady")
    assert steady["took"] is True
    assert steady["mmapped"] == 0
    assert steady["heap_after_free"] >= 64 << 20  # freed, not handed back
    assert steady["environment"] == ENVIRONMENT  # spawned children start the same way
