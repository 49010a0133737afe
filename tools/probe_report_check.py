"""Check that the bundled probe's artifacts agree with each other (a report, not a test).

    .venv/bin/python tools/probe_report_check.py

``python -m tools.tiny_model.probe_fit`` writes ``probe.safetensors`` and
``probe_report.json`` in one run, and ``docs/model.md`` quotes the report. Checking
one of these against another cannot catch a bug in that run (they are its own
output), so the test suite measures the probe instead (``tests/models/
test_tiny_probe.py``: accuracy on fresh prompts, the abort threshold, live scores
against a plain forward hook). This script is for whoever refits the probe or edits
the docs: it prints what the report claims and exits 1 when the artifacts disagree
(layer or threshold in the file, the control margins, the tables quoted in the docs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script: tools.tiny_model is importable


def problems() -> list[str]:
    """Every disagreement between the probe file, its report and docs/model.md."""
    from tools.tiny_model.probe_fit import report_markdown
    from undercurrent.models import tiny_model_path, tiny_probe_path
    from undercurrent.probes.weights import load_linear_weights

    report = json.loads((tiny_model_path() / "probe_report.json").read_text())
    meta = load_linear_weights(tiny_probe_path()).metadata
    found = []
    if int(meta["layer"]) != report["best_layer"]:
        found.append(f"probe.safetensors is for layer {meta['layer']}, the report's best "
                     f"layer is {report['best_layer']}")
    if abs(float(meta["threshold"]) - float(report["threshold"])) > 1e-9:
        found.append(f"probe.safetensors threshold {meta['threshold']} != report's "
                     f"{report['threshold']}")
    best = report["layers"][str(report["best_layer"])]
    trained, control = best["trained"], best["random_init"]
    print(f"best layer {report['best_layer']}: accuracy {trained['accuracy_all_tokens']:.3f} "
          f"(random-init control {control['accuracy_all_tokens']:.3f}), before the reveal "
          f"{trained['accuracy_before_reveal']:.3f} (control "
          f"{control['accuracy_before_reveal']:.3f})")
    if trained["accuracy_all_tokens"] < control["accuracy_all_tokens"] + 0.08:
        found.append("the best layer beats the random-init control by less than 0.08")
    if trained["accuracy_before_reveal"] < control["accuracy_before_reveal"] + 0.05:
        found.append("before the reveal, the best layer beats the control by less than 0.05")
    docs = REPO / "docs" / "model.md"
    text = docs.read_text()
    found += [f"docs/model.md does not quote the report's line: {line}"
              for line in report_markdown(report).splitlines()
              if line.startswith("|") and line not in text]
    return found


def main() -> int:
    found = problems()
    for problem in found:
        print(f"MISMATCH: {problem}", file=sys.stderr)
    print("the probe file, probe_report.json and docs/model.md agree" if not found
          else f"{len(found)} mismatch(es)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
