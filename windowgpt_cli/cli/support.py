"""What every command shares: consoles, one-line errors, and flags made from the config."""
from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import signal
import sys
import typing
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Callable, Iterator, Literal, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ..config import (
    CHOICES,
    GROUP_TYPES,
    PRESETS,
    RunConfig,
    apply_overrides,
    bounds_text,
    group_fields,
    load_config_file,
    preset,
    setting_help,
)
from ..errors import Interrupted, SettingError, Stopped, WindowGPTError, end_at_once, stop_for


class _Console(Console):
    """rich's console, but a closed pipe (`windowgpt ... | head`) raises BrokenPipeError for
    the command to handle, where rich would exit with status 1 at once, without a word."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more goes to the closed pipe
        raise BrokenPipeError(errno.EPIPE, "the output pipe was closed")


# No markup: paths, prompts and model output are printed as written, "[" and all; styles
# come as rich Text.
console = _Console(markup=False)
err_console = _Console(stderr=True, markup=False)


EXIT_ERROR = 1
EXIT_USAGE = 2  # click's code for usage errors (interrupted and terminated: `errors.Stopped`)


def print_error(message: str, label: str = "error") -> None:
    """One line on stderr; the message is printed verbatim (paths may hold [ and ])."""
    err_console.print(Text.assemble((f"{label}:", "bold red"), " ", str(message).strip().replace("\n", " ")),
                      highlight=False, soft_wrap=True)


def print_warning(message: str) -> None:
    """One line on stderr, as text."""
    err_console.print(Text.assemble(("warning:", "bold yellow"), " ", message), highlight=False, soft_wrap=True)


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
            with stops_raised():
                return func(*args, **kwargs)
        except SettingError as exc:  # a value this command took as a flag: named by its flag
            given = kwargs.get(exc.setting) is not None  # as a flag, not from a file
            print_error(named_by_flag(exc, (flag_name(exc.setting),)) if given else str(exc))
            raise typer.Exit(EXIT_ERROR) from None
        except WindowGPTError as exc:
            print_error(str(exc))
            raise typer.Exit(EXIT_ERROR) from None
        except OSError as exc:
            print_error(describe_os_error(exc))
            raise typer.Exit(EXIT_ERROR) from None
        except Stopped as stop:
            print_error(stop.reason, label=stop.label)
            raise typer.Exit(stop.exit_status) from None
        except KeyboardInterrupt:
            print_error(Interrupted.reason, label=Interrupted.label)
            raise typer.Exit(Interrupted.exit_status) from None

    return wrapper


@contextlib.contextmanager
def stops_raised() -> Iterator[None]:
    """While a command works, Ctrl-C and SIGTERM raise `errors.Stopped` where it is, so that
    what it was writing is cleaned up before the process ends (a training loop takes them
    over itself, to stop at a step with a checkpoint)."""
    def stop(signum: int, frame: FrameType | None) -> None:
        if _importing(frame):  # a module the command imports as it goes (torch): see errors.end_at_once
            end_at_once(signum)
        raise stop_for(signum)

    try:
        previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: the signals are not this code's to take
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _importing(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class Command(typer.core.TyperCommand):
    """typer's command with its help shown plainly: a flag (`--resume`, `--compile/--no-compile`)
    takes no value, so the help gives none, and an argument of several paths is named by its
    metavar alone (typer would show `<bool>` and `<list[Path]>`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False):
                param.metavar = ""
            elif param.param_type_name == "argument" and param.nargs != 1 and param.metavar:
                param.display_type_rich = _no_type
        return params


def _no_type(ctx: Any) -> None:
    return None


def add_command(app: typer.Typer, name: str, func: Callable, **settings: Any) -> None:
    """Register a command under `name`, its flags shown bare (`Command`)."""
    app.command(name, cls=Command, **settings)(func)


def run_app(app: typer.Typer) -> None:
    """Run a command-line app. Exit codes: 0 done, 1 error, 2 usage error (one line on
    stderr), 130 interrupted, 143 terminated."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:  # EOF at a prompt
        print_error(Interrupted.reason, label=Interrupted.label)
        code = Interrupted.exit_status
    except Exception as exc:
        if not hasattr(exc, "format_message"):  # a usage error (click's, vendored or not) has one
            raise
        if not exc.format_message():  # the command alone: the help was shown
            sys.exit(0)
        print_error(exc.format_message())
        code = EXIT_USAGE
    sys.exit(code if isinstance(code, int) else 0)


FROM_ARTIFACT = "from the artifact"


def nonempty_path(value: str) -> Path:
    """A path option's value: an empty one (an unset shell variable, say) is a usage error,
    never the current directory."""
    if isinstance(value, Path):
        return value
    if not str(value).strip():
        raise typer.BadParameter("is empty; give a path")
    return Path(value)


def out_option(writes: str, replaces: str, flag: str = "--out") -> Any:
    """An output path option whose help says what it writes and exactly what it may replace."""
    return typer.Option(flag, parser=nonempty_path, metavar="PATH", show_default=False,
                        help=f"{writes} It replaces only {replaces}; any other file there is refused, as is a path "
                             "that is, holds or lies inside one of the command's inputs.")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return repr(value) if value == "" else str(value)


def shown_default(group: str, name: str) -> str:
    """The default preset's value of a field, and the tiny preset's where it differs."""
    default = _shown(getattr(getattr(preset("default"), group), name))
    tiny = _shown(getattr(getattr(preset("tiny"), group), name))
    return default if tiny == default else f"{default}; tiny preset: {tiny}"


def option_help(text: str, default: str, bounds: str = "") -> str:
    """Help text ending in its default (and what the value may be), escaped so that rich
    shows brackets as written."""
    return escape(f"{text} [default: {default}{'; ' + bounds if bounds else ''}]")


def _flag_annotation(group: str, name: str, hint: Any, help_text: str, aliases: tuple[str, ...]) -> Any:
    flag = flag_name(name)
    common = dict(help=help_text, rich_help_panel=f"{group} settings", show_default=False)
    if name in CHOICES:  # a usage error (exit 2) for anything else; shells complete the choices
        return Annotated[Optional[Literal[CHOICES[name]]], typer.Option(flag, *aliases, **common)]
    if hint is bool:
        decls = tuple(f"{f}/--no-{f[2:]}" for f in (flag, *aliases))
        return Annotated[Optional[bool], typer.Option(*decls, **common)]
    if typing.get_origin(hint) is tuple:
        return Annotated[Optional[str], typer.Option(flag, *aliases, **common)]
    return Annotated[Optional[hint], typer.Option(flag, *aliases, **common)]


def with_config_flags(*groups: str, from_artifact: bool = False, aliases: dict[str, tuple[str, ...]] | None = None,
                      leave_out: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Add one `--kebab-case` option per field of the named config groups to a command.

    Each option's help is the field's documentation and its default (the presets' values,
    or "from the artifact" for stages that start from an artifact's configuration).
    `aliases` gives extra flag names for some fields (the first is the one messages name);
    `leave_out` names fields that get no flag. The command then receives
    `overrides: dict[group, dict[field, value]]` holding only the flags the user gave, to
    apply over a preset or a loaded configuration.
    """

    def decorate(func: Callable) -> Callable:
        extra: list[inspect.Parameter] = []
        owners: dict[str, str] = {}
        for group in groups:
            hints = typing.get_type_hints(GROUP_TYPES[group])
            for f in group_fields(group):
                if f.name in leave_out:
                    continue
                default = FROM_ARTIFACT if from_artifact else shown_default(group, f.name)
                help_text = option_help(setting_help(group, f.name), default, bounds_text(f.name))
                annotation = _flag_annotation(group, f.name, hints[f.name], help_text, (aliases or {}).get(f.name, ()))
                extra.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                               annotation=annotation))
                owners[f.name] = group

        def call(kwargs: dict[str, Any]) -> Any:
            overrides: dict[str, dict[str, Any]] = {}
            for name, group in owners.items():
                value = kwargs.pop(name)
                if value is not None:
                    overrides.setdefault(group, {})[name] = value
            try:
                return func(overrides=overrides, **kwargs)
            except SettingError as exc:  # name the flag the user typed, not the setting behind it
                given = {name for values in overrides.values() for name in values}
                if exc.setting not in given:
                    raise
                names = (*(aliases or {}).get(exc.setting, ()), flag_name(exc.setting))
                raise SettingError(exc.setting, named_by_flag(exc, names)) from None

        return extended(func, "overrides", extra, call)

    return decorate


def named_by_flag(exc: SettingError, names: tuple[str, ...]) -> str:
    """The error's message with its setting named by the flag the command line holds."""
    return str(exc).replace(f"{exc.setting}=", f"{typed_flag(names)} ", 1)


def typed_flag(names: tuple[str, ...]) -> str:
    """Which of an option's names the command line holds (the first where none is found)."""
    for arg in sys.argv[1:]:
        for name in names:
            if arg == name or arg.startswith(name + "="):
                return name
    return names[0]


def with_options(target: str, options: dict[str, tuple[Any, Any]]) -> Callable[[Callable], Callable]:
    """Add the options ({parameter: (annotation, default)}, written once for several
    commands) to a command, which receives them as one dict, its parameter `target`."""

    def decorate(func: Callable) -> Callable:
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
                 for name, (annotation, default) in options.items()]

        def call(kwargs: dict[str, Any]) -> Any:
            return func(**{target: {name: kwargs.pop(name) for name in options}}, **kwargs)

        return extended(func, target, extra, call)

    return decorate


def extended(func: Callable, replaced: str, extra: list[inspect.Parameter],
             call: Callable[[dict[str, Any]], Any]) -> Callable:
    """func with its parameter `replaced` swapped for the `extra` ones, as typer reads a
    command's signature; `call` gets the given arguments and calls func."""
    base = inspect.signature(func, eval_str=True)
    params = [p for p in base.parameters.values() if p.name != replaced] + extra

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        return call(kwargs)

    wrapper.__signature__ = base.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # typer must read the new signature, not the original
    return wrapper


def build_config(config_file: Optional[Path], preset_name: Optional[str],
                 overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """The preset (default: the reference's settings), then the file's settings over it,
    then the flags given."""
    base = preset(preset_name or "default")
    if config_file is not None:
        base = load_config_file(config_file, base)
    return apply_overrides(base, overrides)


ConfigFileOption = Annotated[Optional[Path], typer.Option(
    "--config", help="Settings from a JSON, TOML or YAML file ({section: {setting: value}}, as a run's config.json "
    "or configs/*.json; it may hold only some), applied over the preset; flags apply over both.",
    show_default=False)]
PresetOption = Annotated[Optional[Literal[tuple(PRESETS)]], typer.Option(  # type: ignore[misc]
    "--preset", help=escape("Start from a named preset: default (the reference's settings), tiny (a small model "
                            "for a CPU) or frontier (the final leaderboard record's recipe, as far as windowgpt's "
                            "settings go; data with an 8,192-token tokenizer). [default: default]"),
    show_default=False)]
