"""A windowgpt process's first and last steps: Python's bytecode kept (`bytecode`), the
command line run, and the process ended as soon as the command returns (`exit_process`).
Nothing heavy is imported here: the first step must come before torch is imported."""
from __future__ import annotations

import importlib
import os
import signal
import sys
from typing import Callable, NoReturn

from .bytecode import keep_bytecode
from .errors import Interrupted, Stopped, end_at_once

CLI_MODULE = "windowgpt_cli.cli.app"


def _end_at_once(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM before a command's work begins (interpreter, imports, the command
    line): nothing is written yet, so the process ends here, with one line. Raising instead
    could unwind through a C++ extension being imported, which would abort the process."""
    end_at_once(signum)


def exit_process(main: Callable[[], None]) -> NoReturn:
    """The process's end after main(): at once, with main's exit status.

    A command has closed, fsynced and renamed everything it writes by the time it returns,
    so the interpreter's teardown has nothing left to do; yet after a command that used CUDA
    and torch.compile it took 2-4 s of the command's wall time on an H200 (finalizing every
    module, unloading the CUDA libraries). os._exit skips it, once stdout and stderr are
    flushed. Ctrl-C and SIGTERM that reach here (the command line not yet built, say) end
    it with 130 or 143 and one line (`errors.Stopped`); another exception is left to Python
    (traceback, exit 1)."""
    try:
        main()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    except Stopped as stop:
        code = _stopped(f"{stop.label}: {stop.reason}", stop.exit_status)
    except KeyboardInterrupt:
        code = _stopped(f"{Interrupted.label}: {Interrupted.reason}", Interrupted.exit_status)
    if code is not None and not isinstance(code, int):  # SystemExit("message"), as Python prints it
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`windowgpt ... | head`) or stream
            pass
    os._exit(code or 0)


def _stopped(message: str, code: int) -> int:
    try:
        print(message, file=sys.stderr)
    except (OSError, ValueError):
        pass
    return code


def run(app_module: str) -> NoReturn:
    """A command line as a process: SIGTERM and Ctrl-C honoured from the first step, the
    bytecode kept, then `app_module`'s main() run and the process ended with its status."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _end_at_once)

    def main() -> None:
        keep_bytecode()
        importlib.import_module(app_module).main()

    exit_process(main)


def windowgpt() -> NoReturn:
    """`windowgpt` (its console script, `python -m windowgpt_cli`)."""
    run(CLI_MODULE)
