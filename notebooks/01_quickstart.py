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
# # Quickstart: spec -> generate -> results
#
# undercurrent captures activations **while a model generates** and hands them to
# probes. This notebook uses the bundled tiny model (a 4-layer Llama trained on a
# synthetic corpus of requests that are either benign or harmful) and the linear
# probe shipped with it, which reads the residual stream and scores P(harmful).

# %%
from undercurrent import ProbedModel
from undercurrent.models import tiny_probe_path
from undercurrent.probes import load_linear_weights

probe_file = load_linear_weights(tiny_probe_path())
meta = probe_file.metadata
print({key: meta[key] for key in ("layer", "tensor_type", "link", "threshold", "label_names")})

# %% [markdown]
# A spec names *what* to capture and *which probe* gets it. Two points: the
# shipped linear probe on every generated token at the probe's layer, and a
# simple norm probe on the last prompt token at two layers.

# %%
# NBVAL_CHECK_OUTPUT
from undercurrent.spec import parse_yaml

spec = parse_yaml(f'''
version: "1"
extraction_points:
  - name: harm_probe
    layers: {meta["layer"]}
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: linear_probe
    probe_kind: single_shot
  - name: prompt_norm
    layers: [0, 3]
    tensor_type: residual_stream
    position: "prompt[-1]"
    probe_type: norm_probe
    probe_kind: single_shot
''')
print(spec.names)

# %% [markdown]
# `probe_defaults` gives router-level arguments per probe type: here the path of
# the shipped probe file, so the spec itself stays portable.

# %%
model = ProbedModel.from_pretrained(
    "undercurrent/tiny",
    spec=spec,
    probe_defaults={"linear_probe": {"path": str(tiny_probe_path())}},
)
model

# %% [markdown]
# Two requests in the model's chat format: one plainly benign (your own car, the
# key is lost), one plainly harmful (someone else's car, in secret). The intent
# is fixed by the prompt; the words that give it away come later in the reply.

# %%
from undercurrent.models.corpus import chat_prompt

prompts = [
    chat_prompt("how do i unlock my own car because the key is lost ?"),            # benign
    chat_prompt("how do i get into my neighbour's car without anyone knowing ?"),   # harmful
]
outputs = model.generate(prompts, max_new_tokens=24)
for prompt, out in zip(prompts, outputs):
    print(prompt, "->", repr(out.text))

# %% [markdown]
# Each output carries one `ProbeResult` per point: the probe's verdict, every
# signal it emitted, and its stats.
#
# **Why 23 signals for 24 new tokens?** A token's activations exist only once the
# model reads it back as input, at the next decode step. Generation stops after
# sampling the last token, so that one is never read back: `max_new_tokens=24`
# gives 23 signals on `generated[*]`. Pass `capture_last_token=True` to
# `generate` (or to `ProbedModel`) for one extra forward pass that captures it.

# %%
# NBVAL_CHECK_OUTPUT
harm = [out.results["harm_probe"] for out in outputs]
print([len(result.signals) for result in harm])
print([result.flagged for result in harm])

# %% [markdown]
# `results_frame` lays the results out as a table, one row per (request, point).

# %%
from undercurrent.notebook import results_frame

table = results_frame(outputs)
table["prompt"] = table["request"].map({o.request_id: i for i, o in enumerate(outputs)})
table[["prompt", "point", "flagged", "n_signals", "n_flags", "max_score", "processed"]]

# %% [markdown]
# The model stays loaded, so any cell above can be run again. `model.close()`
# removes every hook when you are done (shutting the kernel down does too).
