"""``LiveView``: watch a probed generation token by token in a notebook.

For each prompt it shows the generated text with every token coloured by its
probe score (hover a token for the score), a plotly ``FigureWidget`` with one
line of score per generated token per (request, point, layer), and a red
marker and message where a probe aborted the generation.

>>> view = LiveView(probed_model, threshold=0.8)                   # doctest: +SKIP
>>> outputs = view.run(["Once upon", "The assistant"], max_new_tokens=24)  # doctest: +SKIP
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from undercurrent.notebook.live_state import LiveState, RequestTrace


def _modules() -> tuple[Any, Any]:
    try:
        import ipywidgets
        import plotly.graph_objects as go
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "LiveView needs ipywidgets and plotly: pip install 'undercurrent[notebook]'"
        ) from error
    return ipywidgets, go


class LiveView:
    """Runs ``ProbedModel.stream`` and updates a text view and a score plot as tokens arrive.

    ``model`` is a ``ProbedModel`` (anything whose ``stream(prompt, **kwargs)``
    yields ``StreamEvent``s). ``point`` picks which extraction point colours the
    text (default: the first that scored the token). ``score_range`` fixes the
    colour scale (default ``(0, 1)`` while every score is a probability, else the
    range seen). ``threshold`` draws a dashed line on the plot.
    """

    def __init__(
        self,
        model: Any,
        *,
        point: str | None = None,
        score_range: tuple[float, float] | None = None,
        threshold: float | None = None,
        title: str = "Probe score per generated token",
    ) -> None:
        w, go = _modules()
        self.model = model
        self.point = point
        self.score_range = score_range
        self.threshold = threshold
        self.state = LiveState()
        self.outputs: list[Any] = []
        self.text = w.HTML()
        self.text.add_class("undercurrent-live-text")
        self.message = w.HTML()
        self.figure = go.FigureWidget()
        self.figure.update_layout(
            title=title, xaxis_title="generated token", yaxis_title="score",
            template="plotly_white", height=360, margin={"t": 50, "b": 40, "l": 50, "r": 10},
        )
        if threshold is not None:
            self.figure.add_hline(y=threshold, line_dash="dash", line_color="grey",
                                  annotation_text=f"threshold {threshold:g}")
        self._traces: dict[tuple[str, str, int], int] = {}
        self._abort_traces: dict[str, int] = {}
        self.widget = w.VBox([self.text, self.message, self.figure])
        self.widget.add_class("undercurrent-live-view")
        self._displayed = False
        self._prompt = ""

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        self._displayed = True
        return self.widget._repr_mimebundle_(**kwargs)

    # -- running ----------------------------------------------------------------------

    def run(
        self,
        prompts: str | Sequence[str],
        *,
        display: bool = True,
        **stream_kwargs: Any,
    ) -> list[Any]:
        """Stream each prompt in turn, updating the view per token; return the outputs.

        ``stream_kwargs`` go to ``model.stream`` (``max_new_tokens``, sampling
        options). With ``display=True`` the view shows itself first when it is
        not on screen yet, so the updates can be watched.
        """
        if display and not self._displayed:
            self._show()
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        for prompt in prompt_list:
            self._prompt = prompt
            for event in self.model.stream(prompt, **stream_kwargs):
                self.update(event)
        self._prompt = ""
        return list(self.outputs)

    def _show(self) -> None:
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:  # pragma: no cover - IPython comes with ipywidgets
            return
        if get_ipython() is not None:
            display(self)

    def update(self, event: Any) -> None:
        """Apply one ``StreamEvent`` to the text, the plot and the abort message."""
        trace = self.state.add(event)
        if not trace.prompt:
            trace.prompt = self._prompt
        if event.finished and event.output is not None:
            self.outputs.append(event.output)
        self._render_text()
        self._render_plot(trace)
        self._render_message()
        if event.finished:
            self._settle_figure()

    def _settle_figure(self) -> None:
        """Replace the figure by a fresh copy built from its current data.

        Traces added to a displayed ``FigureWidget`` reach the browser as messages
        only, not as widget state, so a page that connects later (Voila, a
        reloaded notebook) would show an empty plot; a widget constructed with
        the data carries it in its state.
        """
        _, go = _modules()
        fresh = go.FigureWidget(self.figure)
        old, self.figure = self.figure, fresh
        self.widget.children = (self.text, self.message, fresh)
        old.close()

    def clear(self) -> None:
        """Forget every request and empty the views."""
        self.state = LiveState()
        self.outputs = []
        self.figure.data = ()
        self._traces.clear()
        self._abort_traces.clear()
        self.text.value = ""
        self.message.value = ""

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
        point = self.colour_point()
        seen = [score for trace in self.state.requests.values()
                for (name, _layer), by_token in trace.scores.items() if name == point
                for score in by_token.values()]
        if not seen or (min(seen) >= 0.0 and max(seen) <= 1.0):
            return (0.0, 1.0)
        low, high = min(seen), max(seen)
        return (low, high if high > low else low + 1.0)

    def token_html(self, trace: RequestTrace) -> str:
        """The request's line: id, prompt, generated tokens coloured by score, abort mark."""
        low, high = self._scale()
        point = self.colour_point()
        abort_at = None if trace.abort is None else trace.abort.generated_index
        spans = []
        for index, piece in enumerate(trace.pieces):
            score = trace.score_of(index, point)
            shown = html.escape(piece, quote=False).replace("\n", "↵")
            if score is None:
                style, title = "", f"token {index}: no score"
            else:
                level = min(max((score - low) / (high - low), 0.0), 1.0)
                style = f"background:rgba(214,39,40,{0.08 + 0.8 * level:.2f});"
                title = f"token {index}: score {score:.3f}"
            if index == abort_at:
                style += "outline:2px solid #b00020;"
                title += " (abort)"
            if index in trace.steered:
                style += "border-bottom:2px solid #1f77b4;"
                title += " (steered)"
            spans.append(
                f'<span class="uc-token" data-score="{"" if score is None else f"{score:.6f}"}" '
                f'title="{html.escape(title)}" style="{style}border-radius:3px">{shown}</span>'
            )
        marker = ""
        if trace.abort is not None:
            marker = (' <span class="uc-abort" style="color:#b00020;font-weight:bold">'
                      "✖ aborted</span>")
        elif not trace.finished:
            marker = ' <span style="color:#999">…</span>'
        prompt = html.escape(trace.prompt, quote=False)
        return (
            f'<div class="uc-request" style="margin:4px 0;white-space:pre-wrap;'
            f'font-family:monospace"><b>{html.escape(trace.request_id)}</b> '
            f'<span style="color:#777">{prompt}</span>{"".join(spans)}{marker}</div>'
        )

    def _render_text(self) -> None:
        self.text.value = "".join(self.token_html(t) for t in self.state.requests.values())

    def _render_message(self) -> None:
        lines = [
            f"<b>{html.escape(t.request_id)}</b>: "
            + html.escape(t.abort_message() or "", quote=False)
            for t in self.state.requests.values() if t.abort is not None
        ]
        self.message.value = (
            '<div class="uc-abort-message" style="color:#b00020">✖ ' + "<br>✖ ".join(lines)
            + "</div>" if lines else ""
        )

    def _render_plot(self, trace: RequestTrace) -> None:
        with self.figure.batch_update():
            for (point, layer), by_token in trace.scores.items():
                key = (trace.request_id, point, layer)
                xs = sorted(by_token)
                ys = [by_token[x] for x in xs]
                if key not in self._traces:
                    self.figure.add_scatter(
                        x=xs, y=ys, mode="lines+markers",
                        name=f"{trace.request_id} · {point} · L{layer}",
                    )
                    self._traces[key] = len(self.figure.data) - 1
                else:
                    scatter = self.figure.data[self._traces[key]]
                    scatter.x, scatter.y = xs, ys
            if trace.abort is not None and trace.request_id not in self._abort_traces:
                abort = trace.abort
                x = abort.generated_index
                if x is None and trace.output is not None:
                    x = abort.token_index - trace.output.prompt_len
                self.figure.add_scatter(
                    x=[x], y=[abort.signal.score], mode="markers",
                    marker={"symbol": "x", "size": 16, "color": "#b00020"},
                    name=f"{trace.request_id} abort",
                    hovertemplate=html.escape(trace.abort_message() or "") + "<extra></extra>",
                )
                self._abort_traces[trace.request_id] = len(self.figure.data) - 1
