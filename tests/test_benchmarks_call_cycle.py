"""``benchmarks.call_cycle``: a generation call's work around the model, without it."""

from __future__ import annotations

import time

from benchmarks.call_cycle import LAYERS, STEPS, cycle, main, make_call


def test_a_cycle_opens_routes_and_closes_every_request_of_the_call():
    call = make_call(3)
    router = call[0]
    stages = cycle(call, time.perf_counter)
    assert len(stages) == 3 and all(seconds >= 0 for seconds in stages)
    assert router.live_requests() == ()
    totals = router.metrics()["totals"]
    assert totals["received"] == totals["processed"] == 3 * STEPS * LAYERS
    cycle(call)  # (a second call on the same router: the ids are free again)
    assert router.metrics()["totals"]["processed"] == 2 * 3 * STEPS * LAYERS


def test_the_command_prints_each_stage(capsys):
    assert main(["--batch", "2", "--repeats", "2"]) == 0
    printed = capsys.readouterr().out
    assert "batch 2, fastest of 2 cycles: open" in printed and "close" in printed
    assert main(["--batch", "2", "--run", "1"]) == 0  # (what a counted child runs)


def test_a_cold_cycle_sweeps_the_caches_before_each_stage(capsys):
    from benchmarks.call_cycle import cache_sweep

    swept: list[int] = []
    sweep = cache_sweep(1)
    stages = cycle(make_call(2), time.perf_counter, lambda: swept.append(int(sweep())))
    assert len(stages) == 3 and swept == [(1 << 20) // 8] * 3
    assert main(["--batch", "2", "--repeats", "2", "--cold"]) == 0
    assert "fastest of 2 cold cycles: open" in capsys.readouterr().out
