"""A windowgpt process's first and last steps: Python's bytecode kept (`bytecode`), the
command line run, and the process ended as soon as the command returns (`exit_process`).
Nothing heavy is imported here: the first step must come before torch is imported."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, NoReturn

from .bytecode import keep_bytecode

CLI_MODULE = "windowgpt_cli.cli.app"


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
