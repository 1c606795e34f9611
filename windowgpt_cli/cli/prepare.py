"""`windowgpt prepare`: documents in, token shards out (`data.prepare`), with a summary table."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn
from rich.table import Table

from ..data.prepare import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    PrepareResult,
    index_data,
    prepare,
)
from ..data.tokenizer_options import DEFAULT_TRAIN_SAMPLE_BYTES, TokenizerOptions
from ..errors import ConfigError
from .support import console, err_console, out_option, print_warning, user_errors_exit_1


def _summary_table(result: PrepareResult) -> Table:
    table = Table(title=f"prepared {result.data_dir}", title_justify="left")
    for name in ("split", "documents", "tokens", "shards", "text MB", "bytes/token", "<unk> tokens"):
        table.add_column(name, justify="left" if name == "split" else "right")
    for split, s in result.manifest["splits"].items():
        table.add_row(split, f"{s['documents']:,}", f"{s['tokens']:,}", str(len(s["shards"])),
                      f"{s['text_bytes'] / 1e6:.2f}", f"{s['text_bytes'] / max(s['tokens'], 1):.3f}",
                      f"{s['unknown_tokens']:,}")
    return table


@user_errors_exit_1
def command(
    inputs: Annotated[Optional[list[Path]], typer.Argument(
        metavar="FILE",
        help="Documents: .jsonl (field text), .jsonl.xz, .jsonl.gz, or .txt (one document per file).",
        show_default=False)] = None,
    out: Annotated[Optional[Path], out_option("DATA_DIR to write shards, tokenizer and manifest to.",
                                              "a data directory prepare wrote (or an empty one)")] = None,
    index: Annotated[Optional[Path], typer.Option(
        "--index", help="Instead: write the manifest of a DATA_DIR of shards made elsewhere (with --tokenizer, "
        "the model they were encoded with).", show_default=False)] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(
        "--tokenizer", help="A SentencePiece model to use; without it one is trained on the training split.",
        show_default=False)] = None,
    vocab_size: Annotated[Optional[int], typer.Option(
        "--vocab-size", help=f"Vocabulary of the tokenizer to train (default: {DEFAULT_VOCAB_SIZE}).",
        show_default=False)] = None,
    case_markers: Annotated[bool, typer.Option(
        "--case-markers", help="Train the tokenizer on text lowercased with markers for its capitals (as the "
        "records' CaseOps): a piece serves a word in every case; bits per byte still count the original text."
        )] = False,
    tokenizer_sample_bytes: Annotated[Optional[int], typer.Option(
        "--tokenizer-sample-bytes", help=f"Text the tokenizer to train learns from, in UTF-8 bytes from the "
        f"first training documents (default: {DEFAULT_TRAIN_SAMPLE_BYTES:,}).", show_default=False)] = None,
    split_scripts: Annotated[bool, typer.Option(
        "--split-scripts/--no-split-scripts", help="Whether the tokenizer to train keeps every piece within one "
        "Unicode script (SentencePiece's split_by_unicode_script); without, letters join the punctuation and "
        "symbols beside them.")] = True,
    split_words: Annotated[bool, typer.Option(
        "--split-words/--no-split-words", help="Whether the tokenizer to train keeps every piece within one word "
        "(SentencePiece's split_by_whitespace); without, frequent runs of words become pieces ('▁of▁the'), "
        "each space inside one counted as a byte.")] = True,
    val_fraction: Annotated[Optional[float], typer.Option(
        "--val-fraction", help=f"Share of documents (chosen by a hash of their text) for validation "
                               f"(default: {DEFAULT_VAL_FRACTION}).", show_default=False)] = None,
    val: Annotated[Optional[list[Path]], typer.Option(
        "--val", metavar="FILE", help="Files forming the validation split instead (repeat for several).",
        show_default=False)] = None,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="Tokens per shard file.")]
        = DEFAULT_SHARD_TOKENS,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", help="Encoding processes (default: all cores).", show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Tokenize documents into train/val shards, with the tokenizer and a manifest (replaces DATA_DIR's shards).

    Example: windowgpt prepare corpus.jsonl --out data --vocab-size 1024
    """
    from ..data.manifest import MANIFEST_NAME
    from ..data.shards import SPLITS
    from ..data.tokenizer import has_byte_fallback, load_sentencepiece, no_byte_fallback_warning

    tokenizer_options = TokenizerOptions(case_markers, split_scripts, split_words)
    if index is not None:
        if inputs or out is not None or tokenizer_options != TokenizerOptions() or tokenizer_sample_bytes is not None:
            raise ConfigError("--index DATA_DIR takes no input files, no --out and no tokenizer options (the "
                              "tokenizer given or in DATA_DIR is the one the shards were encoded with)")
        manifest = index_data(index, tokenizer)
        if json_output:
            console.print_json(data=manifest)
        else:
            counts = ", ".join(f"{len(manifest['splits'][s]['shards'])} {s} shards" for s in SPLITS)
            console.print(f"wrote {index / MANIFEST_NAME} ({counts})", highlight=False, soft_wrap=True)
        return
    if not inputs or out is None:
        raise ConfigError("give input files and --out DATA_DIR (or --index DATA_DIR)")
    if tokenizer is not None and not has_byte_fallback(load_sentencepiece(tokenizer)):
        print_warning(no_byte_fallback_warning(tokenizer))
    columns = (TextColumn("encoding"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    progress = Progress(*columns, console=err_console, disable=json_output or not err_console.is_terminal)
    bar = progress.add_task("encode", total=None)

    def show_progress(done: int, total: int) -> None:
        # Started on the first result, once the worker processes exist: forking while the
        # display's refresh thread runs could leave its locks held in the workers.
        if not progress.live.is_started:
            progress.start()
        progress.update(bar, completed=done, total=total)

    try:
        result = prepare(inputs, out, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction,
                         val_inputs=val or None, shard_tokens=shard_tokens, workers=workers,
                         tokenizer_sample_bytes=tokenizer_sample_bytes,
                         tokenizer_options=tokenizer_options, on_progress=show_progress)
    finally:
        if progress.live.is_started:
            progress.stop()
    if json_output:
        console.print_json(data={**result.manifest, "seconds": result.seconds})
        return
    console.print(_summary_table(result))
    info = result.manifest["tokenizer"]
    origin = "trained" if info["trained"] else f"from {info['source']}"
    console.print(f"tokenizer: {result.data_dir / info['file']} ({origin}, vocab {info['vocab_size']}, "
                  f"byte fallback {'on' if info['byte_fallback'] else 'off'}"
                  f"{', case markers' if info.get('case_markers') else ''}); "
                  f"{result.text_bytes / 1e6:.1f} MB of text in {result.seconds:.1f} s "
                  f"({result.megabytes_per_second:.1f} MB/s)", highlight=False, soft_wrap=True)
