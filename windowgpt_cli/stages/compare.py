"""`windowgpt compare`: runs and artifacts side by side, one column each: their scores,
speed and size, and the settings in which they differ."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from ..cli_support import console, user_errors_exit_1
from ..errors import ConfigError

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    from ..artifact_info import ArtifactInfo

# (row label, key in a column's record, format)
METRIC_ROWS = (
    ("kind", "kind", "{}"),
    ("val_bpb (end of training)", "val_bpb", "{:.4f}"),
    ("val_bpb post-EMA", "post_ema_val_bpb", "{:.4f}"),
    ("val_bpb standard eval", "standard_bpb", "{:.4f}"),
    ("val_bpb sliding eval", "sliding_bpb", "{:.4f}"),
    ("val_bpb TTT eval", "ttt_bpb", "{:.4f}"),
    ("steps", "steps", "{:,}"),
    ("ms / step", "ms_per_step", "{:.1f}"),
    ("tokens / s", "tokens_per_s", "{:,.0f}"),
    (".ptz bytes", "ptz_bytes", "{:,}"),
)


def column(info: ArtifactInfo) -> dict[str, Any]:
    """One column's figures; None where the artifact has none (no eval result saved, ...)."""
    summary = info.summary or {}
    steps = summary.get("step", info.step)
    time_ms = summary.get("training_time_ms", info.training_time_ms)
    timed = bool(steps) and bool(time_ms)
    return {
        "name": info.name, "artifact": str(info.path), "kind": info.kind,
        "val_bpb": summary.get("val_bpb"), "post_ema_val_bpb": summary.get("post_ema_val_bpb"),
        **{f"{mode}_bpb": info.evals.get(mode, {}).get("val_bpb") for mode in ("standard", "sliding", "ttt")},
        "steps": steps,
        "ms_per_step": time_ms / steps if timed else None,
        "tokens_per_s": info.config.train.train_batch_tokens * steps / (time_ms / 1000) if timed else None,
        "ptz_bytes": info.file_bytes if info.kind == "ptz" else None,
    }


def compare(paths: list[Path]) -> dict[str, Any]:
    """Everything `compare --json` prints: the columns and the differing settings."""
    from ..artifact_info import differing_settings, read_artifact

    if not paths:
        raise ConfigError("give at least one run or artifact to compare")
    infos = [read_artifact(Path(p)) for p in paths]
    columns = [column(info) for info in infos]
    names = [c["name"] for c in columns]
    if len(set(names)) < len(names):  # same-named runs in different folders: say which is which
        for c in columns:
            c["name"] = c["artifact"]
    return {"columns": columns, "settings": differing_settings([info.config for info in infos])}


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
    artifacts: Annotated[list[Path], typer.Argument(help="Training run directories, exports or .ptz files.",
                                                    show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")] = False,
) -> None:
    """Compare runs: scores (with the eval results saved beside each artifact), speed, size and differing settings."""
    result = compare(artifacts)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        console.print(compare_table(result))
