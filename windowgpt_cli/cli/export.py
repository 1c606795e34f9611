"""`windowgpt export`: a training checkpoint's chosen weights as per-layer tensors
(`artifacts.export`)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.table import Table

from .support import console, out_option, user_errors_exit_1


@user_errors_exit_1
def command(
    run_dir: Annotated[Path, typer.Argument(help="A training run directory (holds checkpoint.pt).",
                                            show_default=False)],
    out: Annotated[Path, out_option("The export directory to write.",
                                    "an export directory of the same format (or an empty one)")],
    weights: Annotated[str, typer.Option(help="Which weights: ema (what the reference applies), swa (averaged "
                                                "snapshots) or last (the final step).")] = "ema",
    export_format: Annotated[Literal["windowgpt", "hf"], typer.Option(
        "--format", help="windowgpt: per-layer tensors for quantize and eval; hf: a folder Hugging Face "
        "transformers loads (AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True), windowgpt "
        "installed), to share on the Hub.")] = "windowgpt",
    json_output: Annotated[bool, typer.Option("--json", help="Print export.json (or the hf config.json) instead "
                                                              "of a table.")] = False,
) -> None:
    """Export a checkpoint's weights as per-layer tensors (safetensors) with its config.

    Example: windowgpt export demo-out/run --out demo-out/export  (--format hf for transformers)
    """
    if export_format == "hf":
        from ..artifacts.hf import export_hf  # imports torch: only when the command runs

        config = export_hf(run_dir, out, weights)
        if json_output:
            console.print_json(data=config)
        else:
            console.print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, "
                          "trust_remote_code=True)", highlight=False, soft_wrap=True)
        return
    from ..artifacts.export import export

    info = export(run_dir, out, weights)
    if json_output:
        console.print_json(data=info)
        return
    table = Table(title=f"exported {out}", show_header=False)
    for key in ("weights", "step", "tensor_count", "parameter_count", "source_sha256", "tokenizer_sha256"):
        value = info[key]
        table.add_row(key, f"{value:,}" if isinstance(value, int) and key != "step" else str(value))
    console.print(table)
