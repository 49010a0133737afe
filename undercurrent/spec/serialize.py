"""Resolved specs back to spec-shaped data and YAML.

The output always uses the current key names, omits optional fields left at their
defaults and spells positions canonically, so ``parse_dict(probe_spec_to_dict(spec))
== spec`` holds for every valid spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from undercurrent.spec.declarations import to_spec_data
from undercurrent.spec.errors import SpecProblem, SpecValidationError
from undercurrent.spec.loader import parse_dict
from undercurrent.spec.types import Edit, ExtractionPoint, ProbeSpec


def extraction_point_to_dict(point: ExtractionPoint) -> dict[str, Any]:
    """One point as a plain dict in spec form (handy for logging what a probe ran with).

    Derived from the field declarations (:func:`~undercurrent.spec.declarations.to_spec_data`):
    every key in declaration order, optional ones left out at their default,
    ``intervention.mode`` always written (an explicit policy differs from an
    omitted one).

    >>> from undercurrent.spec import ExtractionPoint
    >>> extraction_point_to_dict(ExtractionPoint(name="p", layers=(3,),
    ...     tensor_type="mlp_out", position=" prompt[-1] ", probe_type="norm_probe",
    ...     probe_kind="single_shot"))["position"]
    'prompt[-1]'
    """
    return to_spec_data(point)


def edit_to_dict(edit: Edit) -> dict[str, Any]:
    """One edit as a plain dict in spec form (defaults omitted, position canonical).

    >>> from undercurrent.spec import Edit
    >>> edit_to_dict(Edit(name="e", layers=(1,), tensor_type="residual_stream",
    ...     position="generated[*]", op="add", vector=[0.5, 1.0]))["vector"]
    [0.5, 1.0]
    """
    return to_spec_data(edit)


def probe_spec_to_dict(spec: ProbeSpec) -> dict[str, Any]:
    """A whole spec as plain data: ``{"version": ..., "extraction_points": [...]}``,
    plus ``"edits"`` when the spec has any.

    ``version`` is always written, so a saved file says which format it uses.
    """
    data: dict[str, Any] = {
        "version": spec.version,
        "extraction_points": [extraction_point_to_dict(point) for point in spec],
    }
    if spec.edits:
        data["edits"] = [edit_to_dict(edit) for edit in spec.edits]
    return data


def _plain(value: Any) -> Any:
    """Mappings -> dicts and tuples -> lists, so the safe YAML dumper accepts them."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


class _SpecDumper(yaml.SafeDumper):
    """Block style throughout, except flat lists of scalars (``layers: [4, 8]``)."""


def _represent_list(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.Node:
    flat = all(not isinstance(item, dict | list) for item in items)
    return dumper.represent_sequence(
        "tag:yaml.org,2002:seq", items, flow_style=flat
    )


_SpecDumper.add_representer(list, _represent_list)


def yaml_data(spec: ProbeSpec) -> dict[str, Any]:
    """:func:`probe_spec_to_dict` with every ``probe_args`` made plain for the YAML
    dumper (dicts and lists).

    Raises :class:`SpecValidationError` naming the point when its ``probe_args``
    hold a value YAML cannot represent (an arbitrary Python object, a numpy
    scalar): what :func:`to_yaml` and the notebook's ``SpecEditor`` refuse.
    """
    data = probe_spec_to_dict(spec)
    for index, point in enumerate(data["extraction_points"]):
        if "probe_args" not in point:
            continue
        try:
            point["probe_args"] = _plain(point["probe_args"])
            yaml.dump(point["probe_args"], Dumper=_SpecDumper)
        except (yaml.YAMLError, RecursionError) as error:
            problem = SpecProblem(
                f"cannot be written as YAML: {error}", "probe_args", index, point["name"]
            )
            raise SpecValidationError([problem]) from None
    return data


def to_yaml(spec: ProbeSpec) -> str:
    """The spec as YAML text, which :func:`parse_yaml` reads back to an equal spec
    (but for a tuple in ``probe_args``, which comes back as a list: YAML has one
    kind of sequence).

    Raises :class:`SpecValidationError` naming the point when its ``probe_args``
    hold a value YAML cannot represent (see :func:`yaml_data`), and with the
    loader's problems for a hand-built spec it would refuse (two points of one
    name, a version this release does not read): the text is never one that
    :func:`parse_yaml` refuses.
    """
    data = yaml_data(spec)
    parse_dict(data)  # (the loader's own checks, not a copy of them)
    text = _dump(data, allow_unicode=True)
    # PyYAML writes a few code points (NEL, line and paragraph separators) unescaped
    # that its reader then folds into line breaks; escape everything when that bites.
    if yaml.safe_load(text) != data:
        text = _dump(data, allow_unicode=False)
    return text


def _dump(data: Any, allow_unicode: bool) -> str:
    return yaml.dump(
        data,
        Dumper=_SpecDumper,
        sort_keys=False,
        allow_unicode=allow_unicode,
        default_flow_style=False,
    )
