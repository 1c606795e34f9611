"""The compressors of a `.ptz` payload, each named by an id in the `.ptz` header.

Whole-payload compressors: `lzma` (xz preset 6, the reference's), `rans`, which
entropy-codes the int8 code tensors with their own per-tensor statistics and gives the rest
to lzma, and `brotli` and `zstd` (the `windowgpt[compress]` extra). `auto`, the default,
codes the payload group by group (`grouped`: each tensor group's codes, scales and kept
values with the codec and byte layout that make them smallest); the header names it
`groups`. `python3 bench/compressors.py MODEL.ptz` measures every compressor, and other lzma
settings, zlib and bz2, on a model's payload.

Every decompressor stops at the size the header declares, so a small file cannot inflate
beyond it, and raises `CorruptPayload` on anything it cannot decode.
"""
from __future__ import annotations

import lzma
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ConfigError
from ..storage import tensorfile
from . import codecs, grouped
from .codecs import lzma_decode as _unlzma
from .rans import RANS_MAX_LANES, RANS_MIN_LANES, RANS_SCALE_BITS, RANS_SYMBOLS_PER_LANE  # noqa: F401 - public
from .rans import CorruptPayload, rans_lanes
from .rans import first_line as _first_line
from .rans import rans_decode as _rans_decode
from .rans import rans_encode as _rans_encode
from .rans import symbol_frequencies as _symbol_frequencies


@dataclass(frozen=True)
class Compressor:
    id: int  # stored in the .ptz header
    compress: Callable[[bytes], bytes]
    decompress: Callable[[bytes, int], bytes]  # (data, max output bytes); raises CorruptPayload


def _lzma(b: bytes) -> bytes:
    return lzma.compress(b, preset=6)


# --- rANS for int8 codes -------------------------------------------------------------------
#
# LZ-style compressors spend several percent more than the entropy of int6/int8 codes,
# which are nearly independent draws from a per-tensor distribution. The "rans" compressor
# codes every int8 tensor of the payload with an interleaved range asymmetric numeral
# system (Duda 2013; 32-bit states, 16-bit output words) under that tensor's own symbol
# frequencies, within a few bytes per lane of their order-0 entropy, and leaves the rest
# (header, scales, kept tensors, frequency tables: the side bytes) to lzma, which runs in
# a thread beside the coder. Symbol i goes to lane i % lanes, and numpy advances all lanes
# at once, so the Python loop takes symbols / lanes steps; each lane's final state costs 4
# bytes, so the lane count grows with the payload.
#
# Stream (compressor id 3): _RANS_HEADER, the side bytes (one xz stream), the lanes' final
# states (uint32), the words in decoding order (uint16). Compressor id 2, the first
# version, is the same without the lane count in its header, always RANS_V1_LANES lanes.

RANS_MIN_SYMBOLS = 4096  # smaller int8 tensors stay with lzma
RANS_MAX_RANGES = 4096  # int8 tensors coded at most (the largest); bounds the decoder's tables


RANS_V1_LANES = 1024
_RANS_HEADER = struct.Struct("<QQQII")  # side bytes, words, symbols, crc32 of the payload, lanes
_RANS_V1_HEADER = struct.Struct("<QQQI")  # id 2: the same without lanes


def _int8_ranges(payload: bytes) -> list[tuple[int, int]]:
    """Absolute byte ranges of the payload's int8 tensors worth entropy coding."""
    entries, _, start = tensorfile.layout(payload, "payload")
    ranges = [(start + b, start + e) for dtype, _, (b, e) in entries.values()
              if dtype == "I8" and e - b >= RANS_MIN_SYMBOLS]
    return sorted(sorted(ranges, key=lambda r: r[0] - r[1])[:RANS_MAX_RANGES])


def _rans_compress(payload: bytes) -> bytes:
    ranges = _int8_ranges(payload)
    view = np.frombuffer(payload, dtype=np.uint8)
    pieces = [view[b:e] ^ np.uint8(0x80) for b, e in ranges]  # int8 + 128: the codes' range is contiguous
    freq = np.stack([_symbol_frequencies(p) for p in pieces]) if pieces else np.zeros((0, 256), np.int64)
    cum = np.cumsum(freq, axis=1) - freq
    n_symbols = sum(len(p) for p in pieces)
    lanes = rans_lanes(n_symbols)
    with ThreadPoolExecutor(1) as pool:  # lzma releases the GIL: the side bytes compress meanwhile
        side = pool.submit(_rans_side, payload, ranges, freq)
        words, states = _rans_encode(_per_symbol(freq, pieces), _per_symbol(cum, pieces), lanes)
        side = side.result()
    return (_RANS_HEADER.pack(len(side), len(words), n_symbols, zlib.crc32(payload), lanes) + side
            + states.astype("<u4").tobytes() + words.astype("<u2").tobytes())


def _per_symbol(table: np.ndarray, pieces: list[np.ndarray]) -> np.ndarray:
    """table[k][symbol] for every symbol of every piece k, as one uint16 array."""
    rows = table.astype(np.uint16)
    return np.concatenate([row[p] for row, p in zip(rows, pieces)]) if pieces else np.zeros(0, np.uint16)


def _rans_side(payload: bytes, ranges: list[tuple[int, int]], freq: np.ndarray) -> bytes:
    """lzma of: the ranges, each range's nonzero frequency span, and the payload's other bytes."""
    index = [struct.pack("<I", len(ranges))]
    for (b, e), f in zip(ranges, freq):
        nonzero = np.flatnonzero(f)
        lo, hi = int(nonzero[0]), int(nonzero[-1]) + 1
        index.append(struct.pack("<QQHH", b, e, lo, hi) + f[lo:hi].astype("<u2").tobytes())
    rest, cursor = [], 0
    for b, e in ranges:
        rest.append(payload[cursor:b])
        cursor = e
    rest.append(payload[cursor:])
    return _lzma(b"".join(index) + b"".join(rest))


def _rans_decompress(data: bytes, limit: int) -> bytes:
    if len(data) < _RANS_HEADER.size:
        raise CorruptPayload("truncated (no rANS header)")
    side_len, n_words, n_symbols, crc, lanes = _RANS_HEADER.unpack_from(data)
    if not 1 <= lanes <= RANS_MAX_LANES:
        raise CorruptPayload(f"rANS lane count {lanes} is outside 1..{RANS_MAX_LANES}")
    return _rans_decode_stream(data, _RANS_HEADER.size, side_len, n_words, n_symbols, crc, lanes, limit)


def _rans_v1_decompress(data: bytes, limit: int) -> bytes:
    if len(data) < _RANS_V1_HEADER.size:
        raise CorruptPayload("truncated (no rANS header)")
    side_len, n_words, n_symbols, crc = _RANS_V1_HEADER.unpack_from(data)
    return _rans_decode_stream(data, _RANS_V1_HEADER.size, side_len, n_words, n_symbols, crc, RANS_V1_LANES, limit)


def _rans_decode_stream(data: bytes, side_at: int, side_len: int, n_words: int, n_symbols: int, crc: int,
                        lanes: int, limit: int) -> bytes:
    states_at = side_at + side_len
    words_at = states_at + 4 * lanes
    if words_at + 2 * n_words != len(data):
        raise CorruptPayload(f"truncated or padded ({len(data)} bytes, the header implies {words_at + 2 * n_words})")
    side = _unlzma(data[side_at:states_at], limit)
    ranges, freq, rest = _parse_rans_side(side)
    lengths = [e - b for b, e in ranges]
    if sum(lengths) != n_symbols or n_symbols + len(rest) > limit:
        raise CorruptPayload("rANS index does not match its stream")
    states = np.frombuffer(data, dtype="<u4", count=lanes, offset=states_at)
    words = np.frombuffer(data, dtype="<u2", count=n_words, offset=words_at)
    symbols = _rans_decode(words, states, lengths, freq)
    symbols ^= np.uint8(0x80)
    payload = _interleave(rest, ranges, symbols.tobytes())
    if zlib.crc32(payload) != crc:
        raise CorruptPayload("payload checksum mismatch")
    return payload


def _parse_rans_side(side: bytes) -> tuple[list[tuple[int, int]], np.ndarray, bytes]:
    try:
        (count,) = struct.unpack_from("<I", side)
        if count > RANS_MAX_RANGES:
            raise ValueError(f"{count} ranges, more than {RANS_MAX_RANGES}")
        pos, ranges, freqs = 4, [], []
        for _ in range(count):
            b, e, lo, hi = struct.unpack_from("<QQHH", side, pos)
            pos += 20
            f = np.zeros(256, dtype=np.int64)
            f[lo:hi] = np.frombuffer(side, dtype="<u2", count=hi - lo, offset=pos)
            pos += 2 * (hi - lo)
            if f.sum() != 1 << RANS_SCALE_BITS or not (ranges[-1][1] if ranges else 0) <= b <= e - RANS_MIN_SYMBOLS:
                raise ValueError("bad frequency table or range")
            ranges.append((b, e))
            freqs.append(f)
    except (struct.error, ValueError) as exc:
        raise CorruptPayload(f"corrupt rANS index ({_first_line(exc)})") from None
    return ranges, np.stack(freqs) if freqs else np.zeros((0, 256), np.int64), side[pos:]


def _interleave(rest: bytes, ranges: list[tuple[int, int]], coded: bytes) -> bytes:
    """Put the decoded ranges back between the other bytes."""
    out, rest_at, coded_at, cursor = [], 0, 0, 0
    for b, e in ranges:
        out.append(rest[rest_at:rest_at + b - cursor])
        rest_at += b - cursor
        out.append(coded[coded_at:coded_at + e - b])
        coded_at += e - b
        cursor = e
    out.append(rest[rest_at:])
    return b"".join(out)


# --- Choosing a compressor -----------------------------------------------------------------
#
# "auto" codes the payload group by group (`grouped`), each section with the smallest of
# every available codec and layout; the whole-payload compressors stay for comparison and
# for artifacts written by earlier versions.

def _codec(name: str) -> Compressor:
    """A whole-payload compressor made of one of `codecs`' codecs."""
    return Compressor(WHOLE_PAYLOAD_IDS[name], lambda payload: codecs.encode(name, payload),
                      lambda data, limit: codecs.decode(codecs.CODEC_IDS[name], data, limit))


AUTO = "auto"
GROUPS = "groups"  # what auto writes
WHOLE_PAYLOAD_IDS = {"brotli": 5, "zstd": 6}
COMPRESSORS: dict[str, Compressor] = {
    "lzma": Compressor(1, _lzma, _unlzma),  # the reference's: xz, preset 6
    "rans": Compressor(3, _rans_compress, _rans_decompress),
    "brotli": _codec("brotli"),
    "zstd": _codec("zstd"),
    GROUPS: Compressor(4, lambda payload: grouped.compress(payload)[0], grouped.decompress),
}


COMPRESSOR_CHOICES = (AUTO, *(name for name in COMPRESSORS if name != GROUPS))
DEFAULT_COMPRESSOR = AUTO


# Every compressor id a .ptz may name, with the name reports give it: id 2 is rans's first
# version, read but no longer written.
_DECOMPRESSORS: dict[int, tuple[str, Callable[[bytes, int], bytes]]] = {
    **{c.id: (name, c.decompress) for name, c in COMPRESSORS.items()},
    2: ("rans", _rans_v1_decompress),
}


def compress(payload: bytes, compressor: str = DEFAULT_COMPRESSOR) -> tuple[int, bytes]:
    """(the id the header records, the compressed bytes); "auto" writes `groups`."""
    if compressor == AUTO:
        compressor = GROUPS
    if compressor not in COMPRESSORS:
        raise ConfigError(f"unknown compressor {compressor!r}; choose from {', '.join(COMPRESSOR_CHOICES)}")
    spec = COMPRESSORS[compressor]
    return spec.id, spec.compress(payload)


def is_known(compressor_id: int) -> bool:
    return compressor_id in _DECOMPRESSORS


def name_of(compressor_id: int) -> str:
    """The compressor's name ("id N" for an unknown id)."""
    return _DECOMPRESSORS[compressor_id][0] if compressor_id in _DECOMPRESSORS else f"id {compressor_id}"


def decompress(compressor_id: int, data: bytes, limit: int) -> bytes:
    """At most `limit` bytes decoded by the compressor the id names; CorruptPayload otherwise."""
    return _DECOMPRESSORS[compressor_id][1](data, limit)


# --- The payload's first bytes, decoded alone -------------------------------------------------
#
# `inspect` reads a .ptz's description, which the payload's safetensors header holds at its
# start, without decoding the rest: lzma decodes a prefix by itself, and rans keeps the
# payload's bytes before its first coded tensor at the start of its side stream.

class _LzmaPrefix:
    """The first bytes of an xz stream, decoded as far as asked and no further."""

    def __init__(self, data: bytes):
        self.decompressor, self.data, self.buffer = lzma.LZMADecompressor(), data, b""

    def read(self, n: int) -> bytes:
        while len(self.buffer) < n and not self.decompressor.eof:
            try:
                chunk = self.decompressor.decompress(self.data, max_length=n - len(self.buffer))
            except lzma.LZMAError as exc:
                raise CorruptPayload(f"corrupt compressed payload ({_first_line(exc)})") from None
            self.data = b""
            if not chunk and self.decompressor.needs_input:
                break
            self.buffer += chunk
        if len(self.buffer) < n:
            raise CorruptPayload("truncated (the compressed payload ends early)")
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out


def payload_prefix(compressor_id: int, data: bytes, n: int, limit: int = 1 << 30) -> bytes | None:
    """The payload's first n bytes, decoded alone; None where this compressor cannot give
    them without decoding everything (the caller then decompresses the whole payload)."""
    if compressor_id == COMPRESSORS["lzma"].id:
        return _LzmaPrefix(data).read(n)
    if compressor_id == COMPRESSORS[GROUPS].id:
        return grouped.prefix(data, n, limit)
    if compressor_id not in (COMPRESSORS["rans"].id, 2):
        return None
    header = _RANS_HEADER if compressor_id == COMPRESSORS["rans"].id else _RANS_V1_HEADER
    if len(data) < header.size:
        raise CorruptPayload("truncated (no rANS header)")
    side = _LzmaPrefix(data[header.size:header.size + header.unpack_from(data)[0]])
    (count,) = struct.unpack("<I", side.read(4))
    if count > RANS_MAX_RANGES:
        raise CorruptPayload(f"corrupt rANS index ({count} ranges, more than {RANS_MAX_RANGES})")
    first = None
    for _ in range(count):
        b, _e, lo, hi = struct.unpack("<QQHH", side.read(20))
        if hi < lo:
            raise CorruptPayload("corrupt rANS index (bad frequency table)")
        side.read(2 * (hi - lo))
        first = b if first is None else first
    return side.read(n) if first is None or n <= first else None
