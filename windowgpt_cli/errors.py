"""The errors a user can cause. The CLI prints them as one line and exits with code 1."""
import os
import signal
from typing import NoReturn


class WindowGPTError(Exception):
    """Base class: a problem with the user's input, not a bug."""


class ConfigError(WindowGPTError):
    """An invalid setting or combination of settings."""


class SettingError(ConfigError):
    """One setting's value out of its bounds or choices. The message names it as
    `setting=value`; a command whose flag the user typed names the flag instead."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


class DataError(WindowGPTError):
    """Unreadable, malformed or inconsistent data, tokenizer or metadata files."""


class ArtifactError(WindowGPTError):
    """A checkpoint, export or .ptz that is missing, truncated or of another format."""


class OutputRefused(WindowGPTError):
    """An output path that names what the command may not replace: a user's files, or the
    command's own input."""


class RecordError(WindowGPTError):
    """A record run that breaks a rule of the challenge."""


class TrainingDiverged(WindowGPTError):
    """The loss became NaN or infinite: training stops rather than save such weights."""


class Stopped(BaseException):
    """A signal that stops the command, raised where the process is (a training run handles
    them itself: it stops at the next step with a checkpoint). Not a KeyboardInterrupt, which
    the command-line library would take as its own and end in silence."""

    label, exit_status, reason = "interrupted", 130, "stopped by the user"  # 128 + SIGINT


class Interrupted(Stopped):
    """Ctrl-C (SIGINT)."""


class Terminated(Stopped):
    """SIGTERM."""

    label, exit_status, reason = "terminated", 143, "stopped by SIGTERM"  # 128 + SIGTERM


def stop_for(signum: int) -> type[Stopped]:
    return Terminated if signum == signal.SIGTERM else Interrupted


def end_at_once(signum: int) -> NoReturn:
    """End the process for a signal with one line and its exit status, unwinding nothing:
    where an exception could not be raised safely (before a command's work begins, or
    inside an import, which would leave modules half-built for whatever catches it)."""
    stop = stop_for(signum)
    try:
        os.write(2, f"{stop.label}: {stop.reason}\n".encode())
    finally:
        os._exit(stop.exit_status)


class RunLocked(WindowGPTError):
    """Another process is writing to the same run directory."""
