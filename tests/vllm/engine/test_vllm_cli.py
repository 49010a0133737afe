"""``undercurrent run`` and ``undercurrent capture`` with ``--backend vllm``, each in a
process of its own, as a user starts them (vLLM reads its environment when first
imported, so only a fresh process shows what the command sets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SPEC = """\
version: "1"
extraction_points:
  - name: last_prompt
    layers: 1
    tensor_type: residual_stream
    position: "prompt[-1]"
    probe_type: norm_probe
    probe_kind: single_shot
"""


def _undercurrent(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("VLLM_LOGGING_STREAM", "VLLM_CONFIGURE_LOGGING")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return subprocess.run([sys.executable, "-m", "undercurrent", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=400, check=False)


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


@pytest.mark.timeout(420)
def test_run_json_on_stdout_is_json_alone_with_vllm_s_logs_on_stderr(model_dir, spec,
                                                                    tmp_path):
    # vLLM logs to stdout by default: its INFO lines came before the JSON.
    done = _undercurrent("run", str(spec), "--model", model_dir, "--backend", "vllm",
                         "--prompt", "the quick brown fox", "--max-new-tokens", "3",
                         "--format", "json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (summary,) = json.loads(done.stdout)
    assert set(summary["verdicts"]) == {"last_prompt"}
    assert "INFO" in done.stderr  # (vLLM still says what it does, where logs belong)


@pytest.mark.timeout(420)
def test_capture_prints_only_its_summary_line_on_stdout(model_dir, spec, tmp_path):
    (tmp_path / "prompts.txt").write_text("the quick brown fox\n")
    done = _undercurrent("capture", "--spec", str(spec), "--prompts", "prompts.txt",
                         "--out", "store", "--model", model_dir, "--backend", "vllm",
                         "--max-new-tokens", "2", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.splitlines()
    assert line.startswith("1 prompts (0 already done)"), done.stdout


@pytest.mark.parametrize(("device", "fragment"), [
    ("bogus", "device 'bogus' is not a device torch knows"),
    ("meta", "device 'meta': the vllm backend runs where the installed vLLM build targets"),
])
def test_a_device_the_engine_cannot_run_on_is_a_usage_error_before_the_model_loads(
        spec, tmp_path, capsys, monkeypatch, device, fragment):
    # The CLI checked --device for the hf backend only: with vllm it was exit 1,
    # after starting to load the model.
    from undercurrent.cli import main

    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    (tmp_path / "prompts.txt").write_text("the quick brown fox\n")
    never_loaded = str(tmp_path / "never-loaded")
    for command, argv in (("run", ["run", str(spec), "--prompt", "hi"]),
                          ("capture", ["capture", "--spec", str(spec), "--prompts",
                                       str(tmp_path / "prompts.txt"), "--out",
                                       str(tmp_path / "store")])):
        code = main([*argv, "--model", never_loaded, "--backend", "vllm", "--device", device])
        captured = capsys.readouterr()
        assert code == 2, captured.err
        (line,) = captured.err.strip().splitlines()
        assert line.startswith(f"{command}: ") and fragment in line
