"""`windowgpt export`: a training checkpoint's chosen weights as per-layer tensors
(`artifacts.export`)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .support import console, out_option, user_errors_exit_1


@user_errors_exit_1
def command(
    run_dir: Annotated[Path, typer.Argument(help="A training run directory (holds checkpoint.pt).",
                                            show_default=False)],
    out: Annotated[Path, out_option("The export directory to write.", "an export directory (or an empty one)")],
    weights: Annotated[str, typer.Option(help="Which weights: ema (what the reference applies), swa (averaged "
                                                "snapshots) or last (the final step).")] = "ema",
    json_output: Annotated[bool, typer.Option("--json", help="Print export.json instead of a table.")] = False,
) -> None:
    """Export a checkpoint's weights as per-layer tensors (safetensors) with its config."""
    from ..artifacts.export import export  # imports torch: only when the command runs

    info = export(run_dir, out, weights)
    if json_output:
        console.print_json(data=info)
        return
    table = Table(title=f"exported {out}", show_header=False)
    for key in ("weights", "step", "tensor_count", "parameter_count", "source_sha256", "tokenizer_sha256"):
        value = info[key]
        table.add_row(key, f"{value:,}" if isinstance(value, int) and key != "step" else str(value))
    console.print(table)
