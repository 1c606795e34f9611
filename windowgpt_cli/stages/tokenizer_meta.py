"""`windowgpt tokenizer-meta`: write or check a tokenizer's byte tables (`.meta.npz`), and
show how they count the bytes of a sample text.

With byte fallback, every character is covered, so the counted bytes equal the UTF-8
length of the text the tokenizer encodes (after its normalization). Without it, unknown
characters become <unk> and count 0 bytes: bits per byte then comes out too low.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.table import Table

from ..cli_support import console, err_console, user_errors_exit_1
from ..corpus import JSONL_SUFFIXES, iter_documents
from ..errors import ConfigError, DataError

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    from ..tokenizer import ByteCount

# Each line exercises a different part of the tables: multi-byte UTF-8 of 2, 3 and 4
# bytes, characters a small vocabulary lacks, and forms that NFKC normalization rewrites.
BUILTIN_SAMPLE: tuple[tuple[str, str], ...] = (
    ("English", "The quick brown fox jumps over the lazy dog. It wasn't the first time, and it won't be the last."),
    ("accented Latin", "Ça déjà vu: naïve café owners in Zürich, São Paulo and Kraków; señor Ångström's façade."),
    ("Greek", "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο."),
    ("Cyrillic", "Съешь же ещё этих мягких французских булок, да выпей чаю."),
    ("CJK", "我能吞下玻璃而不伤身体。私はガラスを食べられます。나는 유리를 먹을 수 있어요."),
    ("emoji", "Launch day 🚀🎉 — thumbs up 👍🏽, family 👨‍👩‍👧, flag 🇫🇷."),
    ("code", "def f(x): return {'k': [x[0], x[-1]]}  # @decorator, snake_case_name = x_1 == y_2"),
    ("digits", "Call 555-0142 at 10:45 on 2024-03-17; pi is 3.14159 and 1,234,567 > 99."),
    ("NFKC forms", "ｆｕｌｌｗｉｄｔｈ ﬁne ligatures, ① circled, x² and ½ fractions…"),
)


@dataclass
class TokenizerMetaReport:
    tokenizer: Path
    meta_path: Path
    checked: bool  # True: an existing file was compared; False: the file was written
    vocab_size: int
    byte_fallback: bool
    counts: list[ByteCount]

    @property
    def total(self) -> ByteCount:
        return functools.reduce(operator.add, self.counts)

    def to_dict(self) -> dict[str, Any]:
        return {"tokenizer": str(self.tokenizer), "meta_path": str(self.meta_path),
                "action": "checked" if self.checked else "written", "vocab_size": self.vocab_size,
                "byte_fallback": self.byte_fallback, "samples": [c.to_dict() for c in self.counts],
                "total": self.total.to_dict()}


def _read_sample(path: Path) -> list[tuple[str, str]]:
    """(label, text) pairs: each document of a JSON-lines file, or a whole text file."""
    path = Path(path)
    if path.name.lower().endswith(JSONL_SUFFIXES):
        return [(f"{path.name} #{i}", text) for i, text in enumerate(iter_documents(path), start=1)]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read sample ({exc.strerror})") from None
    try:
        return [(path.name, data.decode("utf-8"))]
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}: line {line}: sample is not valid UTF-8") from None


def tokenizer_meta(tokenizer: Path, out: Path | None = None, check: Path | None = None,
                   sample: Path | None = None) -> TokenizerMetaReport:
    """Write the tokenizer's .meta.npz (or, with `check`, refuse a file that disagrees with
    the tokenizer), then count a sample's bytes with the tables as every stage loads them."""
    from ..tokenizer import (check_tokenizer_meta, count_text_bytes, default_meta_path, has_byte_fallback,
                             load_byte_luts, load_sentencepiece, write_tokenizer_meta)

    tokenizer = Path(tokenizer)
    if check is not None and out is not None:
        raise ConfigError("give either --out (write) or --check (compare), not both")
    sp = load_sentencepiece(tokenizer)
    if check is not None:
        check_tokenizer_meta(check, tokenizer)
        meta_path = Path(check)
    else:
        meta_path = write_tokenizer_meta(tokenizer, out or default_meta_path(tokenizer))
    samples = _read_sample(sample) if sample is not None else list(BUILTIN_SAMPLE)
    if not samples:
        raise DataError(f"{sample}: the sample has no text")
    luts = load_byte_luts(tokenizer, meta_path, int(sp.vocab_size()))
    counts = [count_text_bytes(sp, luts, text, label) for label, text in samples]
    return TokenizerMetaReport(tokenizer, meta_path, check is not None, int(sp.vocab_size()),
                               has_byte_fallback(sp), counts)


def _byte_table(report: TokenizerMetaReport) -> Table:
    table = Table(title="byte accounting: counted bytes vs the UTF-8 text the tokenizer encodes",
                  title_justify="left")
    for name in ("sample", "tokens", "<unk>", "UTF-8 bytes", "normalized", "counted", "difference", "%"):
        table.add_column(name, justify="left" if name == "sample" else "right")
    rows = report.counts + ([report.total] if len(report.counts) > 1 else [])
    for c in rows:
        style = "bold" if c is rows[-1] and len(rows) > 1 else None
        diff_style = "" if c.discrepancy == 0 else "[red]"
        table.add_row(c.label, f"{c.tokens:,}", f"{c.unknown_tokens:,}", f"{c.utf8_bytes:,}",
                      f"{c.normalized_bytes:,}", f"{c.counted_bytes:,}", f"{diff_style}{c.discrepancy:+,}",
                      f"{diff_style}{c.discrepancy_percent:+.2f}", style=style)
    return table


@user_errors_exit_1
def command(
    tokenizer: Annotated[Path, typer.Argument(help="The SentencePiece model.", show_default=False)],
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Where to write the metadata (default: name.model -> name.meta.npz beside the model).",
        show_default=False)] = None,
    check: Annotated[Optional[Path], typer.Option(
        "--check", help="Compare an existing .meta.npz with the tokenizer instead of writing one; "
                        "exit 1 on the first difference.", show_default=False)] = None,
    sample: Annotated[Optional[Path], typer.Option(
        "--sample", help="Text (or .jsonl) to check byte accounting on (default: a built-in multilingual text).",
        show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Write (or --check) a tokenizer's byte tables for bits per byte, and test them on a sample."""
    from ..tokenizer import no_byte_fallback_warning

    report = tokenizer_meta(tokenizer, out=out, check=check, sample=sample)
    total = report.total
    if not report.byte_fallback:
        err_console.print(f"[bold yellow]warning:[/] {no_byte_fallback_warning(report.tokenizer)} "
                          f"(on this sample: {-total.discrepancy:,} of {total.normalized_bytes:,} bytes "
                          f"not counted, {total.discrepancy_percent:+.2f}%)", highlight=False, soft_wrap=True)
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
