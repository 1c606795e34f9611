"""The `groups` compressor: the payload's tensors coded group by group, each group with the
codec and the byte layout that make it smallest.

A section holds the tensors of one kind (codes, scales, kept values, LQER factors) of one
tensor group (attention, MLP, embeddings, other, control), laid out by one transform:

- none: the bytes as stored;
- transpose: a matrix's codes column by column (neighbouring rows' codes side by side);
- sort: a matrix's rows reordered so that similar rows are neighbours (greedy nearest
  neighbour in Euclidean distance), the permutation stored;
- sort_transpose: both, sorted first;
- shuffle: the bytes of multi-byte values as planes (every first byte, then every second).

Each section is then coded by a codec of `codecs`, or, when it holds int8 matrices laid
out as stored or transposed, by `rans_rows` (a table per matrix and class of rows, or of
columns when transposed; the map gives it the matrices' shapes). The columns of trained
codes differ in spread more than their rows (each input channel's weights have their own
scale), so classes of columns code them smaller. `compress(payload)` lays each section out
every way that applies, keeps the layout a fast stand-in codec (zlib) codes smallest, codes
it and the bytes as stored with every available codec and keeps the smallest (the work runs
in threads: the codecs release the GIL). On a large section the slow codecs (lzma, brotli, zstd: seconds a
megabyte) first code a sample, and code the whole section only where the sample says they
may come within SAMPLE_MARGIN of rANS's best. `exhaustive=True` codes every layout with
every codec; `compress(payload, codecs=..., transforms=...)` restricts the search.
Everything else (the safetensors header, the tensors too small to be worth a section) goes,
with the map of the sections, into the first section, coded by lzma.

Stream (compressor id 4): _HEADER (the map's compressed and raw length, the payload's
crc32), the map section, then each section's bytes. The map: the section count; per
section its codec, transform, raw and compressed length, range count, and per range the
payload offsets, rows, columns, item size and, when sorted, the permutation; then the
payload's bytes outside every range.
"""
from __future__ import annotations

import struct
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..model.state_dict import tensor_group
from ..storage import tensorfile
from . import codecs, rans_rows
from .rans import CorruptPayload

TRANSFORMS = ("none", "transpose", "sort", "sort_transpose", "shuffle")
_TRANSFORM_IDS = {name: i for i, name in enumerate(TRANSFORMS)}
# A section's codec: one of `codecs`' byte codecs, or rans_rows (int8 matrices as stored or
# transposed, a table per matrix and class of rows), which needs the matrices' shapes from
# the map.
BY_ROWS_LAYOUTS = ("none", "transpose")
SECTION_CODEC_IDS = {**codecs.CODEC_IDS, "rans_rows": 5}
SECTION_CODEC_NAMES = {i: name for name, i in SECTION_CODEC_IDS.items()}
RANS_ROWS_MAX_MATRICES = 1024  # bounds the decoder's tables (ROW_CLASSES rows of 256 a matrix)
MIN_SECTION_TENSOR_BYTES = 1024  # smaller tensors stay in the map section
MAX_SECTIONS = 256
MAX_RANGES = 1 << 16
_HEADER = struct.Struct("<QQI")
_SECTION = struct.Struct("<BBQQI")  # codec id, transform id, raw bytes, compressed bytes, ranges
_RANGE = struct.Struct("<QQIIB")  # payload begin, end, rows, columns, item size


@dataclass
class Range:
    begin: int
    end: int
    rows: int
    cols: int
    itemsize: int
    order: np.ndarray | None = None  # the rows' order when sorted

    def matrix(self, payload: bytes | memoryview) -> np.ndarray:
        """The range's bytes as [rows, cols * itemsize]."""
        return np.frombuffer(payload, dtype=np.uint8, count=self.end - self.begin,
                             offset=self.begin).reshape(self.rows, self.cols * self.itemsize)


@dataclass
class Section:
    name: str  # "group/kind", for reports
    ranges: list[Range]
    transform: str = "none"
    codec: str = "lzma"
    raw_bytes: int = 0
    body: bytes = b""
    transforms: tuple[str, ...] = field(default=("none",))  # those that apply to it
    stored_bytes: int = 0  # the body's length, as a stream's map gives it


# --- Planning ---------------------------------------------------------------------------------

def _kind(key: str, dtype: str) -> tuple[str, str]:
    """(tensor name, kind) of a payload tensor's key."""
    for suffix, kind in ((".q", "codes"), (".scale", "scales")):
        if key.endswith(suffix) and ".lqer_" not in key:
            return key[: -len(suffix)], kind
    if ".lqer_" in key:
        return key.split(".lqer_")[0], "lqer"
    return key, "kept"


def plan_sections(payload: bytes) -> list[Section]:
    """The payload's tensors large enough to be worth it, in sections by group and kind."""
    entries, _, start = tensorfile.layout(payload, "payload")
    sections: dict[str, Section] = {}
    for key, (dtype, shape, (b, e)) in entries.items():
        if e - b < MIN_SECTION_TENSOR_BYTES:
            continue
        name, kind = _kind(key, dtype)
        itemsize = tensorfile.ITEM_SIZES[dtype]
        rows = shape[0] if len(shape) >= 1 else 1
        cols = (e - b) // itemsize // max(rows, 1)
        label = f"{tensor_group(name)}/{kind}"
        section = sections.setdefault(label, Section(label, []))
        section.ranges.append(Range(start + b, start + e, rows, cols, itemsize))
    for section in sections.values():
        section.transforms = _applicable(section.ranges)
        section.raw_bytes = sum(r.end - r.begin for r in section.ranges)
    return list(sections.values())


def _applicable(ranges: Sequence[Range]) -> tuple[str, ...]:
    if all(r.itemsize > 1 for r in ranges):
        return ("none", "shuffle")
    if all(r.itemsize == 1 and r.rows > 1 and r.cols > 1 for r in ranges):
        return ("none", "transpose", "sort", "sort_transpose")
    return ("none",)


# --- Transforms ---------------------------------------------------------------------------------

def similarity_order(rows: np.ndarray) -> np.ndarray:
    """A greedy nearest-neighbour tour of the rows (Euclidean), from row 0."""
    x = rows.astype(np.float32)
    n = len(x)
    norms = (x * x).sum(axis=1)
    distances = norms[:, None] + norms[None, :] - 2.0 * (x @ x.T)
    order = np.empty(n, dtype=np.int64)
    visited = np.zeros(n, dtype=bool)
    current = 0
    for i in range(n):
        order[i] = current
        visited[current] = True
        if i + 1 < n:
            d = np.where(visited, np.inf, distances[current])
            current = int(np.argmin(d))
    return order


def _forward(payload: bytes, r: Range, transform: str) -> bytes:
    m = r.matrix(payload)
    if transform in ("sort", "sort_transpose"):
        assert r.order is not None
        m = m[r.order]
    if transform in ("transpose", "sort_transpose"):
        m = m.T
    if transform == "shuffle":
        m = m.reshape(-1, r.itemsize).T
    return np.ascontiguousarray(m).tobytes()


def _inverse(data: bytes, r: Range, transform: str) -> bytes:
    m = np.frombuffer(data, dtype=np.uint8)
    width = r.cols * r.itemsize
    if transform == "shuffle":
        return np.ascontiguousarray(m.reshape(r.itemsize, -1).T).tobytes()
    if transform in ("transpose", "sort_transpose"):
        m = m.reshape(width, r.rows).T
    else:
        m = m.reshape(r.rows, width)
    if transform in ("sort", "sort_transpose"):
        assert r.order is not None
        restored = np.empty_like(m)
        restored[r.order] = m
        m = restored
    return np.ascontiguousarray(m).tobytes()


def _laid_out(payload: bytes, section: Section, transform: str) -> bytes:
    if transform in ("sort", "sort_transpose"):
        for r in section.ranges:
            if r.order is None:
                r.order = similarity_order(r.matrix(payload))
    return b"".join(_forward(payload, r, transform) for r in section.ranges)


def _order_bytes(section: Section, transform: str) -> int:
    """What storing the section's permutations costs in the map."""
    if transform not in ("sort", "sort_transpose"):
        return 0
    return sum(r.rows * (2 if r.rows <= 1 << 16 else 4) for r in section.ranges)


# --- Compressing --------------------------------------------------------------------------------

# The layout search's stand-in codec: fast, and like the real ones it finds repeats and
# skewed byte statistics, so the layout it codes smallest is nearly always theirs too.
PROXY_LEVEL = 6


# Sections of at least SAMPLE_MIN_BYTES judge the slow codecs by a sample: SAMPLE_CHUNK-byte
# pieces evenly spaced over the section, an eighth of it (at least SAMPLE_MIN_BYTES / 2). A
# codec's size is estimated as the section's rANS size times the codec's size over rANS's on
# the sample: the ratio to the order-0 coder barely depends on which matrices the sample
# reaches, where a sample's own size does (within 1% on trained int6 codes, against 2-10%).
SLOW_CODECS = ("lzma", "brotli", "zstd")
SAMPLE_MIN_BYTES = 4 << 20
SAMPLE_CHUNK = 1 << 16
SAMPLE_MARGIN = 0.01


def compress(payload: bytes, codecs_tried: Iterable[str] | None = None,
             transforms: Iterable[str] | None = None, workers: int = 8,
             exhaustive: bool = False) -> tuple[bytes, list[Section]]:
    """The stream and its sections (with the codec and transform each one chose). Each codec
    codes two layouts of a section, the one zlib (level PROXY_LEVEL) codes smallest and the
    bytes as stored, and the smallest is kept; exhaustive: every codec codes every layout
    (about three times the time where four layouts apply) and no codec is judged by a sample."""
    tried = tuple(codecs_tried) if codecs_tried is not None else codecs.available()
    for codec in tried:
        codecs.require(codec)
    allowed = tuple(transforms) if transforms is not None else TRANSFORMS
    sections = plan_sections(payload)
    with ThreadPoolExecutor(workers) as pool:
        layouts = {id(section): [(t, _laid_out(payload, section, t)) for t in section.transforms
                                 if t in allowed or t == "none" and not set(allowed) & set(section.transforms)]
                   for section in sections}
        by_rows = {id(s): [(t, laid) for t, laid in layouts[id(s)] if t in BY_ROWS_LAYOUTS] for s in sections}
        if not exhaustive:
            layouts = {key: _proxy_choice(pool, options, section)
                       for section in sections for key, options in [(id(section), layouts[id(section)])]}
        sampled = {id(s) for s in sections if not exhaustive and "rans" in tried and s.raw_bytes >= SAMPLE_MIN_BYTES}
        jobs = {id(s): _whole_codings(pool, s, layouts[id(s)], tried, id(s) in sampled, by_rows[id(s)])
                for s in sections}
        samples = {id(s): _sample_codings(pool, layouts[id(s)], tried) for s in sections if id(s) in sampled}
        for section in sections:
            if id(section) in samples:
                jobs[id(section)] += _promising(pool, section, samples[id(section)], jobs[id(section)])
        for section in sections:
            section.transform, section.codec, section.body = _smallest(section, jobs[id(section)])
    return _stream(payload, sections), sections


def _smallest(section: Section, jobs: list[tuple[str, str, Future]]) -> tuple[str, str, bytes]:
    """(transform, codec, body) of the smallest coding, permutations counted; the first of equals."""
    best = None
    for transform, codec, future in jobs:
        body = future.result()
        cost = len(body) + _order_bytes(section, transform)
        if best is None or cost < best[0]:
            best = (cost, transform, codec, body)
    return best[1:]


def _whole_codings(pool: ThreadPoolExecutor, section: Section, layouts: list[tuple[str, bytes]],
                   tried: tuple[str, ...], sampled: bool,
                   by_rows: list[tuple[str, bytes]]) -> list[tuple[str, str, Future]]:
    """(transform, codec, future body) of each coding of the whole section to try outright:
    every codec on every layout, less the slow codecs where they are judged by a sample; and
    rans_rows on the by_rows layouts (as stored, transposed) where it applies."""
    jobs = [(transform, codec, pool.submit(codecs.encode, codec, laid)) for transform, laid in layouts
            for codec in tried if not (sampled and codec in SLOW_CODECS)]
    if "rans" in tried and _by_rows(section):
        jobs += [(transform, "rans_rows", pool.submit(rans_rows.encode, laid, _shapes(section, transform)))
                 for transform, laid in by_rows]
    return jobs


def _sample_of(laid: bytes) -> bytes:
    """Evenly spaced SAMPLE_CHUNK-byte pieces of laid, an eighth of it or SAMPLE_MIN_BYTES / 2."""
    pieces = max(len(laid) // 8, SAMPLE_MIN_BYTES // 2) // SAMPLE_CHUNK
    if pieces * SAMPLE_CHUNK >= len(laid):
        return laid
    step = len(laid) // pieces
    return b"".join(laid[i * step:i * step + SAMPLE_CHUNK] for i in range(pieces))


def _coded_size(codec: str, data: bytes) -> int:
    return len(codecs.encode(codec, data))


def _sample_codings(pool: ThreadPoolExecutor, layouts: list[tuple[str, bytes]],
                    tried: tuple[str, ...]) -> list[tuple[str, bytes, dict[str, Future]]]:
    """Per layout: the layout, and the futures of its sample's size under rANS and each slow codec."""
    found = []
    for transform, laid in layouts:
        sample = _sample_of(laid)
        sizes = {codec: pool.submit(_coded_size, codec, sample)
                 for codec in ("rans", *(c for c in tried if c in SLOW_CODECS))}
        found.append((transform, laid, sizes))
    return found


def _promising(pool: ThreadPoolExecutor, section: Section, samples: list[tuple[str, bytes, dict[str, Future]]],
               jobs: list[tuple[str, str, Future]]) -> list[tuple[str, str, Future]]:
    """The whole-section codings by slow codecs whose estimate comes within SAMPLE_MARGIN of
    the best coding in jobs (rANS's, which every sampled section has)."""
    best = min(len(f.result()) + _order_bytes(section, t) for t, _, f in jobs)
    rans_whole = {t: len(f.result()) for t, c, f in jobs if c == "rans"}
    chosen = []
    for transform, laid, sizes in samples:
        scale = rans_whole[transform] / max(sizes["rans"].result(), 1)
        for codec, size in sizes.items():
            estimate = size.result() * scale + _order_bytes(section, transform)
            if codec != "rans" and estimate <= best * (1 + SAMPLE_MARGIN):
                chosen.append((transform, codec, pool.submit(codecs.encode, codec, laid)))
    return chosen


def _by_rows(section: Section) -> bool:
    """Whether rans_rows may code the section: int8 matrices, not too many."""
    return "transpose" in section.transforms and len(section.ranges) <= RANS_ROWS_MAX_MATRICES


def _shapes(section: Section, transform: str) -> list[tuple[int, int]]:
    """The section's matrices' shapes as laid out by transform (none or transpose)."""
    return [(r.cols, r.rows) if transform == "transpose" else (r.rows, r.cols) for r in section.ranges]


def _proxy_choice(pool: ThreadPoolExecutor, options: list[tuple[str, bytes]],
                  section: Section) -> list[tuple[str, bytes]]:
    """Of a section's layouts, the one the stand-in codec codes smallest (its permutations'
    bytes counted), and the bytes as stored, which need no permutation (a codec blind to
    the order of bytes, as rANS of bytes is, codes every layout alike)."""
    if len(options) <= 1:
        return options
    sizes = [pool.submit(lambda laid: len(zlib.compress(laid, PROXY_LEVEL)), laid) for _, laid in options]
    costs = [size.result() + _order_bytes(section, t) for size, (t, _) in zip(sizes, options)]
    chosen = options[costs.index(min(costs))]
    return [chosen] + [option for option in options if option[0] == "none" and option is not chosen]


def _stream(payload: bytes, sections: list[Section]) -> bytes:
    index = [struct.pack("<I", len(sections))]
    for s in sections:
        label = s.name.encode()
        index.append(struct.pack("<B", len(label)) + label)
        index.append(_SECTION.pack(SECTION_CODEC_IDS[s.codec], _TRANSFORM_IDS[s.transform], s.raw_bytes,
                                   len(s.body), len(s.ranges)))
        for r in s.ranges:
            index.append(_RANGE.pack(r.begin, r.end, r.rows, r.cols, r.itemsize))
            if s.transform in ("sort", "sort_transpose"):
                assert r.order is not None
                index.append(r.order.astype("<u2" if r.rows <= 1 << 16 else "<u4").tobytes())
    ranges = sorted((r.begin, r.end) for s in sections for r in s.ranges)
    rest, cursor = [], 0
    for b, e in ranges:
        rest.append(payload[cursor:b])
        cursor = e
    rest.append(payload[cursor:])
    raw_map = b"".join(index) + b"".join(rest)
    map_body = codecs.encode("lzma", raw_map)
    return (_HEADER.pack(len(map_body), len(raw_map), zlib.crc32(payload)) + map_body
            + b"".join(s.body for s in sections))


# --- Reading ----------------------------------------------------------------------------------------

def read_map(data: bytes, limit: int) -> tuple[list[Section], bytes, int, int]:
    """(sections without their bodies, the payload's bytes outside them, where the bodies
    start, the payload's crc32) from a stream, every count and range checked."""
    if len(data) < _HEADER.size:
        raise CorruptPayload("truncated (no section header)")
    map_len, raw_len, crc = _HEADER.unpack_from(data)
    if raw_len > 2 * limit + (1 << 20) or _HEADER.size + map_len > len(data):
        raise CorruptPayload("the section map does not fit the stream")
    raw = codecs.decode(codecs.CODEC_IDS["lzma"], data[_HEADER.size:_HEADER.size + map_len], raw_len)
    try:
        sections, rest = _parse_map(raw, limit)
    except (struct.error, ValueError) as exc:
        raise CorruptPayload(f"corrupt section map ({exc})") from None
    return sections, rest, _HEADER.size + map_len, crc


def _parse_map(raw: bytes, limit: int) -> tuple[list[Section], bytes]:
    (count,) = struct.unpack_from("<I", raw)
    if count > MAX_SECTIONS:
        raise ValueError(f"{count} sections, more than {MAX_SECTIONS}")
    at, sections, previous_end = 4, [], 0
    for _ in range(count):
        (label_len,) = struct.unpack_from("<B", raw, at)
        label = raw[at + 1:at + 1 + label_len].decode("utf-8", errors="replace")
        at += 1 + label_len
        codec_id, transform_id, raw_bytes, compressed, n_ranges = _SECTION.unpack_from(raw, at)
        at += _SECTION.size
        if codec_id not in SECTION_CODEC_NAMES or transform_id >= len(TRANSFORMS) or n_ranges > MAX_RANGES:
            raise ValueError("unknown codec or transform, or too many ranges")
        section = Section(label, [], TRANSFORMS[transform_id], SECTION_CODEC_NAMES[codec_id], raw_bytes,
                          stored_bytes=compressed)
        for _ in range(n_ranges):
            r = Range(*_RANGE.unpack_from(raw, at))
            at += _RANGE.size
            if r.itemsize not in (1, 2, 4, 8) or r.begin > r.end or r.end > limit \
                    or r.rows * r.cols * r.itemsize != r.end - r.begin:
                raise ValueError("a range does not match its shape or the payload")
            if section.transform in ("sort", "sort_transpose"):
                width = 2 if r.rows <= 1 << 16 else 4
                r.order = np.frombuffer(raw, dtype=f"<u{width}", count=r.rows, offset=at).astype(np.int64)
                at += width * r.rows
                if not np.array_equal(np.sort(r.order), np.arange(r.rows)):
                    raise ValueError("a row order is not a permutation")
            section.ranges.append(r)
        if sum(r.end - r.begin for r in section.ranges) != raw_bytes:
            raise ValueError("a section's size does not match its ranges")
        sections.append(section)
    spans = sorted((r.begin, r.end) for s in sections for r in s.ranges)
    for b, e in spans:
        if b < previous_end:
            raise ValueError("ranges overlap")
        previous_end = e
    return sections, raw[at:]


def decompress(data: bytes, limit: int) -> bytes:
    sections, rest, at, crc = read_map(data, limit)
    pieces: list[tuple[int, bytes]] = []
    for s in sections:
        length = s.stored_bytes
        if at + length > len(data):
            raise CorruptPayload("truncated (a section ends past the stream)")
        laid = _decode_section(s, data[at:at + length])
        at += length
        if len(laid) != s.raw_bytes:
            raise CorruptPayload("a section decodes to another size than its map says")
        cursor = 0
        for r in s.ranges:
            size = r.end - r.begin
            pieces.append((r.begin, _inverse(laid[cursor:cursor + size], r, s.transform)))
            cursor += size
    if at != len(data):
        raise CorruptPayload("unexpected bytes after the last section")
    payload = _interleave(rest, sorted(pieces, key=lambda p: p[0]), limit)
    if zlib.crc32(payload) != crc:
        raise CorruptPayload("payload checksum mismatch")
    return payload


def _decode_section(s: Section, body: bytes) -> bytes:
    if s.codec != "rans_rows":
        return codecs.decode(codecs.CODEC_IDS[s.codec], body, s.raw_bytes)
    if (s.transform not in BY_ROWS_LAYOUTS or len(s.ranges) > RANS_ROWS_MAX_MATRICES
            or any(r.itemsize != 1 for r in s.ranges)):
        raise CorruptPayload("a rANS-by-rows section that is not int8 matrices as stored or transposed")
    return rans_rows.decode(body, _shapes(s, s.transform), s.raw_bytes)


def _interleave(rest: bytes, pieces: list[tuple[int, bytes]], limit: int) -> bytes:
    out, rest_at, cursor = [], 0, 0
    for begin, body in pieces:
        gap = begin - cursor
        out.append(rest[rest_at:rest_at + gap])
        rest_at += gap
        out.append(body)
        cursor = begin + len(body)
    out.append(rest[rest_at:])
    payload = b"".join(out)
    if len(payload) > limit:
        raise CorruptPayload(f"the payload inflates beyond the {limit:,} bytes its header declares")
    return payload


def prefix(data: bytes, n: int, limit: int) -> bytes | None:
    """The payload's first n bytes from the map section alone, when no section starts
    before them; else None."""
    sections, rest, _, _ = read_map(data, limit)
    first = min((r.begin for s in sections for r in s.ranges), default=None)
    if first is not None and first < n:
        return None
    if len(rest) < n:
        raise CorruptPayload("truncated (the payload ends early)")
    return rest[:n]


def describe_sections(data: bytes, limit: int) -> list[dict[str, object]]:
    """Each section's codec, transform and sizes, from the map alone (for `inspect`)."""
    sections, _, _, _ = read_map(data, limit)
    return [section_record(s) for s in sections]


def section_record(s: Section) -> dict[str, object]:
    """A section as reports give it."""
    return {"section": s.name, "codec": s.codec, "transform": s.transform, "raw_bytes": s.raw_bytes,
            "compressed_bytes": s.stored_bytes or len(s.body), "tensors": len(s.ranges)}
