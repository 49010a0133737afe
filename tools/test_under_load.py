"""Run the test suite while the machine is busy: one CPU burner per core.

    .venv/bin/python tools/test_under_load.py [PYTEST_ARGS...]
    make test-under-load [TESTS="tests/router tests/reliability"]

With no arguments it runs what ``make test`` runs (``pytest tests``, then
``pytest --nbval-lax notebooks``); with arguments, ``pytest ARGS`` only. Before the
first command it starts one burner process per CPU this process may use (a tight
arithmetic loop, the load a second CPU-bound job puts on a laptop), and it stops
them after the last, also when a command fails or the run is interrupted. A burner
also stops by itself once this script's process is gone, so none can outlive a
killed run.

The exit status is the first failing command's (0 when all pass). A summary at the
end gives each command's wall time and exit status; ``--record PATH`` appends it to
PATH as one JSON line (for docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Busy arithmetic in short slices; between slices the burner checks that its parent
# (this script) is still there, and exits once it is not.
_BURNER = """
import os, sys
parent = int(sys.argv[1])
value = 1
while os.getppid() == parent:
    for step in range(100_000):
        value = (value * 31 + step) % 1_000_003
"""


def burner_count() -> int:
    """One burner per CPU this process may run on."""
    return len(os.sched_getaffinity(0))


def start_burners(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", _BURNER, str(os.getpid())],
                             stdin=subprocess.DEVNULL) for _ in range(count)]


def stop_burners(burners: list[subprocess.Popen[bytes]]) -> None:
    for burner in burners:
        if burner.poll() is None:
            burner.terminate()
    for burner in burners:
        try:
            burner.wait(timeout=10)
        except subprocess.TimeoutExpired:
            burner.kill()
            burner.wait()


def commands(pytest_args: list[str]) -> list[list[str]]:
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE"]
    if pytest_args:
        return [pytest + pytest_args]
    return [pytest + ["tests"], pytest + ["--nbval-lax", "notebooks"]]


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the test suite with one CPU burner per core.", allow_abbrev=False,
        epilog="Arguments after the options go to pytest (default: the whole suite).")
    parser.add_argument("--record", type=Path, help="append the summary to this JSON-lines file")
    options, pytest_args = parser.parse_known_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # so that the burners are stopped
    count = burner_count()
    results: list[dict[str, object]] = []
    codes: list[int] = []
    burners = start_burners(count)
    started = time.monotonic()
    try:
        alive = sum(burner.poll() is None for burner in burners)
        print(f"[under load] {alive} CPU burner(s) running (pids "
              f"{', '.join(str(b.pid) for b in burners)})", flush=True)
        for command in commands(pytest_args):
            began = time.monotonic()
            code = subprocess.call(command, cwd=REPO)
            codes.append(code)
            results.append({"command": " ".join(command[2:]), "exit": code,
                            "wall_s": round(time.monotonic() - began, 1)})
    finally:
        stop_burners(burners)
        stopped = sum(burner.poll() is not None for burner in burners)
        print(f"[under load] {stopped} of {len(burners)} burner(s) stopped", flush=True)
    status = next((code for code in codes if code != 0), 0)
    summary = {"burners": count, "wall_s": round(time.monotonic() - started, 1),
               "exit": status, "commands": results}
    for result in results:
        print(f"[under load] {result['command']}: exit {result['exit']} "
              f"in {result['wall_s']} s", flush=True)
    print(f"[under load] {count} burner(s), {summary['wall_s']} s in all, exit {status}",
          flush=True)
    if options.record is not None:
        with options.record.open("a") as out:
            out.write(json.dumps(summary) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
