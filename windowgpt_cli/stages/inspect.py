"""`windowgpt inspect`: what a run, an export or a `.ptz` holds, without building its model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from ..cli_support import console, user_errors_exit_1
from ..codesize import code_bytes
from .quantize import DEFAULT_BUDGET

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    from ..artifact_info import ArtifactInfo


def inspect_artifact(path: Path, budget: int = DEFAULT_BUDGET) -> dict[str, Any]:
    """Everything `inspect --json` prints."""
    from ..artifact_info import changed_from_defaults, read_artifact

    info = read_artifact(Path(path))
    record: dict[str, Any] = {
        "artifact": str(info.path), "kind": info.kind, "format_version": info.format_version,
        "sha256": info.sha256, "file_bytes": info.file_bytes, "step": info.step,
        "training_time_ms": info.training_time_ms or (info.summary or {}).get("training_time_ms"),
        "tokenizer_sha256": info.tokenizer_sha256,
        "parameters": info.params,
        "groups": {name: {"tensors": g.tensors, "params": g.params, "bytes": g.bytes,
                          **({"schemes": g.schemes} if g.schemes else {})} for name, g in info.groups.items()},
        "config_changes": {k: {"value": v, "default": d} for k, (v, d) in changed_from_defaults(info.config).items()},
        "lineage": info.lineage, "run_dir": str(info.run_dir) if info.run_dir else None,
        "training": _training_summary(info), "evals": {mode: _eval_summary(r) for mode, r in info.evals.items()},
    }
    if info.kind == "ptz":
        code = code_bytes()
        total = info.file_bytes + code
        record.update({"compressor": info.compressor, "code_bytes": code, "total_bytes": total,
                       "budget_bytes": budget, "within_budget": total <= budget})
    return record


def _training_summary(info: ArtifactInfo) -> dict[str, Any] | None:
    s = info.summary
    if s is None:
        return None
    keys = ("step", "training_time_ms", "val_loss", "val_bpb", "post_ema_val_loss", "post_ema_val_bpb")
    return {k: s.get(k) for k in keys}


def _eval_summary(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("val_bpb", "val_loss", "seq_len", "stride", "tokens", "seconds", "artifact_sha256")
    return {k: record.get(k) for k in keys}


def _number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def inspect_table(r: dict[str, Any]) -> Table:
    table = Table(title=f"{r['artifact']} ({r['kind']}, format {r['format_version']})", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("sha256", r["sha256"])
    table.add_row("size", f"{r['file_bytes']:,} bytes")
    if r["step"] is not None:
        seconds = f", {r['training_time_ms'] / 1000:.1f} s of training" if r["training_time_ms"] else ""
        table.add_row("step", f"{r['step']:,}{seconds}")
    table.add_row("parameters", f"{r['parameters']:,}")
    for name, g in r["groups"].items():
        schemes = ", ".join(f"{k} x{n}" for k, n in g.get("schemes", {}).items())
        table.add_row(f"  {name}", f"{g['params']:,} params in {g['tensors']} tensors, {g['bytes']:,} bytes"
                      + (f" ({schemes})" if schemes else ""))
    if r["kind"] == "ptz":
        style = "green" if r["within_budget"] else "bold red"
        table.add_row("compressor", r["compressor"])
        table.add_row("budget", f"[{style}]{r['total_bytes']:,}[/] bytes (model {r['file_bytes']:,} + code "
                      f"{r['code_bytes']:,}) of {r['budget_bytes']:,}")
    for key, value in r["lineage"].items():
        table.add_row(f"from: {key}", _number(value))
    if r["training"]:
        t = r["training"]
        table.add_row("trained", f"val_bpb {_number(t['val_bpb'])}, post-EMA {_number(t['post_ema_val_bpb'])} "
                      f"at step {_number(t['step'])}")
    for mode, e in r["evals"].items():
        table.add_row(f"eval {mode}", f"val_bpb {e['val_bpb']:.6f} (seq_len {e['seq_len']}, stride {e['stride']})")
    table.add_section()
    if not r["config_changes"]:
        table.add_row("settings", "the reference's defaults")
    for key, change in r["config_changes"].items():
        table.add_row(key, f"{_number(change['value'])}  [dim](default {_number(change['default'])})[/]")
    return table


@user_errors_exit_1
def command(
    artifact: Annotated[Path, typer.Argument(help="A training run directory, an export directory or a .ptz.",
                                             show_default=False)],
    budget: Annotated[int, typer.Option("--budget", help="Bytes allowed for code plus compressed model.")]
    = DEFAULT_BUDGET,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")] = False,
) -> None:
    """Show what an artifact holds: settings, sizes by group, quantization, budget, hashes and lineage."""
    record = inspect_artifact(artifact, budget)
    if as_json:
        typer.echo(json.dumps(record, indent=2))
    else:
        console.print(inspect_table(record))
