"""``undercurrent inspect-model`` and ``undercurrent run`` on a saved tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent.cli import check_output_file, main  # noqa: E402
from undercurrent.spec import load_yaml_file  # noqa: E402

SPEC_FILE = Path(__file__).resolve().parents[2] / "specs" / "classic_single_token.yaml"
NORM_SPEC = """\
extraction_points:
  - {name: first, layers: [1], tensor_type: residual_stream, position: "generated[*]",
     probe_type: norm_probe, probe_kind: trajectory}
  - {name: second, layers: [1], tensor_type: mlp_out, position: "prompt[-1]",
     probe_type: norm_probe, probe_kind: single_shot}
"""


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama").save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def test_inspect_model_json_lists_tensor_types_per_layer(saved_model, capsys):
    assert main(["inspect-model", str(saved_model), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_type"] == "llama" and report["num_layers"] == 3
    hf = report["backends"]["hf"]["tensor_types"]
    assert hf["residual_stream"] == [0, 1, 2] and hf["final_norm"] == [3]
    assert set(hf) == {"residual_stream", "attn_out", "mlp_out", "kv", "final_norm"}


def test_inspect_model_text_and_starter_spec(saved_model, tmp_path, capsys):
    spec_path = tmp_path / "starter.yaml"
    assert main(["inspect-model", str(saved_model), "--emit-spec", str(spec_path)]) == 0
    out = capsys.readouterr().out
    assert "3 decoder layers" in out and "final_norm" in out and "layers 0..2" in out
    spec = load_yaml_file(spec_path)
    assert len(spec) == 2 and all(point.layers == (1,) for point in spec)


def test_inspect_model_on_a_missing_path_fails_clearly(tmp_path, capsys, monkeypatch):
    assert main(["inspect-model", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "cannot read" in err and "does not exist; pass a directory" in err, err
    # A relative owner/name whose owner is a local directory is a path, not a
    # hub id to look up (no network, no retries): the same clear refusal.
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    for command in (["inspect-model", "models/nope"],
                    ["run", str(SPEC_FILE), "--model", "models/nope", "--prompt", "w1"]):
        assert main(command) == 1
        assert "model path 'models/nope' does not exist" in _one_line_error(capsys)


def test_a_model_path_that_is_a_file_fails_clearly(saved_model, capsys):
    """run --model <config.json> died with a traceback (torch's UnpicklingError)."""
    config = saved_model / "config.json"
    for command in (["inspect-model", str(config)],
                    ["run", str(SPEC_FILE), "--model", str(config), "--prompt", "w1"]):
        assert main(command) == 1
        line = _one_line_error(capsys)
        assert f"model path {str(config)!r} is a file, not a directory" in line, line


def test_run_prints_text_and_verdicts_and_saves_records(saved_model, tmp_path, capsys):
    spec_path = tmp_path / "spec.yaml"
    assert main(["inspect-model", str(saved_model), "--emit-spec", str(spec_path)]) == 0
    capsys.readouterr()
    records = tmp_path / "records.parquet"
    code = main(["run", str(spec_path), "--model", str(saved_model), "--prompt", prompt(1, 2, 3),
                 "--prompt", prompt(4), "--max-new-tokens", "4", "--records", str(records),
                 "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summaries = json.loads(captured.out)
    assert len(summaries) == 2
    assert set(summaries[0]["verdicts"]) == {"last_prompt_token_norm",
                                             "generation_norm_trajectory"}
    assert records.exists() and "records saved" in captured.err
    pandas = pytest.importorskip("pandas")
    frame = pandas.read_parquet(records)
    assert len(frame) == 2 * (1 + 3)  # per prompt: prompt[-1] + 3 fed generated tokens


def test_a_model_directory_without_a_tokenizer_is_named_with_the_fix(tmp_path, capsys):
    bare = tmp_path / "bare"
    build_model("llama").save_pretrained(bare)  # weights and config, no tokenizer
    capsys.readouterr()  # (transformers' own progress bar)
    assert main(["run", str(SPEC_FILE), "--model", str(bare), "--prompt", "w1"]) == 1
    line = _one_line_error(capsys)
    assert f"model path '{bare}' has no tokenizer transformers can load" in line, line
    assert "tokenizer.save_pretrained(path)" in line


PROBES = """\
import numpy as np
from undercurrent.probes import Probe, register_probe
from undercurrent.records import ProbeSignal
from undercurrent.spec import ProbeKind

class Odd(Probe):
    probe_kind = ProbeKind.TRAJECTORY
    def __init__(self, *, fail: bool = False):
        self.fail = fail
    def on_start(self, ctx):
        if self.fail:
            raise RuntimeError("boom at start")
    def on_activation(self, record):
        return ProbeSignal("continue", score=0.5)
    def on_end(self, ctx):
        return {"np": np.float32(0.5), "arr": np.arange(3), "nan": float("nan"),
                "inf": -float("inf"), "pair": (1, 2)}

register_probe("odd_verdicts", Odd)
"""


def test_run_json_is_strict_json_with_plain_values_and_each_probe_error(saved_model, tmp_path,
                                                                        capsys):
    # NaN/inf have no JSON spelling (null), numpy values are numbers and lists,
    # and a point whose probe raised says so, as the text format does.
    (tmp_path / "odd_probes.py").write_text(PROBES)
    spec = tmp_path / "odd.yaml"
    spec.write_text("extraction_points:\n" + "".join(
        f"  - {{name: {name}, layers: [1], tensor_type: residual_stream, position: "
        f"'generated[*]', probe_type: odd_verdicts, probe_kind: trajectory, "
        f"probe_args: {{fail: {fail}}}}}\n" for name, fail in (("ok", "false"),
                                                                  ("broken", "true"))))
    code = main(["run", str(spec), "--model", str(saved_model), "--probes",
                 str(tmp_path / "odd_probes.py"), "--prompt", prompt(1, 2),
                 "--max-new-tokens", "3", "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    (summary,) = json.loads(captured.out, parse_constant=refuse)
    assert summary["verdicts"]["ok"] == {"np": 0.5, "arr": [0, 1, 2], "nan": None,
                                         "inf": None, "pair": [1, 2]}
    assert list(summary["errors"]) == ["broken"]
    assert summary["errors"]["broken"].startswith("on_start: RuntimeError: boom at start")


GATED_PROBES = """\
import threading
from undercurrent.probes import Probe, register_probe
from undercurrent.records import ProbeSignal
from undercurrent.spec import ProbeKind

gate = threading.Event()

class Held(Probe):
    # Holds its worker at its first record until the opener has seen four: by
    # then three records came to a queue of one, so at least one was dropped.
    probe_kind = ProbeKind.TRAJECTORY
    def __init__(self):
        self.seen = 0
    def on_activation(self, record):
        gate.wait(120)
        self.seen += 1
    def on_end(self, ctx):
        return {"seen": self.seen}

class Opener(Probe):
    probe_kind = ProbeKind.TRAJECTORY
    def __init__(self):
        self.seen = 0
    def on_activation(self, record):
        self.seen += 1
        if self.seen == 4:
            gate.set()

register_probe("held_async", Held, replace=True)  # (loaded once per run below)
register_probe("gate_opener", Opener, replace=True)
"""


def test_run_says_how_many_records_an_async_probe_dropped(tmp_path, capsys):
    # The verdict of an async probe whose queue overflowed covered a few of the
    # tokens, and neither the text nor the JSON output said records were dropped.
    (tmp_path / "gated_probes.py").write_text(GATED_PROBES)
    spec = tmp_path / "gated.yaml"
    spec.write_text("extraction_points:\n"
                    "  - {name: held, layers: [1], tensor_type: residual_stream, position: "
                    "'generated[*]', probe_type: held_async, probe_kind: trajectory, "
                    "execution_mode: async, queue_depth: 1}\n"
                    "  - {name: opener, layers: [1], tensor_type: residual_stream, position: "
                    "'generated[*]', probe_type: gate_opener, probe_kind: trajectory}\n")
    base = ["run", str(spec), "--model", "tiny", "--probes", str(tmp_path / "gated_probes.py"),
            "--prompt", "how do i open my car ?", "--max-new-tokens", "8"]
    assert main([*base, "--format", "json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    counts = summary["stats"]["held"]
    assert counts["dropped"] >= 1
    assert counts["received"] == counts["processed"] + counts["dropped"] == 7
    assert summary["verdicts"]["held"] == {"seen": counts["processed"]}
    assert summary["stats"]["opener"] == {"received": 7, "processed": 7, "dropped": 0}
    assert main(base) == 0
    lines = capsys.readouterr().out.splitlines()
    dropped = [line for line in lines if "dropped" in line]
    assert len(dropped) == 1 and dropped[0].startswith("  held: dropped "), lines
    assert "records (its async queue was full); the verdict saw the" in dropped[0]


def test_run_refuses_a_prompt_that_is_not_text_with_exit_2(saved_model, capsys):
    # Bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape).
    code = main(["run", str(SPEC_FILE), "--model", str(saved_model), "--prompt",
                 "w1 caf\udce9"])
    assert code == 2
    assert "prompts[0] is not valid text: character 6 is the lone surrogate" in (
        _one_line_error(capsys))


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    # (transformers' own progress bar, when a model loads, is not ours)
    lines = [line for line in captured.err.strip().splitlines()
             if not line.startswith("Loading weights")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(("option", "fragment"), [
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "1e-39"], "temperature must be 0 (greedy) or >= 0.01, got 1e-39"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--temperature", "0.7", "--seed", "-1"], "seed must be in [0, 2**63)"),
    (["--stop", ""], "stop strings must not be empty"),
    (["--device", "bogus"], "device 'bogus' is not a device torch knows"),
    (["--records", "records.csv"], "--records 'records.csv' must end in .parquet"),
])
def test_run_refuses_a_bad_option_value_with_exit_2_before_loading_the_model(
        saved_model, tmp_path, capsys, option, fragment):
    # Each was exit 1 after the model loaded (a bad --device, or a --records path
    # that cannot be written, a traceback after generating).
    code = main(["run", str(SPEC_FILE), "--model", str(tmp_path / "never-loaded"),
                 "--prompt", "hi", *option])
    assert code == 2
    line = _one_line_error(capsys)
    assert line.startswith("run: ") and fragment in line


def test_run_refuses_a_records_path_that_is_a_folder_or_in_a_missing_one(tmp_path, capsys):
    for path, fragment in ((tmp_path, "is a directory"),
                           (tmp_path / "missing" / "r.parquet", "does not exist")):
        assert main(["run", str(SPEC_FILE), "--model", "tiny", "--prompt", "hi",
                     "--records", str(path)]) == 2
        assert fragment in _one_line_error(capsys)


def test_run_and_capture_with_vllm_device_say_vllm_is_not_installed(tmp_path, capsys,
                                                                     monkeypatch):
    # The --device check imported vLLM first: a ModuleNotFoundError traceback, where
    # without --device it is the one line naming the extra.
    monkeypatch.setitem(sys.modules, "vllm", None)  # (find_spec and import: not installed)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    never_loaded = str(tmp_path / "never-loaded")
    for argv in (["run", str(SPEC_FILE), "--prompt", "hi"],
                 ["capture", "--spec", str(SPEC_FILE), "--prompts", str(prompts),
                  "--out", str(tmp_path / "store")]):
        code = main([*argv, "--model", never_loaded, "--backend", "vllm", "--device", "cpu"])
        assert code == 2
        assert _one_line_error(capsys) == (
            f"{argv[0]}: the 'vllm' backend needs 'vllm', which is not installed; install it "
            "with: pip install 'undercurrent[vllm]'")


# /sys refuses new files even to root, where a chmod-ed folder would not.
READ_ONLY = Path("/sys")
needs_read_only = pytest.mark.skipif(not READ_ONLY.is_dir(), reason="no /sys to write into")


@needs_read_only
def test_run_refuses_a_records_path_it_cannot_create_before_loading_the_model(tmp_path,
                                                                              capsys):
    # It was a pyarrow traceback after the model loaded and generated (exit 1).
    code = main(["run", str(SPEC_FILE), "--model", str(tmp_path / "never-loaded"),
                 "--prompt", "hi", "--records", str(READ_ONLY / "records.parquet")])
    captured_line = _one_line_error(capsys)
    assert code == 2
    assert captured_line.startswith("run: --records '/sys/records.parquet' cannot be written")


def test_an_existing_records_file_passes_the_check_untouched_and_a_new_one_is_not_left(
        tmp_path):
    existing = tmp_path / "old.parquet"
    existing.write_bytes(b"kept")
    check_output_file(str(existing), "--records", (".parquet",))
    assert existing.read_bytes() == b"kept"
    check_output_file(str(tmp_path / "new.parquet"), "--records", (".parquet",))
    assert not (tmp_path / "new.parquet").exists()


def test_run_writes_records_through_a_symlink_to_a_file_not_yet_written(saved_model,
                                                                          tmp_path, capsys):
    # The check opened the path (creating the link's target), then unlinked the path:
    # the user's link was removed, the records went to a new regular file in its
    # place, and the target was left empty.
    spec_path = tmp_path / "spec.yaml"
    assert main(["inspect-model", str(saved_model), "--emit-spec", str(spec_path)]) == 0
    (tmp_path / "results").mkdir()
    target = tmp_path / "results" / "run1.parquet"
    link = tmp_path / "latest.parquet"
    link.symlink_to(target)
    check_output_file(str(link), "--records", (".parquet",))
    assert link.is_symlink() and not target.exists()
    code = main(["run", str(spec_path), "--model", str(saved_model), "--prompt", prompt(4),
                 "--max-new-tokens", "2", "--records", str(link)])
    assert code == 0, capsys.readouterr().err
    assert link.is_symlink() and link.resolve() == target.resolve()
    pandas = pytest.importorskip("pandas")
    assert len(pandas.read_parquet(target)) == 1 + 1  # prompt[-1] + 1 fed generated token


def test_run_prints_several_problems_on_one_line(saved_model, tmp_path, capsys):
    spec_path = tmp_path / "far.yaml"
    spec_path.write_text(NORM_SPEC.replace("layers: [1]", "layers: [10]"))
    assert main(["run", str(spec_path), "--model", str(saved_model), "--prompt", "hi"]) == 1
    line = _one_line_error(capsys)
    assert line.startswith("run: ") and "out of range" in line


def test_inspect_model_refuses_an_emit_spec_path_it_cannot_write(saved_model, tmp_path, capsys):
    for path in (tmp_path, tmp_path / "missing" / "s.yaml", tmp_path / "s.txt"):
        assert main(["inspect-model", str(saved_model), "--emit-spec", str(path)]) == 2
        assert _one_line_error(capsys).startswith("inspect-model: --emit-spec ")


@needs_read_only
def test_inspect_model_refuses_an_emit_spec_path_it_cannot_create(saved_model, capsys):
    # It was found only after reading the model, as exit 1.
    code = main(["inspect-model", str(saved_model), "--emit-spec", str(READ_ONLY / "s.yaml")])
    line = _one_line_error(capsys)
    assert code == 2
    assert line.startswith("inspect-model: --emit-spec '/sys/s.yaml' cannot be written")


@pytest.mark.parametrize("indent", ["-1", "9", "1000000"])
def test_schema_indent_is_bounded(capsys, indent):
    assert main(["schema", "--indent", indent]) == 2
    assert "--indent" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "fragment"), [
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer from 1 to 200"),
    (["--max-new-tokens", "1000"], "max_new_tokens must be an integer from 1 to 200"),
])
def test_demo_refuses_a_bad_option_value_with_exit_2(capsys, option, fragment):
    assert main(["demo", *option]) == 2
    assert fragment in _one_line_error(capsys)


def test_demo_refuses_an_out_path_it_cannot_write_and_a_spec_without_its_guard(
        tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "is a directory" in _one_line_error(capsys)
    starter = tmp_path / "starter.yaml"
    starter.write_text(NORM_SPEC)
    assert main(["demo", "--spec", str(starter), "--out", str(tmp_path / "r.html")]) == 1
    assert "has no point 'harm_guard'" in _one_line_error(capsys)
    assert main(["demo", "--spec", str(tmp_path / "nope.yaml")]) == 1
    assert "not found" in _one_line_error(capsys)
