"""The error family: every refusal that lists problems derives from one base.

:class:`~undercurrent.spec.SpecValidationError` (an invalid spec),
:class:`~undercurrent.router.RouterError` (a request the router refuses) and
:class:`~undercurrent.adapters.CapabilityError` (a point the loaded model cannot
serve) all derive from :class:`ProblemsError`, so one ``except ProblemsError``
catches any of them, and :meth:`ProblemsError.errors` lists their problems in the
shape of pydantic's ``ValidationError.errors()``. This module sits at the bottom
of the layers with :mod:`undercurrent.records`: it imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict


class ErrorDetail(TypedDict):
    """One problem, shaped like an entry of pydantic's ``errors()``.

    ``loc`` is the path to the value at fault (``("extraction_points", 0, "stride")``;
    empty when the problem has no location), ``msg`` says what is wrong, ``type``
    names the family (``"spec"``, ``"router"``, ``"capability"``).
    """

    loc: tuple[str | int, ...]
    msg: str
    type: str


class ProblemsError(ValueError):
    """Base of the errors that refuse something and list every problem found.

    Subclasses keep their own ``problems`` attribute (strings, or
    :class:`~undercurrent.spec.SpecProblem` for specs); :meth:`errors` gives the
    same problems as :class:`ErrorDetail` dicts whatever the subclass.
    """

    #: The ``type`` of every detail this error reports.
    error_type = "value_error"

    def __init__(self, message: str, details: Sequence[ErrorDetail] = ()) -> None:
        super().__init__(message)
        self._details: list[ErrorDetail] = list(details)

    def errors(self) -> list[ErrorDetail]:
        """Every problem as ``{"loc": ..., "msg": ..., "type": ...}`` (a fresh list)."""
        return [ErrorDetail(loc=d["loc"], msg=d["msg"], type=d["type"]) for d in self._details]


def plain_details(problems: Sequence[object], error_type: str) -> list[ErrorDetail]:
    """Details for problems that carry no location: ``msg`` is each one's text."""
    return [ErrorDetail(loc=(), msg=str(problem), type=error_type) for problem in problems]


def one_line(error: BaseException | str) -> str:
    """An error's message on one line, as the command line prints it: several
    problems (one per line under "2 problems:") joined by "; "."""
    lines = [line.strip().removeprefix("- ") for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} " + "; ".join(lines[1:])
    return "; ".join(lines)
