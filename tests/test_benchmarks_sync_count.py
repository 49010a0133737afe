"""benchmarks.sync_count: the host-sync counter behind the async-path measurement."""

from __future__ import annotations

import threading

import pytest

from benchmarks.sync_count import count_syncs

torch = pytest.importorskip("torch")


def test_counts_host_copies_made_by_undercurrent_per_thread_and_restores_tensor():
    from undercurrent.probes.arrays import as_float_matrix

    # bfloat16: converted by a copy into a float64 host tensor (float32 by numpy)
    rows = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]
    original = torch.Tensor.tolist
    with count_syncs() as counts:
        as_float_matrix(rows)  # undercurrent: .copy_ into a float64 host tensor, .numpy()
        rows[0].tolist()  # this test's own call: not undercurrent's, not counted
        worker = threading.Thread(target=as_float_matrix, args=(rows,))
        worker.start()
        worker.join()
    assert torch.Tensor.tolist is original
    by_key = {(kind, who, call): n for (kind, who, call, _where), n in counts.items()}
    assert by_key == {
        ("generation thread", "undercurrent", "copy_ to host"): 1,
        ("generation thread", "undercurrent", "numpy"): 1,
        ("worker thread", "undercurrent", "copy_ to host"): 1,
        ("worker thread", "undercurrent", "numpy"): 1,
    }
    assert all(where.startswith("probes/arrays.py:") for (*_, where) in counts)


def test_stage_timers_time_the_capture_path_and_put_every_function_back():
    import collections

    from benchmarks.stage_timers import STAGES, timed_stages
    from undercurrent import ProbedModel
    from undercurrent.adapters.session import CaptureSession
    from undercurrent.probes.scoring import ScoreSummary
    from undercurrent.spec import parse_dict

    before = (CaptureSession.open_requests, vars(ScoreSummary)["batch_signals_many"])
    spec = parse_dict({"version": "1", "extraction_points": [{
        "name": "p", "layers": [0, 1], "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory",
        "probe_args": {"threshold": 1.0e9}}]})
    totals: collections.Counter[str] = collections.Counter()
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as probed:
        with timed_stages(totals):
            probed.generate(["a b", "c d e"], max_new_tokens=3)
    for stage in (STAGES[0][3], "register requests", "end requests", "plan a forward",
                  "deliver a forward (all below)",
                  "  route a point's batch", "    thresholds and summaries (judge_many)"):
        assert totals[stage] > 0, stage
    assert (CaptureSession.open_requests, vars(ScoreSummary)["batch_signals_many"]) == before


def test_stage_timers_time_each_inner_forward_of_a_generation_and_remove_their_hooks():
    from benchmarks.stage_timers import timed_forwards
    from undercurrent import ProbedModel

    ticks = iter(range(1000))  # a clock that moves one second a reading
    with ProbedModel.from_pretrained("undercurrent/tiny") as probed:
        model = probed.backend.model  # type: ignore[attr-defined]
        inner = model.base_model
        assert inner is not model
        hooks = (dict(inner._forward_pre_hooks), dict(inner._forward_hooks))
        with timed_forwards(model, clock=lambda: float(next(ticks))) as timed:
            probed.generate(["a b", "c d e"], max_new_tokens=3)
            # the prefill and two decode steps (the third token is never fed)
            assert timed == [3.0, 3]
            timed[:] = [0.0, 0]
            probed.generate(["a b"], max_new_tokens=2)
            assert timed == [2.0, 2]
        assert (dict(inner._forward_pre_hooks), dict(inner._forward_hooks)) == hooks


def test_stage_timers_time_an_async_trajectory_s_workers_and_put_every_function_back():
    import collections

    from benchmarks.stage_timers import timed_stages
    from undercurrent import ProbedModel
    from undercurrent.probes.trajectory import TrajectoryProbe
    from undercurrent.router import Router, scheduler
    from undercurrent.router.binding import Binding
    from undercurrent.spec import parse_dict

    before = (vars(TrajectoryProbe)["judge_many"], TrajectoryProbe.row_values,
              scheduler._judge_taken, vars(Binding)["take_together"])
    spec = parse_dict({"version": "1", "extraction_points": [{
        "name": "p", "layers": [0, 1], "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "trajectory_probe",
        "probe_kind": "trajectory", "execution_mode": "async",
        "probe_args": {"threshold": 1.0e9}}]})
    totals: collections.Counter[str] = collections.Counter()
    # One worker, never joined by another: each routing schedules both requests'
    # bindings at once, and that worker takes them together (a group's turn).
    with Router(workers=1, stall_timeout_s=3600.0) as router, ProbedModel.from_pretrained(
            "undercurrent/tiny", spec=spec, router=router) as probed:
        with timed_stages(totals):
            outputs = probed.generate(["a b", "c d e"], max_new_tokens=3)
    # (every row judged: the workers' stages ran before generate() returned)
    assert all(output.results["p"].stats.processed == output.results["p"].stats.received > 0
               for output in outputs)
    for stage in ("workers: judge together",
                  "  take the group's queued rows (every binding at once)",
                  "  the turn's values and judgements (in the trajectory stages above)",
                  "    settle the group's bindings (at once)",
                  "    trajectory: the rows' values (norms or scores)",
                  "    trajectory: running statistics and summaries (judge_many)"):
        assert totals[stage] > 0, stage
    assert (vars(TrajectoryProbe)["judge_many"], TrajectoryProbe.row_values,
            scheduler._judge_taken, vars(Binding)["take_together"]) == before


def test_a_copy_counts_when_it_blocks_into_host_memory():
    from benchmarks.sync_count import _blocking_copy_to_host

    host, source = torch.empty(3), torch.ones(3)
    assert _blocking_copy_to_host(host, (source,), {})
    assert _blocking_copy_to_host(host, (source, False), {})
    assert not _blocking_copy_to_host(host, (source,), {"non_blocking": True})
    assert not _blocking_copy_to_host(host, (source, True), {})
    meta = torch.empty(3, device="meta")  # a target off the host: a copy to a device
    assert not _blocking_copy_to_host(meta, (source,), {})


def test_a_to_host_counts_unless_non_blocking_and_a_host_device_object_counts_off_a_device():
    from benchmarks.profile import OURS
    from benchmarks.sync_count import _to_host

    # a function whose frame lies in undercurrent's package, copying as the hooks do
    # on CUDA (adapters/hf/hooks.py: non-blocking into pinned memory)
    source = ("def copies(t):\n"
              "    t.to('cpu', non_blocking=True)\n"
              "    t.to('cpu', torch.float64, True)\n"
              "    t.to(device='cpu', non_blocking=True, dtype=torch.float64)\n"
              "    t.to(torch.device('cpu'))\n"  # (already on the host: no copy off a device)
              "    t.to('cpu')\n"
              "    t.to('cpu', torch.float64, False)\n")
    namespace = {"torch": torch}
    exec(compile(source, OURS + "adapters/hf/hooks.py", "exec"), namespace)
    with count_syncs() as counts:
        namespace["copies"](torch.zeros(2))
    assert {(call, where) for (_, _, call, where) in counts} == {
        ("to('cpu')", "adapters/hf/hooks.py:6(copies)"),
        ("to('cpu')", "adapters/hf/hooks.py:7(copies)")}
    meta = torch.empty(2, device="meta")  # a tensor off the host
    assert _to_host(meta, (torch.device("cpu"),), {})
    assert _to_host(meta, (), {"device": torch.device("cpu"), "dtype": torch.float64})
    assert not _to_host(meta, (torch.device("cpu"),), {"non_blocking": True})
    assert not _to_host(meta, (torch.device("meta"),), {})
    assert not _to_host(meta, (torch.float64,), {})
