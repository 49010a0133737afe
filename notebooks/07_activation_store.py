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
# # An activation store: capture thousands of generations, then find which layer knows
#
# `generate(records=True)` keeps every record in memory, which is fine for a few
# dozen prompts. For a dataset, `ProbedModel.capture` writes the records to disk
# **while generating**: vectors go into memory-mappable shard files, with a
# parquet index (one row per vector), the outputs and the probes' results.
# Memory stays flat however many prompts there are, and a killed run started
# again continues where it stopped.
#
# The loop of this notebook:
#
# 1. capture 2,000 generations of the bundled model to a store;
# 2. label them (the corpus knows each prompt's intent);
# 3. sweep a linear probe over every layer;
# 4. fit the best layer's probe;
# 5. run it live on prompts it has never seen.

# %%
import random
import tempfile
from pathlib import Path

import plotly.io as pio
import torch

from undercurrent import ProbedModel, open_activations
from undercurrent.models.corpus import LABEL_NAMES, make_prompt
from undercurrent.notebook import fit_linear_probe, results_frame
from undercurrent.store import sweep_figure, sweep_linear_probes

torch.set_num_threads(1)  # the bundled model is tiny: one thread is fastest on a busy CPU
pio.renderers.default = "plotly_mimetype"
workdir = Path(tempfile.mkdtemp())

rng = random.Random(7)
labels = [index % 2 for index in range(2000)]  # 0 benign, 1 harmful
prompts = [make_prompt(rng, label) for label in labels]
print(prompts[0])
print(prompts[1])

# %% [markdown]
# ## 1. Capture
#
# One point: the residual stream of every layer at every generated token. The
# progress bar shows prompts/s, tokens/s and vectors/s.

# %%
spec = """
extraction_points:
  - name: resid
    layers: [0, 1, 2, 3]
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: norm_probe
    probe_kind: trajectory
"""
model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
summary = model.capture(prompts, workdir / "acts", max_new_tokens=6, batch_size=128)

# %%
# NBVAL_CHECK_OUTPUT
print(summary.requests, "generations,", summary.vectors, "vectors,",
      round(summary.bytes / 2**20, 1), "MiB")

# %% [markdown]
# Run the same cell again and nothing is generated: every prompt is already
# committed (`resume=True` is the default). A run killed half-way continues
# from its last committed shard.

# %% [markdown]
# ## 2. Open and label
#
# `open_activations` reads the index (a pandas frame), the outputs and the
# results; vectors stay on disk until asked for.

# %%
store = open_activations(workdir / "acts")
print(store)
store.index.head()

# %%
store.outputs[["prompt_index", "request_id", "text", "finish_reason"]].head(3)

# %% [markdown]
# `vectors(rows)` takes any subset of the index (here one layer, in the
# store's order) and returns an array aligned to it, read from the
# memory-mapped shard files.

# %%
# NBVAL_CHECK_OUTPUT
layer_two = store.index[store.index["layer"] == 2]
X = store.vectors(layer_two)
print(X.shape, X.dtype)

# %% [markdown]
# Labels: the corpus drew each prompt's intent, so a `{prompt_index: label}`
# mapping labels every vector of that prompt's generation.

# %%
label_of = {index: LABEL_NAMES[label] for index, label in enumerate(labels)}
print(label_of[0], label_of[1])

# %% [markdown]
# ## 3. Which layer knows?
#
# `sweep_linear_probes` fits one logistic-regression probe per layer, each
# layer read from disk on its own, with the same held-out split by request.
# `positions="last"` takes each generation's last captured token (one row per
# generation); `"generated"` would take every generated token (the split still
# keeps each generation on one side).

# %%
sweep = sweep_linear_probes(store, label_of, point="resid", positions="last", C=0.5)
sweep[["layer", "accuracy", "auc", "n", "n_requests", "chance_accuracy"]].round(3)

# %%
sweep_figure(sweep)

# %% [markdown]
# ## 4. Fit the best layer
#
# `fit_linear_probe` takes the store (here narrowed with `select`) and reads
# only that layer from disk.

# %%
best = int(sweep.loc[sweep["auc"].idxmax(), "layer"])
last_tokens = store.select(point="resid", positions="last")
fit = fit_linear_probe(last_tokens, label_of, layer=best, C=0.5,
                       save_to=workdir / "probe.safetensors")
print("layer", best, "held-out accuracy", round(fit.metrics["test_accuracy"], 3),
      "AUC", round(fit.metrics["test_auc"], 3))

# %% [markdown]
# ## 5. Run it live
#
# The saved probe becomes a `linear_probe` point on the same loaded model; it
# scores P(harmful) at every generated token of prompts it has never seen
# (`mean_score` averages a generation's tokens).

# %%
live = ProbedModel(model.backend, spec={"extraction_points": [{
    "name": "intent", "layers": [best], "tensor_type": "residual_stream",
    "position": "generated[*]", "probe_type": "linear_probe", "probe_kind": "trajectory",
    "probe_args": fit.probe_args(threshold=0.5),
}]})
test_rng = random.Random(2024)
test_labels = [1, 0, 1, 0, 1, 0]
test_prompts = [make_prompt(test_rng, label) for label in test_labels]
outputs = live.generate(test_prompts, max_new_tokens=12)
frame = results_frame(outputs)
frame["truth"] = [LABEL_NAMES[label] for label in test_labels]
frame[["request", "truth", "mean_score", "last_score"]].round(3)

# %%
# NBVAL_CHECK_OUTPUT
mean_scores = frame["mean_score"].to_numpy()
print("harmful prompts score higher on average:",
      mean_scores[::2].mean() > mean_scores[1::2].mean())

# %%
model.close()
