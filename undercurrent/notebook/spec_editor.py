"""``SpecEditor``: build, check and export a probe spec from ipywidgets controls.

The editor keeps one :class:`~undercurrent.notebook.spec_draft.PointDraft` per
extraction point and runs the spec loader on every change, so what it shows
next to each field is exactly what ``parse_dict`` would say; nothing is raised
into the notebook while editing. ``.spec``, ``.to_yaml()`` and ``.save()`` give
the result (and raise ``SpecValidationError`` only when asked for an invalid one).

>>> editor = SpecEditor(model=probed_model)   # doctest: +SKIP
>>> editor                                    # doctest: +SKIP  (shows the form)
>>> editor.save("probes.yaml")                # doctest: +SKIP
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from undercurrent.notebook.spec_draft import (
    DEFAULT_INTERVENTION,
    PointDraft,
    draft_from_point,
    drafts_to_raw_spec,
    validate_drafts,
)
from undercurrent.notebook.spec_editor_text import (
    LABELS,
    LAYERS_HINT,
    describe_problem,
    field_messages_html,
    form_snapshot_html,
    status_html,
    with_subject,
    yaml_html,
)
from undercurrent.spec import (
    ExecutionMode,
    InterventionMode,
    OnTimeout,
    ProbeKind,
    ProbeSpec,
    SpecProblem,
    SpecValidationError,
    TensorType,
    UntilKind,
    load_yaml_file,
    parse_yaml,
    to_yaml,
)
from undercurrent.spec.serialize import _dump as dump_spec_yaml

FIELDS: tuple[str, ...] = (
    "name",
    "layers",
    "tensor_type",
    "position",
    "stride",
    "until",
    "probe_type",
    "probe_kind",
    "probe_args",
    "execution_mode",
    "queue_depth",
    "intervention_mode",
    "timeout_ms",
    "on_timeout",
)
"""The editor's fields, in display order (``editor.fields[name]`` is the control)."""


# Which editor field shows a loader problem reported on a spec field.
_PROBLEM_FIELD = {
    "intervention": "intervention_mode",
    "intervention.mode": "intervention_mode",
    "intervention.timeout_ms": "timeout_ms",
    "intervention.on_timeout": "on_timeout",
    "every_n": "stride",
}


def _widgets() -> Any:
    try:
        import ipywidgets
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "SpecEditor needs ipywidgets: pip install 'undercurrent[notebook]'"
        ) from error
    return ipywidgets


def resolve_capabilities(model: Any) -> Any:
    """``Capabilities`` from a ``ProbedModel``, a ``Capabilities``, a layer count, or None."""
    if model is None:
        return None
    from undercurrent.adapters.capabilities import Capabilities

    if isinstance(model, Capabilities):
        return model
    if isinstance(model, int) and not isinstance(model, bool):
        if model < 1:
            raise ValueError(f"SpecEditor: a model has at least one layer, got {model}")
        return Capabilities.standard("any", "model", num_layers=model)
    capabilities = getattr(model, "capabilities", None)
    if capabilities is not None:
        return capabilities() if callable(capabilities) else capabilities
    raise TypeError(
        "SpecEditor(model=...) takes a ProbedModel, a Capabilities object or a number of "
        f"layers, got {type(model).__name__}"
    )


class SpecEditor:
    """An ipywidgets form for a probe spec, with live validation and a live YAML view.

    ``spec`` is a ``ProbeSpec`` to start from (default: one new point); ``model``
    (a ``ProbedModel``, its ``Capabilities`` or a number of layers) bounds the
    layer picker and the tensor types, and its problems are shown like any other.
    Display the editor (or ``editor.widget``) in a notebook to use it.
    """

    def __init__(self, spec: ProbeSpec | None = None, *, model: Any = None) -> None:
        self.capabilities = resolve_capabilities(model)
        self.drafts: list[PointDraft] = (
            [draft_from_point(point) for point in spec] if spec is not None and len(spec)
            else [self._new_draft([])]
        )
        self.current = 0
        self._loading = False
        # Edits (spec version 2) are not edited here yet: a loaded spec's edits are
        # carried through unchanged, so saving it keeps them.
        self.edits = tuple(spec.edits) if spec is not None else ()
        self._spec: ProbeSpec | None = None
        self._problems: list[SpecProblem] = []
        self._build()
        self._load_form()
        self.refresh()

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec_or_path: ProbeSpec | str | os.PathLike[str], *,
                  model: Any = None) -> SpecEditor:
        """An editor loaded with a ``ProbeSpec``, a YAML file path, or YAML text.

        Loading goes through the spec loader, so an invalid file raises
        ``SpecValidationError`` naming the problems (there is nothing to edit yet).
        """
        if isinstance(spec_or_path, ProbeSpec):
            spec = spec_or_path
        elif isinstance(spec_or_path, str) and ("\n" in spec_or_path
                                                or "extraction_points" in spec_or_path):
            spec = parse_yaml(spec_or_path)
        else:
            spec = load_yaml_file(spec_or_path)
        return cls(spec, model=model)

    def _new_draft(self, existing: list[PointDraft]) -> PointDraft:
        names = {draft.name for draft in existing}
        number = len(existing)
        while f"point_{number}" in names:
            number += 1
        layer = 0
        if self.capabilities is not None:
            valid = self.capabilities.valid_layers("residual_stream")
            layer = valid[-1] if valid else 0
        from undercurrent.probes import list_probes

        probes = list_probes()
        probe_type = "norm_probe" if "norm_probe" in probes else (probes[0] if probes else "")
        return PointDraft(
            name=f"point_{number}",
            layers=(layer,),
            layers_text=None if self.capabilities is not None else str(layer),
            probe_type=probe_type,
        )

    def _build(self) -> None:
        w = _widgets()
        wide = w.Layout(width="380px")
        self.fields: dict[str, Any] = {}
        self.errors: dict[str, Any] = {}
        self.rows: dict[str, Any] = {}
        tensor_types = [t.value for t in TensorType]
        if self.capabilities is not None:
            tensor_types = [t.value for t in self.capabilities.tensor_types]
        from undercurrent.probes import list_probes

        controls: dict[str, Any] = {
            "name": w.Text(description="name", layout=wide),
            "layers": (
                w.SelectMultiple(description="layers", rows=5, layout=wide)
                if self.capabilities is not None
                else w.Text(description="layers", placeholder="e.g. 0, 2, 4", layout=wide)
            ),
            "tensor_type": w.Dropdown(description="tensor_type", options=tensor_types,
                                      layout=wide),
            "position": w.Text(description="position", placeholder="prompt[-1], generated[*]",
                               layout=wide),
            "stride": w.BoundedIntText(description="stride", min=1, max=1_000_000, layout=wide),
            "until": w.Dropdown(description="until",
                                options=[("(not set)", "")] + [(u.value, u.value)
                                                               for u in UntilKind],
                                layout=wide),
            "probe_type": w.Dropdown(description="probe_type", options=list(list_probes()),
                                     layout=wide),
            "probe_kind": w.Dropdown(description="probe_kind",
                                     options=[k.value for k in ProbeKind], layout=wide),
            "probe_args": w.Textarea(description="probe_args",
                                     placeholder="key: value (YAML), e.g.\nthreshold: 0.5",
                                     layout=w.Layout(width="380px", height="70px")),
            "execution_mode": w.Dropdown(description="execution_mode",
                                         options=[m.value for m in ExecutionMode], layout=wide),
            "queue_depth": w.Text(description="queue_depth", placeholder="32 (router default)",
                                  layout=wide),
            "intervention_mode": w.Dropdown(
                description=LABELS["intervention_mode"],
                options=[("(router default)", DEFAULT_INTERVENTION)]
                + [(m.value, m.value) for m in InterventionMode],
                layout=wide,
            ),
            "timeout_ms": w.BoundedIntText(description=LABELS["timeout_ms"], min=1, max=3_600_000,
                                           layout=wide),
            "on_timeout": w.Dropdown(description=LABELS["on_timeout"],
                                     options=[o.value for o in OnTimeout], layout=wide),
        }
        style = {"description_width": "150px"}
        for field in FIELDS:
            control = controls[field]
            control.style = style
            error = w.HTML(value="", layout=w.Layout(width="auto", max_width="520px"))
            error.add_class("undercurrent-field-error")
            control.add_class(f"undercurrent-field-{field}")
            control.observe(self._on_field_change, names="value")
            self.fields[field] = control
            self.errors[field] = error
            self.rows[field] = w.HBox([control, error])
        if self.capabilities is not None:
            hint = w.HTML(f'<span style="color:#777;font-size:90%">{LAYERS_HINT}</span>')
            hint.add_class("undercurrent-layers-hint")
            self.rows["layers"].children = (self.fields["layers"],
                                            w.VBox([hint, self.errors["layers"]]))

        self.point_list = w.Select(description="points", rows=6, layout=w.Layout(width="260px"))
        self.point_list.style = {"description_width": "50px"}
        self.point_list.observe(self._on_select, names="value")
        self.add_button = w.Button(description="Add", icon="plus", tooltip="add a new point")
        self.duplicate_button = w.Button(description="Duplicate", icon="copy",
                                         tooltip="copy the selected point")
        self.remove_button = w.Button(description="Remove", icon="trash",
                                      tooltip="remove the selected point")
        for button, action in (
            (self.add_button, self.add_point),
            (self.duplicate_button, self.duplicate_point),
            (self.remove_button, self.remove_point),
        ):
            button.layout = w.Layout(width="110px")
            button.on_click(_ignore_argument(action))
        self.status = w.HTML()
        self.yaml_view = w.HTML()
        self.yaml_view.add_class("undercurrent-yaml")
        self.save_path = w.Text(value="spec.yaml", description="save to",
                                layout=w.Layout(width="260px"))
        self.save_button = w.Button(description="Save YAML", icon="save")
        self.save_message = w.HTML()
        self._saved: tuple[Path, ProbeSpec] | None = None
        self.save_button.on_click(_ignore_argument(self._save_clicked))

        sidebar = w.VBox([
            self.point_list,
            w.HBox([self.add_button, self.duplicate_button]),
            self.remove_button,
        ], layout=w.Layout(flex="0 0 auto"))  # the wide form must not squeeze the list
        form = w.VBox([self.rows[field] for field in FIELDS])
        yaml_panel = w.VBox([
            w.HTML("<b>YAML</b>"),
            self.yaml_view,
            w.HBox([self.save_path, self.save_button]),
            self.save_message,
        ])
        self.widget = w.VBox([w.HBox([sidebar, form]), self.status, yaml_panel])
        self.widget.add_class("undercurrent-spec-editor")

    # -- display --------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs))
        bundle["text/html"] = self.snapshot_html()
        bundle["text/plain"] = self._yaml_text()
        return bundle

    def snapshot_html(self) -> str:
        """The editor as static HTML: the selected point's form, the problems and the YAML,
        for readers without a running kernel (GitHub, nbconvert, an unrun notebook)."""
        problems = self.field_problems()
        rows = []
        for field in FIELDS:
            if self.rows[field].layout.display == "none":
                continue
            control = self.fields[field]
            value = control.value
            if isinstance(value, tuple):
                value = ", ".join(str(item) for item in value)
            elif isinstance(getattr(control, "label", None), str):
                value = control.label  # what a dropdown shows: "(router default)"
            rows.append((LABELS.get(field, field), str(value), problems.get(field, [])))
        return form_snapshot_html(rows, [d.name for d in self.drafts], self.status.value,
                                  self.yaml_view.value)

    # -- editing --------------------------------------------------------------------

    def add_point(self) -> None:
        """Append a new point with defaults and select it."""
        self.drafts.append(self._new_draft(self.drafts))
        self._select(len(self.drafts) - 1)

    def duplicate_point(self) -> None:
        """Insert a copy of the selected point (renamed ``<name>_copy``) after it."""
        source = self.drafts[self.current]
        names = {draft.name for draft in self.drafts}
        name = f"{source.name}_copy"
        suffix = 2
        while name in names:
            name = f"{source.name}_copy{suffix}"
            suffix += 1
        self.drafts.insert(self.current + 1, source.copy(name=name))
        self._select(self.current + 1)

    def remove_point(self) -> None:
        """Remove the selected point (an empty spec is allowed, and shown as such)."""
        if not self.drafts:
            return
        del self.drafts[self.current]
        self._select(min(self.current, len(self.drafts) - 1))

    def select(self, index_or_name: int | str) -> None:
        """Show the point at ``index_or_name`` (an index or a point name) in the form."""
        if isinstance(index_or_name, str):
            names = [draft.name for draft in self.drafts]
            if index_or_name not in names:
                raise KeyError(f"no point named {index_or_name!r}; points: {names}")
            index_or_name = names.index(index_or_name)
        self._select(index_or_name)

    def _select(self, index: int) -> None:
        self.current = max(index, 0)
        self._load_form()
        self.refresh()

    def _on_select(self, change: dict[str, Any]) -> None:
        if self._loading or change["new"] is None:
            return
        self._select(int(change["new"]))

    def _on_field_change(self, change: dict[str, Any]) -> None:
        if self._loading or not self.drafts:
            return
        draft = self._read_form()
        if change["owner"] is self.fields["tensor_type"]:
            draft = self._valid_layers_for(draft)
            self.drafts[self.current] = draft
            self._load_form()
        self.drafts[self.current] = draft
        self.refresh()

    def _valid_layers_for(self, draft: PointDraft) -> PointDraft:
        """Keep the selected layers the new tensor type allows; with none left, take the
        closest valid one (``final_norm`` only exists at layer N)."""
        if self.capabilities is None:
            return draft
        valid = tuple(self.capabilities.valid_layers(draft.tensor_type))
        if not valid:
            return draft
        kept = tuple(layer for layer in draft.layers if layer in valid)
        if not kept:
            wanted = max(draft.layers) if draft.layers else valid[-1]
            kept = (min(valid, key=lambda layer: (abs(layer - wanted), -layer)),)
        return draft.copy(layers=kept)

    def _read_form(self) -> PointDraft:
        f = self.fields
        draft = self.drafts[self.current]
        if self.capabilities is not None:
            layers = tuple(sorted(int(v) for v in f["layers"].value))
            layers_text = None
        else:
            layers, layers_text = draft.layers, f["layers"].value
        return draft.copy(
            name=f["name"].value,
            layers=layers,
            layers_text=layers_text,
            tensor_type=f["tensor_type"].value,
            position=f["position"].value,
            stride=int(f["stride"].value),
            until=f["until"].value or "",
            probe_type=f["probe_type"].value or "",
            probe_kind=f["probe_kind"].value,
            probe_args=f["probe_args"].value,
            execution_mode=f["execution_mode"].value,
            queue_depth=f["queue_depth"].value,
            intervention_mode=f["intervention_mode"].value,
            timeout_ms=int(f["timeout_ms"].value),
            on_timeout=f["on_timeout"].value,
        )

    def _load_form(self) -> None:
        """Put the current draft's values into the controls (without triggering edits)."""
        self._loading = True
        try:
            self._update_point_list()
            if not self.drafts:
                return
            draft = self.drafts[self.current]
            f = self.fields
            _ensure_option(f["tensor_type"], draft.tensor_type)
            _ensure_option(f["probe_type"], draft.probe_type)
            f["name"].value = draft.name
            f["tensor_type"].value = draft.tensor_type
            if self.capabilities is not None:
                valid = self.capabilities.valid_layers(draft.tensor_type)
                layers = sorted(set(valid) | set(draft.layers))
                f["layers"].options = [(self._layer_label(layer, valid), layer)
                                       for layer in layers]
                f["layers"].value = tuple(draft.layers)
            else:
                text = draft.layers_text
                if text is None:
                    text = ", ".join(str(layer) for layer in draft.layers)
                f["layers"].value = text
            f["position"].value = draft.position
            f["stride"].value = draft.stride
            f["until"].value = draft.until
            f["probe_type"].value = draft.probe_type
            f["probe_kind"].value = draft.probe_kind
            f["probe_args"].value = draft.probe_args
            f["execution_mode"].value = draft.execution_mode
            f["queue_depth"].value = draft.queue_depth
            f["intervention_mode"].value = draft.intervention_mode
            f["timeout_ms"].value = draft.timeout_ms
            f["on_timeout"].value = draft.on_timeout
        finally:
            self._loading = False

    def _layer_label(self, layer: int, valid: tuple[int, ...]) -> str:
        if layer not in valid:
            return f"{layer} (out of range)"
        if self.capabilities is not None and layer == self.capabilities.num_layers:
            return f"{layer} (final norm)"
        return str(layer)

    def _update_point_list(self) -> None:
        flagged = {problem.point_index for problem in self._problems}
        options = [
            (("⚠ " if index in flagged else "") + (draft.name or "(unnamed)"), index)
            for index, draft in enumerate(self.drafts)
        ]
        self.point_list.options = options
        self.point_list.value = self.current if self.drafts else None

    # -- validation and views ---------------------------------------------------------

    def refresh(self) -> None:
        """Re-validate every point and update errors, visibility, the list and the YAML."""
        self._spec, self._problems = validate_drafts(self.drafts, self.capabilities)
        if self._spec is not None and self.edits:
            self._spec = ProbeSpec(self._spec.extraction_points, version="2", edits=self.edits)
        self._loading = True
        try:
            self._update_point_list()
        finally:
            self._loading = False
        self._update_visibility()
        self._update_errors()
        self._update_views()

    def _update_visibility(self) -> None:
        draft = self.drafts[self.current] if self.drafts else None
        applies: dict[str, Callable[[PointDraft], bool]] = {
            "stride": lambda d: d.continuous,
            "until": lambda d: d.continuous,
            "queue_depth": lambda d: d.is_async,
            "timeout_ms": lambda d: d.blocks,
            "on_timeout": lambda d: d.blocks,
        }
        for field in FIELDS:
            shown = draft is not None and applies.get(field, lambda d: True)(draft)
            self.rows[field].layout.display = "" if shown else "none"

    def field_problems(self, index: int | None = None) -> dict[str, list[str]]:
        """``{editor field: [messages]}`` for the point at ``index`` (default: selected)."""
        index = self.current if index is None else index
        found: dict[str, list[str]] = {}
        for problem in self._problems:
            if problem.point_index != index or problem.field is None:
                continue
            field = _PROBLEM_FIELD.get(problem.field, problem.field)
            found.setdefault(field if field in FIELDS else "name", []).append(
                with_subject(problem))
        if self.drafts and 0 <= index < len(self.drafts):
            live = self.drafts[index].position_problem()
            if live and live not in found.get("position", []):
                found.setdefault("position", []).insert(0, live)
        return found

    def _update_errors(self) -> None:
        problems = self.field_problems()
        for field in FIELDS:
            self.errors[field].value = field_messages_html(problems.get(field, []))

    def _yaml_text(self) -> str:
        """The spec's YAML, or the draft's in the same style, marked as not valid yet."""
        if self._spec is not None:
            return to_yaml(self._spec)
        raw, _ = drafts_to_raw_spec(self.drafts)
        return "# not valid yet: fix the fields marked ⚠\n" + dump_spec_yaml(
            raw, allow_unicode=True)

    def _update_views(self) -> None:
        others = [p for p in self._problems if p.point_index != self.current]
        names = [draft.name for draft in self.drafts]
        self.status.value = status_html(
            None if self._spec is None else len(self._spec), len(self._problems),
            [describe_problem(problem, names) for problem in others[:20]],
        )
        if self._saved is not None and self._saved[1] != self._spec:
            self._saved = None
            self.save_message.value = ""  # the file no longer holds what is on screen
        self.yaml_view.value = yaml_html(self._yaml_text())

    # -- results ----------------------------------------------------------------------

    @property
    def problems(self) -> list[SpecProblem]:
        """Every problem in the edited spec (empty when it is valid)."""
        return list(self._problems)

    @property
    def valid(self) -> bool:
        """Whether the edited spec is valid."""
        return self._spec is not None

    @property
    def spec(self) -> ProbeSpec:
        """The edited spec; raises ``SpecValidationError`` listing the problems if invalid."""
        if self._spec is None:
            raise SpecValidationError(self._problems, source="SpecEditor")
        return self._spec

    def to_yaml(self) -> str:
        """The edited spec as YAML (raises ``SpecValidationError`` if invalid)."""
        return to_yaml(self.spec)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the spec's YAML to ``path`` and return its absolute path (raises if the
        spec is invalid)."""
        target = Path(path).expanduser().resolve()
        spec = self.spec
        target.write_text(to_yaml(spec), encoding="utf-8")
        self._saved = (target, spec)
        return target

    def _save_clicked(self) -> None:
        try:
            target = self.save(self.save_path.value)
        except (SpecValidationError, OSError) as error:
            self.save_message.value = (
                f'<span style="color:#b00020">not saved: {html.escape(str(error))}</span>'
            )
        else:
            self.save_message.value = f"saved to <code>{html.escape(str(target))}</code>"


def _ensure_option(dropdown: Any, value: str) -> None:
    """Add ``value`` to a dropdown's options (a loaded spec may name an unknown value)."""
    options = list(dropdown.options)
    values = [option[1] if isinstance(option, tuple) else option for option in options]
    if value not in values:
        dropdown.options = options + [value]


def _ignore_argument(action: Callable[[], Any]) -> Callable[[Any], None]:
    def handler(_button: Any) -> None:
        action()

    return handler
