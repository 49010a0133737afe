"""The README's first example runs as written, on the bundled model."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_quick_example_runs_and_the_guard_aborts(monkeypatch):
    readme = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[:1]
    monkeypatch.chdir(ROOT)  # the example names specs/demo.yaml relative to the checkout
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("True AbortInfo(extraction_point_name='harm_guard'")
    assert "'flagged': True" in lines[2]
