"""Memory stays flat while capturing: peak RSS grows by less than 10% of the
bytes written on a run writing at least 500 MB (its own process, so nothing else
of the test session counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("pyarrow")


@pytest.mark.slow
def test_peak_rss_growth_is_under_a_tenth_of_the_bytes_written():
    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("memory_child.py")),
                           "240"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    growth = report["peak_after"] - report["peak_before"]
    assert report["bytes"] >= 500 * 10**6, report
    assert growth < 0.10 * report["bytes"], report
