"""``undercurrent.open_activations`` and ``undercurrent.store`` load lazily: importing
them pulls in neither torch nor numpy, pandas or pyarrow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_store_names_import_light():
    code = ("import sys, undercurrent, undercurrent.store\n"
            "assert callable(undercurrent.open_activations)\n"
            "heavy = [m for m in ('torch', 'numpy', 'pandas', 'pyarrow', 'sklearn') "
            "if m in sys.modules]\n"
            "print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], check=True)
    assert done.stdout.strip() == "[]"
