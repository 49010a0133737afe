"""Regenerate the README pictures in ``docs/images/`` from the current code.

    .venv/bin/python tools/screenshots.py [--out docs/images]

- ``spec_editor.png`` and ``live_view.png``: a small notebook rendered by Voila
  (the real widgets, with a live kernel), captured in headless Chromium;
- ``trajectory.png``: ``trajectory_figure`` of the bundled model's probe on a
  few prompts, written by plotly with kaleido.

Everything runs offline on CPU with the bundled model (about a minute).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from voila_page import REPO, launch_chromium, serve_notebook  # noqa: E402


def _prompts() -> list[str]:
    """Two harmful and two benign requests from the bundled model's corpus generator."""
    import random

    from undercurrent.models.corpus import make_prompt

    rng = random.Random(3)
    return [make_prompt(rng, label) for label in (1, 0, 1, 0)]



SETUP = f'''
from undercurrent import ProbedModel
from undercurrent.models import tiny_probe_path
from undercurrent.notebook import LiveView, SpecEditor
from undercurrent.probes import load_linear_weights
from undercurrent.spec import parse_yaml

meta = load_linear_weights(tiny_probe_path()).metadata
spec = parse_yaml(f"""
extraction_points:
  - name: harm_probe
    layers: {{meta['layer']}}
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: linear_probe
    probe_kind: single_shot
    probe_args: {{{{path: "undercurrent:models/tiny/probe.safetensors", action: abort}}}}
""")
model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
PROMPTS = {_prompts()!r}
'''

EDITOR = '''
editor = SpecEditor.from_spec(spec, model=model)
editor.duplicate_point()
editor.fields["name"].value = "trajectory_watch"
editor.fields["probe_type"].value = "trajectory_probe"
editor.fields["probe_kind"].value = "trajectory"
editor.fields["execution_mode"].value = "async"
editor.fields["queue_depth"].value = "16"
editor.fields["stride"].value = 2
editor
'''

LIVE = '''
view = LiveView(model, threshold=float(meta.get("threshold", 0.5)))
view.run(PROMPTS[:3], labels=["harmful 1", "benign 2", "harmful 3"], max_new_tokens=28,
         display=False)
view
'''


def _notebook(path: Path) -> None:
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(SETUP.strip()),
        nbformat.v4.new_code_cell(EDITOR.strip()),
        nbformat.v4.new_code_cell(LIVE.strip()),
    ])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, path)


def widget_screenshots(out: Path) -> list[Path]:
    """The spec editor and the live view, rendered by Voila and captured by Chromium."""
    from playwright.sync_api import sync_playwright

    written = []
    with tempfile.TemporaryDirectory() as scratch:
        notebook = Path(scratch) / "screenshots.ipynb"
        _notebook(notebook)
        with serve_notebook(notebook, Path(scratch) / "voila.log") as url:
            with sync_playwright() as playwright:
                browser = launch_chromium(playwright)
                try:
                    page = browser.new_page(viewport={"width": 1200, "height": 1000},
                                            device_scale_factor=1)
                    page.goto(url, timeout=240_000)
                    for selector, name in ((".undercurrent-spec-editor", "spec_editor.png"),
                                           (".undercurrent-live-view", "live_view.png")):
                        element = page.wait_for_selector(selector, timeout=240_000)
                        if name == "live_view.png":
                            page.wait_for_selector(".undercurrent-live-view .main-svg",
                                                   timeout=60_000)
                            page.wait_for_timeout(1500)  # let plotly finish drawing
                        element.screenshot(path=str(out / name))
                        written.append(out / name)
                finally:
                    browser.close()
    return written


def trajectory_picture(out: Path) -> Path:
    """Score trajectories of the bundled probe on the prompts, via plotly + kaleido."""
    from undercurrent import ProbedModel
    from undercurrent.models import tiny_probe_path
    from undercurrent.notebook import trajectory_figure
    from undercurrent.probes import load_linear_weights
    from undercurrent.spec import parse_yaml

    meta = load_linear_weights(tiny_probe_path()).metadata
    spec = parse_yaml(f"""
extraction_points:
  - name: harm_probe
    layers: {meta['layer']}
    tensor_type: residual_stream
    position: "generated[*]"
    probe_type: linear_probe
    probe_kind: single_shot
    probe_args: {{path: "undercurrent:models/tiny/probe.safetensors"}}
""")
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as model:
        outputs = model.generate(_prompts(), max_new_tokens=28)
    kinds = ("harmful", "benign", "harmful", "benign")  # the labels _prompts() drew
    names = {o.request_id: f"prompt {i} ({kinds[i]})" for i, o in enumerate(outputs)}
    figure = trajectory_figure(outputs, threshold=float(meta.get("threshold", 0.5)),
                               names=names,
                               color_by={o.request_id: kinds[i] for i, o in enumerate(outputs)},
                               title="P(harmful) per generated token, bundled model")
    target = out / "trajectory.png"
    figure.write_image(str(target), width=900, height=420, scale=1)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--only", choices=("widgets", "trajectory"), default=None)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.only in (None, "trajectory"):
        written.append(trajectory_picture(args.out))
    if args.only in (None, "widgets"):
        written += widget_screenshots(args.out)
    for path in written:
        print("wrote", path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
