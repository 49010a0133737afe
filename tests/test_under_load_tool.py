"""``tools/test_under_load.py`` (``make test-under-load``): the burners run while the
commands run and are stopped afterwards, also when a command fails; a burner
whose script is gone stops by itself; the exit status is the first failing
command's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

TOOL = Path(__file__).resolve().parents[1] / "tools" / "test_under_load.py"


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("undercurrent_test_under_load", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers; it is gone once its parent has reaped it.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" in status.read_text()


def test_the_burners_run_during_each_command_and_stop_after_a_failure(tmp_path,
                                                                      monkeypatch) -> None:
    tool = _tool()
    started: list[subprocess.Popen[bytes]] = []
    start_burners = tool.start_burners

    def keep(count: int) -> list[subprocess.Popen[bytes]]:
        started.extend(start_burners(count))
        return started

    ran: list[tuple[list[str], bool]] = []

    def fake_call(command: list[str], **kwargs: Any) -> int:
        ran.append((command, all(burner.poll() is None for burner in started)))
        return 0 if len(ran) == 1 else 3

    monkeypatch.setattr(tool, "start_burners", keep)
    monkeypatch.setattr(tool.subprocess, "call", fake_call)
    record = tmp_path / "runs.jsonl"
    assert tool.main(["--record", str(record)]) == 3
    # The whole suite: what `make test` runs, each command with every burner running.
    assert [command[-1] for command, _ in ran] == ["tests", "notebooks"]
    assert all(busy for _, busy in ran)
    assert len(started) == tool.burner_count() >= 1
    assert all(burner.poll() is not None for burner in started)  # stopped
    summary = json.loads(record.read_text())
    assert summary["exit"] == 3 and [c["exit"] for c in summary["commands"]] == [0, 3]


def test_arguments_select_what_pytest_runs_and_its_exit_status_comes_back(monkeypatch) -> None:
    tool = _tool()
    ran: list[list[str]] = []

    def fake_call(command: list[str], **kwargs: Any) -> int:
        ran.append(command)
        return 5

    monkeypatch.setattr(tool.subprocess, "call", fake_call)
    assert tool.main(["tests/router", "-k", "block"]) == 5
    assert ran == [[sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE",
                    "tests/router", "-k", "block"]]


def test_a_burner_stops_by_itself_once_its_script_is_gone() -> None:
    starter = (f"import importlib.util, sys\n"
               f"spec = importlib.util.spec_from_file_location('tool', {str(TOOL)!r})\n"
               f"tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool)\n"
               f"print(tool.start_burners(1)[0].pid)\n")
    completed = subprocess.run([sys.executable, "-c", starter], capture_output=True,
                               text=True, timeout=120, check=True)
    pid = int(completed.stdout.strip())
    pause = threading.Event()
    for _ in range(60_000):  # up to a minute: a guard against a hang, not a speed bound
        if _gone(pid):
            break
        pause.wait(0.001)
    assert _gone(pid), f"burner {pid} outlived its script"
