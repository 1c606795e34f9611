"""Where a command's wall time goes: named phases, counted from the process's own start.

A command's user waits from the moment the process starts, not from the moment its work
begins: `Phases` therefore opens with `start` (interpreter, imports, process group), read
from the kernel's record of when the process began, and every later phase is timed as it
runs. `line()` gives `time: start 2.1s, setup 0.4s, ..., total 31.0s` for the log and
`as_dict()` the same for JSON reports.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator


def _process_start_epoch() -> float | None:
    """When this process started (seconds since the epoch), from /proc; None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after the command name
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


_IMPORTED_AT = time.time()  # the fallback start: when the package was first imported


def seconds_since_process_start() -> float:
    started = _process_start_epoch()
    # btime has a resolution of a second: never report less than what this process has seen
    since_import = time.time() - _IMPORTED_AT
    return since_import if started is None else max(time.time() - started, since_import)


def compile_phases() -> dict[str, float]:
    """torch.compile's own seconds in this process by phase (`total_wall_time`: Dynamo,
    AOTAutograd and Inductor, the backward's compilation included); empty when it never ran."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None or not hasattr(utils, "calculate_time_spent"):
        return {}
    return {name: float(s) for name, s in utils.calculate_time_spent().items()}


def compile_seconds() -> float:
    return compile_phases().get("total_wall_time", 0.0)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (0 when it never ran): a
    difference of two readings counts the recompilations in between."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def compile_line() -> str:
    """`compile: 41.2s (inductor_compile 30.1s, ...)`: the phases of a second or more."""
    phases = compile_phases()
    parts = ", ".join(f"{name} {s:.1f}s" for name, s in sorted(phases.items(), key=lambda kv: -kv[1])
                      if s >= 1.0 and name != "total_wall_time")
    return f"compile: {phases.get('total_wall_time', 0.0):.1f}s" + (f" ({parts})" if parts else "")


class Phases:
    """Wall time per named phase; `start` is the time from the process's start to here."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"start": seconds_since_process_start()}
        self._opened = time.perf_counter() - self.seconds["start"]

    @contextlib.contextmanager
    def timed(self, name: str, sync: "object | None" = None) -> Iterator[None]:
        """Add the block's wall time to phase `name` (phases may repeat: they add up).
        sync: a torch.device whose queued work is waited for at both ends."""
        _synchronize(sync)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(sync)
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def total(self) -> float:
        return time.perf_counter() - self._opened

    def as_dict(self) -> dict[str, float]:
        """Every phase, `other` (what no phase covers) and `total`, rounded to milliseconds."""
        total = self.total()
        out = {name: round(s, 3) for name, s in self.seconds.items()}
        out["other"] = round(max(0.0, total - sum(self.seconds.values())), 3)
        out["total"] = round(total, 3)
        return out

    def line(self) -> str:
        return "time: " + ", ".join(f"{name} {s:.1f}s" for name, s in self.as_dict().items())


def _synchronize(device) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)
