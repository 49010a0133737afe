"""Item 3: bad generation input. Each case either fails with a clear error before
anything runs (naming what was wrong and what would be right) or has the
documented outcome asserted here; either way no hook and no live request is left
behind, and the same ``ProbedModel`` then generates exactly what a fresh one does."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from reliability_support import (  # noqa: E402
    MAX_POSITIONS,
    TEST_PROBES,
    check_accounting,
    live_hooks,
    point,
    prompt,
)

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.adapters.base import BackendError  # noqa: E402
from undercurrent.adapters.capabilities import Capabilities, CapabilityError  # noqa: E402
from undercurrent.adapters.hf.architectures import UnsupportedArchitectureError  # noqa: E402
from undercurrent.spec import SpecValidationError  # noqa: E402
from undercurrent.spec.types import TensorType  # noqa: E402

SPEC = [point("last_prompt", probe_type="recorder", position="prompt[-1]"),
        point("generated", probe_type="recorder")]


@pytest.fixture(scope="module")
def probed(tiny: tuple[Any, Any]) -> Any:
    model, tokenizer = tiny
    with ProbedModel(model, tokenizer, spec=SPEC, probes=TEST_PROBES) as pm:
        yield pm


@pytest.fixture(scope="module")
def reference(probed: Any) -> Any:
    return probed.generate([prompt(1, 2, 3)], max_new_tokens=5)[0]


def _still_healthy(pm: Any, reference: Any) -> None:
    assert live_hooks(pm.backend.model) == 0
    assert pm.router.live_requests() == ()
    again = pm.generate([prompt(1, 2, 3)], max_new_tokens=5)[0]
    assert again.token_ids == reference.token_ids
    assert again.results["generated"].verdict == reference.results["generated"].verdict


CALL_ERRORS = [
    # (label, generate kwargs, exception, message fragment)
    ("prompts=None", {"prompts": None}, TypeError, "prompts must be a string or a list"),
    ("prompts=int", {"prompts": 123}, TypeError, "got int"),
    ("prompts=bytes", {"prompts": b"t1 t2"}, TypeError, "got bytes"),
    ("prompts=dict", {"prompts": {"t1": 1}}, TypeError, "got dict"),
    ("prompt token ids", {"prompts": [1, 2, 3]}, TypeError, "prompts[0] is int"),
    ("one bad prompt", {"prompts": ["t1", None]}, TypeError, "prompts[1] is NoneType"),
    ("nested list", {"prompts": [["t1"]]}, TypeError, "prompts[0] is list"),
    ("max_new_tokens=0", {"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
    ("max_new_tokens=-1", {"max_new_tokens": -1}, ValueError, "max_new_tokens must be >= 1"),
    ("max_new_tokens=2.5", {"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int"),
    ("max_new_tokens='5'", {"max_new_tokens": "5"}, TypeError, "max_new_tokens must be an int"),
    ("max_new_tokens=None", {"max_new_tokens": None}, TypeError, "max_new_tokens must be an"),
    ("max_new_tokens=True", {"max_new_tokens": True}, TypeError, "got bool"),
    ("temperature<0", {"temperature": -1.0}, ValueError, "temperature must be >= 0"),
    ("temperature=1e-39", {"temperature": 1e-39}, ValueError,
     "temperature must be 0 (greedy) or >= 0.01, got 1e-39"),
    ("temperature str", {"temperature": "hot"}, TypeError, "temperature must be a number"),
    ("top_p=0", {"top_p": 0.0}, ValueError, "top_p must be in (0, 1]"),
    ("top_k=0", {"top_k": 0}, ValueError, "top_k must be >= 1"),
    ("stop=[int]", {"stop": [3]}, TypeError, "stop must be a string or a list of strings"),
    ("stop=int", {"stop": 5}, TypeError, "stop must be a string or a list of strings, got int"),
    ("stop=bytes", {"stop": b"you"}, TypeError,
     "stop must be a string or a list of strings, got bytes"),
    ("duplicate ids", {"prompts": ["t1", "t2"], "request_ids": ["a", "a"]}, ValueError,
     "request_ids must be unique"),
    ("too long prompt", {"prompts": [prompt(*range(MAX_POSITIONS + 10))]}, ValueError,
     f"the model's context is {MAX_POSITIONS}: shorten the prompt"),
    ("prompt + new tokens too long", {"prompts": [prompt(*range(MAX_POSITIONS - 3))],
                                      "max_new_tokens": 8}, ValueError,
     "use max_new_tokens <= 3"),
    ("second prompt too long", {"prompts": ["t1", prompt(*range(MAX_POSITIONS))]}, ValueError,
     "prompt 1 has"),
]


@pytest.mark.parametrize(("kwargs", "error", "fragment"),
                         [case[1:] for case in CALL_ERRORS], ids=[c[0] for c in CALL_ERRORS])
def test_bad_call_arguments_fail_clearly_before_generation(probed, reference, kwargs, error,
                                                           fragment) -> None:
    call = {"prompts": [prompt(1, 2)], "max_new_tokens": 3, **kwargs}
    prompts = call.pop("prompts")
    with pytest.raises(error) as caught:
        probed.generate(prompts, **call)
    assert fragment in str(caught.value)
    _still_healthy(probed, reference)


@pytest.mark.parametrize("bad", [None, ["t1"], 5, b"t1"], ids=["None", "list", "int", "bytes"])
def test_stream_takes_one_prompt_string(probed, reference, bad) -> None:
    with pytest.raises(TypeError, match="stream\\(\\) takes one prompt string"):
        next(iter(probed.stream(bad, max_new_tokens=2)))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        next(iter(probed.stream("t1", max_new_tokens=0)))
    _still_healthy(probed, reference)


def test_an_empty_prompt_generates_from_the_bos_token_alone(probed, reference) -> None:
    # Documented outcome: a tokenizer that adds <bos> turns "" into one token, and
    # "prompt[-1]" is that token.
    for text in ("", "   "):
        (output,) = probed.generate([text], max_new_tokens=3)
        assert output.prompt_token_ids == (1,) and len(output.token_ids) == 3
        assert output.results["last_prompt"].verdict == {"seen": [0]}
        for result in output.results.values():
            check_accounting(result)
    assert probed.generate([], max_new_tokens=3) == []
    _still_healthy(probed, reference)


def test_a_prompt_that_encodes_to_no_tokens_is_a_clear_error(tiny, reference) -> None:
    model, tokenizer = tiny

    class NoBos:
        """The tiny tokenizer without its <bos> template: "" encodes to nothing."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.pad_token_id, self.eos_token_id = inner.pad_token_id, inner.eos_token_id

        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": self.inner(text, add_special_tokens=False)["input_ids"]}

        def decode(self, ids: Any, **kwargs: Any) -> str:
            return self.inner.decode(ids, **kwargs)

    with ProbedModel(model, NoBos(tokenizer), spec=SPEC, probes=TEST_PROBES) as pm:
        with pytest.raises(ValueError, match=r"prompts\[1\] \(''\) encodes to no tokens"):
            pm.generate(["t1", ""], max_new_tokens=2)
        assert live_hooks(model) == 0 and pm.router.live_requests() == ()
        assert len(pm.generate(["t1"], max_new_tokens=2)[0].token_ids) == 2


REGISTRATION_ERRORS = [
    ("layer past the last", {"layers": (2,)}, "layer(s) [2] out of range", "valid: 0..1"),
    ("final_norm not at N", {"tensor_type": "final_norm", "layers": (0,)},
     "out of range for final_norm", "layer N = 2"),
    ("residual at N", {"layers": (2,), "tensor_type": "mlp_out"}, "[2] out of range",
     "valid: 0..1"),
]


@pytest.mark.parametrize(("fields", "fragment", "hint"), [c[1:] for c in REGISTRATION_ERRORS],
                         ids=[c[0] for c in REGISTRATION_ERRORS])
def test_unknown_layers_are_refused_at_registration(tiny, fields, fragment, hint) -> None:
    model, tokenizer = tiny
    with pytest.raises(CapabilityError) as caught:
        ProbedModel(model, tokenizer, spec=[point("bad", **fields)])
    assert "'bad'" in str(caught.value) and fragment in str(caught.value)
    assert hint in str(caught.value)
    assert live_hooks(model) == 0


def test_a_negative_layer_in_a_list_of_points_is_refused_as_in_a_yaml_spec(tiny) -> None:
    model, tokenizer = tiny
    with pytest.raises(SpecValidationError, match="extraction_points\\[0\\] \\(name 'bad'\\), "
                       "field 'layers': is -1; layer indices start at 0"):
        ProbedModel(model, tokenizer, spec=[point("bad", layers=(-1,))])
    assert live_hooks(model) == 0


def test_an_unknown_tensor_type_is_refused_by_every_spec_route(tiny) -> None:
    model, tokenizer = tiny
    raw = {"name": "x", "layers": 0, "tensor_type": "logits", "position": "prompt[-1]",
           "probe_type": "norm_probe", "probe_kind": "single_shot"}
    yaml_text = "extraction_points:\n  - " + "\n    ".join(f"{k}: {v}" for k, v in raw.items())
    for spec in ({"extraction_points": [raw]}, yaml_text):
        with pytest.raises(SpecValidationError, match="'logits' is not allowed; expected one "
                                                      "of: residual_stream"):
            ProbedModel(model, tokenizer, spec=spec)
    # Built by hand, the same message, naming the point (a SpecValidationError is
    # a ValueError too).
    with pytest.raises(SpecValidationError, match="extraction point 'x', field 'tensor_type': "
                                                  "'logits' is not allowed; expected one of: "
                                                  "residual_stream"):
        point("x", tensor_type="logits")


def test_a_tensor_type_the_backend_cannot_capture_is_refused_at_registration(tiny) -> None:
    model, tokenizer = tiny
    from undercurrent.adapters.hf.backend import HFBackend

    class NoKvBackend(HFBackend):
        """An HF backend declaring no kv capture (as an engine without it would)."""

        def capabilities(self) -> Capabilities:
            caps = super().capabilities()
            layers = {t: v for t, v in caps.layers.items() if t is not TensorType.KV}
            return Capabilities(backend=caps.backend, model_type=caps.model_type,
                                num_layers=caps.num_layers, layers=layers,
                                hidden_size=caps.hidden_size, notes={"kv": "not here"})

    backend = NoKvBackend(model, tokenizer)
    with pytest.raises(CapabilityError, match="tensor_type 'kv' is not captured by the hf "
                                              "backend on 'llama'"):
        ProbedModel(backend, spec=[point("keys", tensor_type="kv")])
    backend.close()
    assert live_hooks(model) == 0


def test_models_of_unknown_architectures_and_wrong_objects_are_named(tiny) -> None:
    import torch

    _, tokenizer = tiny

    class MysteryForCausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
            self.config = type("MysteryConfig", (), {"model_type": "mystery"})()

    with pytest.raises(UnsupportedArchitectureError) as caught:
        ProbedModel(MysteryForCausalLM(), tokenizer)
    message = str(caught.value)
    assert "MysteryForCausalLM" in message and "'mystery'" in message and "llama" in message
    with pytest.raises(TypeError, match="use|load it with ProbedModel.from_pretrained"):
        ProbedModel("/no/such/model", tokenizer)
    with pytest.raises(BackendError, match="needs a tokenizer"):
        ProbedModel(tiny[0])
    with pytest.raises(BackendError, match="unknown backend 'mystery'; known backends: hf"):
        ProbedModel.from_pretrained("/no/such/model", backend="mystery")
