"""``ProbedModel`` refuses, when it is built, what would otherwise fail (or run
wrongly) at the first ``generate()``: unknown probe types, bad probe_args, and a
probe file fitted on another layer than its point captures."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.probes import TrajectoryProbe  # noqa: E402
from undercurrent.router import Router, RouterError  # noqa: E402

BUNDLED_PROBE = "undercurrent:models/tiny/probe.safetensors"  # fitted on layer 3


@pytest.fixture(scope="module")
def tiny():
    model = ProbedModel.from_pretrained("undercurrent/tiny")
    yield model
    model.close()


def _spec(**fields) -> dict:
    point = {"name": "guard", "layers": [1], "tensor_type": "residual_stream",
             "position": "generated[*]", "probe_type": "norm_probe",
             "probe_kind": "single_shot", **fields}
    return {"version": "1", "extraction_points": [point]}


def test_the_bundled_layer_3_probe_on_layer_1_is_refused_before_generation(tiny):
    spec = _spec(probe_type="linear_probe",
                 probe_args={"path": BUNDLED_PROBE, "action": "abort"})
    with pytest.raises(RouterError) as refused:
        ProbedModel(tiny.backend, spec=spec)
    assert ("was fitted on layer 3, but extraction point 'guard' captures layers [1]; fix the "
            "spec or pass check_metadata: false") in str(refused.value)
    with pytest.raises(RouterError, match="fitted on layer 3"):
        ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)


def test_the_bundled_probe_runs_where_it_was_fitted_or_when_told_to_skip_the_check(tiny):
    fitted = _spec(layers=[3], probe_type="linear_probe",
                   probe_args={"path": BUNDLED_PROBE})
    unchecked = _spec(probe_type="linear_probe",
                      probe_args={"path": BUNDLED_PROBE, "check_metadata": False})
    for spec in (fitted, unchecked):
        output = ProbedModel(tiny.backend, spec=spec).generate("the cat", max_new_tokens=3)[0]
        result = output.results["guard"]
        assert result.error is None and result.stats.processed == len(output.token_ids) - 1


def test_a_trajectory_probe_checks_its_probe_file_s_layer_and_tensor_type_as_linear_does(tiny):
    """trajectory_probe reads a probe file with the same readout as linear_probe, and
    refuses a point the file was not fitted on the same way (it checked nothing)."""
    def trajectory(**fields) -> dict:
        return _spec(probe_type="trajectory_probe", probe_kind="trajectory",
                     **{"probe_args": {"path": BUNDLED_PROBE, "statistic": "max"}, **fields})

    with pytest.raises(RouterError) as refused:
        ProbedModel(tiny.backend, spec=trajectory())
    assert ("probe_type 'trajectory_probe' refuses it: linear probe file "
            in str(refused.value))
    assert ("was fitted on layer 3, but extraction point 'guard' captures layers [1]; fix the "
            "spec or pass check_metadata: false") in str(refused.value)
    with pytest.raises(RouterError, match="was fitted on residual_stream, but extraction point "
                                          "'guard' captures mlp_out"):
        ProbedModel(tiny.backend, spec=trajectory(layers=[3], tensor_type="mlp_out"))
    unchecked = trajectory(probe_args={"path": BUNDLED_PROBE, "check_metadata": False})
    for spec in (trajectory(layers=[3]), unchecked):
        output = ProbedModel(tiny.backend, spec=spec).generate("the cat", max_new_tokens=3)[0]
        assert output.results["guard"].error is None
    with pytest.raises(TypeError, match=r"check_metadata must be True or False, got str"):
        TrajectoryProbe(path=BUNDLED_PROBE, check_metadata="no")


def test_an_unknown_probe_type_is_refused_at_construction_with_the_closest_name(tiny):
    with pytest.raises(RouterError, match="unknown probe_type 'nrom_probe'; did you mean "
                                          "'norm_probe'\\?"):
        ProbedModel(tiny.backend, spec=_spec(probe_type="nrom_probe"))


def test_probe_args_the_probe_does_not_take_are_refused_at_construction(tiny):
    with pytest.raises(RouterError, match="unknown probe_arg 'treshold' \\(did you mean "
                                          "'threshold'\\?\\); NormProbe takes action, threshold"):
        ProbedModel(tiny.backend, spec=_spec(probe_args={"treshold": 3.0}))
    with pytest.raises(RouterError, match="could not build probe_type 'norm_probe'.*action"):
        ProbedModel(tiny.backend, spec=_spec(probe_args={"action": "explode"}))


@pytest.mark.parametrize("args, message", [
    ("{threshold: yes, action: abort}", "threshold must be a number, got the boolean True"),
    ("{threshold: .inf, action: abort}", "threshold must be a finite number"),
    ("{threshold: -.inf}", "threshold must be a finite number"),
    ("{action: abort}", "action 'abort' needs a threshold"),
])
def test_a_threshold_that_cannot_act_as_written_is_refused_at_construction(tiny, args,
                                                                             message):
    # A YAML boolean read as 1.0, an infinite threshold, or an abort with no
    # threshold would each run, and never (or always) act as the spec reads.
    spec = ("extraction_points:\n  - {name: guard, layers: [1], tensor_type: "
            "residual_stream, position: 'generated[*]', probe_type: norm_probe, "
            f"probe_kind: single_shot, probe_args: {args}}}\n")
    with pytest.raises(RouterError, match=message):
        ProbedModel(tiny.backend, spec=spec)


def test_a_threshold_yaml_reads_as_text_still_acts(tiny):
    # YAML 1.1 reads 1e-3 (no dot) as a string: it is the number it spells.
    spec = ("extraction_points:\n  - {name: guard, layers: [1], tensor_type: "
            "residual_stream, position: 'generated[*]', probe_type: norm_probe, "
            "probe_kind: single_shot, probe_args: {threshold: 1e-3, action: abort}}\n")
    output = ProbedModel(tiny.backend, spec=spec).generate("the cat", max_new_tokens=4)[0]
    assert output.aborted and output.abort.generated_index == 0


@pytest.mark.parametrize("probe_type, probe_kind", [("linear_probe", "single_shot"),
                                                     ("trajectory_probe", "trajectory")])
def test_a_linear_readout_of_another_size_than_the_hidden_size_is_refused_at_construction(
        tiny, probe_type, probe_kind):
    # (it raised on every token, into ProbeResult.error, and an abort guard never
    # fired; a trajectory_probe was accepted, then failed on every batch: "expects
    # activations of size 5")
    spec = _spec(probe_type=probe_type, probe_kind=probe_kind, probe_args={
        "weight": [0.1] * 5, "bias": 0.0, "threshold": 0.5, "action": "abort"})
    with pytest.raises(RouterError, match=rf"extraction_points\[0\] \(name 'guard'\): "
                                          rf"probe_type '{probe_type}' refuses it: inline "
                                          r"probe_args: the weight has 5 numbers per "
                                          r"activation but the model's hidden size is 128"):
        ProbedModel(tiny.backend, spec=spec)
    if probe_type == "linear_probe":
        with pytest.raises(RouterError, match="weight has 5 numbers"):  # (whatever check_metadata)
            ProbedModel(tiny.backend, spec=_spec(probe_type="linear_probe", probe_args={
                "weight": [0.1] * 5, "bias": 0.0, "check_metadata": False}))
    else:  # A trajectory of norms reads activations of any size.
        norms = _spec(probe_type="trajectory_probe", probe_kind="trajectory",
                      probe_args={"source": "norm"})
        output = ProbedModel(tiny.backend, spec=norms).generate("the cat", max_new_tokens=3)[0]
        assert output.results["guard"].error is None


def test_a_kv_point_is_not_held_to_the_hidden_size(tiny):
    # a kv activation is (2, kv heads, head dim): 2 * 2 * 64 = 256 values on the tiny model
    capabilities = tiny.capabilities()
    size = 2 * capabilities.num_kv_heads * capabilities.head_dim
    assert size != capabilities.hidden_size
    spec = _spec(tensor_type="kv", probe_type="linear_probe",
                 probe_args={"weight": [0.01] * size, "bias": 0.0})
    output = ProbedModel(tiny.backend, spec=spec).generate("the cat", max_new_tokens=3)[0]
    result = output.results["guard"]
    assert result.error is None and result.stats.processed == len(output.token_ids) - 1


class _CheckWithoutSize(Router):
    """A router whose ``check`` was written before it took ``hidden_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[list[str]] = []

    def check(self, points):  # type: ignore[override]
        self.checked.append([point.name for point in points])
        super().check(points)


def test_a_router_whose_check_takes_no_hidden_size_is_used_and_the_size_still_checked(tiny):
    # (ProbedModel called check(points, hidden_size=...) and a check(points) raised TypeError)
    router = _CheckWithoutSize()
    output = ProbedModel(tiny.backend, spec=_spec(), router=router).generate(
        "the cat", max_new_tokens=2)[0]
    assert router.checked == [["guard"]] and output.results["guard"].error is None
    wrong_size = _spec(probe_type="linear_probe", probe_args={
        "weight": [0.1] * 5, "bias": 0.0, "threshold": 0.5, "action": "abort"})
    with pytest.raises(RouterError, match=r"refuses it: inline probe_args: the weight has 5 "
                                          r"numbers per activation but the model's hidden "
                                          r"size is 128"):
        ProbedModel(tiny.backend, spec=wrong_size, router=_CheckWithoutSize())
    router.shutdown()
