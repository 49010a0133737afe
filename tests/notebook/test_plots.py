"""Plots return plotly figures whose data is exactly what the frames say."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest
from nb_builders import make_records, make_result

from undercurrent.models import tiny_model_path
from undercurrent.notebook import (
    activation_matrix,
    heatmap_figure,
    projection_figure,
    record_tensors,
    records_frame,
    signals_frame,
    trajectory_figure,
    verdict_figure,
)
from undercurrent.records import ProbeResult, ProbeSignal, ProbeStats, SignalAction


def test_trajectory_has_one_line_per_request_point_layer_and_marks_aborts():
    results = [
        {"p": make_result("r0", "p", [0.1, 0.4, 0.95], ["continue", "flag", "abort"])},
        {"p": make_result("r1", "p", [0.2, 0.3])},
    ]
    figure = trajectory_figure(results, threshold=0.9)
    assert isinstance(figure, go.Figure)
    lines = [t for t in figure.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["r0 · p · L1", "r1 · p · L1"]
    assert list(lines[0].x) == [0, 1, 2] and list(lines[0].y) == pytest.approx([0.1, 0.4, 0.95])
    aborts = [t for t in figure.data if t.name == "r0 · p · L1 abort"]
    assert len(aborts) == 1 and list(aborts[0].x) == [2]
    assert figure.layout.shapes[0].y0 == 0.9


def test_trajectory_falls_back_to_signal_order_when_tokens_are_unknown():
    figure = trajectory_figure({"q": make_result("r0", "q", [0.5, None, 0.7],
                                                 with_location=False)})
    (line,) = figure.data
    assert list(line.x) == [0, 2] and list(line.y) == pytest.approx([0.5, 0.7])
    assert line.name == "r0 · q"


def test_heatmap_is_layer_by_token_of_the_chosen_value():
    records = make_records(requests=2, layers=(0, 1, 2), prompt_len=2, generated=3)
    figure = heatmap_figure(records, request="req1")
    (heat,) = figure.data
    z = np.asarray(heat.z)
    assert z.shape == (3, 5)
    expected = {
        (r.layer, r.token_index): np.linalg.norm(r.tensor) for r in records
        if r.request_id == "req1"
    }
    for (layer, token), norm in expected.items():
        assert z[layer, token] == pytest.approx(norm, rel=1e-6)
    assert list(heat.y) == ["L0", "L1", "L2"]


def test_heatmap_accepts_a_score_function_and_labels_tokens_with_text():
    class Tok:
        def decode(self, ids):
            return f"w{ids[0]}"

    frame = records_frame(make_records(requests=1, layers=(0,), prompt_len=1, generated=1),
                          tokenizer=Tok())
    figure = heatmap_figure(frame, value=lambda a: a[0])
    assert list(figure.data[0].x) == ["0 'w10'", "1* 'w11'"]
    assert np.asarray(figure.data[0].z)[0, 0] == pytest.approx(
        activation_matrix(frame)[0, 0])


def test_heatmap_names_the_available_requests_when_one_is_missing():
    with pytest.raises(ValueError, match="req0"):
        heatmap_figure(make_records(requests=1), request="nope")


def test_trajectory_keeps_the_requests_named_and_refuses_one_it_has_no_signals_of():
    # (requests=["typo"] drew an empty figure; requests="r0" failed inside pandas)
    results = [{"p": make_result("r0", "p", [0.1, 0.4])}, {"p": make_result("r1", "p", [0.2])}]
    (line,) = [t for t in trajectory_figure(results, requests="r0").data]
    assert line.name.startswith("r0") and trajectory_figure(results, points="p").data
    with pytest.raises(ValueError, match=r"requests: no signals of request 'r2'.*the requests "
                                         r"with signals are \['r0', 'r1'\]"):
        trajectory_figure(results, requests=["r0", "r2"])
    with pytest.raises(ValueError, match=r"points: no signals of point 'q'"):
        trajectory_figure(results, points=["q"])


def test_plot_options_of_the_wrong_kind_are_refused_naming_the_argument():
    results = {"p": make_result("r0", "p", [0.5])}
    records = make_records(requests=2, layers=(0,), hidden=5)
    with pytest.raises(TypeError, match=r"trajectory_figure: names must be a mapping "
                                        r"\{request: name\}, got list"):
        trajectory_figure(results, names=["a"])
    with pytest.raises(TypeError, match=r"trajectory_figure: threshold must be a number, got "
                                        r"str \('0.5'\)"):
        trajectory_figure(results, threshold="0.5")
    # (threshold=nan drew no line; color_by=5 was "'int' object is not iterable")
    with pytest.raises(ValueError, match=r"trajectory_figure: threshold must be a finite "
                                         r"number, got nan"):
        trajectory_figure(results, threshold=float("nan"))
    with pytest.raises(TypeError, match=r"trajectory_figure: color_by must be a frame column, "
                                        r"a \{request: label\} mapping or None, got int"):
        trajectory_figure(results, color_by=5)
    with pytest.raises(TypeError, match=r"heatmap_figure draws one request: request must be a "
                                        r"request id \(a string\), got list"):
        heatmap_figure(records, request=["req0"])
    with pytest.raises(ValueError, match=r"projection_figure: labels='label' names no column "
                                         r"of the frame; its columns are \['request'"):
        projection_figure(records, "label", layer=0)


def test_projection_separates_labelled_clusters_along_the_first_component():
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(-5, 1, (30, 8)), rng.normal(5, 1, (30, 8))])
    labels = ["a"] * 30 + ["b"] * 30
    figure = projection_figure(X, labels)
    a, b = figure.data
    assert (a.name, b.name) == ("a", "b")
    assert np.sign(np.mean(a.x)) != np.sign(np.mean(b.x))
    assert "of variance" in figure.layout.xaxis.title.text


def test_projection_takes_request_labels_for_a_records_frame():
    records = make_records(requests=4, layers=(0, 1), hidden=5)
    figure = projection_figure(records, {"req0": 0, "req1": 1, "req2": 0, "req3": 1}, layer=0)
    assert sum(len(t.x) for t in figure.data) == 4 * 7


def test_projection_draws_unlabelled_rows_as_a_group_of_their_own():
    # They were refused with the fit's message ("label every row that is fitted"):
    # a plot fits nothing, and before they were drawn.
    from undercurrent.notebook import fit_linear_probe

    frame = records_frame(make_records(requests=4, layers=(0, 1), hidden=5))
    frame["label"] = frame["request"].map({"req0": "a", "req1": "b", "req2": None,
                                           "req3": "a"})
    figure = projection_figure(frame, "label", layer=0)
    assert [trace.name for trace in figure.data] == ["a", "b", "(no label)"]
    # (the same PCA as with every row labelled: the unlabelled rows are req2's)
    labelled = projection_figure(frame.fillna({"label": "c"}), "label", layer=0)
    unlabelled, req2 = figure.data[2], labelled.data[2]
    assert req2.name == "c" and len(req2.x) == 7
    np.testing.assert_array_equal(unlabelled.x, req2.x)
    np.testing.assert_array_equal(unlabelled.y, req2.y)
    as_list = frame.loc[frame["layer"] == 0, "label"].tolist()  # (None, per row)
    assert [t.name for t in projection_figure(frame, as_list, layer=0).data] == [
        "a", "b", "(no label)"]
    with pytest.raises(ValueError, match="1 row has no label|rows have no label"):
        fit_linear_probe(frame, "label", layer=0)


def test_verdict_counts_each_request_once_per_point_by_outcome():
    results = [
        {"p": make_result("r0", "p", [0.9], ["abort"]), "q": make_result("r0", "q", [0.1])},
        {"p": make_result("r1", "p", [0.6], ["flag"]), "q": make_result("r1", "q", [0.2])},
        {"p": make_result("r2", "p", [0.1]), "q": make_result("r2", "q", [0.7], ["flag"])},
    ]
    figure = verdict_figure(results)
    counts = {t.name: dict(zip(t.x, t.y, strict=True)) for t in figure.data}
    assert counts["aborted"] == {"p": 1, "q": 0}
    assert counts["flagged"] == {"p": 1, "q": 1}
    assert counts["clean"] == {"p": 1, "q": 2}
    assert counts["error"] == {"p": 0, "q": 0}


def test_trajectory_coloured_by_label_has_one_colour_and_one_legend_entry_per_label():
    results = [
        {"p": make_result(f"r{i}", "p", [0.1 * i, 0.2], ["continue", "abort" if i == 1 else
                                                        "continue"])}
        for i in range(4)
    ]
    label = {"r0": "benign", "r1": "harmful", "r2": "benign", "r3": "harmful"}
    names = {f"r{i}": f"p{i} ({label[f'r{i}']})" for i in range(4)}
    figure = trajectory_figure(results, color_by=label, names=names)
    lines = [t for t in figure.data if t.mode == "lines+markers"]
    colours = {t.hovertemplate.split("<br>")[0]: t.line.color for t in lines}
    assert colours["p0 (benign)"] == colours["p2 (benign)"]
    assert colours["p1 (harmful)"] == colours["p3 (harmful)"] != colours["p0 (benign)"]
    assert [t.name for t in figure.data if t.showlegend is not False] == ["benign", "harmful"]
    assert figure.layout.legend.title.text == "label"
    (abort,) = [t for t in figure.data if t.name.endswith("abort")]
    assert abort.legendgroup == "harmful"


def test_trajectory_colours_frames_joined_with_repeated_row_labels():
    # Two runs' signals frames joined the usual way (pd.concat) repeat the row
    # labels 0..n of each: colouring reads each line's group by position.
    import pandas as pd

    first = signals_frame([{"p": make_result("r0", "p", [0.1, 0.2])}])
    second = signals_frame([{"p": make_result("r1", "p", [0.3, 0.4])}])
    both = pd.concat([first.assign(label="benign"), second.assign(label="harmful")])
    assert both.index.has_duplicates
    for color_by in ("label", {"r0": "benign", "r1": "harmful"}):
        figure = trajectory_figure(both, color_by=color_by)
        lines = {t.legendgroup: t for t in figure.data if t.mode == "lines+markers"}
        assert sorted(lines) == ["benign", "harmful"]
        assert list(lines["harmful"].y) == [0.3, 0.4]
        assert lines["benign"].line.color != lines["harmful"].line.color


def test_trajectory_color_by_names_the_missing_groups():
    results = {"p": make_result("r0", "p", [0.5])}
    with pytest.raises(ValueError, match="r0"):
        trajectory_figure(results, color_by={"other": "x"})
    with pytest.raises(ValueError, match="not a column"):
        trajectory_figure(results, color_by="label")


def test_heatmap_and_projection_use_the_names_given_for_requests():
    records = make_records(requests=2, layers=(0,), hidden=5)
    names = {"req0": "p0 (benign)", "req1": "p1 (harmful)"}
    heat = heatmap_figure(records, request="req1", names=names)
    assert "p1 (harmful)" in heat.layout.title.text
    projection = projection_figure(records, {"req0": 0, "req1": 1}, layer=0, names=names)
    hover = [text for trace in projection.data for text in trace.text]
    assert hover and all(text.startswith(("p0 (benign) ·", "p1 (harmful) ·")) for text in hover)


@pytest.fixture(scope="module")
def three_points_frame():
    """Real records of one request: residual stream at layers 0-3, mlp_out and kv at 1."""
    if not (tiny_model_path() / "config.json").exists():  # pragma: no cover - ships with repo
        pytest.skip("the bundled model is not built yet")
    from undercurrent import ProbedModel
    from undercurrent.spec import parse_yaml

    spec = parse_yaml("""
extraction_points:
  - {name: resid, layers: [0, 1, 2, 3], tensor_type: residual_stream,
     position: "generated[0:3]", probe_type: norm_probe, probe_kind: trajectory}
  - {name: mlp, layers: [1], tensor_type: mlp_out,
     position: "generated[0:3]", probe_type: norm_probe, probe_kind: trajectory}
  - {name: kv, layers: [1], tensor_type: kv,
     position: "generated[0:3]", probe_type: norm_probe, probe_kind: trajectory}
""")
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    try:
        (output,) = model.generate(["the cat sat on"], max_new_tokens=4, records=True)
    finally:
        model.close()
    return records_frame(output)


def test_heatmap_of_several_points_has_one_row_per_point_and_layer(three_points_frame):
    frame = three_points_frame
    figure = heatmap_figure(frame)
    (heat,) = figure.data
    rows = ["resid L0", "resid L1", "resid L2", "resid L3", "mlp L1", "kv L1"]
    assert list(heat.y) == rows
    z = np.asarray(heat.z)
    tokens = sorted(frame["token_index"].unique())
    assert z.shape == (len(rows), len(tokens))
    for row, tensor in zip(frame.itertuples(index=False), record_tensors(frame), strict=True):
        cell = z[rows.index(f"{row.point} L{row.layer}"), tokens.index(row.token_index)]
        assert cell == pytest.approx(np.linalg.norm(tensor.astype(np.float64)), rel=1e-6)
    assert not np.isnan(z).any()
    assert figure.layout.yaxis.title.text == "point · layer"
    resid = heatmap_figure(frame, point="resid").data[0]
    assert list(resid.y) == ["L0", "L1", "L2", "L3"]


def test_heatmap_refuses_two_records_for_the_same_cell():
    records = make_records(requests=1, layers=(0,), prompt_len=1, generated=1)
    with pytest.raises(ValueError, match="more than one record for point 'resid', layer 0"):
        heatmap_figure(records + records)


def _signal(action: str, score: float | None, generated_index: int) -> ProbeSignal:
    return ProbeSignal(action=SignalAction(action), score=score,
                       metadata={"generated_index": generated_index})


def _result(request: str, *signals: ProbeSignal) -> ProbeResult:
    return ProbeResult(request_id=request, extraction_point_name="p", verdict=None,
                       signals=signals, stats=ProbeStats())


def test_trajectory_draws_aborts_and_flags_that_have_no_score():
    figure = trajectory_figure([
        _result("r0", _signal("continue", 0.3, 0), _signal("continue", 0.5, 1),
                _signal("abort", None, 2)),
        _result("r1", _signal("flag", None, 0), _signal("continue", 0.7, 1)),
        _result("r2", _signal("abort", None, 0)),
    ], threshold=0.9)
    traces = {trace.name: trace for trace in figure.data}
    assert list(traces["r0 · p abort"].x) == [2]
    assert list(traces["r0 · p abort"].y) == pytest.approx([0.5])  # the line's last score
    assert list(traces["r0 · p abort"].text) == ["no score"]
    assert list(traces["r1 · p flag"].y) == pytest.approx([0.7])  # none before: the next
    assert list(traces["r2 · p abort"].y) == pytest.approx([0.9])  # no line: the threshold
    assert list(traces["r0 · p"].x) == [0, 1]  # the line joins the scores alone
    assert "r2 · p" not in traces


def test_trajectory_names_the_accepted_x_columns():
    with pytest.raises(ValueError, match="x='nope'.*'generated_index', 'token_index'"):
        trajectory_figure({"p": make_result("r0", "p", [0.5])}, x="nope")


def test_projection_names_the_filter_and_what_the_frame_holds_when_nothing_is_left():
    frame = records_frame(make_records(requests=2, layers=(0, 1)))
    with pytest.raises(ValueError, match=r"layer=9.*points \['resid'\] and layers \[0, 1\]"):
        projection_figure(frame, layer=9)


def test_heatmap_refuses_a_frame_without_activations_instead_of_drawing_nan():
    # A tensors=False frame, or one merged without its attrs, drew an all-NaN heatmap.
    import pandas as pd

    records = make_records(requests=2, layers=(0, 1))
    frame = records_frame(records)
    merged = frame.merge(pd.DataFrame({"request": ["req0", "req1"], "label": [0, 1]}),
                         on="request")
    for bare in (records_frame(records, tensors=False), merged):
        with pytest.raises(ValueError, match=r"^heatmap_figure: this frame carries no "
                                             r"activations \(built with tensors=False"):
            heatmap_figure(bare)
    merged.attrs.update(frame.attrs)  # the way the message gives
    assert not np.isnan(np.asarray(heatmap_figure(merged).data[0].z, dtype=float)).any()


def test_projection_refuses_rows_of_several_layers_as_a_fit_does():
    # One PCA ran over the rows of layers 0 and 1 together, without a word.
    from undercurrent.notebook import fit_linear_probe

    frame = records_frame(make_records(requests=4, layers=(0, 1), hidden=5))
    labels = {"req0": 0, "req1": 1, "req2": 0, "req3": 1}
    with pytest.raises(ValueError, match=r"^projection_figure: the frame mixes layers \[0, 1\], "
                                         r"and projection_figure reads one; pass layer=\.\.\. "
                                         r"\(e\.g\. layer=0\)$"):
        projection_figure(frame, labels)
    with pytest.raises(ValueError, match=r"^fit_linear_probe: the frame mixes layers \[0, 1\]"):
        fit_linear_probe(frame, labels)
    # (a list of several layers, which select_rows reads as "any of": rows of both)
    for read in (projection_figure, fit_linear_probe):
        with pytest.raises(ValueError, match=rf"^{read.__name__}: layer=\[0, 1\] selects layers "
                                             r"\[0, 1\], and \w+ reads one"):
            read(frame, labels, layer=[0, 1])
    two_points = records_frame(make_records(requests=4, layers=(0, 1), hidden=5)
                               + make_records(requests=4, layers=(0,), hidden=5, point="other"))
    with pytest.raises(ValueError, match=r"mixes points \['other', 'resid'\].*point='other'"):
        projection_figure(two_points, labels, layer=0)
    figure = projection_figure(two_points, labels, layer=0, point="resid")
    assert sum(len(trace.x) for trace in figure.data) == 4 * 7



@pytest.fixture(scope="module")
def two_requests_frame():
    """Real records of two requests: residual stream at layers 2 and 3, six tokens each."""
    if not (tiny_model_path() / "config.json").exists():  # pragma: no cover - ships with repo
        pytest.skip("the bundled model is not built yet")
    from undercurrent import ProbedModel

    spec = {"version": "1", "extraction_points": [dict(
        name="r", layers=[2, 3], tensor_type="residual_stream", position="generated[*]",
        probe_type="capture", probe_kind="trajectory")]}
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    try:
        outputs = model.generate(["user : how do i open my neighbour's car ? assistant :",
                                  "user : how do i open my car ? assistant :"],
                                 max_new_tokens=6, records=True)
    finally:
        model.close()
    return records_frame(outputs), {outputs[0].request_id: "harmful",
                                    outputs[1].request_id: "benign"}


def _label_of_each_point(figure, names):
    """(trace label, request the point's hover names) for every point drawn."""
    by_name = {name: request for request, name in names.items()}
    return [(trace.name, by_name[text.split(" · ")[0]])
            for trace in figure.data for text in trace.text]


def test_projection_reads_labels_as_a_fit_does_a_series_by_its_index(two_requests_frame):
    from undercurrent.notebook import fit_linear_probe

    frame, by_request = two_requests_frame
    names = {request: f"q{i}" for i, request in enumerate(by_request)}
    labels = frame["request"].map(by_request)  # a Series indexed like the frame
    shuffled = frame.sample(frac=1.0, random_state=1)  # the frame re-sorted afterwards
    assert not shuffled.index.equals(frame.index)
    figure = projection_figure(shuffled, labels, layer=3, names=names)
    drawn = _label_of_each_point(figure, names)
    assert len(drawn) == int((frame["layer"] == 3).sum())
    assert all(label == by_request[request] for label, request in drawn)
    fit_linear_probe(shuffled, labels, layer=3, test_size=0)  # the same labels, accepted


def test_projection_takes_per_row_labels_of_the_whole_frame_or_of_the_filtered_rows(
        two_requests_frame):
    from undercurrent.notebook import fit_linear_probe

    frame, by_request = two_requests_frame
    names = {request: f"q{i}" for i, request in enumerate(by_request)}
    of_frame = [by_request[request] for request in frame["request"]]
    of_rows = [by_request[request] for request in frame.loc[frame["layer"] == 3, "request"]]
    assert len(of_frame) == 2 * len(of_rows)
    for labels in (of_frame, of_rows, by_request, "request"):
        figure = projection_figure(frame, labels, layer=3, names=names)
        expected = by_request if labels != "request" else {r: r for r in by_request}
        assert all(label == expected[request]
                   for label, request in _label_of_each_point(figure, names))
        fit_linear_probe(frame, labels, layer=3, test_size=0)
    with pytest.raises(ValueError, match=r"^projection_figure: 3 labels, but the frame has "):
        projection_figure(frame, of_rows[:3], layer=3)
