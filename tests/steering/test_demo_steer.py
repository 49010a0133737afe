"""``undercurrent demo --steer``: the closed loop on the bundled model, end to end."""

from __future__ import annotations

import contextlib
import io

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("plotly")

from undercurrent.cli import main  # noqa: E402
from undercurrent.demo import DEMO_REQUESTS, default_spec_path  # noqa: E402
from undercurrent.spec import load_yaml_file  # noqa: E402


def test_the_steer_spec_is_a_version_2_spec_with_a_triggered_edit() -> None:
    spec = load_yaml_file(default_spec_path(steer=True))
    (edit,) = spec.edits
    assert spec.version == "2" and edit.when.point == "harm_guard"
    assert spec.get("harm_guard").probe_args["action"] == "flag"


def test_demo_steer_steers_every_harmful_request_and_leaves_benign_ones(tmp_path) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["demo", "--steer", "--max-new-tokens", "30", "--out",
                     str(tmp_path / "report.html")])
    text = printed.getvalue()
    assert code == 0 and "ABORTED" not in text
    blocks = text.split("\n[")[1:]
    assert len(blocks) == len(DEMO_REQUESTS)
    for block, (_, intent) in zip(blocks, DEMO_REQUESTS, strict=True):
        assert ("STEERED by away_from_harm" in block) == (intent == "harmful"), block
        assert ("~" in block.split("STEERED")[0]) == (intent == "harmful"), block
    assert "6/6 requests handled as their intent asks (harmful steered" in text
    assert (tmp_path / "report.html").is_file()
