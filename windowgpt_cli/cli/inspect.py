"""`windowgpt inspect`: what a run, an export, a `.ptz` or the packed code holds, without
building its model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..challenge import BUDGET_BYTES
from .support import console, user_errors_exit_1


def _number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def bits_text(row: dict[str, Any]) -> str:
    """A tensor group's code widths, with its LQER corrections: "6/8 +lqer x3"."""
    bits = "/".join(str(b) for b in row.get("bits", []))
    return bits + (f" +lqer x{row['lqer']}" if row.get("lqer") else "")


def error_text(row: dict[str, Any]) -> str:
    """A tensor group's round-trip relative squared error ("" where none is recorded)."""
    return "" if "rel_error" not in row else f"{row['rel_error']:.2e}" if row["rel_error"] else "0"


def compressed_bytes(group: str, sections: list[dict[str, Any]]) -> str:
    """A tensor group's bytes in a per-group coded .ptz ("" for a whole-payload compressor)."""
    coded = [s["compressed_bytes"] for s in sections if str(s["section"]).split("/")[0] == group]
    return f"{sum(coded):,}" if coded else ""


def sections_table(sections: list[dict[str, Any]]) -> Table:
    """The sections of a per-group coded .ptz: the codec and layout each one chose."""
    table = Table(title="sections (the rest: header and small tensors, in the map, lzma)")
    for col in ("section", "tensors", "codec", "layout", "bytes", "compressed"):
        table.add_column(col, justify="left" if col in ("section", "codec", "layout") else "right")
    for s in sections:
        table.add_row(str(s["section"]), str(s["tensors"]), str(s["codec"]), str(s["transform"]),
                      f"{s['raw_bytes']:,}", f"{s['compressed_bytes']:,}")
    return table


def file_table(r: dict[str, Any], kind: str) -> Table:
    """A table of fields, opening with the file's sha256 and size."""
    table = Table(title=f"{r['artifact']} ({kind})", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("sha256", r["sha256"])
    table.add_row("size", f"{r['file_bytes']:,} bytes")
    return table


def inspect_table(r: dict[str, Any]) -> Table:
    from ..artifacts.inspect import eval_windows_text

    table = file_table(r, f"{r['kind']}, format {r['format_version']}")
    if r["step"] is not None:
        seconds = f", {r['training_time_ms'] / 1000:.1f} s of training" if r["training_time_ms"] else ""
        table.add_row("step", f"{r['step']:,}{seconds}")
    table.add_row("parameters", f"{r['parameters']:,}")
    for name, g in r["groups"].items():
        schemes = ", ".join(f"{k} x{n}" for k, n in g.get("schemes", {}).items())
        line = f"{g['params']:,} params in {g['tensors']} tensors, {g['bytes']:,} bytes" + (
            f" ({schemes})" if schemes else "")
        if "bits" in g:
            line += f"; bits {bits_text(g)}, rel. error {error_text(g) or 'not recorded'}"
        compressed = compressed_bytes(name, r.get("sections", []))
        table.add_row(f"  {name}", line + (f"; {compressed} compressed" if compressed else ""))
    if r["kind"] == "ptz":
        style = "green" if r["within_budget"] else "bold red"
        table.add_row("compressor", r["compressor"])
        table.add_row("budget", Text.assemble((f"{r['total_bytes']:,}", style),
                                              f" bytes (model {r['file_bytes']:,} + code {r['code_bytes']:,}) of "
                                              f"{r['budget_bytes']:,}"))
        table.add_row("code counted", f"{r['code_counted'] or 'not recorded'} (from {r['code_from']})")
    for key, value in r["lineage"].items():
        table.add_row(f"from: {key}", _number(value))
    if r["training"]:
        t = r["training"]
        table.add_row("trained", f"val_bpb {_number(t['val_bpb'])}, post-EMA {_number(t['post_ema_val_bpb'])} "
                      f"at step {_number(t['step'])}")
    for mode, e in r["evals"].items():
        table.add_row(f"eval {mode}", f"val_bpb {e['val_bpb']:.6f} ({eval_windows_text(mode, e)})")
    table.add_section()
    if not r["config_changes"]:
        table.add_row("settings", "the reference's defaults")
    for key, change in r["config_changes"].items():
        table.add_row(key, Text.assemble(_number(change["value"]), "  ", (f"(default {_number(change['default'])})",
                                                                           "dim")))
    return table


def packed_code_table(r: dict[str, Any]) -> Table:
    table = file_table(r, r["kind"])
    table.add_row("form", r["form"])
    table.add_row("source", f"{r['source_bytes']:,} bytes uncompressed")
    return table


@user_errors_exit_1
def command(
    artifact: Annotated[Path, typer.Argument(help="A training run directory, an export directory, a .ptz or the "
                                             "packed code (code.pyz).", show_default=False)],
    budget: Annotated[int, typer.Option("--budget", help="Bytes allowed for code plus compressed model.")]
    = BUDGET_BYTES,
    code: Annotated[Path | None, typer.Option("--code", help="The packed code (code.pyz) a .ptz's budget counts; "
                                              "without it, the code its quantize report counted (MODEL.ptz.json), "
                                              "else this windowgpt's record modules' source.",
                                              show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")] = False,
) -> None:
    """Show what an artifact holds: settings, sizes by group, quantization, budget, hashes and lineage.

    Example: windowgpt inspect demo-out/model.ptz
    """
    from ..artifacts import inspect as describe  # loaded only when the command runs

    record = describe.inspect_artifact(artifact, budget, code)
    if as_json:
        typer.echo(json.dumps(record, indent=2))
    elif record["kind"] == describe.PACKED_CODE:
        console.print(packed_code_table(record))
    else:
        console.print(inspect_table(record))
        if record.get("sections"):
            console.print(sections_table(record["sections"]))
