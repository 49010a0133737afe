"""Item 1: bad specs and files. Every malformed input to ``undercurrent validate``
(and to the loaders under it) ends in exit code 1 with one line per file and no
traceback, in bounded time and memory. ``tests/spec`` already fuzzes the loaders
with hypothesis; this file adds the corpus of malformed files, the CLI-level
fuzz, and measured time and peak memory for the nastiest inputs in a fresh
process."""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from undercurrent.cli import main
from undercurrent.spec import SpecValidationError, load_yaml_file, parse_yaml
from undercurrent.spec.yaml_source import MAX_EXPANDED_NODES, MAX_SPEC_BYTES

VALID_POINT = {
    "name": "p",
    "layers": "[0, 1]",
    "tensor_type": "residual_stream",
    "position": "generated[*]",
    "stride": "1",
    "probe_type": "norm_probe",
    "probe_kind": "trajectory",
    "execution_mode": "async",
    "queue_depth": "8",
    "until": "generation_end",
    "probe_args": "{threshold: 2.0}",
}
VALID = "version: \"1\"\nextraction_points:\n" + "".join(
    ("  - " if i == 0 else "    ") + f"{key}: {value}\n"
    for i, (key, value) in enumerate(VALID_POINT.items()))

WRONG_VALUES = ["[]", "{}", "null", "true", "-3", "1.5", "'text'", "[[1]]", "{a: 1}",
                "99999999999999999999", ".nan", "2001-12-14", "!!binary aGk=", "''"]


VALID_SUBSTITUTIONS = {
    # Values of the right type for that field (a layer or stride this large is valid
    # in a spec; the backend refuses the layer at registration).
    ("name", "'text'"), ("probe_type", "'text'"), ("layers", "99999999999999999999"),
    ("stride", "99999999999999999999"), ("queue_depth", "99999999999999999999"),
    ("queue_depth", "null"), ("until", "null"), ("probe_args", "{}"), ("probe_args", "{a: 1}"),
}


def _point_with(key: str, value: str) -> str:
    lines = [f"{k}: {value if k == key else v}" for k, v in VALID_POINT.items()]
    return "extraction_points:\n  - " + "\n    ".join(lines) + "\n"


def _nested(depth: int, flow: bool) -> str:
    if flow:
        return "extraction_points: " + "[" * depth + "]" * depth + "\n"
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "v\n"


def _billion_laughs(levels: int = 9, fan: int = 10) -> str:
    lines = ["a0: &a0 [lol]"]
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * fan)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append(f"extraction_points: *a{levels}")
    return "\n".join(lines) + "\n"


def malformed_corpus() -> dict[str, bytes]:
    """Name -> file bytes: every kind of malformed spec this suite feeds the CLI."""
    rng = random.Random(9)
    corpus: dict[str, bytes] = {
        "empty": b"",
        "whitespace_only": b"   \n\n\t\n",
        "comment_only": b"# nothing here\n",
        "random_binary": bytes(rng.randrange(256) for _ in range(4096)),
        "png_header": b"\x89PNG\r\n\x1a\n" + bytes(64),
        "elf_header": b"\x7fELF\x02\x01\x01" + bytes(120),
        "gzip": b"\x1f\x8b\x08\x00" + bytes(rng.randrange(256) for _ in range(200)),
        "nul_bytes": b"extraction_points:\x00\x00\n",
        "latin1": VALID.replace("name: p", "name: caf\u00e9").encode("latin-1"),
        "utf16_bom": VALID.encode("utf-16"),
        "lone_continuation_byte": b"version: 1\n\x80\n",
        "truncated_utf8": "name: \u20ac".encode()[:-1],
        "surrogate_escape": b"a: \xed\xa0\x80\n",
        "control_chars": b"extraction_points: \x07\x1b[31m\n",
        "nel_and_bom_inside": "a: b\u0085c\n\ufeffd: e\n".encode(),
        "tabs_for_indentation": VALID.replace("    ", "\t").encode(),
        "tab_after_dash": b"extraction_points:\n-\tname: p\n",
        "duplicate_top_level_key": (VALID + "version: 1\n").encode(),
        "duplicate_point_key": VALID.replace("stride: 1", "stride: 1\n    stride: 2").encode(),
        "unclosed_flow": b"extraction_points: [ {name: p, layers: [0\n",
        "unclosed_quote": b"extraction_points:\n  - name: 'p\n",
        "bad_indentation": b"extraction_points:\n  - name: p\n   layers: 0\n",
        "two_documents": (VALID + "---\n" + VALID).encode(),
        "directive_only": b"%YAML 1.1\n---\n",
        "top_level_list": b"- 1\n- 2\n",
        "top_level_scalar": b"just a string\n",
        "top_level_number": b"42\n",
        "points_not_a_list": b"extraction_points: {name: p}\n",
        "point_not_a_mapping": b"extraction_points: [p, 3, null]\n",
        "unhashable_key": b"? [a, b]\n: 1\n",
        "python_object_tag": b"!!python/object/apply:os.system ['touch /tmp/uc-pwned']\n",
        "python_name_tag": b"extraction_points: !!python/name:os.system\n",
        "unknown_local_tag": b"extraction_points: !custom {a: 1}\n",
        "bad_int_tag": b"version: !!int abc\n",
        "bad_float_tag": b"version: !!float abc\n",
        "bad_timestamp_tag": b"version: !!timestamp 2001-13-45\n",
        "bad_binary_tag": b"version: !!binary '%%%'\n",
        "bad_bool_tag": b"version: !!bool 8\n",
        "empty_int_tag": b"version: !!int ''\n",
        "bad_timestamp_text_tag": b"version: !!timestamp abc\n",
        "integer_past_digit_limit": _point_with("stride", "9" * 5000).encode(),
        "huge_key": ("k" * 100_000 + ": 1\n").encode(),
        "long_line": ("extraction_points: " + "x" * 200_000 + "\n").encode(),
        "over_size_bound": (VALID + "#" * (MAX_SPEC_BYTES + 10) + "\n").encode(),
        "deep_flow_nesting": _nested(10_000, flow=True).encode(),
        "deep_block_nesting": _nested(500, flow=False).encode(),
        "alias_bomb": _billion_laughs().encode(),
        "alias_bomb_in_probe_args": _point_with(
            "probe_args", "{x: *a9}").replace("extraction_points:", _billion_laughs()
                                             .replace("extraction_points: *a9\n", "")
                                             + "extraction_points:").encode(),
        "recursive_alias": b"a: &a [*a]\nextraction_points: *a\n",
        "undefined_alias": b"extraction_points: *nowhere\n",
        "merge_of_scalar": b"a: &x 1\nb:\n  <<: *x\n",
        "unknown_top_level_key": (VALID + "extraction_point: []\n").encode(),
        "wrong_version": VALID.replace("version: \"1\"", "version: \"99\"").encode(),
        "yaml_booleans_everywhere": _point_with("layers", "[yes, no]").encode(),
    }
    for key in VALID_POINT:
        for index, value in enumerate(WRONG_VALUES):
            if (key, value) in VALID_SUBSTITUTIONS:
                continue
            corpus[f"wrong_type_{key}_{index}"] = _point_with(key, value).encode()
    return corpus


CORPUS = malformed_corpus()


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("malformed")
    for name, data in CORPUS.items():
        (directory / f"{name}.yaml").write_bytes(data)
    (directory / "valid.yaml").write_text(VALID, encoding="utf-8")
    return directory


def _run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_the_valid_baseline_spec_is_valid(corpus_dir: Path) -> None:
    # Without this, a corpus of "wrong" variants of an already-invalid spec proves nothing.
    code, out, _ = _run_cli("validate", str(corpus_dir / "valid.yaml"))
    assert code == 0 and out.strip().endswith("OK (1 extraction point)")


def test_the_wrong_type_variants_are_all_invalid_except_the_known_valid_ones() -> None:
    valid = set()
    for key in VALID_POINT:
        for value in WRONG_VALUES:
            try:
                parse_yaml(_point_with(key, value))
            except SpecValidationError:
                continue
            valid.add((key, value))
    assert valid == VALID_SUBSTITUTIONS


@pytest.mark.timeout(120)
def test_every_malformed_file_gives_exit_1_one_line_and_no_traceback(
        corpus_dir: Path, figures) -> None:
    slowest = (0.0, "")
    for name in CORPUS:
        path = corpus_dir / f"{name}.yaml"
        started = time.perf_counter()
        code, out, err = _run_cli("validate", str(path))
        elapsed = time.perf_counter() - started
        slowest = max(slowest, (elapsed, name))
        lines = out.splitlines()
        assert code == 1, (name, out, err)
        assert len(lines) == 1 and lines[0].startswith(f"{path}: INVALID ("), (name, out)
        assert "Traceback" not in out + err, name
        with pytest.raises(SpecValidationError):
            load_yaml_file(path)
    assert not Path("/tmp/uc-pwned").exists(), "a python tag was constructed"
    figures.add("bad_specs", corpus_files=len(CORPUS),
                slowest_file_s=round(slowest[0], 3), slowest_file=slowest[1])


# Peak RSS from /proc's VmHWM: ru_maxrss would carry the forking test process's peak
# across exec on Linux.
_CHILD = """
import sys, time
started = time.perf_counter()
from undercurrent.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
sys.stderr.write(f"\\nWALL_S={time.perf_counter() - started:.3f} PEAK_RSS_KB={peak}\\n")
sys.exit(code)
"""


def _validate_in_fresh_process(*paths: Path) -> tuple[int, str, float, int]:
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD, "validate", *map(str, paths)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONHASHSEED="0"))
    tail = completed.stderr.strip().splitlines()[-1]
    wall = float(tail.split("WALL_S=")[1].split()[0])
    peak_kb = int(tail.split("PEAK_RSS_KB=")[1])
    return completed.returncode, completed.stdout + completed.stderr, wall, peak_kb


@pytest.mark.timeout(300)
def test_alias_bomb_and_huge_inputs_are_bounded_in_a_fresh_process(corpus_dir: Path,
                                                                   figures) -> None:
    code, _, base_wall, base_kb = _validate_in_fresh_process(corpus_dir / "valid.yaml")
    assert code == 0
    measured = {}
    for name in ("alias_bomb", "alias_bomb_in_probe_args", "deep_flow_nesting",
                 "over_size_bound", "huge_key"):
        code, output, wall, peak_kb = _validate_in_fresh_process(corpus_dir / f"{name}.yaml")
        assert code == 1 and "Traceback" not in output, (name, output)
        growth_mb = (peak_kb - base_kb) / 1024
        # A billion-laughs document expands to 10**9 nodes: bounded means refused before
        # any expansion, so peak memory stays within a few MB of a valid spec's.
        assert growth_mb < 64, (name, growth_mb)
        measured[name] = {"wall_s": round(wall, 3), "rss_growth_mb": round(growth_mb, 1)}
    # A file 4 GiB long is never read whole: the reader stops past the size bound.
    code, output, wall, peak_kb = _validate_in_fresh_process(Path("/dev/zero"))
    assert code == 1 and "larger than 256 KiB" in output
    assert (peak_kb - base_kb) / 1024 < 64
    measured["/dev/zero"] = {"wall_s": round(wall, 3),
                             "rss_growth_mb": round((peak_kb - base_kb) / 1024, 1)}
    code, output, wall, _ = _validate_in_fresh_process(
        *(corpus_dir / f"{name}.yaml" for name in CORPUS))
    assert code == 1 and "Traceback" not in output
    assert sum(": INVALID (" in line for line in output.splitlines()) == len(CORPUS)
    figures.add("bad_specs", baseline_wall_s=round(base_wall, 3),
                baseline_peak_rss_mb=round(base_kb / 1024, 1), bounded_inputs=measured,
                whole_corpus_one_process_s=round(wall, 2),
                max_expanded_nodes=MAX_EXPANDED_NODES, max_spec_bytes=MAX_SPEC_BYTES)


def _mutate(text: str, edits: list[tuple[int, int, str]]) -> str:
    for position, kind, char in edits:
        if not text:
            text = char
            continue
        position %= len(text)
        if kind == 0:
            text = text[:position] + char + text[position:]
        elif kind == 1:
            text = text[:position] + text[position + 1:]
        else:
            text = text[:position] + char + text[position + 1:]
    return text


_YAML_CHARS = st.sampled_from(list(":-[]{},&*!|>'\"#%@` \t\n?0123456789abcxyz") + ["\u0085",
                                                                                     "\ufeff"])
_FUZZ_DIR = tempfile.mkdtemp(prefix="uc-cli-fuzz-")


@pytest.fixture(scope="module", autouse=True)
def _remove_fuzz_dir() -> Iterator[None]:
    yield
    shutil.rmtree(_FUZZ_DIR, ignore_errors=True)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(
    st.binary(max_size=600),
    st.text(max_size=400).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 2), _YAML_CHARS), min_size=1,
             max_size=8).map(lambda edits: _mutate(VALID, edits).encode("utf-8",
                                                                       "surrogatepass")),
))
def _fuzz_the_cli(counts: dict[str, int], data: bytes) -> None:
    folder = Path(_FUZZ_DIR)
    folder.mkdir(parents=True, exist_ok=True)  # never rely on the folder made at import
    path = folder / "spec.yaml"
    path.write_bytes(data)
    code, out, err = _run_cli("validate", str(path))
    assert code in (0, 1)
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: ")
    assert (code == 0) == lines[0].startswith(f"{path}: OK")
    assert "Traceback" not in out + err
    counts["examples"] += 1
    counts["invalid"] += code


def test_cli_fuzz_never_crashes_and_prints_one_line(figures) -> None:
    counts = {"examples": 0, "invalid": 0}
    _fuzz_the_cli(counts)  # Hypothesis draws ``data`` for each example
    # The fuzz really ran its examples, and invalid inputs were among them.
    assert counts["examples"] >= 100, counts
    assert counts["invalid"] > 0, counts
    figures.add("bad_specs", cli_fuzz_examples=counts["examples"],
                cli_fuzz_invalid=counts["invalid"])
