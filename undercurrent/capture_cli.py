"""``undercurrent capture``: write a prompt file's generations to an activation store."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from undercurrent.adapters.arguments import check_device
from undercurrent.adapters.base import BackendError, backend_class
from undercurrent.adapters.prompts import refuse_lone_surrogates
from undercurrent.api import ProbedModel
from undercurrent.errors import one_line
from undercurrent.paths import path_argument
from undercurrent.spec import SpecDeprecationWarning
from undercurrent.store.capture import (
    capture_settings,
    check_out_dir,
    check_point_reductions,
)
from undercurrent.store.format import MANIFEST, StoreError, StoreExistsError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # (128 + SIGINT, as a shell reports a command stopped by Ctrl-C)


def add_capture_command(subparsers: Any) -> None:
    """Register ``capture`` (its handler imports torch only when it runs)."""
    parser = subparsers.add_parser(
        "capture",
        help="generate over a prompt file and store every captured activation",
        description=(
            "Load MODEL, attach the points of SPEC, generate for every prompt of PROMPTS "
            "and write every captured vector to the activation store OUT (see "
            "docs/store.md). A killed run started again continues where it stopped. With "
            "--shard i/N, N processes (or machines sharing a filesystem) each capture a "
            "disjoint part of the prompts into the same OUT."),
    )
    parser.add_argument("--spec", required=True, type=path_argument, help="YAML spec file")
    parser.add_argument("--prompts", required=True, metavar="FILE", type=path_argument,
                        help="prompts: .txt (one per line) or .jsonl (a string, or an object "
                             "with a 'prompt' key, per line)")
    parser.add_argument("--out", required=True, metavar="DIR", type=path_argument,
                        help="store directory")
    parser.add_argument("--model", default="tiny", type=path_argument,
                        help="local path, hub id, or 'tiny'")
    parser.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1")
    parser.add_argument("--shard", default=None, metavar="i/N",
                        help="capture part i (0-based) of N disjoint parts of the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--storage-dtype", default=None,
                        choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--reduce", action="append", default=[], metavar="POINT=REDUCTION",
                        help="e.g. resid=last_token, resid=mean_generated, resid=project:64 "
                             "(once per point; combine with '+': resid=mean_generated+project:64)")
    parser.add_argument("--no-resume", action="store_true",
                        help="refuse a directory that already holds this part's shards")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_capture)


@contextlib.contextmanager
def spec_deprecations_told(command: str) -> Iterator[None]:
    """Print each :class:`SpecDeprecationWarning` raised inside (a spec loaded
    with older key names) as one ``<command>: warning: ...`` line on stderr, as
    ``validate`` reports them; other warnings go on as they would."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpecDeprecationWarning)
        try:
            yield
        finally:
            told = [w for w in caught if isinstance(w.message, SpecDeprecationWarning)]
            others = [w for w in caught if not isinstance(w.message, SpecDeprecationWarning)]
    for warning in told:
        print(f"{command}: warning: {one_line(warning.message)}", file=sys.stderr)
    for warning in others:
        warnings.warn_explicit(warning.message, warning.category, warning.filename,
                               warning.lineno)


def engine_logs_to_stderr(backend: str) -> None:
    """Send vLLM's own log lines to stderr, for a command about to load the vllm
    backend: vLLM logs to stdout unless told otherwise, which mixes its INFO
    lines into the command's output (``--format json`` then does not parse).
    vLLM reads ``VLLM_LOGGING_STREAM`` once, when it is first imported, so this
    runs before anything imports it; a stream the user set is kept."""
    if backend == "vllm":
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def check_backend_device(backend: str, device: str | None) -> None:
    """Refuse, before the model loads, a ``--device`` the backend cannot run on: one
    torch does not know (without importing vLLM) or, for vllm, one other than the
    device the installed vLLM build targets (a ``BackendError``)."""
    check_device(device)
    if backend == "vllm" and device is not None:
        # (vLLM installed first: the device check imports it, and a missing vLLM is
        # the one line naming the extra, as without --device)
        backend_class(backend)
        from undercurrent.adapters.vllm.backend import check_engine_device

        check_engine_device(device)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a ``.txt`` (one per non-empty line) or ``.jsonl`` file. Lines
    end at a newline alone (``\n``, ``\r\n`` or ``\r``): other characters Python
    counts as line breaks (U+2028, form feed, ...) stay in their prompt, as in a
    JSON string; a UTF-8 byte order mark before the first line is dropped."""
    source = Path(path)
    suffix = source.suffix.lower()  # (as --records and --emit-spec take any case)
    if suffix not in (".txt", ".jsonl"):
        raise ValueError(f"{str(source)!r}: prompts must be a .txt or .jsonl file")
    try:
        text = source.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        at = error.object[:error.start].count(b"\n") + 1
        raise ValueError(f"{source}:{at}: not UTF-8 text (byte {error.object[error.start]:#04x}"
                         f" at byte {error.start} of the file); save the prompts as UTF-8"
                         ) from None
    prompts = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if suffix == ".txt":
            prompts.append(line)
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}:{number}: not JSON ({error.msg})") from None
        if isinstance(item, dict):
            item = item.get("prompt")
        if not isinstance(item, str):
            raise ValueError(f"{source}:{number}: expected a JSON string or an object with a "
                             "string 'prompt'")
        refuse_lone_surrogates(item, f"{source}:{number}: the prompt")  # (a "\udcff" escape)
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{source}: no prompts in this file (it is empty or blank); a "
                         f"{suffix} prompts file needs at least one prompt")
    return prompts


def attach_dash_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--shard -1/3`` written ``--shard=-1/3``: argparse takes a
    value that starts with '-' and is not a plain negative number for the next
    option ("expected one argument"); attached, it reaches the check that says
    what a part must be."""
    out = list(argv)
    for at in range(len(out) - 2, -1, -1):
        if out[at] == "--shard" and out[at + 1][:2] != "--" and out[at + 1].startswith("-"):
            out[at:at + 2] = [f"--shard={out[at + 1]}"]
    return out


def _reductions(items: list[str]) -> dict[str, str]:
    """``{point: reduction}`` from the ``--reduce POINT=REDUCTION`` items; a point
    given twice is refused (the last would win silently)."""
    found: dict[str, str] = {}
    for item in items:
        point, sep, reduction = item.partition("=")
        if not sep or not point or not reduction:
            raise ValueError(f"--reduce {item!r}: use POINT=REDUCTION, e.g. resid=last_token")
        if point in found:
            raise ValueError(
                f"--reduce gives point {point!r} twice ({point}={found[point]} and "
                f"{item}); give each point once, combining reductions with '+' (e.g. "
                f"{point}=mean_generated+project:64)")
        found[point] = reduction
    return found


def run_capture(args: argparse.Namespace) -> int:
    """The ``capture`` command: its exit code. Ctrl-C is one line and exit 130:
    every shard committed before it stays (the capture's own guarantee), and the
    same command resumes."""
    try:
        return _capture(args)
    except KeyboardInterrupt:
        print(f"capture: interrupted after {_stored_prompts(Path(args.out))}; run the "
              "same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


def _stored_prompts(out: Path) -> str:
    """How many prompts the store at ``out`` holds, in words (``"12 of 300 prompts
    stored"``; none when the capture left no store)."""
    from undercurrent.store.reader import open_activations

    if not (out / MANIFEST).is_file():
        return "0 prompts stored"
    try:
        store = open_activations(out)
    except (StoreError, OSError, ValueError) as error:
        return f"an unreadable store ({one_line(error)})"
    return f"{store.n_prompts} of {store.manifest['prompts']['count']} prompts stored"


def _capture(args: argparse.Namespace) -> int:
    engine_logs_to_stderr(args.backend)
    # Bad argument values are exit 2 and are caught before the model loads; what is
    # left for model.capture to refuse is the spec, the model or the store (exit 1).
    try:
        prompts = read_prompts(args.prompts)
        reductions = _reductions(args.reduce)
        check_out_dir(args.out, "--out")
        capture_settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         seed=args.seed, batch_size=args.batch_size,
                         storage_dtype=args.storage_dtype, reduce=reductions, shard=args.shard)
        check_backend_device(args.backend, args.device)
    except (OSError, ValueError, TypeError, BackendError) as error:
        print(f"capture: {one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    # What a user can get wrong in the spec, its probes, the model or the store is
    # one message and exit 1 (ValueError covers SpecValidationError,
    # CapabilityError, RouterError and ProbeFileError), as for `run`.
    user_errors = (ValueError, OSError, BackendError, StoreError)
    try:
        with spec_deprecations_told("capture"):
            model = ProbedModel.from_pretrained(args.model, spec=args.spec,
                                                backend=args.backend, device=args.device)
    except user_errors as error:
        print(f"capture: {one_line(error)}", file=sys.stderr)
        return EXIT_FAILURE
    with model:
        try:
            # Only the spec knows its point names and positions: --reduce naming
            # another, or asking what would store nothing, is still a bad argument.
            check_point_reductions(model.points, reductions, model.backend.capabilities())
        except ValueError as error:
            print(f"capture: {one_line(error)}", file=sys.stderr)
            return EXIT_USAGE
        try:
            summary = model.capture(
                prompts, args.out, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, seed=args.seed, batch_size=args.batch_size,
                storage_dtype=args.storage_dtype, resume=not args.no_resume,
                progress=not args.no_progress, reduce=reductions, shard=args.shard)
        except user_errors as error:
            if isinstance(error, StoreExistsError):  # (in the CLI's terms)
                error = error.advised("drop --no-resume",
                                      "give --out an empty or new directory")
            print(f"capture: {one_line(error)}", file=sys.stderr)
            return EXIT_FAILURE
    print(f"{summary.requests} prompts ({summary.skipped} already done), {summary.vectors} "
          f"vectors, {summary.bytes / 2**20:.1f} MiB written to {summary.path} in "
          f"{summary.seconds:.1f} s")
    return EXIT_OK
