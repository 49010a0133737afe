"""Measurement helpers: memory from /proc, a first-token clock, and summary statistics.

Nothing here imports torch at module level, so the orchestrating process stays
light; the clock touches the model only through ``register_forward_hook``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class GenerationRun:
    """What one scenario's generation returns to the harness.

    ``token_ids`` holds the generated ids per prompt (prompt excluded), used to
    check that every scenario generated exactly the baseline's tokens;
    ``records`` counts captured activation vectors (one per token and layer);
    ``captured_bytes`` is the size of the captured tensors the scenario holds.
    """

    token_ids: list[list[int]]
    records: int = 0
    captured_bytes: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


def _status_kib(key: str, pid: int | str = "self") -> int:
    path = Path(f"/proc/{pid}/status")
    for line in path.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} missing from {path}; memory figures need Linux /proc")


def _tree() -> list[int | str]:
    """This process and its live descendants (vLLM runs its model in a worker process)."""
    try:
        import psutil
    except ImportError:
        return ["self"]
    return ["self", *(child.pid for child in psutil.Process().children(recursive=True))]


def _sum_over_tree(key: str) -> int:
    total = 0
    for pid in _tree():
        try:
            total += _status_kib(key, pid)
        except (OSError, RuntimeError):  # a child that exited or is a zombie
            continue
    return total * 1024


def current_rss_bytes() -> int:
    """Resident set size now, summed over this process and its descendants."""
    return _sum_over_tree("VmRSS")


def peak_rss_bytes() -> int:
    """RSS high-water marks (since the last reset), summed over this process and its
    descendants: an upper bound on their peak together, exact for one process."""
    return _sum_over_tree("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the RSS high-water marks (Linux >= 4.0); False where the kernel refuses."""
    try:
        for pid in _tree():
            Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class FirstForwardClock:
    """Times the first forward of the model's output head after ``start()``.

    Every scenario's timing goes through the same one-hook clock on the output
    embedding (``lm_head``), so time to first token means the same thing for
    the baseline and for every capture method: generate called -> logits of the
    first new token computed.
    """

    def __init__(self, model: Any) -> None:
        head = model.get_output_embeddings()
        self._handle = head.register_forward_hook(self._on_forward)
        self._start: float | None = None
        self._first: float | None = None

    def _on_forward(self, module: Any, args: Any, output: Any) -> None:
        if self._first is None and self._start is not None:
            self._first = time.perf_counter()

    def start(self) -> float:
        """Arm the clock; returns the start time (``time.perf_counter``)."""
        self._first = None
        self._start = time.perf_counter()
        return self._start

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from ``start()`` to the end of the first head forward, if any."""
        if self._start is None or self._first is None:
            return None
        return self._first - self._start

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()


#: The confidence :func:`median_interval` aims for.
INTERVAL_LEVEL = 0.95


def median_interval(values: Sequence[float], level: float = INTERVAL_LEVEL
                    ) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of ``values``:
    (low, high, coverage). The bounds are the ``j``-th smallest and ``j``-th
    largest value, with the largest ``j`` whose coverage (the probability that
    the true median lies between them, ``1 - 2 P(B < j)`` for ``B`` binomial
    with ``n`` trials of 1/2) is at least ``level``. Too few values to reach
    ``level`` give the min and the max with the coverage they have (93.75% for
    5 values). It assumes only that the repeats are independent draws of one
    distribution; None without values."""
    ordered = sorted(v for v in values if v is not None)
    count = len(ordered)
    if not count:
        return None
    below = 0.0  # P(B < j), for the j tried
    chosen, coverage = 1, 1.0 - 2.0 * 0.5 ** count
    for j in range(1, (count + 1) // 2 + 1):
        below += math.comb(count, j - 1) / 2 ** count
        kept = 1.0 - 2.0 * below
        if kept < level:
            break
        chosen, coverage = j, kept
    return ordered[chosen - 1], ordered[count - chosen], coverage


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """Median, min, max and relative spread ((max - min) / median) of repeats, and
    the median's confidence interval (:func:`median_interval`: ``ci_low``,
    ``ci_high``, ``ci_level``)."""
    clean = [v for v in values if v is not None]
    if not clean:
        return {"median": None, "min": None, "max": None, "spread_pct": None,
                "ci_low": None, "ci_high": None, "ci_level": None}
    median = statistics.median(clean)
    low, high = min(clean), max(clean)
    relative = (high - low) / median * 100 if median else None
    ci_low, ci_high, level = median_interval(clean) or (None, None, None)
    return {"median": median, "min": low, "max": high, "spread_pct": relative,
            "ci_low": ci_low, "ci_high": ci_high, "ci_level": level}


def per_vector(amount: float, vectors: int, number_format: str) -> str:
    """``amount / vectors`` written with ``number_format`` (``format``'s spec),
    or "—" where no vector was captured: a scenario that captures nothing
    (``uc_empty_spec``, the machinery alone) has no cost per vector."""
    return "—" if not vectors else format(amount / vectors, number_format)


def tensor_bytes(tensors: Sequence[Any]) -> int:
    """Total bytes of a sequence of torch tensors."""
    return sum(t.numel() * t.element_size() for t in tensors)
