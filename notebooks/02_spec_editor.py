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
# # The spec editor: build a spec with widgets, export YAML
#
# A spec says what to capture (tensor, layers, token positions) and which probe
# receives it. `SpecEditor` builds one from form controls and checks it as you
# type, with the spec loader's own messages shown next to the field at fault.
# Give it the loaded model and the layer picker only offers that model's layers.

# %%
from undercurrent import ProbedModel
from undercurrent.notebook import SpecEditor

model = ProbedModel.from_pretrained("undercurrent/tiny")
caps = model.capabilities()
print(caps.num_layers, "decoder layers; tensor types:", [t.value for t in caps.tensor_types])

# %% [markdown]
# Run the next cell and edit the point: pick layers (Ctrl- or Shift-click for
# several), type a position such as `generated[*]` (stride and `until` only
# appear for positions that match many tokens), switch `execution_mode` to
# `async` (queue depth appears), choose an `intervention.mode`. **Add**,
# **Duplicate** and **Remove** manage the points (and, below them, the edits);
# the YAML below the form follows every change, and **Save YAML** writes it.
# Running the cell again starts a new editor and closes the one it built before
# (ipywidgets keeps every widget until it is closed).

# %%
if isinstance(previous := globals().get("editor"), SpecEditor):
    previous.close()  # this cell run again: the editor it built before lets its widgets go
editor = SpecEditor(model=model)
editor

# %% [markdown]
# The same form can be driven from code, which is also how this notebook is
# tested. The cells below drive a second editor, so the one above stays yours;
# the second one is shown at the end. An invalid position is shown next to the
# field, never raised:

# %%
# NBVAL_CHECK_OUTPUT
if isinstance(previous := globals().get("scripted"), SpecEditor):
    previous.close()  # (Run All again)
scripted = SpecEditor(model=model)
f = scripted.fields
f["name"].value = "harm_watch"
f["position"].value = "generated[*"
print(scripted.valid)
print(scripted.field_problems()["position"][0][:60])

# %%
# NBVAL_CHECK_OUTPUT
f["position"].value = "generated[*]"
f["stride"].value = 2
f["probe_type"].value = "trajectory_probe"
f["probe_kind"].value = "trajectory"
f["execution_mode"].value = "async"
f["queue_depth"].value = "16"
print(scripted.to_yaml())

# %% [markdown]
# A second point: duplicate the first and make it a blocking inline probe.

# %%
# NBVAL_CHECK_OUTPUT
scripted.duplicate_point()
f["name"].value = "last_prompt_norm"
f["position"].value = "prompt[-1]"
f["probe_type"].value = "norm_probe"
f["probe_kind"].value = "single_shot"
f["execution_mode"].value = "inline"
f["intervention_mode"].value = "block_until_signal"
f["timeout_ms"].value = 200
print(scripted.spec.names, scripted.valid)

# %% [markdown]
# Below the points, the **edits** section changes activations live during
# generation (see `docs/steering.md`). With at least one edit the spec becomes
# version "2". A new edit has no vector yet, and the form says so next to the
# field:

# %%
# NBVAL_CHECK_OUTPUT
scripted.add_edit()
e = scripted.edit_fields
print(scripted.edit_field_problems())

# %% [markdown]
# `vector` takes comma-separated numbers or a `.safetensors`/`.npz` path (here the
# bundled probe's weight direction); `when.point` offers the spec's inline points,
# so the edit stays off for a request until that point flags it. With the model
# given, the editor also checks what registering the spec would: the layers, and
# that the vector has the model's hidden size.

# %%
# NBVAL_CHECK_OUTPUT
e["name"].value = "away_from_harm"
e["vector"].value = "1, 2, 3"
print(scripted.edit_field_problems()["vector"][0][:66])
e["vector"].value = "undercurrent:models/tiny/probe.safetensors"
e["coefficient"].value = "-10"
e["when_point"].value = "last_prompt_norm"
print(scripted.spec.version, scripted.valid)
print(scripted.to_yaml().split("edits:")[1])

# %% [markdown]
# Save it (`save` returns the absolute path), load it back with the spec loader,
# and open it in a new editor:

# %%
# NBVAL_CHECK_OUTPUT
import tempfile
from pathlib import Path

from undercurrent.spec import load_yaml_file

path = scripted.save(Path(tempfile.mkdtemp()) / "probes.yaml")
print(path.is_absolute(), load_yaml_file(path) == scripted.spec)

# %%
if isinstance(previous := globals().get("loaded"), SpecEditor):
    previous.close()
loaded = SpecEditor.from_spec(path, model=model)
loaded
