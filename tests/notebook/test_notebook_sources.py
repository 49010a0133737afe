"""The stored tutorial notebooks are their jupytext sources, executed, with outputs a
reader can see without a kernel (``tools/build_notebooks.py`` makes them)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import build_notebooks  # noqa: E402

SOURCES = build_notebooks.sources()
IDS = [path.stem for path in SOURCES]


def test_every_tutorial_has_a_source_and_a_stored_notebook():
    assert len(SOURCES) >= 5
    stored = sorted(path.stem for path in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert stored == IDS, "every notebooks/NN_*.ipynb needs its NN_*.py source and back"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_stored_notebook_cells_are_the_sources_cells(source):
    assert build_notebooks.mismatches(source) == [], (
        f"run: python tools/build_notebooks.py {source.stem[:2]}"
    )


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_stored_outputs_are_readable_without_a_kernel(source):
    notebook = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    assert build_notebooks.output_problems(notebook) == []
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), "the stored notebook was executed"
    assert not [cell for cell in code for out in cell.outputs if out.output_type == "error"]


def test_a_mismatch_is_found_and_named(tmp_path):
    source = tmp_path / "01_demo.py"
    source.write_text("# %% [markdown]\n# Title\n\n# %%\nprint(1)\n", encoding="utf-8")
    notebook = build_notebooks.read_source(source)
    notebook.cells[1].source = "print(2)"
    nbformat.write(notebook, tmp_path / "01_demo.ipynb")
    (problem,) = build_notebooks.mismatches(source)
    assert "cell 1" in problem and "print(1)" in problem and "print(2)" in problem
    (tmp_path / "01_demo.ipynb").unlink()
    assert "01_demo.ipynb is missing" in build_notebooks.mismatches(source)[0]


def test_cleaning_drops_progress_bars_engine_noise_and_widget_views_but_keeps_warnings():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    notebook.metadata["widgets"] = {"state": {}}
    view = "application/vnd.jupyter.widget-view+json"
    notebook.cells[0].outputs = [
        nbformat.v4.new_output("display_data", data={
            view: {"model_id": "a"}, "text/plain": "Loading weights:  40%|####  | 15/38 [00:00]"}),
        nbformat.v4.new_output("stream", name="stderr", text=(
            "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
            "[W1129 19:14:53.097438498 utils.cpp:68] Warning: NUMA binding: Using MEMBIND\n")),
        nbformat.v4.new_output("stream", name="stderr", text="UserWarning: look at me\n"),
        nbformat.v4.new_output("display_data", data={
            view: {"model_id": "b"}, "text/html": "<b>snapshot</b>", "text/plain": "editor"}),
        nbformat.v4.new_output("display_data", data={view: {"model_id": "c"}, "text/plain":
            "Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]"}),
    ]
    assert len(build_notebooks.output_problems(notebook)) == 7
    kept = build_notebooks.clean_outputs(notebook)
    outputs = notebook.cells[0].outputs
    assert [o.get("text") or o.data for o in outputs] == [
        "UserWarning: look at me\n", {"text/html": "<b>snapshot</b>", "text/plain": "editor"},
    ]
    assert len(kept) == 1 and build_notebooks.output_problems(notebook) == []
