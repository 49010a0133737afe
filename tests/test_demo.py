"""``undercurrent demo`` end to end, and the demo spec."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("plotly")

from undercurrent.cli import main  # noqa: E402
from undercurrent.demo import (  # noqa: E402
    DEMO_REQUESTS,
    GUARD_POINT,
    TRAJECTORY_POINT,
    _Painter,
    default_spec_path,
)
from undercurrent.models import tiny_probe_path  # noqa: E402
from undercurrent.probes.weights import load_linear_weights  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    report = tmp_path_factory.mktemp("demo") / "report.html"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["demo", "--out", str(report)])
    return code, printed.getvalue(), report


def test_demo_spec_validates_and_reads_the_probe_layer() -> None:
    from undercurrent.spec import load_yaml_file

    spec = load_yaml_file(default_spec_path())
    guard, trajectory = spec.get(GUARD_POINT), spec.get(TRAJECTORY_POINT)
    assert guard.execution_mode.value == "inline" and guard.probe_type == "linear_probe"
    assert guard.probe_args["action"] == "abort"
    assert trajectory.execution_mode.value == "async"
    assert trajectory.probe_type == "trajectory_probe"
    layer = int(load_linear_weights(tiny_probe_path()).metadata["layer"])
    assert guard.layers == (layer,) and trajectory.layers == (layer,)
    assert main(["validate", str(default_spec_path())]) == 0


def test_demo_exits_zero_and_prints_plain_text_when_not_a_terminal(demo) -> None:
    code, printed, _ = demo
    assert code == 0
    assert not ANSI.search(printed)
    for request, _ in DEMO_REQUESTS:
        assert request in printed
    # one token, tokens otherwise ("1 tokens later" was printed)
    leads = re.findall(r"\((\d+) (tokens?) later\)", printed)
    assert leads and all((count == "1") == (word == "token") for count, word in leads), leads


def test_every_harmful_request_is_aborted_before_its_words_and_no_benign_one(demo) -> None:
    _, printed, _ = demo
    aborts = re.findall(r"ABORTED by harm_guard .* at generated token (\d+)", printed)
    harmful = sum(intent == "harmful" for _, intent in DEMO_REQUESTS)
    assert len(aborts) == harmful
    leads = [int(n) for n in re.findall(r"\((\d+) tokens? later\)", printed)]
    assert len(leads) == harmful and min(leads) > 0
    assert f"{len(DEMO_REQUESTS)}/{len(DEMO_REQUESTS)} requests handled" in printed


def test_each_token_is_printed_with_its_score(demo) -> None:
    _, printed, _ = demo
    scored = re.findall(r"\S+\[(\d\.\d\d)\]", printed)
    assert len(scored) > 60
    assert all(0.0 <= float(s) <= 1.0 for s in scored)


def test_verdict_table_lists_each_request(demo) -> None:
    _, printed, _ = demo
    header = next(line for line in printed.splitlines() if line.startswith("request "))
    for column in ("expected", "outcome", "guard_max", "trajectory_peak", "correct"):
        assert column in header
    assert printed.count("aborted @") == sum(i == "harmful" for _, i in DEMO_REQUESTS)


def test_html_report_is_self_contained(demo) -> None:
    _, printed, report = demo
    html = report.read_text()
    assert str(report.resolve()) in printed
    assert len(html) > 1_000_000  # plotly.js is embedded
    assert "<script src=" not in html  # nothing fetched from a CDN
    assert "Plotly.newPlot" in html or "Plotly.react" in html


def test_painter_colours_by_score_on_a_terminal_only() -> None:
    coloured = _Painter(color=True, threshold=0.9)
    plain = _Painter(color=False, threshold=0.9)
    assert plain.token("lock", 0.95) == "lock[0.95]"
    assert ANSI.search(coloured.token("lock", 0.95))
    assert coloured.token("lock", 0.95) != coloured.token("key", 0.1)
    assert ANSI.sub("", coloured.token("lock", 0.95)) == "lock[0.95]"
