"""A windowgpt process's first and last steps. Nothing heavy is imported here: the first
step must come before torch is imported.

- First, Python's bytecode: an installation whose environment tells Python not to write
  bytecode (PYTHONDONTWRITEBYTECODE, `python -B`: common in containers), and that ships
  none, compiles every module it imports from source in every process. For torch and
  torch.compile that is 2,000-odd modules: importing torch and TorchDynamo took 7.3 s
  instead of 2.8 s on an H200 host. windowgpt keeps that bytecode in a folder of its own
  (`bytecode_cache_dir`), never beside the sources, so each later process reads it back.
- Last, the process ends as soon as the command returns (`exit_process`).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

CLI_MODULE = "windowgpt_cli.cli"


def bytecode_cache_dir() -> Path:
    """$XDG_CACHE_HOME/windowgpt/bytecode (default ~/.cache/windowgpt/bytecode)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "windowgpt" / "bytecode"


def keep_bytecode() -> None:
    """Where Python is told not to write bytecode beside the sources and no other place is
    set for it (PYTHONPYCACHEPREFIX), write and read it under `bytecode_cache_dir` instead.
    Elsewhere nothing changes. A folder that cannot be written only costs the speed-up."""
    if sys.dont_write_bytecode and sys.pycache_prefix is None:
        sys.pycache_prefix = str(bytecode_cache_dir())
        sys.dont_write_bytecode = False


def exit_process(main: Callable[[], None]) -> NoReturn:
    """The process's end after main(): at once, with main's exit status.

    A command has closed, fsynced and renamed everything it writes by the time it returns,
    so the interpreter's teardown has nothing left to do; yet after a command that used CUDA
    and torch.compile it took 2-4 s of the command's wall time on an H200 (finalizing every
    module, unloading the CUDA libraries). os._exit skips it, once stdout and stderr are
    flushed. An exception other than SystemExit is left to Python (traceback, exit 1)."""
    try:
        main()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):  # SystemExit("message"), as Python prints it
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`windowgpt ... | head`) or stream
            pass
    os._exit(code or 0)


def run(app_module: str) -> NoReturn:
    """A command line as a process: the bytecode kept, then `app_module`'s main() run and the
    process ended with its status."""
    keep_bytecode()
    exit_process(importlib.import_module(app_module).main)


def windowgpt() -> NoReturn:
    """`windowgpt` (its console script, `python -m windowgpt_cli`)."""
    run(CLI_MODULE)
