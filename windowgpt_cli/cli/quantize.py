"""`windowgpt quantize`: a run or export into a `.ptz` (`quant.quantize`), with its budget table."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..challenge import BUDGET_BYTES, INSIDE_TRAINING
from ..errors import ArtifactError
from .inspect import bits_text, compressed_bytes, error_text, sections_table
from .support import console, err_console, option_help, out_option, user_errors_exit_1, with_config_flags

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    from ..quant.quantize import StartPhase


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[StartPhase | None]:
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description:12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bars:
        def start(description: str, total: int) -> Callable[[int], None]:
            task = bars.add_task(description, total=total)
            return lambda n: bars.advance(task, n)

        yield start


def _budget_table(report: dict[str, Any]) -> Table:
    chosen = f" by {report['compressor_option']}" if report["compressor_option"] != report["compressor"] else ""
    table = Table(title=f"{Path(report['artifact']).name} ({report['compressor']}{chosen}, clip {report['clip_range']}"
                        f"{', GPTQ' if report['gptq'] else ''})")
    for col in ("group", "params", "bits", "rel. error", "quantized bytes", "compressed"):
        table.add_column(col, justify="left" if col == "group" else "right", no_wrap=col == "group")
    for name, row in report["groups"].items():
        if row["tensors"]:
            table.add_row(name, f"{row['params']:,}", bits_text(row), error_text(row), f"{row['quantized_bytes']:,}",
                          compressed_bytes(name, report.get("sections", [])))
    table.add_section()
    table.add_row("payload", "", "", "", f"{report['payload_bytes']:,}", "")
    table.add_row("compressed model", "", "", "", "", f"{report['model_bytes']:,}")
    table.add_row("code", "", "", "", "", f"{report['code_bytes']:,}")
    style = "green" if report["within_budget"] else "bold red"
    table.add_row("total", "", "", "", "", Text(f"{report['total_bytes']:,}", style=style))
    table.add_row("budget", "", "", "", "", f"{report['budget_bytes']:,}")
    table.add_row("headroom", "", "", "", "", Text(f"{report['headroom_bytes']:,}", style=style))
    return table


def _timing_line(report: dict[str, Any]) -> str:
    return "time: " + ", ".join(f"{k} {v:.2f}s" for k, v in report["timings_s"].items()) + f" on {report['device']}"


def _code_line(report: dict[str, Any]) -> str:
    """Which form of the code was counted, with the source figure beside a packed one."""
    line = f"code: {report['code_counted']}, {report['code_bytes']:,} bytes"
    if report["code_archive"]:
        return line + f" ({report['code_archive']}; its source uncompressed: {report['code_source_bytes']:,} bytes)"
    return line + f" ({len(report['code_modules'])} modules; `windowgpt pack` packs them smaller)"


def _calibration_line(report: dict[str, Any]) -> str | None:
    """Where GPTQ's Hessians came from: only Hessians from inside training make a record artifact."""
    if report["calibration"] is None:
        return None
    info = report["calibration_info"]
    line = (f"calibration: {report['calibration']} ({info['batches']} batches, {info['tokens']:,} tokens, "
            f"{info['seconds']:.1f}s")
    if report["calibration"] == INSIDE_TRAINING:
        return line + f" at step {info['step']}, {info['hessians']})"
    return line + "): outside the training budget, not a record artifact"


def _fit_line(report: dict[str, Any]) -> str | None:
    """What fitting into the budget (quant_fit_budget) gave up, when it had to."""
    fit = report.get("fit")
    if not fit or not fit["zeroed_codes"]:
        return None
    outcome = "fits" if fit["fitted"] else "still does not fit"
    line = (f"fit: zeroed {fit['zeroed_codes']:,} codes of +-1 ({100 * fit['zeroed_fraction']:.2f}% of the codes) "
            f"in {fit['rounds']} rounds: model {fit['bytes_before']:,} -> {fit['bytes_after']:,} bytes, {outcome} "
            f"in {fit['allowed_bytes']:,}")
    if report["code_archive"] is None:  # the source counts several times the packed code's bytes
        line += ("; the code counted is its source: quantize run from `windowgpt pack`'s archive counts the packed "
                 "code and gives up fewer codes")
    return line


QUANT_FLAG_ALIASES = {"use_gptq": ("--gptq",), "gptq_calib_samples": ("--calib-batches",),
                      "quant_clip_range": ("--clip-range",)}


@user_errors_exit_1
@with_config_flags("quant", from_artifact=True, aliases=QUANT_FLAG_ALIASES)
def command(
    model_dir: Annotated[Path, typer.Argument(help="An export directory, or a run directory (its EMA weights).",
                                              show_default=False)],
    out: Annotated[Path, out_option("The .ptz file to write, and its report OUT.json beside it.",
                                    "a .ptz and a quantize report")],
    data: Annotated[Optional[Path], typer.Option("--data", help=option_help(
        "Training shards for GPTQ calibration, when the run holds no Hessians from training.",
        "the artifact's data_path"), show_default=False)] = None,
    compressor: Annotated[Optional[str], typer.Option("--compressor", help=option_help(
        "Payload compressor: auto (each tensor group with the codec and byte layout that make it smallest: "
        "lzma, rans, and brotli and zstd where installed, over transposed, similarity-sorted or byte-shuffled "
        "layouts), or one for the whole payload: lzma (the reference's xz preset 6), rans, brotli, zstd "
        "(brotli and zstd: pip install 'windowgpt[compress]').", "auto"), show_default=False)] = None,
    budget: Annotated[int, typer.Option("--budget", help="Bytes allowed for code plus compressed model; "
                      "exceeding it exits 1 (the artifact is still written).")] = BUDGET_BYTES,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu or cuda.")] = "auto",
    recalibrate: Annotated[bool, typer.Option("--recalibrate", help="Calibrate GPTQ on --data even when the run "
                           "holds Hessians from training.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of a table.")] = False,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Quantize to int6/int8 (optionally GPTQ), compress, and check the size budget.

    Example: windowgpt quantize demo-out/export --out demo-out/model.ptz --gptq
    """
    from ..quant.quantize import quantize, report_path

    with _progress_bars(not json_output) as progress:
        report = quantize(model_dir, out, data_dir=data, compressor=compressor, budget=budget, device=device,
                          recalibrate=recalibrate, settings=(overrides or {}).get("quant"), progress=progress)
    if json_output:
        console.print_json(data=report)
    else:
        console.print(_budget_table(report))
        if report.get("sections"):
            console.print(sections_table(report["sections"]))
        console.print(_timing_line(report), highlight=False)
        console.print(_code_line(report), highlight=False, soft_wrap=True)
        for line in (_fit_line(report), _calibration_line(report)):
            if line:
                console.print(line, highlight=False)
        console.print(f"wrote {out} (sha256 {report['sha256'][:16]}...) and {report_path(out)}", highlight=False)
    if not report["within_budget"]:
        raise ArtifactError(f"{out}: {report['total_bytes']:,} bytes (model {report['model_bytes']:,} + code "
                            f"{report['code_bytes']:,}) exceed the budget of {report['budget_bytes']:,} by "
                            f"{-report['headroom_bytes']:,}")
