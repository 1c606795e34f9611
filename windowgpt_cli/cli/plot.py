"""`windowgpt plot`: training curves of one or several runs (train_loss and val_bpb against
step and against training time), as a PNG or a self-contained HTML page.

Reads RUN/metrics.jsonl and RUN/config.json, so a run still training can be plotted.
Needs matplotlib, the optional extra `windowgpt[plot]`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .support import console, out_option, user_errors_exit_1


@user_errors_exit_1
def command(
    runs: Annotated[list[Path], typer.Argument(
        metavar="RUN", help="Training run directories (or exports / .ptz files of runs that can be found).",
        show_default=False)],
    out: Annotated[Path, out_option("The picture to write: FILE.png or FILE.html.", "a picture plot wrote")],
) -> None:
    """Plot train_loss and val_bpb against step and training time for one or more runs.

    Example: windowgpt plot runs/a runs/b --out curves.png
    """
    from ..artifacts.curves import plot_runs  # imports torch: only when the command runs

    path = plot_runs(runs, out)
    console.print(f"wrote {path}", highlight=False)
