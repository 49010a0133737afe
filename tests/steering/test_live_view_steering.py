"""The LiveView marks the tokens sampled under a live edit."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from oracles import PROMPTS  # noqa: E402

from undercurrent.notebook import LiveView  # noqa: E402
from undercurrent.spec import Edit  # noqa: E402


def test_steered_tokens_are_marked_from_the_first_token_sampled_under_the_edit(tiny):
    # Prompt-free edit on generated tokens from 3 on: tokens 4.. are sampled under it.
    edit = Edit(name="late", layers=1, tensor_type="residual_stream", position="generated[3:]",
                op="add", vector=[1.0] * 128, coefficient=0.5)
    view = LiveView(tiny)
    (output,) = view.run(PROMPTS[0], display=False, max_new_tokens=8, edits=[edit])
    trace = view.state.requests[output.request_id]
    assert trace.steered == set(range(4, 8)) == set(output.steered_tokens)
    html = view.token_html(trace)
    assert html.count("(steered)") == 4
    plain = LiveView(tiny)
    (unsteered,) = plain.run(PROMPTS[0], display=False, max_new_tokens=8)
    assert "(steered)" not in plain.token_html(plain.state.requests[unsteered.request_id])
