"""The Parameter Golf shard format: 256 little-endian int32 header words (magic 20240520,
version 1, token count), then the tokens as little-endian uint16."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..storage.files import atomic_write_bytes

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
TOKEN_DTYPE = np.dtype("<u2")
SPLITS = ("train", "val")


def shard_name(split: str, index: int) -> str:
    return f"fineweb_{split}_{index:06d}.bin"


def list_shards(data_dir: Path, split: str) -> list[Path]:
    """The shards of one split in order; a clear error when there are none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: no such data directory")
    files = sorted(data_dir.glob(f"fineweb_{split}_*.bin"))
    if not files:
        raise DataError(f"{data_dir}: no {split} shards (fineweb_{split}_*.bin)")
    return files


def read_token_count(path: Path) -> int:
    """Check a shard's header and size; return its token count."""
    path = Path(path)
    try:
        size = path.stat().st_size
        header = np.fromfile(path, dtype="<i4", count=HEADER_WORDS)
    except OSError as exc:
        raise DataError(f"{path}: cannot read shard ({exc.strerror})") from None
    if header.size != HEADER_WORDS:
        raise DataError(f"{path}: shard header is truncated ({size} bytes)")
    if int(header[0]) != MAGIC:
        raise DataError(f"{path}: not a token shard (magic {int(header[0])}, expected {MAGIC})")
    if int(header[1]) != VERSION:
        raise DataError(f"{path}: unsupported shard version {int(header[1])} (expected {VERSION})")
    count = int(header[2])
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if count < 0 or size != expected:
        raise DataError(f"{path}: header says {count} tokens ({expected} bytes) but the file has {size} bytes")
    return count


def open_shard(path: Path) -> np.memmap:
    """A read-only view of a shard's tokens, checked first."""
    count = read_token_count(path)
    if count == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)  # np.memmap refuses empty maps
    return np.memmap(path, mode="r", dtype=TOKEN_DTYPE, offset=HEADER_BYTES, shape=(count,))


def load_tokens(files: list[Path]) -> torch.Tensor:
    """All tokens of the given shards, concatenated, as a uint16 tensor."""
    arrays = [np.asarray(open_shard(f)) for f in files]
    return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, dtype=TOKEN_DTYPE))


def check_vocab(tokens: torch.Tensor | np.ndarray, vocab_size: int, source: str) -> None:
    """Token ids at or above vocab_size would index past the embedding: refuse them."""
    if len(tokens) == 0:
        return
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(f"{source}: token id {top} is outside the model's vocabulary (vocab_size={vocab_size})")


def encode_shard(tokens: np.ndarray) -> bytes:
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 65535):
        raise DataError("token ids must fit in uint16 (0..65535)")
    header = np.zeros(HEADER_WORDS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    return header.tobytes() + tokens.astype(TOKEN_DTYPE).tobytes()


def write_shard(path: Path, tokens: np.ndarray) -> Path:
    return atomic_write_bytes(path, encode_shard(tokens))
