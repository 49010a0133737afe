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
# # Steering: fit a direction, edit activations live, close the loop
#
# Capture the residual stream of the bundled model on harmful and benign requests,
# fit a steering direction (the difference of the class means), then generate
# again with an edit that pushes the harmful requests against that direction, and
# watch the bundled probe's score trajectory move. Last, let the probe itself
# switch the edit on, per request, from the token after it flags. See
# `docs/steering.md` for the semantics.

# %%
import random

import plotly.io as pio
from plotly.subplots import make_subplots
from transformers.utils import logging as transformers_logging

from undercurrent import ProbedModel
from undercurrent.models.corpus import chat_prompt, make_prompt
from undercurrent.notebook import records_frame, signals_frame, trajectory_figure
from undercurrent.spec import edit_to_dict
from undercurrent.steering import edits_frame, fit_steering_vector

pio.renderers.default = "plotly_mimetype"  # rendered by JupyterLab/Notebook, no CDN needed
transformers_logging.disable_progress_bar()
PROBE = "undercurrent:models/tiny/probe.safetensors"
rng = random.Random(6)
labels = ["harmful" if i % 2 else "benign" for i in range(12)]
prompts = [chat_prompt(make_prompt(rng, int(label == "harmful"))) for label in labels]

# %% [markdown]
# ## 1. Capture: the guard's score and the residual stream at layer 2
#
# The guard reads layer 3; the direction is fitted one layer below it, where the
# edit will act.

# %%
# NBVAL_CHECK_OUTPUT
spec = {"version": "2", "extraction_points": [
    {"name": "harm_guard", "layers": 3, "tensor_type": "residual_stream",
     "position": "generated[*]", "probe_type": "linear_probe", "probe_kind": "single_shot",
     "probe_args": {"path": PROBE}},
    {"name": "resid2", "layers": 2, "tensor_type": "residual_stream",
     "position": "generated[*]", "probe_type": "norm_probe", "probe_kind": "trajectory"},
]}
model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
ids = [f"p{i}" for i in range(len(prompts))]
plain = model.generate(prompts, max_new_tokens=32, records=True, request_ids=ids)
frame = records_frame(plain)
print(frame[frame["point"] == "resid2"].shape[0], "activations at layer 2")

# %% [markdown]
# ## 2. Fit a steering direction from the frame
#
# `fit_steering_vector` takes the same inputs as `fit_linear_probe`: here a
# `{request: label}` mapping. With `normalize=True` the vector has unit length,
# so an edit's coefficient is a distance in activation space.

# %%
# NBVAL_CHECK_OUTPUT
direction = fit_steering_vector(frame, dict(zip(ids, labels, strict=True)), point="resid2",
                                normalize=True)
print(direction.positive, "minus", direction.negative, "at layer", direction.layer,
      "| norm", round(direction.norm, 3), "| rows", direction.counts)

# %% [markdown]
# ## 3. Steer the harmful requests only, and compare
#
# `prompt_edits` gives each prompt its own edits (None leaves it untouched), so
# the benign requests of the same batch run exactly as before.

# %%
# NBVAL_CHECK_OUTPUT
away = direction.edit("away_from_harm", coefficient=-8.0)
steered = model.generate(prompts, max_new_tokens=32, request_ids=ids,
                         prompt_edits=[[away] if label == "harmful" else None
                                       for label in labels])
untouched = [a.token_ids == b.token_ids for a, b, label in zip(plain, steered, labels,
                                                                 strict=True)
             if label == "benign"]
print("benign replies unchanged:", all(untouched))
print("harmful replies changed:", sum(a.token_ids != b.token_ids for a, b, label
                                      in zip(plain, steered, labels, strict=True)
                                      if label == "harmful"), "of", labels.count("harmful"))

# %%
changed = [(a, b) for a, b in zip(plain, steered, strict=True) if a.token_ids != b.token_ids]
for before, after in changed[:3]:
    print(f"without: {before.text}\n   with: {after.text}\n")

# %% [markdown]
# ## 4. The probe's trajectory, without and with steering
#
# The guard's score per generated token for the harmful requests: left as the
# model writes on its own, right with the edit on. The edit acts one layer below
# the guard, so the guard reads the steered residual stream.

# %%
def harm_scores(outputs):
    signals = signals_frame(outputs)
    harmful = {i for i, label in zip(ids, labels, strict=True) if label == "harmful"}
    return signals[(signals["point"] == "harm_guard") & signals["request"].isin(harmful)]


side_by_side = make_subplots(rows=1, cols=2, shared_yaxes=True,
                             subplot_titles=("without steering", "with steering"))
for column, outputs in ((1, plain), (2, steered)):
    for trace in trajectory_figure(harm_scores(outputs)).data:
        trace.showlegend = column == 1
        side_by_side.add_trace(trace, row=1, col=column)
side_by_side.update_layout(title="P(harmful) per generated token, harmful requests",
                           template="plotly_white", height=420)
side_by_side.update_xaxes(title_text="generated index")
side_by_side.show()

# %%
# NBVAL_CHECK_OUTPUT
before, after = harm_scores(plain)["score"].mean(), harm_scores(steered)["score"].mean()
print("mean P(harmful) on harmful requests:", round(before, 2), "->", round(after, 2))

# %% [markdown]
# Read this with care. The replies change (an object, a step), but the harmful
# plan mostly stays: a tiny model's wording is decided by a few tokens early on,
# and the edit changes what the guard reads more than what the model writes. The
# guard sits one layer above the edit and scores the very direction the edit
# pushes against, so its collapse measures the edit at least as much as the reply.
#
# Which tokens were edited? `edits_frame` lists every applied edit and joins the
# signals frame on `request` and `token_index`; the edit starts with generated
# token 0 (the first token fed back) and the last sampled token is never fed.

# %%
# NBVAL_CHECK_OUTPUT
applied = edits_frame(steered)
joined = signals_frame(steered).merge(applied, on=["request", "token_index"], how="left")
print(applied.groupby("request")["generated_index"].agg(["min", "max", "count"]).iloc[0].tolist())
guard = joined[joined["point"] == "harm_guard"]
print(int(guard["edit"].notna().sum()), "of", len(guard), "guard signals are on edited tokens")

# %% [markdown]
# ## 5. Close the loop: the guard switches the edit on
#
# The guard now flags (instead of aborting) and `when:` ties the edit to its flag:
# off until the guard flags token t of a request, then on from the pass that feeds
# token t+1, so token t+2 is the first one sampled under it, for that request only.

# %%
# NBVAL_CHECK_OUTPUT
flagging_guard = {**spec["extraction_points"][0], "probe_args": {"path": PROBE, "action": "flag"}}
triggered = {**edit_to_dict(away), "when": {"point": "harm_guard", "action": "flag"}}
loop_spec = {"version": "2", "extraction_points": [flagging_guard], "edits": [triggered]}
with ProbedModel.from_pretrained("undercurrent/tiny", spec=loop_spec) as loop:
    looped = loop.generate(prompts, max_new_tokens=32, request_ids=ids)
for output, label in zip(looped, labels, strict=True):
    flags = [s.generated_index for s in output.signals if s.action.value == "flag"]
    first = flags[0] if flags else None
    start = output.edited_tokens[0] if output.edited_tokens else None
    sampled = output.steered_tokens[0] if output.steered_tokens else None
    print(f"{label:8} first flag {first!s:4} edit from fed token {start!s:4} "
          f"first steered token {sampled!s:4} aborted {output.aborted}")

# %%
for output in looped:
    if output.edits:
        print(output.text)

# %%
model.close()
