"""What a pip install gets: the files the package reads at run time are in its
wheel. The demo read its spec from the repository's ``specs/`` folder, which no
wheel holds: after ``pip install undercurrent``, ``undercurrent demo`` stopped with
"demo spec '.../specs/demo.yaml' not found"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHECK = """
import sys
from pathlib import Path

import undercurrent
from undercurrent.api import load_spec
from undercurrent.demo import default_spec_path
from undercurrent.models import tiny_model_path
from undercurrent.probes.weights import resolve_probe_path

installed = Path(sys.argv[1]).resolve()
assert Path(undercurrent.__file__).resolve().is_relative_to(installed), undercurrent.__file__
assert (tiny_model_path() / "config.json").is_file()
for steer in (False, True):
    path = default_spec_path(steer)
    assert path.is_relative_to(installed) and path.is_file(), path
    shipped = "undercurrent:models/" + path.name
    spec = load_spec(shipped)
    assert spec == load_spec(str(path)) and len(spec) >= 1
    files = [point.probe_args["path"] for point in spec]
    files += [edit.vector for edit in spec.edits if isinstance(edit.vector, str)]
    for name in files:
        assert resolve_probe_path(name).is_file(), (shipped, name)
print("ok")
"""


def test_an_installed_wheel_holds_the_demo_specs_and_what_they_name(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(REPO / "undercurrent", source / "undercurrent",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "--quiet", "--wheel-dir", str(tmp_path / "wheel")],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    done = subprocess.run([sys.executable, "-P", "-c", CHECK, str(installed)], cwd=tmp_path,
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(installed)})
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-3000:]
