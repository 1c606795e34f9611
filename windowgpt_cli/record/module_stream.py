"""The record modules in one lzma stream, and the importer that runs them from it.

`pack --lzma` writes the modules' sources into one lzma stream, the archive's member
`MODULES_MEMBER`, and this file's own source as the archive's `windowgpt_cli/__init__.py`.
Imported from the archive (`python code.pyz`, or a child process with the archive on its
path), that file reads the stream, puts an importer of its modules first on `sys.meta_path`
and runs the package's real `__init__`. One stream finds what the modules share, where a
zip deflates each file alone: about a third fewer bytes. Each module keeps the file name it
has in a plain zipapp, and the importer gives its source to whoever asks (tracebacks,
`inspect`, Triton parsing a kernel). Only the standard library is imported here: nothing of
the package can be imported before this runs.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import lzma
import sys

PACKAGE = "windowgpt_cli"
MODULES_MEMBER = f"{PACKAGE}/modules.xz"
PACKAGE_INIT = f"{PACKAGE}/__init__.py"  # in the archive, the bootstrap (this file); in the stream, the real one


def join_sources(sources: list[tuple[str, bytes]]) -> bytes:
    """One lzma stream of (path, source) pairs: a JSON line of paths and sizes, then the sources in that order."""
    header = json.dumps([[path, len(source)] for path, source in sources]).encode() + b"\n"
    return lzma.compress(header + b"".join(source for _, source in sources), preset=9 | lzma.PRESET_EXTREME)


def split_sources(stream: bytes) -> dict[str, bytes]:
    """The {path: source} that join_sources wrote."""
    header, _, body = lzma.decompress(stream).partition(b"\n")
    sources, start = {}, 0
    for path, size in json.loads(header):
        sources[path] = body[start:start + size]
        start += size
    if start != len(body):
        raise ValueError(f"module stream: its modules take {start} bytes, it holds {len(body)}")
    return sources


class StreamImporter(importlib.abc.MetaPathFinder, importlib.abc.SourceLoader):
    """Finds and loads the stream's modules, under file names inside the archive."""

    def __init__(self, archive: str, sources: dict[str, bytes]):
        self.archive = archive  # what codesize.running_archive reads, as of a zipimporter
        self.sources = sources

    def _path(self, fullname: str) -> str | None:
        base = fullname.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self.sources:
                return path
        return None

    def find_spec(self, fullname, path=None, target=None):
        found = self._path(fullname)
        if found is None:
            return None
        is_package = found.endswith("/__init__.py")  # its submodules come from the stream alone
        return importlib.util.spec_from_file_location(fullname, f"{self.archive}/{found}", loader=self,
                                                      submodule_search_locations=[] if is_package else None)

    def get_filename(self, fullname: str) -> str:
        return f"{self.archive}/{self._path(fullname)}"

    def get_data(self, path: str) -> bytes:
        name = path[len(self.archive) + 1:] if path.startswith(f"{self.archive}/") else None
        if name not in self.sources:
            raise OSError(f"not in the module stream: {path}")
        return self.sources[name]


def install(package: dict) -> None:
    """Run as the archive's package `__init__` (its globals given): import every module of
    the package from the stream, starting with the real `__init__`."""
    archive = package["__loader__"].archive
    importer = StreamImporter(archive, split_sources(package["__loader__"].get_data(f"{archive}/{MODULES_MEMBER}")))
    sys.meta_path.insert(0, importer)
    package["__loader__"] = package["__spec__"].loader = importer
    exec(compile(importer.sources[PACKAGE_INIT], f"{archive}/{PACKAGE_INIT}", "exec"), package)


if __name__ == PACKAGE:  # this source as the archive's package __init__; imported as itself, it only defines
    install(globals())
