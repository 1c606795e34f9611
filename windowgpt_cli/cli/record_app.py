"""The record stages' command line: what the packed code (`windowgpt pack`) runs.

The packed archive holds only the modules a record run imports, so its command line
registers only the record stages, under the names `windowgpt` gives them.
"""
from __future__ import annotations

import typer

from . import eval_ttt, evaluate, export, quantize, train
from .support import add_command, run_app


def add_record_stages(app: typer.Typer) -> None:
    """Register train, export, quantize, eval and eval-ttt (the full command line too)."""
    add_command(app, "train", train.command, context_settings={"max_content_width": 120})
    add_command(app, "export", export.command)
    add_command(app, "quantize", quantize.command)
    add_command(app, "eval", evaluate.command)
    add_command(app, "eval-ttt", eval_ttt.command)


app = typer.Typer(name="windowgpt", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="windowgpt's record stages, packed: train, export, quantize, eval, eval-ttt.")
add_record_stages(app)


def main() -> None:
    run_app(app)
