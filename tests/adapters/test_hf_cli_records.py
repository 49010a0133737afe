"""``undercurrent run --records`` fills ``token_text`` with the model's tokenizer."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pandas = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

from hf_models import build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent.cli import main  # noqa: E402

SPEC = """\
version: "1"
extraction_points:
  - name: every_token
    layers: [0, 2]
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: norm_probe
    probe_kind: trajectory
  - name: last_prompt
    layers: 1
    tensor_type: mlp_out
    position: "prompt[-1]"
    probe_type: norm_probe
    probe_kind: single_shot
"""


def test_run_records_have_the_decoded_token_of_each_row(tmp_path, capsys) -> None:
    model_dir = tmp_path / "model"
    build_model("llama").save_pretrained(model_dir)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(model_dir)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    records = tmp_path / "records.parquet"
    code = main(["run", str(spec), "--model", str(model_dir), "--prompt", prompt(1, 2, 3),
                 "--prompt", prompt(7), "--max-new-tokens", "4", "--records", str(records)])
    assert code == 0, capsys.readouterr().err
    frame = pandas.read_parquet(records)
    assert len(frame) == 2 * (2 * 3 + 1)
    assert frame["token_text"].notna().all()
    for token_id, text in zip(frame["token_id"], frame["token_text"], strict=True):
        assert text == tokenizer.decode([int(token_id)])
    last_prompt = frame[frame["point"] == "last_prompt"].sort_values("request")
    assert sorted(last_prompt["token_text"]) == sorted([prompt(3), prompt(7)])
