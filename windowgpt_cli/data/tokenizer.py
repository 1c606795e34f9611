"""SentencePiece tokenizers: training with the Parameter Golf recipe, and the byte
accounting behind bits per byte.

Bits per byte divides the loss by the UTF-8 bytes of the text the tokens stand for. Each
token is worth `base_bytes[t]` bytes, plus one for the space its '▁' prefix stands for,
unless the previous token is a boundary (BOS, unknown, ...), where no space is written.
These three tables are computed here once (`build_byte_tables`), saved as a `.meta.npz`
beside the model, and loaded by every stage through `load_byte_luts`.
"""
from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import sentencepiece as spm
import torch

from ..errors import DataError
from ..storage.files import atomic_write_bytes
from .case_ops import decode_case, encode_case, has_case_markers, marker_bytes
from .tokenizer_options import DEFAULT_TRAIN_SAMPLE_BYTES, TokenizerOptions

META_FORMAT_VERSION = 1
META_SUFFIX = ".meta.npz"
TABLE_KEYS = ("base_bytes", "has_leading_space", "is_boundary_token")
META_KEYS = ("format_version", "tokenizer_kind", "source_model_name", "vocab_size") + TABLE_KEYS
TOKENIZER_KIND = "sentencepiece"
DATA_DIR_TOKENIZER = "tokenizer.model"
BOS_ID = 1  # every document in a shard starts with it
MAX_VOCAB_SIZE = 65536  # token ids are stored as uint16
WORD_PREFIX = "\u2581"  # SentencePiece's '▁', a space before the piece

# The Parameter Golf tokenizer recipe (the vocabulary size is chosen separately).
TRAINER_RECIPE: dict[str, Any] = dict(
    model_type="bpe",
    byte_fallback=True,
    normalization_rule_name="nmt_nfkc",
    split_digits=True,
    add_dummy_prefix=False,
    pad_id=0,
    bos_id=BOS_ID,
    eos_id=2,
    unk_id=3,
    character_coverage=0.9995,
)
_MAX_SENTENCE_BYTES = 1 << 16


# --- Loading ----------------------------------------------------------------------------

def load_sentencepiece(path: Path) -> spm.SentencePieceProcessor:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such tokenizer file")
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError):
        raise DataError(f"{path}: not a readable SentencePiece model") from None


class TextCodec:
    """Text to the tokenizer's ids and back, through the case markers where it has them."""

    def __init__(self, sp: spm.SentencePieceProcessor):
        self.sp = sp
        self.case_markers = has_case_markers(sp)

    def prepare(self, text: str) -> str:
        """The text as the tokenizer takes it. Marked after the tokenizer's normalization (it
        changes nothing more then): a marker between two spaces, or between a space and a
        character normalization drops, would keep a space normalization removes."""
        return encode_case(normalized_text(self.sp, text)) if self.case_markers else text

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(self.prepare(text))

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode([self.prepare(t) for t in texts], num_threads=1)

    def decode(self, ids: list[int]) -> str:
        text = self.sp.decode(ids)
        return decode_case(text) if self.case_markers else text


def load_text_codec(path: Path) -> TextCodec:
    """The tokenizer with its text transform: what encodes a text and decodes ids."""
    return TextCodec(load_sentencepiece(path))


def tokenizer_vocab_size(path: Path) -> int:
    return int(load_sentencepiece(path).vocab_size())


def has_byte_fallback(sp: spm.SentencePieceProcessor) -> bool:
    """Whether characters outside the vocabulary become byte tokens rather than <unk>."""
    return any(sp.is_byte(i) for i in range(sp.vocab_size()))


def no_byte_fallback_warning(tokenizer_path: Path) -> str:
    return (f"{tokenizer_path} has no byte fallback: characters outside its vocabulary become <unk>, "
            "which byte accounting counts as 0 bytes, so bits per byte come out too low")


def check_vocab_fits(vocab_size: int, source: str) -> None:
    if vocab_size > MAX_VOCAB_SIZE:
        raise DataError(f"{source}: vocabulary of {vocab_size} tokens does not fit the uint16 shard format "
                        f"(at most {MAX_VOCAB_SIZE})")


def resolve_tokenizer(data_dir: Path | None, tokenizer: Path | None) -> Path | None:
    """The explicit tokenizer, else DATA_DIR/tokenizer.model (written by prepare) if it exists."""
    if tokenizer is not None:
        return Path(tokenizer)
    if data_dir is not None and (Path(data_dir) / DATA_DIR_TOKENIZER).is_file():
        return Path(data_dir) / DATA_DIR_TOKENIZER
    return None


# --- Training ---------------------------------------------------------------------------

def _training_sentences(texts: Iterable[str], max_bytes: int) -> list[str]:
    """Non-blank lines of the first documents, up to max_bytes of UTF-8.

    Lines are enough: nmt_nfkc turns newlines into spaces and pieces never cross a space.
    """
    sentences, total = [], 0
    for text in texts:
        for line in text.splitlines():
            if not line.strip():
                continue
            size = len(line.encode("utf-8"))
            if total + size > max_bytes:
                return sentences
            sentences.append(line)
            total += size
    return sentences


def train_sentencepiece(texts: Iterable[str], vocab_size: int, *, max_bytes: int = DEFAULT_TRAIN_SAMPLE_BYTES,
                        source: str = "corpus", options: TokenizerOptions = TokenizerOptions()) -> bytes:
    """A serialized BPE model trained with the Parameter Golf recipe on a bounded sample.

    The whole sample is used (no random subsampling), so the pieces are deterministic. It
    trains on one thread: the model file records the thread count, and stages identify a
    tokenizer by its file's sha256, so a thread per core wrote another file on each machine
    (the default 4 MB sample trains in about 2 s). With options.case_markers it trains on the
    texts lowercased with case markers and holds `case_ops.SIGNATURE`.
    """
    check_vocab_fits(vocab_size, source)
    if options.case_markers:
        texts = map(encode_case, texts)
    sentences = _training_sentences(texts, max_bytes)
    if not sentences:
        raise DataError(f"{source}: no text to train a tokenizer on")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
            max_sentence_length=_MAX_SENTENCE_BYTES, num_threads=1, minloglevel=2,
            **options.trainer_settings(), **TRAINER_RECIPE,
        )
    except RuntimeError as exc:
        message = " ".join(str(exc).split())
        reason = re.sub(r"^[A-Z_]+: \S+ \[.*?\] ", "", message) or message or "SentencePiece gave no reason"
        raise DataError(f"{source}: cannot train a {vocab_size}-token tokenizer: {reason}") from None
    return model.getvalue()


# --- Byte tables ------------------------------------------------------------------------

def build_byte_tables(sp: spm.SentencePieceProcessor, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(base_bytes int16, has_leading_space bool, is_boundary_token bool), of size
    max(tokenizer vocabulary, vocab_size); ids beyond the tokenizer are boundaries of 0 bytes.
    A piece's '▁' stands for one space: a leading one only where its predecessor is no boundary
    (has_leading_space), any other always (pieces that span words, end in a space or hold a
    run of them). A tokenizer with case markers counts them as the bytes they stand for
    (`case_ops`)."""
    sp_size = int(sp.vocab_size())
    case_markers = has_case_markers(sp)
    size = max(sp_size, vocab_size)
    base_bytes = np.zeros(size, dtype=np.int16)
    has_leading_space = np.zeros(size, dtype=np.bool_)
    is_boundary_token = np.ones(size, dtype=np.bool_)
    for token in range(sp_size):
        if sp.is_control(token) or sp.is_unknown(token) or sp.is_unused(token):
            continue
        is_boundary_token[token] = False
        if sp.is_byte(token):
            base_bytes[token] = 1
            continue
        piece = sp.id_to_piece(token)
        if piece.startswith(WORD_PREFIX):
            has_leading_space[token] = True
            piece = piece[len(WORD_PREFIX):]
        text = piece.replace(WORD_PREFIX, " ")
        base_bytes[token] = len(text.encode("utf-8")) - (marker_bytes(piece) if case_markers else 0)
    return base_bytes, has_leading_space, is_boundary_token


def pad_byte_tables(tables: tuple[np.ndarray, np.ndarray, np.ndarray], size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Extend the tables to `size` entries with 0-byte boundary tokens (as the reference)."""
    base_bytes, has_leading_space, is_boundary_token = tables
    missing = size - len(base_bytes)
    if missing <= 0:
        return tables
    return (
        np.concatenate([base_bytes, np.zeros(missing, dtype=np.int16)]),
        np.concatenate([has_leading_space, np.zeros(missing, dtype=np.bool_)]),
        np.concatenate([is_boundary_token, np.ones(missing, dtype=np.bool_)]),
    )


@dataclass(frozen=True)
class ByteLuts:
    """The byte tables as tensors, indexed by token id."""

    base_bytes: torch.Tensor  # int16 [table_size]
    has_leading_space: torch.Tensor  # bool [table_size]
    is_boundary_token: torch.Tensor  # bool [table_size]

    @classmethod
    def from_numpy(cls, base_bytes: np.ndarray, has_leading_space: np.ndarray,
                   is_boundary_token: np.ndarray) -> "ByteLuts":
        return cls(torch.as_tensor(base_bytes.astype(np.int16)),
                   torch.as_tensor(has_leading_space.astype(np.bool_)),
                   torch.as_tensor(is_boundary_token.astype(np.bool_)))

    @property
    def table_size(self) -> int:
        return int(self.base_bytes.numel())

    def to(self, device: torch.device | str) -> "ByteLuts":
        return ByteLuts(self.base_bytes.to(device), self.has_leading_space.to(device),
                        self.is_boundary_token.to(device))

    def count_bytes(self, prev_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Bytes of each target token given its predecessor, float64, same shape (the reference's formula)."""
        space = self.has_leading_space[target_ids] & ~self.is_boundary_token[prev_ids]
        return self.base_bytes[target_ids].to(torch.float64) + space.to(torch.float64)


# --- The .meta.npz file -----------------------------------------------------------------

def default_meta_path(tokenizer_path: Path) -> Path:
    """`name.model` -> `name.meta.npz`; any other name gets `.meta.npz` appended."""
    tokenizer_path = Path(tokenizer_path)
    if tokenizer_path.suffix == ".model":
        return tokenizer_path.with_suffix(META_SUFFIX)
    return tokenizer_path.with_name(tokenizer_path.name + META_SUFFIX)


def encode_tokenizer_meta(sp: spm.SentencePieceProcessor, source_model_name: str) -> bytes:
    vocab_size = int(sp.vocab_size())
    base_bytes, has_leading_space, is_boundary_token = build_byte_tables(sp, vocab_size)
    buf = io.BytesIO()
    np.savez(buf, format_version=np.int64(META_FORMAT_VERSION), tokenizer_kind=np.str_(TOKENIZER_KIND),
             source_model_name=np.str_(source_model_name), vocab_size=np.int64(vocab_size),
             base_bytes=base_bytes, has_leading_space=has_leading_space, is_boundary_token=is_boundary_token)
    return buf.getvalue()


def write_tokenizer_meta(tokenizer_path: Path, out: Path | None = None) -> Path:
    """Write the tokenizer's byte tables (default: next to the model); return the path."""
    tokenizer_path = Path(tokenizer_path)
    sp = load_sentencepiece(tokenizer_path)
    return atomic_write_bytes(out or default_meta_path(tokenizer_path),
                              encode_tokenizer_meta(sp, tokenizer_path.name))


def _scalar(value: np.ndarray) -> Any:
    """A 0-d value, or the first element of a 1-d one (both forms exist in the wild)."""
    flat = np.asarray(value).reshape(-1)
    if flat.size == 0:
        raise ValueError("empty value")
    return flat[0].item()


def read_tokenizer_meta(meta_path: Path) -> dict[str, Any]:
    """The file's scalars and tables, checked for shape and version (never unpickles)."""
    meta_path = Path(meta_path)
    if not meta_path.is_file():
        raise DataError(f"{meta_path}: no such tokenizer metadata file")
    try:
        with np.load(meta_path, allow_pickle=False) as data:
            missing = [k for k in META_KEYS if k not in data.files]
            if missing:
                raise DataError(f"{meta_path}: not tokenizer metadata (no {missing[0]!r} entry)")
            version = int(_scalar(data["format_version"]))
            if version != META_FORMAT_VERSION:
                raise DataError(f"{meta_path}: tokenizer metadata format_version {version} is not supported "
                                f"(expected {META_FORMAT_VERSION})")
            meta: dict[str, Any] = {
                "format_version": version,
                "tokenizer_kind": str(_scalar(data["tokenizer_kind"])),
                "source_model_name": str(_scalar(data["source_model_name"])),
                "vocab_size": int(_scalar(data["vocab_size"])),
                "base_bytes": np.asarray(data["base_bytes"]).astype(np.int16),
                "has_leading_space": np.asarray(data["has_leading_space"]).astype(np.bool_),
                "is_boundary_token": np.asarray(data["is_boundary_token"]).astype(np.bool_),
            }
    except DataError:
        raise
    except (ValueError, TypeError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise DataError(f"{meta_path}: not a readable tokenizer metadata file ({exc})") from None
    lengths = {k: meta[k].shape for k in TABLE_KEYS}
    if len(set(lengths.values())) != 1 or meta["base_bytes"].ndim != 1:
        raise DataError(f"{meta_path}: tables have inconsistent shapes {lengths}")
    return meta


def is_tokenizer_meta(path: Path) -> bool:
    """Whether a file is tokenizer byte tables (`tokenizer-meta` may replace those)."""
    try:
        read_tokenizer_meta(path)
    except DataError:
        return False
    return True


def find_meta_mismatch(meta: dict[str, Any], sp: spm.SentencePieceProcessor) -> str | None:
    """The first disagreement between metadata and the tokenizer, as a phrase; None if they agree."""
    if meta["tokenizer_kind"] != TOKENIZER_KIND:
        return f"tokenizer_kind is {meta['tokenizer_kind']!r}, expected {TOKENIZER_KIND!r}"
    sp_size = int(sp.vocab_size())
    if meta["vocab_size"] != sp_size:
        return f"vocab_size is {meta['vocab_size']}, the tokenizer has {sp_size}"
    stored_size = len(meta["base_bytes"])
    if stored_size < sp_size:
        return f"base_bytes has {stored_size} entries, the tokenizer {sp_size} tokens"
    expected = build_byte_tables(sp, stored_size)
    for key, want in zip(TABLE_KEYS, expected):
        differing = np.flatnonzero(meta[key] != want)
        if differing.size:
            token = int(differing[0])
            piece = f" {sp.id_to_piece(token)!r}" if token < sp_size else ""
            return (f"{key} differs at token id {token}{piece}: {meta[key][token].item()} in the file, "
                    f"{want[token].item()} from the tokenizer")
    return None


def check_tokenizer_meta(meta_path: Path, tokenizer_path: Path) -> dict[str, Any]:
    """Read the metadata and refuse it (DataError) unless it matches the tokenizer."""
    meta = read_tokenizer_meta(meta_path)
    mismatch = find_meta_mismatch(meta, load_sentencepiece(tokenizer_path))
    if mismatch:
        raise DataError(f"{meta_path}: the byte tables do not belong to {tokenizer_path} ({mismatch}); rewrite them "
                        f"with `windowgpt tokenizer-meta {tokenizer_path}`")
    return meta


def load_byte_luts(tokenizer_path: Path | None, meta_path: Path | None, vocab_size: int) -> ByteLuts:
    """The byte tables for bits per byte, padded to max(table size, vocab_size).

    From meta_path if given, else the tokenizer's default `.meta.npz` if it exists, else
    computed from the model. Tables read from a file are compared with the tokenizer's own
    and refused where they differ: they decide every score's denominator.
    """
    if meta_path is None and tokenizer_path is not None and default_meta_path(tokenizer_path).is_file():
        meta_path = default_meta_path(tokenizer_path)
    if meta_path is not None:
        meta = (check_tokenizer_meta(meta_path, tokenizer_path) if tokenizer_path is not None
                else read_tokenizer_meta(meta_path))
        tables = (meta["base_bytes"], meta["has_leading_space"], meta["is_boundary_token"])
    elif tokenizer_path is not None:
        tables = build_byte_tables(load_sentencepiece(tokenizer_path), vocab_size)
    else:
        raise DataError("no tokenizer to count bytes with: give the tokenizer model or its .meta.npz")
    return ByteLuts.from_numpy(*pad_byte_tables(tables, vocab_size))


# --- Byte accounting of a text ----------------------------------------------------------

@dataclass(frozen=True)
class ByteCount:
    """How the tables count one text, against its actual UTF-8 size."""

    label: str
    tokens: int
    unknown_tokens: int
    utf8_bytes: int  # the text as given
    normalized_bytes: int  # the text the tokenizer actually encodes (after nmt_nfkc etc.)
    counted_bytes: int  # what bits per byte divides by

    @property
    def discrepancy(self) -> int:
        return self.counted_bytes - self.normalized_bytes

    @property
    def discrepancy_percent(self) -> float:
        return 100.0 * self.discrepancy / self.normalized_bytes if self.normalized_bytes else 0.0

    def __add__(self, other: "ByteCount") -> "ByteCount":
        return ByteCount("total", self.tokens + other.tokens, self.unknown_tokens + other.unknown_tokens,
                         self.utf8_bytes + other.utf8_bytes, self.normalized_bytes + other.normalized_bytes,
                         self.counted_bytes + other.counted_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "tokens": self.tokens, "unknown_tokens": self.unknown_tokens,
                "utf8_bytes": self.utf8_bytes, "normalized_bytes": self.normalized_bytes,
                "counted_bytes": self.counted_bytes, "discrepancy": self.discrepancy,
                "discrepancy_percent": self.discrepancy_percent}


def normalized_text(sp: spm.SentencePieceProcessor, text: str) -> str:
    """The text as the tokenizer sees it, minus a leading space: a document's first token
    follows BOS, a boundary, so a space there is never counted."""
    normalized = sp.normalize(text).replace(WORD_PREFIX, " ")
    return normalized[1:] if normalized.startswith(" ") else normalized


def count_text_bytes(sp: spm.SentencePieceProcessor, luts: ByteLuts, text: str, label: str = "") -> ByteCount:
    """Encode the text as one document (after BOS) and count its bytes with the tables."""
    ids = TextCodec(sp).encode(text)
    stream = torch.tensor([BOS_ID, *ids], dtype=torch.long)
    counted = luts.count_bytes(stream[:-1], stream[1:]).sum().item() if ids else 0.0
    unknown = sum(1 for t in ids if t == sp.unk_id())
    return ByteCount(label, len(ids), unknown, len(text.encode("utf-8")),
                     len(normalized_text(sp, text).encode("utf-8")), int(counted))
