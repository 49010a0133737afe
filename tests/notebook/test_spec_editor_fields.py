"""The editor's forms come from the spec's field tables: one control per key, in the
schema's order, labelled with its YAML path, with the schema's documentation as help,
and a fresh form writes the schema's defaults."""

from __future__ import annotations

import dataclasses

import pytest

from undercurrent.notebook import SpecEditor
from undercurrent.notebook.edit_draft import EditDraft
from undercurrent.notebook.spec_draft import PointDraft
from undercurrent.notebook.spec_editor_controls import EDIT_FIELDS, FIELDS, help_text
from undercurrent.spec.fields import REQUIRED, edit_fields, point_fields


@pytest.mark.parametrize("model", [None, 4])
def test_every_spec_field_has_a_control_labelled_with_its_path_and_documented(model):
    editor = SpecEditor(model=model)
    for table, controls in ((point_fields(), editor.fields),
                            (edit_fields(), editor.edit_fields)):
        assert [control.description for control in controls.values()] == [
            field.path for field in table]
        for field, control in zip(table, controls.values(), strict=True):
            assert control.tooltip == help_text(field.doc) and "``" not in control.tooltip
            if field.kind == "choice" and field.path not in ("intervention.mode",):
                values = [o[1] if isinstance(o, tuple) else o for o in control.options]
                assert set(values) - {""} <= set(field.choices), field.path


def _resolved(value):
    return getattr(value, "value", value)


def test_a_fresh_point_and_edit_write_the_schemas_defaults():
    editor = SpecEditor(model=4)
    editor.add_edit()
    editor.edit_fields["vector"].value = "1, 0"
    point, edit = editor.spec[0], editor.spec.edits[0]
    for table, resolved in ((point_fields(), point), (edit_fields(), edit)):
        for field in table:
            if field.required or "." in field.path:
                continue
            assert _resolved(getattr(resolved, field.path)) == field.default, field.path
    assert point.intervention is None  # omitted: the router's default policy applies
    assert edit.when is None  # omitted: always on
    assert REQUIRED not in [field.default for field in edit_fields() if not field.required]


def test_every_spec_field_is_an_attribute_of_its_draft():
    """A key added to the schema needs a draft attribute (and its text -> data step)."""
    for names, draft in ((FIELDS, PointDraft), (EDIT_FIELDS, EditDraft)):
        missing = set(names) - {field.name for field in dataclasses.fields(draft)}
        assert not missing, f"{draft.__name__} lacks {sorted(missing)}"
