"""Run by test_memory.py in its own process: capture a wide random model (8 layers,
hidden 512, four tensor types on every layer and generated token: 80 KB a token)
into a store and print, as JSON, the bytes written and the peak RSS before and
after the capture."""

from __future__ import annotations

import json
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "adapters"))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    import torch
    from hf_models import WORDS, build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from undercurrent import ProbedModel

    torch.set_num_threads(1)  # a shared machine: one thread is the fastest here
    n_prompts, layers, batch = int(sys.argv[1]), 8, 8
    config = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=8, pad_token_id=0, bos_token_id=1,
                         eos_token_id=None, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    points = [{"name": kind, "layers": list(range(layers)), "tensor_type": kind,
               "position": "generated[*]", "probe_type": "norm_probe",
               "probe_kind": "trajectory"}
              for kind in ("residual_stream", "attn_out", "mlp_out", "kv")]
    probed = ProbedModel(model, build_tokenizer(), spec={"extraction_points": points})
    prompts = [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(6))
               for i in range(n_prompts)]
    options = dict(max_new_tokens=32, batch_size=batch, progress=False)
    with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as out:
        # One batch of the same shape first: imports, allocator pools and one batch's
        # records are then in the baseline, so the growth is what accumulates.
        probed.capture(prompts[:batch], warm, **options)
        before = peak_rss_bytes()
        summary = probed.capture(prompts, out, **options)
        after = peak_rss_bytes()
    print(json.dumps({"bytes": summary.bytes, "vectors": summary.vectors,
                      "requests": summary.requests, "peak_before": before,
                      "peak_after": after, "seconds": summary.seconds}))


if __name__ == "__main__":
    main()
