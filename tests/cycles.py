"""What the garbage collector would find: the tests that check a generation
leaves nothing of undercurrent's in a reference cycle share it."""

from __future__ import annotations

import gc


def undercurrent_types_in_cycles() -> list[str]:
    """Collect now and return the names of undercurrent's types among the objects
    only the collector could free (the collector's debug settings and its
    ``garbage`` list are restored)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({type(item).__qualname__ for item in gc.garbage
                       if type(item).__module__.startswith("undercurrent")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
