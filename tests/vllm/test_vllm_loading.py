"""Model directories with extra safetensors files (saved probes) load in vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from undercurrent.adapters.vllm.loading import (
    extra_safetensors,
    loadable_directory,
    remove_staging,
)


def _model_dir(root: Path, *names: str) -> Path:
    root.mkdir()
    for name in ("config.json", "tokenizer.json", *names):
        (root / name).write_text(name)
    return root


def test_a_probe_next_to_the_weights_is_hidden_from_vllm(tmp_path):
    directory = _model_dir(tmp_path / "m", "model.safetensors", "probe.safetensors")
    assert [p.name for p in extra_safetensors(directory)] == ["probe.safetensors"]
    staged, staging = loadable_directory(str(directory))
    try:
        assert staging is not None and staged != str(directory)
        assert sorted(p.name for p in Path(staged).iterdir()) == [
            "config.json", "model.safetensors", "tokenizer.json"]
        assert (Path(staged) / "model.safetensors").read_text() == "model.safetensors"
    finally:
        remove_staging(staging)
    assert not Path(staging).exists()
    assert (directory / "probe.safetensors").exists()


def test_sharded_weights_are_kept_and_plain_directories_are_used_as_they_are(tmp_path):
    sharded = _model_dir(tmp_path / "s", "model-00001-of-00002.safetensors",
                         "model-00002-of-00002.safetensors")
    assert extra_safetensors(sharded) == []
    assert loadable_directory(str(sharded)) == (str(sharded), None)


def test_an_index_file_already_tells_vllm_which_files_hold_weights(tmp_path):
    indexed = _model_dir(tmp_path / "i", "model.safetensors", "probe.safetensors",
                         "model.safetensors.index.json")
    assert loadable_directory(str(indexed)) == (str(indexed), None)


def _config(root: Path, **fields) -> Path:
    import json

    root.mkdir()
    (root / "config.json").write_text(json.dumps(fields))
    return root


def test_auto_dtype_is_the_one_config_json_declares(tmp_path):
    pytest.importorskip("torch")
    from undercurrent.adapters.vllm.loading import engine_dtype

    assert engine_dtype(str(_config(tmp_path / "a", dtype="float32")), None) == "float32"
    assert engine_dtype(str(_config(tmp_path / "b", torch_dtype="bfloat16")), "auto") == "bfloat16"
    nested = _config(tmp_path / "c", text_config={"dtype": "float16"})
    assert engine_dtype(str(nested), None) == "float16"
    # no declared dtype: vLLM's own choice
    assert engine_dtype(str(_config(tmp_path / "d")), None) == "auto"


def test_an_explicit_dtype_wins_and_a_wrong_one_names_the_argument(tmp_path):
    torch = pytest.importorskip("torch")
    from undercurrent.adapters.vllm.loading import engine_dtype

    directory = str(_config(tmp_path / "m", dtype="float32"))
    assert engine_dtype(directory, "bfloat16") == "bfloat16"
    assert engine_dtype(directory, torch.float16) == "float16"
    with pytest.raises(ValueError, match=r"dtype='float33' is not a torch dtype; use 'auto'"):
        engine_dtype(directory, "float33")


@pytest.mark.parametrize(("gib", "space"), [(2, "2"), (2.0, "2"), (1, "1")])
def test_kv_cache_gib_is_a_whole_number_of_gib(gib, space):
    from undercurrent.adapters.vllm.backend import kv_cache_space

    assert kv_cache_space(gib) == space


@pytest.mark.parametrize("gib", [0.5, 2.5, 0, float("nan")])
def test_a_fraction_of_a_gib_or_none_at_all_is_refused_naming_kv_cache_gib(gib):
    from undercurrent.adapters.vllm.backend import kv_cache_space

    with pytest.raises(ValueError, match="kv_cache_gib must be a whole number of GiB"):
        kv_cache_space(gib)


def test_the_kv_cache_size_is_set_while_an_engine_is_built_then_restored(monkeypatch):
    from undercurrent.adapters.vllm.backend import kv_cache_environment

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with kv_cache_environment(None):  # (unset: 1 GiB, not vLLM's ~10)
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    with pytest.raises(RuntimeError), kv_cache_environment("2"):
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
        raise RuntimeError("the engine failed to start")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    with kv_cache_environment(None):  # (the process's own size)
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_kv_cache_memory_bytes_sizes_the_cache_over_the_variable(monkeypatch):
    # the CPU build took VLLM_CPU_KVCACHE_SPACE (set to 1 GiB by the backend) over
    # the engine argument, which was ignored
    from vllm import EngineArgs

    from undercurrent.adapters.vllm.backend import kv_cache_environment
    from undercurrent.models import tiny_model_path

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    sizes = {}
    for sized in (False, True):
        with kv_cache_environment(None, sized=sized):
            config = EngineArgs(model=str(tiny_model_path()), enforce_eager=True,
                                kv_cache_memory_bytes=5 << 20).create_engine_config()
        sizes[sized] = config.cache_config.kv_cache_memory_bytes
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert sizes == {False: 3 << 30, True: 5 << 20}


def test_kv_cache_gib_and_kv_cache_memory_bytes_together_are_refused():
    from undercurrent.adapters.base import BackendError
    from undercurrent.adapters.vllm.backend import VLLMBackend

    with pytest.raises(BackendError, match=r"kv_cache_gib=2 and kv_cache_memory_bytes=1024 "
                                           r"both size the KV cache; give one"):
        VLLMBackend.from_pretrained("undercurrent/tiny", kv_cache_gib=2,
                                    kv_cache_memory_bytes=1024)


@pytest.mark.parametrize("device", ["cuda:1", "cuda", "meta", "cpu:2", "nonsense"])
def test_a_device_the_engine_does_not_run_on_is_refused_before_it_starts(device):
    # device= was ignored: a model asked on cuda:1 ran on the CPU, without a word
    from undercurrent.adapters.base import BackendError
    from undercurrent.adapters.vllm.backend import VLLMBackend

    if device == "nonsense":
        with pytest.raises(ValueError, match=r"device 'nonsense' is not a device torch knows"):
            VLLMBackend.from_pretrained("undercurrent/tiny", device=device)
        return
    with pytest.raises(BackendError, match=rf"device {device!r}: the vllm backend runs where "
                                           r"the installed vLLM build targets \('cpu' here\)"):
        VLLMBackend.from_pretrained("undercurrent/tiny", device=device)


@pytest.mark.parametrize("device", [None, "cpu", "cpu:0"])
def test_the_engines_own_device_is_accepted(device):
    from undercurrent.adapters.vllm.backend import check_engine_device

    check_engine_device(device)
