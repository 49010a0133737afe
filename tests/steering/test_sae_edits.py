"""Edits with SAE feature directions, on the bundled model and its bundled SAE
(TopK, k=16, on layer 3's residual stream), checked against a hook written here
that reads the SAE's safetensors itself and does the arithmetic in float64."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from oracles import PROMPTS, hooked_generate, probed_generate  # noqa: E402

import undercurrent  # noqa: E402
from undercurrent import ProbedModel  # noqa: E402
from undercurrent.spec import Edit, ExtractionPoint, SpecValidationError  # noqa: E402

SAE = "undercurrent:models/tiny/sae"
FOLDER = Path(undercurrent.__file__).parent / "models" / "tiny" / "sae"
LAYER = 3            # cfg.json: blocks.3.hook_resid_post
FEATURE = 2          # the bundled SAE's "harmful" feature
CLAMP = 12.0
NEW = 10


class HandSae:
    """The bundled TopK SAE from its files: pre-activations, codes, decode."""

    def __init__(self) -> None:
        config = json.loads((FOLDER / "cfg.json").read_text())
        assert config["architecture"] == "topk" and config["apply_b_dec_to_input"]
        assert config["normalize_activations"] == "none"
        assert not config["rescale_acts_by_decoder_norm"]
        assert config["metadata"]["hook_name"] == f"blocks.{LAYER}.hook_resid_post"
        self.k = config["k"]
        weights = safetensors_torch.load_file(str(FOLDER / "sae_weights.safetensors"))
        self.w = {name: array.double() for name, array in weights.items()}

    def pre(self, h: torch.Tensor) -> torch.Tensor:
        return (h.double() - self.w["b_dec"]) @ self.w["W_enc"] + self.w["b_enc"]

    def codes(self, h: torch.Tensor) -> torch.Tensor:
        pre = self.pre(h)
        top = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.clamp(min=0.0))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes @ self.w["W_dec"] + self.w["b_dec"]

    def clamped(self, h: torch.Tensor, c: float) -> torch.Tensor:
        """h + (c - f_i(h)) * W_dec[i], in h's dtype."""
        f = self.codes(h)[..., FEATURE : FEATURE + 1]
        return (h.double() + (c - f) * self.w["W_dec"][FEATURE]).to(h.dtype)


@pytest.fixture(scope="module")
def hand_sae():
    return HandSae()


def sae_edit(op: str, coefficient: float, vector=None) -> Edit:
    vector = {"sae": SAE, "feature": FEATURE} if vector is None else vector
    return Edit(name="feature", layers=LAYER, tensor_type="residual_stream",
                position="generated[*]", op=op, vector=vector, coefficient=coefficient)


def decode_forwards(change, seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]):
    """A hand hook body: on every decode forward, ``change`` each row; keeps (h, h')
    by (forward, row)."""
    def edit_rows(forward: int, hidden: torch.Tensor):
        if forward < 1 or hidden.shape[1] != 1:
            return None
        out = hidden.clone()
        for row in range(hidden.shape[0]):
            out[row, 0] = change(hidden[row, 0])
            seen[(forward, row)] = (hidden[row, 0].clone(), out[row, 0].clone())
        return out
    return edit_rows


def test_clamp_on_a_feature_equals_a_hand_hook_and_keeps_the_error_term(tiny, hand_sae):
    point = ExtractionPoint(name="site", layers=LAYER, tensor_type="residual_stream",
                            position="generated[*]", probe_type="norm_probe",
                            probe_kind="single_shot")
    seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    expected, oracle = hooked_generate(
        tiny, PROMPTS, NEW, LAYER, "residual_stream",
        decode_forwards(lambda h: hand_sae.clamped(h, CLAMP), seen))
    plain, _ = hooked_generate(tiny, PROMPTS, NEW, LAYER, "residual_stream", lambda f, h: None)
    with ProbedModel(tiny.backend.model, tiny.backend.tokenizer, spec=[point]) as probed:
        outputs, recorded = probed_generate(probed, PROMPTS, NEW, records=True,
                                            edits=[sae_edit("clamp", CLAMP)])
    assert [list(o.token_ids) for o in outputs] == expected
    assert expected != plain  # the clamp changes what the model writes
    checked = 0
    for row, output in enumerate(outputs):
        count = len(output.token_ids)
        torch.testing.assert_close(recorded.row(row, count), oracle.row(row, count),
                                   rtol=1e-5, atol=1e-5)
        for record in output.records:
            assert record.edits == ("feature",)
            # the pass feeding generated token g is decode forward g + 1
            h, h_oracle = seen[(record.generated_index + 1, row)]
            edited = torch.as_tensor(record.tensor)
            torch.testing.assert_close(edited, h_oracle, rtol=1e-5, atol=1e-5)
            codes = hand_sae.codes(h)
            f = float(codes[FEATURE])
            # the SAE's code with feature i set to c, decoded, plus the old error term
            target = codes.clone()
            target[FEATURE] = CLAMP
            error_before = h.double() - hand_sae.decode(codes)
            error_after = edited.double() - hand_sae.decode(target)
            torch.testing.assert_close(error_after, error_before, rtol=0, atol=1e-5)
            # re-encoded, the pre-activation along i moves by (c - f) * (W_enc[:, i] . W_dec[i])
            gain = float(hand_sae.w["W_enc"][:, FEATURE] @ hand_sae.w["W_dec"][FEATURE])
            moved = float(hand_sae.pre(edited)[FEATURE] - hand_sae.pre(h)[FEATURE])
            assert moved == pytest.approx((CLAMP - f) * gain, abs=1e-4)
            checked += 1
    assert checked >= 3 * (NEW - 1) - 3


def test_add_with_a_feature_equals_add_with_its_decoder_row_as_a_list(tiny, hand_sae):
    row = hand_sae.w["W_dec"][FEATURE].float()
    by_feature = tiny.generate(PROMPTS, max_new_tokens=NEW, edits=[sae_edit("add", 6.0)])
    by_list = tiny.generate(PROMPTS, max_new_tokens=NEW,
                            edits=[sae_edit("add", 6.0, vector=row.tolist())])
    plain = tiny.generate(PROMPTS, max_new_tokens=NEW)
    assert [o.token_ids for o in by_feature] == [o.token_ids for o in by_list]
    assert [o.token_ids for o in by_feature] != [o.token_ids for o in plain]


def test_a_feature_edit_in_a_spec_round_trips_and_bad_ones_name_the_edit(tiny):
    from undercurrent.spec import edit_to_dict
    from undercurrent.spec.loader import parse_edit

    edit = sae_edit("clamp", 0.0)
    assert edit_to_dict(edit)["vector"] == {"sae": SAE, "feature": FEATURE}
    assert parse_edit(edit_to_dict(edit)) == edit
    with pytest.raises(SpecValidationError, match=r"edits\[0\] \(name 'feature'\), "
                                                  r"field 'vector': .*lacks feature"):
        parse_edit({**edit_to_dict(edit), "vector": {"sae": SAE}})
    with pytest.raises(SpecValidationError, match=r"field 'vector': .*feature 512 out of "
                                                  r"range; this SAE has d_sae=512"):
        tiny.generate(PROMPTS[:1], max_new_tokens=1,
                      edits=[sae_edit("clamp", 0.0, {"sae": SAE, "feature": 512})])
    with pytest.raises(SpecValidationError, match=r"field 'vector': SAE folder .*no cfg.json"):
        tiny.generate(PROMPTS[:1], max_new_tokens=1,
                      edits=[sae_edit("add", 1.0, {"sae": "/nonexistent", "feature": 0})])
