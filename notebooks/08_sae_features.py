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
# # SAE features, live
#
# A sparse autoencoder (SAE) rewrites an activation as a handful of active
# *features*. `sae_probe` reads SAEs in SAELens's format and reports their
# features while the model generates. The package ships a small TopK SAE
# (512 features, 16 active per token) trained on the bundled model's layer-3
# residual stream (`docs/sae.md` has its numbers).
#
# This notebook watches its features on benign and harmful requests, finds the
# ones that fire on harmful ones, uses one live as an abort rule, and steers with
# it: an edit that clamps the feature through the SAE's encoder.

# %%
import random

import numpy as np
import plotly.io as pio

from undercurrent import ProbedModel
from undercurrent.models.corpus import LABEL_NAMES, make_prompt
from undercurrent.notebook import features_frame
from undercurrent.notebook.plots import (
    feature_heatmap_figure,
    mean_peaks_by_label,
    top_features_by_label_figure,
)
from undercurrent.probes import load_sae, sae_clamp_delta

pio.renderers.default = "plotly_mimetype"  # rendered by JupyterLab/Notebook, no CDN needed
SAE = "undercurrent:models/tiny/sae"
sae = load_sae(SAE)
print(sae.architecture, "SAE:", sae.d_sae, "features, k =", sae.k, "| reads", sae.hook_name)

# %% [markdown]
# ## Watch the active features of every generated token
#
# `top_k: 16` reports each token's 16 most active features: for this TopK SAE
# (k = 16) that is every active one. The SAE's
# `hook_name` says layer 3's residual stream; `sae_probe` refuses a point that
# captures anything else (`check_hook`).

# %%
SPEC = f"""
version: "1"
extraction_points:
  - name: sae_top
    layers: 3
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: sae_probe
    probe_kind: trajectory
    probe_args: {{path: "{SAE}", top_k: 16}}
"""
rng = random.Random(8)
labels = [i % 2 for i in range(8)]
prompts = [make_prompt(rng, label) for label in labels]
model = ProbedModel.from_pretrained("undercurrent/tiny", spec=SPEC)
outputs = model.generate(prompts, max_new_tokens=40)
label_of = {o.request_id: LABEL_NAMES[label] for o, label in zip(outputs, labels, strict=True)}
frame = features_frame(outputs, tokenizer=model.backend.tokenizer)
frame.head(8)

# %% [markdown]
# One harmful request, feature by token, for its 12 strongest features (blank:
# not active at that token).

# %%
harmful = next(o for o in outputs if label_of[o.request_id] == "harmful")
print(harmful.prompt)
feature_heatmap_figure(frame, request=harmful.request_id, top=12)

# %% [markdown]
# ## Which features fire on harmful requests?
#
# Summarise each request by each feature's peak, then average the peaks per
# label. The bars show each label's strongest features.

# %%
top_features_by_label_figure(frame, label_of, top=6)

# %%
# NBVAL_CHECK_OUTPUT
table = mean_peaks_by_label(frame, label_of)
table["gap"] = table["harmful"] - table["benign"]
print(table.sort_values("gap", ascending=False).head(5).round(1))

# %% [markdown]
# Several features are (nearly) silent on benign requests and strong on harmful
# ones. Where do they fire? Above 3, all five at the same place: the token just
# before the reply's harmful step ("the first step is *to*" → "grab…", "*then*" →
# "wait…"); besides that, one fires once at a "." and one at a "best" (the only
# benign hit). They say "the next words are the harmful ones", one token before
# the text shows it; the SAE has split that one signal over several features.

# %%
# NBVAL_CHECK_OUTPUT
strong = frame[frame["feature"].isin(table.sort_values("gap").index[-5:])
               & (frame["activation"] > 3)]
strong = strong.assign(label=strong["request"].map(label_of))
print(strong.groupby(["label", "token_text"])["feature"].nunique().rename("features"))

# %% [markdown]
# ## Use it live
#
# Feature 2 is one of them; it was picked on the SAE's own training prompts
# (`tiny/sae/report.json`: per-request AUC 1.0 on held-out prompts, one token of
# lead over the reveal). Watch it alone and abort when it reaches 3.05 (its
# highest peak on a benign training request). Harmful replies stop right before their
# harmful step; benign ones run to the end.

# %%
GUARD = f"""
version: "1"
extraction_points:
  - name: guard
    layers: 3
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: sae_probe
    probe_kind: single_shot
    probe_args: {{path: "{SAE}", features: [2], threshold: 3.05, action: abort}}
"""
guarded = ProbedModel.from_pretrained("undercurrent/tiny", spec=GUARD)
for output, label in zip(guarded.generate(prompts, max_new_tokens=40), labels, strict=True):
    feature = output.results["guard"].verdict["features"][0]
    print(f"{LABEL_NAMES[label]:8s} aborted={output.aborted!s:5s} peak={feature['max']:5.1f} "
          f"| {output.text[-45:]}")

# %% [markdown]
# ## The clamp, on captured activations
#
# Steering with a feature (next section) clamps it with
# `h' = h + (c − f_i(h)) · W_dec[i]`. That changes `h` only
# along the feature's decoder direction and keeps the SAE's error term
# `h − decode(encode(h))`; replacing `h` by the SAE's reconstruction would throw
# that error away (`docs/sae.md` says why that matters). `sae_clamp_delta` is the
# pure function; here it sets feature 2 to 0 on a harmful request's captured
# activations.

# %%
capture = ProbedModel.from_pretrained("undercurrent/tiny", spec=GUARD.replace("abort", "flag"))
(run,) = capture.generate([harmful.prompt], max_new_tokens=40, records=True)

# %%
# NBVAL_CHECK_OUTPUT
h = np.stack([r.tensor.double().numpy() for r in run.records])
f = sae.encode(h)
h_clamped = h + sae_clamp_delta(sae, h, feature=2, value=0.0)
# the reconstruction with feature 2 at 0, and the error term before and after
recon_clamped = (f @ sae.W_dec + sae.b_dec) - np.outer(f[:, 2], sae.W_dec[2])
error_before = h - (f @ sae.W_dec + sae.b_dec)
print("feature 2 peak before:", round(float(f[:, 2].max()), 1))
print("h moved along one direction only:", np.linalg.matrix_rank(h_clamped - h) == 1)
print("error term kept:", np.allclose(h_clamped - recon_clamped, error_before))

# %% [markdown]
# The clamp is exact in the SAE's reconstruction. Encoding `h'` again need not
# give exactly 0: the encoder is not the decoder's inverse, so the feature moves
# by `(c − f_i) · (W_enc[:, i] · W_dec[i])`, and a TopK selection can change.

# %%
# NBVAL_CHECK_OUTPUT
print("feature 2 peak after re-encoding h':", round(float(sae.encode(h_clamped)[:, 2].max()), 1))

# %% [markdown]
# ## Steer with the feature
#
# An edit's `vector` can name an SAE feature, `{sae: FOLDER, feature: INDEX}`.
# With `op: clamp` the edit is the clamp above, applied live at every generated
# token (`docs/steering.md`). Here feature 2 is clamped to 0 at its own site on
# every request, then to 26 (its usual peak on harmful replies).

# %%
# NBVAL_CHECK_OUTPUT
def clamp_feature_2(value):
    return {"name": "feature_2", "layers": 3, "tensor_type": "residual_stream",
            "position": "generated[*]", "op": "clamp",
            "vector": {"sae": SAE, "feature": 2}, "coefficient": value}


plain_runs = model.generate(prompts, max_new_tokens=40)
for value in (0.0, 26.0):
    steered = model.generate(prompts, max_new_tokens=40, edits=[clamp_feature_2(value)])
    print(f"feature 2 clamped to {value}:")
    for before, after, label in zip(plain_runs, steered, labels, strict=True):
        same = "unchanged" if after.token_ids == before.token_ids else after.text[-42:]
        print(f"  {LABEL_NAMES[label]:8s} {same}")

# %% [markdown]
# Read honestly: clamping the feature to 0 does not make harmful replies harmless.
# Two of the four do not change at all, and the other two swap one harmful step
# for another. The feature marks *where* the harmful step comes, one token ahead,
# but at layer 3 (the model's last layer) removing it does not remove the intent
# the earlier layers already carry. Clamping it high changes every benign reply
# and still leaves them benign. A feature that detects well is not necessarily a
# lever; the edit makes that cheap to find out.
