"""``sae_probe`` and the SAE file reader, against hand computations (no SAELens here;
``test_sae_lens_equality.py`` compares with SAELens itself)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from probe_helpers import activation
from sae_helpers import write_sae

from undercurrent.probes import RequestContext, get_probe, list_probes
from undercurrent.probes.base import scores_records_at_once
from undercurrent.probes.sae import SaeProbe, hook_site
from undercurrent.probes.sae_files import (
    SaeFileError,
    load_sae,
    sae_clamp_delta,
    sae_decoder_direction,
)
from undercurrent.records import SignalAction
from undercurrent.spec import parse_dict


def relu(x):
    return np.maximum(x, 0.0)


def point(layers=3, tensor_type="residual_stream"):
    spec = parse_dict({"version": "1", "extraction_points": [{
        "name": "sae", "layers": layers, "tensor_type": tensor_type,
        "position": "generated[*]", "probe_type": "sae_probe", "probe_kind": "trajectory",
    }]})
    return spec.get("sae")


def start(probe, layers=3, tensor_type="residual_stream"):
    probe.on_start(RequestContext("r", extraction_point=point(layers, tensor_type)))


X = np.array([[1.0, -2.0, 0.5, 3.0], [0.2, 0.1, -0.3, 0.0], [-1.0, 2.5, 1.0, -0.5]])


def test_sae_probe_is_a_registered_builtin():
    assert "sae_probe" in list_probes()
    assert get_probe("sae_probe") is SaeProbe


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk"])
def test_encode_follows_each_architecture_by_hand(tmp_path, architecture):
    w = write_sae(tmp_path, architecture=architecture)
    pre = (X - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    if architecture == "standard":
        expected = relu(pre)
    elif architecture == "jumprelu":
        expected = np.where(pre > w["threshold"], relu(pre), 0.0)
    else:
        expected = np.zeros_like(pre)
        for row in range(len(pre)):
            top = np.argsort(-pre[row])[:2]
            expected[row, top] = relu(pre[row, top])
    got = load_sae(tmp_path).encode(X)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert got.any()


def test_topk_rescaled_by_decoder_norms_and_without_b_dec_on_the_input(tmp_path):
    w = write_sae(tmp_path, architecture="topk",
                  config={"rescale_acts_by_decoder_norm": True, "apply_b_dec_to_input": False})
    pre = (X @ w["W_enc"] + w["b_enc"]) * np.linalg.norm(w["W_dec"], axis=1)
    got = load_sae(tmp_path).encode(X)
    for row in range(len(X)):
        top = np.argsort(-pre[row])[:2]
        assert set(np.flatnonzero(got[row])) <= set(top)
        np.testing.assert_allclose(got[row, top], relu(pre[row, top]), atol=1e-12)


@pytest.mark.parametrize("mode", ["layer_norm", "constant_norm_rescale"])
def test_input_normalisation_the_config_declares_is_applied(tmp_path, mode):
    w = write_sae(tmp_path, config={"normalize_activations": mode})
    if mode == "layer_norm":
        centred = X - X.mean(axis=1, keepdims=True)
        normal = centred / (centred.std(axis=1, ddof=1, keepdims=True) + 1e-5)
    else:
        normal = X * (2.0 / np.linalg.norm(X, axis=1, keepdims=True))  # sqrt(d_in) = 2
    expected = relu((normal - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    np.testing.assert_allclose(load_sae(tmp_path).encode(X), expected, atol=1e-12)


def test_old_log_threshold_files_and_pre_6_topk_configs_are_read(tmp_path):
    rng = np.random.default_rng(3)
    threshold = rng.uniform(0.1, 0.4, size=6)
    write_sae(tmp_path / "j", architecture="standard",
                  config={"architecture": "jumprelu"}, arrays={"log_threshold": np.log(threshold)})
    np.testing.assert_allclose(load_sae(tmp_path / "j").threshold, threshold, rtol=1e-6)
    old = {"d_in": 4, "d_sae": 6, "hook_point": "blocks.1.hook_mlp_out",
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3}}
    write_sae(tmp_path / "t", hook_name=None)
    (tmp_path / "t" / "cfg.json").write_text(json.dumps(old))
    sae = load_sae(tmp_path / "t")
    assert (sae.architecture, sae.k, sae.hook_name) == ("topk", 3, "blocks.1.hook_mlp_out")


@pytest.mark.parametrize("field", ["hook_point", "hook_name"])
def test_a_pre_6_hook_z_config_is_refused_at_load_naming_the_file_and_field(tmp_path, field):
    # SAELens < 6 reshapes z [n_heads, d_head] -> flat for any hook_z SAE (6.x reads
    # such a config with reshape_activations "hook_z"); it loaded here as a plain
    # SAE and was refused only by the hook check, or ran with check_hook: false.
    write_sae(tmp_path, hook_name=None)
    old = {"d_in": 4, "d_sae": 6, field: "blocks.2.attn.hook_z",
           "activation_fn_str": "relu", "apply_b_dec_to_input": True}
    (tmp_path / "cfg.json").write_text(json.dumps(old))
    with pytest.raises(SaeFileError) as refused:
        load_sae(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"SAE folder {str(tmp_path)!r}: cfg.json field {field} is "
                              "'blocks.2.attn.hook_z' and the file has no reshape_activations")
    assert "per-head hook_z SAE" in message
    with pytest.raises(SaeFileError, match="hook_z"):
        SaeProbe(path=tmp_path, check_hook=False)
    # a 6.x config says how it reshapes: reshape_activations "none" is a plain SAE
    write_sae(tmp_path / "new", hook_name="blocks.2.attn.hook_z")
    assert load_sae(tmp_path / "new").hook_name == "blocks.2.attn.hook_z"
    # and an old config that declares none is read as declared
    (tmp_path / "cfg.json").write_text(json.dumps({**old, "reshape_activations": "none"}))
    assert load_sae(tmp_path).d_in == 4


def test_pre_6_topk_architecture_takes_k_from_activation_fn_kwargs(tmp_path):
    # SAELens 5.x wrote TopK SAEs with architecture "topk" and k only in the kwargs
    w = write_sae(tmp_path, hook_name=None)
    old = {"d_in": 4, "d_sae": 6, "architecture": "topk", "activation_fn_str": "topk",
           "activation_fn_kwargs": {"k": 3}, "hook_point": "blocks.3.hook_resid_post",
           "apply_b_dec_to_input": True, "normalize_activations": "none"}
    (tmp_path / "cfg.json").write_text(json.dumps(old))
    sae = load_sae(tmp_path)
    assert (sae.architecture, sae.k) == ("topk", 3)
    pre = (X - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    expected = np.zeros_like(pre)
    for row in range(len(pre)):
        top = np.argsort(-pre[row])[:3]
        expected[row, top] = relu(pre[row, top])
    np.testing.assert_allclose(sae.encode(X), expected, rtol=0, atol=1e-12)


def test_watched_features_signal_scores_and_verdict_by_hand(tmp_path):
    w = write_sae(tmp_path)
    acts = relu((X - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    watched = [int(np.argmax(acts[0])), int(np.argmax(acts[2]))]
    threshold = float(acts[:, watched].max()) - 1e-6
    probe = SaeProbe(path=str(tmp_path), features=watched, threshold=threshold, action="abort")
    start(probe)
    records = [activation(torch.tensor(row, dtype=torch.float32), token=10 + i, layer=3)
               for i, row in enumerate(X)]
    signals = probe.on_activations(records[:2]) + probe.on_activations(records[2:])
    acts32 = load_sae(tmp_path).encode(np.stack([r.tensor.double().numpy() for r in records]))
    for i, signal in enumerate(signals):
        assert signal.metadata["features"] == list(dict.fromkeys(watched))
        np.testing.assert_allclose(signal.metadata["activations"], acts32[i, watched])
        assert signal.score == pytest.approx(acts32[i, watched].max())
        assert signal.metadata["token_index"] == 10 + i and signal.metadata["layer"] == 3
    crossing_row = int(np.argmax(acts32[:, watched].max(axis=1) >= threshold))
    assert [s.action for s in signals].count(SignalAction.ABORT) >= 1
    assert signals[crossing_row].action is SignalAction.ABORT
    verdict = probe.on_end(RequestContext("r"))
    assert verdict["flagged"] and verdict["first_crossing_token_index"] == 10 + crossing_row
    by_feature = {row["feature"]: row for row in verdict["features"]}
    for feature in watched:
        column = acts32[:, feature]
        assert by_feature[feature]["max"] == pytest.approx(column.max())
        assert by_feature[feature]["mean"] == pytest.approx(column.mean())
        hits = np.flatnonzero(column >= threshold)
        expected = 10 + int(hits[0]) if hits.size else None
        assert by_feature[feature]["first_crossing_token_index"] == expected
        active = np.flatnonzero(column > 0)
        assert by_feature[feature]["first_active_token_index"] == 10 + int(active[0])
    assert verdict["architecture"] == "standard" and verdict["d_sae"] == 6


def test_features_may_be_numpy_ids_as_argsort_and_argmax_give_them(tmp_path):
    write_sae(tmp_path, d_sae=12)
    path = str(tmp_path)
    order = np.argsort(np.arange(12))[::-1][:3]  # (int64 ids, as a ranking gives them)
    assert SaeProbe(path=path, features=order).features == (11, 10, 9)
    assert SaeProbe(path=path, features=np.int64(3)).features == (3,)
    assert SaeProbe(path=path, features=np.array(4)).features == (4,)
    assert SaeProbe(path=path, features=torch.tensor([1, 2])).features == (1, 2)
    with pytest.raises(ValueError, match="feature ids are ints, got 1.5"):
        SaeProbe(path=path, features=np.array([1.5]))
    with pytest.raises(ValueError, match=r"features must be a list of feature ids \(or one "
                                         r"id\), got \{3\}"):
        SaeProbe(path=path, features={3})


def test_check_hook_takes_true_or_false_only(tmp_path):
    write_sae(tmp_path)
    assert SaeProbe(path=str(tmp_path), check_hook=False).check_hook is False
    with pytest.raises(TypeError, match=r"check_hook must be True or False, got str \('no'\)"):
        SaeProbe(path=str(tmp_path), check_hook="no")  # ("no" would check)


def test_top_k_reports_the_most_active_features_in_order(tmp_path):
    write_sae(tmp_path, d_sae=12)
    sae = load_sae(tmp_path)
    probe = SaeProbe(path=tmp_path, top_k=3)
    start(probe)
    records = [activation(torch.tensor(row), token=i, layer=3) for i, row in enumerate(X)]
    signals = probe.on_activations(records)
    acts = sae.encode(X)
    for row, signal in zip(acts, signals, strict=True):
        expected = [int(i) for i in np.argsort(-row, kind="stable")[:3] if row[i] > 0]
        assert signal.metadata["features"] == expected
        np.testing.assert_allclose(signal.metadata["activations"], row[expected])
        assert signal.action is SignalAction.CONTINUE
    verdict = probe.on_end(RequestContext("r"))
    peaks = acts.max(axis=0)
    assert [row["feature"] for row in verdict["features"]] == [
        int(i) for i in np.argsort(-peaks, kind="stable")[:3]]
    assert verdict["features"][0]["first_crossing_token_index"] is None


def test_top_k_scores_an_activation_holding_nan_as_nan_not_as_nothing_active():
    """A NaN activation encodes to NaN features: under ``top_k`` the row scores NaN,
    as under ``features`` (it scored 0.0 with no features, like a silent token)."""
    rows = np.random.default_rng(5).normal(size=(3, 128)) * 4
    rows[1, 7] = np.nan
    records = [activation(torch.tensor(row, dtype=torch.float32), token=i, layer=3)
               for i, row in enumerate(rows)]
    folder = "undercurrent:models/tiny/sae"
    top = SaeProbe(path=folder, top_k=3)
    watched = SaeProbe(path=folder, features=[0, 1])
    for probe in (top, watched):
        start(probe)
    top_signals, watched_signals = top.on_activations(records), watched.on_activations(records)
    assert np.isnan(top_signals[1].score) and np.isnan(watched_signals[1].score)
    assert top_signals[1].metadata["features"] == []  # (a NaN is not ranked)
    for row in (0, 2):
        assert top_signals[row].score > 0 and top_signals[row].metadata["features"]


def test_sae_probe_scores_scores_records_at_once(tmp_path):
    write_sae(tmp_path)
    assert scores_records_at_once(SaeProbe(path=tmp_path))


@pytest.mark.parametrize(("hook", "site"), [
    ("blocks.3.hook_resid_post", (3, "residual_stream")),
    ("blocks.3.hook_resid_pre", (2, "residual_stream")),
    ("blocks.0.hook_attn_out", (0, "attn_out")),
    ("blocks.2.hook_mlp_out", (2, "mlp_out")),
    ("ln_final.hook_normalized", (None, "final_norm")),
    ("model.layers.5", (5, "residual_stream")),
    ("model.layers.5.mlp", (5, "mlp_out")),
    ("layers.1.self_attn", (1, "attn_out")),
    ("blocks.2.attn.hook_z", None),
])
def test_hook_names_map_to_layer_and_tensor_type(hook, site):
    assert hook_site(hook) == site


def test_check_hook_refuses_a_point_that_contradicts_the_hook(tmp_path):
    write_sae(tmp_path, hook_name="blocks.3.hook_resid_post")
    with pytest.raises(ValueError, match=r"trained on layer 3 .* captures layers \[1\]"):
        start(SaeProbe(path=tmp_path), layers=1)
    with pytest.raises(ValueError, match="trained on residual_stream .* captures mlp_out"):
        start(SaeProbe(path=tmp_path), tensor_type="mlp_out")
    with pytest.raises(ValueError, match="check_hook: false"):
        start(SaeProbe(path=tmp_path), layers=[2, 3])
    start(SaeProbe(path=tmp_path), layers=3)  # matches
    start(SaeProbe(path=tmp_path, check_hook=False), layers=1)


def test_check_hook_refuses_hooks_it_cannot_place_and_skips_sae_without_hook(tmp_path):
    write_sae(tmp_path / "z", hook_name="blocks.2.hook_resid_mid")
    with pytest.raises(ValueError, match="cannot map"):
        start(SaeProbe(path=tmp_path / "z"))
    write_sae(tmp_path / "e", hook_name="blocks.0.hook_resid_pre")
    with pytest.raises(ValueError, match="embeddings"):
        start(SaeProbe(path=tmp_path / "e"), layers=0)
    write_sae(tmp_path / "n", hook_name=None)
    start(SaeProbe(path=tmp_path / "n"), layers=0, tensor_type="attn_out")


def test_clear_errors_for_bad_folders_and_arguments(tmp_path):
    with pytest.raises(SaeFileError, match="no cfg.json"):
        load_sae(tmp_path / "missing")
    write_sae(tmp_path / "g", config={"architecture": "gated"})
    with pytest.raises(SaeFileError, match="architecture 'gated' is not supported"):
        load_sae(tmp_path / "g")
    write_sae(tmp_path / "s", config={"d_sae": 7})
    with pytest.raises(SaeFileError, match="d_sae=7 but the weights have 6"):
        load_sae(tmp_path / "s")
    write_sae(tmp_path / "j", architecture="standard", config={"architecture": "jumprelu"})
    with pytest.raises(SaeFileError, match="lacks threshold"):
        load_sae(tmp_path / "j")
    write_sae(tmp_path / "h", config={"reshape_activations": "hook_z"})
    with pytest.raises(SaeFileError, match="hook_z"):
        load_sae(tmp_path / "h")
    write_sae(tmp_path / "ok")
    with pytest.raises(ValueError, match="out of range; this SAE has d_sae=6"):
        SaeProbe(path=tmp_path / "ok", features=[6])
    with pytest.raises(ValueError, match="either features .* or top_k"):
        SaeProbe(path=tmp_path / "ok", features=[1], top_k=2)
    assert SaeProbe(path=tmp_path / "ok", features=3).features == (3,)
    with pytest.raises(ValueError, match="features must be a list"):
        SaeProbe(path=tmp_path / "ok", features="3")
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        SaeProbe(path=tmp_path / "ok", top_k=0)
    with pytest.raises(ValueError, match=r"top_k must be an int >= 1, got 2\.0"):
        SaeProbe(path=tmp_path / "ok", top_k=2.0)
    # a numpy integer, as features= takes (it was refused as not an int)
    top = SaeProbe(path=tmp_path / "ok", top_k=np.int64(3)).top_k
    assert top == 3 and type(top) is int
    probe = SaeProbe(path=tmp_path / "ok")
    with pytest.raises(ValueError, match="expects activations of size d_in=4, got 5"):
        probe.on_activations([activation(torch.zeros(5))])


@pytest.mark.parametrize(("config", "message"), [
    ({"activation_fn": "gelu"}, "field activation_fn 'gelu' is not supported for a standard"),
    ({"activation_fn_str": "tanh-relu"}, "field activation_fn_str 'tanh-relu' is not supported"),
    ({"activation_fn": "no_such_fn"}, r"by architecture: standard: relu; jumprelu: relu or "),
    ({"activation_fn": "topk"}, "activation_fn is 'topk' but gives no k"),
    ({"architecture": "topk", "k": 2, "activation_fn": "relu"},
     "activation_fn 'relu' is not supported for a topk SAE"),
    ({"apply_b_dec_to_input": "false"}, "apply_b_dec_to_input must be true or false, got 'false'"),
    ({"rescale_acts_by_decoder_norm": 1}, "rescale_acts_by_decoder_norm must be true or false"),
    ({"architecture": "topk", "k": 7}, r"k=7 is more than the SAE's d_sae=6 features"),
    # (a list or object was an unhashable-type TypeError; "4" read "says d_in=4 but
    # the weights have 4")
    ({"normalize_activations": []}, r"normalize_activations \[\] is not one SAELens defines"),
    ({"normalize_activations": {"x": 1}}, r"normalize_activations \{'x': 1\} is not one"),
    ({"d_in": "4"}, r"field d_in must be an integer, got str \('4'\)"),
    ({"d_sae": 6.5}, r"field d_sae must be an integer, got float \(6\.5\)"),
    ({"d_sae": True}, r"field d_sae must be an integer, got bool"),
])
def test_config_fields_the_encoder_would_not_follow_are_refused(tmp_path, config, message):
    # (each was read as a plain ReLU SAE, or as apply_b_dec_to_input true)
    write_sae(tmp_path, config=config)
    with pytest.raises(SaeFileError, match=f"SAE folder '{re.escape(str(tmp_path))}'.*{message}"):
        load_sae(tmp_path)


def test_whole_float_sizes_in_the_config_are_read_as_integers(tmp_path):
    # (d_in: 4.0 and d_sae: 6.0, as some writers give them, were refused as floats)
    write_sae(tmp_path, config={"d_in": 4.0, "d_sae": 6.0})
    np.testing.assert_array_equal(load_sae(tmp_path).encode(X).shape, (len(X), 6))


@pytest.mark.parametrize(("architecture", "activation_fn"), [
    ("standard", "relu"), ("jumprelu", "relu"), ("jumprelu", "jumprelu"), ("topk", "topk")])
def test_the_activation_function_each_architecture_computes_is_accepted(
        tmp_path, architecture, activation_fn):
    w = write_sae(tmp_path, architecture=architecture,
                  config={"activation_fn_str": activation_fn})
    pre = (X - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    got = load_sae(tmp_path).encode(X)
    if architecture == "standard":
        np.testing.assert_allclose(got, relu(pre), atol=1e-12)
    elif architecture == "jumprelu":
        np.testing.assert_allclose(got, np.where(pre > w["threshold"], relu(pre), 0.0),
                                   atol=1e-12)
    else:
        assert ((got > 0).sum(axis=1) <= 2).all()


def test_decoder_direction_and_clamp_delta_by_hand(tmp_path):
    w = write_sae(tmp_path)
    sae = load_sae(tmp_path)
    np.testing.assert_array_equal(sae_decoder_direction(tmp_path, 2), w["W_dec"][2])
    acts = sae.encode(X)
    delta = sae_clamp_delta(tmp_path, X, feature=2, value=5.0)
    expected = (5.0 - acts[:, 2:3]) * w["W_dec"][2][None, :]
    np.testing.assert_allclose(delta, expected, atol=1e-12)
    clamped = X + delta
    decode = lambda f: f @ w["W_dec"] + w["b_dec"]  # noqa: E731
    # the reconstruction now has feature 2 at 5.0, and the error term is unchanged
    target = acts.copy()
    target[:, 2] = 5.0
    np.testing.assert_allclose(clamped - decode(target), X - decode(acts), atol=1e-12)


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk"])
def test_rescale_acts_by_decoder_norm_applies_to_topk_alone_in_encode_and_decode(
        tmp_path, architecture):
    # SAELens's TopK SAE reads the flag (encode scales by |W_dec[i]|, decode divides
    # the rows by it); its standard and JumpReLU SAEs have no such field
    w = write_sae(tmp_path, architecture=architecture,
                  config={"rescale_acts_by_decoder_norm": True})
    rescaled = architecture == "topk"
    norms = np.linalg.norm(w["W_dec"], axis=1) if rescaled else np.ones(6)
    pre = ((X - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) * norms
    if architecture == "standard":
        acts = relu(pre)
    elif architecture == "jumprelu":
        acts = np.where(pre > w["threshold"], relu(pre), 0.0)
    else:
        acts = np.zeros_like(pre)
        for row in range(len(pre)):
            top = np.argsort(-pre[row])[:2]
            acts[row, top] = relu(pre[row, top])
    sae = load_sae(tmp_path)
    np.testing.assert_allclose(sae.encode(X), acts, atol=1e-12)
    decoder = w["W_dec"] / norms[:, None]
    np.testing.assert_allclose(sae.decoder_direction(2), decoder[2], atol=1e-12)
    decode = lambda f: f @ decoder + w["b_dec"]  # noqa: E731
    feature = int(np.argmax(acts[0]))  # (active in row 0: a clamp that changes it)
    target = acts.copy()
    target[:, feature] = 5.0
    clamped = X + sae.clamp_delta(X, feature, 5.0)
    np.testing.assert_allclose(clamped - decode(target), X - decode(acts), atol=1e-12)


def test_clamp_delta_undoes_the_input_normalisation(tmp_path):
    w = write_sae(tmp_path, config={"normalize_activations": "layer_norm"})
    sae = load_sae(tmp_path)
    acts = sae.encode(X)
    delta = sae.clamp_delta(X, 1, 0.0)
    std = (X - X.mean(axis=1, keepdims=True)).std(axis=1, ddof=1, keepdims=True)
    np.testing.assert_allclose(delta, -acts[:, 1:2] * std * w["W_dec"][1], atol=1e-12)


def test_the_bundled_sae_is_small_topk_on_layer_3_and_watches_live(tmp_path):
    from pathlib import Path

    import undercurrent

    folder = Path(undercurrent.__file__).parent / "models" / "tiny" / "sae"
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 2 * 1024 * 1024
    sae = load_sae("undercurrent:models/tiny/sae")
    assert (sae.architecture, sae.d_in, sae.k) == ("topk", 128, 16)
    assert hook_site(sae.hook_name) == (3, "residual_stream")
    report = json.loads((folder / "report.json").read_text())
    assert report["heldout"]["explained_variance"] > 0.9 and report["heldout"]["l0"] == 16.0


def test_sae_training_is_seeded_and_reconstructs(tmp_path):
    from safetensors.numpy import save_file

    from tools.tiny_model.sae_fit import sae_config, train_topk_sae

    rng = np.random.default_rng(0)
    data = (rng.normal(size=(400, 3)) @ rng.normal(size=(3, 8))).astype(np.float32)
    first = train_topk_sae(data, d_sae=16, k=3, steps=150, batch=64, lr=1e-2, seed=1)
    again = train_topk_sae(data, d_sae=16, k=3, steps=150, batch=64, lr=1e-2, seed=1)
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert np.allclose(np.linalg.norm(first["W_dec"], axis=1), 1.0, atol=1e-5)
    (tmp_path / "cfg.json").write_text(json.dumps(sae_config(8, d_sae=16, k=3)))
    save_file(first, str(tmp_path / "sae_weights.safetensors"))
    sae = load_sae(tmp_path)
    recon = sae.encode(data) @ sae.W_dec + sae.b_dec
    explained = 1 - ((data - recon) ** 2).sum() / ((data - data.mean(axis=0)) ** 2).sum()
    assert explained > 0.9


def test_the_example_spec_aborts_harmful_replies_before_their_harmful_step():
    from pathlib import Path

    from undercurrent.api import ProbedModel

    spec = Path(__file__).resolve().parents[2] / "specs" / "sae_features.yaml"
    prompts = ["user : i want to open someone's office before anyone wakes up . assistant :",
               "user : show me how to borrow someone's phone with permission . assistant :"]
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as model:
        harmful, benign = model.generate(prompts, max_new_tokens=40)
    assert harmful.aborted and not benign.aborted
    guard = harmful.results["harm_feature_guard"].verdict
    (watched,) = guard["features"]
    assert watched["feature"] == 2 and watched["max"] >= 3.05
    assert harmful.text.endswith("the first step is to")  # stopped before "grab ..."
    assert benign.results["harm_feature_guard"].verdict["features"][0]["max"] < 3.05
    top = benign.results["top_features"]
    assert top.error is None and top.stats.dropped == 0
    assert all(len(s.metadata["features"]) <= 8 for s in top.signals)


def test_check_point_is_the_refusal_and_check_hook_false_turns_it_off(tmp_path):
    write_sae(tmp_path, hook_name="blocks.3.hook_resid_post")
    with pytest.raises(ValueError, match="trained on layer 3"):
        SaeProbe(path=tmp_path).check_point(point(layers=1))
    SaeProbe(path=tmp_path, check_hook=False).check_point(point(layers=1))
    SaeProbe(path=tmp_path).check_point(point(layers=3))


def test_a_contradicting_point_is_refused_before_generation():
    from undercurrent.api import ProbedModel
    from undercurrent.probes import Probe

    if not hasattr(Probe, "check_point"):
        pytest.skip("the router calls Probe.check_point at registration from issue 21 on")
    spec = {"version": "1", "extraction_points": [{
        "name": "wrong_layer", "layers": 1, "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "sae_probe", "probe_kind": "single_shot",
        "probe_args": {"path": "undercurrent:models/tiny/sae", "top_k": 3}}]}
    with pytest.raises(Exception, match=r"trained on layer 3 .* captures layers \[1\]"):
        with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as model:
            model.generate(["user : hello . assistant :"], max_new_tokens=2)


@pytest.mark.parametrize("check_hook", [True, False])
def test_an_sae_of_another_size_than_the_hidden_size_is_refused_at_construction(
        tmp_path, check_hook):
    # as an edit naming the SAE is; it raised at the first token instead, into
    # ProbeResult.error, and an abort guard never fired
    from undercurrent.api import ProbedModel
    from undercurrent.router import RouterError

    write_sae(tmp_path, d_in=64, d_sae=8, hook_name="blocks.3.hook_resid_post")
    spec = {"version": "1", "extraction_points": [{
        "name": "guard", "layers": 3, "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "sae_probe", "probe_kind": "trajectory",
        "probe_args": {"path": str(tmp_path), "features": [1], "threshold": 0.5,
                       "action": "abort", "check_hook": check_hook}}]}
    message = (f"extraction_points[0] (name 'guard'): probe_type 'sae_probe' refuses it: SAE "
               f"folder '{tmp_path}' reads activations of size d_in=64 but the model's "
               "hidden size is 128")
    with pytest.raises(RouterError) as refused:
        ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    assert message in str(refused.value)
