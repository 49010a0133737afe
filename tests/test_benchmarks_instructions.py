"""``benchmarks.instructions`` and ``benchmarks.stage_timers``: costs per captured vector,
and a scenario that captures none."""

from __future__ import annotations

import collections

from benchmarks import stage_timers
from benchmarks.instructions import instruction_tables


def test_a_scenario_that_captured_no_vector_has_no_instructions_per_vector():
    # (the counts as _instructions reads them from callgrind's dumps: their total,
    # and each function's)
    function = "ceval.c:_PyEval_EvalFrameDefault [/usr/bin/python3]"
    found = {name: (instructions, collections.Counter({function: instructions}))
             for name, instructions in (("raw_forward_hooks", 1_000_000),
                                        ("uc_empty_spec", 1_600_000),
                                        ("uc_3_layers_capture_only", 1_300_000))}
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
