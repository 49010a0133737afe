"""The tidy frames, importable from here as before: they live in
:mod:`undercurrent.analysis.frames`, below the notebook layer, so that fitting and
the activation store can build frames without importing the notebook."""

from __future__ import annotations

from undercurrent.analysis.frames import (
    FEATURE_COLUMNS,
    RECORD_COLUMNS,
    RESULT_COLUMNS,
    SIGNAL_COLUMNS,
    activation_matrix,
    features_frame,
    label_rows,
    records_frame,
    results_frame,
    select_rows,
    signals_frame,
)

__all__ = [
    "FEATURE_COLUMNS",
    "RECORD_COLUMNS",
    "RESULT_COLUMNS",
    "SIGNAL_COLUMNS",
    "activation_matrix",
    "features_frame",
    "label_rows",
    "records_frame",
    "results_frame",
    "select_rows",
    "signals_frame",
]
