"""The record's code packed as a zipapp: reproducible, exactly the record modules, and
runnable on its own."""
from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import subprocess
import sys
import tokenize
import zipfile
from pathlib import Path

import pytest

from windowgpt_cli.record import codesize, module_stream
from windowgpt_cli.storage.files import sha256_file
from windowgpt_cli.record.archive import FIXED_TIME, pack
from windowgpt_cli.record.codesize import MAIN_MEMBER, MAIN_SOURCE
from windowgpt_cli.record.strip import strip_source
from windowgpt_cli.quant.quantize import quantize


@pytest.mark.slow
def test_packing_is_reproducible_and_holds_exactly_the_record_modules(tmp_path: Path):
    first, second = pack(tmp_path / "a" / "code.pyz"), pack(tmp_path / "b.pyz")
    data = (tmp_path / "a" / "code.pyz").read_bytes()
    assert data == (tmp_path / "b.pyz").read_bytes()
    assert first.sha256 == second.sha256 == sha256_file(tmp_path / "b.pyz")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["code.pyz"]  # no temporary file left behind
    with zipfile.ZipFile(tmp_path / "b.pyz") as archive:
        members = archive.infolist()
        assert archive.read(MAIN_MEMBER).decode() == MAIN_SOURCE
    names = [m.filename for m in members]
    assert names == first.files == [MAIN_MEMBER, *codesize.record_modules()]
    assert "windowgpt_cli/cli/record_app.py" in names and "windowgpt_cli/cli/train.py" in names
    left_out = {"windowgpt_cli/cli/app.py", "windowgpt_cli/cli/prepare.py", "windowgpt_cli/record/packing.py"}
    assert not left_out & set(names)
    assert all(m.compress_type == zipfile.ZIP_DEFLATED and m.date_time == FIXED_TIME for m in members)
    assert first.bytes == len(data) and first.source_bytes == sum(m.file_size for m in members)
    assert first.source_bytes == codesize.code_bytes() + len(MAIN_SOURCE) > 2 * first.bytes
    assert first.form == f"zipapp (deflate) of {len(names)} files, runnable as `python code.pyz`"


@pytest.mark.parametrize("strip", [False, True])
def test_the_lzma_form_holds_the_record_modules_in_one_stream(tmp_path: Path, strip: bool):
    count = pack(tmp_path / "code.pyz", strip, lzma=True)
    data = (tmp_path / "code.pyz").read_bytes()
    pack(tmp_path / "again.pyz", strip, lzma=True)
    assert (tmp_path / "again.pyz").read_bytes() == data
    with zipfile.ZipFile(tmp_path / "code.pyz") as archive:
        members = {m.filename: m for m in archive.infolist()}
        stream = module_stream.split_sources(archive.read(module_stream.MODULES_MEMBER))
        bootstrap = archive.read(module_stream.PACKAGE_INIT)
    assert list(members) == [MAIN_MEMBER, module_stream.PACKAGE_INIT, module_stream.MODULES_MEMBER]
    assert members[module_stream.MODULES_MEMBER].compress_type == zipfile.ZIP_STORED
    # the stream holds each record module's source exactly as the plain archive would, the bootstrap is module_stream's
    form = strip_source if strip else (lambda source: source)
    expected = {path: form((codesize.PACKAGE_DIR.parent / path).read_bytes()) for path in codesize.record_modules()}
    assert stream == expected and list(stream) == sorted(expected)
    assert bootstrap == expected[codesize.module_path(module_stream.__name__)]
    assert count.bytes == len(data) and count.files[:2] == [MAIN_MEMBER, module_stream.PACKAGE_INIT]
    assert count.files[2:] == [f"{module_stream.MODULES_MEMBER}:{path}" for path in expected]
    assert count.source_bytes == len(MAIN_SOURCE) + len(bootstrap) + sum(map(len, expected.values()))
    assert f"zipapp of 3 files, {len(expected)} modules in one lzma stream" in count.form
    plain = pack(tmp_path / "plain.pyz", strip)
    assert count.bytes < 0.75 * plain.bytes


def test_a_module_stream_whose_sizes_disagree_with_its_bytes_is_refused():
    import lzma

    stream = module_stream.join_sources([("a.py", b"x = 1\n"), ("b/__init__.py", b"")])
    assert module_stream.split_sources(stream) == {"a.py": b"x = 1\n", "b/__init__.py": b""}
    with pytest.raises(ValueError, match="its modules take 6 bytes, it holds 7"):
        module_stream.split_sources(lzma.compress(lzma.decompress(stream) + b"!"))
    with pytest.raises(ValueError, match="its modules take 6 bytes, it holds 5"):
        module_stream.split_sources(lzma.compress(lzma.decompress(stream)[:-1]))


STREAM_PROBE = """
import inspect, sys, traceback
archive, source_tree = sys.argv[1:]
sys.path[:0] = [archive, source_tree]  # the source tree after the archive: the archive's modules win
from windowgpt_cli.kernels import attention_output
from windowgpt_cli.record import codesize, module_stream
print(attention_output.__file__)
print(codesize.running_archive())
print(inspect.getsource(codesize.module_path).splitlines()[0])
print(type(attention_output._xsa_forward_kernel.parse()).__name__)  # Triton reads the kernel's source
try:
    module_stream.split_sources(b"not lzma")
except Exception as error:
    print(traceback.extract_tb(error.__traceback__)[-2].line)  # a line of the stream's module, in the traceback
try:
    import windowgpt_cli.no_such_module
except ModuleNotFoundError as error:
    print(error.name)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_modules_from_the_stream_give_their_source_and_their_files_inside_the_archive(tmp_path: Path):
    archive = tmp_path / "code.pyz"
    pack(archive, strip=True, lzma=True)
    compiled = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # Triton's JIT, as on a GPU
    done = subprocess.run([sys.executable, "-c", STREAM_PROBE, str(archive), str(codesize.PACKAGE_DIR.parent)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=compiled)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"{archive}/windowgpt_cli/kernels/attention_output.py", str(archive),
                                        "def module_path(module: str) -> str:", "Module",
                                        'header, _, body = lzma.decompress(stream).partition(b"\\n")',
                                        "windowgpt_cli.no_such_module"]


@pytest.mark.slow
@pytest.mark.parametrize("strip, lzma", [(False, False), (True, False), (True, True)])
def test_the_archive_alone_runs_a_record_stage_and_counts_itself(tiny_run_dir: Path, tmp_path: Path,
                                                                 quant_single_thread, strip: bool, lzma: bool):
    archive = tmp_path / "code.pyz"
    pack(archive, strip, lzma)
    work = tmp_path / "elsewhere"  # neither the working directory nor the path holds the source tree
    work.mkdir()
    done = subprocess.run([sys.executable, str(archive), "quantize", str(tiny_run_dir), "--out", "model.ptz",
                           "--no-gptq", "--device", "cpu", "--json"], cwd=work, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    packed = json.loads((work / "model.ptz.json").read_text())
    assert json.loads(done.stdout) == packed
    # The report names the archive only when the package was imported from one.
    assert packed["code_archive"] == str(archive) and packed["code_sha256"] == sha256_file(archive)
    assert packed["code_bytes"] == archive.stat().st_size
    assert packed["total_bytes"] == packed["model_bytes"] + archive.stat().st_size

    source = quantize(tiny_run_dir, tmp_path / "source.ptz", gptq=False, device="cpu")
    assert (work / "model.ptz").read_bytes() == (tmp_path / "source.ptz").read_bytes()
    assert source["code_archive"] is None and source["code_counted"] == codesize.SOURCE_FORM
    assert source["code_bytes"] == codesize.code_bytes()
    if strip:  # the archive says what it left out; its modules are smaller than their source
        assert "without comments and docstrings" in packed["code_counted"]
        assert packed["code_source_bytes"] - len(MAIN_SOURCE) < 0.85 * source["code_bytes"]
        assert ("in one lzma stream" in packed["code_counted"]) == lzma
    else:
        assert "without" not in packed["code_counted"]
        assert source["code_bytes"] == packed["code_source_bytes"] - len(MAIN_SOURCE)


@pytest.mark.slow
def test_pack_command_writes_the_archive_and_says_what_it_counts(tmp_path: Path):
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app

    result = CliRunner().invoke(app, ["pack", "--out", str(tmp_path / "code.pyz")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    size = (tmp_path / "code.pyz").stat().st_size
    assert f"zipapp (deflate) of {len(codesize.record_modules()) + 1} files" in result.output
    assert f"{size:,} bytes (source {codesize.code_bytes() + len(MAIN_SOURCE):,} bytes" in result.output
    result = CliRunner().invoke(app, ["pack", "--strip", "--out", str(tmp_path / "small.pyz")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "files, without comments and docstrings, runnable as `python small.pyz`" in result.output
    assert (tmp_path / "small.pyz").stat().st_size < 0.8 * size
    with zipfile.ZipFile(tmp_path / "small.pyz") as archive:
        assert archive.comment == codesize.STRIPPED_COMMENT
    result = CliRunner().invoke(app, ["pack", "--strip", "--lzma", "--out", str(tmp_path / "smaller.pyz")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "modules in one lzma stream, without comments and docstrings, runnable as `python smaller.pyz`" \
        in result.output
    assert (tmp_path / "smaller.pyz").stat().st_size < 0.75 * (tmp_path / "small.pyz").stat().st_size


@pytest.mark.parametrize("lzma", [False, True])
def test_a_child_process_of_the_packed_code_finds_the_archive(tmp_path: Path, lzma: bool):
    """Run as `python code.pyz`, the package is on no path a child inherits; the background
    compile's process (`bytecode.module_process`) still imports it from the archive. Python
    runs without site-packages (-S), where an installed windowgpt would hide the difference."""
    archive = tmp_path / "code.pyz"
    pack(archive, lzma=lzma)
    work = tmp_path / "elsewhere"
    work.mkdir()
    script = (f"import subprocess, sys; sys.path.insert(0, {str(archive)!r}); "
              "from windowgpt_cli import bytecode as process; "
              "argv, env = process.module_process('windowgpt_cli.bytecode'); "
              "done = subprocess.run([argv[0], '-S', *argv[1:]], env=env, capture_output=True, text=True); "
              "print(process.__file__); print(done.returncode); print(done.stderr.splitlines()[0])")
    done = subprocess.run([sys.executable, "-S", "-c", script], cwd=work, capture_output=True, text=True, timeout=60,
                          env={"PATH": ""})
    assert done.returncode == 0, done.stderr
    imported_from, child_status, child_says = done.stdout.splitlines()
    assert imported_from.startswith(str(archive))
    assert child_status == "2" and child_says.startswith("usage: python -m windowgpt_cli.bytecode")


def _without_docstrings(tree: ast.AST) -> str:
    """The tree, every docstring before further statements taken out, with every node's lines."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and len(body) > 1 and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:]
    return ast.dump(tree, include_attributes=True)


def test_stripped_modules_keep_every_statement_on_its_line():
    stripped_bytes = source_bytes = 0
    for path in codesize.record_modules():
        source = (codesize.PACKAGE_DIR.parent / path).read_bytes()
        stripped = strip_source(source)
        assert stripped.count(b"\n") == source.count(b"\n"), path
        assert _without_docstrings(ast.parse(stripped)) == _without_docstrings(ast.parse(source)), path
        tokens = tokenize.generate_tokens(io.StringIO(stripped.decode()).readline)
        assert not any(t.type == tokenize.COMMENT for t in tokens), path
        stripped_bytes, source_bytes = stripped_bytes + len(stripped), source_bytes + len(source)
    assert stripped_bytes < 0.85 * source_bytes


def test_stripping_keeps_what_a_body_needs_and_strings_that_look_like_comments():
    source = (b'"""A module."""\nfrom __future__ import annotations\n\n\n'
              b'class Empty(Exception):\n    """Only a docstring: it stays."""\n\n\n'
              b'def f(x):  # a comment\n    """Two\n    lines."""\n    return "# not a comment"  # gone\n\n\n'
              b'def g(): "kept: it shares the line"; return 1\n')
    stripped = strip_source(source).decode()
    assert stripped == ('\nfrom __future__ import annotations\n\n\n'
                        'class Empty(Exception):\n    """Only a docstring: it stays."""\n\n\n'
                        'def f(x):\n\n\n    return "# not a comment"\n\n\n'
                        'def g(): "kept: it shares the line"; return 1\n')
    namespace: dict = {}
    exec(compile(stripped, "m.py", "exec"), namespace)
    assert namespace["f"](0) == "# not a comment" and namespace["g"]() == 1
