"""``undercurrent validate`` checks each point's probe against the probe registry
(built-ins, entry points, ``--probes`` modules): probe_type, probe_kind and the
probe_args names. ``undercurrent run`` reports a user error in one line, never
with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from undercurrent.cli import main

POINT = """\
version: "1"
extraction_points:
  - name: guard
    layers: [1]
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: {probe_type}
    probe_kind: {probe_kind}
    probe_args: {probe_args}
"""

CUSTOM_PROBES = '''\
from undercurrent.probes import Probe, register_probe


@register_probe("custom_probe")
class CustomProbe(Probe):
    def __init__(self, *, scale):
        self.scale = scale

    def on_activation(self, record):
        return None
'''


def _spec(tmp_path: Path, name: str = "spec.yaml", *, probe_type: str = "norm_probe",
          probe_kind: str = "single_shot", probe_args: str = "{}") -> Path:
    path = tmp_path / name
    path.write_text(POINT.format(probe_type=probe_type, probe_kind=probe_kind,
                                 probe_args=probe_args), encoding="utf-8")
    return path


def _validate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["validate", *argv])
    out = capsys.readouterr().out.strip()
    assert "\n" not in out  # one line per file
    return code, out


def test_validate_refuses_a_misspelt_probe_type_with_the_closest_name(tmp_path, capsys):
    path = _spec(tmp_path, probe_type="nrom_probe")
    code, line = _validate(capsys, str(path))
    assert code == 1
    assert line.startswith(f"{path}: INVALID (1 problem): extraction_points[0] (name 'guard'), "
                           "field 'probe_type': unknown probe_type 'nrom_probe'; did you mean "
                           "'norm_probe'?")


def test_validate_checks_probe_args_against_the_probe_constructor(tmp_path, capsys):
    path = _spec(tmp_path, probe_args="{treshold: 2.0}")
    code, line = _validate(capsys, str(path))
    assert code == 1
    assert ("field 'probe_args': probe_args for probe_type 'norm_probe': unknown probe_arg "
            "'treshold' (did you mean 'threshold'?); NormProbe takes action, threshold") in line
    code, line = _validate(capsys, str(_spec(tmp_path, probe_args="{threshold: 2.0}")))
    assert (code, line.endswith("OK (1 extraction point)")) == (0, True)


def test_validate_checks_the_probe_kind_the_probe_class_serves(tmp_path, capsys):
    path = _spec(tmp_path, probe_type="dual_position_probe", probe_kind="trajectory",
                 probe_args="{path: probe.safetensors}")
    code, line = _validate(capsys, str(path))
    assert code == 1 and "field 'probe_kind': probe_kind trajectory does not match" in line


def test_validate_json_reports_probe_problems_with_their_point_and_field(tmp_path, capsys):
    import json

    path = _spec(tmp_path, probe_type="nrom_probe")
    assert main(["validate", "--format", "json", str(path)]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    (problem,) = report["problems"]
    assert (problem["point_index"], problem["point_name"], problem["field"]) == (
        0, "guard", "probe_type")


def test_validate_reports_probe_problems_with_the_spec_s_own_in_one_pass(tmp_path, capsys):
    # A spec with its own problems still has its points' probes checked, where
    # their fields allow: every problem at once, each point's together.
    path = tmp_path / "spec.yaml"
    path.write_text(
        POINT.format(probe_type="linear_prob", probe_kind="single_shot",
                     probe_args="{path: p.safetensors}").replace("layers: [1]", "layers: [-1]")
        + POINT.format(probe_type="norm_probe", probe_kind="trajectory",
                       probe_args="{treshold: 1}").split("extraction_points:\n")[1]
        .replace("guard", "other").replace("residual_stream", "resid"),
        encoding="utf-8")
    code, line = _validate(capsys, str(path))
    assert code == 1 and line.startswith(f"{path}: INVALID (4 problems): ")
    located = [part.split(": ")[0] for part in line.split("INVALID (4 problems): ")[1]
               .split("; extraction_points")]
    assert located == [
        "extraction_points[0] (name 'guard'), field 'layers'",
        "[0] (name 'guard'), field 'probe_type'",
        "[1] (name 'other'), field 'tensor_type'",
        "[1] (name 'other'), field 'probe_args'",
    ]
    assert "did you mean 'linear_probe'?" in line and "did you mean 'threshold'?" in line


def _cli(cwd: Path, *argv: str, script: bool = False) -> subprocess.CompletedProcess[str]:
    # A process of its own: --probes registers probe types process-wide. ``script``:
    # started as the `undercurrent` command is, without the current directory on
    # sys.path (python -P -m), as `python -m` puts it first for every import.
    python = [sys.executable, "-P"] if script else [sys.executable]
    return subprocess.run([*python, "-m", "undercurrent", *argv], cwd=cwd,
                          capture_output=True, text=True, check=False, env=dict(os.environ))


def test_validate_knows_the_probe_types_of_probes_modules(tmp_path):
    (tmp_path / "my_probes.py").write_text(CUSTOM_PROBES, encoding="utf-8")
    good = _spec(tmp_path, "good.yaml", probe_type="custom_probe", probe_args="{scale: 2}")
    missing = _spec(tmp_path, "missing.yaml", probe_type="custom_probe")
    without = _cli(tmp_path, "validate", str(good))
    assert without.returncode == 1 and "unknown probe_type 'custom_probe'" in without.stdout
    for module in ("my_probes", str(tmp_path / "my_probes.py")):
        done = _cli(tmp_path, "validate", "--probes", module, str(good), str(missing))
        assert done.returncode == 1, done.stderr
        ok, bad = done.stdout.splitlines()
        assert ok == f"{good}: OK (1 extraction point)"
        assert bad.startswith(f"{missing}: INVALID") and "missing required probe_arg 'scale'" \
            in bad


def test_a_probes_module_that_cannot_be_imported_is_a_usage_error(tmp_path):
    done = _cli(tmp_path, "validate", "--probes", "no_such_module_here", str(_spec(tmp_path)))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("validate: cannot import --probes 'no_such_module_here': "
                                   "ModuleNotFoundError: No module named 'no_such_module_here'")


def test_a_probes_path_that_is_no_module_is_a_usage_error_saying_what_is_taken(tmp_path):
    # probes.txt was imported as the dotted name "probes.txt" ("No module named
    # 'probes'"); an empty folder was imported as a namespace package, and validate
    # said OK having loaded nothing
    spec = _spec(tmp_path, "good.yaml", probe_type="custom_probe", probe_args="{scale: 2}")
    (tmp_path / "probes.txt").write_text(CUSTOM_PROBES, encoding="utf-8")
    (tmp_path / "empty_folder").mkdir()
    package = tmp_path / "probe_package"
    package.mkdir()
    (package / "__init__.py").write_text(CUSTOM_PROBES, encoding="utf-8")
    for module, problem in [
            ("probes.txt", "is a file but not a .py file; a --probes file must end in .py "
                           "(or give a module name)"),
            ("empty_folder", "is a folder without __init__.py (a namespace package: nothing "
                             "in it is imported, so no probe type is registered); name a "
                             "module, a package or a .py file"),
            ("", "is empty; give a module name or a .py file")]:
        done = _cli(tmp_path, "validate", "--probes", module, str(spec))
        assert done.returncode == 2 and done.stdout == "", done
        assert done.stderr.strip() == f"validate: --probes {module!r} {problem}"
    # (a package, with its __init__.py, is a module name like any other)
    done = _cli(tmp_path, "validate", "--probes", "probe_package", str(spec))
    assert done.returncode == 0 and done.stdout == f"{spec}: OK (1 extraction point)\n", done


def test_a_probes_module_that_exits_when_imported_is_a_usage_error(tmp_path):
    # (a script's sys.exit(0) would end validate with exit 0 and no word on the spec)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n", encoding="utf-8")
    done = _cli(tmp_path, "validate", "--probes", "exits.py", str(_spec(tmp_path)))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "validate: cannot import --probes 'exits.py': SystemExit: 0"


@pytest.mark.parametrize("folder", ["pdir/", ""])
@pytest.mark.parametrize("stem", ["signal", "queue"])
def test_a_probes_file_named_like_a_standard_module_leaves_that_module_alone(tmp_path, stem,
                                                                            folder):
    # It was stored as sys.modules[stem]: run then died in torch or multiprocessing.
    # In the current directory, which --probes put first on sys.path for good, torch's
    # own `import signal` found the file ("module 'signal' has no attribute 'SIGINT'",
    # or the file ran again: "probe type 'custom_probe' is already registered").
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (tmp_path / "pdir").mkdir()
    (tmp_path / folder / f"{stem}.py").write_text(CUSTOM_PROBES, encoding="utf-8")
    spec = _spec(tmp_path, probe_type="custom_probe", probe_args="{scale: 2}")
    done = _cli(tmp_path, "run", str(spec), "--probes", f"{folder}{stem}.py", "--model", "tiny",
                "--prompt", "the cat", "--max-new-tokens", "2", "--format", "json", script=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert '"guard"' in done.stdout


@pytest.mark.parametrize("stem", ["signal", "queue"])
def test_a_file_named_like_a_standard_module_beside_a_probes_module_is_not_imported(
        tmp_path, stem):
    # --probes base_probes (a module name) put the current directory first on
    # sys.path for the rest of the run: torch's `import signal` / `import queue`
    # then found the unrelated file there.
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (tmp_path / f"{stem}.py").write_text("raise RuntimeError('not the standard module')\n",
                                         encoding="utf-8")
    (tmp_path / "base_probes.py").write_text(CUSTOM_PROBES, encoding="utf-8")
    spec = _spec(tmp_path, probe_type="custom_probe", probe_args="{scale: 2}")
    done = _cli(tmp_path, "run", str(spec), "--probes", "base_probes", "--model", "tiny",
                "--prompt", "the cat", "--max-new-tokens", "2", "--format", "json", script=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert '"guard"' in done.stdout


EXTRA_PROBES = '''\
from undercurrent.probes import register_probe
from base_probes import CustomProbe


@register_probe("custom_probe2")
class CustomProbe2(CustomProbe):
    pass
'''


@pytest.mark.parametrize("folder", ["", "pdir/"])
def test_a_probes_file_can_import_an_earlier_one_by_its_name(tmp_path, folder):
    # The first file was loaded under a private name only: the second's import ran it
    # again from the cwd ("probe type 'custom_probe' is already registered"), or found
    # nothing where the files sit in a folder not on sys.path (ModuleNotFoundError).
    (tmp_path / "pdir").mkdir()
    (tmp_path / folder / "base_probes.py").write_text(CUSTOM_PROBES, encoding="utf-8")
    (tmp_path / folder / "extra_probes.py").write_text(EXTRA_PROBES, encoding="utf-8")
    spec = _spec(tmp_path, probe_type="custom_probe2", probe_args="{scale: 2}")
    done = _cli(tmp_path, "validate", str(spec), "--probes", f"{folder}base_probes.py",
                "--probes", f"{folder}extra_probes.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{spec}: OK (1 extraction point)"


# -- run --------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "expected"), [
    ({"probe_type": "nrom_probe"}, "unknown probe_type 'nrom_probe'; did you mean 'norm_probe'?"),
    ({"probe_type": "linear_probe",
      "probe_args": "{path: 'undercurrent:models/tiny/probe.safetensors', action: abort}"},
     "was fitted on layer 3, but extraction point 'guard' captures layers [1]; fix the spec or "
     "pass check_metadata: false"),
])
def test_run_reports_a_probe_error_in_one_line_without_a_traceback(tmp_path, capsys, fields,
                                                                   expected):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = _spec(tmp_path, **fields)
    code = main(["run", str(path), "--model", "tiny", "--prompt", "the cat",
                 "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    last = captured.err.strip().splitlines()[-1]  # after the loader's progress bar
    assert last.startswith("run: ") and expected in last
    assert "Traceback" not in captured.err


def test_run_reports_a_bad_generation_option_in_one_line_without_a_traceback(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code = main(["run", str(_spec(tmp_path)), "--model", "tiny", "--prompt", "the cat",
                 "--max-new-tokens", "0"])
    captured = capsys.readouterr()
    # A bad option value is a usage error (2), refused before the model loads.
    assert code == 2 and "Traceback" not in captured.err
    assert captured.err.strip().splitlines() == ["run: max_new_tokens must be >= 1, got 0"]
