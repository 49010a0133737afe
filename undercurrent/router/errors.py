"""Router errors and the overflow policy vocabulary."""

from __future__ import annotations

import enum


class RouterError(ValueError):
    """A request the router refuses (bad points, duplicate id, unknown request).

    ``problems`` lists every problem found, each naming the extraction point.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems: list[str] = list(problems or [])
        if self.problems:
            if len(self.problems) == 1:
                message = f"{message}: {self.problems[0]}"
            else:
                lines = "\n".join(f"  - {problem}" for problem in self.problems)
                message = f"{message}: {len(self.problems)} problems\n{lines}"
        super().__init__(message)


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
