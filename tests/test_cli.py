"""The ``undercurrent`` command: validate and schema (other commands have their own tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from spec_files import SHIPPED, SPEC_FILES

from undercurrent.cli import main
from undercurrent.spec import json_schema

SPECS = Path(__file__).resolve().parents[1] / "specs"
DEMO = str(SHIPPED / "demo.yaml")

OLD_KEYS = """\
extraction_points:
  - name: old_style
    layer: 1
    tensor_type: kv
    position: 0
    probe_type: norm_probe
    probe_kind: single_shot
"""

INVALID = """\
extraction_points:
  - name: bad
    layers: -1
    tensor_type: residual
    position: "prompt[-1]"
    probe_type: norm_probe
    probe_kind: single_shot
"""


@pytest.fixture
def old_spec(tmp_path: Path) -> Path:
    path = tmp_path / "old.yaml"
    path.write_text(OLD_KEYS, encoding="utf-8")
    return path


@pytest.fixture
def invalid_spec(tmp_path: Path) -> Path:
    path = tmp_path / "invalid.yaml"
    path.write_text(INVALID, encoding="utf-8")
    return path


def test_validate_valid_specs_prints_one_ok_line_each_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    paths = SPEC_FILES
    assert len(paths) >= 4
    assert main(["validate", *map(str, paths)]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = []
    for path in paths:
        data = yaml.safe_load(path.read_text())
        count = len(data["extraction_points"])
        noun = "extraction point" if count == 1 else "extraction points"
        edits = len(data.get("edits", []))
        more = f", {edits} edit{'' if edits == 1 else 's'}" if edits else ""
        expected.append(f"{path}: OK ({count} {noun}{more})")
    assert lines == expected


def test_validate_invalid_spec_prints_all_problems_on_one_line_and_exits_1(
    invalid_spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(invalid_spec)]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{invalid_spec}: INVALID (2 problems): ")
    assert "extraction_points[0] (name 'bad'), field 'layers'" in line
    assert "field 'tensor_type'" in line and "residual_stream" in line


def test_validate_exits_1_when_any_file_is_invalid_or_missing(
    invalid_spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = str(SPECS / "classic_single_token.yaml")
    missing = str(tmp_path / "missing.yaml")
    assert main(["validate", good, missing]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("OK (1 extraction point)")
    assert out[1].startswith(f"{missing}: INVALID") and "no such file" in out[1]
    assert main(["validate", invalid_spec.as_posix(), good]) == 1


def test_validate_reports_deprecations_as_warnings(
    old_spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(old_spec)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == f"{old_spec}: OK (1 extraction point)"
    assert "warning" in captured.err and "'layer'" in captured.err


def test_validate_strict_turns_deprecations_into_errors(
    old_spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "--strict", str(old_spec)]) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{old_spec}: INVALID (1 problem)") and "'layers'" in line


def test_validate_json_format(
    old_spec: Path, invalid_spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = str(SPECS / "continuous_trajectory.yaml")
    assert main(["validate", "--format", "json", good, str(old_spec), str(invalid_spec)]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [(r["path"], r["valid"], r["extraction_points"]) for r in reports] == [
        (good, True, 1),
        (str(old_spec), True, 1),
        (str(invalid_spec), False, None),
    ]
    assert reports[1]["warnings"][0]["field"] == "layer"
    problems = reports[2]["problems"]
    assert [(p["point_index"], p["point_name"], p["field"]) for p in problems] == [
        (0, "bad", "layers"),
        (0, "bad", "tensor_type"),
    ]


@pytest.mark.parametrize(
    "argv",
    [["validate"], ["validate", "--format", "xml", "a.yaml"], ["no-such-command"], [],
     ["validate", "--bogus", "a.yaml"]],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "option"), [
    (["run", DEMO, "--model", "tiny", "--prompt", "hi", "--records", ""],
     "--records"),
    (["run", DEMO, "--model", "", "--prompt", "hi"], "--model"),
    (["run", "", "--model", "tiny", "--prompt", "hi"], "SPEC"),
    (["inspect-model", "tiny", "--emit-spec", ""], "--emit-spec"),
    (["inspect-model", ""], "MODEL"),
    (["validate", DEMO, ""], "SPEC"),
    (["demo", "--out", ""], "--out"),
    (["demo", "--spec", ""], "--spec"),
    (["capture", "--spec", DEMO, "--prompts", "", "--out", "o"],
     "--prompts"),
    (["capture", "--spec", "", "--prompts", "p.txt", "--out", "o"], "--spec"),
])
def test_an_empty_path_argument_is_a_usage_error_naming_it(
        argv: list[str], option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`run --records ''` and `inspect-model --emit-spec ''` ran and wrote nothing,
    without a word; `validate ''` and `demo --out ''` said "'' is a directory" and
    `capture --prompts ''` named '.'."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert f"argument {option}: an empty path; give a path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_help_lists_the_commands_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "validate" in out and "schema" in out and "exit codes" in out
    assert main(["validate", "--help"]) == 0
    assert "--strict" in capsys.readouterr().out


def test_schema_prints_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()


def test_python_dash_m_undercurrent_runs_the_same_command(invalid_spec: Path) -> None:
    good = str(SPECS / "classic_single_token.yaml")
    ok = subprocess.run(
        [sys.executable, "-m", "undercurrent", "validate", good],
        capture_output=True, text=True, check=False,
    )
    assert (ok.returncode, ok.stdout.strip()) == (0, f"{good}: OK (1 extraction point)")
    bad = subprocess.run(
        [sys.executable, "-m", "undercurrent", "validate", str(invalid_spec)],
        capture_output=True, text=True, check=False,
    )
    assert bad.returncode == 1 and "INVALID" in bad.stdout


def test_run_reports_a_spec_s_deprecations_as_warnings(
    old_spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # As validate does: one line each on stderr, the run itself unchanged.
    assert main(["run", str(old_spec), "--model", "tiny", "--max-new-tokens", "1",
                 "--prompt", "hi"]) == 0
    captured = capsys.readouterr()
    told = [line for line in captured.err.splitlines() if line.startswith("run: warning:")]
    assert len(told) == 1 and "key 'layer' is deprecated" in told[0], captured.err
    assert "--- 'hi'" in captured.out


def test_a_spec_s_deprecations_point_at_the_caller_through_probed_model(
    old_spec: Path,
) -> None:
    # Python shows a DeprecationWarning under its default filters only where it
    # points at the caller's code: so it does through ProbedModel(spec=...).
    import warnings

    pytest.importorskip("torch")
    from undercurrent import ProbedModel
    from undercurrent.spec import SpecDeprecationWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ProbedModel.from_pretrained("undercurrent/tiny", spec=str(old_spec)).close()
    (warning,) = [w for w in caught if issubclass(w.category, SpecDeprecationWarning)]
    assert warning.filename == __file__
