"""Python's bytecode, kept where the environment forbids writing it. Nothing heavy is
imported here: `keep_bytecode` must run before torch is imported.

An installation whose environment tells Python not to write
bytecode (PYTHONDONTWRITEBYTECODE, `python -B`: common in containers), and that ships
none, compiles every module it imports from source in every process. For torch and
torch.compile that is 2,000-odd modules: importing torch and TorchDynamo took 7.3 s
instead of 2.8 s on an H200 host. windowgpt keeps that bytecode in a folder of its own
(`bytecode_cache_dir`), never beside the sources, so each later process reads it back.
The first process there also starts compiling the big libraries' modules in the
background (`start_precompile`), on the machine's spare cores: it imports them one after
another, and finds most already compiled.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

# The libraries whose thousands of modules a command imports (torch.compile's alone, 2,000-odd).
PRECOMPILED_PACKAGES = ("torch", "triton", "sympy", "numpy")
# Fewer cores than this, and compiling everything in the background would slow the command
# it should speed up (it compiles far more modules than one command imports).
PRECOMPILE_MIN_CPUS = 8
# The cache's bound: past it, it is emptied (and rebuilt by the commands that follow). One
# environment's torch, triton, sympy and numpy take 25-55 MB.
MAX_CACHE_BYTES = 512 << 20
PRUNE_EVERY_SECONDS = 24 * 3600


def bytecode_cache_dir() -> Path:
    """$XDG_CACHE_HOME/windowgpt/bytecode (default ~/.cache/windowgpt/bytecode)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "windowgpt" / "bytecode"


def keep_bytecode() -> None:
    """Where Python is told not to write bytecode beside the sources and no other place is
    set for it (PYTHONPYCACHEPREFIX), write and read it under `bytecode_cache_dir` instead.
    Elsewhere nothing changes. A folder that cannot be written only costs the speed-up."""
    if sys.dont_write_bytecode and sys.pycache_prefix is None and not ships_bytecode("torch"):
        sys.pycache_prefix = str(bytecode_cache_dir())
        sys.dont_write_bytecode = False
        if usable_cpus() >= PRECOMPILE_MIN_CPUS:
            start_precompile(Path(sys.pycache_prefix), PRECOMPILED_PACKAGES)
        start_prune(Path(sys.pycache_prefix))


def ships_bytecode(package: str) -> bool:
    """Whether an installed package has its bytecode beside its sources (compiled when it
    was installed): Python reads that as it is, and a cache elsewhere would only be built
    again for nothing (it cost 3 s on the first command, and saved none)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    return Path(importlib.util.cache_from_source(spec.origin)).is_file()


def start_prune(prefix: Path) -> None:
    """Once a day, prune the cache in a background process (`prune`)."""
    stamp = prefix / "pruned"
    try:
        import time

        if stamp.exists() and time.time() - stamp.stat().st_mtime < PRUNE_EVERY_SECONDS:
            return
        prefix.mkdir(parents=True, exist_ok=True)
        stamp.touch()
        argv, env = module_process(__name__, "--prune", str(prefix))
        subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    except (OSError, ValueError):
        pass


def prune(prefix: Path, max_bytes: int = MAX_CACHE_BYTES) -> None:
    """Remove the bytecode of sources that are gone (an environment deleted, a package
    upgraded), then, if the cache is still over max_bytes, all of it."""
    import shutil

    prefix = Path(prefix)
    total = 0
    for folder, subdirs, files in os.walk(prefix, topdown=True):
        source = Path("/" + os.path.relpath(folder, prefix)) if folder != str(prefix) else None
        if source is not None and not source.exists():
            shutil.rmtree(folder, ignore_errors=True)
            subdirs.clear()
            continue
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files if f.endswith(".pyc"))
    if total > max_bytes:
        for entry in prefix.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith("precompiled-"):
                entry.unlink(missing_ok=True)


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def package_dirs(packages: Sequence[str]) -> list[Path]:
    """The source folders of those packages that are installed (found, not imported)."""
    dirs = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.append(Path(next(iter(spec.submodule_search_locations))))
    return dirs


def precompile_marker(prefix: Path, dirs: Sequence[Path]) -> Path:
    """The file that says these folders' bytecode is under prefix: named by the interpreter
    and by each folder with its package's version (the mtime of its __init__.py)."""
    stamps = [f"{d}:{(d / '__init__.py').stat().st_mtime_ns if (d / '__init__.py').exists() else 0}" for d in dirs]
    key = hashlib.sha256("\n".join([sys.implementation.cache_tag or "", *stamps]).encode()).hexdigest()[:16]
    return prefix / f"precompiled-{key}"


def start_precompile(prefix: Path, packages: Sequence[str]) -> None:
    """Compile the packages' modules to bytecode under prefix in a background process (at a
    low priority, on every core), unless that was done. The command goes on at once; a
    module it imports before its turn, it compiles itself (both writes are atomic)."""
    try:
        dirs = package_dirs(packages)
        if not dirs or precompile_marker(prefix, dirs).exists():
            return
        argv, env = module_process(__name__, str(prefix), *map(str, dirs))
        subprocess.Popen(argv, env={**env, "PYTHONPYCACHEPREFIX": str(prefix)}, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except (OSError, ValueError):  # only the speed-up is lost
        pass


def module_process(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a child process that runs `python -m module args` with
    this interpreter and finds windowgpt_cli where this process found it: a source tree,
    site-packages, or the archive `python code.pyz` runs from (a path a child would not
    inherit)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    return [sys.executable, "-m", module, *args], env


def precompile(prefix: Path, dirs: Sequence[Path]) -> bool:
    """Compile every module under dirs to bytecode under prefix (Python's own pycache_prefix
    layout) and leave the marker; one process at a time (an flock: a crashed one holds
    none). False where another process holds the lock or the marker was there."""
    import compileall
    import fcntl

    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / "precompile.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        marker = precompile_marker(prefix, dirs)
        if marker.exists():
            return False
        previous, sys.pycache_prefix = sys.pycache_prefix, str(prefix)  # where compileall writes
        try:
            for folder in dirs:
                compileall.compile_dir(folder, quiet=2, workers=0)
        finally:
            sys.pycache_prefix = previous
        marker.touch()
        return True


if __name__ == "__main__" and sys.argv[1:2] == ["--prune"]:  # start_prune's process: --prune PREFIX
    prune(Path(sys.argv[2]))
elif __name__ == "__main__":  # start_precompile's process: PREFIX FOLDER...
    if len(sys.argv) < 2:
        print("usage: python -m windowgpt_cli.bytecode PREFIX [FOLDER...] (windowgpt starts this itself)",
              file=sys.stderr)
        sys.exit(2)
    try:
        os.nice(10)
    except OSError:
        pass
    precompile(Path(sys.argv[1]), [Path(d) for d in sys.argv[2:]])
