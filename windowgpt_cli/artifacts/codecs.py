"""Byte codecs that a `.ptz` section may use, each named in the artifact by a one-byte id.

- lzma: xz at preset 9 with the extreme flag (the section coder the standard library has);
- brotli: quality 11, a 16 MB window (the `brotli` package: `pip install 'windowgpt[compress]'`);
- zstd: level 22 (the `zstandard` package, the same extra);
- rans: an order-0 rANS coder of the section's bytes under one frequency table, which
  reaches their order-0 entropy within a few bytes per lane: the right coder for codes
  that are close to independent draws (`rans` holds the coder itself).

Every decoder stops at the size it is told to expect, so a small section cannot inflate
beyond it, and raises `CorruptPayload` on anything it cannot decode. Codecs whose package is
missing are left out of `available()`; a section that names one is refused in one line.
"""
from __future__ import annotations

import importlib.util
import io
import lzma
import struct
from typing import Callable

import numpy as np

from ..errors import ConfigError
from .rans import RANS_SCALE_BITS, CorruptPayload, rans_decode, rans_encode, rans_lanes, symbol_frequencies
from .rans import first_line as _first_line

CODEC_IDS = {"lzma": 1, "rans": 2, "brotli": 3, "zstd": 4}
CODEC_NAMES = {i: name for name, i in CODEC_IDS.items()}
PACKAGES = {"brotli": "brotli", "zstd": "zstandard"}  # codec -> the package it needs
BROTLI_QUALITY, BROTLI_WINDOW_BITS = 11, 24
ZSTD_LEVEL = 22


def missing_package(codec: str) -> str | None:
    """The package a codec needs that is not installed, else None."""
    package = PACKAGES.get(codec)
    return package if package and importlib.util.find_spec(package) is None else None


def available() -> tuple[str, ...]:
    return tuple(name for name in CODEC_IDS if missing_package(name) is None)


def require(codec: str) -> None:
    package = missing_package(codec)
    if package:
        raise ConfigError(f"the {codec} codec needs the {package} package: pip install 'windowgpt[compress]'")


def encode(codec: str, data: bytes) -> bytes:
    require(codec)
    return _ENCODERS[codec](data)


def decode(codec_id: int, data: bytes, limit: int) -> bytes:
    """At most `limit` bytes decoded by the codec the id names; CorruptPayload otherwise."""
    if codec_id not in CODEC_NAMES:
        raise CorruptPayload(f"unknown section codec id {codec_id}")
    codec = CODEC_NAMES[codec_id]
    package = missing_package(codec)
    if package:
        raise CorruptPayload(f"a section is {codec}-coded; reading it needs the {package} package "
                             "(pip install 'windowgpt[compress]')")
    out = _DECODERS[codec](data, limit)
    if len(out) > limit:
        raise CorruptPayload(f"a {codec} section inflates beyond the {limit:,} bytes declared")
    return out


# --- lzma -----------------------------------------------------------------------------------

def _lzma_encode(data: bytes) -> bytes:
    return lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)


def lzma_decode(data: bytes, limit: int) -> bytes:
    """Decompress one xz stream of at most `limit` bytes, refusing truncated or trailing
    data (also the reference's whole-payload lzma, `compressors`)."""
    decompressor = lzma.LZMADecompressor()
    try:
        out = decompressor.decompress(data, limit)
    except lzma.LZMAError as exc:
        raise CorruptPayload(f"corrupt compressed payload ({_first_line(exc)})") from None
    if not decompressor.eof:
        if not decompressor.needs_input:
            raise CorruptPayload(f"the payload inflates beyond the {limit:,} bytes its header declares")
        raise CorruptPayload("truncated (the compressed payload ends early)")
    if decompressor.unused_data:
        raise CorruptPayload("unexpected bytes after the compressed payload")
    return out


# --- brotli and zstd ----------------------------------------------------------------------

def _brotli_encode(data: bytes) -> bytes:
    import brotli

    return brotli.compress(data, quality=BROTLI_QUALITY, lgwin=BROTLI_WINDOW_BITS)


def _brotli_decode(data: bytes, limit: int) -> bytes:
    import brotli

    decompressor = brotli.Decompressor()
    try:
        out = decompressor.process(data, output_buffer_limit=limit + 1)
    except brotli.error as exc:
        raise CorruptPayload(f"corrupt brotli section ({_first_line(exc)})") from None
    if len(out) <= limit and not decompressor.is_finished():
        raise CorruptPayload("a brotli section is truncated")
    return out


def _zstd_encode(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def _zstd_decode(data: bytes, limit: int) -> bytes:
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=False) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"corrupt zstd section ({_first_line(exc)})") from None
    return out


# --- order-0 rANS of bytes ------------------------------------------------------------------
#
# Layout: _RANS_BYTES_HEADER (symbols, lanes, words, lowest and one past the highest byte
# value present), their frequencies (uint16), the lanes' final states (uint32), the words
# in decoding order (uint16).

_RANS_BYTES_HEADER = struct.Struct("<QIQHH")


def _rans_bytes_encode(data: bytes) -> bytes:
    symbols = np.frombuffer(data, dtype=np.uint8)
    freq = symbol_frequencies(symbols)
    cum = np.cumsum(freq) - freq
    lanes = rans_lanes(len(symbols))
    words, states = rans_encode(freq[symbols].astype(np.uint16), cum[symbols].astype(np.uint16), lanes)
    nonzero = np.flatnonzero(freq)
    lo, hi = (int(nonzero[0]), int(nonzero[-1]) + 1) if len(nonzero) else (0, 0)
    return (_RANS_BYTES_HEADER.pack(len(symbols), lanes, len(words), lo, hi) + freq[lo:hi].astype("<u2").tobytes()
            + states.astype("<u4").tobytes() + words.astype("<u2").tobytes())


def _rans_bytes_decode(data: bytes, limit: int) -> bytes:
    try:
        n, lanes, n_words, lo, hi = _RANS_BYTES_HEADER.unpack_from(data)
    except struct.error:
        raise CorruptPayload("truncated rANS section header") from None
    if n > limit or not 1 <= lanes <= 1 << 16 or not lo <= hi <= 256:
        raise CorruptPayload("corrupt rANS section header")
    at = _RANS_BYTES_HEADER.size
    if at + 2 * (hi - lo) + 4 * lanes + 2 * n_words != len(data):
        raise CorruptPayload("a rANS section's length does not match its header")
    freq = np.zeros(256, dtype=np.int64)
    freq[lo:hi] = np.frombuffer(data, dtype="<u2", count=hi - lo, offset=at)
    if n and freq.sum() != 1 << RANS_SCALE_BITS:
        raise CorruptPayload("corrupt rANS section frequencies")
    at += 2 * (hi - lo)
    states = np.frombuffer(data, dtype="<u4", count=lanes, offset=at)
    words = np.frombuffer(data, dtype="<u2", count=n_words, offset=at + 4 * lanes)
    if n == 0:
        return b""
    return rans_decode(words, states, [n], freq[None, :]).tobytes()


_ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "lzma": _lzma_encode, "rans": _rans_bytes_encode, "brotli": _brotli_encode, "zstd": _zstd_encode}
_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "lzma": lzma_decode, "rans": _rans_bytes_decode, "brotli": _brotli_decode, "zstd": _zstd_decode}
