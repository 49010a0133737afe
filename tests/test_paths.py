"""A path a user gives is read one way at every public entry point: ``~`` is expanded
(what one call writes to ``"~/x"`` the next reads back from the same string) and an
empty path is refused naming the argument (``Path("")`` is the working directory)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from undercurrent.paths import path_argument, user_path


def test_user_path_expands_home_and_refuses_an_empty_path(home):
    assert user_path("~/a/b.parquet", "path") == home / "a" / "b.parquet"
    assert user_path(Path("rel"), "path") == Path("rel")
    with pytest.raises(ValueError, match=r"^out_dir is an empty path; give a store$"):
        user_path("", "out_dir", what="a store")
    with pytest.raises(TypeError, match="path must be a path .* got int"):
        user_path(3, "path")
    with pytest.raises(TypeError, match="path must be a path .* got bytes"):
        user_path(b"x", "path")


def test_path_argument_expands_home_and_refuses_an_empty_argument(home):
    assert path_argument("~/s.yaml") == str(home / "s.yaml")
    assert path_argument("tiny") == "tiny"
    with pytest.raises(argparse.ArgumentTypeError, match="an empty path"):
        path_argument("")


def test_a_tilde_naming_no_user_is_left_as_written(home, tmp_path, monkeypatch):
    # Path.expanduser() raises a bare RuntimeError ("Could not determine home
    # directory") for "~nosuchuser/..."; a folder so named in the working directory
    # was read before "~" was expanded, and a missing one was named in the message.
    from undercurrent.api import load_spec
    from undercurrent.paths import shipped_or_user_path

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "~undercurrent_no_such_user"
    folder.mkdir()
    (folder / "spec.yaml").write_text("extraction_points: []\n", encoding="utf-8")
    assert user_path("~undercurrent_no_such_user/x", "path") == Path(
        "~undercurrent_no_such_user/x")
    assert shipped_or_user_path("~undercurrent_no_such_user/x") == Path(
        "~undercurrent_no_such_user/x")
    assert len(load_spec("~undercurrent_no_such_user/spec.yaml")) == 0
    with pytest.raises(FileNotFoundError, match="'~undercurrent_no_such_user/missing.yaml' is "
                                                "not a file"):
        load_spec("~undercurrent_no_such_user/missing.yaml")
