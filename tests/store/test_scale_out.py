"""``--shard i/N``: parts written by concurrent processes into one directory form
one store equal to a single capture; a part has one writer at a time; the CLI
reads .txt and .jsonl prompt files and names bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from store_helpers import SPEC, corpus_prompts, oracle_vectors, request_ids, store_vectors

from undercurrent import open_activations
from undercurrent.store import StoreError
from undercurrent.store.format import parse_part, part_range
from undercurrent.store.writer import StoreWriter

pytest.importorskip("torch")
pytest.importorskip("pyarrow")

ROOT = Path(__file__).parents[2]


def _cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "undercurrent", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_parts_are_disjoint_and_cover_the_prompts():
    for n_prompts in (0, 1, 7, 100):
        for count in (1, 2, 3, 8):
            for grid in (1, 3, 4):
                parts = [list(part_range(i, count, n_prompts, grid)) for i in range(count)]
                assert sorted(sum(parts, [])) == list(range(n_prompts))
                assert all(part[0] % grid == 0 for part in parts if part)
    assert parse_part("2/4") == (2, 4)
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="i/N|0 <= i < N"):
            parse_part(bad)


def test_two_cli_processes_write_one_store(tiny, tmp_path):
    prompts = corpus_prompts(9, seed=21)[0]
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    as_jsonl = tmp_path / "prompts.jsonl"
    as_jsonl.write_text("".join(json.dumps({"prompt": p, "label": 0}) + "\n" for p in prompts))
    as_txt = tmp_path / "prompts.txt"
    as_txt.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "store"
    common = ["--spec", str(spec), "--out", str(out), "--model", "tiny", "--max-new-tokens",
              "5", "--batch-size", "1", "--no-progress"]
    workers = [_cli("capture", "--prompts", str(as_jsonl), "--shard", "0/2", *common),
               _cli("capture", "--prompts", str(as_txt), "--shard", "1/2", *common)]
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=300)
        assert worker.returncode == 0, stderr[-2000:]
        assert "vectors" in stdout
    store = open_activations(out)
    assert sorted(store.outputs["prompt_index"]) == list(range(9))
    shards = {str(s).split("-")[0] for s in store.index["shard"].unique()}
    assert shards == {"part0000of0002", "part0001of0002"}
    oracle = tiny.generate(prompts, request_ids=request_ids(9), records=True,
                           max_new_tokens=5, batch_size=1)
    expected = oracle_vectors(oracle)
    found = store_vectors(store)
    assert found.keys() == expected.keys()
    # Other processes: torch may pick another thread count there, which changes float32
    # summation order (seen: 1.7e-6 at |x| ~ 0.1). Bitwise equality is proven in one
    # process by test_capture_equivalence; here the union and its keys are the point.
    for key, vector in expected.items():
        np.testing.assert_allclose(found[key], vector, rtol=1e-5, atol=1e-5, err_msg=str(key))


def test_cli_names_bad_input(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('"fine"\n{"text": "no prompt key"}\n')
    from undercurrent.cli import main

    base = ["capture", "--spec", str(spec), "--out", str(tmp_path / "o")]
    assert main([*base, "--prompts", str(bad)]) == 2
    assert main([*base, "--prompts", str(tmp_path / "p.csv")]) == 2
    good = tmp_path / "prompts.txt"
    good.write_text("hello\n")
    assert main([*base, "--prompts", str(good), "--shard", "2/2"]) == 2
    assert main([*base, "--prompts", str(good), "--reduce", "resid"]) == 2


def test_one_writer_per_part_and_one_capture_per_directory(tmp_path):
    identity = {"model": "m", "points": [{"name": "a"}], "reductions": {"a": None},
                "storage_dtype": None, "sampling": {}, "prompts": {"count": 1}}
    first = StoreWriter(tmp_path, identity, "part0000of0001")
    try:
        with pytest.raises(StoreError, match="another writer"):
            StoreWriter(tmp_path, identity, "part0000of0001")
        other = StoreWriter(tmp_path, identity, "part0000of0002")  # another part: fine
        other.close()
        with pytest.raises(StoreError, match="model"):
            StoreWriter(tmp_path, dict(identity, model="other"), "part0001of0002")
    finally:
        first.close()
    StoreWriter(tmp_path, identity, "part0000of0001").close()  # the lock was released


def test_seeded_sampling_in_parts_and_resumed_stores_what_generate_samples(tiny, tmp_path):
    # On the HF backend a seeded batch is sampled from one generator: parts and
    # resumes take generate()'s batches, so the texts are generate()'s, and a
    # resume with another batch size is refused (it would sample other texts).
    prompts = corpus_prompts(10, seed=5)[0]
    settings = dict(max_new_tokens=8, temperature=1.0, seed=3, batch_size=4, progress=False)
    live = tiny.generate(prompts, max_new_tokens=8, temperature=1.0, seed=3, batch_size=4)
    for parts in ("0/1", "0/3 1/3 2/3", "2/3 0/3 1/3"):
        out = tmp_path / parts.replace("/", "of").replace(" ", "_")
        for part in parts.split():
            tiny.capture(prompts, out, shard=part, **settings)
        texts = open_activations(out).outputs.sort_values("prompt_index")["text"]
        assert list(texts) == [output.text for output in live], parts
    assert len({output.text for output in live}) > 1  # (sampled: the texts differ)
    with pytest.raises(StoreError, match="different sampling.*batch size"):
        tiny.capture(prompts, tmp_path / "0of1", **{**settings, "batch_size": 3})


def test_parts_of_the_bundled_model_loaded_by_name_by_path_or_as_a_model_form_one_store(
        tiny, tmp_path):
    # By path or as a loaded model it was named by its absolute path, so a part
    # after one captured by name was refused as "a different model".
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from undercurrent import ProbedModel
    from undercurrent.models import tiny_model_path

    path = tiny_model_path()
    prompts = corpus_prompts(6, seed=8)[0]
    settings = dict(max_new_tokens=3, batch_size=2, progress=False)
    with ProbedModel.from_pretrained(str(path), spec=SPEC) as by_path, \
            ProbedModel(AutoModelForCausalLM.from_pretrained(path),
                        AutoTokenizer.from_pretrained(path), spec=SPEC) as loaded:
        for part, model in enumerate((tiny, by_path, loaded)):
            assert model.backend.model_name == "undercurrent/tiny"
            model.capture(prompts, tmp_path, shard=f"{part}/3", **settings)
    oracle = tiny.generate(prompts, request_ids=request_ids(6), records=True,
                           max_new_tokens=3, batch_size=2)
    found, expected = store_vectors(open_activations(tmp_path)), oracle_vectors(oracle)
    assert found.keys() == expected.keys()
    for key, vector in expected.items():
        np.testing.assert_array_equal(found[key], vector, err_msg=str(key))


def test_two_writers_creating_a_store_at_once_both_open_it(tmp_path, monkeypatch):
    # Both find no store.json and write their temporary copy before either links
    # it into place; the first then links and removes its copy, and only then does
    # the second link its own. Each needs a temporary name of its own (threads, or
    # processes of two machines with the same pid, share a pid).
    import threading

    from undercurrent.store import writer

    identity = {"model": "m", "points": [{"name": "a"}], "reductions": {"a": None},
                "storage_dtype": None, "sampling": {}, "prompts": {"count": 2}}
    second_written, first_done = threading.Event(), threading.Event()
    write_json = writer.write_json

    def interleaved(path, data):
        write_json(path, data)
        if path.name.startswith(".tmp-store.json"):
            if threading.current_thread().name == "first":
                assert second_written.wait(timeout=60)
            else:
                second_written.set()
                assert first_done.wait(timeout=60)

    monkeypatch.setattr(writer, "write_json", interleaved)
    failures = []

    def run(part):
        try:
            StoreWriter(tmp_path, identity, part).close()
        except BaseException as error:  # (reported below, from the test's thread)
            failures.append(f"{part}: {type(error).__name__}: {error}")
        finally:
            if threading.current_thread().name == "first":
                first_done.set()

    threads = [threading.Thread(target=run, args=(f"part000{i}of0002",), name=name)
               for i, name in enumerate(("first", "second"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert json.loads((tmp_path / "store.json").read_text())["model"] == "m"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "store.json"]


class _SeedsAsVllm:
    """The bundled model as capture sees a vLLM one (chunks of concurrent requests),
    noting the seed vLLM would give each prompt: the call's seed + its position."""

    def __init__(self, model):
        from types import SimpleNamespace

        self.model = model
        self.backend = SimpleNamespace(name="vllm", model_name=model.backend.model_name,
                                       dtype=model.backend.dtype,
                                       capabilities=model.backend.capabilities)
        self.batch_size, self.points, self.spec = model.batch_size, model.points, model.spec
        self.seeds = {}

    def generate(self, prompts, *, request_ids, seed, **options):
        for position, request in enumerate(request_ids):
            self.seeds[int(request[1:])] = seed + position
        return self.model.generate(prompts, request_ids=request_ids, seed=seed, **options)


def test_vllm_seeds_each_prompt_its_own_seed_when_a_resume_skips_a_gap(tiny, tmp_path):
    # Part 1/3 first, then the whole list: the resume generates prompts 0-2 and 6-8.
    # vLLM seeds a call's i-th request seed + i, so a call spanning the gap would
    # sample prompts 6-8 with the seeds of prompts 3-5.
    from undercurrent.store.capture import _chunks, capture_activations

    assert list(_chunks([0, 1, 2, 6, 7, 8, 9], 2, None)) == [[0, 1], [2], [6, 7], [8, 9]]
    prompts = corpus_prompts(9, seed=5)[0]
    settings = dict(max_new_tokens=2, temperature=1.0, seed=40, progress=False)
    model = _SeedsAsVllm(tiny)
    capture_activations(model, prompts, tmp_path, shard="1/3", **settings)
    assert model.seeds == {3: 43, 4: 44, 5: 45}
    summary = capture_activations(model, prompts, tmp_path, **settings)
    assert (summary.requests, summary.skipped) == (6, 3)
    assert model.seeds == {index: 40 + index for index in range(9)}


def test_a_writer_of_another_split_never_stores_a_prompt_twice(tiny, tmp_path, monkeypatch):
    # --shard 0/1 runs to its end while --shard 0/2 generates its first batch: the
    # 0/2 writer finds its prompts committed meanwhile and drops its shard.
    prompts = corpus_prompts(4, seed=5)[0]
    settings = dict(max_new_tokens=3, batch_size=2, progress=False)
    generate = type(tiny).generate
    nested = []

    def meanwhile(self, *args, **kwargs):
        if not nested:
            nested.append("started")
            nested.append(tiny.capture(prompts, tmp_path, shard="0/1", **settings))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny), "generate", meanwhile)
    with pytest.raises(StoreError, match=r"prompt\(s\) \[0, 1\] of shard 'part0000of0002-"
                                         r"000000' were committed meanwhile by shard\(s\) "
                                         r"\['part0000of0001-000000'\]"):
        tiny.capture(prompts, tmp_path, shard="0/2", **settings)
    assert nested[1].requests == 4
    store = open_activations(tmp_path)
    assert sorted(store.outputs["prompt_index"]) == [0, 1, 2, 3]
    assert not list((tmp_path / "shards").glob(".tmp-*"))


def test_a_store_whose_shards_share_a_prompt_is_refused_naming_them(tiny, tmp_path):
    # (two writers of different splits that both committed, e.g. on a filesystem
    # where one did not yet see the other's shard)
    import shutil

    prompts = corpus_prompts(4, seed=5)[0]
    settings = dict(max_new_tokens=3, batch_size=2, progress=False)
    tiny.capture(prompts, tmp_path / "whole", **settings)
    tiny.capture(prompts, tmp_path / "half", shard="1/2", **settings)
    shutil.copytree(tmp_path / "half" / "shards" / "part0001of0002-000000",
                    tmp_path / "whole" / "shards" / "part0001of0002-000000")
    with pytest.raises(StoreError, match=r"shards 'part0000of0001-000000' and "
                                         r"'part0001of0002-000000' both hold prompt\(s\) "
                                         r"\[2, 3\]: two writers with different --shard"):
        open_activations(tmp_path / "whole")
