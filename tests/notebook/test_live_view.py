"""LiveView: stream events in, coloured tokens, score lines and abort markers out.

A scripted model yields real ``StreamEvent``s (the adapters' own types), so the
view is checked against known scores; the last tests run the bundled model with
probes that return chosen scores (NaN, a prompt-token abort, an abort without a
score), and ``test_end_to_end.py`` runs a fitted probe in the view.
"""

from __future__ import annotations

import html
import json
import re

import pytest

from undercurrent.adapters.outputs import AbortInfo, GenerationOutput, StreamEvent, TokenSignal
from undercurrent.models import tiny_model_path
from undercurrent.notebook import LiveView
from undercurrent.probes import probe
from undercurrent.records import ProbeSignal, SignalAction
from undercurrent.spec import ExtractionPoint, ProbeSpec


class ScriptedModel:
    """``stream(prompt)`` yields one event per token; token g's signal comes with event g+1."""

    def __init__(self, scores: dict[str, list[float]], abort_at: dict[str, int] | None = None):
        self.scores = scores
        self.abort_at = abort_at or {}
        self.calls: list[tuple[str, dict]] = []

    def stream(self, prompt: str, **kwargs):
        self.calls.append((prompt, kwargs))
        request = f"req-{prompt}"
        scores = self.scores[prompt]
        stop = self.abort_at.get(prompt)
        prompt_len = 3
        located = []
        pending: tuple = ()
        for g, score in enumerate(scores):
            yield StreamEvent(request, token_id=100 + g, text=f" w{g}", token_index=prompt_len + g,
                              generated_index=g, signals=pending)
            action = SignalAction.ABORT if g == stop else SignalAction.CONTINUE
            signal = TokenSignal("watch", 2, prompt_len + g, g, ProbeSignal(action, score))
            located.append(signal)
            pending = (signal,)
            if g == stop:
                break
        abort = None
        if stop is not None:
            abort = AbortInfo("watch", 2, prompt_len + stop, stop, located[-1].signal)
        output = GenerationOutput(
            request_id=request, prompt=prompt, text="", token_ids=tuple(range(len(located))),
            prompt_len=prompt_len, finish_reason="abort" if abort else "length", abort=abort,
            signals=tuple(located),
        )
        yield StreamEvent(request, None, "", None, None, signals=pending, aborted=bool(abort),
                          finished=True, output=output)


def _token_scores(view: LiveView) -> list[str]:
    return re.findall(r'data-score="([^"]*)"', view.text_html())


def test_every_token_is_coloured_by_its_score_with_the_score_on_hover():
    model = ScriptedModel({"a": [0.1, 0.5, 0.9]})
    view = LiveView(model)
    outputs = view.run("a", display=False, max_new_tokens=3)
    assert model.calls == [("a", {"max_new_tokens": 3})]
    assert len(outputs) == 1 and outputs[0].request_id == "req-a"
    assert _token_scores(view) == ["0.100000", "0.500000", "0.900000"]
    text = html.unescape(view.text_html())
    assert 'title="token 2: score 0.900"' in text
    assert "rgba(214,39,40,0.80)" in text  # 0.9 on the default 0..1 scale
    assert "prompt 1: a" in text and ">a<" in text  # default label and prompt


def test_plot_has_one_line_per_request_and_point_with_each_score():
    view = LiveView(ScriptedModel({"a": [0.1, 0.5], "b": [0.7, 0.2, 0.3]}), threshold=0.6)
    view.run(["a", "b"], display=False)
    lines = {t.name: (list(t.x), list(t.y)) for t in view.figure.data}
    assert lines == {
        "prompt 1: a": ([0, 1], [0.1, 0.5]),
        "prompt 2: b": ([0, 1, 2], [0.7, 0.2, 0.3]),
    }
    assert view.figure.layout.shapes[0].y0 == 0.6


def test_the_view_updates_while_tokens_arrive():
    model = ScriptedModel({"a": [0.2, 0.4, 0.6]})
    view = LiveView(model)
    seen = []
    for event in model.stream("a"):
        view.update(event)
        seen.append(len(re.findall('class="uc-token"', view.text_html())))
    assert seen == [1, 2, 3, 3]
    assert "…" not in view.text_html()  # finished requests lose the "still running" mark


def test_an_abort_is_marked_in_the_text_the_plot_and_a_message():
    view = LiveView(ScriptedModel({"a": [0.1, 0.95, 0.2], "b": [0.1, 0.2]}, abort_at={"a": 1}))
    view.run(["a", "b"], display=False)
    text = html.unescape(view.text_html())
    assert text.count("✖\xa0aborted") == 1
    assert "outline:2px solid #b00020" in text and "token 1: score 0.950 (abort)" in text
    message = html.unescape(view.message.value)
    assert "prompt 1: a" in message
    assert "aborted by 'watch' (layer 2) at generated token 1" in message
    assert "score 0.950" in message and "prompt 2" not in message
    (marker,) = [t for t in view.figure.data if t.name == "prompt 1: a: abort"]
    assert list(marker.x) == [1] and list(marker.y) == [0.95]


def test_scores_outside_zero_one_use_the_range_seen():
    view = LiveView(ScriptedModel({"a": [2.0, 4.0, 6.0]}))
    view.run("a", display=False)
    text = view.text_html()
    assert "rgba(214,39,40,0.08)" in text and "rgba(214,39,40,0.88)" in text


def test_clear_empties_everything():
    view = LiveView(ScriptedModel({"a": [0.3]}))
    view.run("a", display=False)
    view.clear()
    assert view.text_html() == "" and len(view.figure.data) == 0 and view.outputs == []


def test_close_lets_every_widget_of_the_view_go_and_keeps_its_snapshot():
    """ipywidgets keeps each widget until it is closed: a view dropped without
    close() (a cell that builds a new one, run again) stayed for the kernel's life."""
    from ipywidgets.widgets.widget import _instances

    before = set(_instances)
    view = LiveView(ScriptedModel({"a": [0.1, 0.9]}), threshold=0.5)
    view.run("a", labels=["harmful"], display=False)
    made = set(_instances) - before
    # texts, plot, boxes, their layouts and styles, and the request's line
    assert len(made) == 14
    view.close()
    view.close()
    assert made & set(_instances) == set()
    bundle = view._repr_mimebundle_()  # (no widget: the snapshot alone)
    assert sorted(bundle) == ["text/html", "text/plain"] and "harmful" in bundle["text/plain"]
    assert view.snapshot_html(picture=False).count('class="uc-token"') == 2
    assert [output.request_id for output in view.outputs] == ["req-a"]
    with pytest.raises(RuntimeError, match=r"LiveView.run: this view is closed"):
        view.run("a", display=False)


def test_a_token_sends_the_page_as_much_after_many_prompts_as_after_a_few(monkeypatch):
    """Every token re-sent the text of every request shown (40 kB a token after 16
    prompts of 32 tokens): the traffic grew with the square of the run, and a
    browser fell minutes behind the kernel. A token now re-draws its own line."""
    import comm

    sent: list[int] = []

    class Page(comm.DummyComm):  # the browser's end of every widget's comm
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            sent.append(len(json.dumps(data, default=str)) + sum(map(len, buffers or ())))

    monkeypatch.setattr(comm, "create_comm", Page)
    per_token = {}
    for prompts in (3, 12):
        scores = {f"p{i}": [(i + g) % 10 / 10 for g in range(24)] for i in range(prompts)}
        view = LiveView(ScriptedModel(scores))
        sent.clear()
        view.run(list(scores), display=False)
        per_token[prompts] = sum(sent) / (24 * prompts)
        shown = view.snapshot_html(picture=False)
        assert len(re.findall('class="uc-token"', shown)) == 24 * prompts
        view.close()
    assert per_token[12] < 1.1 * per_token[3], per_token


def test_text_is_coloured_by_one_point_on_that_points_own_scale():
    class TwoPoints(ScriptedModel):
        def stream(self, prompt, **kwargs):
            for event in super().stream(prompt, **kwargs):
                extra = tuple(
                    TokenSignal("norm", 0, s.token_index, s.generated_index,
                                ProbeSignal(SignalAction.CONTINUE, 100.0 + s.generated_index))
                    for s in event.signals
                )
                yield StreamEvent(event.request_id, event.token_id, event.text,
                                  event.token_index, event.generated_index,
                                  signals=extra + event.signals, aborted=event.aborted,
                                  finished=event.finished, output=event.output)

    view = LiveView(TwoPoints({"a": [0.1, 0.9]}), point="watch")
    view.run("a", display=False)
    assert _token_scores(view) == ["0.100000", "0.900000"]
    assert "rgba(214,39,40,0.16)" in view.text_html()  # 0.1 on the 0..1 scale, not 0..101
    names = {t.name for t in view.figure.data}
    assert names == {"prompt 1: a · watch · L2", "prompt 1: a · norm · L0"}


def test_finished_plot_carries_its_traces_in_the_widget_state():
    # A page that connects after the run (Voila, a reload) draws from the state alone.
    view = LiveView(ScriptedModel({"a": [0.1, 0.5]}))
    view.run("a", display=False)
    state = view.figure.get_state()["_widget_data"]
    assert [list(trace["y"]) for trace in state] == [[0.1, 0.5]]
    assert view.widget.children[-1] is view.figure


def test_labels_name_the_requests_in_the_text_the_legend_and_the_messages():
    model = ScriptedModel({"a": [0.1, 0.95], "b": [0.2]}, abort_at={"a": 1})
    view = LiveView(model)
    view.run(["a", "b"], labels=["harmful", "benign"], display=False)
    assert [t.name for t in view.figure.data if t.showlegend is not False] == ["harmful", "benign"]
    text = view.text_html()
    assert "<b>harmful</b>" in text and "<b>benign</b>" in text and "req-a" not in text
    assert "<b>harmful</b>: aborted by" in view.message.value


def test_labels_are_shown_as_written_in_the_legend_not_read_as_markup():
    model = ScriptedModel({"a": [0.1, 0.95], "b": [0.2]}, abort_at={"a": 1})
    view = LiveView(model)
    view.run(["a", "b"], labels=["<i>L1</i>", "x & y"], display=False)
    # plotly reads a trace's name and hover text as HTML: both come escaped.
    lines = [t for t in view.figure.data if t.showlegend is not False]
    assert [t.name for t in lines] == ["&lt;i&gt;L1&lt;/i&gt;", "x &amp; y"]
    assert [t.hovertemplate.split("<br>")[0] for t in lines] == [t.name for t in lines]
    (marker,) = [t for t in view.figure.data if t.showlegend is False]
    assert marker.name == "&lt;i&gt;L1&lt;/i&gt;: abort"
    assert "<b>&lt;i&gt;L1&lt;/i&gt;</b>" in view.text_html()


def test_line_ends_in_a_token_are_drawn_as_symbols_not_line_breaks():
    class LineEnds(ScriptedModel):
        def stream(self, prompt, **kwargs):
            for event in super().stream(prompt, **kwargs):
                if event.generated_index == 0:
                    event = StreamEvent(event.request_id, event.token_id, "\r\n",
                                        event.token_index, 0, signals=event.signals)
                yield event

    view = LiveView(LineEnds({"a": [0.1, 0.5]}))
    view.run("a", display=False)
    tokens = re.findall(r'<span class="uc-token"[^>]*>([^<]*)</span>', view.text_html())
    assert tokens == ["␍↵", " w1"]
    assert "\r" not in view.text_html() and "\n" not in view.text_html()


def test_default_labels_number_the_prompts_and_preview_them():
    long_prompt = "user : how do i bake a loaf of bread at home ? assistant :"
    model = ScriptedModel({long_prompt: [0.1], "b": [0.2]})
    view = LiveView(model)
    view.run([long_prompt, "b"], display=False)
    labels = [trace.label for trace in view.state.requests.values()]
    assert labels == ["prompt 1: user : how do i bake a…", "prompt 2: b"]


def test_display_takes_true_or_false_only():
    model = ScriptedModel({"a": [0.1]})
    with pytest.raises(TypeError, match=r"LiveView.run: display must be True or False, got "
                                        r"str \('no'\)"):
        LiveView(model).run("a", display="no")
    assert model.calls == []


def test_prompts_max_new_tokens_and_score_range_of_the_wrong_kind_are_refused():
    # (each failed inside Python: None not iterable, "3" - 0.5, "01" read as two ends)
    model = ScriptedModel({"a": [0.1]})
    with pytest.raises(TypeError, match=r"prompts must be a string or a list of strings, got "
                                        r"NoneType"):
        LiveView(model).run(None, display=False)
    with pytest.raises(TypeError, match=r"LiveView.run: max_new_tokens must be an integer, "
                                        r"got str \('3'\)"):
        LiveView(model).run("a", display=False, max_new_tokens="3")
    assert model.calls == []
    for bad, error in (("01", TypeError), ((0, "1"), TypeError), ((1, 0), ValueError),
                       ((0, float("inf")), ValueError)):
        with pytest.raises(error, match="LiveView: score_range must be"):
            LiveView(model, score_range=bad)
    with pytest.raises(TypeError, match=r"LiveView: threshold must be a number, got str"):
        LiveView(model, threshold="0.5")
    # (threshold=nan was accepted; labels=5 was "'int' object is not iterable")
    with pytest.raises(ValueError, match=r"LiveView: threshold must be a finite number, "
                                         r"got nan"):
        LiveView(model, threshold=float("nan"))
    with pytest.raises(TypeError, match=r"LiveView.run: labels must be a label per prompt .* "
                                        r"or None, got int \(5\)"):
        LiveView(model).run("a", labels=5, display=False)
    assert model.calls == []
    assert LiveView(model, score_range=[0, 2]).score_range == (0.0, 2.0)


def test_one_label_per_prompt_is_required():
    view = LiveView(ScriptedModel({"a": [0.1], "b": [0.2]}))
    try:
        view.run(["a", "b"], labels=["only one"], display=False)
    except ValueError as error:
        assert "2 prompts but 1 labels" in str(error)
    else:  # pragma: no cover - the test fails here
        raise AssertionError("a missing label was accepted")


def test_the_header_counts_prompts_tokens_and_aborts_while_running():
    model = ScriptedModel({"a": [0.1, 0.95, 0.3], "b": [0.2, 0.3]}, abort_at={"a": 1})
    view = LiveView(model)
    seen: list[str] = []
    original = view.update

    def spy(event):
        original(event)
        seen.append(view.progress_text())

    view.update = spy
    view.run(["a", "b"], display=False, max_new_tokens=4)
    assert seen[0] == "prompt 1/2 · token 1/4"
    assert "prompt 1/2 · token 2/4 · 1 aborted" in seen
    assert seen[-1] == "prompt 2/2 · token 2/4 · 1 aborted"
    assert view.progress_text() == "done: 2 prompts · 4 tokens · 1 aborted"
    assert "done: 2 prompts" in view.header.value
    assert "token colour = score of <code>watch</code>" in view.header.value  # the key


class StoppedAt(ScriptedModel):
    """Raises ``error`` in place of the event of generated token ``at`` of prompt ``prompt``."""

    def __init__(self, scores, prompt: str, at: int, error: BaseException):
        super().__init__(scores)
        self.stop = (prompt, at, error)

    def stream(self, prompt, **kwargs):
        for event in super().stream(prompt, **kwargs):
            if (prompt, event.generated_index) == self.stop[:2]:
                raise self.stop[2]
            yield event


@pytest.mark.parametrize(("error", "said"), [
    (KeyboardInterrupt(), "interrupted"),  # what Kernel > Interrupt raises
    (ValueError("the stream broke"), "stopped by ValueError"),
])
def test_an_interrupted_run_says_where_it_stopped_and_the_exception_goes_on(error, said):
    # It read "done: 1 prompt · 5 tokens", a finished run, for a 3-prompt run stopped early.
    scores = {"a": [0.1] * 8, "b": [0.2] * 8, "c": [0.3] * 8}
    view = LiveView(StoppedAt(scores, "b", 5, error))
    with pytest.raises(type(error)):
        view.run(["a", "b", "c"], display=False, max_new_tokens=8)
    assert view.progress_text() == f"{said} at prompt 2/3 · token 5/8"
    assert view.summary().startswith(f"{said} at prompt 2/3 · token 5/8\n")
    assert f"{said} at prompt 2/3 · token 5/8" in view.snapshot_html(picture=False)
    assert f"{said} at prompt 2/3" in view.header.value
    view.run("c", display=False, max_new_tokens=8)  # a run to its end is done again
    assert view.progress_text() == "done: 3 prompts · 21 tokens"


def test_a_run_interrupted_before_a_prompts_first_token_counts_none_of_its_tokens():
    view = LiveView(StoppedAt({"a": [0.1] * 3, "b": [0.2] * 3}, "b", 0, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        view.run(["a", "b"], display=False)
    assert view.progress_text() == "interrupted at prompt 2/2 · token 0"


def test_probabilities_fix_the_score_axis_and_other_scores_autoscale():
    empty = LiveView(ScriptedModel({}))
    assert tuple(empty.figure.layout.yaxis.range) == (-0.03, 1.03)
    assert tuple(empty.figure.layout.xaxis.range) == (-0.5, 15.5)  # not plotly's -1..4
    probabilities = LiveView(ScriptedModel({"a": [0.1, 0.9]}))
    probabilities.run("a", display=False, max_new_tokens=8)
    assert tuple(probabilities.figure.layout.yaxis.range) == (-0.03, 1.03)
    assert tuple(probabilities.figure.layout.xaxis.range) == (-0.5, 7.5)
    raw = LiveView(ScriptedModel({"a": [2.0, 6.0]}))
    raw.run("a", display=False)
    assert raw.figure.layout.yaxis.autorange is True and raw.figure.layout.yaxis.range is None


def test_updates_change_the_same_figure_and_traces_without_rebuilding():
    model = ScriptedModel({"a": [0.1, 0.5, 0.7], "b": [0.2, 0.4]})
    view = LiveView(model)
    figure = view.figure
    view.run("a", display=False)
    first_trace = view.figure.data[0]
    view.run("b", display=False)
    assert view.figure is figure and view.widget.children[-1] is figure
    assert view.figure.data[0] is first_trace and list(first_trace.y) == [0.1, 0.5, 0.7]


def test_abort_mark_does_not_wrap_and_the_reply_is_spaced_from_the_prompt():
    class NoSpace(ScriptedModel):
        def stream(self, prompt, **kwargs):
            for event in super().stream(prompt, **kwargs):
                if event.generated_index == 0:
                    event = StreamEvent(event.request_id, event.token_id, "okay",
                                        event.token_index, 0, signals=event.signals)
                yield event

    view = LiveView(NoSpace({"assistant :": [0.9, 0.9]}, abort_at={"assistant :": 1}))
    view.run("assistant :", display=False)
    text = view.text_html()
    assert 'assistant :</span> <span class="uc-token"' in text
    assert "white-space:nowrap\">✖&nbsp;aborted" in text


def test_the_display_carries_a_static_snapshot_beside_the_widget(monkeypatch):
    from undercurrent.notebook import static

    drawn = []
    monkeypatch.setattr(static, "figure_png", lambda figure, **kw: drawn.append(figure) or b"PNG")
    view = LiveView(ScriptedModel({"a": [0.1, 0.9]}))
    view.run("a", labels=["harmful"], display=False)
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "harmful" in bundle["text/plain"] and "done: 1 prompt" in bundle["text/plain"]
    snapshot = bundle["text/html"]
    assert snapshot.count('class="uc-token"') == 2 and "done: 1 prompt" in snapshot
    assert "VBox" not in bundle["text/plain"]
    assert drawn == [view.figure] and 'src="data:image/png;base64,UE5H"' in snapshot


def test_a_run_shows_the_live_widget_then_a_snapshot_that_widget_frontends_hide(monkeypatch):
    from undercurrent.notebook import live_view, static

    shown: list[dict] = []
    monkeypatch.setattr(live_view, "_display", lambda: lambda bundle, raw: shown.append(bundle))
    monkeypatch.setattr(static, "figure_png", lambda figure, **kw: None)
    view = LiveView(ScriptedModel({"a": [0.1, 0.9]}))
    view.run("a", labels=["harmful"])
    live, snapshot = shown
    widget_id = live["application/vnd.jupyter.widget-view+json"]["model_id"]
    assert widget_id == view.widget.model_id and "text/html" not in live
    # An empty model id: JupyterLab and Voila hide this output; GitHub and nbconvert show it.
    assert snapshot["application/vnd.jupyter.widget-view+json"]["model_id"] == ""
    assert "harmful" in snapshot["text/html"] and "done: 1 prompt" in snapshot["text/html"]
    view.run("a", labels=["again"])
    assert len(shown) == 3  # the widget is not shown twice; the new run adds its snapshot


# -- the bundled model, with probes whose scores the tests choose --------------------------

NAN_FIRST = [float("nan"), 0.2, 0.9, 0.4, 0.7, 0.1]


@probe(register=False)
def nan_first(record):
    """A score per generated token, NaN on the first."""
    return NAN_FIRST[record.generated_index % len(NAN_FIRST)]


@probe(register=False)
def high(record):
    return 0.97


@probe(register=False)
def abort_without_score(record):
    return ProbeSignal(SignalAction.ABORT, None)


@pytest.fixture(scope="module")
def tiny_with():
    """``tiny_with(position, probe_type, **probe_args)``: the bundled model probed by one
    point ``watch`` (layer 1) running one of the probes above."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not (tiny_model_path() / "config.json").exists():  # pragma: no cover - ships with repo
        pytest.skip("the bundled model is not built yet")
    from undercurrent import ProbedModel
    from undercurrent.router import Router

    base = ProbedModel.from_pretrained("undercurrent/tiny")
    router = Router(probes={"nan_first": nan_first, "high": high,
                            "abort_without_score": abort_without_score})

    def make(position: str, probe_type: str, **probe_args) -> ProbedModel:
        point = ExtractionPoint(name="watch", layers=(1,), tensor_type="residual_stream",
                                position=position, probe_type=probe_type,
                                probe_kind="single_shot", probe_args=probe_args)
        return ProbedModel(base.backend, spec=ProbeSpec((point,)), router=router)

    yield make
    router.shutdown()
    base.close()


def test_a_nan_score_counts_as_no_score_and_the_others_keep_the_zero_one_scale(tiny_with):
    view = LiveView(tiny_with("generated[*]", "nan_first"))
    view.run(["hello there"], display=False, max_new_tokens=6)
    text = html.unescape(view.text_html())
    assert _token_scores(view)[:5] == ["", "0.200000", "0.900000", "0.400000", "0.700000"]
    assert 'title="token 0: no score"' in text and "nan" not in text.lower()
    assert "rgba(214,39,40,0.80)" in text  # 0.9 on the 0..1 scale, as without the NaN
    assert ">0</span>" in view.header.value and ">1</span>" in view.header.value  # the key
    assert "nan" not in view.header.value
    assert tuple(view.figure.layout.yaxis.range) == (-0.03, 1.03)  # still probabilities


def test_a_prompt_token_abort_and_its_score_are_drawn_inside_the_token_axis(tiny_with):
    view = LiveView(tiny_with("prompt[-1]", "high", threshold=0.9, action="abort"))
    (output,) = view.run(["hello there"], display=False, max_new_tokens=6)
    assert output.aborted and output.abort.generated_index is None
    (marker,) = [t for t in view.figure.data if t.name.endswith(": abort")]
    (line,) = [t for t in view.figure.data if not t.name.endswith(": abort")]
    low, high_end = view.figure.layout.xaxis.range
    assert list(marker.x) == [-1] == list(line.x) and low < -1 < high_end
    assert high_end == 5.5 and "prompt" in view.figure.layout.xaxis.title.text
    assert "at prompt token" in html.unescape(view.message.value)
    view.clear()  # an empty view starts at generated token 0 again
    assert tuple(view.figure.layout.xaxis.range)[0] == -0.5


def test_each_run_returns_its_own_outputs_and_the_view_keeps_them_all(tiny_with):
    view = LiveView(tiny_with("generated[*]", "nan_first"))
    first = view.run(["a", "b"], display=False, max_new_tokens=8)
    again = view.run(["again"], display=False, max_new_tokens=4)
    assert [o.prompt for o in first] == ["a", "b"] and [o.prompt for o in again] == ["again"]
    assert view.outputs == first + again
    assert len(view.state.requests) == 3  # the view still shows every run


def test_a_seeded_run_samples_prompt_i_with_seed_plus_i_as_generate_does(tiny_with):
    # Repeated prompts give different samples, each the one generate() gives it.
    model = tiny_with("generated[*]", "nan_first")
    prompts, sampling = ["hello there"] * 4, dict(max_new_tokens=8, temperature=1.0, seed=3)
    shown = LiveView(model).run(prompts, display=False, **sampling)
    expected = model.generate(prompts, batch_size=1, **sampling)
    assert [o.token_ids for o in shown] == [o.token_ids for o in expected]
    assert len({o.token_ids for o in shown}) > 1


def test_text_held_back_for_a_stop_string_that_never_came_is_shown(tiny_with):
    # The stream holds back text that could begin a stop string; what never became
    # one comes with the last event: the view's text is the output's, in full.
    model = tiny_with("generated[*]", "nan_first")
    (output,) = model.generate(["hello there"], max_new_tokens=6)
    last = output.text.rstrip()[-1]
    view = LiveView(model)
    (shown,) = view.run(["hello there"], display=False, max_new_tokens=6, stop=[last + "\x00"])
    assert shown.text == output.text and shown.finish_reason == "length"
    pieces = view.state.requests[shown.request_id].pieces
    assert len(pieces) == len(shown.token_ids) and "".join(pieces) == output.text
    assert html.unescape(re.sub(r"<[^>]+>", "", view.text_html())).endswith(output.text.rstrip())


def test_a_point_the_spec_does_not_have_is_refused_naming_the_spec_points(tiny_with):
    model = tiny_with("generated[*]", "nan_first")
    with pytest.raises(ValueError, match=r"no extraction point 'W'; its points are: watch$"):
        LiveView(model, point="W")
    with pytest.raises(ValueError, match=r"'wacth' \(did you mean 'watch'\?\)"):
        LiveView(model, point="wacth")
    assert LiveView(model, point="watch").point == "watch"


def test_an_abort_without_a_score_is_drawn_at_the_top_of_the_scale(tiny_with):
    view = LiveView(tiny_with("generated[2]", "abort_without_score"))
    (output,) = view.run(["hello there"], display=False, max_new_tokens=6)
    assert output.abort.generated_index == 2 and output.abort.signal.score is None
    (marker,) = [t for t in view.figure.data if t.name.endswith(": abort")]
    low, top = view.figure.layout.yaxis.range
    assert list(marker.x) == [2] and list(marker.y) == [1.0] and low < 1.0 < top
    assert "(no score)" in marker.hovertemplate


def test_an_async_points_scores_colour_the_text_and_draw_a_line_once_the_request_ends():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from undercurrent import ProbedModel
    from undercurrent.notebook import signals_frame
    from undercurrent.spec import parse_yaml

    # The stream carries no async signal: the view reads them from the output's results.
    spec = parse_yaml("""
version: "1"
extraction_points:
  - {name: norm, layers: 1, tensor_type: residual_stream, position: "generated[*]",
     probe_type: norm_probe, probe_kind: single_shot}
  - {name: traj, layers: 3, tensor_type: residual_stream, position: "generated[*]",
     probe_type: trajectory_probe, probe_kind: trajectory, execution_mode: async,
     probe_args: {path: "undercurrent:models/tiny/probe.safetensors", statistic: ewma,
                  alpha: 0.3}}
""")
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=spec)
    try:
        view = LiveView(model, point="traj")
        (output,) = view.run(["user : how do i open my car ? assistant :"], display=False,
                             max_new_tokens=8)
    finally:
        model.close()
    frame = signals_frame([output])
    expected = {
        point: dict(zip(rows["generated_index"].tolist(), rows["score"].tolist(), strict=True))
        for point, rows in frame.groupby("point")}
    assert len(expected["traj"]) >= 7 and not any(
        s.extraction_point_name == "traj" for s in output.signals)
    trace = view.state.requests[output.request_id]
    assert trace.scores == {("norm", 1): expected["norm"], ("traj", 3): expected["traj"]}
    assert _token_scores(view)[:len(expected["traj"])] == [
        f"{expected['traj'][g]:.6f}" for g in sorted(expected["traj"])]
    (line,) = [t for t in view.figure.data if t.name.endswith("· traj · L3")]
    assert list(line.x) == sorted(expected["traj"])
    assert list(line.y) == [expected["traj"][g] for g in sorted(expected["traj"])]


def test_request_ids_name_each_prompts_request_and_one_id_is_refused_for_several(tiny_with):
    model = tiny_with("generated[*]", "nan_first")
    view = LiveView(model)
    prompts = ["how do i open my car ?", "what is a lock ?"]
    with pytest.raises(ValueError, match=r"request_id='same' names one request, but 2 prompts"):
        view.run(prompts, display=False, max_new_tokens=4, request_id="same")
    assert not view.state.requests and not view.outputs  # refused before streaming
    outputs = view.run(prompts, display=False, max_new_tokens=4, request_ids=["a", "b"])
    assert [o.request_id for o in outputs] == ["a", "b"]
    assert {k: "".join(t.pieces) for k, t in view.state.requests.items()} == {
        o.request_id: o.text for o in outputs}
    (one,) = view.run(prompts[:1], display=False, max_new_tokens=4, request_id="c")
    assert one.request_id == "c" and len(view.state.requests) == 3
    with pytest.raises(ValueError, match=r"already shows a request 'a'.*clear\(\)"):
        view.run(prompts[:1], display=False, max_new_tokens=4, request_ids=["a"])
    with pytest.raises(ValueError, match=r"2 prompts but 1 request_ids"):
        view.run(prompts, display=False, max_new_tokens=4, request_ids=["d"])
    with pytest.raises(ValueError, match=r"unique, 'd' is given more than once"):
        view.run(prompts, display=False, max_new_tokens=4, request_ids=["d", "d"])
    assert len(view.state.requests) == 3
