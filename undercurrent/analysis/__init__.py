"""Analysis below the notebook: tidy pandas frames over records, signals and results,
and fitting linear probes on them.

Nothing here imports the notebook, plotting or widget layers, so the activation
store and the maintainer tools use it directly; ``undercurrent.notebook`` re-exports
the same names. Importing it is cheap: pandas, numpy and scikit-learn are imported
inside the functions that need them.
"""

from __future__ import annotations

from undercurrent.analysis.fitting import LinearProbeFit, fit_linear_probe, save_linear_probe
from undercurrent.analysis.frames import (
    FEATURE_COLUMNS,
    RECORD_COLUMNS,
    RESULT_COLUMNS,
    SIGNAL_COLUMNS,
    activation_matrix,
    features_frame,
    label_rows,
    record_tensors,
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
    "LinearProbeFit",
    "activation_matrix",
    "features_frame",
    "fit_linear_probe",
    "label_rows",
    "record_tensors",
    "records_frame",
    "results_frame",
    "save_linear_probe",
    "select_rows",
    "signals_frame",
]
