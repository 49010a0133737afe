"""Extraction-point specs: load, validate, resolve, serialize.

>>> from undercurrent.spec import parse_yaml
>>> spec = parse_yaml('''
... extraction_points:
...   - name: last_prompt_token_probe
...     layers: 12
...     tensor_type: residual_stream
...     position: "prompt[-1]"
...     probe_type: linear_probe
...     probe_kind: single_shot
... ''')
>>> spec.names
('last_prompt_token_probe',)

Nothing here imports torch, transformers or vllm.
"""

from __future__ import annotations

from undercurrent.spec.check import check_edits, check_extraction_points
from undercurrent.spec.errors import SpecProblem, SpecValidationError
from undercurrent.spec.loader import (
    SpecDeprecationWarning,
    load_yaml_file,
    parse_dict,
    parse_yaml,
)
from undercurrent.spec.position import PositionSelector, parse_position
from undercurrent.spec.schema import json_schema
from undercurrent.spec.serialize import (
    edit_to_dict,
    extraction_point_to_dict,
    probe_spec_to_dict,
    to_yaml,
)
from undercurrent.spec.types import (
    Edit,
    EditOp,
    EditTrigger,
    ExecutionMode,
    ExtractionPoint,
    InterventionMode,
    InterventionPolicy,
    OnTimeout,
    ProbeKind,
    ProbeSpec,
    SaeFeature,
    TensorType,
    TriggerAction,
    UntilKind,
)

__all__ = [
    "Edit",
    "EditOp",
    "EditTrigger",
    "ExecutionMode",
    "ExtractionPoint",
    "InterventionMode",
    "InterventionPolicy",
    "OnTimeout",
    "PositionSelector",
    "ProbeKind",
    "ProbeSpec",
    "SaeFeature",
    "SpecDeprecationWarning",
    "SpecProblem",
    "SpecValidationError",
    "TensorType",
    "TriggerAction",
    "UntilKind",
    "check_edits",
    "check_extraction_points",
    "edit_to_dict",
    "extraction_point_to_dict",
    "json_schema",
    "load_yaml_file",
    "parse_dict",
    "parse_position",
    "parse_yaml",
    "probe_spec_to_dict",
    "to_yaml",
]
