"""``ProbedModel``: loading, spec forms, the router it builds (or the one you
bring), results and records per prompt, callbacks, and lifecycle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent / "adapters"))
from hf_models import build_model, build_tokenizer, prompt  # noqa: E402

from undercurrent import GenerationOutput, ProbedModel  # noqa: E402
from undercurrent.adapters import BackendError  # noqa: E402
from undercurrent.records import ProbeResult  # noqa: E402
from undercurrent.router import Router  # noqa: E402

SPEC = """
version: "1"
extraction_points:
  - name: last_prompt
    layers: [0, 2]
    tensor_type: residual_stream
    position: "prompt[-1]"
    probe_type: norm_probe
    probe_kind: single_shot
  - name: trajectory
    layers: 1
    tensor_type: mlp_out
    position: "generated[1:]"
    stride: 2
    probe_type: norm_probe
    probe_kind: trajectory
    execution_mode: async
"""


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_model("qwen2").save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture()
def spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def test_from_pretrained_generates_with_results_and_records(saved_model, spec_file):
    seen: list[ProbeResult] = []
    with ProbedModel.from_pretrained(str(saved_model), spec=spec_file, device="cpu",
                                     on_result=seen.append) as pm:
        assert pm.capabilities().num_layers == 3
        outs = pm.generate([prompt(1, 2, 3), prompt(4)], max_new_tokens=7, records=True)
    assert [type(o) for o in outs] == [GenerationOutput, GenerationOutput]
    for out in outs:
        assert len(out.token_ids) == 7 and not out.aborted
        assert set(out.results) == {"last_prompt", "trajectory"}
        last = [r for r in out.records if r.extraction_point_name == "last_prompt"]
        assert sorted(r.layer for r in last) == [0, 2]
        assert all(r.token_index == out.prompt_len - 1 for r in last)
        # generated[1:] stride 2 over fed tokens g0..g5 -> g1, g3, g5
        traj = [r.generated_index for r in out.records if r.extraction_point_name == "trajectory"]
        assert traj == [1, 3, 5]
        assert out.results["trajectory"].stats.received == 3
        assert out.results["last_prompt"].verdict["count"] == 2
    assert len(seen) == 4 and {r.request_id for r in seen} == {o.request_id for o in outs}
    assert outs[0].request_id != outs[1].request_id


def test_records_are_not_kept_unless_asked_and_a_string_prompt_works(saved_model):
    pm = ProbedModel.from_pretrained(saved_model, spec=SPEC)
    (out,) = pm.generate(prompt(5, 6), max_new_tokens=3)
    assert out.records is None and out.results["last_prompt"].stats.received == 2
    pm.close()
    pm.close()  # idempotent
    with pytest.raises(BackendError, match="closed"):
        pm.generate("x")


def test_tiny_name_loads_the_bundled_model_and_keeps_its_short_name(saved_model, monkeypatch):
    import undercurrent.models as models

    monkeypatch.setattr(models, "tiny_model_path", lambda: Path(saved_model))
    for name in ("tiny", "undercurrent/tiny"):
        pm = ProbedModel.from_pretrained(name)
        assert pm.backend.model.config._name_or_path == str(saved_model)  # loaded from there
        assert pm.backend.model_name == "undercurrent/tiny"  # shown by its short name
        assert repr(pm).startswith("ProbedModel('undercurrent/tiny', backend='hf'")
        pm.close()
    with ProbedModel.from_pretrained(str(saved_model) + "/") as pm:  # its path, too
        assert pm.backend.model_name == "undercurrent/tiny"
    monkeypatch.undo()
    with ProbedModel.from_pretrained(str(saved_model)) as pm:
        assert pm.backend.model_name == str(saved_model)  # any other path names itself


def test_from_pretrained_on_a_loaded_model_applies_its_name_and_refuses_loading_arguments():
    # device=, dtype= and the loader's keywords were dropped without a word, and
    # model_name= with them.
    import torch

    model = build_model("llama")
    with ProbedModel.from_pretrained(model, tokenizer=build_tokenizer(),
                                     model_name="mine") as pm:
        assert pm.backend.model_name == "mine" and repr(pm).startswith("ProbedModel('mine'")
    for given, named in (({"dtype": "bfloat16"}, "dtype='bfloat16'"),
                         ({"device": "cuda:7"}, "device='cuda:7'"),
                         ({"no_such_option": 1}, "no_such_option=1")):
        with pytest.raises(TypeError, match=rf"^from_pretrained\(<a loaded LlamaForCausalLM>\) "
                                            rf"cannot apply {named}: .*model.to\(device, dtype\)"):
            ProbedModel.from_pretrained(model, tokenizer=build_tokenizer(), **given)
    assert next(model.parameters()).dtype == torch.float32  # left as it was


def test_from_pretrained_on_a_path_uses_the_tokenizer_given(saved_model):
    # tokenizer= reached AutoModelForCausalLM.from_pretrained, a TypeError inside
    # transformers.
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    loaded = ProbedModel(AutoModelForCausalLM.from_pretrained(saved_model), build_tokenizer())
    with loaded, ProbedModel.from_pretrained(saved_model) as saved, \
            ProbedModel.from_pretrained(saved_model, tokenizer=tokenizer) as given, \
            ProbedModel.from_pretrained(saved_model, tokenizer=str(saved_model)) as by_path:
        assert given.backend.tokenizer is tokenizer
        for pm, oracle in ((given, loaded), (by_path, saved)):
            assert (pm.generate([prompt(1, 2)], max_new_tokens=3)[0].token_ids
                    == oracle.generate([prompt(1, 2)], max_new_tokens=3)[0].token_ids)
    with pytest.raises(ValueError, match=r"^tokenizer '/nonexistent' is not a tokenizer"):
        ProbedModel.from_pretrained(saved_model, tokenizer="/nonexistent")


def test_from_pretrained_with_vllm_refuses_a_loaded_tokenizer_before_the_engine_starts(
        saved_model):
    pytest.importorskip("vllm")
    with pytest.raises(TypeError, match=r"^from_pretrained\(path, backend='vllm'\) cannot "
                                        r"apply a loaded tokenizer \(.*\): .* the path or hub id"):
        ProbedModel.from_pretrained(saved_model, backend="vllm", tokenizer=build_tokenizer())


def test_a_misspelt_from_pretrained_keyword_is_named_with_the_one_meant(saved_model):
    # It reached the model's class: "LlamaForCausalLM.__init__() got an unexpected
    # keyword argument 'batchsize'", naming neither from_pretrained nor batch_size.
    import inspect

    from undercurrent.adapters.hf import backend as hf_backend
    from undercurrent.adapters.hf.backend import HFBackend

    with pytest.raises(TypeError, match=r"^from_pretrained got an unexpected keyword argument "
                                        r"'batchsize': .*; did you mean batch_size=\?$"):
        ProbedModel.from_pretrained(saved_model, batchsize=4)
    own = set(inspect.signature(ProbedModel.from_pretrained).parameters) | set(
        inspect.signature(HFBackend.from_pretrained).parameters)
    assert set(hf_backend._FROM_PRETRAINED_ARGUMENTS) == own - {
        "cls", "model_or_path", "path", "backend_kwargs", "model_kwargs"}


def test_output_loading_info_is_refused_naming_the_way_to_get_it(saved_model):
    # transformers returned (model, info): "'tuple' object has no attribute 'eval'"
    with pytest.raises(TypeError, match=r"^from_pretrained cannot take output_loading_info="
                                        r"True .* ProbedModel\(model, tokenizer\)$"):
        ProbedModel.from_pretrained(saved_model, output_loading_info=True)
    pm = ProbedModel.from_pretrained(saved_model, output_loading_info=False)
    pm.close()


def test_a_router_you_bring_is_used_and_left_running():
    router = Router()
    pm = ProbedModel(build_model("llama"), build_tokenizer(), spec=SPEC, router=router)
    out = pm.generate([prompt(1)], max_new_tokens=3)[0]
    assert set(out.results) == {"last_prompt", "trajectory"}
    assert router.metrics()  # it saw the traffic
    pm.close()
    assert router.live_requests() == ()
    with router.request(list(pm.spec), request_id="still-alive"):
        pass  # not shut down by close()
    router.shutdown()


def test_no_spec_means_no_router_and_plain_generation():
    pm = ProbedModel(build_model("gpt2"), build_tokenizer())
    out = pm.generate([prompt(1, 2)], max_new_tokens=4, seed=3, temperature=0.7)[0]
    assert out.results == {} and len(out.token_ids) == 4 and out.signals == ()
    assert pm._router is None
    pm.close()


def test_a_spec_file_is_read_as_a_file_whatever_its_name(tmp_path):
    # A path whose folder or name holds "extraction_points" is still a file;
    # one line of flow YAML that names no file is still YAML text.
    from undercurrent.api import load_spec
    from undercurrent.notebook import SpecEditor
    from undercurrent.spec import load_yaml_file
    original = Path(__file__).parent.parent / "specs" / "classic_single_token.yaml"
    folder = tmp_path / "extraction_points"
    folder.mkdir()
    path = folder / "my_extraction_points.yaml"
    path.write_bytes(original.read_bytes())
    expected = load_yaml_file(original)
    assert len(expected) >= 1
    assert load_spec(str(path)) == load_spec(path) == expected
    assert SpecEditor.from_spec(str(path)).spec == expected
    flow = ("{extraction_points: [{name: p, layers: 1, tensor_type: residual_stream, "
            "position: 0, probe_type: norm_probe, probe_kind: single_shot}]}")
    assert [point.name for point in load_spec(flow)] == ["p"]
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_spec(str(folder / "missing_extraction_points.yaml"))


def test_a_spec_of_the_wrong_kind_is_refused_naming_what_a_spec_may_be():
    # (each failed inside Python: "'int' object is not iterable", or read bytes as ints)
    from undercurrent.api import load_spec
    from undercurrent.spec import ExtractionPoint, ProbeSpec
    point = ExtractionPoint(name="p", layers=1, tensor_type="residual_stream",
                            position="generated[*]", probe_type="norm_probe",
                            probe_kind="trajectory")
    with pytest.raises(TypeError, match="spec is a single ExtractionPoint; wrap it in a list"):
        ProbedModel(build_model("llama"), build_tokenizer(), spec=point)
    with pytest.raises(TypeError, match=r"spec must be a spec: pass a YAML file path, YAML "
                                        r"text, .* got int \(5\)"):
        load_spec(5)
    with pytest.raises(TypeError, match="spec is bytes; decode YAML text first"):
        load_spec(b"version: '1'\nextraction_points: []\n")
    with pytest.raises(TypeError, match="ProbeSpec extraction_points must be a list of "
                                        "ExtractionPoint, got a single ExtractionPoint"):
        ProbeSpec(point)
    with pytest.raises(TypeError, match=r"ProbeSpec extraction_points\[1\] must be an "
                                        r"ExtractionPoint, got str"):
        ProbeSpec((point, "q"))
    with pytest.raises(TypeError, match=r"ProbeSpec edits must be a list of Edit, got int"):
        ProbeSpec((point,), edits=5)
    assert load_spec([point]) == load_spec(ProbeSpec((point,))) == ProbeSpec([point])


def test_bad_arguments_are_named():
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        ProbedModel.from_pretrained("/nonexistent", backend="nope")
    with pytest.raises(BackendError, match="needs a tokenizer"):
        ProbedModel(build_model("llama"))
    # (accepted; the first generate() failed with "'int' object is not callable")
    for tokenizer in (5, "gpt2-tokenizer-name", print):
        with pytest.raises(TypeError, match=r"the hf backend's tokenizer must be a tokenizer "
                                            r"\(callable on text, with decode\(\).*got "):
            ProbedModel(build_model("llama"), tokenizer)
    with pytest.raises(BackendError, match="from_pretrained"):
        ProbedModel(build_model("llama"), build_tokenizer(), backend="vllm")
    with pytest.raises(FileNotFoundError, match="not a file"):
        ProbedModel(build_model("llama"), build_tokenizer(), spec="missing.yaml")
    pm = ProbedModel(build_model("llama"), build_tokenizer())
    with pytest.raises(ValueError, match="max_new_tokens"):
        pm.generate("x", max_new_tokens=0)
    with pytest.raises(ValueError, match="request_ids"):
        pm.generate(["a", "b"], request_ids=["same", "same"])


def test_a_bad_router_on_result_or_backend_name_is_refused_when_built():
    # (a string on_result failed only after the whole batch was generated, a dict
    # router deep inside the session, and backend="HF" was told to load itself)
    model, tokenizer = build_model("llama"), build_tokenizer()
    with pytest.raises(TypeError, match=r"on_result must be a function .* got str \('print'\)"):
        ProbedModel(model, tokenizer, spec=SPEC, on_result="print")
    with pytest.raises(TypeError, match="router must be an undercurrent Router .* got dict "
                                        ".* lacks register_request, route_columns, end_request"):
        ProbedModel(model, tokenizer, spec=SPEC, router={"workers": 2})
    with pytest.raises(TypeError, match="on_result must be a function"):
        ProbedModel.from_pretrained("undercurrent/tiny", on_result=1)
    with pytest.raises(BackendError, match="unknown backend 'HF'; known backends: hf, vllm"):
        ProbedModel(model, tokenizer, backend="HF")

    class MinimalRouter:  # (the router protocol: any object with its three methods)
        def __init__(self):
            self.inner = Router()
            self.register_request = self.inner.register_request
            self.route_columns = self.inner.route_columns
            self.end_request = self.inner.end_request

    seen = []
    custom = MinimalRouter()
    pm = ProbedModel(model, tokenizer, spec=SPEC, router=custom, on_result=seen.append)
    out = pm.generate([prompt(1)], max_new_tokens=2)[0]
    assert set(out.results) == {"last_prompt", "trajectory"} and len(seen) == 2
    pm.close()
    custom.inner.shutdown()


def test_outputs_with_records_pickle_and_deep_copy_whole():
    # (notebook caches, joblib and multiprocessing pickle what a call returns: its
    # lazily built records and signals come back as plain lists and tuples)
    import copy
    import pickle

    import numpy as np

    spec = ("extraction_points:\n  - {name: resid, layers: [1, 3], tensor_type: "
            "residual_stream, position: 'generated[*]', probe_type: norm_probe, "
            "probe_kind: trajectory}\n")
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as pm:
        outputs = pm.generate(["user : how do i bake bread ? assistant :"] * 3,
                              max_new_tokens=6, records=True)
    for again in (pickle.loads(pickle.dumps(outputs)), copy.deepcopy(outputs)):
        for before, after in zip(outputs, again, strict=True):
            assert after.token_ids == before.token_ids and after.text == before.text
            assert len(after.records) == len(before.records) == 10
            for one, other in zip(before.records, after.records, strict=True):
                assert (one.layer, one.token_index, one.token_id) == (
                    other.layer, other.token_index, other.token_id)
                np.testing.assert_array_equal(np.asarray(one.tensor), np.asarray(other.tensor))
            assert after.signals == before.signals
            assert after.results["resid"].verdict == before.results["resid"].verdict
            assert after.results["resid"].signals == before.results["resid"].signals
