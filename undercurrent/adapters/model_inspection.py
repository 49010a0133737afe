"""``inspect-model``: what each backend can capture on a model, without loading
its weights where possible (the HF model is built on the meta device from its
config), and a starter spec for it."""

from __future__ import annotations

from typing import Any

from undercurrent.adapters.arguments import check_model_path
from undercurrent.adapters.capabilities import Capabilities
from undercurrent.adapters.hf.architectures import config_dimensions, find_architecture
from undercurrent.adapters.vllm import capabilities_from_config
from undercurrent.models import resolve_model_path
from undercurrent.spec.position import parse_position
from undercurrent.spec.types import ExtractionPoint, ProbeKind, ProbeSpec, TensorType


def load_config(name_or_path: str) -> Any:
    """The transformers config of a local path, a reachable hub id or ``"tiny"``."""
    from transformers import AutoConfig  # heavy: only when a model is inspected

    path = resolve_model_path(name_or_path)
    check_model_path(path)
    return AutoConfig.from_pretrained(path)


def hf_capabilities(config: Any) -> Capabilities:
    """HF capabilities from a config: the model is built on the meta device (no
    weights, no memory) so the architecture table's paths are really checked."""
    # torch and transformers (and hooks.py, which imports torch) only when a model is inspected
    import torch
    from transformers import AutoModelForCausalLM

    from undercurrent.adapters.hf.hooks import ModelHooks  # imports torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return ModelHooks(model).capabilities()


def vllm_capabilities(config: Any) -> Capabilities | None:
    """The vLLM adapter's answer from the config alone (vLLM itself is not imported)."""
    described = capabilities_from_config(config)
    return described if isinstance(described, Capabilities) else None


def inspect_model(name_or_path: str) -> dict[str, Any]:
    """Layer count, sizes and, per backend, the tensor types and valid layers."""

    config = load_config(name_or_path)
    report: dict[str, Any] = {"model": name_or_path,
                              "model_type": getattr(config, "model_type", None),
                              **config_dimensions(config), "backends": {}}
    try:
        report["architecture"] = find_architecture(config).family
        report["backends"]["hf"] = hf_capabilities(config).as_dict()
    except Exception as error:  # noqa: BLE001 - reported, not raised
        report["architecture"] = None
        report["backends"]["hf"] = {"error": str(error)}
    try:
        vllm = vllm_capabilities(config)
    except Exception as error:  # noqa: BLE001
        report["backends"]["vllm"] = {"error": str(error)}
    else:
        unreported = {"error": "not reported from the config alone; load the model with "
                               "backend='vllm' and call capabilities()"}
        report["backends"]["vllm"] = vllm.as_dict() if vllm is not None else unreported
    return report


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`inspect_model`'s report."""
    lines = [
        f"model:        {report['model']}",
        f"model_type:   {report['model_type']} ({report.get('architecture') or 'not in table'})",
        f"layers:       {report['num_layers']} decoder layers (final_norm is layer "
        f"{report['num_layers']})",
        f"hidden size:  {report['hidden_size']}",
        f"kv heads:     {report['num_kv_heads']} x head_dim {report['head_dim']}",
    ]
    for backend, caps in report["backends"].items():
        lines.append(f"{backend} backend:")
        if "error" in caps:
            lines.append(f"  unavailable: {caps['error']}")
            continue
        for tensor_type, layers in caps["tensor_types"].items():
            span = f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else str(layers[0])
            lines.append(f"  {tensor_type:<16} layers {span}")
        missing = [t.value for t in TensorType if t.value not in caps["tensor_types"]]
        if missing:
            lines.append(f"  not captured:    {', '.join(missing)}")
    return "\n".join(lines)


def starter_spec(num_layers: int) -> ProbeSpec:
    """Two points to start from: the last prompt token's residual stream at the
    middle layer, and the MLP output of every generated token there."""
    middle = max(0, num_layers // 2)
    return ProbeSpec((
        ExtractionPoint(name="last_prompt_token_norm", layers=(middle,),
                        tensor_type=TensorType.RESIDUAL_STREAM,
                        position=parse_position("prompt[-1]"), probe_type="norm_probe",
                        probe_kind=ProbeKind.SINGLE_SHOT),
        ExtractionPoint(name="generation_norm_trajectory", layers=(middle,),
                        tensor_type=TensorType.MLP_OUT, position=parse_position("generated[*]"),
                        probe_type="norm_probe", probe_kind=ProbeKind.TRAJECTORY),
    ))
