"""``benchmarks.ab``: two versions of undercurrent timed in alternating processes."""

from __future__ import annotations

import pytest

from benchmarks import ab
from benchmarks.ab import PLAIN, RAW, ROOT, main, summarise, time_interleaved


def test_a_versions_processes_are_summed_up_by_their_paired_repeats():
    runs = [
        {"scenario": "s", "vectors": 10,
         "times": {PLAIN: [1.0, 0.9], RAW: [1.0, 1.0], "s": [1.00002, 1.00004]}},
        {"scenario": "s", "vectors": 10,
         "times": {PLAIN: [0.8, 1.1], RAW: [2.0, 2.0], "s": [2.00001, 2.00003]}},
    ]
    summary = summarise(runs)
    # Paired extras: 2, 4 µs per vector in the first process, 1, 3 in the second.
    assert summary["extra_us"] == pytest.approx(2.5)
    assert (summary["low_us"], summary["high_us"]) == pytest.approx((2.0, 3.0))
    assert summary["x_plain"] == pytest.approx(1.00002 / 0.8)
    assert summary["processes"] == 2


def test_one_process_times_plain_raw_hooks_and_the_scenario_in_turn(monkeypatch):
    # (this process's heap and environment left as they are: the timing
    # processes the command starts make theirs steady)
    monkeypatch.setattr("benchmarks.allocator.steady_allocator", lambda: True)
    found = time_interleaved("uc_inline_linear", batch=2, layers="all", tokens=3, repeats=2,
                             threads=None)
    assert set(found["times"]) == {PLAIN, RAW, "uc_inline_linear"}
    assert all(len(times) == 2 and min(times) > 0 for times in found["times"].values())
    assert found["vectors"] > 0
    assert found["package"] == str((ROOT / "undercurrent").resolve())


def test_the_command_times_a_base_revision_against_the_working_tree(capsys, tmp_path,
                                                                    monkeypatch):
    """End to end on ``HEAD``: a worktree of the base is made and removed, each
    version's process imports its own package."""
    imported: list[str] = []
    run_process = ab._run_process

    def recording(package_root, args, scenario, lib):
        found = run_process(package_root, args, scenario, lib)
        imported.append(found["package"])
        return found

    monkeypatch.setattr(ab, "_run_process", recording)
    assert main(["--base", "HEAD", "--batch", "2", "--max-new-tokens", "2", "--rounds", "1",
                 "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| `HEAD` |" in printed and "| working tree |" in printed
    assert len(imported) == 2 and imported[1] == str((ROOT / "undercurrent").resolve())
    assert imported[0] != imported[1] and "undercurrent-ab-" in imported[0]


def test_a_scenario_that_captures_no_vector_has_no_cost_per_vector(capsys, monkeypatch):
    monkeypatch.setattr("benchmarks.allocator.steady_allocator", lambda: True)
    found = time_interleaved("uc_empty_spec", batch=1, layers="3", tokens=2, repeats=2,
                             threads=None)
    assert found["vectors"] == 0
    summary = summarise([found, found])
    assert (summary["extra_us"], summary["low_us"], summary["high_us"]) == (None, None, None)
    assert summary["x_plain"] > 0 and summary["processes"] == 2
    monkeypatch.setattr(ab, "compare", lambda args: {"base": summary, "working tree": summary})
    assert main(["--base", "HEAD", "--scenario", "uc_empty_spec"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `HEAD`")]
    assert rows == [f"| `HEAD` | — | — | {summary['x_plain']:.3f} |"]
