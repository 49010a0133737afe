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
# # Trajectories and dataframe analysis
#
# Capture once, analyse with pandas and plotly: the shipped probe's score per
# generated token, a layer x token heatmap, a PCA of the activations coloured by
# label, per-point verdicts, and records saved to parquet.

# %%
import random

from undercurrent import ProbedModel
from undercurrent.models import tiny_probe_path
from undercurrent.models.corpus import LABEL_NAMES, make_prompt
from undercurrent.notebook import png_fallback
from undercurrent.probes import load_linear_weights
from undercurrent.spec import parse_yaml

png_fallback()  # plotly figures also carry a PNG, for readers without a kernel
meta = load_linear_weights(tiny_probe_path()).metadata
threshold = float(meta["threshold"])
rng = random.Random(11)
labels = [i % 2 for i in range(8)]
prompts = [make_prompt(rng, label) for label in labels]

# %%
spec = parse_yaml(f'''
extraction_points:
  - name: harm_probe
    layers: {meta["layer"]}
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: linear_probe
    probe_kind: single_shot
    probe_args: {{path: "{tiny_probe_path()}"}}
  - name: resid
    layers: [0, 1, 2, 3]
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: norm_probe
    probe_kind: trajectory
''')
model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)

# %%
# NBVAL_CHECK_OUTPUT
outputs = model.generate(prompts, max_new_tokens=24, records=True)
label_of = {o.request_id: LABEL_NAMES[y] for o, y in zip(outputs, labels)}
short = {o.request_id: f"p{i} ({LABEL_NAMES[y]})" for i, (o, y) in enumerate(zip(outputs, labels))}
print(len(outputs), "outputs")

# %% [markdown]
# `label_of` and `short` map request ids to a label and to a short name; the
# figures below take them as `color_by=` and `names=`.
#
# ## Signals: one row per probe signal
#
# Inline signals are located on the token axis (`generated_index`), so a
# trajectory is a group-by away. With `max_new_tokens=24` each request has 23
# signals: the last sampled token is never fed back to the model, so it has no
# activations (`capture_last_token=True` adds them).

# %%
# NBVAL_CHECK_OUTPUT
from undercurrent.notebook import signals_frame

signals = signals_frame(outputs)
signals["prompt"] = signals["request"].map(short)
signals["label"] = signals["request"].map(label_of)
print(list(signals.columns[:9]))

# %%
from undercurrent.notebook import trajectory_figure

harm = signals[signals["point"] == "harm_probe"]
trajectory_figure(harm, threshold=threshold, names=short, color_by="label",
                  title="P(harmful) per generated token, by label")

# %% [markdown]
# When does each generation first cross the threshold, by label?

# %%
crossing = (
    harm[harm["score"] >= threshold]
    .groupby("prompt")["generated_index"].min()
    .rename("first_crossing")
)
summary = harm.groupby(["prompt", "label"])["score"].agg(["mean", "max"]).join(crossing)
summary

# %%
# NBVAL_CHECK_OUTPUT
by_label = harm.groupby("label")["score"].mean()
print(by_label.idxmax())

# %% [markdown]
# ## Records: activations as a frame, a heatmap and a projection
#
# `records_frame` gives one row per record with index columns only (request,
# point, layer, token, ...); the activations sit beside it as one 2-D matrix,
# and `activation_matrix` hands one layer's rows over as a view, without copying.

# %%
# NBVAL_CHECK_OUTPUT
import numpy as np

from undercurrent.notebook import activation_matrix, records_frame

records = records_frame(outputs, tokenizer=model.backend.tokenizer)
resid = records[records["point"] == "resid"]
X = activation_matrix(resid, layer=3)
print(X.shape[1], "features per activation")
print("no copy:", np.shares_memory(X, activation_matrix(records, point="resid", layer=3)))

# %%
from undercurrent.notebook import heatmap_figure

heatmap_figure(resid, request=outputs[1].request_id, value="norm", names=short)

# %%
from undercurrent.notebook import projection_figure

projection_figure(resid, label_of, layer=int(meta["layer"]), names=short)

# %% [markdown]
# ## Results and verdicts

# %%
from undercurrent.notebook import results_frame, verdict_figure

results = results_frame(outputs)
results["label"] = results["request"].map(label_of)
results.groupby(["point", "label"])[["flagged", "max_score"]].mean()

# %%
verdict_figure(outputs)

# %% [markdown]
# ## Parquet: save the records, load them back

# %%
# NBVAL_CHECK_OUTPUT
import tempfile
from pathlib import Path

from undercurrent.notebook import load_records, save_records

path = save_records(outputs, Path(tempfile.mkdtemp()) / "run.parquet")
loaded = load_records(path)
same = (activation_matrix(loaded, point="resid", layer=3) == X).all()
print(len(loaded) == len(records), same, loaded["dtype"].iloc[0])

# %% [markdown]
# The model stays loaded, so any cell above can be run again; `model.close()`
# removes every hook when you are done.
