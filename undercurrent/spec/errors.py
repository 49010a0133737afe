"""The one error type every invalid spec raises."""

from __future__ import annotations

from dataclasses import dataclass

from undercurrent.errors import ErrorDetail, ProblemsError


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a spec.

    ``point_index``/``point_name`` locate the extraction point or edit (both
    ``None`` for problems at the top level of the file); ``section`` says which
    list the index counts in (``extraction_points`` or ``edits``); ``field`` names
    the key at fault.
    """

    message: str
    field: str | None = None
    point_index: int | None = None
    point_name: str | None = None
    section: str = "extraction_points"

    def location(self) -> str:
        """Where the problem is: ``extraction_points[0] (name 'p'), field 'layers'``
        (or ``edits[0] (name 'e'), field 'vector'``)."""
        parts: list[str] = []
        if self.point_index is not None:
            where = f"{self.section}[{self.point_index}]"
            if self.point_name:
                where += f" (name {self.point_name!r})"
            parts.append(where)
        elif self.point_name:  # (a hand-built point or edit: in no list)
            kind = "edit" if self.section == "edits" else "extraction point"
            parts.append(f"{kind} {self.point_name!r}")
        if self.field:
            parts.append(f"field {self.field!r}")
        return ", ".join(parts) if parts else "spec"

    def detail(self, error_type: str = "spec") -> ErrorDetail:
        """This problem shaped like a pydantic ``errors()`` entry:
        ``loc`` is ``("extraction_points", index, *field path)`` (``"edits"`` for an
        edit)."""
        loc: list[str | int] = []
        if self.point_index is not None:
            loc += [self.section, self.point_index]
        if self.field:
            loc += self.field.split(".")
        return ErrorDetail(loc=tuple(loc), msg=self.message, type=error_type)

    def __str__(self) -> str:
        if self.point_index is None and not self.field and not self.point_name:
            return self.message  # a problem with the document as a whole
        return f"{self.location()}: {self.message}"


class SpecValidationError(ProblemsError):
    """An invalid spec. ``problems`` lists every problem found, not only the first.

    The message names, for each problem, the extraction point (by index and name)
    and the field at fault; :meth:`errors` gives them as pydantic-shaped dicts.
    """

    error_type = "spec"

    def __init__(
        self,
        problems: list[SpecProblem] | str,
        *,
        source: str | None = None,
    ) -> None:
        if isinstance(problems, str):
            problems = [SpecProblem(problems)]
        self.problems: list[SpecProblem] = list(problems)
        self.source = source
        super().__init__(self._render(), [p.detail(self.error_type) for p in self.problems])

    def _render(self) -> str:
        where = f" in {self.source}" if self.source else ""
        count = len(self.problems)
        if count == 1:
            return f"invalid spec{where}: {self.problems[0]}"
        lines = [f"invalid spec{where}: {count} problems"]
        lines += [f"  - {problem}" for problem in self.problems]
        return "\n".join(lines)

    def one_line(self) -> str:
        """The message folded onto a single line (for CLI output)."""
        return "; ".join(str(problem) for problem in self.problems)
