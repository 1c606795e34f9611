"""What a command may write over: nothing it did not write itself, and never its own input.

Every stage that writes calls these before it reads or writes anything. An output path may
name nothing yet, an empty directory, or an output of the command's own kind that it
recognizes as its own (each format module says how: `is_data_dir`, `is_run_dir`, `is_ptz`,
...); anything else is refused with one line naming the path, whatever `--force` says. An
output that is, contains or lies inside one of the command's inputs is refused too, so a
stage can never replace what it is reading.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from ..errors import OutputRefused

Recognizer = Callable[[Path], bool]


def check_apart(out: Path, inputs: Iterable[Path | None], flag: str = "--out") -> None:
    """Refuse an output that is, contains or lies inside one of the inputs."""
    target = Path(out).resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if target == source:
            raise OutputRefused(f"{flag} {out} is the command's own input; choose another {flag}")
        if target in source.parents:
            raise OutputRefused(f"{flag} {out} contains the command's input {given}; choose another {flag}")
        if source in target.parents:
            raise OutputRefused(f"{flag} {out} lies inside the command's input {given}; choose another {flag}")


def claim_file(path: Path, what: str, is_own: Recognizer, flag: str = "--out") -> Path:
    """The path, when it names nothing yet or a file that is_own recognizes as `what`. flag
    names the path in the message: the option that gave it, or (for a file a command
    writes beside its output or input, such as "the report") what it is."""
    path = Path(path)
    if path.is_symlink() or path.exists():
        if path.is_dir() and not path.is_symlink():
            raise OutputRefused(f"{flag} {path} is a directory; give a file name for {what}")
        if not path.is_file() or not is_own(path):
            other = f" or choose another {flag}" if flag.startswith("-") else ""
            raise OutputRefused(f"{flag} {path} exists and is not {what} windowgpt wrote; move it away{other}")
    return path


def claim_dir(path: Path, what: str, is_own: Recognizer, flag: str = "--out") -> Path:
    """The path, when it names nothing yet, an empty directory, or a directory that is_own
    recognizes as `what`."""
    path = Path(path)
    if path.is_symlink() or path.exists():
        if not path.is_dir():
            raise OutputRefused(f"{flag} {path} exists and is not a directory; choose another {flag}")
        if any(path.iterdir()) and not is_own(path):
            raise OutputRefused(f"{flag} {path} holds files that are not {what} windowgpt wrote; nothing was "
                                f"changed: choose a new or empty {flag}")
    return path
