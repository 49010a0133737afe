"""Hostile or malformed input: every loader answers with SpecValidationError, never a raw
YAML, pydantic or Python error, and never spends unbounded time or memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from spec_builders import raw_point, raw_spec

from undercurrent.spec import SpecValidationError, load_yaml_file, parse_dict, parse_yaml
from undercurrent.spec.yaml_source import MAX_DEPTH, MAX_EXPANDED_NODES

VALID = """\
extraction_points:
  - name: p
    layers: 1
    tensor_type: kv
    position: 0
    probe_type: x
    probe_kind: single_shot
"""


def message_of(text: str | bytes) -> str:
    with pytest.raises(SpecValidationError) as caught:
        parse_yaml(text)
    return str(caught.value)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("", "empty"),
        ("# only a comment\n", "empty"),
        ("- a\n- b\n", "got a list"),
        ("just a string\n", "got a string"),
        ("42\n", "got an integer"),
        ("extraction_points: {name: p}\n", "must be a list"),
        ("extraction_points: hello\n", "must be a list"),
        ("extraction_points:\n", "must be a list"),
        ("version: '1'\n", "'extraction_points'"),
    ],
)
def test_wrong_shapes_are_reported(text: str, fragment: str) -> None:
    assert fragment in message_of(text)


def test_yaml_syntax_errors_give_line_and_column() -> None:
    message = message_of("extraction_points: [\n  {name: p\n")
    assert "YAML error at line" in message and "column" in message


def test_tabs_used_for_indentation_get_a_hint() -> None:
    message = message_of(VALID.replace("    layers", "\tlayers"))
    assert "spaces, not tabs" in message


def test_duplicate_keys_are_rejected_with_both_lines() -> None:
    message = message_of(VALID + "    layers: 2\n")
    assert "duplicate key 'layers'" in message
    assert "first defined on line 3" in message and "line 8" in message


def test_duplicate_top_level_keys_are_rejected() -> None:
    assert "duplicate key 'version'" in message_of("version: '1'\nversion: '1'\n" + VALID)


def test_merge_keys_may_override_merged_values() -> None:
    text = """\
defaults: &defaults {layers: 1, tensor_type: kv, probe_type: x, probe_kind: single_shot}
"""
    # ``defaults`` is an unknown top-level key; the merge itself must not count as a duplicate.
    merged = VALID.replace("    layers: 1\n", "    <<: {layers: 3, position: 5}\n    layers: 1\n")
    assert parse_yaml(merged)[0].layers == (1,)
    assert "unknown key 'defaults'" in message_of(text + VALID)


def test_non_utf8_bytes_are_rejected_with_the_offset() -> None:
    message = message_of(VALID.encode() + b"\xff\xfe")
    assert "not UTF-8" in message and "0xff" in message


def test_non_printable_characters_are_rejected() -> None:
    assert "YAML error" in message_of(VALID + "# \x07 bell\n")


def test_several_documents_are_rejected() -> None:
    assert "YAML error" in message_of(VALID + "---\n" + VALID)


def test_python_object_tags_are_never_constructed() -> None:
    text = "!!python/object/apply:os.system ['echo hacked']\n"
    assert "YAML error" in message_of(text)


@pytest.mark.parametrize("value,fragment", [
    ("!!bool 8", "the value '8' is not a valid !!bool"),  # (a KeyError inside PyYAML)
    ("!!int ''", "the value '' is not a valid !!int"),  # (an IndexError)
    ("!!timestamp abc", "the value 'abc' is not a valid !!timestamp"),  # (an AttributeError)
    ("!!timestamp 2001-13-45", "!!timestamp (month must be in 1..12)"),  # (a ValueError)
    ("!!int abc", "!!int (invalid literal"),
])
def test_a_tagged_value_pyyaml_cannot_read_is_a_yaml_error_at_its_line(
        value: str, fragment: str) -> None:
    message = message_of(VALID + f"    probe_args: {{x: {value}}}\n")
    assert "YAML error at line 8, column 21: the value " in message and fragment in message


@pytest.mark.parametrize("field,value,fragment", [
    ("layers", "010", "010 has a leading zero, which YAML 1.1 reads as the octal number 8"),
    ("layers", "[1, 010]", "reads as the octal number 8"),
    ("position", "5:20", "5:20 is a base-60 number in YAML 1.1 (it reads as 320)"),
    ("layers", "1:30", "(it reads as 90)"),
    ("probe_args", "{t: 1:30.5}", "(it reads as 90.5)"),
])
def test_numbers_yaml_1_1_reads_unlike_a_person_are_refused_at_their_line(
        field: str, value: str, fragment: str) -> None:
    text = VALID.replace("    layers: 1\n", "").replace("    position: 0\n", "")
    text += "    layers: 1\n    position: 0\n".replace(
        f"    {field}: " + ("1" if field == "layers" else "0"), f"    {field}: {value}")
    if field == "probe_args":
        text += f"    probe_args: {value}\n"
    message = message_of(text)
    assert "YAML error at line" in message and fragment in message
    assert "quote it if you meant text" in message


def test_numbers_a_person_reads_as_yaml_does_are_kept() -> None:
    text = VALID + "    probe_args: {a: 0x10, b: 1_000, c: 0, d: -0, e: 0.5, f: 010.5, g: '010'}\n"
    assert dict(parse_yaml(text)[0].probe_args) == {
        "a": 16, "b": 1000, "c": 0, "d": 0, "e": 0.5, "f": 10.5, "g": "010"}
    # Quoted, it is text: the position's own check answers, not YAML.
    message = message_of(VALID.replace("position: 0", "position: '5:20'"))
    assert "YAML error" not in message and "field 'position'" in message


def test_an_alias_bomb_is_refused_quickly() -> None:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        previous = f"*a{level - 1}"
        lines.append(f"a{level}: &a{level} [{', '.join([previous] * 9)}]")
    message = message_of("\n".join(lines) + "\n")
    assert f"more than {MAX_EXPANDED_NODES} nodes" in message


def test_moderate_alias_reuse_is_fine() -> None:
    text = "extraction_points:\n  - &p {name: p, layers: [1, 2], tensor_type: kv, position: 0,\n"
    text += "       probe_type: x, probe_kind: single_shot, probe_args: {w: &w [1, 2, 3]}}\n"
    text += "  - {name: q, layers: 1, tensor_type: kv, position: 0, probe_type: x,\n"
    text += "     probe_kind: single_shot, probe_args: {w: *w}}\n"
    spec = parse_yaml(text)
    assert spec[1].probe_args["w"] == [1, 2, 3]


def test_a_recursive_alias_is_refused() -> None:
    assert "recursive" in message_of("extraction_points: &loop [*loop]\n")


def test_deep_nesting_is_refused() -> None:
    message = message_of("[" * 100_000 + "]" * 100_000)
    assert f"deeper than {MAX_DEPTH} levels" in message


def test_nesting_that_only_aliases_make_deep_is_refused() -> None:
    lines = ["a0: &a0 [" + "[" * 60 + "]" * 60 + "]"]
    lines += [f"a{i}: &a{i} [" + "[" * 60 + f"*a{i - 1}" + "]" * 60 + "]" for i in range(1, 4)]
    assert "once its aliases are resolved" in message_of("\n".join(lines) + "\n")


def test_deeply_nested_python_data_in_probe_args_is_reported() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(SpecValidationError, match="probe_args"):
        parse_dict(raw_spec(raw_point(probe_args={"deep": deep})))


def test_uncopyable_probe_args_are_reported() -> None:
    class Uncopyable:
        def __deepcopy__(self, memo: Any) -> Any:
            raise RuntimeError("no copies")

    with pytest.raises(SpecValidationError, match="probe_args.*no copies"):
        parse_dict(raw_spec(raw_point(probe_args={"x": Uncopyable()})))


@pytest.mark.parametrize("value", [None, 5, "text", b"bytes", object()])
def test_parse_dict_rejects_non_mappings(value: object) -> None:
    with pytest.raises(SpecValidationError, match="must be a mapping"):
        parse_dict(value)


@pytest.mark.parametrize("value", [None, 5, ["a"], {"a": 1}])
def test_parse_yaml_rejects_non_text(value: object) -> None:
    with pytest.raises(SpecValidationError, match="expected YAML text"):
        parse_yaml(value)  # type: ignore[arg-type]


def test_a_mapping_whose_methods_raise_still_gives_a_spec_error() -> None:
    class Broken(dict):  # type: ignore[type-arg]
        def items(self) -> Any:
            raise RuntimeError("broken mapping")

    with pytest.raises(SpecValidationError, match="broken mapping"):
        parse_dict(raw_spec(Broken(raw_point())))


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(SpecValidationError) as caught:
        load_yaml_file(path)
    assert str(path) in str(caught.value) and "no such file" in str(caught.value)
    assert caught.value.source == str(path)


@pytest.mark.parametrize("path", [None, 5, b"specs/x.yaml", "bad\x00name.yaml"])
def test_odd_paths_give_a_spec_error(path: object) -> None:
    with pytest.raises(SpecValidationError):
        load_yaml_file(path)  # type: ignore[arg-type]


def test_a_directory_is_not_a_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecValidationError, match="directory"):
        load_yaml_file(tmp_path)


def test_an_unreadable_file_names_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret.yaml"
    path.write_text(VALID, encoding="utf-8")

    def refuse(self: Path, *args: object, **kwargs: object) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)  # root could read a chmod 0 file
    with pytest.raises(SpecValidationError, match="permission denied") as caught:
        load_yaml_file(path)
    assert str(path) in str(caught.value)


def test_a_non_utf8_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(VALID.replace("name: p", "name: caf\u00e9").encode("latin-1"))
    with pytest.raises(SpecValidationError, match="not UTF-8") as caught:
        load_yaml_file(path)
    assert str(path) in str(caught.value)
