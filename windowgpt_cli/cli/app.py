"""The `windowgpt` command: one subcommand per stage, each a thin edge over plain Python."""
from __future__ import annotations

import typer

from .. import __version__
from . import compare, generate, inspect, pack, plot, prepare, report, tokenizer_meta
from .record_app import add_record_stages
from .support import add_command, run_app

app = typer.Typer(
    name="windowgpt",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    help="Train, compress and score tiny language models under a 16 MB artifact budget.",
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"windowgpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Stages pass checkpoints and artifacts on disk, so each can be rerun on its own."""


add_command(app, "prepare", prepare.command)
add_command(app, "tokenizer-meta", tokenizer_meta.command)
add_record_stages(app)
add_command(app, "report", report.command)
add_command(app, "generate", generate.command)
add_command(app, "inspect", inspect.command)
add_command(app, "plot", plot.command)
add_command(app, "compare", compare.command)
add_command(app, "pack", pack.command)


def main() -> None:
    run_app(app)
