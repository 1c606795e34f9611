"""Every candidate compressor on one quantized payload: bytes, compress and decompress time.

    python3 bench/compressors.py MODEL.ptz|PAYLOAD [--json PATH] [--only NAME,...] [--jobs N]

A `.ptz` is decompressed to its payload (the safetensors file quantize compresses); any other
file is taken as a payload. Each candidate compresses it, decompresses the result, checks
the round trip and is timed on the CPU:

- lzma-6: xz preset 6, the reference's and `--compressor lzma`;
- lzma-9e: xz preset 9 | extreme;
- xz-lc0-lp0-pb0: a raw LZMA2 stream, preset 6 with no literal context or position bits
  (int8 codes have no byte structure for them to find);
- lzma-6-chunks: the payload cut into one chunk per CPU, each compressed (and decompressed)
  by xz preset 6 in its own thread; 8 bytes a chunk for the chunk table are counted;
- zlib-9, bz2-9;
- rans, auto: the .ptz compressors (whole .ptz files: header, payload hash and all);
- auto-exhaustive: auto's per-group stream with every codec tried on every layout, where
  auto codes only the layout its stand-in (zlib) prefers and the bytes as stored.

Candidates that use one core run side by side in --jobs processes (default: one per
candidate, at most the CPU count); lzma-6-chunks, which uses every core, runs alone after
them. With fewer free cores than jobs, the times of the side-by-side candidates include
waiting for a core: `--jobs 1` runs them one after another.
"""
from __future__ import annotations

import argparse
import bz2
import json
import lzma
import os
import struct
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from windowgpt_cli.artifacts import ptz  # noqa: E402

from windowgpt_cli.artifacts import compressors, grouped

console = Console(width=140)
REFERENCE = "lzma-6"
RAW_LC0_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6, "lc": 0, "lp": 0, "pb": 0}]
CHUNKED = "lzma-6-chunks"


def chunked_lzma(payload: bytes) -> bytes:
    """One xz stream per CPU, compressed in threads (lzma releases the GIL), after a table
    of their compressed sizes."""
    count = os.cpu_count() or 1
    step = -(-len(payload) // count) or 1
    with ThreadPoolExecutor(count) as pool:
        streams = list(pool.map(lambda at: lzma.compress(payload[at:at + step], preset=6),
                                range(0, len(payload), step)))
    return struct.pack(f"<Q{len(streams)}Q", len(streams), *map(len, streams)) + b"".join(streams)


def unchunked_lzma(data: bytes) -> bytes:
    (count,) = struct.unpack_from("<Q", data)
    sizes = struct.unpack_from(f"<{count}Q", data, 8)
    starts = [8 + 8 * count + sum(sizes[:i]) for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        return b"".join(pool.map(lambda i: lzma.decompress(data[starts[i]:starts[i] + sizes[i]]), range(count)))


def _ptz_codec(name: str) -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
    return (lambda b: ptz.compress_payload(b, name)), (lambda d: ptz.decompress_payload(d, name))


CANDIDATES: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    REFERENCE: (lambda b: lzma.compress(b, preset=6), lzma.decompress),
    "lzma-9e": (lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME), lzma.decompress),
    "xz-lc0-lp0-pb0": (lambda b: lzma.compress(b, format=lzma.FORMAT_RAW, filters=RAW_LC0_FILTERS),
                       lambda d: lzma.decompress(d, format=lzma.FORMAT_RAW, filters=RAW_LC0_FILTERS)),
    CHUNKED: (chunked_lzma, unchunked_lzma),
    "zlib-9": (lambda b: zlib.compress(b, 9), zlib.decompress),
    "bz2-9": (lambda b: bz2.compress(b, 9), bz2.decompress),
    "rans": _ptz_codec("rans"),
    "auto": _ptz_codec(compressors.AUTO),
    # auto's search without its stand-in: every codec on every layout of every section (the
    # bare stream, without the .ptz's few bytes of header)
    "auto-exhaustive": (lambda b: grouped.compress(b, exhaustive=True)[0], lambda d: grouped.decompress(d, 1 << 40)),
}


def measure(name: str, payload: bytes) -> dict:
    """Compress and decompress once; sizes in bytes, times in seconds."""
    compress, decompress = CANDIDATES[name]
    t0 = time.perf_counter()
    data = compress(payload)
    t1 = time.perf_counter()
    back = decompress(data)
    t2 = time.perf_counter()
    result = {"bytes": len(data), "compress_s": round(t1 - t0, 3), "decompress_s": round(t2 - t1, 3),
              "round_trip": back == payload}
    if name in ("rans", compressors.AUTO):
        result["compressor"] = ptz.compressor_of(data)
    return result


def read_payload(path: Path) -> bytes:
    data = path.read_bytes()
    return ptz.decompress_payload(data, str(path)) if data[:len(ptz.MAGIC)] == ptz.MAGIC else data


def run_all(payload: bytes, names: list[str], jobs: int) -> dict[str, dict]:
    side_by_side = [n for n in names if n != CHUNKED]
    results: dict[str, dict] = {}
    if side_by_side:
        with ProcessPoolExecutor(max(1, min(jobs, len(side_by_side)))) as pool:
            futures = {n: pool.submit(measure, n, payload) for n in side_by_side}
            results = {n: f.result() for n, f in futures.items()}
    if CHUNKED in names:
        results[CHUNKED] = measure(CHUNKED, payload)
    return {n: results[n] for n in names}


def table(results: dict[str, dict], title: str) -> Table:
    out = Table(title=title)
    for col in ("candidate", "bytes", f"vs {REFERENCE}", "compress s", "decompress s", "round trip"):
        out.add_column(col, justify="left" if col == "candidate" else "right")
    base = results.get(REFERENCE, {}).get("bytes")
    smallest = min(r["bytes"] for r in results.values())
    for name, r in results.items():
        label = name + (f" ({r['compressor']})" if "compressor" in r else "")
        size = f"{r['bytes']:,}" if r["bytes"] != smallest else f"[bold]{r['bytes']:,}[/]"
        out.add_row(label, size, f"{r['bytes'] / base - 1:+.2%}" if base else "", f"{r['compress_s']:.2f}",
                    f"{r['decompress_s']:.2f}", "ok" if r["round_trip"] else "[bold red]FAILED[/]")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="a .ptz, or a raw payload")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--only", help=f"comma-separated candidates (default: all of {', '.join(CANDIDATES)})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes for the single-core candidates (default: the CPU count)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidate {unknown[0]!r}; choose from {', '.join(CANDIDATES)}")
    started = time.perf_counter()
    payload = read_payload(args.input)
    results = run_all(payload, names, args.jobs)
    wall = time.perf_counter() - started
    console.print(table(results, f"{args.input.name}: payload {len(payload):,} bytes, "
                                               f"{os.cpu_count()} CPUs, {wall:.1f} s in all"))
    if args.json:
        record = {"input": str(args.input), "payload_bytes": len(payload), "cpu_count": os.cpu_count(),
                  "jobs": args.jobs, "wall_s": round(wall, 2), "candidates": results}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    if not all(r["round_trip"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
