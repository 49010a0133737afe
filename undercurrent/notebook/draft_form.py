"""One section of the spec editor: a list of drafts and the form for the selected one.

The spec editor has two: the extraction points and the edits. Both work the same
way, so one class serves both: a list with **Add**, **Duplicate** and **Remove**,
one row per field (the control, then the problems found on that field), rows
shown only when their field applies, and ``layers`` a multi-select bounded by the
model when there is one (a comma-separated text otherwise). The drafts are plain
dataclasses whose attribute names are the field names (``PointDraft``,
``EditDraft``); every change calls ``on_change`` (the editor re-validates).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from undercurrent.notebook.spec_editor_controls import editor_name
from undercurrent.notebook.spec_editor_text import (
    LABELS,
    LAYERS_HINT,
    field_messages_html,
    with_subject,
)
from undercurrent.spec import SpecProblem

FieldTest = Callable[[Any], bool]


def widgets() -> Any:
    """The ``ipywidgets`` module, or an ImportError saying which extra to install."""
    try:
        import ipywidgets
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "SpecEditor needs ipywidgets: pip install 'undercurrent[notebook]'"
        ) from error
    return ipywidgets


class DraftForm:
    """A list of drafts of one kind (``noun``: "point" or "edit") and their form.

    ``controls`` maps each field, in display order, to its widget; ``applies``
    says when a field's row is shown (default: always). A loader problem shows on
    the row of its key (``intervention.mode`` on ``intervention_mode``), or on the
    row ``problem_fields`` names for a key without a row of its own
    (``intervention`` as a whole, the alias ``every_n``); any other goes to
    ``name``. ``new_draft(taken_names, count)`` makes the draft **Add** appends
    (``count``: how many drafts the list holds).
    """

    def __init__(
        self,
        *,
        noun: str,
        section: str,
        controls: Mapping[str, Any],
        drafts: list[Any],
        new_draft: Callable[[set[str], int], Any],
        names_in_use: Callable[[], set[str]],
        on_change: Callable[[], None],
        capabilities: Any = None,
        applies: Mapping[str, FieldTest] | None = None,
        problem_fields: Mapping[str, str] | None = None,
    ) -> None:
        w = widgets()
        self.noun = noun
        self.section = section
        self.order = tuple(controls)
        self.drafts = drafts
        self.current = 0
        self.loading = False
        self.capabilities = capabilities
        self._new_draft = new_draft
        self._names_in_use = names_in_use
        self._on_change = on_change
        self._applies = dict(applies or {})
        self._problem_fields = dict(problem_fields or {})
        self.fields: dict[str, Any] = {}
        self.errors: dict[str, Any] = {}
        self.rows: dict[str, Any] = {}
        # Styles and layouts are set in place: one assigned anew would leave the
        # widget's first one open (ipywidgets keeps it until closed) and out of the
        # tree that close() walks.
        for field, control in controls.items():
            control.style.description_width = "150px"
            error = w.HTML(value="", layout=w.Layout(width="auto", max_width="520px"))
            error.add_class("undercurrent-field-error")
            control.add_class(f"undercurrent-{noun}-field-{field}")
            if noun == "point":
                control.add_class(f"undercurrent-field-{field}")  # the original class names
            control.observe(self._on_field_change, names="value")
            self.fields[field] = control
            self.errors[field] = error
            self.rows[field] = w.HBox([control, error])
        if capabilities is not None and "layers" in self.fields:
            hint = w.HTML(f'<span style="color:#777;font-size:90%">{LAYERS_HINT}</span>')
            hint.add_class("undercurrent-layers-hint")
            self.rows["layers"].children = (self.fields["layers"],
                                            w.VBox([hint, self.errors["layers"]]))

        self.list = w.Select(description=f"{noun}s", rows=6, layout=w.Layout(width="260px"))
        self.list.style.description_width = "50px"
        self.list.add_class(f"undercurrent-{noun}-list")
        self.list.observe(self._on_select, names="value")
        self.add_button = w.Button(description="Add", icon="plus", tooltip=f"add a new {noun}")
        self.duplicate_button = w.Button(description="Duplicate", icon="copy",
                                         tooltip=f"copy the selected {noun}")
        self.remove_button = w.Button(description="Remove", icon="trash",
                                      tooltip=f"remove the selected {noun}")
        for button, action in (
            (self.add_button, self.add),
            (self.duplicate_button, self.duplicate),
            (self.remove_button, self.remove),
        ):
            button.layout.width = "110px"
            button.add_class(f"undercurrent-{noun}-{button.description.lower()}")
            button.on_click(_ignore_argument(action))
        self.sidebar = w.VBox([
            self.list,
            w.HBox([self.add_button, self.duplicate_button]),
            self.remove_button,
        ], layout=w.Layout(flex="0 0 auto"))  # the wide form must not squeeze the list
        self.form = w.VBox([self.rows[field] for field in self.order])
        self.widget = w.HBox([self.sidebar, self.form])

    # -- the list ---------------------------------------------------------------------

    @property
    def draft(self) -> Any:
        """The selected draft (None when the list is empty)."""
        return self.drafts[self.current] if self.drafts else None

    def add(self) -> None:
        """Append a new draft with defaults and select it."""
        self.drafts.append(self._new_draft(self._names_in_use(), len(self.drafts)))
        self._select(len(self.drafts) - 1)

    def duplicate(self) -> None:
        """Insert a copy of the selected draft (renamed ``<name>_copy``) after it."""
        if not self.drafts:
            return
        source = self.drafts[self.current]
        names = self._names_in_use()
        name = f"{source.name}_copy"
        suffix = 2
        while name in names:
            name = f"{source.name}_copy{suffix}"
            suffix += 1
        self.drafts.insert(self.current + 1, source.copy(name=name))
        self._select(self.current + 1)

    def remove(self) -> None:
        """Remove the selected draft (an empty list is allowed)."""
        if not self.drafts:
            return
        del self.drafts[self.current]
        self._select(min(self.current, len(self.drafts) - 1))

    def select(self, index_or_name: int | str) -> None:
        """Show the draft at ``index_or_name`` (an index or a name) in the form."""
        self._select(self.index_of(index_or_name))

    def index_of(self, index_or_name: int | str, caller: str = "select") -> int:
        """The index of the draft at ``index_or_name`` (an index or a name); a
        ``KeyError``, ``TypeError`` or ``IndexError`` naming what is wrong."""
        if isinstance(index_or_name, str):
            names = [draft.name for draft in self.drafts]
            if index_or_name not in names:
                raise KeyError(f"no {self.noun} named {index_or_name!r}; {self.noun}s: {names}")
            index_or_name = names.index(index_or_name)
        elif isinstance(index_or_name, bool) or not isinstance(index_or_name, numbers.Integral):
            raise TypeError(f"{caller} takes a {self.noun} index or name, got "
                            f"{type(index_or_name).__name__} ({index_or_name!r:.40})")
        elif not 0 <= index_or_name < len(self.drafts):
            raise IndexError(f"no {self.noun} at index {index_or_name}; there are "
                             f"{len(self.drafts)} {self.noun}s (indices 0.."
                             f"{len(self.drafts) - 1})")
        return int(index_or_name)

    def _select(self, index: int) -> None:
        self.current = max(index, 0)
        self.load_form()
        self._on_change()

    def _on_select(self, change: dict[str, Any]) -> None:
        if self.loading or change["new"] is None:
            return
        self._select(int(change["new"]))

    def update_list(self, flagged: set[int]) -> None:
        """List the drafts by name, ⚠ on those at the ``flagged`` indices."""
        self.loading = True
        try:
            self.list.options = [
                (("⚠ " if index in flagged else "") + (draft.name or "(unnamed)"), index)
                for index, draft in enumerate(self.drafts)
            ]
            self.list.value = self.current if self.drafts else None
        finally:
            self.loading = False

    # -- the form ---------------------------------------------------------------------

    def _on_field_change(self, change: dict[str, Any]) -> None:
        if self.loading or not self.drafts:
            return
        draft = self.read_form()
        self.drafts[self.current] = draft
        if change["owner"] is self.fields.get("tensor_type") and "layers" in self.fields:
            self.drafts[self.current] = self._valid_layers_for(draft)
            self.load_form()
        self._on_change()

    def _valid_layers_for(self, draft: Any) -> Any:
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

    def read_form(self) -> Any:
        """The selected draft with the controls' values."""
        values: dict[str, Any] = {}
        for field, control in self.fields.items():
            if field == "layers" and self.capabilities is not None:
                values["layers"] = _layers_kept_in_order(
                    self.drafts[self.current].layers, control.value)
                values["layers_text"] = None
            elif field == "layers":
                values["layers_text"] = control.value
            else:
                values[field] = "" if control.value is None else control.value
        return self.drafts[self.current].copy(**values)

    def load_form(self) -> None:
        """Put the selected draft's values into the controls (without triggering edits)."""
        w = widgets()
        self.loading = True
        try:
            draft = self.draft
            if draft is None:
                return
            for field, control in self.fields.items():
                if field == "layers":
                    self._load_layers(draft)
                    continue
                value = getattr(draft, field)
                if isinstance(control, w.Dropdown):
                    ensure_option(control, value)
                control.value = value
        finally:
            self.loading = False

    def _load_layers(self, draft: Any) -> None:
        control = self.fields["layers"]
        if self.capabilities is None:
            text = draft.layers_text
            control.value = text if text is not None else ", ".join(
                str(layer) for layer in draft.layers)
            return
        valid = self.capabilities.valid_layers(draft.tensor_type)
        layers = sorted(set(valid) | set(draft.layers))
        control.options = [(self._layer_label(layer, valid), layer) for layer in layers]
        control.value = tuple(draft.layers)

    def _layer_label(self, layer: int, valid: Sequence[int]) -> str:
        if layer not in valid:
            return f"{layer} (out of range)"
        if self.capabilities is not None and layer == self.capabilities.num_layers:
            return f"{layer} (final norm)"
        return str(layer)

    def set_options(self, field: str, options: list[tuple[str, str]]) -> None:
        """Replace a dropdown's choices, keeping the selected draft's value shown."""
        control = self.fields[field]
        if list(control.options) == options:
            return
        self.loading = True
        try:
            control.options = options
            if self.draft is not None:
                value = getattr(self.draft, field)
                ensure_option(control, value)
                control.value = value
        finally:
            self.loading = False

    def update_visibility(self) -> None:
        """Show the rows of the fields that apply to the selected draft."""
        draft = self.draft
        for field, row in self.rows.items():
            test = self._applies.get(field)
            shown = draft is not None and (test is None or test(draft))
            row.layout.display = "" if shown else "none"

    def shown(self, field: str) -> bool:
        """Whether ``field``'s row is shown."""
        return bool(self.rows[field].layout.display != "none")

    # -- problems ---------------------------------------------------------------------

    def field_problems(self, problems: Sequence[SpecProblem],
                       index: int | None = None) -> dict[str, list[str]]:
        """``{field: [messages]}`` for the draft at ``index`` (default: selected); an
        index with no draft is refused as :meth:`select` refuses it (an empty dict
        would read as "no problems")."""
        index = self.current if index is None else self.index_of(index, "field_problems")
        found: dict[str, list[str]] = {}
        for problem in problems:
            if (problem.section != self.section or problem.point_index != index
                    or problem.field is None):
                continue
            field = self._problem_fields.get(problem.field, editor_name(problem.field))
            found.setdefault(field if field in self.fields else "name", []).append(
                with_subject(problem))
        if self.drafts and 0 <= index < len(self.drafts):
            live = self.drafts[index].position_problem()
            if live and live not in found.get("position", []):
                found.setdefault("position", []).insert(0, live)
        return found

    def update_errors(self, problems: Sequence[SpecProblem]) -> None:
        """Show each field's problems next to it (the selected draft's)."""
        found = self.field_problems(problems)
        for field, error in self.errors.items():
            error.value = field_messages_html(found.get(field, []))

    def flagged(self, problems: Sequence[SpecProblem]) -> set[int]:
        """Indices of the drafts with a problem."""
        return {problem.point_index for problem in problems
                if problem.section == self.section and problem.point_index is not None}

    def snapshot_rows(self, problems: Sequence[SpecProblem]) -> list[tuple[str, str, list[str]]]:
        """``(label, value shown, messages)`` for each shown row of the form."""
        found = self.field_problems(problems)
        rows = []
        for field, control in self.fields.items():
            if not self.shown(field):
                continue
            value = control.value
            if isinstance(value, tuple):
                value = ", ".join(str(item) for item in value)
            elif isinstance(getattr(control, "label", None), str):
                value = control.label  # what a dropdown shows: "(router default)"
            rows.append((LABELS.get(field, field), str(value), found.get(field, [])))
        return rows


def ensure_option(dropdown: Any, value: str) -> None:
    """Add ``value`` to a dropdown's options (a loaded spec may name an unknown value,
    an edit's trigger point may have been renamed or removed).

    Options given as ``(label, value)`` pairs get a pair: ipywidgets reads the
    options as pairs only when every one is, so a bare value among pairs would
    turn each pair into a value of its own.
    """
    options = list(dropdown.options)
    pairs = any(isinstance(option, tuple) for option in options)
    values = [option[1] if isinstance(option, tuple) else option for option in options]
    if value not in values:
        dropdown.options = options + [(str(value), value) if pairs else value]


def _ignore_argument(action: Callable[[], Any]) -> Callable[[Any], None]:
    def handler(_button: Any) -> None:
        action()

    return handler


def _layers_kept_in_order(before: Sequence[int], selected: Sequence[Any]) -> tuple[int, ...]:
    """The layers ``selected`` in a multi-select: the draft's own, in its order, where
    the selection is still the draft's layers (an edit's layers order its applied
    edits: a change elsewhere in the form keeps a loaded spec's order), else
    ascending."""
    chosen = sorted({int(value) for value in selected})
    return tuple(before) if sorted(before) == chosen else tuple(chosen)
