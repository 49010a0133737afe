"""The scaling set (issue 14): overhead against batch size x captured layers x probe mode.

HF: batch 1/8/32/64, three layers or every layer, and four ways of handling the
capture (inline ``linear_probe`` with the bundled probe file, async
``trajectory_probe``, the same trajectory probe inline, capture only), next to
plain ``generate()``, raw forward
hooks and nnsight capturing the same layers. vLLM: 1/8/64 concurrent requests,
the same specs, against plain eager vLLM. Every number is relative: the ratio to
plain, the ratio to raw hooks, and the extra microseconds per captured vector
over raw hooks (HF) or over plain (vLLM, which has no raw-hook baseline here),
each paired per round like the main table.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.measure import spread
from benchmarks.report import _token_check

BATCH_SIZES = (1, 8, 32, 64)
QUICK_BATCH_SIZES = (2,)
VLLM_CONCURRENCY = (1, 8, 64)
LAYER_SETS = ("3", "all")
PLAIN, RAW = "plain_generate", "raw_forward_hooks"
#: probe mode -> the scenario that runs it (its ``layers`` set per layer set).
MODES = {
    "inline linear": "uc_inline_linear",
    "async trajectory": "uc_3_layers_async_trajectory",
    "capture only": "uc_3_layers_capture_only",
}
#: HF only: the async scenario's probe judged inline, so that async is also
#: compared with inline probe for probe (the machinery alone).
HF_ONLY_MODES = {"inline trajectory": "uc_inline_trajectory"}
SCENARIOS = (PLAIN, RAW, "nnsight", *MODES.values(), *HF_ONLY_MODES.values())
VLLM_PLAIN = "vllm_plain_eager"
#: The scenarios a target compares a probed one with (``ratio_to`` on each HF row).
COMPARED = ("nnsight", MODES["inline linear"], HF_ONLY_MODES["inline trajectory"])
#: The issue's targets at the largest batch (reported, never asserted).
TARGET_BATCH = 64
TARGET_US_PER_VECTOR = 1.0
TARGET_HF_RATIO = 1.05
TARGET_VLLM_RATIO = 1.10


def mode_of(scenario: str) -> str:
    """The table label of a scenario: a probe mode, or the scenario's own name."""
    return next((mode for mode, name in (*MODES.items(), *HF_ONLY_MODES.items())
                 if name == scenario), scenario)


def _paired(samples: list[dict[str, Any]], reference: list[dict[str, Any]] | None,
            value: Any) -> dict[str, float | None] | None:
    """``value(sample, reference sample of the same round)`` over the paired rounds."""
    if not reference:
        return None
    by_round = {s["round"]: s for s in reference}
    return spread([value(s, by_round[s["round"]]) for s in samples if s["round"] in by_round])


def _per_vector_us(sample: dict[str, Any], reference: dict[str, Any]) -> float | None:
    records = sample["records"]
    return (sample["wall_s"] - reference["wall_s"]) / records * 1e6 if records else None


def hf_rows(result: dict[str, Any], max_new_tokens: int) -> list[dict[str, Any]]:
    """One row per (layer set, batch, scenario) of a scaling job, paired per round."""
    cases = {(c["layer_set"], c["batch_size"], c["scenario"]): c for c in result["cases"]}
    rows = []
    for (layer_set, batch, scenario), case in cases.items():
        row: dict[str, Any] = {
            "backend": "hf", "model": result["model"],
            "model_description": result["model_description"], "layer_set": layer_set,
            "capture_layers": case["capture_layers"], "batch_size": batch,
            "concurrency": None, "scenario": scenario, "mode": mode_of(scenario),
            "status": case["status"], "reason": case.get("reason"),
            "max_new_tokens": max_new_tokens,
        }
        if case["status"] == "ok":
            samples = case["samples"]
            plain = cases.get((layer_set, batch, PLAIN), {})
            raw = cases.get((layer_set, batch, RAW), {})
            row.update(
                repeats=len(samples),
                records=samples[0]["records"] if samples else 0,
                wall_s=spread([s["wall_s"] for s in samples]),
                ratio_plain=_paired(samples, plain.get("samples"),
                                    lambda s, b: s["wall_s"] / b["wall_s"]),
                cpu_ratio_plain=_paired(samples, plain.get("samples"),
                                        lambda s, b: s["cpu_s"] / b["cpu_s"]),
                ratio_raw=_paired(samples, raw.get("samples"),
                                  lambda s, b: s["wall_s"] / b["wall_s"]),
                us_per_vector=None if scenario in (PLAIN, RAW)
                else _paired(samples, raw.get("samples"), _per_vector_us),
                # Against the scenarios a target compares with, paired per round
                # (a ratio of two medians would have no interval).
                ratio_to={reference: _paired(samples, other["samples"],
                                             lambda s, b: s["wall_s"] / b["wall_s"])
                          for reference in COMPARED if reference != scenario
                          for other in [cases.get((layer_set, batch, reference), {})]
                          if other.get("status") == "ok"},
                notes=samples[-1]["notes"] if samples else {},
            )
            row["tokens_match"], row["token_check"] = _token_check(
                case.get("token_ids"), plain.get("token_ids"))
        rows.append(row)
    return rows


def pooled_rounds(rounds: list[dict[tuple[str, str], dict[str, Any]]]
                  ) -> dict[tuple[str, str], dict[str, Any]]:
    """The vLLM jobs' outcomes of several rounds (each round every job once, each
    in a process of its own) as one outcome per job: per concurrency, every
    round's samples, each marked with its round and repeat, so that a probed
    sample is paired with the plain sample of the same round and repeat (a job
    that failed in a round adds nothing; the first failure stands when it
    failed in every round)."""
    pooled: dict[tuple[str, str], dict[str, Any]] = {}
    for number, outcomes in enumerate(rounds):
        for key, outcome in outcomes.items():
            if not outcome.get("ok"):
                pooled.setdefault(key, outcome)
                continue
            result = outcome["result"]
            marked = [{**case, "samples": [{**sample, "round": (number, index)}
                                           for index, sample in enumerate(case["samples"])]}
                      for case in result["cases"]]
            kept = pooled.get(key)
            if kept is None or not kept.get("ok"):
                pooled[key] = {**outcome, "result": {**result, "cases": marked}}
                continue
            cases = {case["concurrency"]: case for case in kept["result"]["cases"]}
            for case in marked:
                if case["concurrency"] in cases:
                    cases[case["concurrency"]]["samples"] += case["samples"]
                else:
                    kept["result"]["cases"].append(case)
    return pooled


def vllm_rows(model: str, outcomes: dict[tuple[str, str], dict[str, Any]],
              max_new_tokens: int) -> list[dict[str, Any]]:
    """Rows for the vLLM scaling jobs; ``outcomes`` maps (mode, layer set) -> job outcome,
    with the plain engine under (``VLLM_PLAIN``, ``"-"``)."""
    plain_outcome = outcomes.get((VLLM_PLAIN, "-"), {})
    plain = ({c["concurrency"]: c for c in plain_outcome["result"]["cases"]}
             if plain_outcome.get("ok") else {})
    rows = []
    for (mode, layer_set), outcome in outcomes.items():
        base_row: dict[str, Any] = {
            "backend": "vllm", "model": model, "layer_set": layer_set, "mode": mode,
            "scenario": VLLM_PLAIN if mode == VLLM_PLAIN else f"vllm {mode}",
            "max_new_tokens": max_new_tokens,
        }
        if not outcome.get("ok"):
            error = outcome.get("error", "").strip().splitlines()[-1:] or ["failed"]
            rows.append({**base_row, "status": "error", "reason": error[0],
                         "batch_size": None, "concurrency": None})
            continue
        for case in outcome["result"]["cases"]:
            concurrency = case["concurrency"]
            samples = [{"round": i, **s} for i, s in enumerate(case["samples"])]
            base = plain.get(concurrency)
            reference = ([{"round": i, **s} for i, s in enumerate(base["samples"])]
                         if base else None)
            row = {**base_row, "status": "ok", "reason": None, "batch_size": concurrency,
                   "concurrency": concurrency, "capture_layers": outcome["result"].get("layers"),
                   "repeats": len(samples), "records": samples[0]["records"],
                   "wall_s": spread([s["wall_s"] for s in samples])}
            if mode != VLLM_PLAIN:
                row["ratio_plain"] = _paired(samples, reference,
                                             lambda s, b: s["wall_s"] / b["wall_s"])
                row["cpu_ratio_plain"] = _paired(samples, reference,
                                                 lambda s, b: s["cpu_s"] / b["cpu_s"])
                row["us_per_vector"] = _paired(samples, reference, _per_vector_us)
                row["ratio_plain_processes"] = _per_process(samples, reference)
                row["tokens_match"], row["token_check"] = _token_check(
                    case["token_ids"], base["token_ids"] if base else None)
            rows.append(row)
    return rows


#: The mode label of the one-engine vLLM rows (``benchmarks.vllm_paired``).
ONE_ENGINE = "inline linear, one engine"


def one_engine_rows(model: str, concurrency: int, outcomes: dict[str, list[dict[str, Any]]],
                    max_new_tokens: int) -> list[dict[str, Any]]:
    """Rows for the one-engine vLLM jobs (:func:`benchmarks.vllm_paired.paired_job`):
    per layer set, the pairs of every round's process pooled. Within a process
    plain and probed generations alternate on one engine, so a pair's ratio
    carries no difference between engines; ``ratio_plain_processes`` keeps each
    process's median (``per_round``) to show how far processes differ.
    ``ratio_plain`` is over plain with undercurrent's output handling,
    ``ratio_default_plain`` over plain with vLLM's defaults."""
    rows = []
    for layer_set, results in outcomes.items():
        base_row: dict[str, Any] = {
            "backend": "vllm", "model": model, "layer_set": layer_set, "mode": ONE_ENGINE,
            "scenario": f"vllm {ONE_ENGINE}", "max_new_tokens": max_new_tokens,
            "batch_size": concurrency, "concurrency": concurrency,
        }
        done = [result["result"] for result in results if result.get("ok")]
        if not done:
            failed = next(iter(results), {"error": "not run"})
            error = (failed.get("error") or "").strip().splitlines()[-1:] or ["failed"]
            rows.append({**base_row, "status": "error", "reason": error[0]})
            continue
        pairs = [pair for result in done for pair in result["pairs"]]
        per_round = [statistics.median(p["probed_s"] / p["plain_s"] for p in result["pairs"])
                     for result in done]
        rows.append({
            **base_row, "status": "ok", "reason": None, "capture_layers": done[0]["layers"],
            "repeats": len(pairs), "records": pairs[0]["records"],
            "wall_s": spread([p["probed_s"] for p in pairs]),
            "ratio_plain": spread([p["probed_s"] / p["plain_s"] for p in pairs]),
            "ratio_default_plain": spread([p["probed_s"] / p["default_plain_s"]
                                           for p in pairs if "default_plain_s" in p]),
            "us_per_vector": spread([(p["probed_s"] - p["plain_s"]) / p["records"] * 1e6
                                     for p in pairs if p["records"]]),
            "ratio_plain_processes": {**spread(per_round), "per_round": per_round},
            "tokens_match": True,
            "token_check": "identical to plain on the same engine (checked every repeat)",
        })
    return rows


def _per_process(samples: list[dict[str, Any]], reference: list[dict[str, Any]] | None
                 ) -> dict[str, float | None] | None:
    """The ratio to plain per process pair: the median of each round's paired
    ratios, one value per round (``round`` is (round, repeat) once pooled). A
    round's repeats share their two processes, whose speeds differ by a few
    percent, so they are not independent draws: the target's interval is taken
    over the rounds instead (3 rounds: their min and max, which cover 75%).
    ``per_round`` keeps each round's value, in round order (which engine ran
    first alternates from round to round)."""
    if not reference:
        return None
    by_round = {s["round"]: s for s in reference}
    rounds: dict[Any, list[float]] = {}
    for sample in samples:
        base = by_round.get(sample["round"])
        if base is not None:
            key = sample["round"][0] if isinstance(sample["round"], (tuple, list)) else 0
            rounds.setdefault(key, []).append(sample["wall_s"] / base["wall_s"])
    medians = {key: statistics.median(ratios) for key, ratios in sorted(rounds.items())}
    return {**spread(list(medians.values())), "per_round": list(medians.values())}


def _median(stat: dict[str, Any] | None) -> float | None:
    return None if not stat else stat.get("median")


def _cell(stat: dict[str, Any] | None, digits: int = 2) -> str:
    if not stat or stat.get("median") is None:
        return "—"
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: one table per backend and model, sorted by layer set, batch and
    scenario."""
    lines: list[str] = []
    order = {name: index for index, name in enumerate(SCENARIOS)}
    groups = [(backend, size, model) for backend, size in (("hf", "batch"), ("vllm", "concurrent"))
              for model in dict.fromkeys(r.get("model") for r in rows)]
    for backend, size, model in groups:
        members = [r for r in rows if r["backend"] == backend and r.get("model") == model]
        if not members:
            continue
        first = next((r for r in members if r["status"] == "ok"), members[0])
        over = "raw hooks" if backend == "hf" else "plain"
        lines += [
            f"#### {backend}: {first.get('model_description', first['model'])}, "
            f"{first['max_new_tokens']} new tokens, "
            f"medians of {first.get('repeats', '—')} paired repeats (min–max)",
            "",
            f"| layers | {size} | scenario | vectors | × plain | × raw hooks "
            f"| extra µs per vector over {over} | CPU × plain | tokens match |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        members.sort(key=lambda r: (r["layer_set"], r["batch_size"] or 0,
                                    order.get(r["scenario"], len(order)), r["scenario"]))
        for row in members:
            label = row["mode"]
            if row["status"] != "ok":
                reason = row["reason"] or row["status"]
                lines.append(f"| {row['layer_set']} | {row['batch_size'] or '—'} | {label} "
                             f"| {reason} | | | | | |")
                continue
            match = {True: "yes", False: "**NO**", None: "—"}[row.get("tokens_match")]
            lines.append(
                f"| {row['layer_set']} | {row['batch_size']} | {label} | {row['records']} "
                f"| {_cell(row.get('ratio_plain'), 3)} | {_cell(row.get('ratio_raw'), 3)} "
                f"| {_cell(row.get('us_per_vector'), 1)} "
                f"| {_cell(row.get('cpu_ratio_plain'), 3)} | {match} |"
            )
        lines.append("")
    return lines


def depth_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the HF rows with every layer captured, one column per model
    in order of depth, where the rows hold models of several depths (``--scaling-models
    deep12 deep24 deep48``); else none. A cell is the extra µs per captured vector
    over raw hooks and, in brackets, the ratio to plain ``generate()`` (medians)."""
    members = [r for r in rows if r["backend"] == "hf" and r["layer_set"] == "all"
               and r["status"] == "ok"]
    depths = {r["model"]: len(r["capture_layers"]) for r in members}
    if len(set(depths.values())) < 2:
        return []
    models = sorted(depths, key=lambda model: (depths[model], model))
    order = {name: index for index, name in enumerate(SCENARIOS)}
    cells = {(r["model"], r["batch_size"], r["scenario"]): r for r in members}
    lines = [
        "#### Cost against depth (HF, every layer captured)",
        "",
        "Extra µs per captured vector over raw hooks (x plain `generate()`), medians of "
        "the paired repeats.",
        "",
        "| batch | scenario | " + " | ".join(f"{model} ({depths[model]} layers)"
                                            for model in models) + " |",
        "|---|---|" + "---|" * len(models),
    ]
    for batch in sorted({r["batch_size"] for r in members}):
        scenarios = sorted({r["scenario"] for r in members if r["batch_size"] == batch}
                           - {PLAIN}, key=lambda name: order.get(name, len(order)))
        for scenario in scenarios:
            row_cells = []
            for model in models:
                row = cells.get((model, batch, scenario))
                us, ratio = (_median((row or {}).get("us_per_vector")),
                             _median((row or {}).get("ratio_plain")))
                row_cells.append("—" if ratio is None else
                                 f"{us:.2f} ({ratio:.3f}x)" if us is not None else
                                 f"— ({ratio:.3f}x)")
            lines.append(f"| {batch} | {mode_of(scenario)} | " + " | ".join(row_cells) + " |")
    return [*lines, ""]


def evaluate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's scaling targets on the measured rows: met, missed, or not measured
    (per model, each target named with its model, when the rows hold several)."""
    models = list(dict.fromkeys(r.get("model") for r in rows))
    if len(models) > 1:
        return [{**check, "target": f"{model}: {check['target']}"} for model in models
                for check in evaluate([r for r in rows if r.get("model") == model])]
    def find(backend: str, layer_set: str, batch: int, mode: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["backend"] == backend and r["status"] == "ok"
                     and r["layer_set"] == layer_set and r["batch_size"] == batch
                     and r["mode"] == mode), None)

    checks = []

    def add(target: str, stat: dict[str, Any] | None, limit: float, unit: str) -> None:
        checks.append(_check(target, stat, limit, unit))

    def against(row: dict[str, Any] | None, mode: str) -> dict[str, Any] | None:
        """``row``'s wall time over ``mode`` 's, paired per round; where the rows
        carry no pairs (older results), the ratio of their medians to plain."""
        if row is None:
            return None
        paired = (row.get("ratio_to") or {}).get(MODES.get(mode, HF_ONLY_MODES.get(mode, mode)))
        if paired is not None:
            return paired
        ours = _median(row.get("ratio_plain"))
        theirs = _median((find("hf", row["layer_set"], row["batch_size"], mode) or {})
                         .get("ratio_plain"))
        return {"median": ours / theirs} if ours and theirs else None

    inline = find("hf", "all", TARGET_BATCH, "inline linear")
    add(f"HF batch {TARGET_BATCH}, all layers, inline linear: extra cost per captured "
        f"vector over raw hooks <= {TARGET_US_PER_VECTOR:g} µs",
        (inline or {}).get("us_per_vector"), TARGET_US_PER_VECTOR, " µs")
    add(f"HF batch {TARGET_BATCH}, all layers, inline linear: <= {TARGET_HF_RATIO}x plain "
        "generate()", (inline or {}).get("ratio_plain"), TARGET_HF_RATIO, "x")
    add(f"HF batch {TARGET_BATCH}, all layers: inline linear no slower than nnsight's "
        "capture alone", against(inline, "nnsight"), 1.0, "x nnsight")
    for layer_set in LAYER_SETS:
        for batch in sorted({r["batch_size"] for r in rows if r["backend"] == "hf"}):
            asynchronous = find("hf", layer_set, batch, "async trajectory")
            for inline_mode, what in (("inline linear", "inline"),
                                      ("inline trajectory", "the same probe inline")):
                ratio = against(asynchronous, inline_mode)
                if ratio is not None:
                    add(f"HF batch {batch}, {layer_set} layers: async no more expensive than "
                        f"{what}", ratio, 1.0, f"x {inline_mode}")
    for layer_set in LAYER_SETS:
        probed = find("vllm", layer_set, TARGET_BATCH, "inline linear") or {}
        add(f"vLLM {TARGET_BATCH} concurrent, {layer_set} layers, inline linear: "
            f"<= {TARGET_VLLM_RATIO}x plain eager vLLM (per process pair)",
            probed.get("ratio_plain_processes") or probed.get("ratio_plain"),
            TARGET_VLLM_RATIO, "x")
        one = find("vllm", layer_set, TARGET_BATCH, ONE_ENGINE)
        if one is not None:
            add(f"vLLM {TARGET_BATCH} concurrent, {layer_set} layers, inline linear: "
                f"<= {TARGET_VLLM_RATIO}x plain eager vLLM (one engine, plain and probed "
                "alternating)", one.get("ratio_plain"), TARGET_VLLM_RATIO, "x")
    return checks


#: How a target's verdict reads in the targets table.
VERDICTS = {"met": "yes", "missed": "**no (miss)**",
            "unsettled": "**not shown** (the interval holds the limit)",
            "too few": "**not shown** (too few repeats for an interval)",
            "not measured": "not measured"}

#: The least coverage of an interval that judges a target: 3 repeats (min-max,
#: 75%). One repeat's "interval" is a point (0%) and two cover 50%: their median
#: alone would call a target met or missed that the repeats' spread straddles.
MIN_VERDICT_COVERAGE = 0.75


def _check(target: str, stat: dict[str, Any] | None, limit: float, unit: str
           ) -> dict[str, Any]:
    """One target's check from the median (and, where the repeats give one, the
    median's confidence interval) of a measure that must not exceed ``limit``:
    met when the whole interval is at or below it, missed when the whole
    interval is above it, unsettled when the interval holds the limit (this run
    cannot tell; it is not reported as met). An interval covering less than
    ``MIN_VERDICT_COVERAGE`` (fewer than 3 repeats) judges nothing: "too few".
    Without an interval, the median alone decides."""
    value = _median(stat)
    low, high = (stat or {}).get("ci_low"), (stat or {}).get("ci_high")
    digits = 2 if unit.strip() == "µs" else 3
    if value is None:
        verdict, measured = "not measured", "not measured"
    elif low is None or high is None:
        verdict = "met" if value <= limit else "missed"
        measured = f"{value:.{digits}f}{unit}"
    else:
        verdict = ("too few" if (stat or {}).get("ci_level", 1.0) < MIN_VERDICT_COVERAGE
                   else "met" if high <= limit else "missed" if low > limit
                   else "unsettled")
        measured = (f"{value:.{digits}f}{unit} ({(stat or {})['ci_level']:.0%} interval "
                    f"{low:.{digits}f}–{high:.{digits}f})")
    return {"target": target, "value": value, "limit": limit, "verdict": verdict,
            "met": None if value is None else verdict == "met",
            "ci_low": low, "ci_high": high, "measured": measured}


def targets_table(checks: list[dict[str, Any]]) -> list[str]:
    """Markdown lines for the scaling targets."""
    lines = ["| target | measured: median (confidence interval of the median) | met |",
             "|---|---|---|"]
    for check in checks:
        verdict = check.get("verdict") or {True: "met", False: "missed",
                                           None: "not measured"}[check["met"]]
        lines.append(f"| {check['target']} | {check['measured']} | {VERDICTS[verdict]} |")
    return lines


def _device_line(environment: dict[str, Any]) -> list[str]:
    """A line naming the accelerator, versions and dtype of a run off the CPU."""
    if environment.get("device", "cpu") == "cpu":
        return []
    versions = ", ".join(f"{k} {v}" for k, v in environment.get("versions", {}).items())
    gpus = "; ".join(environment.get("gpus") or ["no GPU listed by nvidia-smi"])
    return [f"- Device: {environment['device']} ({gpus}), model dtype "
            f"{environment.get('dtype', 'float32')}; Python {environment.get('python')}, "
            f"{versions}"]


def summary(environment: dict[str, Any], rows: list[dict[str, Any]],
            checks: list[dict[str, Any]], errors: list[str], plot_renderer: str) -> str:
    """The scaling section's markdown (machine line, tables, targets, job errors)."""
    loads = (*environment["load_average_start"][:1], *environment["load_average_end"][:1])
    lines = [
        f"- Run: {environment['date']}, commit {environment['git_commit']}, "
        f"{environment['cpu_count']} cores, 1-minute load average {loads[0]:.1f} at the "
        f"start and {loads[-1]:.1f} at the end; torch threads per job: "
        f"{environment['torch_threads']}; plot: scaling.png ({plot_renderer})",
        *_device_line(environment),
        "",
        *table(rows),
        *depth_table(rows),
        "#### Scaling targets (reported, not asserted)",
        "",
        *targets_table(checks),
        "",
    ]
    if errors:
        lines += ["#### Job errors", "", *(f"- {e.strip().splitlines()[-1]}" for e in errors), ""]
    return "\n".join(lines)
