"""`windowgpt compare`: runs and artifacts side by side, one column each: their scores,
speed and size, and the settings in which they differ."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .support import console, user_errors_exit_1

# (row label, key in a column's record, format)
METRIC_ROWS = (
    ("kind", "kind", "{}"),
    ("val_bpb (end of training)", "val_bpb", "{:.4f}"),
    ("val_bpb post-EMA", "post_ema_val_bpb", "{:.4f}"),
    ("val_bpb standard eval", "standard_bpb", "{:.4f}"),
    ("val_bpb sliding eval", "sliding_bpb", "{:.4f}"),
    ("val_bpb TTT eval", "ttt_bpb", "{:.4f}"),
    ("val_bpb LoRA TTT eval", "ttt_lora_bpb", "{:.4f}"),
    ("steps", "steps", "{:,}"),
    ("ms / step", "ms_per_step", "{:.1f}"),
    ("tokens / s", "tokens_per_s", "{:,.0f}"),
    (".ptz bytes", "ptz_bytes", "{:,}"),
)


def compare_table(result: dict[str, Any]) -> Table:
    columns = result["columns"]
    table = Table()
    table.add_column("")
    for c in columns:
        table.add_column(c["name"], justify="right")
    for label, key, fmt in METRIC_ROWS:
        values = [c[key] for c in columns]
        if any(v is not None for v in values):
            table.add_row(label, *("-" if v is None else fmt.format(v) for v in values))
    if result["settings"]:
        table.add_section()
        for key, values in result["settings"].items():
            table.add_row(key, *(",".join(map(str, v)) if isinstance(v, list) else str(v) for v in values))
    elif len(columns) > 1:
        table.add_section()
        table.add_row("settings", *["same"] * len(columns))
    return table


@user_errors_exit_1
def command(
    artifacts: Annotated[list[Path], typer.Argument(
        metavar="ARTIFACT", help="Training run directories, exports or .ptz files.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")] = False,
) -> None:
    """Compare runs: scores (with the eval results saved beside each artifact), speed, size and differing settings.

    Example: windowgpt compare runs/a runs/b runs/b.ptz
    """
    from ..artifacts.compare import compare  # imports torch: only when the command runs

    result = compare(artifacts)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        console.print(compare_table(result))
