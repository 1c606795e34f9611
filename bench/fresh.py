"""Run a bench script's child in a fresh process whose Inductor and Triton caches start
empty: what a first run on a new machine pays for compilation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def run_fresh(argv: list[str], cache: str | None = None) -> dict:
    """Run `python argv...`, echo what it prints but its last line, and return that line
    (a JSON object) with "process" (its wall seconds) added. The compiler caches live in
    `cache` when given (a second run there finds the first's work), else in a new
    temporary directory."""
    with tempfile.TemporaryDirectory() as temporary:
        cache = cache or temporary
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
        start = time.perf_counter()
        out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    *printed, last = out.stdout.strip().splitlines()
    if printed:
        print("\n".join(printed), flush=True)
    result = json.loads(last)
    result["process"] = wall
    return result
