"""The record's code, packed: a zipapp of exactly the modules a record run imports.

`python code.pyz train ...` (or `torchrun code.pyz ...`) runs the record stages from the
archive alone, so the archive is both the code that ran and the code counted. Members are
deflated at the highest level (zipimport reads no compression but deflate) in a fixed order with
fixed timestamps and modes: the same source gives the same bytes. With `strip`, each module
goes in without its comments and docstrings (`strip.strip_source`), and the archive's
comment says so. With `lzma`, the modules go into one lzma stream (stored as it is), which
the archive's package `__init__` unpacks when imported (`module_stream`).
"""
from __future__ import annotations

import io
import zipfile
from pathlib import Path

from ..storage.outputs import check_apart, claim_file
from . import codesize, module_stream
from .strip import strip_source

FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip entry can carry


def archive_members(strip: bool = False, lzma: bool = False) -> list[tuple[str, bytes]]:
    """(name, bytes) of each member: the entry point, then the record modules, sorted
    (without comments and docstrings with `strip`); with `lzma`, the package's bootstrap
    `__init__` and the modules' stream in their place."""
    sources = [(path, (codesize.PACKAGE_DIR.parent / path).read_bytes()) for path in codesize.record_modules()]
    if strip:
        sources = [(path, strip_source(source)) for path, source in sources]
    sources.sort()
    if lzma:  # module_stream is a record module: its source (stripped or not) is among them
        bootstrap = dict(sources)[codesize.module_path(module_stream.__name__)]
        sources = [(module_stream.PACKAGE_INIT, bootstrap),
                   (module_stream.MODULES_MEMBER, module_stream.join_sources(sources))]
    return [(codesize.MAIN_MEMBER, codesize.MAIN_SOURCE.encode()), *sources]


def archive_bytes(members: list[tuple[str, bytes]], strip: bool = False) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        if strip:
            archive.comment = codesize.STRIPPED_COMMENT
        for name, data in members:
            info = zipfile.ZipInfo(name, FIXED_TIME)
            # The lzma stream stored as it is: deflate would only add bytes to it.
            stored = name == module_stream.MODULES_MEMBER
            info.compress_type = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, whatever the machine packing
            info.external_attr = 0o644 << 16
            archive.writestr(info, data, compresslevel=9)
    return buffer.getvalue()


def pack(out: Path, strip: bool = False, lzma: bool = False) -> codesize.CodeCount:
    """Write the record's code as a runnable zipapp at `out` (its modules without comments
    and docstrings with `strip`, in one lzma stream with `lzma`); returns what it counts."""
    from ..storage.files import atomic_write_bytes

    out = Path(out)
    check_apart(out, [codesize.PACKAGE_DIR])
    claim_file(out, "packed code", codesize.is_packed_code)
    data = archive_bytes(archive_members(strip, lzma), strip)
    atomic_write_bytes(out, data)
    return codesize.archive_count(out, data)
