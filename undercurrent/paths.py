"""Paths a user gives (a file to save or load, a store, a spec): read one way everywhere.

A leading ``~`` is expanded at every public entry point, so what one call writes
to ``"~/x"`` the next reads back from the same string (``Path`` leaves ``~`` as a
folder name, pyarrow expands it, and the two disagreed). An empty path is
refused naming the argument: ``Path("")`` is the working directory, where an
empty argument would write, or read, silently. Like :mod:`undercurrent.arguments`
this module sits at the bottom of the layers: it imports nothing of the package.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path
from typing import Any

PACKAGE_PREFIX = "undercurrent:"
"""A path starting so names a file shipped inside the package, wherever it is
installed: ``undercurrent:models/tiny/probe.safetensors`` (the bundled probe),
``undercurrent:models/demo.yaml`` (the demo's spec)."""


def user_path(value: Any, argument: str, *, what: str = "a path") -> Path:
    """``value`` (a ``str`` or ``os.PathLike``) as a ``Path`` with ``~`` expanded; a
    ``ValueError`` naming ``argument`` when it is empty, a ``TypeError`` when it is
    not a path.

    >>> user_path("~/x.parquet", "path") == Path.home() / "x.parquet"
    True
    """
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{argument} must be a path (a str or os.PathLike), got "
                        f"{type(value).__name__} ({value!r:.40})")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{argument} must be a text path, got {type(text).__name__} "
                        f"({text!r:.40})")
    if not text:
        raise ValueError(f"{argument} is an empty path; give {what}")
    return Path(os.path.expanduser(text))


def path_argument(text: str) -> str:
    """An argparse ``type`` for a command-line path: refuses an empty one (argparse
    names the option: "argument --out: an empty path ...") and expands ``~`` (the
    shell does not in ``--out=~/x``)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a path")
    return os.path.expanduser(text)


def shipped_or_user_path(value: str | os.PathLike[str], *, resolve: bool = False) -> Path:
    """A file a spec or a call names: ``undercurrent:REL`` is ``REL`` inside the
    package (see :data:`PACKAGE_PREFIX`; resolved once); anything else an ordinary
    path, ``~`` expanded (and resolved when ``resolve``)."""
    text = os.fspath(value)
    if isinstance(text, str) and text.startswith(PACKAGE_PREFIX):
        return package_file(text[len(PACKAGE_PREFIX):])
    path = Path(os.path.expanduser(text))
    return path.resolve() if resolve else path


@functools.lru_cache(maxsize=64)
def package_file(relative: str) -> Path:
    """A file shipped inside the package, resolved once (the package does not move)."""
    return (Path(__file__).resolve().parent / relative).resolve()
