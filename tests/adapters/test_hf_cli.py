"""``undercurrent inspect-model`` and ``undercurrent run`` on a saved tiny model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent.cli import main  # noqa: E402
from undercurrent.spec import load_yaml_file  # noqa: E402


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


def test_inspect_model_on_a_missing_path_fails_clearly(tmp_path, capsys):
    assert main(["inspect-model", str(tmp_path / "nope")]) == 1
    assert "cannot read" in capsys.readouterr().err


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
