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
from typing import Any

from ..errors import ConfigError, DataError
from ..storage.outputs import check_apart, claim_file
from .corpus import JSONL_SUFFIXES, iter_documents
from .tokenizer import (
    ByteCount,
    check_tokenizer_meta,
    count_text_bytes,
    default_meta_path,
    has_byte_fallback,
    is_tokenizer_meta,
    load_byte_luts,
    load_sentencepiece,
    write_tokenizer_meta,
)

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
    tokenizer = Path(tokenizer)
    if check is not None and out is not None:
        raise ConfigError("give either --out (write) or --check (compare), not both")
    sp = load_sentencepiece(tokenizer)
    samples = _read_sample(sample) if sample is not None else list(BUILTIN_SAMPLE)
    if not samples:
        raise DataError(f"{sample}: the sample has no text")
    if check is not None:
        check_tokenizer_meta(check, tokenizer)
        meta_path = Path(check)
    else:
        meta_path = Path(out) if out is not None else default_meta_path(tokenizer)
        check_apart(meta_path, [tokenizer, sample])
        claim_file(meta_path, "tokenizer byte tables", is_tokenizer_meta)
        write_tokenizer_meta(tokenizer, meta_path)
    luts = load_byte_luts(tokenizer, meta_path, int(sp.vocab_size()))
    counts = [count_text_bytes(sp, luts, text, label) for label, text in samples]
    return TokenizerMetaReport(tokenizer, meta_path, check is not None, int(sp.vocab_size()),
                               has_byte_fallback(sp), counts)
