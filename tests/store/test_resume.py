"""A capture killed with SIGKILL at any moment and started again with resume=True
skips the committed prompts and ends with every prompt exactly once: no partial
and no duplicate vectors, values equal to an uninterrupted generation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from store_helpers import SPEC, corpus_prompts, oracle_vectors, request_ids, store_vectors

from undercurrent import open_activations
from undercurrent.store import StoreError

pytest.importorskip("torch")
pytest.importorskip("pyarrow")

N_PROMPTS = 12
OPTIONS = dict(max_new_tokens=6, batch_size=1, shard_prompts=3)

# The child parks (blocks reading stdin) at a chosen moment and says so on stdout;
# the parent kills it there. No sleeps: the line is the event.
CHILD = textwrap.dedent("""
    import json, os, sys
    from undercurrent import ProbedModel
    from undercurrent.store import writer

    spec, out, where, at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    prompts = json.loads(sys.stdin.readline())
    options = json.loads(sys.stdin.readline())
    counts = {"add": 0, "rename": 0}

    def park(event):
        counts[event] += 1
        print(f"{event} {counts[event]}", flush=True)
        if event == where and counts[event] == at:
            sys.stdin.readline()  # parked until killed

    add, rename = writer.StoreWriter.add, os.rename

    def parked_add(self, *args):
        written = add(self, *args)
        park("add")
        return written

    def parked_rename(source, target):
        park("rename")
        rename(source, target)

    writer.StoreWriter.add = parked_add
    writer.os.rename = parked_rename
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    model.capture(prompts, out, progress=False, **options)
    print("finished", flush=True)
""")


# `undercurrent capture` run by the CLI's own main() in a child, with shards of two
# prompts; after the first commit its next generate() parks and says so, and the
# parent sends SIGINT there (a Ctrl-C mid-capture; the line is the event).
CLI_CHILD = textwrap.dedent("""
    import os, sys
    from undercurrent import ProbedModel
    from undercurrent.cli import main

    capture, generate, rename = ProbedModel.capture, ProbedModel.generate, os.rename
    committed = []

    def small_shards(self, *args, **kwargs):
        return capture(self, *args, **{**kwargs, "shard_prompts": 2})

    def parked_generate(self, *args, **kwargs):
        if committed:
            print("committed", flush=True)
            sys.stdin.readline()  # parked until interrupted
        return generate(self, *args, **kwargs)

    def noted_rename(source, target):
        rename(source, target)
        committed.append(target)

    ProbedModel.capture, ProbedModel.generate = small_shards, parked_generate
    os.rename = noted_rename
    sys.exit(main(sys.argv[1:]))
""")


def test_ctrl_c_during_cli_capture_is_one_line_and_exit_130_and_the_rerun_resumes(
        prompts, tmp_path):
    from undercurrent.cli import main

    spec, prompt_file, out = tmp_path / "spec.yaml", tmp_path / "prompts.txt", tmp_path / "o"
    spec.write_text(SPEC)
    prompt_file.write_text("\n".join(prompts[:6]) + "\n")
    command = ["capture", "--spec", str(spec), "--prompts", str(prompt_file), "--out",
               str(out), "--max-new-tokens", "2", "--batch-size", "2", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    child = subprocess.Popen([sys.executable, "-c", CLI_CHILD, *command], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "committed", child.stderr.read()[-2000:]
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("capture:")]
    assert lines == ["capture: interrupted after 2 of 6 prompts stored; run the same "
                     "command again to resume"], err[-2000:]
    assert sorted(open_activations(out).outputs["prompt_index"]) == [0, 1]
    assert main(command) == 0
    assert sorted(open_activations(out).outputs["prompt_index"]) == list(range(6))


@pytest.fixture(scope="module")
def prompts():
    return corpus_prompts(N_PROMPTS, seed=11)[0]


@pytest.fixture(scope="module")
def oracle(tiny, prompts):
    return tiny.generate(prompts, request_ids=request_ids(N_PROMPTS), records=True,
                         max_new_tokens=OPTIONS["max_new_tokens"], batch_size=1)


def _kill_at(tmp_path: Path, prompts: list[str], where: str, at: int) -> Path:
    import json

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(spec), str(out), where, str(at)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)
    try:
        child.stdin.write(json.dumps(prompts) + "\n" + json.dumps(OPTIONS) + "\n")
        child.stdin.flush()
        for line in child.stdout:
            if line.strip() == f"{where} {at}":
                break
            assert line.strip() != "finished", "the child finished before the kill point"
        else:
            raise AssertionError(f"child exited early: {child.stderr.read()[-2000:]}")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=120)
    assert child.returncode == -signal.SIGKILL
    return out


@pytest.mark.parametrize(("where", "at", "committed"), [
    ("add", 1, 0),      # mid first shard: nothing committed yet
    ("add", 5, 3),      # one shard committed, the next half-written
    ("rename", 2, 3),   # second shard fully written but not yet renamed
])
def test_sigkill_then_resume_leaves_every_prompt_once(tiny, prompts, oracle, tmp_path,
                                                      where, at, committed):
    out = _kill_at(tmp_path, prompts, where, at)
    leftovers = [p.name for p in (out / "shards").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the kill should land while a shard is being written"
    killed = open_activations(out)
    assert killed.n_prompts == committed
    assert sorted(killed.outputs["prompt_index"]) == list(range(committed))
    assert set(killed.index["prompt_index"]) <= set(range(committed))

    summary = tiny.capture(prompts, out, progress=False, resume=True, **OPTIONS)
    assert summary.skipped == committed
    assert summary.requests == N_PROMPTS - committed
    assert not [p for p in (out / "shards").iterdir() if p.name.startswith(".tmp-")]

    store = open_activations(out)
    assert sorted(store.outputs["prompt_index"]) == list(range(N_PROMPTS))
    keys = ["request_id", "extraction_point_name", "layer", "token_index"]
    assert not store.index.duplicated(keys).any()
    expected = oracle_vectors(oracle)
    found = store_vectors(store)
    assert found.keys() == expected.keys()
    from_child = set(request_ids(N_PROMPTS)[:committed])
    for key, vector in expected.items():
        if key[0] in from_child:
            # Computed in the killed process. MKL may run a call on fewer threads
            # than asked (MKL_DYNAMIC, on by default), so another process may add
            # in another order: a few ulps apart (seen once, on a busy machine).
            # A vector of another token or layer would differ by far more.
            np.testing.assert_allclose(found[key], vector, rtol=1e-5, atol=1e-6,
                                       err_msg=str(key))
        else:  # computed here, by the same process as the oracle: exactly equal
            np.testing.assert_array_equal(found[key], vector, err_msg=str(key))


def test_a_finished_store_resumes_to_nothing_and_refuses_other_captures(tiny, prompts,
                                                                        tmp_path):
    first = tiny.capture(prompts[:4], tmp_path, progress=False, **OPTIONS)
    assert first.requests == 4
    again = tiny.capture(prompts[:4], tmp_path, progress=False, **OPTIONS)
    assert (again.requests, again.skipped, again.vectors) == (0, 4, 0)
    with pytest.raises(StoreError, match="resume=True"):
        tiny.capture(prompts[:4], tmp_path, progress=False, resume=False, **OPTIONS)
    with pytest.raises(StoreError, match="prompts"):
        tiny.capture(prompts[:5], tmp_path, progress=False, **OPTIONS)
    with pytest.raises(StoreError, match="sampling"):
        tiny.capture(prompts[:4], tmp_path, progress=False, **dict(OPTIONS, max_new_tokens=3))
    assert len(open_activations(tmp_path).outputs) == 4


def test_the_model_s_own_storage_dtype_named_or_not_and_a_greedy_seed_resume_one_capture(
        tiny, prompts, tmp_path):
    # store.json recorded the argument (null), so naming the model's dtype (float32
    # here), the default, was refused as "a different storage_dtype"; a seed, which
    # greedy decoding does not use, was "a different sampling".
    import json

    tiny.capture(prompts[:2], tmp_path, progress=False, **OPTIONS)
    manifest = json.loads((tmp_path / "store.json").read_text())
    assert manifest["storage_dtype"] == manifest["generation"]["dtype"] == "float32"
    for same in ({"storage_dtype": "float32"}, {"seed": 5}, {}):
        again = tiny.capture(prompts[:2], tmp_path, progress=False, **OPTIONS, **same)
        assert (again.requests, again.skipped) == (0, 2)
    with pytest.raises(StoreError, match=r'a different storage_dtype "float32" in the '
                                         r'store, "float16" now; a store'):
        tiny.capture(prompts[:2], tmp_path, progress=False, storage_dtype="float16", **OPTIONS)
    with pytest.raises(StoreError, match=r"a different sampling \(temperature 0.0 in the "
                                         r"store, 0.7 now\); a store"):
        tiny.capture(prompts[:2], tmp_path, progress=False, temperature=0.7, **OPTIONS)
    # a store written when the argument was recorded (null) resumes either way
    manifest["storage_dtype"] = None
    (tmp_path / "store.json").write_text(json.dumps(manifest))
    for same in ({"storage_dtype": "float32"}, {}):
        again = tiny.capture(prompts[:2], tmp_path, progress=False, **OPTIONS, **same)
        assert (again.requests, again.skipped) == (0, 2)


STEER = {"name": "push", "layers": 1, "tensor_type": "residual_stream",
         "position": "generated[*]", "op": "add",
         "vector": "undercurrent:models/tiny/probe.safetensors", "coefficient": -30.0}


@pytest.mark.parametrize("other", ["steered", "steered otherwise", "capture_last_token",
                                   "bfloat16"])
def test_a_part_generated_otherwise_is_refused_as_another_capture(tiny, prompts, tmp_path,
                                                                  other):
    # Steering edits, capture_last_token and the model's dtype change what is
    # generated and stored: a store is one capture, every part and resume alike.
    import torch
    import yaml

    from undercurrent import ProbedModel

    points = yaml.safe_load(SPEC)["extraction_points"]
    first = ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec={
        "version": "2", "extraction_points": points,
        "edits": [STEER]} if other == "steered otherwise" else SPEC)
    first.capture(prompts[:4], tmp_path, progress=False, shard="0/2", **OPTIONS)
    model = tiny.backend.model
    second = ProbedModel(
        model.to(torch.bfloat16) if other == "bfloat16" else model, tiny.backend.tokenizer,
        spec={"version": "2", "extraction_points": points,
              "edits": [dict(STEER, coefficient=-20.0)]} if other.startswith("steered")
        else SPEC, capture_last_token=other == "capture_last_token")
    try:
        with pytest.raises(StoreError, match=r"a different (storage_dtype .*)?generation "
                                             r"\(.*\); a store .* model "
                                             r"dtype, spec \(its edits included\), "
                                             r"capture_last_token"):
            second.capture(prompts[:4], tmp_path, progress=False, shard="1/2", **OPTIONS)
    finally:
        model.to(torch.float32)
    assert len(open_activations(tmp_path).outputs) == 2
    first.capture(prompts[:4], tmp_path, progress=False, shard="1/2", **OPTIONS)
    assert len(open_activations(tmp_path).outputs) == 4


def test_a_part_steered_by_a_vector_file_saved_again_is_refused_as_another_capture(
        tiny, prompts, tmp_path):
    # The edits were compared as written: a steering vector refitted and saved to
    # the same file passed, and the store mixed generations of two vectors.
    import json

    import yaml

    from undercurrent import ProbedModel
    from undercurrent.steering import SteeringVector

    vector = tmp_path / "push.safetensors"
    spec = {"version": "2", "extraction_points": yaml.safe_load(SPEC)["extraction_points"],
            "edits": [dict(STEER, vector=str(vector), coefficient=8.0)]}
    rng = np.random.default_rng(0)

    def steered_by(values):
        SteeringVector(vector=values, positive=1, negative=0, layer=1,
                       tensor_type="residual_stream").save(vector)
        return ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=spec)

    first_vector = rng.normal(size=tiny.capabilities().hidden_size)
    first = steered_by(first_vector)
    first.capture(prompts[:4], tmp_path / "acts", progress=False, shard="0/2", **OPTIONS)
    with pytest.raises(StoreError, match=r"a different generation"):
        steered_by(first_vector + 1.0).capture(prompts[:4], tmp_path / "acts",
                                               progress=False, shard="1/2", **OPTIONS)
    # a store written before the vectors' digest was recorded compares the edits as
    # written (as it did)
    manifest = tmp_path / "acts" / "store.json"
    written = json.loads(manifest.read_text())
    del written["generation"]["edits"]["vectors_sha256"]
    manifest.write_text(json.dumps(written))
    first.capture(prompts[:4], tmp_path / "acts", progress=False, shard="1/2", **OPTIONS)
    assert len(open_activations(tmp_path / "acts").outputs) == 4


def test_an_interrupt_commits_whole_batches_and_a_failed_write_commits_nothing(
        tiny, prompts, tmp_path, monkeypatch):
    from undercurrent.store import writer

    calls = {"n": 0}
    generate = type(tiny).generate

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny), "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.capture(prompts, tmp_path / "a", progress=False, **dict(OPTIONS, shard_prompts=50))
    assert sorted(open_activations(tmp_path / "a").outputs["prompt_index"]) == [0, 1]
    monkeypatch.setattr(type(tiny), "generate", generate)

    add_outputs = writer._OpenShard.add_outputs
    writes = {"n": 0}

    def broken(self, outputs, indices):
        writes["n"] += 1
        if writes["n"] == 2:
            raise OSError("disk full")
        return add_outputs(self, outputs, indices)

    monkeypatch.setattr(writer._OpenShard, "add_outputs", broken)
    with pytest.raises(OSError, match="disk full"):
        tiny.capture(prompts, tmp_path / "b", progress=False, **OPTIONS)
    # (the shard open holds half a batch: it is dropped, the whole one with it)
    store = open_activations(tmp_path / "b")
    assert len(store) == 0 and store.n_prompts == 0
    assert not list((tmp_path / "b" / "shards").glob(".tmp-*"))
    writes["n"] = 1
    with pytest.raises(OSError, match="disk full"):  # (its first batch: nothing stored,
        tiny.capture(prompts, tmp_path / "c", progress=False, **OPTIONS)  # and no directory)
    assert not (tmp_path / "c").exists()


def test_a_commit_that_fails_leaves_no_temporary_shard_and_no_open_file(tiny, prompts,
                                                                       tmp_path, monkeypatch):
    # The disk fills while the shard's index footer is written: the capture fails,
    # and the shard's temporary directory (the space it holds) goes with it, every
    # file of it closed, its other parquet files included.
    import errno

    from undercurrent.store import writer

    opened = []
    write, close = writer._ParquetAppender.write, writer._ParquetAppender.close
    open_shard = writer._OpenShard.append

    def noted_write(self, data):
        written = write(self, data)
        opened.append(self.writer)
        return written

    def noted_append(self, *args):
        open_shard(self, *args)
        opened.extend(self.files.values())

    def full_disk(self):
        if self.path.name == "index.parquet":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        close(self)

    monkeypatch.setattr(writer._ParquetAppender, "write", noted_write)
    monkeypatch.setattr(writer._OpenShard, "append", noted_append)
    monkeypatch.setattr(writer._ParquetAppender, "close", full_disk)
    with pytest.raises(OSError, match="No space left"):
        tiny.capture(prompts[:4], tmp_path, progress=False, **OPTIONS)
    assert not list((tmp_path / "shards").glob(".tmp-*"))
    assert opened
    # (parquet writers say is_open; the vectors' files say closed)
    assert not [f for f in opened if (f.is_open if hasattr(f, "is_open") else not f.closed)]
    assert open_activations(tmp_path).n_prompts == 0


def test_a_shard_missing_a_file_is_refused_by_the_reader_and_by_a_resume(tiny, prompts,
                                                                        tmp_path):
    # (a copy of shards/part* cut short, a file removed by hand): read as it was, the
    # shard's vectors were counted but its rows or outputs were not, and a resume
    # trusted its meta.json and never captured its prompts again.
    import shutil

    options = dict(OPTIONS, shard_prompts=2)
    whole = tmp_path / "whole"
    tiny.capture(prompts[:4], whole, progress=False, **options)
    second = sorted(p.name for p in (whole / "shards").iterdir() if p.is_dir())[1]
    damages = {"index.parquet": "index.parquet is missing",
               "outputs.parquet": "outputs.parquet is missing",
               "p0.bin": r"p0.bin \(the vectors of point 'resid'\) has \d+ bytes, its "
                         r"meta.json says \d+"}
    for name, message in damages.items():
        store = tmp_path / name
        shutil.copytree(whole, store)
        damaged = store / "shards" / second / name
        if name.endswith(".bin"):
            damaged.write_bytes(damaged.read_bytes()[:-4])
        else:
            damaged.unlink()
        expected = rf"shard '{second}' is damaged: {message}; .*remove .*recapture"
        with pytest.raises(StoreError, match=expected):
            open_activations(store)
        with pytest.raises(StoreError, match=expected):
            tiny.capture(prompts[:4], store, progress=False, **options)
        shutil.rmtree(store / "shards" / second)  # (as the message says)
        assert tiny.capture(prompts[:4], store, progress=False, **options).requests == 2
        assert sorted(open_activations(store).outputs["prompt_index"]) == [0, 1, 2, 3]
    (whole / "shards" / sorted(p.name for p in (whole / "shards").iterdir()
                               if p.is_dir())[0] / "results.parquet").unlink()
    assert len(open_activations(whole).results) == 2 * 3  # (early shards: no results)
