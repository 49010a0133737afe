"""`undercurrent inspect-model` reports the vLLM backend from the config alone,
without importing vLLM (each check runs in a subprocess to prove it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest


def needs_vllm() -> None:
    # find_spec, not importorskip: importing vLLM here would patch transformers
    # in the main test process.
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")


@pytest.mark.timeout(180)
def test_inspect_model_reports_vllm_layers_per_tensor_type_without_an_engine():
    needs_vllm()
    done = subprocess.run(
        [sys.executable, "-m", "undercurrent", "inspect-model", "tiny", "--format", "json"],
        capture_output=True, text=True, timeout=170, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    vllm = report["backends"]["vllm"]
    assert "error" not in vllm, vllm
    layers = vllm["tensor_types"]
    n = report["num_layers"]
    for tensor_type in ("residual_stream", "attn_out", "mlp_out", "kv"):
        assert layers[tensor_type] == list(range(n))
    assert layers["final_norm"] == [n]
    # the same answer the HF backend gives for this Llama
    assert layers == report["backends"]["hf"]["tensor_types"]


def test_the_config_answer_never_imports_vllm():
    needs_vllm()
    code = (
        "import sys\n"
        "from undercurrent.adapters.model_inspection import inspect_model\n"
        "report = inspect_model('tiny')\n"
        "assert report['backends']['vllm']['tensor_types']['final_norm'] == [4]\n"
        "print('vllm imported:', 'vllm' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=170, check=False)
    assert "vllm imported: False" in done.stdout, done.stderr[-2000:]


def test_a_family_outside_the_architecture_table_is_reported_as_refused(tmp_path):
    # (what loading it with backend='vllm' would answer: see test_vllm_refusals.py)
    needs_vllm()
    from transformers import AutoConfig

    from undercurrent.adapters.model_inspection import inspect_model

    AutoConfig.for_model("stablelm", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4).save_pretrained(tmp_path)
    report = inspect_model(str(tmp_path))
    assert "config.model_type='stablelm'" in report["backends"]["vllm"]["error"]
    assert "architecture table" in report["backends"]["vllm"]["error"]
    assert "error" in report["backends"]["hf"]
