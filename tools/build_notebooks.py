"""Build the tutorial notebooks from their jupytext sources, and check that they match.

Each tutorial is ``notebooks/NN_name.py`` (jupytext percent format: the source of
truth, linted by ruff) paired with ``notebooks/NN_name.ipynb`` (the same cells,
executed, with outputs a reader can see without a kernel).

    python tools/build_notebooks.py              # every notebooks/NN_*.py -> executed .ipynb
    python tools/build_notebooks.py 03 05        # only the tutorials whose name starts so
    python tools/build_notebooks.py --check      # exit 1 if a stored .ipynb differs from its .py

Building runs each notebook top to bottom on CPU in a fresh kernel (with this
checkout first on ``PYTHONPATH``) and stores its outputs, cleaned for readers:

- no widget state: every widget of the notebook layer displays an HTML snapshot
  beside its live view, and the stored output keeps that snapshot;
- no progress bars (transformers' "Loading weights" bars are switched off in the
  kernel, and any left are removed) and no engine noise on stderr (vLLM's Triton
  and NUMA notices); other stderr stays, and is listed, so real warnings are seen.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
SOURCE_PATTERN = "[0-9][0-9]_*.py"
PAIRING = "ipynb,py:percent"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# A tqdm bar as text: "Loading weights:  40%|####      | 15/38 [00:00<...]", or vLLM's
# "Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]".
_PROGRESS = re.compile(r"\d+%[^\n|]*\|[^\n]*\d+/\d+")
# stderr lines that engines print on their own and that say nothing about the tutorial.
_ENGINE_NOISE = (
    re.compile(r"^Triton is installed, but doesn't include CPU backend"),
    re.compile(r"^\[W\d{4} [\d:.]+ [\w./]+:\d+\] Warning: NUMA binding"),
    re.compile(r"^(INFO|WARNING|DEBUG) \d\d-\d\d [\d:]+ "),  # vLLM's logger
    re.compile(r"^\(EngineCore\w*( pid=\d+)?\) "),
)


def sources(directory: Path = NOTEBOOKS) -> list[Path]:
    """Every tutorial source, ``NN_name.py``, in order."""
    return sorted(directory.glob(SOURCE_PATTERN))


def read_source(path: Path):  # -> nbformat.NotebookNode
    """The notebook a source describes: its cells, the kernel and the jupytext pairing."""
    import jupytext

    notebook = jupytext.read(path, fmt="py:percent")
    notebook.metadata["kernelspec"] = {
        "name": "python3", "display_name": "Python 3", "language": "python",
    }
    notebook.metadata["language_info"] = {"name": "python"}
    notebook.metadata["jupytext"] = {"formats": PAIRING}
    for index, cell in enumerate(notebook.cells):
        cell["id"] = f"{path.stem[:2]}-{index:02d}"  # stable ids: rebuilds diff cleanly
        cell["metadata"] = {}
    return notebook


def _cells(notebook) -> list[tuple[str, str]]:
    return [(cell["cell_type"], cell["source"].strip()) for cell in notebook.cells]


def mismatches(source: Path) -> list[str]:
    """How the stored ``.ipynb`` differs from ``source`` (empty when they match)."""
    import nbformat

    stored_path = source.with_suffix(".ipynb")
    if not stored_path.exists():
        return [f"{stored_path.name} is missing; run python tools/build_notebooks.py "
                f"{source.stem[:2]}"]
    wanted = _cells(read_source(source))
    stored = _cells(nbformat.read(stored_path, as_version=4))
    found: list[str] = []
    if len(wanted) != len(stored):
        found.append(f"{stored_path.name} has {len(stored)} cells, {source.name} has "
                     f"{len(wanted)}")
    for index, (want, have) in enumerate(zip(wanted, stored, strict=False)):
        if want != have:
            found.append(f"cell {index}: {source.name} has a {want[0]} cell starting "
                         f"{want[1][:60]!r}, {stored_path.name} a {have[0]} cell starting "
                         f"{have[1][:60]!r}")
    return found


def output_problems(notebook) -> list[str]:
    """What a stored notebook must not carry: widget state, widget views without a
    static fallback, progress bars, engine noise."""
    found = []
    if "widgets" in notebook.metadata:
        found.append("notebook metadata holds widget state")
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                found.append(f"cell {index}: a widget view is stored (needs a static fallback)")
            text = output.get("text", "") + "".join(
                data.get("text/plain", "") if isinstance(data.get("text/plain"), str)
                else data.get("text/plain", []))
            if _PROGRESS.search(text):
                found.append(f"cell {index}: a progress bar is stored")
            if output.get("name") == "stderr" and _noise_only(output["text"]):
                found.append(f"cell {index}: engine noise on stderr is stored")
    return found


def _noise_only(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and all(
        any(pattern.search(line) for pattern in _ENGINE_NOISE) or _PROGRESS.search(line)
        for line in lines
    )


def clean_outputs(notebook) -> list[str]:
    """Remove progress bars, engine noise and widget views (whose state is not stored:
    the snapshot beside them is what readers see); return what was kept on stderr."""
    kept_stderr: list[str] = []
    notebook.metadata.pop("widgets", None)
    for index, cell in enumerate(notebook.cells):
        if cell["cell_type"] != "code":
            continue
        outputs = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                lines = [line for line in output["text"].splitlines(keepends=True)
                         if not (any(p.search(line) for p in _ENGINE_NOISE)
                                 or _PROGRESS.search(line))]
                if not "".join(lines).strip():
                    continue
                output["text"] = "".join(lines)
                kept_stderr.append(f"cell {index}: {output['text'][:200]!r}")
            data = output.get("data")
            if data is not None:
                plain = data.get("text/plain", "")
                plain = plain if isinstance(plain, str) else "".join(plain)
                if _PROGRESS.search(plain):
                    continue  # a tqdm bar (a widget, shown as text without one)
                data.pop(WIDGET_VIEW, None)
                if not data:
                    continue
            outputs.append(output)
        cell["outputs"] = outputs
    return kept_stderr


def build(source: Path) -> Path:
    """Execute ``source`` in a fresh kernel and write its cleaned ``.ipynb``."""
    import nbformat
    from nbclient import NotebookClient

    notebook = read_source(source)
    environment = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
    }
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)  # the kernel inherits this process's environment
    try:
        NotebookClient(
            notebook, timeout=600, kernel_name="python3",
            resources={"metadata": {"path": str(source.parent)}},
            store_widget_state=False, record_timing=False,
        ).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    for line in clean_outputs(notebook):
        print(f"  stderr kept in {source.stem}, {line}")
    target = source.with_suffix(".ipynb")
    nbformat.write(notebook, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="tutorial numbers or names (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="only compare stored notebooks with their sources")
    args = parser.parse_args(argv)
    chosen = [path for path in sources()
              if not args.names or any(path.stem.startswith(name) for name in args.names)]
    if not chosen:
        print(f"no tutorial matches {args.names}; sources: {[p.name for p in sources()]}")
        return 2
    if args.check:
        problems = [f"{path.name}: {problem}" for path in chosen for problem in mismatches(path)]
        print("\n".join(problems) or f"{len(chosen)} notebooks match their sources")
        return 1 if problems else 0
    for path in chosen:
        print(f"building {path.with_suffix('.ipynb').relative_to(REPO)}")
        build(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
