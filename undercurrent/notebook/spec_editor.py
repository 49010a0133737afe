"""``SpecEditor``: build, check and export a probe spec from ipywidgets controls.

The editor keeps one draft per extraction point
(:class:`~undercurrent.notebook.spec_draft.PointDraft`) and one per edit
(:class:`~undercurrent.notebook.edit_draft.EditDraft`), and runs the spec loader
on the whole draft at every change, so what it shows next to each field is
exactly what ``parse_dict`` would say; nothing is raised into the notebook while
editing. With at least one edit the spec is version "2", otherwise "1".
``.spec``, ``.to_yaml()`` and ``.save()`` give the result (and raise
``SpecValidationError`` only when asked for an invalid one).

>>> editor = SpecEditor(model=probed_model)   # doctest: +SKIP
>>> editor                                    # doctest: +SKIP  (shows the form)
>>> editor.save("probes.yaml")                # doctest: +SKIP
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from undercurrent.adapters.capabilities import Capabilities
from undercurrent.notebook.draft_form import DraftForm, widgets
from undercurrent.notebook.draft_validation import (
    EDITS,
    POINTS,
    ModelCheck,
    drafts_to_raw_spec,
    validate_drafts,
)
from undercurrent.notebook.edit_draft import EditDraft, draft_from_edit
from undercurrent.notebook.spec_draft import DEFAULT_INTERVENTION, PointDraft, draft_from_point
from undercurrent.notebook.spec_editor_controls import EDIT_FIELDS, FIELDS, build_controls
from undercurrent.notebook.spec_editor_text import (
    describe_problem,
    edits_hint_html,
    form_snapshot_html,
    section_snapshot_html,
    status_html,
    yaml_html,
)
from undercurrent.notebook.widget_closing import close_widgets
from undercurrent.probes import ProbeRegistry, default_registry
from undercurrent.spec import (
    ExecutionMode,
    InterventionMode,
    ProbeSpec,
    SpecProblem,
    SpecValidationError,
    load_yaml_file,
    parse_dict,
    parse_yaml,
    to_yaml,
)
from undercurrent.spec.fields import edit_fields, point_fields
from undercurrent.spec.loader import is_yaml_text
from undercurrent.spec.serialize import _dump as dump_spec_yaml
from undercurrent.spec.serialize import yaml_data

if TYPE_CHECKING:  # pragma: no cover
    from undercurrent.api import ProbedModel

ModelArgument = Union["ProbedModel", Capabilities, int, None]
"""What ``SpecEditor(model=...)`` takes: a ``ProbedModel``, its ``Capabilities``,
a number of decoder layers, or None (no model: layers are typed as text)."""

__all__ = ["EDIT_FIELDS", "FIELDS", "SpecEditor", "resolve_capabilities"]

ALWAYS_ON = ""
"""The ``when.point`` choice meaning "no trigger: the edit is always on"."""


def resolve_capabilities(model: ModelArgument) -> Capabilities | None:
    """``Capabilities`` from a ``ProbedModel``, a ``Capabilities``, a layer count, or None."""
    if model is None:
        return None
    if isinstance(model, Capabilities):
        return model
    if isinstance(model, int) and not isinstance(model, bool):
        if model < 1:
            raise ValueError(f"SpecEditor: a model has at least one layer, got {model}")
        return Capabilities.standard("any", "model", num_layers=model)
    capabilities = getattr(model, "capabilities", None)
    if capabilities is not None:
        found = capabilities() if callable(capabilities) else capabilities
        if isinstance(found, Capabilities):
            return found
    raise TypeError(
        "SpecEditor(model=...) takes a ProbedModel, a Capabilities object or a number of "
        f"layers, got {type(model).__name__}"
    )


def resolve_registry(model: ModelArgument) -> ProbeRegistry:
    """The probe registry a spec registered on ``model`` is checked against: a
    ``ProbedModel``'s router's (the default registry with its ``probes=`` added, or
    the registry given), else the default registry (as ``undercurrent validate``)."""
    registry = getattr(getattr(model, "router", None), "registry", None)
    return registry if isinstance(registry, ProbeRegistry) else default_registry


class SpecEditor:
    """An ipywidgets form for a probe spec, with live validation and a live YAML view.

    ``spec`` is a ``ProbeSpec`` to start from (default: one new point, no edits);
    ``model`` (a ``ProbedModel``, its ``Capabilities`` or a number of layers)
    bounds the layer pickers and the tensor types, and what registering the spec
    on it would refuse (a layer out of range, an edit vector that is not the
    model's hidden size) is shown like any other problem; a ``ProbedModel``'s
    probe registry (its ``probes=``) gives the probe types offered and checked
    (without one, the default registry). The points' form is
    ``fields``; the edits' form, below it, is ``edit_fields``. Display the editor
    (or ``editor.widget``) in a notebook to use it.

    ipywidgets keeps every widget until it is closed (an editor has a few hundred),
    so an editor that is done with (before a cell that builds a new one runs
    again) is let go with :meth:`close`; what it shows then is its snapshot.
    """

    def __init__(self, spec: ProbeSpec | None = None, *, model: ModelArgument = None) -> None:
        if spec is not None and not isinstance(spec, ProbeSpec):
            raise TypeError(f"SpecEditor(spec) takes a ProbeSpec or None, got "
                            f"{type(spec).__name__} ({spec!r:.40}); for a YAML file path or "
                            "YAML text use SpecEditor.from_spec(...)")
        if spec is not None:
            # The form holds probe_args as YAML text: a spec to_yaml refuses (a numpy
            # scalar in probe_args) is refused here with its SpecValidationError.
            yaml_data(spec)
        self.capabilities = resolve_capabilities(model)
        self.registry = resolve_registry(model)
        self._model_check = None if self.capabilities is None else ModelCheck(self.capabilities)
        self._spec: ProbeSpec | None = None
        self._problems: list[SpecProblem] = []
        self._saved: tuple[Path, ProbeSpec] | None = None
        self._closed = False
        points = [draft_from_point(point) for point in spec or ()]
        edits = [draft_from_edit(edit) for edit in spec.edits] if spec is not None else []
        if not points and not edits:
            points.append(self._new_point(set(), 0))
        self._build(points, edits)
        self.point_form.load_form()
        self.edit_form.load_form()
        self.refresh()

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec_or_path: ProbeSpec | Mapping[str, Any] | str | os.PathLike[str],
                  *, model: ModelArgument = None) -> SpecEditor:
        """An editor loaded with a ``ProbeSpec``, a spec dict, a YAML file path, or
        YAML text (version "1" or "2": the edits come with it).

        Loading goes through the spec loader, so an invalid file raises
        ``SpecValidationError`` naming the problems (there is nothing to edit yet);
        so does a ``ProbeSpec`` that ``to_yaml`` cannot write (``probe_args``
        holding a value YAML cannot represent, such as a numpy scalar).
        """
        if isinstance(spec_or_path, ProbeSpec):
            spec = spec_or_path
        elif isinstance(spec_or_path, Mapping):  # (as load_spec takes one)
            spec = parse_dict(spec_or_path)
        elif not isinstance(spec_or_path, str | os.PathLike):
            raise TypeError("from_spec takes a ProbeSpec, a spec dict, a YAML file path or "
                            f"YAML text, got {type(spec_or_path).__name__} "
                            f"({spec_or_path!r:.40})")
        elif is_yaml_text(spec_or_path):
            spec = parse_yaml(spec_or_path)
        else:
            spec = load_yaml_file(Path(spec_or_path))
        return cls(spec, model=model)

    def _default_layer(self, middle: bool) -> int:
        if self.capabilities is None:
            return 0
        valid = self.capabilities.valid_layers("residual_stream")
        if not valid:
            return 0
        return int(valid[len(valid) // 2] if middle else valid[-1])

    @staticmethod
    def _free_name(stem: str, taken: set[str], number: int) -> str:
        while f"{stem}_{number}" in taken:
            number += 1
        return f"{stem}_{number}"

    def _new_point(self, taken: set[str], count: int) -> PointDraft:
        """A new point: the model's last layer, ``norm_probe`` when registered."""
        layer = self._default_layer(middle=False)
        probes = self.registry.names()
        probe_type = "norm_probe" if "norm_probe" in probes else (probes[0] if probes else "")
        return PointDraft(
            name=self._free_name("point", taken, count),
            layers=(layer,),
            layers_text=None if self.capabilities is not None else str(layer),
            probe_type=probe_type,
        )

    def _new_edit(self, taken: set[str], count: int) -> EditDraft:
        """A new edit: ``add`` on the model's middle layer at ``generated[*]``, with no
        vector yet (the form asks for one)."""
        layer = self._default_layer(middle=True)
        return EditDraft(
            name=self._free_name("edit", taken, count),
            layers=(layer,),
            layers_text=None if self.capabilities is not None else str(layer),
        )

    def _names_in_use(self) -> set[str]:
        return {draft.name for draft in (*self.point_form.drafts, *self.edit_form.drafts)}

    def _point_controls(self, w: Any) -> dict[str, Any]:
        wide = w.Layout(width="380px")
        return build_controls(w, point_fields(), self.capabilities, {
            "probe_type": w.Dropdown(options=list(self.registry.names()), layout=wide),
            "intervention_mode": w.Dropdown(
                options=[("(router default)", DEFAULT_INTERVENTION)]
                + [(m.value, m.value) for m in InterventionMode],
                layout=wide,
            ),
            "timeout_ms": w.IntText(value=50, layout=wide),
        })

    def _edit_controls(self, w: Any) -> dict[str, Any]:
        wide = w.Layout(width="380px")
        return build_controls(w, edit_fields(), self.capabilities, {
            "when_point": w.Dropdown(options=[("(always on)", ALWAYS_ON)], layout=wide),
        })

    def _build(self, points: list[PointDraft], edits: list[EditDraft]) -> None:
        w = widgets()
        self.point_form = DraftForm(
            noun="point", section=POINTS, controls=self._point_controls(w), drafts=points,
            new_draft=self._new_point, names_in_use=self._names_in_use,
            on_change=self.refresh, capabilities=self.capabilities,
            applies={
                "stride": lambda d: d.continuous,
                "until": lambda d: d.continuous,
                "queue_depth": lambda d: d.is_async,
                "timeout_ms": lambda d: d.blocks,
                "on_timeout": lambda d: d.blocks,
            },
            problem_fields={"intervention": "intervention_mode", "every_n": "stride"},
        )
        self.edit_form = DraftForm(
            noun="edit", section=EDITS, controls=self._edit_controls(w), drafts=edits,
            new_draft=self._new_edit, names_in_use=self._names_in_use,
            on_change=self.refresh, capabilities=self.capabilities,
            applies={
                "stride": lambda d: d.continuous,
                "vector_key": lambda d: d.vector_is_file,
                "norm_match": lambda d: d.adds,
                "when_action": lambda d: d.triggered,
            },
            problem_fields={"when": "when_point"},
        )
        # The names the rest of the editor (and its users) know the point form by.
        form = self.point_form
        self.fields, self.errors, self.rows = form.fields, form.errors, form.rows
        self.point_list = form.list
        self.add_button = form.add_button
        self.duplicate_button = form.duplicate_button
        self.remove_button = form.remove_button
        edit_form = self.edit_form
        self.edit_fields, self.edit_errors = edit_form.fields, edit_form.errors
        self.edit_rows, self.edit_list = edit_form.rows, edit_form.list

        self.status = w.HTML()
        self.yaml_view = w.HTML()
        self.yaml_view.add_class("undercurrent-yaml")
        self.save_path = w.Text(value="spec.yaml", description="save to",
                                layout=w.Layout(width="260px"))
        self.save_button = w.Button(description="Save YAML", icon="save")
        self.save_message = w.HTML()
        self.save_button.on_click(lambda _button: self._save_clicked())
        self.edits_hint = w.HTML()
        edits_section = w.VBox([self.edits_hint, edit_form.widget])
        edits_section.add_class("undercurrent-edits")
        yaml_panel = w.VBox([
            w.HTML("<b>YAML</b>"),
            self.yaml_view,
            w.HBox([self.save_path, self.save_button]),
            self.save_message,
        ])
        self.widget = w.VBox([form.widget, edits_section, self.status, yaml_panel])
        self.widget.add_class("undercurrent-spec-editor")

    # -- display --------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        if self._closed:  # (no widget left to show: the snapshot alone)
            return {"text/html": self.snapshot_html(), "text/plain": self._yaml_text()}
        bundle = dict(self.widget._repr_mimebundle_(**kwargs))
        bundle["text/html"] = self.snapshot_html()
        bundle["text/plain"] = self._yaml_text()
        return bundle

    def close(self) -> None:
        """Close the editor's widgets (both forms, the YAML view, their layouts and
        styles): ipywidgets keeps every widget it made until it is closed, so an
        editor dropped without this stays in memory for the kernel's life. Where
        the editor is displayed, its form leaves the page. The editor keeps its
        drafts, and its :attr:`spec`, :meth:`to_yaml`, :meth:`save` and
        :meth:`snapshot_html` (what displaying it shows now) still work. Closing
        twice does nothing more."""
        self._closed = True
        close_widgets(self.widget)

    def snapshot_html(self) -> str:
        """The editor as static HTML: the selected point's and edit's forms, the
        problems and the YAML, for readers without a running kernel (GitHub,
        nbconvert, an unrun notebook)."""
        sections = [section_snapshot_html(
            "points", [d.name for d in self.drafts], self.point_form.snapshot_rows(self._problems))]
        if self.edit_drafts:
            sections.append(section_snapshot_html(
                "edits", [d.name for d in self.edit_drafts],
                self.edit_form.snapshot_rows(self._problems)))
        return form_snapshot_html(sections, self.status.value, self.yaml_view.value)

    # -- editing --------------------------------------------------------------------

    @property
    def drafts(self) -> list[PointDraft]:
        """The point drafts, in spec order."""
        return self.point_form.drafts

    @property
    def edit_drafts(self) -> list[EditDraft]:
        """The edit drafts, in spec order."""
        return self.edit_form.drafts

    @property
    def current(self) -> int:
        """The index of the point shown in the form."""
        return self.point_form.current

    def add_point(self) -> None:
        """Append a new point with defaults and select it."""
        self.point_form.add()

    def duplicate_point(self) -> None:
        """Insert a copy of the selected point (renamed ``<name>_copy``) after it."""
        self.point_form.duplicate()

    def remove_point(self) -> None:
        """Remove the selected point (an empty spec is allowed, and shown as such)."""
        self.point_form.remove()

    def select(self, index_or_name: int | str) -> None:
        """Show the point at ``index_or_name`` (an index or a point name) in the form."""
        self.point_form.select(index_or_name)

    def add_edit(self) -> None:
        """Append a new edit (the spec becomes version "2") and select it. It has no
        vector yet: the form says so next to ``vector``."""
        self.edit_form.add()

    def duplicate_edit(self) -> None:
        """Insert a copy of the selected edit (renamed ``<name>_copy``) after it."""
        self.edit_form.duplicate()

    def remove_edit(self) -> None:
        """Remove the selected edit (with none left, the spec is version "1" again)."""
        self.edit_form.remove()

    def select_edit(self, index_or_name: int | str) -> None:
        """Show the edit at ``index_or_name`` (an index or an edit name) in its form."""
        self.edit_form.select(index_or_name)

    # -- validation and views ---------------------------------------------------------

    def refresh(self) -> None:
        """Re-validate the whole spec and update errors, visibility, the lists and the
        YAML (called by every change; call it after changing drafts from code)."""
        self._spec, self._problems = validate_drafts(
            self.drafts, self.edit_drafts, self._model_check, self.registry)
        self._offer_trigger_points()
        for form in (self.point_form, self.edit_form):
            form.update_list(form.flagged(self._problems))
            form.update_visibility()
            form.update_errors(self._problems)
        self.edits_hint.value = edits_hint_html(len(self.edit_drafts))
        self._update_views()

    def _offer_trigger_points(self) -> None:
        """``when.point`` offers the spec's inline points (a draft naming another
        point keeps it, and the loader says what is wrong with it)."""
        inline = [draft.name for draft in self.drafts
                  if draft.name and draft.execution_mode == ExecutionMode.INLINE.value]
        self.edit_form.set_options(
            "when_point", [("(always on)", ALWAYS_ON)] + [(name, name) for name in inline])

    def field_problems(self, index: int | None = None) -> dict[str, list[str]]:
        """``{point field: [messages]}`` for the point at ``index`` (default: selected)."""
        return self.point_form.field_problems(self._problems, index)

    def edit_field_problems(self, index: int | None = None) -> dict[str, list[str]]:
        """``{edit field: [messages]}`` for the edit at ``index`` (default: selected)."""
        return self.edit_form.field_problems(self._problems, index)

    def _yaml_text(self) -> str:
        """The spec's YAML, or the draft's in the same style, marked as not valid yet."""
        if self._spec is not None:
            return to_yaml(self._spec)
        raw, _ = drafts_to_raw_spec(self.drafts, self.edit_drafts)
        return "# not valid yet: fix the fields marked ⚠\n" + dump_spec_yaml(
            raw, allow_unicode=True)

    def _update_views(self) -> None:
        shown = {(POINTS, self.point_form.current), (EDITS, self.edit_form.current)}
        others = [p for p in self._problems if (p.section, p.point_index) not in shown]
        names = {POINTS: [d.name for d in self.drafts], EDITS: [d.name for d in self.edit_drafts]}
        spec = self._spec
        self.status.value = status_html(
            None if spec is None else len(spec), len(self._problems),
            [describe_problem(problem, names[problem.section]) for problem in others[:20]],
            edits=0 if spec is None else len(spec.edits),
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
        """The edited spec (version "2" when it has edits); raises
        ``SpecValidationError`` listing the problems if invalid."""
        if self._spec is None:
            raise SpecValidationError(self._problems, source="SpecEditor")
        return self._spec

    def to_yaml(self) -> str:
        """The edited spec as YAML (raises ``SpecValidationError`` if invalid)."""
        return to_yaml(self.spec)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the spec's YAML to ``path`` and return its absolute path (raises if the
        spec is invalid)."""
        target = Path(os.path.expanduser(path)).resolve()
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
