"""Reading spec text into plain data, safely and within bounds.

Only PyYAML's safe loader family is used. On top of it, :class:`BoundedSafeLoader`
rejects duplicate mapping keys (YAML allows them silently; a spec with two
``layers`` keys is almost certainly a mistake) and refuses documents that nest
too deeply or whose aliases expand to a huge number of nodes (the "billion
laughs" attack), so a spec can never exhaust memory or the interpreter stack.

Every failure becomes a :class:`SpecValidationError`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.error import Mark, MarkedYAMLError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from undercurrent.paths import shipped_or_user_path
from undercurrent.spec.errors import SpecProblem, SpecValidationError

MAX_DEPTH = 100
"""Deepest nesting of collections a spec document may have (after alias expansion)."""

MAX_EXPANDED_NODES = 1_000_000
"""Most YAML nodes a document may contain once every alias is expanded."""

MAX_SPEC_BYTES = 1 << 18
"""Largest spec accepted, in bytes of UTF-8 (256 KiB; real specs are a few KiB).
PyYAML's safe loader is pure Python, so this also bounds the time a parse takes."""

_MERGE_TAG = "tag:yaml.org,2002:merge"


class SpecLimitError(MarkedYAMLError):
    """A document that breaks one of the size or nesting bounds."""


_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_SURPRISING_NUMBER_TAG = "tag:undercurrent,2026:surprising-number"
"""What a plain number YAML 1.1 reads unlike a person resolves to: an octal
(``010`` is 8) or a base-60 number (``5:20`` is 320, ``1:30`` is 90)."""

_OCTAL = re.compile(r"[-+]?0[0-7_]+$")


class BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects duplicate keys, deep nesting, alias bombs
    and the numbers YAML 1.1 reads unlike a person (octal and base 60)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        # Bound nesting while composing, before PyYAML's own recursion gets deep.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise SpecLimitError(
                    problem=f"the document nests deeper than {MAX_DEPTH} levels",
                    problem_mark=self.peek_event().start_mark,  # type: ignore[no-untyped-call]
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Node | None:
        node = super().get_single_node()
        if node is not None:
            _measure_expansion(node, {}, set())
        return node

    def resolve(self, kind: type[Node], value: Any, implicit: tuple[bool, bool]) -> str:
        tag: str = super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
        if (kind is ScalarNode and implicit[0] and tag in (_INT_TAG, _FLOAT_TAG)
                and (":" in value or (tag == _INT_TAG and _OCTAL.match(value)))):
            return _SURPRISING_NUMBER_TAG
        return tag

    def construct_surprising_number(self, node: ScalarNode) -> Any:
        """Refuse a plain octal or base-60 number, naming what YAML 1.1 reads."""
        text = str(node.value)
        if ":" in text:
            read = (self.construct_yaml_int(node) if "." not in text
                    else self.construct_yaml_float(node))
            problem = (f"{text} is a base-60 number in YAML 1.1 (it reads as {read}); "
                       "quote it if you meant text")
        else:
            problem = (f"{text} has a leading zero, which YAML 1.1 reads as the octal "
                       f"number {self.construct_yaml_int(node)}; write it without the "
                       "leading zero, or quote it if you meant text")
        raise ConstructorError(None, None, problem, node.start_mark)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        # A tagged scalar PyYAML cannot read (``!!bool 8``, ``!!int ''``,
        # ``!!timestamp abc``) fails inside its constructors with whatever Python
        # error the conversion raises: each becomes a YAML error at the node.
        try:
            return super().construct_object(node, deep=deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as error:  # noqa: BLE001 - any conversion failure, reported
            tag = node.tag.rsplit(":", 1)[-1]
            value = node.value if isinstance(node.value, str) else None
            shown = "" if value is None else f" {value[:40]!r}"
            detail = _conversion_error(error)
            raise ConstructorError(
                None, None,
                f"the value{shown} is not a valid !!{tag}" + (f" ({detail})" if detail else ""),
                node.start_mark,
            ) from None

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_seen: dict[Any, Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = first_seen.get(key)
            except TypeError:
                continue  # unhashable key: the base constructor reports it
            if earlier is not None:
                raise ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r} (first defined on line {earlier.line + 1}); "
                    "each key may appear only once",
                    key_node.start_mark,
                )
            first_seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


BoundedSafeLoader.add_constructor(_SURPRISING_NUMBER_TAG,
                                  BoundedSafeLoader.construct_surprising_number)


def _conversion_error(error: BaseException) -> str:
    """What a PyYAML constructor's own Python error says about a value: its
    message, or nothing where that is only PyYAML's internals (a ``KeyError``
    naming the value, an ``IndexError`` of an empty string)."""
    if isinstance(error, KeyError | IndexError | AttributeError):
        return ""
    return str(error)


def _measure_expansion(node: Node, memo: dict[int, tuple[int, int]], active: set[int]) -> int:
    """Count nodes and depth with every alias expanded; raise past the bounds.

    Aliased nodes are the same objects, so ``memo`` makes this linear in the size of
    the document however much the aliases multiply it. Anchors precede their
    aliases in document order, so the recursion only follows unmeasured nodes and
    is no deeper than the document itself (already bounded by ``compose_node``).
    """
    key = id(node)
    if key in memo:
        return memo[key][0]
    if key in active:
        raise SpecLimitError(
            problem="an alias refers to a node that contains it (a recursive structure)",
            problem_mark=node.start_mark,
        )
    children: list[Node] = []
    if isinstance(node, SequenceNode):
        children = list(node.value)
    elif isinstance(node, MappingNode):
        children = [part for pair in node.value for part in pair]
    active.add(key)
    count, depth = 1, 1
    for child in children:
        count += _measure_expansion(child, memo, active)
        depth = max(depth, 1 + memo[id(child)][1])
    active.discard(key)
    if count > MAX_EXPANDED_NODES:
        raise SpecLimitError(
            problem=f"the document expands to more than {MAX_EXPANDED_NODES} nodes "
            "once its aliases are resolved",
            problem_mark=node.start_mark,
        )
    if depth > MAX_DEPTH:
        raise SpecLimitError(
            problem=f"the document nests deeper than {MAX_DEPTH} levels "
            "once its aliases are resolved",
            problem_mark=node.start_mark,
        )
    memo[key] = (count, depth)
    return count


def _yaml_problem(error: yaml.YAMLError) -> SpecProblem:
    if isinstance(error, MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        problem = error.problem or error.context or "malformed YAML"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        message = f"YAML error at {where}{problem}"
    else:
        message = f"YAML error: {error}"
    if "'\\t'" in message:
        message += " (YAML indentation must use spaces, not tabs)"
    return SpecProblem(message)


def _too_large(source: str | None) -> SpecValidationError:
    return SpecValidationError(
        [SpecProblem(f"the spec is larger than 256 KiB ({MAX_SPEC_BYTES} bytes); real specs "
                     "are a few KiB, so check that this is the file you meant")],
        source=source,
    )


def decode_spec_bytes(data: bytes, source: str | None = None) -> str:
    """Decode spec bytes as UTF-8 (a leading byte-order mark is allowed)."""
    if len(data) > MAX_SPEC_BYTES:
        raise _too_large(source)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        bad = data[error.start : error.start + 1].hex()
        raise SpecValidationError(
            [SpecProblem(f"the spec is not UTF-8 text (byte 0x{bad} at offset {error.start})")],
            source=source,
        ) from None


def load_yaml_data(text: str | bytes, source: str | None = None) -> Any:
    """Parse one YAML document with :class:`BoundedSafeLoader` into plain data."""
    if isinstance(text, bytes | bytearray):
        text = decode_spec_bytes(bytes(text), source)
    if not isinstance(text, str):
        raise SpecValidationError(
            [SpecProblem(f"expected YAML text (str or bytes), got {type(text).__name__}")],
            source=source,
        )
    # A str is at most 4 UTF-8 bytes per character: only count bytes when it could matter.
    if len(text) * 4 > MAX_SPEC_BYTES and len(text.encode("utf-8", "surrogatepass")) > (
        MAX_SPEC_BYTES
    ):
        raise _too_large(source)
    try:
        return yaml.load(text, Loader=BoundedSafeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise SpecValidationError([_yaml_problem(error)], source=source) from None
    except RecursionError:
        raise SpecValidationError(
            [SpecProblem(f"the document nests too deeply (more than {MAX_DEPTH} levels)")],
            source=source,
        ) from None
    except Exception as error:  # noqa: BLE001 - the loader's contract: no raw error escapes
        # (every constructor failure is a YAML error at its node already; this is
        # the net for anything PyYAML raises outside one)
        raise SpecValidationError(
            [SpecProblem(f"YAML error: the document cannot be read ({type(error).__name__}: "
                         f"{error})")],
            source=source,
        ) from None


def read_spec_file(path: str | Path) -> str:
    """Read a spec file's text (``~`` expanded; ``undercurrent:REL`` a spec shipped
    inside the package, as ``undercurrent:models/demo.yaml``), turning every I/O or
    decoding failure into an error that names the path as given."""
    source = str(path)
    if not isinstance(path, str | Path):
        raise SpecValidationError(
            [SpecProblem(f"expected a file path (str or Path), got {type(path).__name__}")],
            source=source,
        )
    try:
        if not str(path):  # (Path("") is the working directory: "a directory")
            raise ValueError("an empty path; give a YAML file")
        with shipped_or_user_path(path).open("rb") as handle:
            data = handle.read(MAX_SPEC_BYTES + 1)  # never read a huge file whole
    except FileNotFoundError:
        reason = "no such file"
    except IsADirectoryError:
        reason = "it is a directory, not a file"
    except PermissionError:
        reason = "permission denied"
    except (OSError, ValueError) as error:
        reason = str(error) or type(error).__name__
    else:
        return decode_spec_bytes(data, source)
    raise SpecValidationError(
        [SpecProblem(f"cannot read spec file {source!r}: {reason}")], source=source
    )
