"""``benchmarks.instructions`` and ``benchmarks.stage_timers``: costs per captured vector,
and a scenario that captures none."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks import stage_timers
from benchmarks.instructions import _dumps, _instructions, instruction_tables


def _dump(folder: Path, name: str, instructions: int) -> None:
    """A callgrind dump of one function, as ``callgrind_control --dump=name`` writes."""
    (folder / f"callgrind.1.{name}").write_text(
        f"version: 1\ncreator: callgrind-3.22.0\npid: 1\ncmd: python\npart: 1\n\n"
        f"desc: Trigger: dump {name}\n\npositions: line\nevents: Ir\n"
        f"summary: {instructions}\n\nob=(1) /usr/bin/python3\nfl=(1) ceval.c\n"
        f"fn=(1) _PyEval_EvalFrameDefault\n1 {instructions}\n\ntotals: {instructions}\n")


@pytest.mark.skipif(shutil.which("callgrind_annotate") is None,
                    reason="needs valgrind's callgrind_annotate")
def test_a_scenario_that_captured_no_vector_has_no_instructions_per_vector(tmp_path):
    for name, instructions in (("raw_forward_hooks", 1_000_000), ("uc_empty_spec", 1_600_000),
                               ("uc_3_layers_capture_only", 1_300_000)):
        _dump(tmp_path, name, instructions)
    found = {name: _instructions(path) for name, path in _dumps(tmp_path).items()}
    lines = instruction_tables(found, {"uc_empty_spec": 0, "uc_3_layers_capture_only": 6},
                               ["uc_empty_spec", "uc_3_layers_capture_only"], by_function=1)
    assert "| uc_empty_spec | 1.6 | 0 | — |" in lines
    assert "| uc_3_layers_capture_only | 1.3 | 6 | 50,000 |" in lines
    assert "| ceval.c:_PyEval_EvalFrameDefault [/usr/bin/python3] | 0.60 | — |" in lines
    assert "| ceval.c:_PyEval_EvalFrameDefault [/usr/bin/python3] | 0.30 | 50,000 |" in lines


def test_stage_timers_give_no_cost_per_vector_to_a_scenario_that_captured_none(capsys):
    assert stage_timers.main(["--scenario", "uc_empty_spec", "--batch", "1", "--layers", "3",
                              "--max-new-tokens", "3", "--repeats", "1", "--threads", "0",
                              "--default-allocator"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "0 vectors, — µs per vector over plain" in printed[0]
    rows = [line.split(" | ") for line in printed if line.startswith("| ") and "---" not in line]
    assert rows[1:] and all(row[1] == "—" for row in rows[1:])
