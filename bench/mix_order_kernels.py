"""The training step's "mix-order" reduction kernels and the time each takes.

Inductor can fuse a reduction along each row (a norm's backward) with sums along the columns
of the same rows (per-channel gradients) into one kernel whose programs walk their rows one
at a time (`train --compile-mix-order`, on by default). Such a kernel reads every tensor it
fuses; with many of them it can spill its registers and run ten times slower than its reads
take. This lists each one a profiled step ran: its loads, calls and time.

    TORCH_LOGS=output_code python3 bench/train_profile.py --data DATA ... --steps 1 --trace T.json 2> CODE.log
    python3 bench/mix_order_kernels.py CODE.log T.json [--steps 1] [--json PATH]

CODE.log: Inductor's generated code as TORCH_LOGS=output_code prints it (any prefix on its
lines); T.json: the profiler's Chrome trace of those steps (or T.json.gz). Times are per
step (--steps: the steps the trace holds). Either file may be gzipped (.gz).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_profile import device_activities  # noqa: E402
from windowgpt_cli.errors import OutputRefused  # noqa: E402
from windowgpt_cli.storage.files import atomic_write_json  # noqa: E402
from windowgpt_cli.storage.outputs import check_apart  # noqa: E402

MIX_ORDER_GRID = "'grid_type': 'MixOrderReductionGrid'"
KERNEL_NAME = re.compile(r"'kernel_name': '([^']+)'")
LOADS = re.compile(r"'num_load': (\d+)")


def mix_order_kernels(code_lines: Iterable[str]) -> dict[str, int]:
    """Each mix-order kernel's name and the loads Inductor counted in it, from the lines of
    its generated code (one kernel's metadata lies on one line)."""
    found = {}
    for line in code_lines:
        if MIX_ORDER_GRID not in line:
            continue
        name, loads = KERNEL_NAME.search(line), LOADS.search(line)
        if name:
            found[name.group(1)] = int(loads.group(1)) if loads else -1
    return found


def kernel_times(events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each GPU kernel's durations (µs) in a Chrome trace's events."""
    times: dict[str, list[float]] = defaultdict(list)
    for activity in device_activities(events):
        if activity.kind == "kernel":
            times[activity.name].append(activity.duration)
    return times


def summary(kernels: dict[str, int], times: dict[str, list[float]], steps: int) -> dict[str, Any]:
    """Per mix-order kernel that ran: loads, calls and ms per step, and ms per call; the
    longest first, with their total."""
    rows = []
    for name, loads in kernels.items():
        durations = times.get(name)
        if durations:
            ms = sum(durations) / 1000.0
            rows.append({"name": name, "loads": loads, "calls": len(durations) // steps,
                         "ms": round(ms / steps, 3), "ms_per_call": round(ms / len(durations), 3)})
    rows.sort(key=lambda row: -row["ms"])
    return {"steps": steps, "total_ms": round(sum(row["ms"] for row in rows), 3), "kernels": rows}


def table(result: dict[str, Any], width: int = 90) -> str:
    lines = [f"{len(result['kernels'])} mix-order kernels, {result['total_ms']:.1f} ms per step",
             "| ms/step | calls | ms/call | loads | kernel |", "| ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['ms']:.2f} | {r['calls']} | {r['ms_per_call']:.3f} | {r['loads']} | {r['name'][:width]} |"
              for r in result["kernels"]]
    return "\n".join(lines)


def open_text(path: Path):
    """A text file, or its gzip (.gz)."""
    return gzip.open(path, "rt", errors="replace") if path.suffix == ".gz" else path.open(errors="replace")


def read_trace(path: Path) -> list[dict[str, Any]]:
    with open_text(path) as f:
        return json.load(f)["traceEvents"]


def inputs_and_output_usable(inputs: list[Path], json_path: Path | None) -> bool:
    """Whether each input exists and --json names none of them; else says why on stderr."""
    for path in inputs:
        if not path.is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return False
    try:
        if json_path:
            check_apart(json_path, inputs, flag="--json")
    except OutputRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True


def trace_events(path: Path) -> list[dict[str, Any]] | None:
    """The trace's events, or None after saying on stderr that it is not a trace."""
    try:
        return read_trace(path)
    except (OSError, EOFError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        print(f"error: {path}: not a profiler's Chrome trace (JSON with traceEvents, or its gzip)", file=sys.stderr)
        return None


def print_and_write(text: str, result: Any, json_path: Path | None) -> None:
    """The result's table printed, and with --json the result written there."""
    print(text)
    if json_path:
        atomic_write_json(json_path, result)
        print(f"wrote {json_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("code_log", type=Path, help="Inductor's output code (TORCH_LOGS=output_code).")
    parser.add_argument("trace", type=Path, help="The profiled steps' Chrome trace (.json or .json.gz).")
    parser.add_argument("--steps", type=int, default=1, help="Steps the trace holds.")
    parser.add_argument("--json", type=Path, help="Write the result as JSON here.")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if not inputs_and_output_usable([args.code_log, args.trace], args.json):
        return 1
    try:
        with open_text(args.code_log) as f:
            kernels = mix_order_kernels(f)
    except (OSError, EOFError):
        print(f"error: {args.code_log}: not readable as text or its gzip", file=sys.stderr)
        return 1
    events = trace_events(args.trace)
    if events is None:
        return 1
    result = summary(kernels, kernel_times(events), args.steps)
    print_and_write(table(result), result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
