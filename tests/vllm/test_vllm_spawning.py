"""Where a script loads an engine that spawns processes: inside its main guard or
not (vLLM's CPU build imports the script again in each spawned process)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = '''\
from undercurrent.adapters.vllm.spawning import unguarded_main_line

def load():
    return unguarded_main_line()

print("top", load())
try:
    if __name__ == "__main__":
        print("guarded", load())
except ValueError:
    pass
if "__main__" == __name__:
    def main():
        print("in main", load())
    main()
with open(__file__):
    print("with", load())
import sys
if __name__ == "__main__" and "--dry-run" not in sys.argv:
    print("and", load())
if __name__ != "__main__":
    pass
else:
    print("else", load())
import multiprocessing
if multiprocessing.current_process().name == "MainProcess":
    print("process", load())
'''


def test_only_a_load_outside_every_main_guard_is_unguarded(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                               timeout=120, check=True)
    assert completed.stdout.splitlines() == [
        f"top ({str(script)!r}, 6)", "guarded None", "in main None",
        f"with ({str(script)!r}, 17)",
        # (guards that keep a spawned process out too: they were refused)
        "and None", "else None", "process None"]


def test_code_not_run_as_a_script_is_never_unguarded():
    completed = subprocess.run(
        [sys.executable, "-c", "from undercurrent.adapters.vllm.spawning import "
                               "unguarded_main_line; print(unguarded_main_line())"],
        capture_output=True, text=True, timeout=120, check=True)
    assert completed.stdout.strip() == "None"
