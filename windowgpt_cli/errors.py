"""The errors a user can cause. The CLI prints them as one line and exits with code 1."""


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


class RunLocked(WindowGPTError):
    """Another process is writing to the same run directory."""
