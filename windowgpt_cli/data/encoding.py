"""The engine of `prepare`: documents encoded in worker processes, each loading the
tokenizer once, and written as shards in input order as results come back.

The main process only decompresses and cuts lines (`corpus.read_chunks`); a worker parses a
chunk's documents, assigns each to a split by a hash of its text (`validation_score`) and
encodes them; `SplitWriter` streams each split's tokens into shards of a fixed size.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import signal
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from .corpus import RawChunk, parse_chunk

# numpy and sentencepiece are imported where the work runs, so that --help answers at once.
if TYPE_CHECKING:
    import numpy as np


def validation_score(text: str) -> float:
    """The document's place in [0, 1), from a hash of its text alone.

    Documents under --val-fraction form the validation split, so the split does not
    depend on input order, and duplicated documents never straddle the two splits.
    """
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass
class SplitPart:
    """One split's share of an encoded chunk."""

    tokens: np.ndarray
    documents: int
    text_bytes: int
    unknown_tokens: int


@dataclass(frozen=True)
class EncodeTask:
    chunk: RawChunk
    split: str | None  # None: decide per document by validation_score


class ChunkEncoder:
    """Parses a chunk's documents, assigns each to a split and encodes them."""

    def __init__(self, tokenizer_path: Path, val_fraction: float):
        from .tokenizer import load_text_codec

        self.codec = load_text_codec(tokenizer_path)
        self.sp = self.codec.sp
        self.val_fraction = val_fraction

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """BOS + sp.encode(text) for each document, concatenated (as the reference's shards)."""
        import numpy as np

        from .tokenizer import BOS_ID

        ids = self.codec.encode_many(texts)  # one thread: parallelism comes from the processes
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.uint16, count=int(lengths.sum()))
        doc_starts = np.cumsum(lengths) - lengths
        return np.insert(flat, doc_starts, BOS_ID)

    def __call__(self, task: EncodeTask) -> dict[str, SplitPart]:
        import numpy as np

        from .shards import SPLITS

        texts = parse_chunk(task.chunk)
        by_split: dict[str, list[str]] = {split: [] for split in SPLITS}
        for text in texts:
            split = task.split or ("val" if validation_score(text) < self.val_fraction else "train")
            by_split[split].append(text)
        parts = {}
        for split, docs in by_split.items():
            if docs:
                tokens = self.encode_documents(docs)
                parts[split] = SplitPart(tokens, len(docs), sum(len(t.encode("utf-8")) for t in docs),
                                         int(np.count_nonzero(tokens == self.sp.unk_id())))
        return parts


_worker_encoder: ChunkEncoder | None = None


def _start_worker(tokenizer_path: Path, val_fraction: float) -> None:
    # Ctrl-C reaches the whole process group: the parent stops the pool; SIGTERM, from the
    # pool itself, ends a worker at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    global _worker_encoder
    _worker_encoder = ChunkEncoder(tokenizer_path, val_fraction)


def _encode_in_worker(task: EncodeTask) -> dict[str, SplitPart]:
    assert _worker_encoder is not None, "worker started without its tokenizer"
    return _worker_encoder(task)


def encode_all(tasks: Iterable[EncodeTask], tokenizer_path: Path, val_fraction: float,
                workers: int) -> Iterator[tuple[EncodeTask, dict[str, SplitPart]]]:
    """Results in task order, with a bounded number of chunks in flight (memory stays flat)."""
    if workers <= 1:
        encoder = ChunkEncoder(tokenizer_path, val_fraction)
        for task in tasks:
            yield task, encoder(task)
        return
    # fork shares the already imported modules; spawn would re-import torch in every worker.
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer_path, val_fraction)) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append((task, pool.apply_async(_encode_in_worker, (task,))))
            if len(pending) >= 2 * workers + 2:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


@dataclass
class SplitWriter:
    """Streams one split's tokens into shards of exactly shard_tokens (the last may be shorter)."""

    data_dir: Path
    split: str
    shard_tokens: int
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    unknown_tokens: int = 0
    shards: list[dict[str, Any]] = field(default_factory=list)
    _buffer: list[np.ndarray] = field(default_factory=list)
    _buffered: int = 0

    def add(self, part: SplitPart) -> None:
        import numpy as np

        self.documents += part.documents
        self.tokens += part.tokens.size
        self.text_bytes += part.text_bytes
        self.unknown_tokens += part.unknown_tokens
        self._buffer.append(part.tokens)
        self._buffered += part.tokens.size
        while self._buffered >= self.shard_tokens:
            pending = np.concatenate(self._buffer)
            self._write(pending[: self.shard_tokens])
            rest = pending[self.shard_tokens:]
            self._buffer, self._buffered = [rest], rest.size

    def finish(self) -> None:
        import numpy as np

        if self._buffered:
            self._write(np.concatenate(self._buffer))
            self._buffer, self._buffered = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        from ..storage.files import atomic_write_bytes, sha256_bytes
        from .shards import encode_shard, shard_name

        name = shard_name(self.split, len(self.shards))
        data = encode_shard(tokens)
        atomic_write_bytes(self.data_dir / name, data)
        self.shards.append({"file": name, "tokens": int(tokens.size), "bytes": len(data), "sha256": sha256_bytes(data)})

    def summary(self) -> dict[str, Any]:
        return {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes,
                "unknown_tokens": self.unknown_tokens, "shards": self.shards}
