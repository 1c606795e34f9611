"""The `.ptz` artifact: a quantized model in a format that cannot run code.

Layout: the magic bytes `WGPTZ`, one byte of format version, one byte naming the
compressor, the payload's size (8 bytes, little-endian) and sha256 (32 bytes), then the
compressed payload. Decompression stops at the declared size, so a small file cannot
inflate beyond it, and the payload must match its hash. The payload is a safetensors file (see
`tensorfile`) holding the int8 codes, scales and kept tensors, whose metadata holds one
JSON document: the format version, the run configuration, how each tensor was quantized
(scheme, original dtype, shape), the tokenizer's sha256 and where the weights came from.

Compressors: `lzma` (xz preset 6, the reference's) and `rans`, which entropy-codes the
int6/int8 codes with their own per-tensor statistics and gives the rest to lzma: 7-9%
smaller than lzma on quantized models. (Other lzma settings, zlib and bz2 were measured
and are not offered: none was smaller by more than 0.5%, zlib and bz2 were 5-10% larger.)

The reference wrote an lzma-compressed pickle; loading one can execute arbitrary code, so
windowgpt never unpickles an artifact, and anything that is not a `.ptz` of this version
is refused with one line.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from . import tensorfile
from .artifacts import atomic_write_bytes, is_sha256
from .config import RunConfig
from .errors import ArtifactError, ConfigError
from .quant import CONTROL, INT6, INT8, PASSTHROUGH, SCHEMES, QuantizedTensor, dequantize_state_dict

MAGIC = b"WGPTZ"
FORMAT_VERSION = 2  # 2: the payload's size and sha256 in the header
_SIZE_AND_HASH = struct.Struct("<Q32s")
HEADER_BYTES = len(MAGIC) + 2 + _SIZE_AND_HASH.size
METADATA_KEY = "windowgpt.ptz"
# Artifacts are meant to fit in 16 MB compressed; no payload of a sensible model nears this.
MAX_PAYLOAD_BYTES = 1 << 30
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in tensorfile.DTYPE_CODES}


class CorruptPayload(ValueError):
    """A compressed payload that does not decode (truncated, altered or inconsistent)."""


@dataclass(frozen=True)
class Compressor:
    id: int  # stored in the .ptz header
    compress: Callable[[bytes], bytes]
    decompress: Callable[[bytes, int], bytes]  # (data, max output bytes); raises CorruptPayload


def _lzma(b: bytes) -> bytes:
    return lzma.compress(b, preset=6)


def _unlzma(data: bytes, limit: int) -> bytes:
    """Decompress one xz stream, refusing truncated or trailing data."""
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


# --- rANS for int8 codes -------------------------------------------------------------------
#
# LZ-style compressors spend several percent more than the entropy of int6/int8 codes,
# which are nearly independent draws from a per-tensor distribution. The "rans" compressor
# codes every int8 tensor of the payload with an interleaved range asymmetric numeral
# system (Duda 2013; 32-bit states, 16-bit output words) under that tensor's own symbol
# frequencies, within a few bytes of their order-0 entropy, and leaves the rest (header,
# scales, kept tensors, frequency tables) to lzma.

RANS_SCALE_BITS = 15  # symbol frequencies sum to 2**15
RANS_LOW = 1 << 16  # states live in [2**16, 2**32)
RANS_LANES = 1024  # symbols coded side by side: numpy works on a lane vector per step
RANS_MIN_SYMBOLS = 4096  # smaller int8 tensors stay with lzma
_RANS_HEADER = struct.Struct("<QQQI")  # side bytes, words, symbols, crc32 of the payload


def _symbol_frequencies(symbols: np.ndarray) -> np.ndarray:
    """Counts scaled to sum to 2**RANS_SCALE_BITS, every symbol present keeping at least 1."""
    counts = np.bincount(symbols, minlength=256).astype(np.int64)
    total = 1 << RANS_SCALE_BITS
    freq = np.where(counts > 0, np.maximum(1, counts * total // max(1, counts.sum())), 0)
    freq[np.argmax(freq)] += total - freq.sum()  # the most frequent symbol absorbs rounding
    return freq.astype(np.uint64)


def _rans_encode(symbols: np.ndarray, table: np.ndarray, freq: np.ndarray, cum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Code symbols (uint8) under freq/cum[table[i]]; symbol i goes to lane i % LANES.
    Returns (16-bit words in decoding order, final lane states)."""
    x = np.full(RANS_LANES, RANS_LOW, dtype=np.uint64)
    chunks = []
    for start in reversed(range(0, len(symbols), RANS_LANES)):  # rANS codes backwards
        stop = min(start + RANS_LANES, len(symbols))
        s, t = symbols[start:stop], table[start:stop]
        f, c, xs = freq[t, s], cum[t, s], x[:stop - start]
        emit = xs >= f << np.uint64(32 - RANS_SCALE_BITS)
        chunks.append((xs[emit] & np.uint64(0xFFFF)).astype(np.uint16))
        xs = np.where(emit, xs >> np.uint64(16), xs)
        x[:stop - start] = ((xs // f) << np.uint64(RANS_SCALE_BITS)) + xs % f + c
    words = np.concatenate(chunks[::-1]) if chunks else np.zeros(0, dtype=np.uint16)
    return words, x.astype(np.uint32)


def _rans_decode(words: np.ndarray, states: np.ndarray, table: np.ndarray, freq: np.ndarray, cum: np.ndarray,
                 lookup: np.ndarray) -> np.ndarray:
    x = states.astype(np.uint64)
    out = np.empty(len(table), dtype=np.uint8)
    words = words.astype(np.uint64)
    mask, pos = np.uint64((1 << RANS_SCALE_BITS) - 1), 0
    for start in range(0, len(table), RANS_LANES):
        stop = min(start + RANS_LANES, len(table))
        t, xs = table[start:stop], x[:stop - start]
        slot = xs & mask
        s = lookup[t, slot]
        out[start:stop] = s
        xs = freq[t, s] * (xs >> np.uint64(RANS_SCALE_BITS)) + slot - cum[t, s]
        refill = np.flatnonzero(xs < RANS_LOW)
        if pos + len(refill) > len(words):
            raise CorruptPayload("rANS stream ends early")
        xs[refill] = (xs[refill] << np.uint64(16)) | words[pos:pos + len(refill)]
        pos += len(refill)
        x[:stop - start] = xs
    if pos != len(words) or np.any(x != RANS_LOW):
        raise CorruptPayload("rANS stream does not decode to its initial state")
    return out


def _int8_ranges(payload: bytes) -> list[tuple[int, int]]:
    """Absolute byte ranges of the payload's int8 tensors worth entropy coding."""
    entries, _, start = tensorfile.layout(payload, "payload")
    return sorted((start + b, start + e) for dtype, _, (b, e) in entries.values()
                  if dtype == torch.int8 and e - b >= RANS_MIN_SYMBOLS)


def _rans_compress(payload: bytes) -> bytes:
    ranges = _int8_ranges(payload)
    view = np.frombuffer(payload, dtype=np.uint8)
    # int8 -> uint8 offset by 128, so a symmetric range of codes is one contiguous run
    pieces = [(view[b:e].view(np.int8).astype(np.int16) + 128).astype(np.uint8) for b, e in ranges]
    freq = np.stack([_symbol_frequencies(p) for p in pieces]) if pieces else np.zeros((0, 256), np.uint64)
    cum = np.cumsum(freq, axis=1) - freq
    symbols = np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
    table = np.repeat(np.arange(len(pieces), dtype=np.int32), [len(p) for p in pieces])
    words, states = _rans_encode(symbols, table, freq, cum)
    side = _rans_side(payload, ranges, freq)
    return (_RANS_HEADER.pack(len(side), len(words), len(symbols), zlib.crc32(payload)) + side
            + states.astype("<u4").tobytes() + words.astype("<u2").tobytes())


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
    side_len, n_words, n_symbols, crc = _RANS_HEADER.unpack_from(data)
    states_at = _RANS_HEADER.size + side_len
    words_at = states_at + 4 * RANS_LANES
    if words_at + 2 * n_words != len(data):
        raise CorruptPayload(f"truncated or padded ({len(data)} bytes, the header implies {words_at + 2 * n_words})")
    side = _unlzma(data[_RANS_HEADER.size:states_at], limit)
    ranges, freq, rest = _parse_rans_side(side)
    lengths = [e - b for b, e in ranges]
    if sum(lengths) != n_symbols or n_symbols + len(rest) > limit:
        raise CorruptPayload("rANS index does not match its stream")
    cum = np.cumsum(freq, axis=1) - freq
    lookup = np.stack([np.repeat(np.arange(256, dtype=np.uint8), f.astype(np.int64)) for f in freq]) \
        if len(freq) else np.zeros((0, 1 << RANS_SCALE_BITS), np.uint8)
    table = np.repeat(np.arange(len(ranges), dtype=np.int32), lengths)
    states = np.frombuffer(data, dtype="<u4", count=RANS_LANES, offset=states_at)
    words = np.frombuffer(data, dtype="<u2", count=n_words, offset=words_at)
    symbols = ((_rans_decode(words, states, table, freq, cum, lookup).astype(np.int16) - 128).astype(np.int8))
    payload = _interleave(rest, ranges, symbols.tobytes())
    if zlib.crc32(payload) != crc:
        raise CorruptPayload("payload checksum mismatch")
    return payload


def _parse_rans_side(side: bytes) -> tuple[list[tuple[int, int]], np.ndarray, bytes]:
    try:
        (count,) = struct.unpack_from("<I", side)
        pos, ranges, freqs = 4, [], []
        for _ in range(count):
            b, e, lo, hi = struct.unpack_from("<QQHH", side, pos)
            pos += 20
            f = np.zeros(256, dtype=np.uint64)
            f[lo:hi] = np.frombuffer(side, dtype="<u2", count=hi - lo, offset=pos)
            pos += 2 * (hi - lo)
            if f.sum() != 1 << RANS_SCALE_BITS or not (ranges[-1][1] if ranges else 0) <= b <= e:
                raise ValueError("bad frequency table or range")
            ranges.append((b, e))
            freqs.append(f)
    except (struct.error, ValueError) as exc:
        raise CorruptPayload(f"corrupt rANS index ({_first_line(exc)})") from None
    return ranges, np.stack(freqs) if freqs else np.zeros((0, 256), np.uint64), side[pos:]


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


COMPRESSORS: dict[str, Compressor] = {
    "lzma": Compressor(1, _lzma, _unlzma),  # the reference's: xz, preset 6
    "rans": Compressor(2, _rans_compress, _rans_decompress),
}
DEFAULT_COMPRESSOR = "lzma"


@dataclass
class PtzArtifact:
    config: RunConfig
    tensors: dict[str, QuantizedTensor]  # per-layer names (model.unbank_state_dict)
    tokenizer_sha256: str | None = None
    source: dict[str, Any] = field(default_factory=dict)  # where the weights came from
    clip_range: int = 31

    def dequantized(self) -> dict[str, Tensor]:
        return dequantize_state_dict(self.tensors)


# --- Writing -----------------------------------------------------------------------------

def payload_tensors(tensors: dict[str, QuantizedTensor]) -> dict[str, Tensor]:
    """The stored tensors: `name.q` (codes) and `name.scale` for quantized ones, `name` for
    kept ones; all codes first, then kept tensors, then scales, so that like bytes are
    contiguous for the compressor."""
    codes = {name + ".q": qt.values for name, qt in tensors.items() if qt.scale is not None}
    kept = {name: qt.values for name, qt in tensors.items() if qt.scale is None}
    scales = {name + ".scale": qt.scale for name, qt in tensors.items() if qt.scale is not None}
    return {**codes, **kept, **scales}


def payload_bytes(artifact: PtzArtifact) -> bytes:
    """The uncompressed payload: a safetensors file."""
    meta = {
        "format_version": FORMAT_VERSION,
        "config": artifact.config.to_dict(),
        "clip_range": artifact.clip_range,
        "tensors": {name: _tensor_meta(qt) for name, qt in artifact.tensors.items()},
        "tokenizer_sha256": artifact.tokenizer_sha256,
        "source": artifact.source,
    }
    text = json.dumps(meta, separators=(",", ":"))
    return tensorfile.dumps(payload_tensors(artifact.tensors), {METADATA_KEY: text})


def _tensor_meta(qt: QuantizedTensor) -> dict[str, Any]:
    meta: dict[str, Any] = {"scheme": qt.scheme, "dtype": str(qt.dtype).removeprefix("torch."), "shape": list(qt.shape)}
    if qt.method:
        meta["method"] = qt.method
    return meta


def encode(artifact: PtzArtifact, compressor: str = DEFAULT_COMPRESSOR) -> bytes:
    return compress_payload(payload_bytes(artifact), compressor)


def compress_payload(payload: bytes, compressor: str = DEFAULT_COMPRESSOR) -> bytes:
    if compressor not in COMPRESSORS:
        raise ConfigError(f"unknown compressor {compressor!r}; choose from {', '.join(COMPRESSORS)}")
    spec = COMPRESSORS[compressor]
    header = MAGIC + bytes([FORMAT_VERSION, spec.id]) + _SIZE_AND_HASH.pack(len(payload), hashlib.sha256(payload).digest())
    return header + spec.compress(payload)


def save(path: Path, artifact: PtzArtifact, compressor: str = DEFAULT_COMPRESSOR) -> int:
    """Write the artifact atomically; returns its size in bytes."""
    data = encode(artifact, compressor)
    atomic_write_bytes(path, data)
    return len(data)


# --- Reading -----------------------------------------------------------------------------

def load(path: Path) -> PtzArtifact:
    path = Path(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a directory, not a .ptz file") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return decode(data, str(path))


def decode(data: bytes, source: str = ".ptz") -> PtzArtifact:
    payload = decompress_payload(data, source)
    stored, metadata = tensorfile.loads(payload, source=f"{source} (payload)")
    meta = _parse_metadata(metadata, source)
    try:
        config = RunConfig.from_dict(meta["config"], source=f"{source} config")
    except ConfigError as exc:
        raise ArtifactError(str(exc)) from None
    clip_range = meta.get("clip_range")
    if not isinstance(clip_range, int) or not 1 <= clip_range <= 127:
        raise ArtifactError(f"{source}: invalid clip_range {clip_range!r}")
    tensors = _rebuild_tensors(meta["tensors"], stored, clip_range, source)
    tokenizer = meta.get("tokenizer_sha256")
    if not is_sha256(tokenizer):
        raise ArtifactError(f"{source}: records no tokenizer sha256")
    source_info = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    return PtzArtifact(config, tensors, tokenizer, source_info, clip_range)


def decompress_payload(data: bytes, source: str) -> bytes:
    if data[:len(MAGIC)] != MAGIC:
        raise ArtifactError(f"{source}: not a windowgpt .ptz file{_foreign_format_hint(data)}")
    if len(data) < HEADER_BYTES:
        raise ArtifactError(f"{source}: truncated .ptz header ({len(data)} bytes)")
    version, compressor_id = data[len(MAGIC)], data[len(MAGIC) + 1]
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{source}: .ptz format version {version} is not supported (this windowgpt reads "
                            f"version {FORMAT_VERSION}); quantize the model again")
    spec = next((c for c in COMPRESSORS.values() if c.id == compressor_id), None)
    if spec is None:
        raise ArtifactError(f"{source}: unknown compressor id {compressor_id}")
    size, digest = _SIZE_AND_HASH.unpack_from(data, len(MAGIC) + 2)
    if size > MAX_PAYLOAD_BYTES:
        raise ArtifactError(f"{source}: declares a payload of {size:,} bytes, more than the {MAX_PAYLOAD_BYTES:,} "
                            "any artifact needs")
    try:
        payload = spec.decompress(data[HEADER_BYTES:], size)
    except CorruptPayload as exc:
        raise ArtifactError(f"{source}: {exc}") from None
    if len(payload) != size:
        raise ArtifactError(f"{source}: the payload is {len(payload):,} bytes, the header declares {size:,}")
    if hashlib.sha256(payload).digest() != digest:
        raise ArtifactError(f"{source}: the payload does not match the sha256 in its header (corrupt or altered)")
    return payload


def _foreign_format_hint(data: bytes) -> str:
    if data[:6] == b"\xfd7zXZ\x00" or data[:1] == b"\x80" or data[:2] == b"PK":
        return (" (it looks like a pickle, compressed or in a torch.save zip, as the reference writes; "
                "windowgpt never unpickles, since that can run code)")
    return ""


def _parse_metadata(metadata: dict[str, str], source: str) -> dict[str, Any]:
    if METADATA_KEY not in metadata:
        raise ArtifactError(f"{source}: payload has no {METADATA_KEY} metadata")
    try:
        meta = json.loads(metadata[METADATA_KEY])
    except ValueError:
        raise ArtifactError(f"{source}: {METADATA_KEY} metadata is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ArtifactError(f"{source}: payload format version {version!r} is not supported (expected {FORMAT_VERSION})")
    if not isinstance(meta.get("config"), dict) or not isinstance(meta.get("tensors"), dict):
        raise ArtifactError(f"{source}: metadata lacks the config or the tensor list")
    return meta


def _rebuild_tensors(described: dict[str, Any], stored: dict[str, Tensor], clip_range: int,
                     source: str) -> dict[str, QuantizedTensor]:
    tensors: dict[str, QuantizedTensor] = {}
    used: set[str] = set()
    for name, info in described.items():
        qt = _rebuild_one(name, info, stored, clip_range, f"{source}: tensor {name!r}")
        tensors[name] = qt
        used.update([name] if qt.scale is None else [name + ".q", name + ".scale"])
    extra = sorted(set(stored) - used)
    if extra:
        raise ArtifactError(f"{source}: payload holds tensors the metadata does not describe ({extra[0]}, ...)")
    return tensors


def _rebuild_one(name: str, info: Any, stored: dict[str, Tensor], clip_range: int, where: str) -> QuantizedTensor:
    if not isinstance(info, dict) or info.get("scheme") not in SCHEMES or info.get("dtype") not in DTYPES:
        raise ArtifactError(f"{where} has an invalid description {info!r}")
    scheme, dtype = info["scheme"], DTYPES[info["dtype"]]
    shape = tuple(info.get("shape", ()))
    method = info.get("method", "")
    if scheme in (PASSTHROUGH, CONTROL):
        values = _stored(stored, name, where)
        expected = {CONTROL: {torch.float32}, PASSTHROUGH: {torch.float16} if dtype.is_floating_point else {dtype}}
        if values.dtype not in expected[scheme] or tuple(values.shape) != shape:
            raise ArtifactError(f"{where} is stored as {values.dtype} {tuple(values.shape)}, "
                                f"which does not match {scheme} {shape}")
        return QuantizedTensor(scheme, dtype, values, None, method)
    codes, scale = _stored(stored, name + ".q", where), _stored(stored, name + ".scale", where)
    limit = clip_range if scheme == INT6 else 127
    scale_shape = (shape[0],) if len(shape) == 2 else ()
    if codes.dtype != torch.int8 or tuple(codes.shape) != shape or tuple(scale.shape) != scale_shape \
            or not scale.dtype.is_floating_point:
        raise ArtifactError(f"{where}: stored codes or scales do not match its {scheme} description")
    if codes.numel() and int(codes.to(torch.int16).abs().max()) > limit:
        raise ArtifactError(f"{where}: codes exceed the {scheme} range of +-{limit}")
    assert scheme in (INT6, INT8)
    return QuantizedTensor(scheme, dtype, codes, scale, method)


def _stored(stored: dict[str, Tensor], key: str, where: str) -> Tensor:
    if key not in stored:
        raise ArtifactError(f"{where}: payload lacks {key!r}")
    return stored[key]


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
