"""Turn raw job results into ``results.jsonl``, ``summary.md`` and the overhead plot."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.measure import spread
from benchmarks.scenarios import BASELINE, scenario_by_name


def _token_check(token_ids: list[list[int]] | None,
                 reference: list[list[int]] | None) -> tuple[bool | None, str]:
    if token_ids is None or reference is None:
        return None, "no tokens to compare"
    if len(token_ids) != len(reference):
        return False, f"{len(token_ids)} outputs, baseline has {len(reference)}"
    for row, (got, want) in enumerate(zip(token_ids, reference, strict=True)):
        if got != want:
            position = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                            min(len(got), len(want)))
            return False, (f"prompt {row} differs at generated token {position} "
                           f"(lengths {len(got)} vs {len(want)})")
    return True, "identical to plain generate()"


def timing_rows(timing: dict[str, Any], max_new_tokens: int) -> list[dict[str, Any]]:
    """One row per (batch size, scenario) of a model's timing job, baseline-relative."""
    rows = []
    baselines = {case["batch_size"]: case for case in timing["cases"]
                 if case["scenario"] == BASELINE and case["status"] == "ok"}
    for case in timing["cases"]:
        scenario = scenario_by_name(case["scenario"])
        row: dict[str, Any] = {
            "backend": "hf",
            "model": timing["model"],
            "model_description": timing["model_description"],
            "batch_size": case["batch_size"],
            "concurrency": None,
            "scenario": case["scenario"],
            "family": scenario.family,
            "captures": scenario.captures,
            "limits": scenario.limits,
            "status": case["status"],
            "reason": case.get("reason"),
            "max_new_tokens": max_new_tokens,
            "prompt_length": case["prompt_length"],
            "layers": timing["layers"],
        }
        if case["status"] == "ok":
            row.update(aggregate(case["samples"]))
            base = baselines.get(case["batch_size"])
            if base is not None:
                row["overhead_ratio"] = _paired_ratio(case["samples"], base["samples"], "wall_s")
                row["cpu_overhead_ratio"] = _paired_ratio(case["samples"], base["samples"],
                                                          "cpu_s")
                row["tokens_match"], row["token_check"] = _token_check(
                    case["token_ids"], base["token_ids"])
        rows.append(row)
    return rows


def _paired_ratio(samples: list[dict[str, Any]], baseline: list[dict[str, Any]],
                  key: str) -> dict[str, float | None]:
    """Per-round ratio to the baseline's sample of the same round, summarised."""
    by_round = {s["round"]: s[key] for s in baseline}
    return spread([s[key] / by_round[s["round"]] for s in samples
                   if by_round.get(s["round"])])


def aggregate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and spread of one case's repeats."""
    walls = [s["wall_s"] for s in samples]
    records = samples[0]["records"] if samples else 0
    notes = samples[-1]["notes"] if samples else {}
    return {
        "repeats": len(samples),
        "wall_s": spread(walls),
        "cpu_s": spread([s["cpu_s"] for s in samples]),
        "ttft_s": spread([s["ttft_s"] for s in samples]),
        "tokens_per_s": spread([s["new_tokens"] / s["wall_s"] for s in samples]),
        "new_tokens": samples[0]["new_tokens"] if samples else 0,
        "records": records,
        "records_per_s": spread([records / w for w in walls]) if records else None,
        "captured_mb": (samples[0]["captured_bytes"] / 2**20) if samples else 0.0,
        "notes": notes,
        "raw_wall_s": walls,
    }


def attach_memory(rows: list[dict[str, Any]], memory: dict[tuple[str, int, str], Any]) -> None:
    """Add each row's fresh-process memory figures (and their own token check)."""
    baseline_tokens = {
        (model, batch): result["result"].get("token_ids")
        for (model, batch, name), result in memory.items()
        if name == BASELINE and result.get("ok")
    }
    for row in rows:
        key = (row["model"], row["batch_size"], row["scenario"])
        if key not in memory:
            continue
        outcome = memory[key]
        if not outcome.get("ok"):
            row["memory_error"] = outcome.get("error", "").strip().splitlines()[-1:]
            continue
        result = outcome["result"]
        if result.get("status") != "ok":
            continue
        row["peak_rss_mb"] = result["peak_rss_mb"]
        row["rss_growth_mb"] = result["rss_growth_mb"]
        match, _ = _token_check(result["token_ids"],
                                baseline_tokens.get((row["model"], row["batch_size"])))
        row["memory_run_tokens_match"] = match


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _stat(stat: dict[str, Any] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not stat or stat.get("median") is None:
        return "—"
    median = stat["median"] * scale
    return f"{median:.{digits}f} ±{_fmt(stat.get('spread_pct'), 0)}%"


def _ratio(stat: dict[str, Any] | None) -> str:
    if not stat or stat.get("median") is None:
        return "—"
    return f"{stat['median']:.3f} ({stat['min']:.3f}–{stat['max']:.3f})"


def _match(row: dict[str, Any]) -> str:
    """The timing job's token check, and the memory job's where it disagrees."""
    if row.get("memory_run_tokens_match") is False:
        return "**NO**" if row.get("tokens_match") is False else "**NO** (memory job)"
    return {True: "yes", False: "**NO**", None: "—"}[row.get("tokens_match")]


def results_table(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Markdown lines: one table per (backend, model, batch size / concurrency)."""
    lines: list[str] = []
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["backend"], row["model"], row["batch_size"], row["concurrency"])
        groups.setdefault(key, []).append(row)
    for (backend, _model, batch, concurrency), members in groups.items():
        measured = [m for m in members if m["status"] == "ok"]
        first = measured[0] if measured else members[0]
        layers = next((m["layers"] for m in members if m.get("layers")), None)
        how = "interleaved repeats" if backend == "hf" else "repeats (one process per scenario)"
        size = f"batch {batch}" if concurrency is None else f"{concurrency} concurrent requests"
        lines += [
            f"### {backend}: {first['model_description']}, {size}",
            "",
            f"{first['max_new_tokens']} new tokens per prompt, prompt {first['prompt_length']} "
            f"tokens, capture layers {layers}. Medians of "
            f"{first.get('repeats', '—')} {how}, ±spread = (max−min)/median.",
            "",
            "| scenario | tokens/s | wall s | TTFT ms | records/s | overhead × plain "
            "(min–max) | CPU-time × plain | peak RSS MB | RSS growth MB | captured MB "
            "| tokens match |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in members:
            if row["status"] != "ok":
                lines.append(f"| {row['scenario']} | {row['status']}: {row['reason']} "
                             "| | | | | | | | | |")
                continue
            lines.append(
                f"| {row['scenario']} | {_stat(row['tokens_per_s'], digits=1)} "
                f"| {_stat(row['wall_s'], digits=3)} | {_stat(row['ttft_s'], 1000, 1)} "
                f"| {_stat(row.get('records_per_s'), digits=0)} "
                f"| {_ratio(row.get('overhead_ratio'))} "
                f"| {_ratio(row.get('cpu_overhead_ratio'))} | {_fmt(row.get('peak_rss_mb'), 0)} "
                f"| {_fmt(row.get('rss_growth_mb'), 1)} | {_fmt(row.get('captured_mb'), 2)} "
                f"| {_match(row)} |"
            )
        lines.append("")
    return lines


def capture_table(rows: Iterable[dict[str, Any]]) -> list[str]:
    """What each scenario captured and what it could not."""
    lines = ["| scenario | captured | could not / caveats |", "|---|---|---|"]
    seen = set()
    for row in rows:
        if row["scenario"] in seen or row["backend"] != "hf":
            continue
        seen.add(row["scenario"])
        lines.append(f"| {row['scenario']} | {row['captures']} | {row['limits'] or '—'} |")
    return lines


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line."""
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
