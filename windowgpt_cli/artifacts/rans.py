"""The rANS coder (Duda 2013) that the `.ptz` compressors share, and the error every
decoder raises.

Interleaved range asymmetric numeral systems with 32-bit states and 16-bit output words:
symbol i goes to lane i % lanes, and numpy advances all lanes at once, so the Python loop
takes symbols / lanes steps; each lane's final state costs 4 bytes, so the lane count
grows with the number of symbols.
"""
from __future__ import annotations

import numpy as np


class CorruptPayload(ValueError):
    """A compressed payload that does not decode (truncated, altered or inconsistent)."""



def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


RANS_SCALE_BITS = 15  # symbol frequencies sum to 2**15
RANS_LOW = 1 << 16  # states live in [2**16, 2**32)
RANS_SYMBOLS_PER_LANE = 4096  # lanes: the largest power of two giving each lane at least this many


RANS_MIN_LANES, RANS_MAX_LANES = 64, 8192


_SLOT_MASK = (1 << RANS_SCALE_BITS) - 1


def rans_lanes(symbols: int) -> int:
    """The lane count for this many symbols (a power of two)."""
    return min(RANS_MAX_LANES, max(RANS_MIN_LANES, 1 << max(0, (symbols // RANS_SYMBOLS_PER_LANE).bit_length() - 1)))


def symbol_frequencies(symbols: np.ndarray) -> np.ndarray:
    """Counts scaled to sum to 2**RANS_SCALE_BITS, every symbol present keeping at least 1."""
    counts = np.bincount(symbols, minlength=256).astype(np.int64)
    total = 1 << RANS_SCALE_BITS
    freq = np.where(counts > 0, np.maximum(1, counts * total // max(1, counts.sum())), 0)
    freq[np.argmax(freq)] += total - freq.sum()  # the most frequent symbol absorbs rounding
    return freq


def rans_encode(freq: np.ndarray, cum: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """Code symbol i of frequency freq[i] and cumulative frequency cum[i] (uint16 arrays)
    into lane i % lanes. Returns (16-bit words in decoding order, final lane states)."""
    x = np.full(lanes, RANS_LOW, dtype=np.uint32)
    chunks = []
    for start in reversed(range(0, len(freq), lanes)):  # rANS codes backwards
        stop = min(start + lanes, len(freq))
        xs, f = x[:stop - start], freq[start:stop]
        emit = xs >> (32 - RANS_SCALE_BITS) >= f  # x >= f * 2**17 would overflow at f = 2**15
        chunks.append((xs[emit] & 0xFFFF).astype(np.uint16))
        xs = np.where(emit, xs >> 16, xs)
        q, r = np.divmod(xs, f)
        x[:stop - start] = (q << RANS_SCALE_BITS) + r + cum[start:stop]
    words = np.concatenate(chunks[::-1]) if chunks else np.zeros(0, dtype=np.uint16)
    return words, x


def rans_decode(words: np.ndarray, states: np.ndarray, lengths: list[int], freq: np.ndarray) -> np.ndarray:
    """Decode sum(lengths) symbols: range k's lengths[k] symbols under frequency row freq[k].
    The decoding tables (2**15 slots a row) are built for the rows a batch of lanes spans,
    at most a few at a time, so the decoder's memory stays that of its output."""
    x, lanes = states.astype(np.uint32), len(states)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    total = int(starts[-1])
    out = np.empty(total, dtype=np.uint8)
    built: tuple[int, int] | None = None
    pos = 0
    for start in range(0, total, lanes):
        stop = min(start + lanes, total)
        rows = np.searchsorted(starts, np.arange(start, stop), side="right") - 1
        if built != (int(rows[0]), int(rows[-1])):
            built = (int(rows[0]), int(rows[-1]))
            symbol_of, step_of = decoding_tables(freq[built[0]:built[1] + 1])
        xs = x[:stop - start]
        slot = ((rows - built[0]).astype(np.uint32) << RANS_SCALE_BITS) + (xs & _SLOT_MASK)
        out[start:stop] = symbol_of[slot]
        step = step_of[slot]
        xs = (step >> 16) * (xs >> RANS_SCALE_BITS) + (step & 0xFFFF)  # < 2**32 for any input
        pos = _refill(xs, words, pos)
        x[:stop - start] = xs
    _check_end(x, words, pos)
    return out


def _refill(xs: np.ndarray, words: np.ndarray, pos: int) -> int:
    """Read the next words into the states that fell under RANS_LOW; the words' new position."""
    refill = np.flatnonzero(xs < RANS_LOW)
    if pos + len(refill) > len(words):
        raise CorruptPayload("rANS stream ends early")
    xs[refill] = (xs[refill] << 16) | words[pos:pos + len(refill)].astype(np.uint32)
    return pos + len(refill)


def _check_end(x: np.ndarray, words: np.ndarray, pos: int) -> None:
    if pos != len(words) or np.any(x != RANS_LOW):
        raise CorruptPayload("rANS stream does not decode to its initial state")


def decoding_tables(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per frequency row, each of the 2**15 slots' symbol and decoding step (see _rans_decode)."""
    slots = np.arange(1 << RANS_SCALE_BITS, dtype=np.uint32)
    symbol_of, step_of = [], []
    for f in freq.astype(np.uint32):
        symbol = np.repeat(np.arange(256, dtype=np.uint8), f)
        symbol_of.append(symbol)
        step_of.append((f[symbol] << 16) | (slots - (np.cumsum(f) - f)[symbol]))
    if not symbol_of:
        return np.zeros(0, np.uint8), np.zeros(0, np.uint32)
    return np.concatenate(symbol_of), np.concatenate(step_of)


def rans_decode_tables(words: np.ndarray, states: np.ndarray, table_of: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """Decode len(table_of) symbols, symbol i under frequency row freq[table_of[i]] (rows that
    interleave symbol by symbol, as the row classes of `rans_rows`). A slot's symbol is found
    by binary search in the rows' cumulative frequencies, laid end to end, so memory stays
    that of the rows (not 2**15 entries each)."""
    x, lanes = states.astype(np.uint32), len(states)
    freq = freq.astype(np.int64)
    cum = np.cumsum(freq, axis=1) - freq  # [T, 256]
    span = 1 << RANS_SCALE_BITS
    ends = (np.cumsum(freq, axis=1) + span * np.arange(len(freq))[:, None]).ravel()  # each symbol's slot end
    total = len(table_of)
    out = np.empty(total, dtype=np.uint8)
    pos = 0
    for start in range(0, total, lanes):
        stop = min(start + lanes, total)
        tables = table_of[start:stop]
        xs = x[:stop - start]
        slot = (xs & _SLOT_MASK).astype(np.int64)
        flat = np.searchsorted(ends, tables * span + slot, side="right")
        symbol = flat - tables * 256
        if np.any((symbol < 0) | (symbol > 255)):
            raise CorruptPayload("rANS stream decodes outside its tables")
        out[start:stop] = symbol
        f, c = freq[tables, symbol], cum[tables, symbol]
        xs = (f * (xs >> RANS_SCALE_BITS) + slot - c).astype(np.uint32)
        pos = _refill(xs, words, pos)
        x[:stop - start] = xs
    _check_end(x, words, pos)
    return out
