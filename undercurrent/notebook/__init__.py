"""The notebook layer: frames, plots, probe fitting, the spec editor and the live view.

Names are imported on first use, so ``import undercurrent.notebook`` stays cheap
and never imports torch; pandas, plotly, scikit-learn and ipywidgets come from
the ``notebook`` extra (``pip install 'undercurrent[notebook]'``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "RECORD_COLUMNS": "undercurrent.analysis.frames",
    "SIGNAL_COLUMNS": "undercurrent.analysis.frames",
    "RESULT_COLUMNS": "undercurrent.analysis.frames",
    "records_frame": "undercurrent.analysis.frames",
    "signals_frame": "undercurrent.analysis.frames",
    "results_frame": "undercurrent.analysis.frames",
    "activation_matrix": "undercurrent.analysis.frames",
    "record_tensors": "undercurrent.analysis.frames",
    "select_rows": "undercurrent.analysis.frames",
    "label_rows": "undercurrent.analysis.frames",
    "FEATURE_COLUMNS": "undercurrent.analysis.frames",
    "features_frame": "undercurrent.analysis.frames",
    "save_records": "undercurrent.notebook.storage",
    "load_records": "undercurrent.notebook.storage",
    "frame_to_records": "undercurrent.notebook.storage",
    "fit_linear_probe": "undercurrent.analysis.fitting",
    "LinearProbeFit": "undercurrent.analysis.fitting",
    "trajectory_figure": "undercurrent.notebook.plots",
    "heatmap_figure": "undercurrent.notebook.plots",
    "projection_figure": "undercurrent.notebook.plots",
    "verdict_figure": "undercurrent.notebook.plots",
    "SpecEditor": "undercurrent.notebook.spec_editor",
    "LiveView": "undercurrent.notebook.live_view",
    "png_fallback": "undercurrent.notebook.static",
}

__all__ = [
    "FEATURE_COLUMNS",
    "LinearProbeFit",
    "LiveView",
    "RECORD_COLUMNS",
    "RESULT_COLUMNS",
    "SIGNAL_COLUMNS",
    "SpecEditor",
    "activation_matrix",
    "features_frame",
    "fit_linear_probe",
    "frame_to_records",
    "heatmap_figure",
    "label_rows",
    "load_records",
    "png_fallback",
    "projection_figure",
    "record_tensors",
    "records_frame",
    "results_frame",
    "save_records",
    "select_rows",
    "signals_frame",
    "trajectory_figure",
    "verdict_figure",
]

if TYPE_CHECKING:  # pragma: no cover
    from undercurrent.analysis.fitting import LinearProbeFit, fit_linear_probe
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
    from undercurrent.notebook.live_view import LiveView
    from undercurrent.notebook.plots import (
        heatmap_figure,
        projection_figure,
        trajectory_figure,
        verdict_figure,
    )
    from undercurrent.notebook.spec_editor import SpecEditor
    from undercurrent.notebook.static import png_fallback
    from undercurrent.notebook.storage import frame_to_records, load_records, save_records


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'undercurrent.notebook' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
