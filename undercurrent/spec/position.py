"""Token position selectors: the grammar of an extraction point's ``position``.

Accepted forms (whitespace around the whole string is stripped, none allowed inside):

- ``N`` (an int) or ``"N"``: absolute index in prompt + generated tokens, N >= 0
- ``prompt[i]``: prompt token i; negative i counts from the end of the prompt
- ``generated[i]``: generated token i, i >= 0
- either of the two above followed by a signed offset ``+k`` / ``-k``
  (``prompt[-1]+1`` is the same token as ``generated[0]``); ``prompt[i]-k`` with
  ``0 <= i < k`` is refused, since it is before token 0 for every prompt
- ``generated[*]``: every generated token
- ``generated[a:]``: generated tokens a, a+1, ... (a >= 0)
- ``generated[a:b]``: generated tokens a .. b-1 (0 <= a < b)

``[*]`` and the slices are *continuous*: they match many tokens, and only they
accept ``stride`` / ``until``.
"""

from __future__ import annotations

import enum
import numbers
import re
from dataclasses import dataclass

ACCEPTED_POSITION_FORMS = (
    "an int N >= 0 or the string \"N\" (absolute token index), "
    "'prompt[i]' (negative i counts from the end of the prompt), "
    "'generated[i]' (i >= 0), either of those with an offset like 'prompt[-1]+1', "
    "'generated[*]', 'generated[a:]', 'generated[a:b]' (0 <= a < b)"
)


class PositionKind(str, enum.Enum):
    """Which form a position selector was written in."""

    ABSOLUTE = "absolute"
    PROMPT = "prompt"
    GENERATED = "generated"
    GENERATED_ALL = "generated_all"
    GENERATED_SLICE = "generated_slice"


class PositionError(ValueError):
    """A position string that does not match the grammar (wrapped into
    ``SpecValidationError`` by the loaders)."""


@dataclass(frozen=True)
class PositionSelector:
    """A parsed position. Build one with :func:`parse_position`.

    ``index`` is N for absolute, i for ``prompt[i]``/``generated[i]``; ``offset`` is
    the signed ``+k``/``-k``; ``start``/``stop`` bound slices (``stop`` None = open).
    """

    kind: PositionKind
    index: int = 0
    offset: int = 0
    start: int = 0
    stop: int | None = None

    @property
    def is_continuous(self) -> bool:
        """True for ``generated[*]`` and slices: they match many tokens."""
        return self.kind in (PositionKind.GENERATED_ALL, PositionKind.GENERATED_SLICE)

    @property
    def prompt_only(self) -> bool:
        """True where no prompt length makes it select a generated token: a prompt
        token's selector whose offset stays in the prompt (``prompt[-1]``,
        ``prompt[0]``, ``generated[0]-1``; not ``prompt[-1]+1``, which is
        ``generated[0]``, nor ``prompt[2]+3``, past a short prompt's end)."""
        if self.kind is PositionKind.PROMPT:
            return self.index + self.offset < 0 if self.index < 0 else self.offset <= 0
        if self.kind is PositionKind.GENERATED:
            return self.index + self.offset < 0
        return False

    @property
    def can_select_prompt(self) -> bool:
        """True where some prompt length makes it select a prompt token: an absolute
        index, ``prompt[i]`` whose offset stays in the prompt of a long enough one
        (``prompt[-1]``, ``prompt[0]+2``, ``prompt[-3]+1``; not ``prompt[-1]+1``,
        which is always ``generated[0]``), ``generated[i]`` reaching back into it
        (``generated[0]-1``). Continuous selectors select generated tokens only."""
        if self.kind is PositionKind.ABSOLUTE:
            return True
        if self.kind is PositionKind.PROMPT:
            # (from the start: index + offset must not fall before token 0; from the
            # end: it must stay before the prompt's end)
            return self.index + self.offset >= 0 if self.index >= 0 else (
                self.index + self.offset < 0)
        if self.kind is PositionKind.GENERATED:
            return self.index + self.offset < 0
        return False

    def target_index(self, prompt_len: int) -> int | None:
        """The one absolute token index a single-token selector picks, or None when
        the selector is continuous or points outside the sequence."""
        if self.kind is PositionKind.ABSOLUTE:
            return self.index
        if self.kind is PositionKind.PROMPT:
            base = self.index if self.index >= 0 else prompt_len + self.index
            if not 0 <= base < prompt_len:
                return None
            target = base + self.offset
            return target if target >= 0 else None
        if self.kind is PositionKind.GENERATED:
            target = prompt_len + self.index + self.offset
            return target if target >= 0 else None
        return None

    def matches(
        self,
        token_index: int,
        is_generated: bool,
        prompt_len: int,
        generated_index: int | None = None,
        stride: int = 1,
    ) -> bool:
        """Whether the token at absolute ``token_index`` is selected.

        For continuous selectors ``stride`` keeps every Nth match, counted from the
        start of the selector (``generated[5:]`` with stride 2 keeps 5, 7, 9, ...).
        """
        if not self.is_continuous:
            return token_index == self.target_index(prompt_len)
        if not is_generated:
            return False
        g = generated_index if generated_index is not None else token_index - prompt_len
        if g < self.start or (self.stop is not None and g >= self.stop):
            return False
        return (g - self.start) % stride == 0

    def last_index(self, prompt_len: int) -> int | None:
        """The largest absolute index this selector can match, None if unbounded.
        Adapters use it to stop paying for a point once it can match nothing more."""
        if self.kind is PositionKind.GENERATED_ALL:
            return None
        if self.kind is PositionKind.GENERATED_SLICE:
            return None if self.stop is None else prompt_len + self.stop - 1
        target = self.target_index(prompt_len)
        return -1 if target is None else target

    def __str__(self) -> str:
        return str(format_position(self))


_SINGLE = re.compile(r"^(prompt|generated)\[(-?\d+)\]([+-]\d+)?$", re.ASCII)
_SLICE = re.compile(r"^generated\[(\d+):(\d*)\]$", re.ASCII)
_ABSOLUTE = re.compile(r"^\d+$", re.ASCII)


def parse_position(value: object) -> PositionSelector:
    """Parse a position (int or string) into a :class:`PositionSelector`.

    Raises :class:`PositionError` naming the accepted forms for anything else
    (including booleans, which YAML produces from ``yes``/``no``).

    >>> parse_position("prompt[-1]+1").target_index(prompt_len=4)
    4
    """
    if isinstance(value, PositionSelector):
        return value
    if isinstance(value, bool):
        raise PositionError(f"position {value!r} is a boolean; expected {ACCEPTED_POSITION_FORMS}")
    if isinstance(value, numbers.Integral):  # a numpy integer too (np.argmax's)
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise PositionError(
                f"absolute position {value} is negative; use 'prompt[{value}]' to count "
                f"from the end of the prompt (accepted: {ACCEPTED_POSITION_FORMS})"
            )
        return PositionSelector(PositionKind.ABSOLUTE, index=value)
    if not isinstance(value, str):
        raise PositionError(
            "position must be an int or a string, got "
            f"{'null' if value is None else type(value).__name__}; "
            f"expected {ACCEPTED_POSITION_FORMS}"
        )
    text = value.strip()
    if _ABSOLUTE.match(text):
        return PositionSelector(PositionKind.ABSOLUTE, index=int(text))
    if text == "generated[*]":
        return PositionSelector(PositionKind.GENERATED_ALL)
    single = _SINGLE.match(text)
    if single:
        where, index_text, offset_text = single.groups()
        index = int(index_text)
        offset = int(offset_text) if offset_text else 0
        if where == "generated":
            if index < 0:
                raise PositionError(
                    f"position {value!r}: generated[i] needs i >= 0 "
                    f"(accepted: {ACCEPTED_POSITION_FORMS})"
                )
            return PositionSelector(PositionKind.GENERATED, index=index, offset=offset)
        if 0 <= index < -offset:
            # (counted from the start, the offset goes back past token 0 for every
            # prompt: the point would capture nothing and the edit change nothing)
            raise PositionError(
                f"position {value!r} is before token 0 for every prompt (prompt token "
                f"{index} shifted back by {-offset}); prompt[i]-k needs k <= i when i >= 0 "
                f"(accepted: {ACCEPTED_POSITION_FORMS})"
            )
        return PositionSelector(PositionKind.PROMPT, index=index, offset=offset)
    sliced = _SLICE.match(text)
    if sliced:
        start = int(sliced.group(1))
        stop = int(sliced.group(2)) if sliced.group(2) else None
        if stop is not None and stop <= start:
            raise PositionError(
                f"position {value!r}: slice generated[a:b] needs a < b "
                f"(accepted: {ACCEPTED_POSITION_FORMS})"
            )
        return PositionSelector(PositionKind.GENERATED_SLICE, start=start, stop=stop)
    raise PositionError(f"position {value!r} is not valid; expected {ACCEPTED_POSITION_FORMS}")


def format_position(selector: PositionSelector) -> str | int:
    """The canonical spelling of a selector (what the serializer writes)."""
    kind = selector.kind
    if kind is PositionKind.ABSOLUTE:
        return selector.index
    if kind is PositionKind.GENERATED_ALL:
        return "generated[*]"
    if kind is PositionKind.GENERATED_SLICE:
        stop = "" if selector.stop is None else str(selector.stop)
        return f"generated[{selector.start}:{stop}]"
    offset = f"{selector.offset:+d}" if selector.offset else ""
    return f"{kind.value}[{selector.index}]{offset}"
