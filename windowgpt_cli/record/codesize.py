"""The code bytes of the artifact: the modules a record run imports.

The challenge counts the bytes of the code that trains and evaluates the model. A record
run runs the stages train, export, quantize, eval and eval-ttt through a small command line
(`record_app.py`); what they import, directly or not (found by reading their import
statements, including those inside functions), is the record's code. The full command line
(`cli.py`, which also registers prepare and the other commands), data preparation, tests and
benchmarks are not.

Run from the packed archive (`windowgpt pack`, see archive.py), the code counted is that
archive, the file that ran; run from the source tree, it is the modules' source as on disk.
"""
from __future__ import annotations

import ast
import functools
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..storage.files import sha256_bytes
from .module_stream import MODULES_MEMBER, PACKAGE, split_sources

PACKAGE_DIR = Path(__file__).resolve().parent.parent
RECORD_STAGES = tuple(f"{PACKAGE}.cli.{name}" for name in ("train", "export", "quantize", "evaluate", "eval_ttt"))
RECORD_ENTRY = f"{PACKAGE}.cli.record_app"
ENTRY = f"{PACKAGE}.entry"  # the packed code's __main__ starts there
RECORD_ROOTS = (*RECORD_STAGES, RECORD_ENTRY, ENTRY)
SOURCE_FORM = "Python source as on disk (uncompressed), not packed"
STRIPPED_COMMENT = b"windowgpt: modules without comments and docstrings"  # the zip comment of `pack --strip`
MAIN_MEMBER = "__main__.py"  # the packed archive's entry point
MAIN_SOURCE = f"from {ENTRY} import run\nrun({RECORD_ENTRY!r})\n"


@functools.lru_cache(maxsize=4096)
def module_file(module: str, package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The file of a module of the package, or None if it is not one."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = package_dir.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(module: str, package_dir: Path = PACKAGE_DIR) -> set[str]:
    """The package's modules that `module`'s import statements name (with their packages)."""
    path = module_file(module, package_dir)
    assert path is not None, module
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _statements(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.module, node.level)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import ptz`
    with_parents = {".".join(name.split(".")[:i + 1]) for name in found for i in range(name.count(".") + 1)}
    return {name for name in with_parents if module_file(name, package_dir) is not None}


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement, nested ones too (imports inside functions, branches, try blocks):
    imports are statements, so the expressions, most of a tree, need no visit."""
    stack = list(body)
    while stack:
        statement = stack.pop()
        yield statement
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(getattr(statement, field, None) or ())


def _absolute(module: str, is_package: bool, target: str | None, level: int) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[:len(anchor) - (level - 1)]
    return ".".join(anchor + ([target] if target else []))


def import_closure(roots: tuple[str, ...] = RECORD_ROOTS, package_dir: Path = PACKAGE_DIR) -> list[str]:
    """The roots and every package module they import, directly or not, sorted."""
    seen: set[str] = set()
    pending = [name for root in roots for name in _with_packages(root)]
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.add(name)
            pending.extend(imported_modules(name, package_dir) - seen)
    return sorted(seen)


def _with_packages(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i + 1]) for i in range(len(parts))]


def module_path(module: str) -> str:
    """A package module's file, relative to the package's parent (as the archive names it)."""
    return str(module_file(module).relative_to(PACKAGE_DIR.parent))


def record_modules() -> list[str]:
    """The package's source files a record run imports, relative to the package's parent."""
    return [module_path(m) for m in import_closure()]


def code_bytes() -> int:
    return sum((PACKAGE_DIR.parent / path).stat().st_size for path in record_modules())


@dataclass(frozen=True)
class CodeCount:
    """The code bytes a report counts, and what they are."""

    bytes: int
    form: str  # what was counted, in words
    files: list[str]  # the counted files (the archive's members when packed)
    source_bytes: int  # the same modules' source, uncompressed: comparable across forms
    archive: str | None = None  # the packed archive that ran, if any
    sha256: str | None = None  # the archive's


def running_archive() -> Path | None:
    """The archive this package runs from, or None when it runs from source files (a
    zipimporter, or module_stream's importer in an archive `pack --lzma` wrote)."""
    archive = getattr(globals().get("__loader__"), "archive", None)
    return Path(archive) if isinstance(archive, str) else None


def archive_form(files: int, archive: Path, stripped: bool = False, streamed: int = 0) -> str:
    """What an archive is, in words: its files, and with a module stream how many modules it holds."""
    kind = f"zipapp of {files} files, {streamed} modules in one lzma stream" if streamed \
        else f"zipapp (deflate) of {files} files"
    without = ", without comments and docstrings" if stripped else ""
    return f"{kind}{without}, runnable as `python {archive.name}`"


def archive_count(archive: Path, data: bytes | None = None) -> CodeCount:
    """What a packed archive counts (its bytes, `data` when given, else the file's): its
    modules, those of its stream included."""
    data = Path(archive).read_bytes() if data is None else data
    with zipfile.ZipFile(io.BytesIO(data)) as packed:
        members = packed.infolist()
        stripped = packed.comment == STRIPPED_COMMENT
        names = [m.filename for m in members]
        stream = split_sources(packed.read(MODULES_MEMBER)) if MODULES_MEMBER in names else {}
    files = [name for name in names if name != MODULES_MEMBER] + [f"{MODULES_MEMBER}:{path}" for path in stream]
    source_bytes = sum(m.file_size for m in members if m.filename != MODULES_MEMBER) + sum(map(len, stream.values()))
    return CodeCount(len(data), archive_form(len(members), archive, stripped, len(stream)), files, source_bytes,
                     str(archive), sha256_bytes(data))


def count_code() -> CodeCount:
    """The packed archive this code runs from; without one, the record modules' source."""
    archive = running_archive()
    if archive is None:
        return CodeCount(code_bytes(), SOURCE_FORM, record_modules(), code_bytes())
    return archive_count(archive)


def is_packed_code(path: Path | bytes) -> bool:
    """Whether a file (or its bytes) is an archive pack wrote: a zip whose entry point is pack's."""
    try:
        with zipfile.ZipFile(io.BytesIO(path) if isinstance(path, bytes) else path) as archive:
            return archive.read(MAIN_MEMBER) == MAIN_SOURCE.encode()
    except (OSError, KeyError, zipfile.BadZipFile):
        return False
