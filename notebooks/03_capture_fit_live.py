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
# # Capture -> label -> fit -> run live (with an abort)
#
# The whole loop in one notebook:
#
# 1. generate for labelled prompts and **capture** residual-stream activations;
# 2. put them in a frame and **fit** a logistic-regression probe per layer
#    (held-out split by request);
# 3. save the best one and **run it live**: an inline `trajectory_probe` that
#    follows a running average of the probe's score and aborts the generation
#    when it crosses a threshold.

# %%
import random
import tempfile
from pathlib import Path

from undercurrent import ProbedModel
from undercurrent.models.corpus import LABEL_NAMES, make_prompt
from undercurrent.notebook import png_fallback
from undercurrent.spec import parse_yaml

png_fallback()  # plotly figures also carry a PNG, for readers without a kernel
rng = random.Random(7)
labels = [i % 2 for i in range(64)]          # 0 benign, 1 harmful
prompts = [make_prompt(rng, label) for label in labels]
print(prompts[0])
print(prompts[1])

# %% [markdown]
# Capture: every layer's residual stream on the generated tokens fed back to
# the model (11 of the 12: the last one sampled is never fed). A
# capture point still names a probe; the cheap `norm_probe` will do.
# `records=True` keeps the `ActivationRecord`s on each output.

# %%
capture_spec = parse_yaml('''
extraction_points:
  - name: resid
    layers: [0, 1, 2, 3]
    tensor_type: residual_stream
    position: "generated[0:12]"
    probe_type: norm_probe
    probe_kind: trajectory
''')
capture = ProbedModel.from_pretrained("undercurrent/tiny", spec=capture_spec)

# %%
# NBVAL_CHECK_OUTPUT
outputs = capture.generate(prompts, max_new_tokens=12, records=True)
print(len(outputs), "generations,", sum(len(o.records) for o in outputs), "records")

# %%
# NBVAL_CHECK_OUTPUT
from undercurrent.notebook import records_frame

frame = records_frame(outputs, tokenizer=capture.backend.tokenizer)
label_of = {out.request_id: LABEL_NAMES[y] for out, y in zip(outputs, labels)}
print(frame.shape)
print(list(frame.columns))

# %% [markdown]
# Fit one probe per layer. Rows of one generation never end up on both sides of
# the split, so the held-out accuracy is about unseen generations.

# %%
import pandas as pd

from undercurrent.notebook import fit_linear_probe

scores = {}
for layer in sorted(frame["layer"].unique()):
    fit = fit_linear_probe(frame, label_of, layer=layer, C=0.5, seed=0)
    scores[layer] = fit.metrics
pd.DataFrame(scores).T[["train_accuracy", "test_accuracy", "test_auc", "n_train", "n_test"]]

# %%
best = max(scores, key=lambda layer: (scores[layer]["test_auc"], layer))
probe_path = Path(tempfile.mkdtemp()) / "my_probe.safetensors"
fit = fit_linear_probe(frame, label_of, layer=best, C=0.5, seed=0, save_to=probe_path)
print("layer", best, "held-out accuracy", round(fit.metrics["test_accuracy"], 3))
print(fit.label_names, "-> the probe scores P(" + fit.label_names[1] + ")")

# %% [markdown]
# Run it live. One token's score is noisy (some words are simply more typical of
# one class), so the live point uses `trajectory_probe`: it reads the same saved
# weights, keeps an exponentially weighted running average of the score
# (`alpha: 0.2`, judged from the third token on), and with `action: abort` the
# router stops the generation the moment that average reaches the threshold.

# %%
# NBVAL_CHECK_OUTPUT
from undercurrent.spec import ExtractionPoint, ProbeSpec

live_spec = ProbeSpec([ExtractionPoint(
    name="my_probe",
    layers=(best,),
    tensor_type="residual_stream",
    position="generated[*]",
    probe_type="trajectory_probe",
    probe_kind="trajectory",
    probe_args={"path": str(probe_path), "statistic": "ewma", "alpha": 0.2,
                "min_count": 3, "threshold": 0.8, "action": "abort"},
)])
live = ProbedModel(capture.backend, spec=live_spec)   # same loaded model, new spec
print(live_spec.names, dict(live_spec[0].probe_args)["action"])

# %% [markdown]
# `LiveView` streams each prompt and updates as tokens arrive: a progress line,
# the tokens shaded by the running score (hover one for its value), the score
# curves, and a red ✖ where the probe aborted. `labels=` names each request;
# here, what the prompt really is.

# %%
from undercurrent.notebook import LiveView

test_rng = random.Random(2024)                 # prompts the probe has never seen
test_labels = [1, 0, 1, 0]
test_prompts = [make_prompt(test_rng, label) for label in test_labels]
names = [f"{LABEL_NAMES[label]} {i + 1}" for i, label in enumerate(test_labels)]
if isinstance(previous := globals().get("view"), LiveView):
    previous.close()  # this cell run again: the view it built before lets its widgets go
view = LiveView(live, threshold=0.8)
live_outputs = view.run(test_prompts, labels=names, max_new_tokens=32)

# %%
for name, out in zip(names, live_outputs):
    print(f"{name:10}", out.finish_reason, "|", out.text)
    if out.aborted:
        print(" " * 10, "stopped at generated token", out.abort.generated_index,
              "score", round(out.abort.signal.score, 3))

# %%
# NBVAL_CHECK_OUTPUT
print([out.aborted for out in live_outputs])

# %% [markdown]
# The live view needs a running kernel to draw its widgets; a reader of the
# stored notebook sees a snapshot of the finished run instead. For a figure of
# the same run, `trajectory_figure` draws the outputs' scores, one colour per
# label (the ✕ marks an abort):

# %%
from undercurrent.notebook import trajectory_figure

trajectory_figure(
    live_outputs, threshold=0.8, title="running P(harmful), live run",
    names={o.request_id: name for o, name in zip(live_outputs, names)},
    color_by={o.request_id: LABEL_NAMES[y] for o, y in zip(live_outputs, test_labels)},
)

# %% [markdown]
# The model stays loaded, so the live cell can be run again (try other prompts);
# it first closes the view it built before, as ipywidgets keeps every widget
# until it is closed. `capture.close()` removes every hook when you are done.
