"""Write the tutorial notebooks' sources (run, then execute them to store outputs).

    .venv/bin/python notebooks/_make_notebooks.py            # write every notebook
    .venv/bin/python notebooks/_make_notebooks.py 02         # only those whose name has "02"
    .venv/bin/jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb

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


def main(selection: list[str]) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1:])
