"""Reading documents: JSON lines (field `text`, optionally xz or gzip compressed) and
plain text files (one document per file).

Reading is split in two so that the expensive half can run in worker processes: the
main process only decompresses and cuts lines (`read_chunks`), and `parse_chunk`
decodes and validates them, naming the file and line of the first bad record.
"""
from __future__ import annotations

import gzip
import json
import lzma
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator

from ..errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.xz", ".jsonl.gz")
TEXT_SUFFIXES = (".txt",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + TEXT_SUFFIXES
DEFAULT_CHUNK_BYTES = 512 * 1024
# A document (a JSON line, or a whole text file) longer than this is refused: reading it
# whole could exhaust memory, and no corpus needs documents this long.
MAX_DOCUMENT_BYTES = 256 << 20

# What a truncated or corrupt compressed stream raises while it is being read.
_DECOMPRESSION_ERRORS = (lzma.LZMAError, EOFError, gzip.BadGzipFile, zlib.error)


@dataclass(frozen=True)
class RawChunk:
    """Consecutive undecoded records of one file, small enough to hand to a worker."""

    source: str
    is_jsonl: bool
    first_line: int  # 1-based line number of records[0]
    records: list[bytes]  # JSON lines, or the whole file for plain text
    raw_position: int  # bytes of the file on disk consumed so far, for progress


def input_kind(path: Path) -> str:
    """'jsonl' or 'text'; a one-line DataError for any other file name."""
    name = Path(path).name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise DataError(f"{path}: unsupported input type; use {', '.join(SUPPORTED_SUFFIXES)}")


def check_inputs(paths: Iterable[Path]) -> list[Path]:
    """Fail early, before any long work, on a missing, unreadable or unsupported input."""
    checked = []
    for path in map(Path, paths):
        input_kind(path)
        if not path.exists():
            raise DataError(f"{path}: no such file")
        if not path.is_file():
            raise DataError(f"{path}: not a file")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror})") from None
        checked.append(path)
    return checked


def _decompressed(path: Path, raw: IO[bytes]) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith(".xz"):
        return lzma.LZMAFile(raw)  # type: ignore[return-value]
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    return raw


def read_chunks(path: Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[RawChunk]:
    """The file's records in order, in chunks of about chunk_bytes of uncompressed data."""
    path = Path(path)
    is_jsonl = input_kind(path) == "jsonl"
    line = 0
    try:
        with open(path, "rb") as raw, _decompressed(path, raw) as stream:
            if not is_jsonl:
                text = stream.read(MAX_DOCUMENT_BYTES + 1)
                if len(text) > MAX_DOCUMENT_BYTES:
                    raise DataError(f"{path}: line 1: the document is longer than {MAX_DOCUMENT_BYTES:,} bytes; "
                                    "split it, or give the corpus as JSON lines")
                yield RawChunk(str(path), False, 1, [text], raw.tell())
                return
            records: list[bytes] = []
            first, size = 1, 0
            for line, record in enumerate(iter(lambda: stream.readline(MAX_DOCUMENT_BYTES + 1), b""), start=1):
                if len(record) > MAX_DOCUMENT_BYTES:
                    raise DataError(f"{path}: line {line}: longer than {MAX_DOCUMENT_BYTES:,} bytes; split the "
                                    "document")
                records.append(record)
                size += len(record)
                if size >= chunk_bytes:
                    yield RawChunk(str(path), True, first, records, raw.tell())
                    records, first, size = [], line + 1, 0
            if records:
                yield RawChunk(str(path), True, first, records, raw.tell())
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except _DECOMPRESSION_ERRORS as exc:
        raise DataError(f"{path}: line {line + 1}: cannot decompress ({exc})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _decode_utf8(data: bytes, source: str, first_line: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + data.count(b"\n", 0, exc.start)
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise DataError(f"{source}: line {line}: not valid UTF-8 "
                        f"(byte 0x{data[exc.start]:02x} at byte {column} of the line)") from None


def parse_jsonl_record(record: bytes, source: str, line: int) -> str | None:
    """The `text` of one JSON line; None for a blank line."""
    text = _decode_utf8(record, source, line)
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{source}: line {line}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise DataError(f"{source}: line {line}: JSON nested too deeply to read; expected an object with a "
                        "string field \"text\"") from None
    if not isinstance(obj, dict):
        raise DataError(f"{source}: line {line}: expected a JSON object with a string field \"text\"")
    value = obj.get("text")
    if not isinstance(value, str):
        found = "missing" if value is None and "text" not in obj else f"a {type(value).__name__}"
        raise DataError(f"{source}: line {line}: field \"text\" must be a string ({found})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate escape such as "\ud800": no character of UTF-8
        raise DataError(f"{source}: line {line}: field \"text\" holds a lone surrogate ({value[exc.start]!r} at "
                        f"character {exc.start}), which is no text; fix the escape") from None
    return value


def parse_chunk(chunk: RawChunk) -> list[str]:
    """The documents of a chunk, in order; DataError naming the file and line of a bad record."""
    if not chunk.is_jsonl:
        return [_decode_utf8(chunk.records[0], chunk.source, 1)]
    texts = []
    for line, record in enumerate(chunk.records, start=chunk.first_line):
        text = parse_jsonl_record(record, chunk.source, line)
        if text is not None:
            texts.append(text)
    return texts


def iter_documents(path: Path) -> Iterator[str]:
    """Every document of one input file, in order."""
    for chunk in read_chunks(path):
        yield from parse_chunk(chunk)


def iter_corpus(paths: Iterable[Path]) -> Iterator[str]:
    """Every document of the given files, file by file, in order."""
    for path in paths:
        yield from iter_documents(path)
