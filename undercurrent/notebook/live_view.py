"""``LiveView``: watch a probed generation token by token in a notebook.

For each prompt it shows the generated text with every token coloured by its
probe score (hover a token for the score), a plotly ``FigureWidget`` with one
line of score per generated token per (request, point, layer), a progress
header, and a red marker and message where a probe aborted the generation.
Requests are named by ``labels=`` (default ``prompt N`` and the prompt's start).

>>> view = LiveView(probed_model, threshold=0.8)                   # doctest: +SKIP
>>> outputs = view.run(["Once upon", "The assistant"], labels=["story", "chat"],
...                    max_new_tokens=24)                          # doctest: +SKIP
"""

from __future__ import annotations

import copy
import html
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from undercurrent.adapters.base import call_seed
from undercurrent.adapters.prompts import check_prompts
from undercurrent.arguments import check_flag, check_number
from undercurrent.notebook import static
from undercurrent.notebook.live_html import abort_messages_html, header_html, request_line_html
from undercurrent.notebook.live_state import LiveState, RequestTrace, known_score
from undercurrent.notebook.widget_closing import close_widgets
from undercurrent.spec.messages import did_you_mean

if TYPE_CHECKING:  # pragma: no cover
    from undercurrent.api import ProbedModel

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

PREVIEW_CHARS = 24
"""How much of a prompt a default label shows."""

DEFAULT_TOKEN_AXIS_END = 15.5
"""Where the token axis ends before a run names ``max_new_tokens`` (``stream``'s 16)."""


def _modules() -> tuple[Any, Any]:
    try:
        import ipywidgets
        import plotly.graph_objects as go
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "LiveView needs ipywidgets and plotly: pip install 'undercurrent[notebook]'"
        ) from error
    return ipywidgets, go


def _display() -> Any:
    """IPython's ``display`` when running under IPython, else None."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython comes with ipywidgets
        return None
    return display if get_ipython() is not None else None


def default_label(number: int, prompt: str) -> str:
    """``prompt N: <the prompt's first words>…``, the name of a request given no label."""
    flat = " ".join(prompt.split())
    preview = flat
    if len(flat) > PREVIEW_CHARS:  # cut at a word boundary when there is one
        cut = flat[:PREVIEW_CHARS + 1]
        preview = (cut.rsplit(" ", 1)[0] if " " in cut else cut[:PREVIEW_CHARS]).rstrip() + "…"
    return f"prompt {number}: {preview}" if preview else f"prompt {number}"


def _check_point(model: Any, point: str | None) -> None:
    """Refuse a ``point=`` the model's spec does not declare (it would colour nothing)."""
    names = getattr(getattr(model, "spec", None), "names", None)
    if point is None or names is None or point in names:
        return
    known = ", ".join(names) or "none"
    raise ValueError(
        f"LiveView(point={point!r}): the model's spec has no extraction point {point!r}"
        f"{did_you_mean(point, names)}; its points are: {known}"
    )


def _score_range(score_range: Any) -> tuple[float, float] | None:
    """``score_range`` as ``(low, high)`` floats with low < high, or None."""
    if score_range is None:
        return None
    accepted = "LiveView: score_range must be (low, high), two numbers with low < high"
    ends = () if isinstance(score_range, str | bytes) or not isinstance(
        score_range, Iterable) else tuple(score_range)
    if len(ends) != 2:
        raise TypeError(f"{accepted}, got {type(score_range).__name__} ({score_range!r:.40})")
    low, high = (check_number("LiveView: score_range", end) for end in ends)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{accepted}, got {ends!r}")
    return float(low), float(high)


def _request_ids(prompt_count: int, request_id: Any, request_ids: Sequence[str] | None,
                 shown: Any) -> list[str | None]:
    """The request id each prompt's stream gets (None: the model makes one), from
    ``request_ids=`` or a one-prompt run's ``request_id=``; refuses ids that would
    put two requests on one line of the view (``shown``: the ids it shows)."""
    if request_id is not None:
        if request_ids is not None:
            raise TypeError("LiveView.run: give request_id= (one prompt) or request_ids= "
                            "(one id per prompt), not both")
        if prompt_count != 1:
            raise ValueError(
                f"LiveView.run: request_id={request_id!r} names one request, but "
                f"{prompt_count} prompts were given (each prompt is a request of its own): "
                "give request_ids=[...] with one id per prompt, or no id")
        request_ids = [request_id]
    if request_ids is None:
        return [None] * prompt_count
    if isinstance(request_ids, (str, bytes)):  # (not one id per character)
        raise TypeError("LiveView.run: request_ids must be a list of strings, one per "
                        f"prompt, got the {type(request_ids).__name__} {request_ids!r:.40}")
    ids: list[str | None] = list(request_ids)
    if len(ids) != prompt_count:
        raise ValueError(f"LiveView.run: {prompt_count} prompts but {len(ids)} request_ids; "
                         "give one id per prompt")
    repeated = sorted({i for i in ids if ids.count(i) > 1}, key=str)
    if repeated:
        raise ValueError(f"LiveView.run: request_ids must be unique, {repeated[0]!r} is "
                         "given more than once")
    again = [i for i in ids if i in shown]
    if again:
        raise ValueError(f"LiveView.run: the view already shows a request {again[0]!r} "
                         "(from an earlier run); give a new id, or call clear() first")
    return ids


class LiveView:
    """Runs ``ProbedModel.stream`` and updates a text view and a score plot as tokens arrive.

    ``model`` is a ``ProbedModel`` (anything whose ``stream(prompt, **kwargs)``
    yields ``StreamEvent``s). ``point`` picks which extraction point colours the
    text (default: the first that scored the token); a name the model's spec
    does not have is refused. An async point's scores (which a stream does not
    carry) are shown when each request finishes, from its output's results.
    ``score_range`` fixes the colour scale (default ``(0, 1)`` while every score
    is a probability, else the range seen; a NaN score counts as no score);
    probabilities also fix the plot's score axis to [0, 1]. ``threshold`` draws
    a dashed line on the plot. Scores and aborts at prompt tokens sit at
    negative x (``prompt[-1]`` is -1), the token axis widened to show them; an
    abort without a score sits at the top of the scale. ``outputs`` holds every
    output the view has collected, over all runs until :meth:`clear`.

    Displayed, the view is a widget; stored notebooks and readers without a
    kernel get an HTML snapshot (progress, coloured tokens, messages and a PNG
    of the plot) from the same display.

    ipywidgets keeps every widget until it is closed, so a view that is done
    with (before a cell that builds a new one runs again) is let go with
    :meth:`close`; what it shows then is its snapshot.
    """

    def __init__(
        self,
        model: ProbedModel,
        *,
        point: str | None = None,
        score_range: tuple[float, float] | None = None,
        threshold: float | None = None,
        title: str = "Probe score per generated token",
    ) -> None:
        _check_point(model, point)
        score_range = _score_range(score_range)
        if threshold is not None:
            check_number("LiveView: threshold", threshold, finite=True)
        w, go = _modules()
        self.model = model
        self.point = point
        self.score_range = score_range
        self.threshold = threshold
        self.state = LiveState()
        self.outputs: list[Any] = []
        self.header = w.HTML()
        self.header.add_class("undercurrent-live-progress")
        # One HTML widget per request: a token re-sends its own request's line, never
        # the lines already shown (they are re-drawn only when the colour scale moves).
        self.text = w.VBox(layout=w.Layout(width="100%"))
        self.text.add_class("undercurrent-live-text")
        self._line_layout = w.Layout(width="100%", margin="0")
        self._line_style = w.widgets.widget_string.HTMLStyle()
        self._lines: dict[str, Any] = {}
        self._lines_drawn_with: tuple[tuple[float, float], str | None] | None = None
        self.message = w.HTML()
        self.figure = go.FigureWidget()
        self.figure.update_layout(
            title=title, xaxis_title="generated token", yaxis_title="score",
            template="plotly_white", height=360, margin={"t": 50, "b": 40, "l": 50, "r": 10},
            legend={"title": {"text": "request"}},
        )
        if threshold is not None:
            self.figure.add_hline(y=threshold, line_dash="dash", line_color="grey",
                                  annotation_text=f"threshold {threshold:g}")
        self._traces: dict[tuple[str, str, int], int] = {}
        self._abort_traces: dict[str, int] = {}
        self.widget = w.VBox([self.header, self.text, self.message, self.figure],
                             layout=w.Layout(width="100%"))
        self.widget.add_class("undercurrent-live-view")
        self._displayed = False
        self._shown_by_run = False
        self._sized = False
        self._prompt = ""
        self._label: str | None = None
        self._run_total = 0
        self._run_index = 0
        self._max_new_tokens: int | None = None
        self._token_axis_end = DEFAULT_TOKEN_AXIS_END
        self._running = False
        self._requests_before = 0  # requests shown when the prompt now streaming began
        self._stopped_by: str | None = None  # why the last run ended early, if it did
        self._closed = False
        self._set_axes()
        self._render_header()

    # -- display ------------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        if self._closed:  # (no widget left to show: the snapshot alone)
            return {"text/html": self.snapshot_html(), "text/plain": self.summary()}
        self._displayed = True
        bundle = dict(self.widget._repr_mimebundle_(**kwargs))
        bundle["text/html"] = self.snapshot_html()
        bundle["text/plain"] = self.summary()
        return bundle

    def _show(self) -> None:
        """Show the live widget for a run (its snapshot comes after the run, see below)."""
        display = _display()
        if display is None:
            return
        self._displayed = True
        bundle = dict(self.widget._repr_mimebundle_())
        bundle["text/plain"] = "LiveView: a live widget; a snapshot of the run follows it"
        display(bundle, raw=True)
        self._shown_by_run = True

    def _show_snapshot(self) -> None:
        """Add the finished run's snapshot under the live widget, hidden where widgets run.

        A widget view with an empty model id is the widget manager's sign to hide
        an output, so JupyterLab, Notebook and Voila show only the live widget
        (never redrawn, so nothing flashes), while GitHub, nbconvert and other
        readers without widgets show the HTML: progress, tokens, messages, plot.
        """
        display = _display()
        if display is None:
            return
        display({
            WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": ""},
            "text/html": self.snapshot_html(),
            "text/plain": self.summary(),
        }, raw=True)

    def close(self) -> None:
        """Close the view's widgets (the text, the plot and their layouts and
        styles): ipywidgets keeps every widget it made until it is closed, so a
        view dropped without this stays in memory for the kernel's life. Where
        the view is displayed, its live widget leaves the page. The view keeps
        its outputs and can still give its :meth:`summary` and
        :meth:`snapshot_html` (what displaying it shows now), but runs no more.
        Closing twice does nothing more."""
        self._closed = True
        close_widgets(self.widget)

    def summary(self) -> str:
        """Plain text: progress, then one line per request (label, text, abort)."""
        lines = [self.progress_text()]
        for trace in self.state.requests.values():
            text = "".join(trace.pieces).replace("\n", "↵")
            lines.append(f"{trace.label}: {text!r}" + (" ✖ aborted" if trace.abort else ""))
        return "\n".join(lines)

    def snapshot_html(self, *, picture: bool = True) -> str:
        """The view as static HTML: header, coloured tokens, abort messages and (with
        ``picture``) a PNG of the plot, for readers without a running kernel."""
        image = ""
        if picture and self.figure.data:
            image = static.png_html(static.figure_png(self.figure, width=900),
                                   alt="probe scores per token")
        parts: list[str] = [self.header.value, self.text_html(), self.message.value, image]
        return '<div class="undercurrent-live-snapshot">' + "".join(parts) + "</div>"

    # -- running ----------------------------------------------------------------------

    def run(
        self,
        prompts: str | Sequence[str],
        *,
        labels: Sequence[str] | None = None,
        request_ids: Sequence[str] | None = None,
        display: bool = True,
        **stream_kwargs: Any,
    ) -> list[Any]:
        """Stream each prompt in turn, updating the view per token; return this run's
        outputs, one per prompt in order (``outputs`` keeps those of every run).

        ``labels`` names each prompt's request in the text and the legend (default
        ``prompt N: <start of the prompt>``). ``request_ids`` gives each prompt's
        request its id (one per prompt, unique, none the view already shows);
        ``request_id=`` is for a run of one prompt. ``stream_kwargs`` go to
        ``model.stream`` (``max_new_tokens``, sampling options; with ``seed=s`` prompt
        i is seeded ``s + i``, as ``generate(prompts, seed=s, batch_size=1)`` seeds
        it, so each prompt's output is that call's). With
        ``display=True`` the view shows itself first when it is not on screen yet,
        so the updates can be watched, and adds a static snapshot of the finished
        run for readers of the stored notebook (hidden where widgets run). A run
        that an exception ends (Kernel > Interrupt raises ``KeyboardInterrupt``)
        shows where it stopped (see :meth:`progress_text`) and lets it go on.
        """
        if self._closed:
            raise RuntimeError("LiveView.run: this view is closed (close() let its widgets "
                               "go); build a new LiveView to run more prompts")
        check_flag("LiveView.run: display", display)
        prompt_list = check_prompts(prompts)
        max_new_tokens = stream_kwargs.get("max_new_tokens")
        if max_new_tokens is not None:  # (the token axis is drawn from it before any stream)
            check_number("LiveView.run: max_new_tokens", max_new_tokens, integer=True)
        if labels is not None and not isinstance(labels, str | Iterable):
            raise TypeError("LiveView.run: labels must be a label per prompt (a list, or "
                            f"one string for one prompt) or None, got "
                            f"{type(labels).__name__} ({labels!r:.40})")
        label_list = None if labels is None else [str(label) for label in (
            [labels] if isinstance(labels, str) else labels)]
        if label_list is not None and len(label_list) != len(prompt_list):
            raise ValueError(
                f"LiveView.run: {len(prompt_list)} prompts but {len(label_list)} labels; "
                "give one label per prompt"
            )
        id_list = _request_ids(len(prompt_list), stream_kwargs.pop("request_id", None),
                               request_ids, self.state.requests)
        self._run_total, self._run_index = len(prompt_list), 0
        self._max_new_tokens = stream_kwargs.get("max_new_tokens")
        if self._max_new_tokens is not None:
            # A fixed token axis: the plot does not rescale with every token.
            self._token_axis_end = self._max_new_tokens - 0.5
            self._set_token_axis()
        first_output = len(self.outputs)
        self._running, self._stopped_by = True, None
        if display and not self._displayed:
            self._show()
        try:
            for index, prompt in enumerate(prompt_list):
                self._run_index = index + 1
                self._prompt = prompt
                self._label = None if label_list is None else label_list[index]
                kwargs = dict(stream_kwargs)
                if index and kwargs.get("seed") is not None:
                    # Seeded as generate() seeds prompt i of a call (seed + i), so
                    # repeated prompts give different samples; prompt 0's stream has
                    # already checked the seed given.
                    kwargs["seed"] = call_seed(kwargs["seed"], index)
                if id_list[index] is not None:
                    kwargs["request_id"] = id_list[index]
                self._requests_before = len(self.state.requests)
                for event in self.model.stream(prompt, **kwargs):
                    self.update(event)
        except BaseException as error:  # the header says where the run stopped; it goes on
            self._stopped_by = ("interrupted" if isinstance(error, KeyboardInterrupt)
                                else f"stopped by {type(error).__name__}")
            raise
        finally:
            self._running = False
            self._prompt, self._label = "", None
            self._render_header()
            self._store_figure_state()
            if self._shown_by_run:
                self._show_snapshot()
        return self.outputs[first_output:]

    def update(self, event: Any) -> None:
        """Apply one ``StreamEvent`` to the header, the text, the plot and the abort message."""
        new = event.request_id not in self.state.requests
        trace = self.state.add(event)
        if new:
            if not trace.prompt:
                trace.prompt = self._prompt
            trace.label = self._label or default_label(len(self.state.requests), trace.prompt)
        if event.finished and event.output is not None:
            self.outputs.append(event.output)
        self._fit_width()
        self._render_header()
        self._render_line(trace)
        self._render_plot(trace)
        if event.finished:
            self._render_message()
            self._store_figure_state()

    def _fit_width(self) -> None:
        """Ask the displayed figure to fill its cell once it is on the page.

        plotly's widget sizes itself when first drawn, before the browser has laid
        out the cell, and falls back to 700 px; a relayout with ``autosize`` once
        tokens flow makes it measure the cell again.
        """
        if self._sized or not self._displayed:
            return
        self._sized = True
        send = getattr(self.figure, "_send_relayout_msg", None)
        if send is not None:
            send({"autosize": True})

    def _store_figure_state(self) -> None:
        """Copy the figure's data into its widget state, without redrawing anything.

        Traces added to a displayed ``FigureWidget`` reach the browser as messages
        only; a page that connects later (Voila, a reloaded notebook) draws from
        the state, which plotly fills only when the figure is created or shown.
        """
        figure = self.figure
        if hasattr(figure, "_widget_data") and hasattr(figure, "_layout_obj"):
            figure._widget_data = copy.deepcopy(figure._data)
            figure._widget_layout = copy.deepcopy(figure._layout_obj._props)

    def clear(self) -> None:
        """Forget every request and empty the views."""
        self.state = LiveState()
        self.outputs = []
        self.figure.data = ()
        self._traces.clear()
        self._abort_traces.clear()
        lines, self.text.children = self.text.children, ()
        for line in lines:
            line.close()
        self._lines.clear()
        self._lines_drawn_with = None
        self.message.value = ""
        self._run_total = self._run_index = self._requests_before = 0
        self._stopped_by = None
        self._set_axes()
        self._render_header()

    # -- rendering ----------------------------------------------------------------------

    def colour_point(self) -> str | None:
        """The point whose scores colour the text: ``point=`` or the first one that scored."""
        if self.point is not None:
            return self.point
        for trace in self.state.requests.values():
            for name, _layer in trace.scores:
                return name
        return None

    def _scale(self) -> tuple[float, float]:
        if self.score_range is not None:
            return self.score_range
        # An infinite score would make the range infinite; it shades as the end it lies past.
        seen = self.state.score_range(self.colour_point())
        if seen is None or (seen[0] >= 0.0 and seen[1] <= 1.0):
            return (0.0, 1.0)
        low, high = seen
        return (low, high if high > low else low + 1.0)

    def _set_axes(self) -> None:
        """Fixed axes for an empty view and for probabilities; autorange otherwise."""
        if self.score_range is not None:
            low, high = self.score_range
            pad = 0.03 * (high - low)
            wanted: dict[str, Any] = {"range": [low - pad, high + pad], "autorange": False}
        elif self.state.probabilities():
            wanted = {"range": [-0.03, 1.03], "autorange": False}
        else:
            wanted = {"range": None, "autorange": True}
        yaxis = self.figure.layout.yaxis
        if (yaxis.autorange, yaxis.range) != (
                wanted["autorange"], None if wanted["range"] is None else tuple(wanted["range"])):
            self.figure.update_yaxes(**wanted)
        self._set_token_axis()

    def _set_token_axis(self) -> None:
        """A fixed token axis from the first prompt token that has a score or an abort
        (negative x: ``prompt[-1]`` is -1) or else token 0, to ``max_new_tokens``."""
        first = min([self.state.first_x, *(x for trace in self.state.aborted
                                            if (x := trace.abort_position()) is not None)])
        wanted = (first - 0.5, self._token_axis_end)
        title = "generated token" if first == 0 else "token (negative: prompt, -1 its last)"
        xaxis = self.figure.layout.xaxis
        if xaxis.range is None or tuple(xaxis.range) != wanted or xaxis.title.text != title:
            self.figure.update_xaxes(range=list(wanted), autorange=False, title_text=title)

    def progress_text(self) -> str:
        """``prompt 2/6 · token 17/32 · 1 aborted`` while running; a summary when done;
        ``interrupted at prompt 2/6 · token 17/32`` (or ``stopped by ValueError at ...``)
        when the last run ended with an exception (Kernel > Interrupt, a stream error)."""
        aborted = len(self.state.aborted)
        tail = f" · {aborted} aborted" if aborted else ""
        if self._run_total and (self._running or self._stopped_by):
            current = self._current_trace()
            tokens = 0 if current is None else len(current.pieces)
            limit = "" if self._max_new_tokens is None else f"/{self._max_new_tokens}"
            where = f"prompt {self._run_index}/{self._run_total} · token {tokens}{limit}{tail}"
            return where if self._running else f"{self._stopped_by} at {where}"
        requests = len(self.state.requests)
        if not requests:
            return "no prompts run yet"
        tokens = sum(len(trace.pieces) for trace in self.state.requests.values())
        return f"done: {requests} prompt{'s' if requests != 1 else ''} · {tokens} tokens{tail}"

    def _current_trace(self) -> RequestTrace | None:
        """The request of the prompt now streaming (None before its first event)."""
        if len(self.state.requests) <= self._requests_before:
            return None
        return next(reversed(self.state.requests.values()), None)

    def _render_header(self) -> None:
        self.header.value = header_html(self.progress_text(), self._scale(), self.colour_point())

    def token_html(self, trace: RequestTrace) -> str:
        """The request's line: label, prompt, generated tokens coloured by score, abort mark."""
        return request_line_html(trace, self._scale(), self.colour_point())

    def text_html(self) -> str:
        """Every request's line (see :meth:`token_html`) as one HTML text, in order."""
        return "".join(line.value for line in self.text.children)

    def _render_line(self, trace: RequestTrace) -> None:
        """Draw ``trace``'s line, or every line when the colour scale or point changed."""
        drawn_with = (self._scale(), self.colour_point())
        if trace.request_id not in self._lines:
            w, _ = _modules()
            line = w.HTML(layout=self._line_layout, style=self._line_style)
            self._lines[trace.request_id] = line
            self.text.children = (*self.text.children, line)
        redraw = [trace]
        if drawn_with != self._lines_drawn_with:
            self._lines_drawn_with = drawn_with
            redraw = [t for t in self.state.requests.values() if t.request_id in self._lines]
        for each in redraw:
            self._lines[each.request_id].value = request_line_html(each, *drawn_with)

    def _render_message(self) -> None:
        self.message.value = abort_messages_html(self.state.requests.values())

    def _trace_name(self, trace: RequestTrace, point: str, layer: int) -> str:
        """The request's label, with point and layer once the request has several lines
        (escaped: plotly reads a trace's name as HTML)."""
        label = trace.label or trace.request_id
        name = label if len(trace.scores) == 1 else f"{label} · {point} · L{layer}"
        return html.escape(name, quote=False)

    def _render_plot(self, trace: RequestTrace) -> None:
        with self.figure.batch_update():
            self._set_axes()
            for (point, layer), by_token in trace.scores.items():
                key = (trace.request_id, point, layer)
                xs = sorted(by_token)
                ys = [by_token[x] for x in xs]
                if key not in self._traces:
                    name = self._trace_name(trace, point, layer)
                    self.figure.add_scatter(
                        x=xs, y=ys, mode="lines+markers", name=name,
                        legendgroup=trace.request_id,
                        hovertemplate=name + "<br>token %{x}<br>score %{y:.3f}"
                        "<extra></extra>",
                    )
                    self._traces[key] = len(self.figure.data) - 1
                else:
                    scatter = self.figure.data[self._traces[key]]
                    scatter.x, scatter.y = xs, ys
                    name = self._trace_name(trace, point, layer)
                    if scatter.name != name:  # a second line appeared for this request
                        scatter.name = name
            if trace.abort is not None and trace.request_id not in self._abort_traces:
                score = known_score(trace.abort.signal.score)
                message = trace.abort_message() or ""
                if score is None:  # drawn at the top of the scale, so it is on the plot
                    message += " (no score)"
                self.figure.add_scatter(
                    x=[trace.abort_position()], y=[self._scale()[1] if score is None else score],
                    mode="markers", marker={"symbol": "x", "size": 16, "color": "#b00020"},
                    name=html.escape(f"{trace.label or trace.request_id}: abort", quote=False),
                    legendgroup=trace.request_id, showlegend=False,
                    hovertemplate=html.escape(message) + "<extra></extra>",
                )
                self._abort_traces[trace.request_id] = len(self.figure.data) - 1
