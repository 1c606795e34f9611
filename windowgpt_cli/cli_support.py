"""What every command shares: consoles, one-line errors, and flags made from the config."""
from __future__ import annotations

import functools
import inspect
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .config import GROUP_TYPES, ConfigError, RunConfig, apply_overrides, group_fields, preset
from .errors import WindowGPTError

console = Console()
err_console = Console(stderr=True)


EXIT_ERROR = 1
EXIT_USAGE = 2  # click's code for usage errors
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def print_error(message: str, label: str = "error") -> None:
    """One line on stderr; the message is printed verbatim (paths may hold [ and ])."""
    err_console.print(f"[bold red]{label}:[/] {escape(str(message).strip().replace(chr(10), ' '))}", highlight=False,
                      soft_wrap=True)


def describe_os_error(exc: OSError) -> str:
    """`PATH: reason` for a failed read or write (full disk, read-only, a directory, ...)."""
    reason = exc.strerror or type(exc).__name__
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else f"{reason}"


def user_errors_exit_1(func: Callable) -> Callable:
    """Turn a WindowGPTError or a failed file operation into one line on stderr and exit
    code 1, and Ctrl-C into exit code 130 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except WindowGPTError as exc:
            print_error(str(exc))
            raise typer.Exit(EXIT_ERROR) from None
        except OSError as exc:
            print_error(describe_os_error(exc))
            raise typer.Exit(EXIT_ERROR) from None
        except KeyboardInterrupt:
            print_error("stopped by the user", label="interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper


def run_app(app: typer.Typer) -> None:
    """Run a command-line app. Exit codes: 0 done, 1 error, 2 usage error (one line on
    stderr), 130 interrupted."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        code = EXIT_INTERRUPTED
    except Exception as exc:
        if not hasattr(exc, "format_message"):  # a usage error (click's, vendored or not) has one
            raise
        if not exc.format_message():  # the command alone: the help was shown
            sys.exit(0)
        print_error(exc.format_message())
        code = EXIT_USAGE
    sys.exit(code if isinstance(code, int) else 0)


def _flag_annotation(group: str, name: str, hint: Any, help_text: str) -> Any:
    flag = "--" + name.replace("_", "-")
    panel = f"{group} settings"
    if hint is bool:
        decls = (f"{flag}/--no-{flag[2:]}",)
        return Annotated[Optional[bool], typer.Option(*decls, help=help_text, rich_help_panel=panel, show_default=False)]
    if typing.get_origin(hint) is tuple:
        return Annotated[Optional[str], typer.Option(flag, help=help_text, rich_help_panel=panel, show_default=False)]
    return Annotated[Optional[hint], typer.Option(flag, help=help_text, rich_help_panel=panel, show_default=False)]


def with_config_flags(*groups: str) -> Callable[[Callable], Callable]:
    """Add one `--kebab-case` option per field of the named config groups to a command.

    The command then receives `overrides: dict[group, dict[field, value]]` holding only the
    flags the user gave, to apply over a preset or a loaded configuration.
    """

    def decorate(func: Callable) -> Callable:
        base = inspect.signature(func, eval_str=True)
        own = [p for p in base.parameters.values() if p.name != "overrides"]
        defaults = RunConfig()
        extra: list[inspect.Parameter] = []
        owners: dict[str, str] = {}
        for group in groups:
            hints = typing.get_type_hints(GROUP_TYPES[group])
            for f in group_fields(group):
                default = getattr(getattr(defaults, group), f.name)
                shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
                help_text = f"(default: {shown})"
                extra.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                               annotation=_flag_annotation(group, f.name, hints[f.name], help_text)))
                owners[f.name] = group

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            overrides: dict[str, dict[str, Any]] = {}
            for name, group in owners.items():
                value = kwargs.pop(name)
                if value is not None:
                    overrides.setdefault(group, {})[name] = value
            return func(overrides=overrides, **kwargs)

        params = own + extra
        wrapper.__signature__ = base.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__  # typer must read the new signature, not the original
        return wrapper

    return decorate


def build_config(config_file: Optional[Path], preset_name: Optional[str],
                 overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """Start from a saved configuration or a preset, then apply the flags given."""
    if config_file is not None and preset_name is not None:
        raise ConfigError("give either --config or --preset, not both")
    base = RunConfig.load(config_file, check=False) if config_file is not None else preset(preset_name or "default")
    return apply_overrides(base, overrides)


ConfigFileOption = Annotated[Optional[Path], typer.Option(
    "--config", help="Start from a saved configuration (a run's config.json).", show_default=False)]
PresetOption = Annotated[Optional[str], typer.Option(
    "--preset", help="Start from a named preset: default (the reference) or tiny (trains in seconds on a CPU).",
    show_default=False)]
