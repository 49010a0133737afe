"""``benchmarks.run``: what makes a run fail, and what its summary says about it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

import benchmarks.run as run
from benchmarks.report import attach_memory, timing_rows

TOKENS = [[1, 2, 3, 4]]
ENVIRONMENT = {"date": "today", "git_commit": "abc", "cpu": "cpu", "cpu_count": 2,
               "memory_gib": 1, "python": "3", "versions": {}, "torch_threads": 1,
               "load_average_start": (0, 0, 0), "load_average_end": (0, 0, 0)}


def _timing_result() -> dict[str, Any]:
    samples = [{"round": r, "wall_s": 0.1, "cpu_s": 0.1, "ttft_s": 0.001, "new_tokens": 4,
                "records": 0, "captured_bytes": 0, "notes": {}} for r in range(2)]
    return {"model": "tiny", "model_description": "tiny model", "layers": [0, 2, 3],
            "cases": [{"scenario": name, "batch_size": 1, "prompt_length": 5, "status": "ok",
                       "samples": samples, "token_ids": TOKENS}
                      for name in ("plain_generate", "raw_forward_hooks")]}


def _memory(token_ids: list[list[int]]) -> dict[str, Any]:
    return {"ok": True, "result": {"status": "ok", "peak_rss_mb": 100.0, "rss_growth_mb": 1.0,
                                   "token_ids": token_ids}}


def _main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rows: list[dict[str, Any]],
          errors: list[str]) -> tuple[int, str]:
    monkeypatch.setattr(run, "measure", lambda args: (ENVIRONMENT, rows, [], errors))
    monkeypatch.setattr(run, "write_plot", lambda rows, path: "none")
    code = run.main(["--quick", "--no-scaling", "--out", str(tmp_path)])
    return code, (tmp_path / "summary.md").read_text()


def test_a_memory_job_that_generated_other_tokens_fails_the_run(monkeypatch, tmp_path):
    rows = timing_rows(_timing_result(), 4)
    attach_memory(rows, {("tiny", 1, "plain_generate"): _memory(TOKENS),
                         ("tiny", 1, "raw_forward_hooks"): _memory([[1, 2, 9, 9]])})
    code, summary = _main(monkeypatch, tmp_path, rows, [])
    assert code == 1
    results = summary.split("## Results")[1].split("## Targets")[0]
    table = {line.split("|")[1].strip(): line for line in results.splitlines()
             if line.startswith(("| plain_generate", "| raw_forward_hooks"))}
    assert table["plain_generate"].endswith("| yes |")
    assert table["raw_forward_hooks"].endswith("| **NO** (memory job) |")


def test_a_run_whose_tokens_all_match_exits_zero(monkeypatch, tmp_path):
    rows = timing_rows(_timing_result(), 4)
    attach_memory(rows, {("tiny", 1, name): _memory(TOKENS)
                         for name in ("plain_generate", "raw_forward_hooks")})
    code, summary = _main(monkeypatch, tmp_path, rows, [])
    assert code == 0 and "**NO**" not in summary and "Job errors" not in summary


def test_a_failed_memory_job_is_a_job_error(monkeypatch, tmp_path):
    class Runner:
        def run(self, job: str, **kwargs: Any) -> dict[str, Any]:
            if job == "timing":
                return {"ok": True, "result": _timing_result()}
            if kwargs["scenario"] == "raw_forward_hooks":
                return {"ok": False, "error": "Traceback ...\nMemoryError: out of memory"}
            return _memory(TOKENS)

    args = argparse.Namespace(
        models=["tiny"], batch_sizes=[1], scenarios=["plain_generate", "raw_forward_hooks"],
        repeats=2, max_new_tokens=4, threads=1, device="cpu", dtype=None, no_memory=False,
        memory_batch_sizes=[1], memory_scenarios=["plain_generate", "raw_forward_hooks"])
    rows, errors = run.run_hf(args, Runner())
    assert len(errors) == 1
    assert "memory job for tiny batch 1 raw_forward_hooks failed" in errors[0]
    assert errors[0].endswith("MemoryError: out of memory")
    code, summary = _main(monkeypatch, tmp_path, rows, errors)
    assert code == 1
    assert ("- memory job for tiny batch 1 raw_forward_hooks failed: Traceback ..."
            not in summary)  # (the summary keeps an error's last line)
    assert "## Job errors\n\n- MemoryError: out of memory" in summary
