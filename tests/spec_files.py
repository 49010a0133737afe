"""The spec files the project ships: the repository's examples (``specs/``) and the
demo's specs inside the package (``undercurrent:models/demo.yaml``, ...)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "specs"
SHIPPED = REPO / "undercurrent" / "models"  # (the demo's specs, beside the bundled model)
SPEC_FILES = sorted([*EXAMPLES.glob("*.yaml"), *SHIPPED.glob("*.yaml")], key=lambda p: p.name)
