"""rANS of int8 code matrices under a frequency table per matrix and class of rows.

The rows of one quantized matrix differ in spread (on the reference's fixed int6 grid a row's
codes spread as its weights do), so one table per matrix spends bits that a table per class
of similar rows saves: each matrix's rows go into ROW_CLASSES classes by the quantiles of
their codes' standard deviation, and every class has its own table. `grouped` offers it for
sections of int8 matrices laid out as stored (the matrices' shapes come from its map).

Body: _HEADER (side bytes, words, symbols, lanes), the side (one xz stream: per matrix its
rows' classes, then per class the nonzero span of its frequencies), the lanes' final states
(uint32), the words in decoding order (uint16).
"""
from __future__ import annotations

import lzma
import struct
from typing import Sequence

import numpy as np

from .codecs import lzma_decode
from .rans import (
    RANS_SCALE_BITS,
    CorruptPayload,
    rans_decode_tables,
    rans_encode,
    rans_lanes,
    symbol_frequencies,
)

ROW_CLASSES = 4
_HEADER = struct.Struct("<QQQI")
_SPAN = struct.Struct("<HH")


def row_classes(codes: np.ndarray) -> np.ndarray:
    """Each row's class (0 .. ROW_CLASSES - 1) by the quantiles of the rows' spread."""
    spread = codes.astype(np.float32).std(axis=1)
    edges = np.quantile(spread, np.linspace(0.0, 1.0, ROW_CLASSES + 1)[1:-1])
    return np.searchsorted(edges, spread).astype(np.uint8)


def encode(data: bytes, shapes: Sequence[tuple[int, int]]) -> bytes:
    """Code the int8 matrices of these shapes [rows, cols], stored one after another."""
    symbols = np.frombuffer(data, dtype=np.uint8) ^ np.uint8(0x80)  # int8 + 128: a contiguous range
    side, tables, table_of, at = [], [], [], 0
    for rows, cols in shapes:
        matrix = symbols[at:at + rows * cols].reshape(rows, cols)
        at += rows * cols
        classes = row_classes(matrix)
        side.append(classes.tobytes())
        for k in range(ROW_CLASSES):
            freq = symbol_frequencies(matrix[classes == k].ravel())
            nonzero = np.flatnonzero(freq)
            side.append(_SPAN.pack(int(nonzero[0]), int(nonzero[-1]) + 1) + freq[nonzero[0]:nonzero[-1] + 1]
                        .astype("<u2").tobytes())
            tables.append(freq)
        table_of.append(np.repeat(len(tables) - ROW_CLASSES + classes.astype(np.int32), cols))
    freq = np.stack(tables) if tables else np.zeros((0, 256), np.int64)
    cum = np.cumsum(freq, axis=1) - freq
    ids = np.concatenate(table_of) if table_of else np.zeros(0, np.int32)
    lanes = rans_lanes(len(symbols))
    words, states = rans_encode(freq[ids, symbols].astype(np.uint16), cum[ids, symbols].astype(np.uint16), lanes)
    packed_side = lzma.compress(b"".join(side), preset=9 | lzma.PRESET_EXTREME)
    return (_HEADER.pack(len(packed_side), len(words), len(symbols), lanes) + packed_side
            + states.astype("<u4").tobytes() + words.astype("<u2").tobytes())


def decode(data: bytes, shapes: Sequence[tuple[int, int]], limit: int) -> bytes:
    """The bytes `encode` coded for these shapes; CorruptPayload for anything else."""
    try:
        side_len, n_words, n_symbols, lanes = _HEADER.unpack_from(data)
    except struct.error:
        raise CorruptPayload("truncated rANS-by-rows section header") from None
    expected = sum(rows * cols for rows, cols in shapes)
    if n_symbols != expected or n_symbols > limit or not 1 <= lanes <= 1 << 16:
        raise CorruptPayload("corrupt rANS-by-rows section header")
    states_at = _HEADER.size + side_len
    if states_at + 4 * lanes + 2 * n_words != len(data):
        raise CorruptPayload("a rANS-by-rows section's length does not match its header")
    side = lzma_decode(data[_HEADER.size:states_at], sum(rows for rows, _ in shapes)
                       + len(shapes) * ROW_CLASSES * (_SPAN.size + 512))
    freq, ids = _parse_side(side, shapes)
    states = np.frombuffer(data, dtype="<u4", count=lanes, offset=states_at)
    words = np.frombuffer(data, dtype="<u2", count=n_words, offset=states_at + 4 * lanes)
    return (rans_decode_tables(words, states, ids, freq) ^ np.uint8(0x80)).tobytes()


def _parse_side(side: bytes, shapes: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The frequency tables and each symbol's table, every value checked."""
    tables, table_of, at = [], [], 0
    try:
        for rows, cols in shapes:
            classes = np.frombuffer(side, dtype=np.uint8, count=rows, offset=at).astype(np.int64)
            at += rows
            if classes.size and int(classes.max()) >= ROW_CLASSES:
                raise ValueError("a row class out of range")
            for _ in range(ROW_CLASSES):
                lo, hi = _SPAN.unpack_from(side, at)
                at += _SPAN.size
                if not lo < hi <= 256:
                    raise ValueError("a frequency span out of range")
                freq = np.zeros(256, dtype=np.int64)
                freq[lo:hi] = np.frombuffer(side, dtype="<u2", count=hi - lo, offset=at)
                at += 2 * (hi - lo)
                if freq.sum() != 1 << RANS_SCALE_BITS:
                    raise ValueError("frequencies that do not sum to the scale")
                tables.append(freq)
            table_of.append(np.repeat(len(tables) - ROW_CLASSES + classes.astype(np.int32), cols))
        if at != len(side):
            raise ValueError("unexpected bytes after the tables")
    except (struct.error, ValueError) as exc:
        raise CorruptPayload(f"corrupt rANS-by-rows side ({exc})") from None
    freq = np.stack(tables) if tables else np.zeros((0, 256), np.int64)
    return freq, np.concatenate(table_of) if table_of else np.zeros(0, np.int32)
