"""Shared pieces of the engine tests: the model, prompts, spec, the HF oracle and the
record comparison."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from undercurrent.probes import probe
from undercurrent.records import ProbeSignal

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

WORDS = ("the quick brown fox jumps over lazy dog a cat sat on mat and ran far away into deep "
         "dark wood where owls sing at night").split()

CHUNK_BUDGET = 48
"""max_num_batched_tokens of the test engines: long prompts are split across steps."""

MAX_NEW_TOKENS = 10


def bundled_model() -> Path | None:
    """The bundled tiny model, once it has been trained into the package."""
    from undercurrent.models import tiny_model_path

    path = tiny_model_path()
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    return None


def build_random_llama(directory: Path) -> Path:
    """A tiny random Llama (head_dim 64, float32) with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory


def model_for_tests(tmp_path_factory: Any) -> str:
    bundled = bundled_model()
    if bundled is not None:
        return str(bundled)
    return str(build_random_llama(tmp_path_factory.mktemp("tiny-llama")))


def prompts(count: int = 18) -> list[str]:
    """Prompts of many lengths; the last ones are longer than one step's token budget."""
    out = []
    for i in range(count):
        length = 2 + (i * 7) % 23
        if i >= count - 2:
            length = 3 * CHUNK_BUDGET // 2 + i
        out.append(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(length)))
    return out


def spec_points(num_layers: int, kv: bool = True) -> list[Any]:
    """Every tensor type, prompt and generated positions, slices with a stride."""
    from undercurrent.spec.types import ExtractionPoint

    last = num_layers - 1

    def point(name: str, layers: Any, tensor_type: str, position: Any, stride: int = 1) -> Any:
        from undercurrent.spec.position import parse_position

        kind = "trajectory" if parse_position(position).is_continuous else "single_shot"
        return ExtractionPoint(name=name, layers=layers, tensor_type=tensor_type,
                               position=position, stride=stride, probe_type="norm_probe",
                               probe_kind=kind)

    points = [
        point("residual_all", tuple(range(num_layers)), "residual_stream", "generated[*]"),
        point("attn_last_prompt", (0, last), "attn_out", "prompt[-1]"),
        point("mlp_window", (last,), "mlp_out", "generated[1:7]", stride=2),
        point("final_norm", (num_layers,), "final_norm", "generated[*]"),
        point("residual_abs", (1,), "residual_stream", 3),
        point("attn_first_generated", (1,), "attn_out", "prompt[-1]+1"),
    ]
    if kv:
        points += [point("kv_prompt", (0, last), "kv", "prompt[0]"),
                   point("kv_generated", (last,), "kv", "generated[2]")]
    return points


def hf_reference(model_dir: str, texts: list[str], points: list[Any],
                 params: Any) -> list[Any]:
    """The HF backend's outputs (with records) for the same prompts: the oracle
    (loaded as ``ProbedModel.from_pretrained`` loads it: Gemma2 on eager attention)."""
    from undercurrent.adapters.hf.backend import HFBackend
    from undercurrent.adapters.session import CaptureSession

    backend = HFBackend.from_pretrained(model_dir, dtype="float32", batch_size=32)
    try:
        session = CaptureSession(None, points, keep_records=True)
        return backend.generate(texts, [f"r{i}" for i in range(len(texts))], params, session)
    finally:
        backend.close()


def compare(vllm_outputs: list[Any], hf_outputs: list[Any], atol: float = 1e-4) -> float:
    """Assert tokens identical, records one per key, same keys, tensors close, and
    every record attributed to its own request; return the largest difference."""
    worst = 0.0
    for ours, theirs in zip(vllm_outputs, hf_outputs, strict=True):
        assert ours.request_id == theirs.request_id
        assert ours.token_ids == theirs.token_ids, ours.request_id
        assert ours.finish_reason == theirs.finish_reason, ours.request_id
        keys = [record.key() for record in ours.records]
        assert len(keys) == len(set(keys)), f"duplicate records for {ours.request_id}"
        ours_by_key = {record.key(): record for record in ours.records}
        theirs_by_key = {record.key(): record for record in theirs.records}
        assert set(ours_by_key) == set(theirs_by_key), (
            ours.request_id, sorted(set(ours_by_key) ^ set(theirs_by_key))[:6])
        sequence = list(ours.prompt_token_ids) + list(ours.token_ids)
        for key, record in ours_by_key.items():
            other = theirs_by_key[key]
            assert record.request_id == ours.request_id
            assert record.token_id == sequence[record.token_index] == other.token_id, key
            assert record.is_generated == other.is_generated
            assert record.generated_index == other.generated_index
            assert tuple(record.tensor.shape) == tuple(other.tensor.shape), key
            difference = float((record.tensor - other.tensor).abs().max())
            worst = max(worst, difference)
            assert difference <= atol, (key, difference)
    return worst



@probe(register=False)
def stop_at(record: Any, *, request_ids: Any = (), generated_index: int = 2) -> Any:
    """Aborts the listed requests at one generated index."""
    if record.request_id in request_ids and record.generated_index == generated_index:
        return ProbeSignal(action="abort", score=1.0)
    return None


def no_hold(monkeypatch: Any) -> None:
    """Make the vLLM backend open its requests without ``hold``: the worker then
    sends each step's batch at once even when no reply could change a step (the
    worker may live in another process, so this is set where the driver asks)."""
    from undercurrent.adapters.vllm.backend import VLLMBackend

    opened = VLLMBackend._open_in_worker

    def open_without_hold(self: Any, entries: Any, hold: bool = False,
                          each_step: bool = False) -> None:
        opened(self, entries, each_step=each_step)

    monkeypatch.setattr(VLLMBackend, "_open_in_worker", open_without_hold)


def steered_guard_spec(backend: Any, num_layers: int) -> dict[str, Any]:
    """An edit of every generated token at the last layer, and a guard that aborts
    each request at its generated token 3 (capturing nothing before it)."""
    return {"version": "2", "extraction_points": [{
        "name": "guard", "layers": 0, "tensor_type": "residual_stream",
        "position": "generated[3]", "probe_type": "norm_probe", "probe_kind": "single_shot",
        "probe_args": {"threshold": 0.0, "action": "abort"}}],
        "edits": [{"name": "push", "layers": num_layers - 1, "tensor_type": "residual_stream",
                   "position": "generated[*]", "op": "add", "coefficient": 0.5,
                   "vector": [0.01] * backend.capabilities().hidden_size}]}


def check_streamed_edits(events: list[Any]) -> None:
    """A stream of :func:`steered_guard_spec`: the event of generated token g
    carries the edit of the token fed to the step that sampled it (g - 1; none
    for the prefill's token 0), and the last event the aborting step's edit (no
    token is sampled from it): the events' edits joined equal the output's, as
    their signals joined equal its signals."""
    output = events[-1].output
    assert output.aborted and len(output.token_ids) == 4
    assert [[a.generated_index for a in event.edits] for event in events] == [
        [], [0], [1], [2], [3]]
    assert [a for event in events for a in event.edits] == list(output.edits)
    assert [s for event in events for s in event.signals] == list(output.signals)



CAPTURE_TIME_SPEC = {"version": "1", "extraction_points": [{
    "name": "norms", "layers": [0, 1], "tensor_type": "residual_stream",
    "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory",
    "probe_args": {"threshold": 1.0e9, "action": "flag"}}]}
"""A call no probe can stop: the worker holds its steps back and sends them together."""


def token_times(outputs: list[Any]) -> list[list[float]]:
    """Each output's records' times, one per generated token in order (checked:
    every layer of a token carries its step's one time)."""
    each = []
    for output in outputs:
        stamps: dict[int, set[float]] = {}
        for record in output.records:
            stamps.setdefault(record.generated_index, set()).add(record.timestamp)
        assert len(stamps) == len(output.token_ids) - 1 >= 3
        assert all(len(times) == 1 for times in stamps.values()), stamps
        each.append([stamps[index].pop() for index in sorted(stamps)])
    return each
