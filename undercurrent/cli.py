"""The ``undercurrent`` command.

Each subcommand is one ``_add_<name>_command(subparsers)`` function that declares
its arguments and sets ``handler`` to a function ``(args) -> exit code``. To add a
command, write those two functions and list the first in ``COMMANDS``. Handlers
import heavy modules (torch, transformers, vllm) inside their body (through
the backends, which load them when a model is loaded), so ``undercurrent
validate`` and ``--help`` stay quick.

Exit codes: 0 success, 1 the command ran and found a failure (an invalid spec),
2 a usage error.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from undercurrent import __version__
from undercurrent.adapters.base import BackendError, SamplingParams, stop_strings
from undercurrent.adapters.model_inspection import format_report, inspect_model, starter_spec
from undercurrent.adapters.prompts import check_prompts
from undercurrent.api import ProbedModel
from undercurrent.capture_cli import (
    add_capture_command,
    attach_dash_values,
    check_backend_device,
    engine_logs_to_stderr,
    spec_deprecations_told,
)
from undercurrent.demo import add_demo_command
from undercurrent.errors import one_line
from undercurrent.notebook.storage import save_records
from undercurrent.paths import path_argument
from undercurrent.probes.registry import default_registry
from undercurrent.router.validation import probe_problems, raw_probe_problems
from undercurrent.spec import (
    SpecDeprecationWarning,
    SpecProblem,
    SpecValidationError,
    json_schema,
    load_yaml_file,
    to_yaml,
)
from undercurrent.spec.yaml_source import load_yaml_data, read_spec_file

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_DESCRIPTION = "Live activation probing of language models while they generate."
_EPILOG = """\
examples:
  undercurrent validate specs/*.yaml          check specs without loading a model
  undercurrent validate --strict --format json probes.yaml
  undercurrent schema > undercurrent-spec.schema.json
  undercurrent capture --spec probes.yaml --prompts prompts.jsonl --out acts/

exit codes: 0 success, 1 failure (e.g. an invalid spec), 2 usage error.
Run 'undercurrent COMMAND --help' for a command's options.
"""


# --- validate ---------------------------------------------------------------------------


def _add_validate_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check spec files without loading a model",
        description=(
            "Check one or more YAML spec files without loading a model: the spec itself, "
            "and each point's probe against the probe registry (built-in probe types, "
            "those installed packages publish, and those of --probes modules): its "
            "probe_type, probe_kind and probe_args names. Prints one line per file: "
            "'PATH: OK (N extraction points)' or every problem found. Exits 0 when all "
            "files are valid, 1 when any is invalid or unreadable, 2 on a usage error "
            "(including a --probes module that cannot be imported)."
        ),
    )
    parser.add_argument("specs", nargs="+", metavar="SPEC", type=path_argument,
                        help="YAML spec file(s)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="treat deprecation warnings (older key names such as 'layer') as errors",
    )
    parser.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="output format: one line per file (text, default) or a JSON list (json)",
    )
    _add_probes_option(parser)
    parser.set_defaults(handler=_run_validate)


def _add_probes_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--probes",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (a module or package name, or a .py file) so that the "
        "probe types it registers are known; repeat for several",
    )


def _probes_argument_problem(module: str) -> str | None:
    """What is wrong with a ``--probes`` argument that names a file that is not a
    ``.py`` file (it was imported as the dotted name ``probes.txt``: "No module
    named 'probes'"), or nothing at all, else None."""
    if not module:
        return "is empty; give a module name or a .py file"
    if not module.endswith(".py") and os.path.isfile(module):
        return ("is a file but not a .py file; a --probes file must end in .py (or give "
                "a module name)")
    return None


def _import_probe_modules(command: str, modules: Sequence[str]) -> int | None:
    """Import each ``--probes`` module (a name, or a path to a .py file); print one
    line and return the usage exit code for the first that fails, else None.

    A module name is looked up first in the current directory, as ``python -m``
    would; the directory is first on ``sys.path`` only for that import and then
    stays on it last (for the modules' later imports), so that a ``signal.py`` or
    ``queue.py`` there never stands in for the standard module torch imports."""
    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for module in modules:
        problem = _probes_argument_problem(module)
        if problem is not None:
            print(f"{command}: --probes {module!r} {problem}", file=sys.stderr)
            return EXIT_USAGE
        try:
            if module.endswith(".py"):
                path = Path(module)
                if not path.is_file():
                    raise FileNotFoundError(f"no such file: {module}")
                name = _probe_file_module_name(path)
                spec = importlib.util.spec_from_file_location(name, path)
                assert spec is not None and spec.loader is not None
                loaded = importlib.util.module_from_spec(spec)
                names = [name, *_probe_file_plain_name(path)]
                for each in names:  # (as an import would: pickle and dataclasses look)
                    sys.modules[each] = loaded
                try:
                    spec.loader.exec_module(loaded)
                except BaseException:
                    for each in names:  # (as a failed import leaves none behind)
                        sys.modules.pop(each, None)
                    raise
            else:
                imported = _import_from_cwd_first(module)
                spec = getattr(imported, "__spec__", None)
                if spec is not None and spec.submodule_search_locations is not None and (
                        spec.origin in (None, "namespace")):
                    sys.modules.pop(module, None)
                    print(f"{command}: --probes {module!r} is a folder without __init__.py "
                          "(a namespace package: nothing in it is imported, so no probe "
                          "type is registered); name a module, a package or a .py file",
                          file=sys.stderr)
                    return EXIT_USAGE
        # Any failure of user code is reported, not raised; so is a module that
        # exits when imported (a script's sys.exit or argparse), which would end
        # this command with its own code and no word on the specs.
        except (Exception, SystemExit) as error:
            print(f"{command}: cannot import --probes {module!r}: "
                  f"{type(error).__name__}: {one_line(str(error))}", file=sys.stderr)
            return EXIT_USAGE
    return None


def _import_from_cwd_first(module: str) -> Any:
    """``import module`` with the current directory first on ``sys.path``."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(cwd)  # (the first occurrence: the one inserted)


def _probe_file_module_name(path: Path) -> str:
    """The module name a ``--probes`` ``.py`` file is loaded under: its stem and a
    hash of its full path, so that a file named like another module (``signal.py``,
    ``queue.py``) does not take that module's place in ``sys.modules``."""
    digest = hashlib.sha1(str(path.resolve()).encode(), usedforsecurity=False).hexdigest()
    return f"undercurrent_probes_{path.stem}_{digest[:8]}"


def _probe_file_plain_name(path: Path) -> list[str]:
    """The plain name (its stem) a ``--probes`` ``.py`` file is also registered
    under, so that a later ``--probes`` file can import it (``from base_probes
    import CustomProbe``) as it could when both sat on ``sys.path``: none where the
    stem is not a module name, names a standard-library module (``signal.py``,
    ``queue.py``) or is already imported."""
    stem = path.stem
    if (not stem.isidentifier() or stem in sys.stdlib_module_names
            or stem in sys.modules):
        return []
    return [stem]


def _validate_one(path: str, strict: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "path": path,
        "valid": False,
        "extraction_points": None,
        "edits": None,
        "problems": [],
        "warnings": [],
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpecDeprecationWarning)
        try:
            spec = load_yaml_file(path)
        except SpecValidationError as error:
            # All at once: the spec's problems, and each point's probe checked
            # where its own fields allow (what a valid spec would be told next).
            report["problems"] = [_problem_dict(problem) for problem in error.problems]
            report["problems"] += _raw_probe_problems(path, error.problems)
            report["problems"].sort(key=_by_point)  # (stable: each point's in order)
            spec = None
    deprecations = [w.message for w in caught if isinstance(w.message, SpecDeprecationWarning)]
    notes = [_problem_dict(message.problem) for message in deprecations]
    if strict:
        suffix = " (an error under --strict)"
        report["problems"] += [
            {**note, "message": note["message"] + suffix, "text": note["text"] + suffix}
            for note in notes
        ]
    else:
        report["warnings"] = notes
    if spec is not None:
        report["problems"] += _probe_problems(spec)
    if spec is not None and not report["problems"]:
        report["valid"] = True
        report["extraction_points"] = len(spec)
        report["edits"] = len(spec.edits)
    return report


def _probe_problems(spec: Any) -> list[dict[str, Any]]:
    """Each point's probe checked against the probe registry (built-ins, entry
    points, ``--probes`` modules): its ``probe_type``, ``probe_kind`` and the
    names of its ``probe_args``. No probe is built (that needs its files)."""

    problems = []
    for index, point in enumerate(spec):
        _, faults = probe_problems(point, default_registry, point.probe_args)
        problems += [_problem_dict(SpecProblem(message, field, index, point.name))
                     for field, message in faults]
    return problems


def _raw_probe_problems(path: str, found: Sequence[SpecProblem]) -> list[dict[str, Any]]:
    """:func:`_probe_problems` of an invalid spec's points, read from its raw data:
    each point whose ``probe_type`` is a string the spec check did not fault has
    its probe checked (its ``probe_kind`` where that is valid, its ``probe_args``
    where they are a mapping the check did not fault). Nothing when the file is
    not readable YAML."""
    try:
        data = load_yaml_data(read_spec_file(path), path)
    except SpecValidationError:
        return []
    points = data.get("extraction_points") if isinstance(data, dict) else None
    problems: list[dict[str, Any]] = []
    for index, raw in enumerate(points if isinstance(points, list) else []):
        faulted = {problem.field for problem in found if problem.point_index == index
                   and problem.section == "extraction_points"}
        if not isinstance(raw, dict):
            continue
        name = raw.get("name") if isinstance(raw.get("name"), str) else None
        problems += [_problem_dict(SpecProblem(message, field, index, name))
                     for field, message in raw_probe_problems(raw, default_registry, faulted)]
    return problems


def _by_point(problem: dict[str, Any]) -> tuple[int, int]:
    """Sort key: the document's problems, then each point's, then each edit's."""
    index = problem["point_index"]
    return (0, 0) if index is None else (1 if problem["section"] != "edits" else 2, index)


def check_output_file(path: str, option: str, suffixes: Sequence[str]) -> None:
    """Refuse, before any work, an output file the command could not write: a
    directory, a missing folder, a suffix other than ``suffixes``, or a place
    the file cannot be created or written (a read-only folder or file)."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path!r} is a directory; give a file path")
    if not target.parent.is_dir():
        raise ValueError(f"{option} {path!r}: the folder {str(target.parent)!r} does not exist")
    if target.suffix.lower() not in suffixes:
        raise ValueError(f"{option} {path!r} must end in {' or '.join(suffixes)}")
    # (a symlink, dangling too, is written through: the file probed and removed
    # again is its target, and the link stays)
    written = Path(os.path.realpath(target))
    existed = written.exists()
    try:
        # Opened for append, an existing file keeps its contents; one made here
        # is removed again, so a later failure leaves nothing behind.
        with open(written, "ab"):
            pass
        if not existed:
            written.unlink()
    except OSError as error:
        raise ValueError(f"{option} {path!r} cannot be written: "
                         f"{error.strerror or error}") from None


def _problem_dict(problem: Any) -> dict[str, Any]:
    return {
        "message": problem.message,
        "field": problem.field,
        "point_index": problem.point_index,
        "point_name": problem.point_name,
        "section": getattr(problem, "section", "extraction_points"),
        "text": str(problem),
    }


def _run_validate(args: argparse.Namespace) -> int:
    failed_import = _import_probe_modules("validate", args.probes)
    if failed_import is not None:
        return failed_import
    reports = [_validate_one(path, args.strict) for path in args.specs]
    if args.format == "json":
        print(json.dumps(reports, indent=2))
    else:
        for report in reports:
            print(_report_line(report))
            for note in report["warnings"]:
                print(f"{report['path']}: warning: {note['text']}", file=sys.stderr)
    return EXIT_OK if all(report["valid"] for report in reports) else EXIT_FAILURE


def _report_line(report: dict[str, Any]) -> str:
    if report["valid"]:
        count = report["extraction_points"]
        noun = "extraction point" if count == 1 else "extraction points"
        edits = report.get("edits") or 0
        more = f", {edits} edit{'' if edits == 1 else 's'}" if edits else ""
        return f"{report['path']}: OK ({count} {noun}{more})"
    problems = report["problems"]
    label = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
    # One line per file: fold any multi-line text.
    texts = " ".join("; ".join(problem["text"] for problem in problems).split())
    return f"{report['path']}: INVALID ({label}): {texts}"


# --- schema -----------------------------------------------------------------------------


def _add_schema_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "schema",
        help="print the JSON Schema of spec files (for editors)",
        description=(
            "Print the JSON Schema of undercurrent spec files. Point your editor's "
            "YAML language server at it for completion, hover docs and checks."
        ),
    )
    parser.add_argument(
        "--indent", type=_indent, default=2,
        help="JSON indentation, 0 to 8 (default 2; 0 for compact)"
    )
    parser.set_defaults(handler=_run_schema)


def _indent(text: str) -> int:
    """``--indent``: an int from 0 to 8 (argparse's usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 8:
        raise argparse.ArgumentTypeError(f"must be from 0 to 8, got {value}")
    return value


def _run_schema(args: argparse.Namespace) -> int:
    try:
        print(json.dumps(json_schema(), indent=args.indent or None), flush=True)
    except OSError as error:  # (a full disk, a closed pipe)
        print(f"schema: cannot write the schema: {error.strerror or error}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


# --- inspect-model ------------------------------------------------------------------------


def _add_inspect_model_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect-model",
        help="show layers and capturable tensor types of a model",
        description=(
            "Show a model's layer count, sizes and, for each backend, which tensor types "
            "can be captured at which layer indices. Reads the config only: the HF model "
            "is built on the meta device, without weights."
        ),
    )
    parser.add_argument("model", metavar="MODEL", type=path_argument,
                        help="local path, hub id, or 'tiny'")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--emit-spec", metavar="FILE", type=path_argument,
                        help="write a starter spec to FILE")
    parser.set_defaults(handler=_run_inspect_model)


def _run_inspect_model(args: argparse.Namespace) -> int:
    if args.emit_spec:
        try:
            check_output_file(args.emit_spec, "--emit-spec", (".yaml", ".yml"))
        except ValueError as error:
            print(f"inspect-model: {error}", file=sys.stderr)
            return EXIT_USAGE
    try:
        report = inspect_model(args.model)
    except (OSError, ValueError) as error:
        print(f"inspect-model: cannot read {args.model!r}: {one_line(error)}", file=sys.stderr)
        return EXIT_FAILURE
    problem = report["backends"].get("hf", {}).get("error")
    if args.emit_spec and problem is None:  # (no starter spec for a model it cannot run)
        try:
            with open(args.emit_spec, "w", encoding="utf-8") as handle:
                handle.write(to_yaml(starter_spec(int(report["num_layers"]))))
        except OSError as error:
            print(f"inspect-model: cannot write --emit-spec {args.emit_spec!r}: "
                  f"{error.strerror or error}", file=sys.stderr)
            return EXIT_FAILURE
        report["emitted_spec"] = args.emit_spec
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if args.emit_spec and problem is None:
            print(f"starter spec written to {args.emit_spec}")
    if problem is not None:
        print(f"inspect-model: {args.model!r} cannot be run by the hf backend: "
              f"{one_line(problem)}" + ("; no starter spec written" if args.emit_spec else ""),
              file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


# --- run ----------------------------------------------------------------------------------


def _add_run_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="generate with probes and print each prompt's text and verdicts",
        description="Load MODEL, attach the probes of SPEC, generate for each --prompt.",
    )
    parser.add_argument("spec", metavar="SPEC", type=path_argument, help="YAML spec file")
    parser.add_argument("--model", required=True, type=path_argument,
                        help="local path, hub id, or 'tiny'")
    parser.add_argument("--prompt", action="append", required=True, dest="prompts",
                        metavar="TEXT", help="a prompt (repeat for several)")
    parser.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string")
    parser.add_argument("--records", metavar="FILE.parquet", type=path_argument,
                        help="save the captured records (needs the notebook extra)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    _add_probes_option(parser)
    parser.set_defaults(handler=_run_run)


def _json_ready(value: Any) -> Any:
    """``value`` as strict JSON data: numpy scalars and arrays as numbers and
    lists, NaN and infinities as null (which JSON has no word for), anything
    else that is not JSON as its text."""
    if isinstance(value, Mapping):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(item) for item in value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return _json_ready(value.tolist())  # (a numpy scalar's tolist is its item)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def _run_run(args: argparse.Namespace) -> int:
    engine_logs_to_stderr(args.backend)  # (before a --probes module could import vLLM)
    failed_import = _import_probe_modules("run", args.probes)
    if failed_import is not None:
        return failed_import

    if args.records:
        missing = [name for name in ("pandas", "pyarrow")
                   if importlib.util.find_spec(name) is None]
        if missing:
            print(f"run: --records needs pandas and pyarrow ({', '.join(missing)} missing); "
                  "install them with pip install 'undercurrent[notebook]'", file=sys.stderr)
            return EXIT_USAGE
    # Bad option values are exit 2, found before the model loads.
    try:
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed, stop=stop_strings(args.stop))
        check_prompts(args.prompts)
        check_backend_device(args.backend, args.device)
        if args.records:
            check_output_file(args.records, "--records", (".parquet",))
    except (ValueError, TypeError, BackendError) as error:
        print(f"run: {one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    # What a user can get wrong (the spec, its probes, the model, the options) is
    # one message and exit 1; a traceback is left for real bugs. ValueError covers
    # SpecValidationError, CapabilityError, RouterError and ProbeFileError.
    user_errors = (ValueError, OSError, BackendError)
    try:
        with spec_deprecations_told("run"):
            model = ProbedModel.from_pretrained(args.model, spec=args.spec,
                                                backend=args.backend, device=args.device)
    except user_errors as error:
        print(f"run: {one_line(error)}", file=sys.stderr)
        return EXIT_FAILURE
    with model:
        try:
            outputs = model.generate(args.prompts, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, seed=args.seed,
                                     stop=args.stop, records=bool(args.records))
        except user_errors as error:
            print(f"run: {one_line(error)}", file=sys.stderr)
            return EXIT_FAILURE
    if args.format == "json":
        print(json.dumps(_json_ready([output.summary() for output in outputs]), indent=2,
                         allow_nan=False))
    else:
        for output in outputs:
            print(f"--- {output.prompt!r}")
            print(f"text: {output.text!r} ({output.finish_reason}, "
                  f"{len(output.token_ids)} tokens)")
            if output.abort is not None:
                print(f"aborted by {output.abort.extraction_point_name!r} at token "
                      f"{output.abort.token_index} (layer {output.abort.layer})")
            for name, result in output.results.items():
                note = f"  error: {result.error}" if result.error else ""
                print(f"  {name}: {result.verdict!r}{note}")
                if result.stats.dropped:
                    print(f"  {name}: dropped {result.stats.dropped} of "
                          f"{result.stats.received} records (its async queue was full); "
                          f"the verdict saw the {result.stats.processed} processed")
    if args.records:
        try:
            path = save_records(outputs, args.records,
                                tokenizer=getattr(model.backend, "tokenizer", None))
        except OSError as error:  # (checked before the model loaded, but it may change)
            print(f"run: cannot write --records {args.records!r}: "
                  f"{error.strerror or one_line(error)}", file=sys.stderr)
            return EXIT_FAILURE
        count = sum(len(output.records or ()) for output in outputs)
        print(f"{count} records saved to {path}", file=sys.stderr)
    return EXIT_OK


# --- wiring -----------------------------------------------------------------------------

COMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_validate_command,
    _add_schema_command,
    _add_inspect_model_command,
    _add_run_command,
    add_demo_command,  # undercurrent.demo imports torch only when the demo runs
    add_capture_command,
)
"""Each adds one subcommand; their order is the order ``--help`` lists them in."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""

    parser = argparse.ArgumentParser(
        prog="undercurrent",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"undercurrent {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 usage error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(attach_dash_values(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_request:  # argparse exits on --help, --version and errors
        code = exit_request.code
        return code if isinstance(code, int) else EXIT_USAGE
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        result: int = handler(args)
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_FAILURE
    return result


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
