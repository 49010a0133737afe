"""Every argument of a capture is checked before anything is written: a call refused
for a bad value (a sampling setting, ``batch_size``, an empty prompt list) leaves
its directory as it found it, so the corrected call is not refused as "a
different capture"; the CLI answers bad values with exit 2 and one line."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from store_helpers import SPEC, corpus_prompts

from undercurrent import open_activations

pytest.importorskip("torch")
pytest.importorskip("pyarrow")

PROMPTS = corpus_prompts(3, seed=11)[0]
GOOD = dict(max_new_tokens=2, batch_size=2, progress=False)


def _listing(root):
    return sorted((str(path.relative_to(root)), path.stat().st_size)
                  for path in root.rglob("*"))


@pytest.mark.parametrize("bad, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), "top_p must be in"),
    (dict(top_k=0), "top_k must be >= 1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
])
def test_a_refused_sampling_value_writes_nothing_and_the_corrected_call_runs(
        tiny, tmp_path, bad, message):
    out = tmp_path / "d1"
    with pytest.raises(ValueError, match=message):
        tiny.capture(PROMPTS, out, **{**GOOD, **bad})
    assert not out.exists()
    summary = tiny.capture(PROMPTS, out, **GOOD)
    assert summary.requests == len(PROMPTS)


def test_a_refused_call_leaves_an_existing_store_unchanged(tiny, tmp_path):
    out = tmp_path / "store"
    tiny.capture(PROMPTS, out, **GOOD)
    before = _listing(out)
    manifest = (out / "store.json").read_text()
    for bad in (dict(max_new_tokens=0), dict(top_p=2.0), dict(batch_size=-1),
                dict(storage_dtype="int8"), dict(reduce={"resid": "nope"}),
                dict(shard="3/2")):
        with pytest.raises(ValueError):
            tiny.capture(PROMPTS, out, **{**GOOD, **bad})
        assert _listing(out) == before, bad
    assert (out / "store.json").read_text() == manifest
    assert tiny.capture(PROMPTS, out, **GOOD).skipped == len(PROMPTS)


@pytest.mark.parametrize("point, features, kind", [
    ("resid", 128, "residual_stream"), ("kv_last_prompt", 2 * 2 * 64, "kv")])
def test_a_projection_onto_more_dimensions_than_a_point_has_is_refused(
        tiny, tmp_path, capsys, point, features, kind):
    # project:K took any K: K above the features stored more than the vectors, and
    # project:99999999999 failed in the writer with numpy's MemoryError
    from undercurrent.store import Reduction

    out = tmp_path / "d1"
    for k in (features + 1, 99999999999):
        with pytest.raises(ValueError, match=re.escape(
                f"reduce[{point!r}]='project:{k}' asks for more dimensions than point "
                f"{point!r} captures ({features} features of {kind}); give K <= "
                f"{features}")):
            tiny.capture(PROMPTS, out, **GOOD, reduce={point: f"project:{k}"})
        assert not out.exists()
    main, base, prompts = _cli_base(tmp_path, out)
    assert main([*base, "--prompts", str(prompts), "--reduce",
                 f"{point}=project:{features + 1}"]) == 2
    assert f"asks for more dimensions than point {point!r}" in capsys.readouterr().err
    assert not out.exists()
    tiny.capture(PROMPTS, out, **GOOD, reduce={point: f"project:{features}"})
    store = open_activations(out).select(point=point)
    assert store.vectors().shape[1:] == (features,)
    assert store.projection(point).shape == (features, features)
    with pytest.raises(ValueError, match=f"project:{features + 1} asks for more dimensions "
                                         f"than the {features} features projected"):
        Reduction(project=features + 1).projection(features)


@pytest.mark.parametrize("batch_size, error", [
    (0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError),
])
def test_batch_size_must_be_an_integer_of_at_least_one(tiny, tmp_path, batch_size, error):
    out = tmp_path / "d1"
    with pytest.raises(error, match=r"batch_size must be an integer >= 1 .* or None"):
        tiny.capture(PROMPTS, out, **{**GOOD, "batch_size": batch_size})
    assert not out.exists()


@pytest.mark.parametrize("shard_prompts, error, got", [
    (None, TypeError, r"an integer, got NoneType \(None\)"),
    ("8", TypeError, r"an integer, got str \('8'\)"),
    (2.5, TypeError, r"an integer, got float \(2\.5\)"),
    (True, TypeError, r"an integer, got bool \(True\)"),
    (0, ValueError, r"an integer >= 1, got 0"),
])
def test_shard_prompts_must_be_an_integer_of_at_least_one(tiny, tmp_path, shard_prompts,
                                                          error, got):
    # (None and "8" failed in a bare "'<' not supported" naming nothing; 2.5 and
    # True were taken as counts)
    out = tmp_path / "d1"
    with pytest.raises(error, match=r"^shard_prompts \(prompts per committed shard\) must "
                                    r"be " + got):
        tiny.capture(PROMPTS, out, **{**GOOD, "shard_prompts": shard_prompts})
    assert not out.exists()
    summary = tiny.capture(PROMPTS, out, **{**GOOD, "shard_prompts": np.int64(2)})
    assert summary.requests == len(PROMPTS)
    assert open_activations(out).index["shard"].nunique() == 2  # (3 prompts, 2 a shard)


@pytest.mark.parametrize("flag", ["resume", "progress"])
def test_on_off_options_take_true_or_false_only(tiny, tmp_path, flag):
    # ("no" is truthy: resume="no" resumed a capture the caller meant to refuse)
    out = tmp_path / "store"
    tiny.capture(PROMPTS, out, **GOOD)
    before = _listing(out)
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got str \\('no'\\)"):
        tiny.capture(PROMPTS, out, **{**GOOD, flag: "no"})
    assert _listing(out) == before


@pytest.mark.parametrize("option, said", [
    (dict(edits=[]), "edits belong in the spec"),
    (dict(capture_last_token=True), "ProbedModel(..., capture_last_token=True)"),
    (dict(records=True), "writes every record to the store"),
    (dict(sharrd="0/2"), "(did you mean 'shard'?)"),
])
def test_an_option_capture_does_not_take_says_where_it_belongs_and_writes_nothing(
        tiny, tmp_path, option, said):
    # These were "capture_activations() got an unexpected keyword argument", naming
    # an internal function and no way on.
    out = tmp_path / "d1"
    with pytest.raises(TypeError, match=rf"^capture\(\) takes no {next(iter(option))}= option"
                                        r".*; it takes: max_new_tokens, .*shard, ") as caught:
        tiny.capture(PROMPTS, out, **{**GOOD, **option})
    assert said in str(caught.value) and not out.exists()


@pytest.mark.parametrize("text, message", [
    ("last_token+mean_generated", "two token reductions, 'last_token' and 'mean_generated'"),
    ("mean_generated+all", "two token reductions, 'mean_generated' and 'all'"),
    ("project:64+project:8", "two projections, 'project:64' and 'project:8'"),
    ("project:4+last_token+project:16", "two projections, 'project:4' and 'project:16'"),
    ("last_token+last_token", "two token reductions"),
])
def test_a_reduction_with_two_parts_of_one_kind_is_refused_naming_them(text, message):
    from undercurrent.store.format import Reduction

    with pytest.raises(ValueError, match=message):
        Reduction.parse(text)
    assert Reduction.parse("project:8+mean_generated") == Reduction("mean_generated", 8)


def test_reduce_that_is_not_a_dict_is_refused_and_writes_nothing(tiny, tmp_path):
    out = tmp_path / "d1"
    with pytest.raises(TypeError, match=r"reduce must be a dict \{point name: reduction\} "
                                        r"\(e.g. \{'resid': 'last_token'\}\), got list"):
        tiny.capture(PROMPTS, out, **GOOD, reduce=["last_token"])
    assert not out.exists()


def test_numpy_integers_are_accepted_and_recorded_as_plain_numbers(tiny, tmp_path):
    out = tmp_path / "d1"
    summary = tiny.capture(PROMPTS, out, progress=False, max_new_tokens=np.int64(2),
                           batch_size=np.int64(2), top_k=np.int32(5), seed=np.int64(1))
    assert summary.requests == len(PROMPTS)
    sampling = open_activations(out).manifest["sampling"]
    assert (sampling["max_new_tokens"], sampling["top_k"], sampling["seed"]) == (2, 5, 1)


def test_an_empty_prompt_list_is_refused_and_writes_nothing(tiny, tmp_path):
    out = tmp_path / "d1"
    for empty in ([], ()):
        with pytest.raises(ValueError, match="no prompts were given"):
            tiny.capture(empty, out, **GOOD)
        assert not out.exists()
    assert tiny.capture(PROMPTS, out, **GOOD).requests == len(PROMPTS)


def _cli_base(tmp_path, out):
    from undercurrent.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    base = ["capture", "--spec", str(spec), "--out", str(out), "--model", "tiny",
            "--no-progress", "--max-new-tokens", "2"]
    return main, base, prompts


@pytest.mark.parametrize("bad, named", [
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--batch-size", "0"], "batch_size"),
    (["--batch-size", "-4"], "batch_size"),
    (["--reduce", "resid=foo"], "'resid'"),
    (["--reduce", "nope=last_token"], "'nope'"),
    (["--reduce", "kv_last_prompt=mean_generated"], "prompt tokens only"),
    (["--reduce", "resid=last_token+mean_generated"],
     "two token reductions, 'last_token' and 'mean_generated'"),
    (["--reduce", "resid=last_token", "--reduce", "resid=project:8"],
     "point 'resid' twice (resid=last_token and resid=project:8)"),
    # (argparse took '-1/3' for an option: "expected one argument")
    (["--shard", "-1/3"], "shard '-1/3' must look like 'i/N' (e.g. '0/4'), with 0 <= i < N"),
])
def test_cli_bad_argument_values_exit_2_with_one_line_and_write_nothing(
        tmp_path, capsys, bad, named):
    out = tmp_path / "o"
    main, base, prompts = _cli_base(tmp_path, out)
    assert main([*base, "--prompts", str(prompts), *bad]) == 2
    err = capsys.readouterr().err
    line = [text for text in err.splitlines() if text.startswith("capture:")]
    assert len(line) == 1 and named in line[0], err
    assert not out.exists()


def test_an_out_dir_that_is_a_file_is_refused_naming_it(tiny, tmp_path, capsys):
    # (the system said "[Errno 20] Not a directory: 'afile/shards'")
    afile = tmp_path / "afile"
    afile.write_text("kept")
    for out, where in ((afile, "is a file"), (afile / "sub", f"is inside {str(afile)!r}")):
        with pytest.raises(NotADirectoryError, match=f"out_dir {str(out)!r} {where}"):
            tiny.capture(PROMPTS, out, **GOOD)
        main, base, prompts = _cli_base(tmp_path, out)
        assert main([*base, "--prompts", str(prompts)]) == 2
        line = [text for text in capsys.readouterr().err.splitlines()
                if text.startswith("capture:")]
        assert line == [f"capture: --out {str(out)!r} {where}"
                        + (", which is a file" if out != afile else "")
                        + ": a store is a directory; give a new directory or an existing "
                          "store's"]
    assert afile.read_text() == "kept"


def test_an_empty_out_dir_is_refused_and_nothing_is_written(tiny, tmp_path, capsys,
                                                             monkeypatch):
    # ('' is the working directory: store.json and shards/ were written there)
    monkeypatch.chdir(tmp_path)
    main, base, prompts = _cli_base(tmp_path, "")
    written = sorted(path.name for path in tmp_path.iterdir())
    with pytest.raises(ValueError, match="^out_dir is an empty path; give the store's"):
        tiny.capture(PROMPTS, "", **GOOD)
    assert main([*base, "--prompts", str(prompts)]) == 2
    assert "argument --out: an empty path; give a path" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == written


def test_a_store_under_home_is_written_and_opened_there(tiny, home):
    # (pyarrow expanded "~" and the store's own code did not: the capture failed
    # on a half-expanded path)
    summary = tiny.capture(PROMPTS, "~/st", **GOOD)
    assert summary.path == home / "st" and (home / "st" / "store.json").is_file()
    store = open_activations("~/st")
    assert store.path == home / "st" and len(store.index) == summary.vectors
    with pytest.raises(ValueError, match="open_activations: path is an empty path"):
        open_activations("")


def test_cli_no_resume_on_a_written_store_names_the_flag_to_drop(tmp_path, capsys):
    out = tmp_path / "o"
    main, base, prompts = _cli_base(tmp_path, out)
    assert main([*base, "--prompts", str(prompts), "--no-resume"]) == 0
    capsys.readouterr()
    assert main([*base, "--prompts", str(prompts), "--no-resume"]) == 1
    err = capsys.readouterr().err
    line = [text for text in err.splitlines() if text.startswith("capture:")]
    assert len(line) == 1 and "drop --no-resume to continue" in line[0], err
    assert "resume=True" not in err and "give --out an empty or new directory" in line[0]
    assert main([*base, "--prompts", str(prompts)]) == 0  # (as the message says)


def test_cli_a_spec_whose_probe_file_is_missing_is_one_line_and_exit_1(tmp_path, capsys):
    out = tmp_path / "o"
    main, base, prompts = _cli_base(tmp_path, out)
    spec = tmp_path / "missing.yaml"
    spec.write_text("""
version: "1"
extraction_points:
  - {name: guard, layers: 2, tensor_type: residual_stream, position: "generated[*]",
     probe_type: linear_probe, probe_kind: single_shot,
     probe_args: {path: no_such_probe.safetensors}}
""")
    at = base.index("--spec") + 1
    assert main([*base[:at], str(spec), *base[at + 1:], "--prompts", str(prompts)]) == 1
    err = capsys.readouterr().err
    line = [text for text in err.splitlines() if text.startswith("capture:")]
    assert len(line) == 1 and "no_such_probe.safetensors" in line[0], err
    assert "Traceback" not in err and not out.exists()


def test_cli_refuses_a_prompts_file_without_prompts(tmp_path, capsys):
    out = tmp_path / "o"
    main, base, prompts = _cli_base(tmp_path, out)
    for name, text in (("empty.txt", ""), ("blank.txt", "\n  \n"), ("empty.jsonl", "\n")):
        empty = tmp_path / name
        empty.write_text(text)
        assert main([*base, "--prompts", str(empty)]) == 2
        err = capsys.readouterr().err
        assert f"{empty}: no prompts" in err, err
        assert not out.exists()
    assert main([*base, "--prompts", str(prompts)]) == 0
    assert len(open_activations(out).outputs) == len(PROMPTS)


def test_cli_names_the_prompt_file_and_line_that_is_not_text(tmp_path, capsys):
    # Latin-1 bytes, and a JSON "\\udcff" escape (a lone surrogate no tokenizer
    # can encode): exit 2 naming the file and line, before the model loads.
    out = tmp_path / "o"
    main, base, _ = _cli_base(tmp_path, out)
    latin, escaped = tmp_path / "latin.txt", tmp_path / "escaped.jsonl"
    latin.write_bytes(b"user : a ?\ncaf\xe9 ?\n")
    escaped.write_text('"user : a ?"\n"caf\\udcff"\n')
    for path, fragment in ((latin, f"{latin}:2: not UTF-8 text (byte 0xe9"),
                           (escaped, f"{escaped}:2: the prompt is not valid text")):
        assert main([*base, "--prompts", str(path)]) == 2
        err = capsys.readouterr().err
        lines = [text for text in err.splitlines() if text.startswith("capture:")]
        assert len(lines) == 1 and fragment in lines[0], err
    assert not out.exists()


def test_cli_a_spec_with_several_problems_is_one_line(tmp_path, capsys):
    out = tmp_path / "o"
    main, base, prompts = _cli_base(tmp_path, out)
    spec = tmp_path / "bad.yaml"
    spec.write_text("extraction_points:\n  - {name: a, layers: [1], tensor_type: resid, "
                    "position: 'generated[*]', probe_type: norm_probe, probe_kind: sometimes}\n")
    at = base.index("--spec") + 1
    assert main([*base[:at], str(spec), *base[at + 1:], "--prompts", str(prompts)]) == 1
    err = capsys.readouterr().err
    lines = [text for text in err.splitlines() if text.strip()
             and not text.startswith("Loading weights")]
    assert len(lines) == 1 and "'resid'" in lines[0] and "'sometimes'" in lines[0], err


def test_a_capture_the_model_refuses_leaves_no_directory_and_the_corrected_one_runs(
        tiny, tmp_path):
    # Past the bundled model's context: refused by generate() itself, after the
    # store's directory was made; it is removed, so the corrected call is not
    # refused as a capture with other sampling settings.
    out = tmp_path / "ctx"
    with pytest.raises(ValueError, match="the model's context is"):
        tiny.capture(PROMPTS, out, **{**GOOD, "max_new_tokens": 400})
    assert not out.exists()
    assert tiny.capture(PROMPTS, out, **GOOD).requests == len(PROMPTS)
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(ValueError, match="the model's context is"):
        tiny.capture(PROMPTS, existing, **{**GOOD, "max_new_tokens": 400})
    assert existing.is_dir() and not any(existing.iterdir())  # (kept, as it was)
    assert tiny.capture(PROMPTS, existing, **GOOD).requests == len(PROMPTS)


def test_prompts_files_break_lines_at_newlines_only_and_drop_a_byte_order_mark(tmp_path):
    # U+2028 and a form feed are text inside a prompt (a JSON string may hold them
    # raw); a UTF-8 BOM, as some editors write, is not part of the first prompt.
    import json

    from undercurrent.capture_cli import read_prompts

    prompts = ["user : a\u2028b ? assistant :", "user : c\fd ? assistant :", "e\u0085f"]
    txt, jsonl = tmp_path / "p.txt", tmp_path / "p.jsonl"
    txt.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(prompts).encode() + b"\n\n")
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\n".join(
        json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts).encode())
    assert read_prompts(txt) == prompts
    assert read_prompts(jsonl) == prompts


def test_a_prompts_file_suffix_is_read_in_any_case(tmp_path):
    # P.TXT was refused, while --records and --emit-spec take any case.
    from undercurrent.capture_cli import read_prompts

    (tmp_path / "P.TXT").write_text("a b\n")
    (tmp_path / "P.JSONL").write_text('"a b"\n{"prompt": "c"}\n')
    assert read_prompts(tmp_path / "P.TXT") == ["a b"]
    assert read_prompts(tmp_path / "P.JSONL") == ["a b", "c"]


def test_values_past_float16_s_range_are_stored_as_infinity_with_a_warning_naming_them(
        tmp_path):
    # A large steering edit at layer 1 drives layer 2's residual stream past 65504:
    # float16 storage keeps infinity there, and says so, naming point and layers.
    from undercurrent import ProbedModel
    from undercurrent.store import StoreOverflowWarning

    spec = """
version: "2"
extraction_points:
  - {name: resid, layers: [0, 2], tensor_type: residual_stream, position: "generated[*]",
     probe_type: norm_probe, probe_kind: trajectory}
edits:
  - {name: push, layers: 1, tensor_type: residual_stream, position: "generated[*]",
     op: add, vector: [1.0, 0.0], coefficient: 100000.0}
"""
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec.replace(
            "[1.0, 0.0]", str([1.0] + [0.0] * 127))) as model:
        with pytest.warns(StoreOverflowWarning) as caught:
            model.capture(PROMPTS[:2], tmp_path / "f16", max_new_tokens=3,
                          storage_dtype="float16", progress=False)
        model.capture(PROMPTS[:2], tmp_path / "f32", max_new_tokens=3, progress=False)
    messages = [str(warning.message) for warning in caught]
    assert messages and all(m.startswith("point 'resid', layer(s) [2]: ") for m in messages)
    assert all("storage_dtype='bfloat16' or 'float32'" in m for m in messages)
    half = open_activations(tmp_path / "f16").select(point="resid", layer=2).vectors()
    full = open_activations(tmp_path / "f32").select(point="resid", layer=2).vectors()
    past = np.abs(full) > 65504
    assert past.any() and np.isinf(half[past]).all() and np.isfinite(half[~past]).all()
    counted = sum(int(m.split(": ")[1].split(" ")[0]) for m in messages)
    assert counted == int(past.sum())
    layer0 = open_activations(tmp_path / "f16").select(point="resid", layer=0).vectors()
    assert np.isfinite(layer0).all()


def test_a_mean_of_generated_tokens_on_a_prompt_point_is_refused_before_writing(
        tiny, tmp_path):
    # (it would store nothing for that point, silently)
    out = tmp_path / "d3"
    with pytest.raises(ValueError, match=r"reduce\['mlp'\]='mean_generated' averages a "
                       r"request's generated tokens, but point 'mlp' \(position "
                       r"'prompt\[-2\]'\) selects prompt tokens only"):
        tiny.capture(PROMPTS, out, reduce={"resid": "mean_generated", "mlp": "mean_generated"},
                     **GOOD)
    assert not out.exists()
    summary = tiny.capture(PROMPTS, out, reduce={"resid": "mean_generated",
                                                 "mlp": "last_token"}, **GOOD)
    assert summary.requests == len(PROMPTS)
    assert set(open_activations(out).index["extraction_point_name"]) == {
        "resid", "kv_last_prompt", "mlp"}


@pytest.mark.parametrize(("position", "generated"), [
    ("prompt[-1]+1", True), ("generated[0]-1", False), ("generated[2]-2", True),
    ("prompt[-2]", False)])
def test_a_mean_of_generated_tokens_follows_the_tokens_an_offset_selects(
        tiny, tmp_path, position, generated):
    # prompt[-1]+1 is generated token 0 (stored: the mean of that one token);
    # generated[0]-1 is the last prompt token (refused: it would store nothing).
    from undercurrent import ProbedModel
    from undercurrent.spec import ExtractionPoint, ProbeSpec

    point = ExtractionPoint(name="p", layers=(2,), tensor_type="residual_stream",
                            position=position, probe_type="norm_probe",
                            probe_kind="single_shot")
    model = ProbedModel(tiny.backend, spec=ProbeSpec((point,)))
    out = tmp_path / "offset"
    if not generated:
        with pytest.raises(ValueError, match=r"selects prompt tokens only"):
            model.capture(PROMPTS, out, reduce={"p": "mean_generated"}, **GOOD)
        assert not out.exists()
        return
    model.capture(PROMPTS, out, reduce={"p": "mean_generated"}, **GOOD)
    live = model.generate(PROMPTS, records=True, max_new_tokens=GOOD["max_new_tokens"],
                          batch_size=GOOD["batch_size"])
    stored = open_activations(out).vectors()
    assert stored.shape[0] == len(PROMPTS)
    for row, output in zip(stored, live, strict=True):
        (record,) = output.records
        assert record.is_generated
        np.testing.assert_allclose(row, record.tensor.float().numpy(), rtol=0, atol=1e-6)


def test_stored_aborts_equal_the_outputs_with_integer_columns(tmp_path):
    # The demo's guard aborts some prompts and not others: the stored abort columns equal
    # the outputs of the same generate() call, and the integer ones stay integers
    # (nullable) rather than floats with NaN for the requests that ran on.
    from undercurrent import ProbedModel
    from undercurrent.demo import default_spec_path

    prompts = corpus_prompts(6, seed=2)[0]
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=default_spec_path()) as guard:
        outputs = guard.generate(prompts, max_new_tokens=12, batch_size=3)
        guard.capture(prompts, tmp_path / "guard", max_new_tokens=12, batch_size=3,
                      progress=False)
    stored = open_activations(tmp_path / "guard").outputs
    assert 0 < sum(o.aborted for o in outputs) < len(outputs)
    assert stored["aborted"].tolist() == [o.aborted for o in outputs]
    for column, field in (("abort_layer", "layer"), ("abort_token_index", "token_index")):
        assert str(stored[column].dtype) == "Int64", column
        assert [None if value is pd.NA else int(value) for value in stored[column]] == [
            None if o.abort is None else getattr(o.abort, field) for o in outputs]
