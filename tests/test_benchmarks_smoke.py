"""The benchmark harness in --quick mode (a smoke test: no timing assertions).

Runs ``python -m benchmarks.run --quick`` end to end and checks what it must
leave behind: the results, the summary, the plot, and every scenario having
generated exactly the baseline's tokens with the captured data it claims.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import scaling
from benchmarks.measure import median_interval, spread
from benchmarks.report import _token_check
from benchmarks.targets import evaluate

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("bench")
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return out, rows


def _scaling_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "scaling.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_quick_run_writes_results_summary_and_plot(quick_run):
    out, rows = quick_run
    assert rows, "results.jsonl is empty"
    summary = (out / "summary.md").read_text()
    assert "## Results" in summary and "| plain_generate |" in summary
    assert (out / "overhead.png").read_bytes()[:8] == PNG_MAGIC
    environment = json.loads((out / "environment.json").read_text())
    assert environment["versions"]["torch"].startswith("2.")


@pytest.mark.timeout(900)
def test_every_measured_scenario_generated_the_baseline_tokens(quick_run):
    _, rows = quick_run
    measured = [r for r in rows if r["status"] == "ok"]
    names = {r["scenario"] for r in measured}
    assert {"plain_generate", "raw_forward_hooks", "uc_3_layers_inline_norm"} <= names
    for row in measured:
        assert row["tokens_match"] is True, (row["scenario"], row.get("token_check"))
        assert row["new_tokens"] == row["batch_size"] * row["max_new_tokens"]
    for row in rows:
        if row["status"] != "ok":  # an alternative missing here must say why
            assert row["reason"], row["scenario"]


@pytest.mark.timeout(900)
def test_three_layer_scenarios_capture_the_same_data_as_raw_hooks(quick_run):
    _, rows = quick_run
    for batch in {r["batch_size"] for r in rows}:
        by_name = {r["scenario"]: r for r in rows
                   if r["batch_size"] == batch and r["status"] == "ok"}
        floor = by_name["raw_forward_hooks"]["records"]
        # one record per (generated token fed back through the model, layer)
        assert floor == batch * (by_name["raw_forward_hooks"]["max_new_tokens"] - 1) * 3
        for name in ("uc_3_layers_inline_norm", "uc_3_layers_capture_only",
                     "uc_3_layers_async_trajectory",
                     "uc_3_layers_block_until_signal", "nnsight", "transformer_lens"):
            if name in by_name:
                assert by_name[name]["records"] == floor, name
        if "uc_3_layers_async_trajectory" in by_name:
            assert by_name["uc_3_layers_async_trajectory"]["notes"]["dropped"] == 0


@pytest.mark.timeout(900)
def test_memory_rows_come_from_fresh_processes(quick_run):
    _, rows = quick_run
    with_memory = [r for r in rows if r.get("peak_rss_mb") is not None]
    assert with_memory
    for row in with_memory:
        assert row["peak_rss_mb"] > 0
        assert row["memory_run_tokens_match"] is True


@pytest.mark.timeout(900)
def test_scaling_set_captures_every_layer_set_like_raw_hooks(quick_run):
    out, _ = quick_run
    rows = _scaling_rows(out)
    assert (out / "scaling.md").read_text().count("| capture only |") == 2
    assert (out / "scaling.png").read_bytes()[:8] == PNG_MAGIC
    tokens = rows[0]["max_new_tokens"]
    for layer_set in scaling.LAYER_SETS:
        by_mode = {r["mode"]: r for r in rows
                   if r["layer_set"] == layer_set and r["status"] == "ok"}
        assert (set(scaling.MODES) | set(scaling.HF_ONLY_MODES)
                | {"plain_generate", "raw_forward_hooks"}) <= set(by_mode)
        raw = by_mode["raw_forward_hooks"]
        layers = raw["capture_layers"]
        if layer_set == "all":
            assert layers == list(range(len(layers))) and len(layers) > 3
        else:
            assert len(layers) == 3
        assert raw["records"] == raw["batch_size"] * (tokens - 1) * len(layers)
        for mode in (*scaling.MODES, *scaling.HF_ONLY_MODES, "nnsight"):
            if mode in by_mode:
                row = by_mode[mode]
                assert row["records"] == raw["records"], (layer_set, mode)
                assert row["tokens_match"] is True, (layer_set, mode, row["token_check"])
                assert row["capture_layers"] == layers
        assert by_mode["async trajectory"]["notes"]["dropped"] == 0
        assert by_mode["inline linear"]["us_per_vector"]["median"] is not None


def test_scaling_targets_report_a_miss_as_a_miss():
    def row(mode: str, ratio: float, us: float | None = None) -> dict:
        return {"backend": "hf", "layer_set": "all", "batch_size": 64, "mode": mode,
                "status": "ok", "ratio_plain": {"median": ratio},
                "us_per_vector": None if us is None else {"median": us}}

    checks = scaling.evaluate([row("plain_generate", 1.0), row("nnsight", 1.03),
                               row("inline linear", 1.8, 21.0),
                               row("async trajectory", 1.5), row("inline trajectory", 1.4)])
    met = {c["target"].split(": ", 1)[-1]: c["met"] for c in checks}
    assert met["extra cost per captured vector over raw hooks <= 1 µs"] is False
    assert met["<= 1.05x plain generate()"] is False
    assert met["inline linear no slower than nnsight's capture alone"] is False
    assert met["async no more expensive than inline"] is True
    assert met["async no more expensive than the same probe inline"] is False
    assert [c["met"] for c in checks if c["target"].startswith("vLLM")] == [None, None]


def test_the_vllm_target_takes_its_interval_over_process_pairs():
    """A vLLM round's repeats share one plain and one probed process: the
    verdict's interval is over each round's median ratio, not over the repeats."""
    def outcome(walls: list[list[float]]) -> list[dict]:
        return [{"ok": True, "result": {"layers": [0], "cases": [{
            "concurrency": 64, "token_ids": [[1]], "samples": [
                {"wall_s": wall, "cpu_s": wall, "records": 5, "ttft_s": 0.0, "new_tokens": 1}
                for wall in round_walls]}]}} for round_walls in walls]

    plain = outcome([[1.0] * 5, [1.0] * 5, [1.0] * 5])
    probed = outcome([[1.01] * 5, [1.02] * 5, [1.3] * 5])  # one slow process pair
    pooled = scaling.pooled_rounds([{(scaling.VLLM_PLAIN, "-"): plain[i],
                                     ("inline linear", "all"): probed[i]} for i in range(3)])
    rows = scaling.vllm_rows("tiny", pooled, max_new_tokens=1)
    row = next(r for r in rows if r["mode"] == "inline linear")
    processes = row["ratio_plain_processes"]
    assert (processes["ci_low"], processes["ci_high"]) == (pytest.approx(1.01),
                                                           pytest.approx(1.3))
    assert processes["ci_level"] == 0.75  # three rounds: their min and max
    assert processes["per_round"] == [pytest.approx(v) for v in (1.01, 1.02, 1.3)]
    check = next(c for c in scaling.evaluate(rows)
                 if c["target"].startswith("vLLM 64 concurrent, all"))
    assert check["verdict"] == "unsettled" and check["value"] == pytest.approx(1.02)


def test_a_run_of_two_models_gets_a_table_targets_and_plot_lines_per_model():
    def row(model: str, mode: str, ratio: float, us: float | None = None) -> dict:
        scenario = {"plain_generate": "plain_generate"}.get(mode, mode)
        return {"backend": "hf", "model": model, "model_description": f"the {model} model",
                "layer_set": "all", "batch_size": 64, "mode": mode, "scenario": scenario,
                "status": "ok", "ratio_plain": {"median": ratio, "min": ratio, "max": ratio},
                "us_per_vector": None if us is None else {"median": us, "min": us, "max": us},
                "records": 10, "repeats": 1, "max_new_tokens": 4}

    rows = [row("tiny", "plain_generate", 1.0), row("tiny", "inline linear", 1.2, 3.0),
            row("large", "plain_generate", 1.0), row("large", "inline linear", 1.02, 0.5)]
    checks = {c["target"]: c["met"] for c in scaling.evaluate(rows)}
    per_vector = "HF batch 64, all layers, inline linear: extra cost per captured vector " \
        "over raw hooks <= 1 µs"
    assert checks[f"tiny: {per_vector}"] is False
    assert checks[f"large: {per_vector}"] is True
    headings = [line for line in scaling.table(rows) if line.startswith("#### hf")]
    assert [h.split(",")[0] for h in headings] == ["#### hf: the tiny model",
                                                   "#### hf: the large model"]
    from benchmarks.plot import _scaling_series

    assert set(_scaling_series(rows)) == {"hf tiny all layers: inline linear",
                                          "hf large all layers: inline linear"}


def test_spread_reports_median_range_relative_spread_and_interval():
    assert spread([1.0, 3.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                        "spread_pct": 100.0, "ci_low": 1.0, "ci_high": 3.0,
                                        "ci_level": 0.75}
    assert spread([])["median"] is None and spread([])["ci_low"] is None


@pytest.mark.parametrize("count", [1, 2, 5, 6, 9, 15, 25, 40, 101])
def test_the_median_interval_is_the_order_statistics_the_binomial_gives(count):
    """The oracle is scipy's binomial distribution: the widest-inside pair of
    order statistics (j-th smallest, j-th largest) whose coverage 1 - 2 P(B <= j - 1)
    reaches 95%, or the min and the max with their own coverage."""
    from scipy.stats import binom

    values = [float(v) for v in reversed(range(100, 100 + count))]  # given unsorted
    low, high, coverage = median_interval(values)
    reaching = [j for j in range(1, (count + 1) // 2 + 1)
                if 1 - 2 * binom.cdf(j - 1, count, 0.5) >= 0.95]
    j = max(reaching, default=1)
    assert (low, high) == (100.0 + j - 1, 100.0 + count - j)
    assert coverage == pytest.approx(1 - 2 * binom.cdf(j - 1, count, 0.5), abs=1e-12)
    if count == 25:
        assert (j, round(coverage, 3)) == (8, 0.957)


def test_a_target_is_met_only_when_its_whole_interval_is_within_the_limit():
    def stat(median: float, low: float, high: float) -> dict:
        return {"median": median, "ci_low": low, "ci_high": high, "ci_level": 0.957}

    assert scaling._check("t", stat(1.01, 0.99, 1.04), 1.05, "x")["verdict"] == "met"
    assert scaling._check("t", stat(1.09, 1.06, 1.12), 1.05, "x")["verdict"] == "missed"
    unsettled = scaling._check("t", stat(1.04, 1.01, 1.08), 1.05, "x")
    assert unsettled["verdict"] == "unsettled" and unsettled["met"] is False
    assert unsettled["measured"] == "1.040x (96% interval 1.010–1.080)"
    assert "not shown" in scaling.targets_table([unsettled])[-1]
    assert scaling._check("t", None, 1.05, "x")["met"] is None
    # One or two repeats make no interval worth the name (0%, 50% coverage): the
    # target is not judged, whichever side of the limit their median falls.
    for values in ([1.09], [1.09, 1.12], [0.90, 1.00]):
        low, high, level = median_interval(values)
        few = scaling._check("t", {"median": sorted(values)[0], "ci_low": low,
                                   "ci_high": high, "ci_level": level}, 1.10, "x")
        assert few["verdict"] == "too few" and few["met"] is False, values
        assert "too few repeats" in scaling.targets_table([few])[-1]
    low, high, level = median_interval([0.90, 1.00, 1.05])
    assert scaling._check("t", {"median": 1.0, "ci_low": low, "ci_high": high,
                                "ci_level": level}, 1.10, "x")["verdict"] == "met"


def test_scaling_rows_pair_async_with_inline_per_round():
    """The async-against-inline targets divide the two scenarios' wall times of
    the same round, so they carry an interval; the smaller ratio of medians
    would hide a round where async lost."""
    walls = {"plain_generate": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
             "raw_forward_hooks": [1.0] * 6,
             "uc_inline_linear": [1.1, 1.2, 1.1, 1.3, 1.1, 1.2],
             "uc_3_layers_async_trajectory": [1.0, 1.3, 1.2, 1.2, 1.0, 1.4],
             "uc_inline_trajectory": [1.1, 1.2, 1.1, 1.3, 1.1, 1.2]}
    result = {"model": "tiny", "model_description": "tiny", "cases": [
        {"layer_set": "all", "batch_size": 64, "scenario": name, "capture_layers": [0],
         "status": "ok", "samples": [{"round": i, "wall_s": w, "cpu_s": w, "records": 10,
                                      "notes": {}} for i, w in enumerate(values)]}
        for name, values in walls.items()]}
    rows = scaling.hf_rows(result, max_new_tokens=4)
    by_mode = {row["mode"]: row for row in rows}
    paired = by_mode["async trajectory"]["ratio_to"]["uc_inline_trajectory"]
    expected = sorted(a / b for a, b in zip(walls["uc_3_layers_async_trajectory"],
                                            walls["uc_inline_trajectory"], strict=True))
    assert paired["median"] == pytest.approx((expected[2] + expected[3]) / 2)
    assert (paired["ci_low"], paired["ci_high"]) == (expected[0], expected[-1])
    checks = {c["target"]: c for c in scaling.evaluate(rows)}
    same = checks["HF batch 64, all layers: async no more expensive than the same probe inline"]
    assert same["value"] == pytest.approx(paired["median"])
    assert same["verdict"] == "unsettled"  # rounds on both sides of 1


def test_token_check_names_the_first_difference():
    assert _token_check([[1, 2, 3]], [[1, 2, 3]])[0] is True
    match, message = _token_check([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert match is False and "prompt 1" in message and "token 1" in message


def test_targets_flag_a_missed_overhead_and_pass_a_met_one():
    def row(scenario: str, ratio: float) -> dict:
        return {"backend": "hf", "model": "large", "batch_size": 1, "scenario": scenario,
                "status": "ok", "overhead_ratio": {"median": ratio},
                "wall_s": {"median": ratio}}

    checks = evaluate([row("plain_generate", 1.0), row("raw_forward_hooks", 1.02),
                       row("uc_3_layers_inline_norm", 1.08)])
    by_target = {c["target"]: c for c in checks}
    assert by_target["3-layer capture adds <= 5% wall over plain generate()"]["met"] is False
    assert by_target["3-layer capture, inline norm probe, within 1.1x of raw hooks"]["met"] is True


def test_scaling_vllm_rows_pair_repeats_with_the_plain_engine_and_keep_errors():
    def case(concurrency: int, walls: list[float], records: int, tokens: list[list[int]]):
        samples = [{"wall_s": w, "cpu_s": w, "records": records} for w in walls]
        return {"concurrency": concurrency, "samples": samples, "token_ids": tokens}

    plain = {"ok": True, "result": {"cases": [case(8, [1.0, 2.0], 0, [[1, 2]])]}}
    probed = {"ok": True, "result": {"layers": [0, 1],
                                     "cases": [case(8, [1.5, 2.0], 1000, [[1, 2]])]}}
    failed = {"ok": False, "error": "Traceback ...\nRuntimeError: engine died"}
    rows = scaling.vllm_rows("tiny", {("vllm_plain_eager", "-"): plain,
                                      ("inline linear", "all"): probed,
                                      ("capture only", "3"): failed}, 4)
    inline = next(r for r in rows if r["mode"] == "inline linear")
    assert inline["ratio_plain"]["min"] == 1.0 and inline["ratio_plain"]["max"] == 1.5
    assert inline["us_per_vector"]["max"] == 500.0  # (1.5 - 1.0) s / 1000 vectors
    assert inline["tokens_match"] is True and inline["capture_layers"] == [0, 1]
    broken = next(r for r in rows if r["mode"] == "capture only")
    assert broken["status"] == "error" and "engine died" in broken["reason"]
    assert any("engine died" in line for line in scaling.table(rows))


def test_vllm_rounds_pair_each_probed_repeat_with_the_plain_repeat_of_its_round():
    """``--vllm-rounds``: each round runs every job in a process of its own; a
    probed repeat is divided by the plain repeat of the same round and index,
    never by another round's (the spread between processes is what rounds
    average over). A job that failed in one round keeps the others' samples."""
    def outcome(walls: list[float], records: int) -> dict:
        samples = [{"wall_s": w, "cpu_s": w, "records": records} for w in walls]
        return {"ok": True, "result": {"layers": [0], "cases": [
            {"concurrency": 64, "samples": samples, "token_ids": [[1]]}]}}

    failed = {"ok": False, "error": "Traceback ...\nRuntimeError: engine died"}
    rounds = [
        {("vllm_plain_eager", "-"): outcome([1.0, 1.0], 0),
         ("inline linear", "all"): outcome([1.1, 1.2], 100),
         ("capture only", "all"): failed},
        {("vllm_plain_eager", "-"): outcome([2.0, 2.0], 0),
         ("inline linear", "all"): outcome([2.6, 2.0], 100),
         ("capture only", "all"): outcome([3.0, 3.0], 100)},
    ]
    pooled = scaling.pooled_rounds(rounds)
    rows = {r["mode"]: r for r in scaling.vllm_rows("tiny", pooled, 4)}
    inline = rows["inline linear"]
    assert inline["repeats"] == 4
    # 1.1, 1.2 against round 1's 1.0; 1.3, 1.0 against round 2's 2.0
    assert inline["ratio_plain"]["min"] == 1.0 and inline["ratio_plain"]["max"] == 1.3
    assert inline["ratio_plain"]["median"] == pytest.approx(1.15)
    captured = rows["capture only"]
    assert captured["status"] == "ok" and captured["repeats"] == 2
    assert captured["ratio_plain"]["min"] == captured["ratio_plain"]["max"] == 1.5
    assert scaling.pooled_rounds(rounds[:1])[("capture only", "all")] is failed


def test_the_inline_linear_scenario_reads_activations_of_the_model_it_runs_on():
    """The bundled probe file on the bundled model; inline weights of the model's
    own width elsewhere (the file would refuse every row of the large model)."""
    from types import SimpleNamespace

    from benchmarks.scenarios.probed import BUNDLED_PROBE_WIDTH, ProbedInlineLinear
    from undercurrent.probes import LinearProbe

    def args_on(hidden: int) -> dict:
        scenario = ProbedInlineLinear()
        scenario.layers = (0, 1)
        model = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))
        scenario.bundle = SimpleNamespace(model=model)
        (point,) = scenario.points()
        return point["probe_args"]

    bundled = LinearProbe(**args_on(BUNDLED_PROBE_WIDTH))
    assert bundled.readout.weights.hidden == BUNDLED_PROBE_WIDTH  # the file's own width
    assert "path" in args_on(BUNDLED_PROBE_WIDTH)
    wide = LinearProbe(**args_on(1024))
    assert wide.readout.weights.hidden == 1024


def test_the_scaling_set_runs_only_the_jobs_asked_for(monkeypatch, tmp_path):
    """``--no-scaling-hf`` leaves out the HF job and ``--vllm-modes`` the other
    probed vLLM jobs; the plain engine runs in every round, first in one round
    and last in the next."""
    from benchmarks import run, vllm_jobs

    class Runner:
        def __init__(self) -> None:
            self.jobs: list[tuple[str, str | None, str | None]] = []

        def run(self, kind: str, **job: object) -> dict:
            self.jobs.append((kind, job.get("mode"), job.get("layer_set")))
            return {"ok": False, "error": "not run"}

    monkeypatch.setattr(vllm_jobs, "vllm_unavailable_reason", lambda: None)
    args = run.parse_args(["--scaling-only", "--vllm", "--no-scaling-hf", "--vllm-modes",
                           "inline linear", "--vllm-rounds", "2", "--out", str(tmp_path)])
    runner = Runner()
    rows, errors = run.run_scaling(args, runner)
    round_jobs = [("vllm", None, "3"), ("vllm", "inline linear", "3"),
                  ("vllm", "inline linear", "all")]
    one_engine = [("vllm_paired", "inline linear", "3"), ("vllm_paired", "inline linear", "all")]
    assert runner.jobs == round_jobs + one_engine + round_jobs[::-1] + one_engine
    assert {row["mode"] for row in rows} == {scaling.VLLM_PLAIN, "inline linear",
                                             scaling.ONE_ENGINE}
    assert len(errors) == 10

    alone = run.parse_args(["--scaling-only", "--vllm", "--no-scaling-hf", "--vllm-modes",
                            "inline linear", "--no-vllm-one-engine", "--out", str(tmp_path)])
    runner = Runner()
    run.run_scaling(alone, runner)
    assert runner.jobs == round_jobs

    every = run.parse_args(["--scaling-only", "--vllm", "--out", str(tmp_path)])
    runner = Runner()
    run.run_scaling(every, runner)
    assert runner.jobs[0] == ("scaling", None, None)
    assert {mode for kind, mode, _ in runner.jobs if kind == "vllm"} == {None, *scaling.MODES}


def test_one_engine_vllm_rows_pool_every_process_s_pairs_and_give_the_target_its_verdict():
    """``benchmarks.vllm_paired``'s pairs (plain and probed on one engine): the row's
    ratio is over every pair of every process, ``per_round`` keeps each process's
    median, a failed process adds nothing, and the target reads the pooled interval."""
    def pairs(ratios):
        return [{"plain_s": 1.0, "default_plain_s": 1.1 * r, "probed_s": r, "records": 100,
                 "first": ("plain", "lean", "probed")[i % 3]} for i, r in enumerate(ratios)]

    outcomes = {"all": [{"ok": True, "result": {"layers": [0, 1], "pairs": pairs([1.02] * 9)}},
                        {"ok": False, "error": "Traceback\nRuntimeError: engine died"},
                        {"ok": True, "result": {"layers": [0, 1], "pairs": pairs([1.04] * 9)}}],
                "3": [{"ok": False, "error": "Traceback\nRuntimeError: engine died"}]}
    rows = {r["layer_set"]: r for r in scaling.one_engine_rows("tiny", 64, outcomes, 24)}
    every = rows["all"]
    assert every["status"] == "ok" and every["repeats"] == 18
    assert every["ratio_plain"]["median"] == pytest.approx(1.03)
    assert every["ratio_plain_processes"]["per_round"] == pytest.approx([1.02, 1.04])
    assert every["ratio_default_plain"]["median"] == pytest.approx(1 / 1.1)
    assert every["us_per_vector"]["median"] == pytest.approx(0.03 / 100 * 1e6)
    assert rows["3"] == {**rows["3"], "status": "error", "reason": "RuntimeError: engine died"}
    checks = {c["target"]: c for c in scaling.evaluate(list(rows.values()))
              if "one engine" in c["target"]}
    assert len(checks) == 1  # the failed layer set has no row to judge
    (check,) = checks.values()
    assert check["verdict"] == "met" and check["ci_high"] == pytest.approx(1.04)
    assert "| all | 64 | inline linear, one engine | 100 |" in "\n".join(scaling.table(
        list(rows.values())))


def test_a_vllm_job_refuses_a_generation_whose_probe_raised():
    """A probed generation whose probe raised times the probe's failure path, not
    probing: ``probed_records`` raises with the probe's last traceback line; else
    it counts what the probes received (or the records, with ``records=True``)."""
    from types import SimpleNamespace

    from benchmarks.vllm_jobs import probed_records

    def output(errors: int, received: int = 4, records=None):
        stats = SimpleNamespace(errors=errors, received=received)
        metadata = {"traceback": "Traceback\n  ...\nValueError: expects size 128"} if errors else {}
        return SimpleNamespace(request_id="r0", records=records,
                               results={"res": SimpleNamespace(stats=stats, metadata=metadata)})

    assert probed_records([output(0), output(0)], keep=False) == 8
    assert probed_records([output(0, records=[1, 2, 3])], keep=True) == 3
    with pytest.raises(RuntimeError, match="'res' raised on request 'r0': ValueError: expects"):
        probed_records([output(0), output(1)], keep=False)


def test_gpu_check_refuses_an_unknown_step_before_it_starts(tmp_path):
    """``GPU_STEPS`` names the GPU checks' parts; a misspelt one is refused before
    anything runs (a lent machine's minutes are few), naming the known ones."""
    script = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.sh"
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out),
                               "GPU_STEPS": "tests stagez"}, check=False)
    assert done.returncode == 2
    assert "unknown step 'stagez'" in done.stderr
    assert "(tests, syncs, stages, scaling)" in done.stderr
    assert not out.exists()


def test_a_deep_model_is_the_bundled_widths_at_the_depth_asked_for():
    """``deep<N>``: any tool's ``--model`` (and ``--scaling-models``) takes it; the
    model has N decoder layers of the bundled model's widths, so the inline
    linear scenario reads its rows with the bundled probe file itself."""
    import argparse

    from benchmarks.models import load_model, model_key
    from benchmarks.scenarios.probed import BUNDLED_PROBE_WIDTH

    bundle = load_model("deep3")
    assert bundle.num_layers == len(bundle.model.model.layers) == 3
    assert bundle.model.config.hidden_size == BUNDLED_PROBE_WIDTH
    assert bundle.three_layers == (0, 1, 2)
    assert model_key("deep48") == "deep48" and model_key("large") == "large"
    for wrong, said in (("deep0", "1 to 256 layers"), ("deep", "deep<N>"),
                        ("huge", "unknown benchmark model 'huge'")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            model_key(wrong)
    with pytest.raises(ValueError, match="unknown benchmark model"):
        load_model("deep-3")


def test_a_scaling_job_on_a_deep_model_captures_every_layer_like_raw_hooks():
    """A real job on ``deep2``: every probed scenario generates plain's tokens
    and captures as many vectors as raw hooks (one per generated token fed back
    and layer; per point), the guards too (they may abort, and never do)."""
    from benchmarks.worker import scaling_job

    names = ["plain_generate", "raw_forward_hooks", "uc_inline_linear",
             "uc_3_layers_async_trajectory", "uc_inline_linear_guard", "uc_guard_and_observer",
             "uc_sae_features", "uc_inline_trajectory_guard"]
    result = scaling_job("deep2", batch_sizes=[2], layer_sets=["all"], scenarios=names,
                         repeats=1, warmup=0, max_new_tokens=3)
    rows = {row["scenario"]: row for row in scaling.hf_rows(result, max_new_tokens=3)}
    assert {row["status"] for row in rows.values()} == {"ok"}
    assert rows["raw_forward_hooks"]["records"] == 2 * 2 * 2  # rows x tokens fed back x layers
    for name in names[2:]:
        # (each point counts its rows)
        points = 2 if name in ("uc_guard_and_observer", "uc_sae_features") else 1
        assert rows[name]["records"] == points * rows["raw_forward_hooks"]["records"], name
        assert rows[name]["tokens_match"] is True, rows[name]["token_check"]
        assert rows[name]["capture_layers"] == [0, 1]


def test_the_strided_slice_and_prompt_read_scenarios_capture_what_their_positions_say():
    """On ``deep2``, 6 new tokens (generated 0 to 4 fed back), 2 rows, both
    layers: every second token (0, 2, 4), the slice's (2, 3, 4), every token
    plus the last prompt token at the last layer, every token at the first
    layer and every second at the other, and every token beside an edit that
    adds nothing (always on, switched on by a flag that never comes, or by the
    first token's flag, or beside the two strides) or beside edits that end,
    and the last prompt token alone at both layers; each generates plain's
    tokens."""
    from benchmarks.worker import scaling_job

    names = ["plain_generate", "raw_forward_hooks", "uc_inline_linear_stride_2",
             "uc_inline_linear_slice", "uc_inline_linear_and_prompt_read",
             "uc_inline_linear_mixed_strides", "uc_inline_linear_and_edit",
             "uc_inline_linear_and_triggered_edit", "uc_inline_linear_and_switched_edit",
             "uc_inline_linear_mixed_strides_and_edit", "uc_inline_linear_and_ending_edits",
             "uc_inline_linear_prompt_last"]
    result = scaling_job("deep2", batch_sizes=[2], layer_sets=["all"], scenarios=names,
                         repeats=1, warmup=0, max_new_tokens=6)
    rows = {row["scenario"]: row for row in scaling.hf_rows(result, max_new_tokens=6)}
    assert {row["status"] for row in rows.values()} == {"ok"}
    assert rows["raw_forward_hooks"]["records"] == 2 * 5 * 2
    expected = {"uc_inline_linear_stride_2": 2 * 3 * 2, "uc_inline_linear_slice": 2 * 3 * 2,
                "uc_inline_linear_and_prompt_read": 2 * 5 * 2 + 2,
                "uc_inline_linear_mixed_strides": 2 * (5 + 3),
                "uc_inline_linear_and_edit": 2 * 5 * 2,
                "uc_inline_linear_and_triggered_edit": 2 * 5 * 2,
                "uc_inline_linear_and_switched_edit": 2 * 5 * 2,
                "uc_inline_linear_mixed_strides_and_edit": 2 * (5 + 3),
                "uc_inline_linear_and_ending_edits": 2 * 5 * 2,
                "uc_inline_linear_prompt_last": 2 * 2}
    for name, records in expected.items():
        assert rows[name]["records"] == records, name
        assert rows[name]["tokens_match"] is True, rows[name]["token_check"]


def test_the_depth_table_sets_models_of_several_depths_side_by_side():
    def row(model: str, depth: int, scenario: str, ratio: float, us: float | None) -> dict:
        return {"backend": "hf", "model": model, "layer_set": "all", "status": "ok",
                "capture_layers": list(range(depth)), "batch_size": 64,
                "scenario": scenario, "mode": scaling.mode_of(scenario),
                "ratio_plain": {"median": ratio, "min": ratio, "max": ratio},
                "us_per_vector": None if us is None else {"median": us, "min": us, "max": us},
                "model_description": model, "max_new_tokens": 24, "repeats": 1,
                "records": depth}

    rows = [row(model, depth, scenario, ratio, us)
            for model, depth, runs in (
                ("deep48", 48, [("plain_generate", 1.0, None), ("uc_inline_linear", 1.06, 0.3)]),
                ("deep4", 4, [("plain_generate", 1.0, None), ("uc_inline_linear", 1.09, 0.82),
                              ("raw_forward_hooks", 1.03, None)]))
            for scenario, ratio, us in runs]
    lines = scaling.depth_table(rows)
    assert "| batch | scenario | deep4 (4 layers) | deep48 (48 layers) |" in lines
    assert "| 64 | inline linear | 0.82 (1.090x) | 0.30 (1.060x) |" in lines
    assert "| 64 | raw_forward_hooks | — (1.030x) | — |" in lines
    assert not any("plain_generate" in line for line in lines)
    assert scaling.depth_table([r for r in rows if r["model"] == "deep4"]) == []
    assert "Cost against depth" in scaling.summary(
        {"load_average_start": [0.1], "load_average_end": [0.2], "date": "d",
         "git_commit": "c", "cpu_count": 2, "torch_threads": 1}, rows, [], [], "pillow")


def test_the_depth_plot_draws_each_mode_against_the_layers_captured(tmp_path):
    from benchmarks.plot import _depth_series, write_depth_plot

    def row(depth: int, batch: int, mode: str, us: float | None) -> dict:
        return {"backend": "hf", "status": "ok", "layer_set": "all", "batch_size": batch,
                "capture_layers": list(range(depth)), "mode": mode,
                "us_per_vector": None if us is None else {"median": us}}

    rows = [row(48, 64, "inline linear", 0.1), row(4, 64, "inline linear", 1.3),
            row(4, 8, "nnsight", 11.5), row(48, 8, "nnsight", 8.7),
            row(4, 64, "raw_forward_hooks", None)]
    assert _depth_series(rows) == {"batch 64: inline linear": [(4, 1.3), (48, 0.1)],
                                   "batch 8: nnsight": [(4, 11.5), (48, 8.7)]}
    assert write_depth_plot(rows, tmp_path / "depth.png") is not None
    assert (tmp_path / "depth.png").read_bytes()[:8] == PNG_MAGIC
    assert write_depth_plot([r for r in rows if len(r["capture_layers"]) == 4],
                            tmp_path / "one.png") is None
    assert not (tmp_path / "one.png").exists()


def test_the_one_engine_tools_also_take_the_guard_and_the_demo_s_shape(tmp_path):
    """``benchmarks.vllm_paired`` / ``vllm_stage_timers`` modes beyond the scaling
    set's: the guard, the guard with an async observer (two points), the SAE
    spec's guard and reporter (on the bundled width only), points of two
    strides, the probe beside a live edit or edits that end, and the probe on
    the last prompt token alone."""
    import json

    from benchmarks.vllm_jobs import ON_REQUEST_MODES, _probed_setup

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4,
                                                      "hidden_size": 128}))
    assert set(ON_REQUEST_MODES) == {"inline linear guard", "guard and observer",
                                     "sae features", "inline linear and prompt read",
                                     "inline trajectory guard", "inline linear stride 2",
                                     "inline linear slice", "inline linear mixed strides",
                                     "inline linear and edit", "inline linear and triggered edit",
                                     "inline linear and switched edit",
                                     "inline linear and ending edits",
                                     "inline linear prompt last"}
    _, spec, _, _ = _probed_setup(str(tmp_path), "all", "inline linear prompt last")
    assert [(point.layers, str(point.position)) for point in spec.extraction_points] == [
        ((0, 1, 2, 3), "prompt[-1]")]
    layers, spec, _, keep = _probed_setup(str(tmp_path), "all", "guard and observer")
    assert layers == (0, 1, 2, 3) and keep is False
    guard, observer = spec.extraction_points
    assert guard.probe_args["action"] == "abort" and guard.execution_mode.value == "inline"
    assert observer.execution_mode.value == "async"
    assert observer.probe_type == "trajectory_probe"
    _, spec, _, _ = _probed_setup(str(tmp_path), "3", "inline linear guard")
    assert [point.layers for point in spec.extraction_points] == [(0, 2, 3)]
    _, spec, _, _ = _probed_setup(str(tmp_path), "all", "inline linear mixed strides")
    assert [(point.layers, point.stride) for point in spec.extraction_points] == [
        ((0, 1), 1), ((2, 3), 2)]
    _, spec, _, _ = _probed_setup(str(tmp_path), "all", "inline linear and triggered edit")
    (edit,) = spec.edits
    assert edit.when is not None and edit.when.point == "residual" and edit.layers == (2,)
    assert edit.vector == "undercurrent:models/tiny/probe.safetensors"  # (the bundled width)
    _, spec, _, _ = _probed_setup(str(tmp_path), "all", "inline linear and ending edits")
    assert [(edit.name, str(edit.position)) for edit in spec.edits] == [
        ("prompt", "prompt[-1]"), ("slice", "generated[2:12]"), ("once", "generated[16]")]
    _, spec, _, _ = _probed_setup(str(tmp_path), "3", "sae features")
    guard, features = spec.extraction_points
    assert guard.probe_type == features.probe_type == "sae_probe"
    assert guard.probe_args["action"] == "abort" and features.execution_mode.value == "async"
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4,
                                                      "hidden_size": 256}))
    with pytest.raises(ValueError, match="bundled SAE reads activations of 128 values"):
        _probed_setup(str(tmp_path), "3", "sae features")


def test_every_timed_model_carries_one_clock_hook_and_none_is_left_behind():
    """Every scenario times through one clock hook on its model's output head:
    the shared model's and each own copy's, in every layer set of a scaling job
    (a copy made after a clock would carry it too), and releasing removes them."""
    from benchmarks.models import load_model
    from benchmarks.worker import _prepare, _release, layers_for

    bundle = load_model("tiny")
    names = ["plain_generate", "raw_forward_hooks", "uc_inline_linear",
             "uc_3_layers_capture_only"]
    head = bundle.model.get_output_embeddings()
    for layer_set in ("3", "all"):
        ready, skipped = _prepare(names, bundle, layers_for(bundle, layer_set))
        assert sorted(ready) == sorted(names), skipped
        assert len({id(scenario.model) for scenario, _ in ready.values()}) > 1
        for name, (scenario, _clock) in ready.items():
            hooks = scenario.model.get_output_embeddings()._forward_hooks
            assert len(hooks) == 1, (layer_set, name, len(hooks))
        _release(ready)
        assert not head._forward_hooks


def test_a_scenario_whose_timed_runs_change_tokens_is_an_error(monkeypatch):
    """Greedy runs repeat: a scenario's timed runs that generate other tokens than
    its first (warm-up) run make it an error, not "identical to plain"."""
    import benchmarks.worker as worker
    from benchmarks.measure import GenerationRun

    class Clock:
        time_to_first_token = 0.0

        def start(self) -> float:
            return 0.0

    class Scenario:
        model = None

        def __init__(self, drifts: bool) -> None:
            self.drifts, self.calls = drifts, 0

        def generate(self, batch, max_new_tokens):
            self.calls += 1
            return GenerationRun([[9, 9, 9]] if self.drifts and self.calls > 1 else [[1, 2, 3]])

    class Batch:
        size, prompt_length = 1, 4

    monkeypatch.setattr(worker, "synchronize", lambda model: None)
    ready = {"plain_generate": (Scenario(False), Clock()),
             "uc_3_layers_inline_norm": (Scenario(True), Clock())}
    cases = {case["scenario"]: case for case in worker._time_cases(
        ready, {}, list(ready), Batch(), warmup=1, repeats=3, max_new_tokens=3)}
    assert cases["plain_generate"]["status"] == "ok"
    assert len(cases["plain_generate"]["samples"]) == 3
    drifting = cases["uc_3_layers_inline_norm"]
    assert drifting["status"] == "error" and "round 1" in drifting["reason"]
