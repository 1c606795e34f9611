"""`windowgpt tokenizer-meta`: a tokenizer's byte tables written or checked (`data.tokenizer_meta`)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from .support import console, out_option, print_warning, user_errors_exit_1

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    from ..data.tokenizer_meta import TokenizerMetaReport


def _byte_table(report: TokenizerMetaReport) -> Table:
    table = Table(title="byte accounting: counted bytes vs the UTF-8 text the tokenizer encodes",
                  title_justify="left")
    for name in ("sample", "tokens", "<unk>", "UTF-8 bytes", "normalized", "counted", "difference", "%"):
        table.add_column(name, justify="left" if name == "sample" else "right")
    rows = report.counts + ([report.total] if len(report.counts) > 1 else [])
    for c in rows:
        style = "bold" if c is rows[-1] and len(rows) > 1 else None
        diff_style = "" if c.discrepancy == 0 else "red"
        table.add_row(c.label, f"{c.tokens:,}", f"{c.unknown_tokens:,}", f"{c.utf8_bytes:,}",
                      f"{c.normalized_bytes:,}", f"{c.counted_bytes:,}", Text(f"{c.discrepancy:+,}", style=diff_style),
                      Text(f"{c.discrepancy_percent:+.2f}", style=diff_style), style=style)
    return table


@user_errors_exit_1
def command(
    tokenizer: Annotated[Path, typer.Argument(help="The SentencePiece model.", show_default=False)],
    out: Annotated[Optional[Path], out_option(
        "Where to write the metadata (default: name.model -> name.meta.npz beside the model).",
        "tokenizer byte tables")] = None,
    check: Annotated[Optional[Path], typer.Option(
        "--check", help="Compare an existing .meta.npz with the tokenizer instead of writing one; "
                        "exit 1 on the first difference.", show_default=False)] = None,
    sample: Annotated[Optional[Path], typer.Option(
        "--sample", help="Text (or .jsonl) to check byte accounting on (default: a built-in multilingual text).",
        show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Write (or --check) a tokenizer's byte tables for bits per byte, and test them on a sample.

    Example: windowgpt tokenizer-meta data/tokenizer.model --sample corpus.jsonl
    """
    from ..data.tokenizer import no_byte_fallback_warning
    from ..data.tokenizer_meta import tokenizer_meta

    report = tokenizer_meta(tokenizer, out=out, check=check, sample=sample)
    total = report.total
    if not report.byte_fallback:
        print_warning(f"{no_byte_fallback_warning(report.tokenizer)} (on this sample: {-total.discrepancy:,} of "
                      f"{total.normalized_bytes:,} bytes not counted, {total.discrepancy_percent:+.2f}%)")
    if json_output:
        console.print_json(data=report.to_dict())
        return
    verb = "matches" if report.checked else "written for"
    console.print(f"{report.meta_path} {verb} {report.tokenizer} (vocab {report.vocab_size}, "
                  f"byte fallback {'on' if report.byte_fallback else 'off'})", highlight=False, soft_wrap=True)
    console.print(_byte_table(report))
    if total.utf8_bytes != total.normalized_bytes:
        console.print(f"normalization changed the text: {total.utf8_bytes:,} UTF-8 bytes as given, "
                      f"{total.normalized_bytes:,} as encoded; bits per byte counts the latter.", highlight=False)
