"""Router errors and the overflow policy vocabulary."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from undercurrent.errors import ProblemsError, plain_details
from undercurrent.spec.errors import SpecProblem


class RouterError(ProblemsError):
    """A request the router refuses (bad points, duplicate id, unknown request).

    ``problems`` lists every problem found (as text), each naming the extraction
    point the way :class:`~undercurrent.spec.SpecValidationError` does; a point that
    breaks a spec rule gets exactly the spec's message. :meth:`errors` gives them
    as pydantic-shaped dicts.
    """

    error_type = "router"

    def __init__(
        self, message: str, problems: Sequence[str | SpecProblem] | None = None
    ) -> None:
        found = list(problems or [])
        self.problems: list[str] = [str(problem) for problem in found]
        details = [
            problem.detail(self.error_type)
            if isinstance(problem, SpecProblem)
            else plain_details([problem], self.error_type)[0]
            for problem in found
        ]
        if self.problems:
            if len(self.problems) == 1:
                message = f"{message}: {self.problems[0]}"
            else:
                lines = "\n".join(f"  - {problem}" for problem in self.problems)
                message = f"{message}: {len(self.problems)} problems\n{lines}"
        super().__init__(message, details)


class OverflowPolicy(str, enum.Enum):
    """What an async queue does when a record arrives and it is full.

    ``drop_oldest`` (default) evicts the oldest queued record, ``drop_newest``
    discards the arriving one, ``block`` makes the caller (the generation
    thread) wait until the binding's worker takes a record off the queue (as
    long as the probe takes; docs/router.md says why it never deadlocks). Every
    discarded record is counted in ``dropped``.
    """

    DROP_OLDEST = "drop_oldest"
    DROP_NEWEST = "drop_newest"
    BLOCK = "block"

    @classmethod
    def parse(cls, value: object) -> OverflowPolicy:
        """An OverflowPolicy from itself or its string value, else ValueError."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(policy.value for policy in cls)
            raise ValueError(f"overflow policy must be one of {allowed}, got {value!r}") from None
