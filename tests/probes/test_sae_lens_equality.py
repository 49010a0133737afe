"""``sae_probe``'s feature activations equal SAELens's own ``encode``.

Each SAE is built with SAELens's classes and written with SAELens's ``save_model``
(plus the bundled SAE, written by ``tools.tiny_model.sae_fit``);
the bundled model generates through ``ProbedModel`` (HF backend, float32) with one
``sae_probe`` point per SAE watching every feature; SAELens then loads the same
folder and encodes the records' tensors. SAELens is the oracle here, so the test
needs the ``sae`` extra (``make test`` installs it).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

from undercurrent.api import ProbedModel
from undercurrent.probes.sae_files import load_sae, resolve_sae_folder

D_IN, D_SAE, LAYER = 128, 48, 3
PROMPTS = ["user : how do i open my own door ? assistant :",
           "user : i want to take someone's car so nobody finds out . assistant :"]
# (name, config class, SAE class, config fields): every architecture sae_probe reads,
# and every input normalisation SAELens applies at inference.
CASES = [
    ("standard", "StandardSAEConfig", "StandardSAE", {}),
    ("standard_layer_norm", "StandardSAEConfig", "StandardSAE",
     {"normalize_activations": "layer_norm"}),
    ("standard_no_b_dec_in", "StandardSAEConfig", "StandardSAE",
     {"apply_b_dec_to_input": False}),
    ("jumprelu", "JumpReLUSAEConfig", "JumpReLUSAE", {}),
    ("jumprelu_norm_rescale", "JumpReLUSAEConfig", "JumpReLUSAE",
     {"normalize_activations": "constant_norm_rescale"}),
    ("topk", "TopKSAEConfig", "TopKSAE", {"k": 6}),
    ("topk_rescaled", "TopKSAEConfig", "TopKSAE",
     {"k": 6, "rescale_acts_by_decoder_norm": True}),
]


def build_sae(folder, config_name, class_name, fields, seed):
    """An SAELens SAE with random (non-trivial) weights, saved by SAELens."""
    torch.manual_seed(seed)
    config = getattr(sae_lens, config_name)(
        d_in=D_IN, d_sae=D_SAE,
        metadata=SAEMetadata(hook_name=f"blocks.{LAYER}.hook_resid_post",
                             model_name="undercurrent/tiny"),
        **fields)
    sae = getattr(sae_lens, class_name)(config)
    with torch.no_grad():
        sae.W_enc.normal_(0.0, 0.15)
        sae.b_enc.normal_(0.0, 0.5)
        sae.b_dec.normal_(0.0, 0.5)
        if hasattr(sae, "threshold"):
            sae.threshold.uniform_(0.0, 1.0)
    sae.save_model(folder)
    return folder


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    folders = {name: build_sae(root / name, config, cls, fields, seed)
               for seed, (name, config, cls, fields) in enumerate(CASES)}
    folders["bundled"] = resolve_sae_folder("undercurrent:models/tiny/sae")
    spec = {"version": "1", "extraction_points": [{
        "name": name, "layers": LAYER, "tensor_type": "residual_stream",
        "position": "generated[*]", "probe_type": "sae_probe", "probe_kind": "trajectory",
        "probe_args": {"path": str(folder), "features": list(range(load_sae(folder).d_sae))},
    } for name, folder in folders.items()]}
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as model:
        outputs = model.generate(PROMPTS, max_new_tokens=12, records=True)
    return folders, outputs


def probe_and_records(outputs, name):
    """(feature activations from the probe's signals, the records' tensors), in order."""
    acts, tensors = [], []
    for output in outputs:
        result = output.results[name]
        assert result.error is None, result.error
        records = [r for r in output.records if r.extraction_point_name == name]
        assert len(records) == len(result.signals) > 0
        for record, signal in zip(records, result.signals, strict=True):
            assert signal.metadata["token_index"] == record.token_index
            acts.append(signal.metadata["activations"])
            tensors.append(record.tensor)
    return np.array(acts), torch.stack(tensors)


@pytest.mark.parametrize("case", [case[0] for case in CASES] + ["bundled"])
def test_sae_probe_features_equal_sae_lens_encode_on_the_records(generated, case):
    folders, outputs = generated
    acts, tensors = probe_and_records(outputs, case)
    assert tensors.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference32 = sae_lens.SAE.load_from_disk(folders[case])
        reference64 = sae_lens.SAE.load_from_disk(folders[case], dtype="float64")
    with torch.no_grad():
        expected32 = reference32.encode(tensors).double().numpy()
        expected64 = reference64.encode(tensors.double()).numpy()
    assert (expected64 > 0).sum() > acts.shape[0], "the SAE must have active features"
    # SAELens in float64 is the same arithmetic as the probe's
    assert np.abs(acts - expected64).max() <= 1e-9
    # SAELens in its saved float32: equal to 1e-5 relative to the activations' scale
    scale = max(1.0, float(np.abs(expected32).max()))
    assert np.abs(acts - expected32).max() <= 1e-5 * scale
    assert np.array_equal(acts > 0, expected64 > 0)


@pytest.mark.parametrize("case", ["standard", "standard_layer_norm", "topk_rescaled"])
def test_clamp_delta_matches_sae_lens_decode_and_keeps_the_error_term(generated, case):
    folders, outputs = generated
    _, tensors = probe_and_records(outputs, case)
    h = tensors.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = sae_lens.SAE.load_from_disk(folders[case], dtype="float64")
    feature, value = 5, 3.0
    with torch.no_grad():
        acts = reference.encode(h)
        recon = reference.decode(acts)  # encode sets the normalisation decode undoes
        clamped_acts = acts.clone()
        clamped_acts[:, feature] = value
        reference.encode(h)
        clamped_recon = reference.decode(clamped_acts)
    delta = load_sae(folders[case]).clamp_delta(h.numpy(), feature, value)
    np.testing.assert_allclose(delta, (clamped_recon - recon).numpy(), atol=1e-9)
    h_new = h.numpy() + delta
    # error term (h - reconstruction) untouched; the reconstruction carries the clamp
    np.testing.assert_allclose(h_new - clamped_recon.numpy(), (h - recon).numpy(), atol=1e-9)


@pytest.mark.parametrize("case", [case[0] for case in CASES])
def test_an_activation_holding_nan_encodes_to_nan_features_as_in_sae_lens(generated, case):
    # A jumprelu SAE encoded a NaN activation as no feature active (0 everywhere,
    # a silent token); SAELens gives NaN. (topk: k NaN features, as SAELens, at
    # columns either may pick among the tied NaN.)
    folders, outputs = generated
    _, tensors = probe_and_records(outputs, case)
    h = tensors[:3].double().clone()
    h[1, 5] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = sae_lens.SAE.load_from_disk(folders[case], dtype="float64")
    with torch.no_grad():
        expected = reference.encode(h).numpy()
    sae = load_sae(folders[case])
    for acts in (sae.encode(h.numpy()), sae.encode_sparse(h.numpy()).dense()):
        assert np.isnan(expected[1]).sum() == np.isnan(acts[1]).sum() > 0
        np.testing.assert_allclose(acts[[0, 2]], expected[[0, 2]], rtol=0, atol=1e-9)
        if not case.startswith("topk"):
            assert np.array_equal(np.isnan(acts), np.isnan(expected))
