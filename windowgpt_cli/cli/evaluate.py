"""`windowgpt eval`: val_loss and val_bpb of an artifact (`eval.evaluate`), as a table or JSON."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Literal, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..challenge import EVAL_SECONDS, GPU_MODEL, GPUS
from ..config import CHOICES
from .support import (
    console,
    err_console,
    option_help,
    print_warning,
    user_errors_exit_1,
    with_config_flags,
    with_options,
)


def timings_line(record: dict[str, Any]) -> str:
    inner = ", ".join(f"{name} {s:.1f}s" for name, s in record.get("scoring_timings_s", {}).items())
    line = "time: " + ", ".join(f"{name} {s:.1f}s" for name, s in record["timings_s"].items())
    return f"{line} (scoring: {inner})" if inner else line


def results_table(record: dict[str, Any], title: str) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    lora = record.get("mode") == "ttt_lora"
    windows = ([("seq_len / documents per batch", f"{record['seq_len']} / {record['batch_seqs']}")] if lora else
               [("seq_len / stride", f"{record['seq_len']} / {record['stride']}"),
                ("windows per batch", str(record["batch_seqs"]))])
    rows = [
        ("val_bpb", f"{record['val_bpb']:.8f}"),
        ("val_loss", f"{record['val_loss']:.8f}"),
        ("mode", record["mode"]),
        *windows,
        ("tokens scored", f"{record['tokens']:,}"),
        ("bytes", f"{record['bytes']:,}"),
        ("seconds", f"{record['seconds']:.2f}"),
        ("tokens / second", f"{record['tokens_per_second']:,.0f}"),
        ("artifact", f"{record['artifact']} ({record['artifact_kind']}, sha256 {record['artifact_sha256'][:16]})"),
    ]
    rows += [(f"phase group {i + 1}", "-" if p["val_bpb"] is None else f"val_bpb {p['val_bpb']:.6f} "
              f"({p['tokens']:,} tokens)") for i, p in enumerate(record.get("per_phase", []))]
    if record.get("eval_cap"):
        rows.append(("time against the cap", cap_text(record["eval_cap"])))
    for name, value in rows:
        table.add_row(name, value)
    return table


def cap_text(cap: dict[str, Any]) -> str:
    """"41.2 s of 4,800 s (600 s on 8 H100, on 1 x NVIDIA H200)", or without a cap, why not."""
    if cap["cap_seconds"] is None:
        return f"{cap['seconds']:.1f} s (no cap for {cap['hardware']}: not comparable with the challenge's H100s)"
    return (f"{cap['seconds']:.1f} s of {cap['cap_seconds']:,.0f} s (the challenge's {EVAL_SECONDS:.0f} s on {GPUS} "
            f"{GPU_MODEL}, on {cap['hardware']})")


def report(record: dict[str, Any], title: str, as_json: bool) -> None:
    from ..data.tokenizer import no_byte_fallback_warning
    from ..storage.files import json_text

    if record.get("tokenizer_byte_fallback") is False:
        print_warning(no_byte_fallback_warning(Path(record["tokenizer"])))
    if as_json:
        typer.echo(json_text(record))
    else:
        console.print(results_table(record, title))
    if "timings_s" in record:
        err_console.print(timings_line(record), highlight=False, soft_wrap=True)


@contextlib.contextmanager
def batch_progress(label: str, compiling: bool) -> Iterator[Callable[[int, int], None]]:
    """A transient rich bar over batches on stderr. With compiling, it says so until the
    first batch is done (compiling takes most of a first run's start)."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task(f"{label} (compiling)" if compiling else label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=label)

        yield update


# --- Options shared with eval-ttt -------------------------------------------------------

ArtifactArg = Annotated[Path, typer.Argument(
    help="A training run directory (its EMA weights), an export directory, or a .ptz.", show_default=False)]
DataOption = Annotated[Path, typer.Option(
    "--data", help="Directory with the fineweb_val_*.bin shards (and tokenizer.model).", show_default=False)]
DeviceOption = Annotated[Literal[CHOICES["device"]], typer.Option("--device", help="auto: CUDA when available.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the results as JSON on stdout (and nothing else).")]
# What scoring takes besides the settings: written once, for eval and eval-ttt.
SCORING_OPTIONS: dict[str, tuple[Any, Any]] = {
    "tokenizer": (Annotated[Optional[Path], typer.Option(
        "--tokenizer", help=option_help("SentencePiece model for byte counts.", "DATA/tokenizer.model"),
        show_default=False)], None),
    "device": (DeviceOption, "auto"),
    "attn_backend": (Annotated[Literal[CHOICES["attn_backend"]], typer.Option(
        "--attn-backend", help="Attention kernels (auto: FlashAttention-3 where installed, else Triton on CUDA).")],
        "auto"),
    "score_once": (Annotated[bool, typer.Option(
        "--score-once", help="Score every token exactly once. The reference scores the last STRIDE tokens again "
        "in each of its final, shorter windows; by default so does this, to give its numbers.")], False),
    "compile_model": (Annotated[Optional[bool], typer.Option(
        "--compile/--no-compile", help=option_help("torch.compile the model.", "on CUDA"), show_default=False)], None),
    "fused": (Annotated[Optional[bool], typer.Option(
        "--fused/--no-fused", help=option_help("Score sliding windows (and train eval-ttt's steps) with windowgpt's "
        "fused GPU kernels; --no-fused runs the model's torch code, its scoring compiled with --compile.",
        "on CUDA with Triton"), show_default=False)], None),
}
# eval's and eval-ttt's settings under the names the reference's evaluation gives them
EVAL_FLAG_ALIASES = {"eval_stride": ("--stride",), "eval_seq_len": ("--seq-len",), "eval_batch_seqs": ("--batch-seqs",)}


def progress_display(display: Callable) -> Callable | None:
    """The display where stderr is a terminal; elsewhere none (plain log lines)."""
    return display if err_console.is_terminal else None


@user_errors_exit_1
@with_config_flags("eval", from_artifact=True, aliases=EVAL_FLAG_ALIASES)
@with_options("scoring", SCORING_OPTIONS)
def command(
    artifact: ArtifactArg,
    data: DataOption,
    as_json: JsonOption = False,
    scoring: dict[str, Any] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Score an artifact on the validation shards: val_loss and val_bpb (standard or sliding window).

    Example: windowgpt eval demo-out/model.ptz --data demo-out/data --stride 64
    """
    from ..eval.evaluate import evaluate_artifact  # imports torch: only when the command runs

    out = evaluate_artifact(artifact, data, settings=overrides, **(scoring or {}),
                            progress=progress_display(batch_progress))
    if out.is_main:
        report(out.record, f"eval ({out.result.mode})", as_json)
