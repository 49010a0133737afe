"""``pm.close()`` called from another thread, as a notebook's second cell or a
signal handler would: the HF and vLLM stream-close tests."""

from __future__ import annotations

import threading
from typing import Any


def close_in_thread(pm: Any) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``pm.close()`` on a thread of its own; the thread, and the list that
    gets what close() raised (read it after joining the thread)."""
    errors: list[BaseException] = []

    def close() -> None:
        try:
            pm.close()
        except BaseException as error:  # noqa: BLE001 - the test reads it
            errors.append(error)

    closer = threading.Thread(target=close)
    closer.start()
    return closer, errors
