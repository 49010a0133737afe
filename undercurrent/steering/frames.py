"""Applied edits as a tidy frame, to join with ``records_frame`` / ``signals_frame``.

>>> frame = edits_frame(outputs)                                     # doctest: +SKIP
>>> signals_frame(outputs).merge(frame, on=["request", "token_index"], how="left")
... # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

EDIT_COLUMNS = ("request", "edit", "layer", "tensor_type", "token_index", "generated_index")
"""Columns of :func:`edits_frame`: one row per (request, edit, layer, token)."""


def edits_frame(outputs: Any) -> Any:
    """One row per applied edit of a ``GenerationOutput`` (or a list of them).

    ``token_index`` / ``generated_index`` locate the token whose activation was
    changed (in the pass that fed it), so the frame joins ``records_frame`` and
    ``signals_frame`` on ``request`` and ``token_index``.
    """
    import pandas as pd

    if hasattr(outputs, "edits"):
        outputs = [outputs]
    rows = [
        {"request": output.request_id, "edit": applied.edit_name, "layer": applied.layer,
         "tensor_type": applied.tensor_type, "token_index": applied.token_index,
         "generated_index": applied.generated_index}
        for output in outputs for applied in output.edits
    ]
    frame = pd.DataFrame(rows, columns=list(EDIT_COLUMNS))
    return frame.astype({"layer": "int64", "token_index": "int64",
                         "generated_index": "Int64"})
