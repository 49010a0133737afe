"""``benchmarks.bytecodes``: exact bytecode counts of one generation."""

from __future__ import annotations

from benchmarks import bytecodes
from benchmarks.bytecodes import BASELINE, PHASES, count, main


def test_probing_runs_more_bytecodes_than_raw_hooks_and_its_stages_are_counted():
    counted = count(["uc_empty_spec", "uc_inline_linear"], batch=3, layers="all", tokens=4,
                    phases=True)
    raw, empty, probed = (counted[name].total
                          for name in (BASELINE, "uc_empty_spec", "uc_inline_linear"))
    assert raw < empty < probed
    inside = counted["uc_inline_linear"].inside
    for function, _ in PHASES:
        assert inside[function] > 0, function
    # Stages nest: what a stage calls is counted in it too.
    assert inside["close_requests"] >= inside["flush_window"] + inside["end_requests"]
    assert counted["uc_empty_spec"].inside["register_requests"] == 0
    calls = counted["uc_inline_linear"].calls
    built = [number for (path, _, name), number in calls.items()
             if name == "__init__" and path.endswith("adapters/session.py")]
    assert 3 in built  # one request state per prompt


def test_the_command_prints_each_table(capsys, monkeypatch):
    monkeypatch.setattr(bytecodes, "set_threads", lambda threads: None)  # (this process's)
    assert main(["--batch", "2", "--max-new-tokens", "3", "--phases", "--by-function", "5"]) == 0
    printed = capsys.readouterr().out
    assert "| uc_inline_linear |" in printed and "| raw_forward_hooks |" in printed
    assert "close the requests" in printed
    assert printed.count("\n| ") >= 2 + len(PHASES) + 5
