"""`windowgpt prepare`: documents in, token shards out, as the reference's data loader reads them.

DATA_DIR receives `fineweb_{train,val}_NNNNNN.bin` (BOS before each document, no EOS),
`tokenizer.model`, its byte tables `tokenizer.meta.npz`, and `manifest.json` (see
`datadir`). DATA_DIR is built in a temporary sibling and renamed into place when complete,
so an existing DATA_DIR is replaced only by a complete one. Encoding
runs in worker processes, each loading the tokenizer once; the main process only
decompresses and cuts lines, and writes shards in input order as results come back.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterable, Iterator, Optional

import typer
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TransferSpeedColumn)
from rich.table import Table

from .. import __version__
from ..cli_support import console, err_console, user_errors_exit_1
from ..corpus import DEFAULT_CHUNK_BYTES, RawChunk, check_inputs, iter_corpus, parse_chunk, read_chunks
from ..errors import ConfigError, DataError

# numpy, sentencepiece and torch (through the shard and tokenizer modules) are imported
# where the work runs, so that --help answers at once.
if TYPE_CHECKING:
    import numpy as np

DEFAULT_VOCAB_SIZE = 1024
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SHARD_TOKENS = 100_000_000  # as the FineWeb shards


# --- The validation split ---------------------------------------------------------------

def validation_score(text: str) -> float:
    """The document's place in [0, 1), from a hash of its text alone.

    Documents under --val-fraction form the validation split, so the split does not
    depend on input order, and duplicated documents never straddle the two splits.
    """
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


# --- Encoding (runs in worker processes) ------------------------------------------------

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
        from ..tokenizer import load_sentencepiece

        self.sp = load_sentencepiece(tokenizer_path)
        self.val_fraction = val_fraction

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """BOS + sp.encode(text) for each document, concatenated (as the reference's shards)."""
        import numpy as np

        from ..tokenizer import BOS_ID

        ids = self.sp.encode(texts, num_threads=1)  # parallelism comes from the processes
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.uint16, count=int(lengths.sum()))
        doc_starts = np.cumsum(lengths) - lengths
        return np.insert(flat, doc_starts, BOS_ID)

    def __call__(self, task: EncodeTask) -> dict[str, SplitPart]:
        import numpy as np

        from ..shards import SPLITS

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
    global _worker_encoder
    _worker_encoder = ChunkEncoder(tokenizer_path, val_fraction)


def _encode_in_worker(task: EncodeTask) -> dict[str, SplitPart]:
    assert _worker_encoder is not None, "worker started without its tokenizer"
    return _worker_encoder(task)


def _encode_all(tasks: Iterable[EncodeTask], tokenizer_path: Path, val_fraction: float,
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


# --- Writing shards ---------------------------------------------------------------------

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
        from ..artifacts import atomic_write_bytes, sha256_bytes
        from ..shards import encode_shard, shard_name

        name = shard_name(self.split, len(self.shards))
        data = encode_shard(tokens)
        atomic_write_bytes(self.data_dir / name, data)
        self.shards.append({"file": name, "tokens": int(tokens.size), "bytes": len(data), "sha256": sha256_bytes(data)})

    def summary(self) -> dict[str, Any]:
        return {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes,
                "unknown_tokens": self.unknown_tokens, "shards": self.shards}


# --- The stage --------------------------------------------------------------------------

@dataclass
class PrepareResult:
    data_dir: Path
    manifest: dict[str, Any]
    seconds: float

    @property
    def text_bytes(self) -> int:
        return sum(s["text_bytes"] for s in self.manifest["splits"].values())

    @property
    def megabytes_per_second(self) -> float:
        return self.text_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def _check_settings(inputs: list[Path], val_inputs: list[Path] | None, val_fraction: float | None,
                    shard_tokens: int, vocab_size: int | None = None) -> None:
    if not inputs:
        raise ConfigError("give at least one input file")
    if val_inputs is not None and val_fraction is not None:
        raise ConfigError("give either --val files or --val-fraction, not both")
    if val_fraction is not None and not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val-fraction {val_fraction} must be between 0 and 1")
    if val_inputs is not None and not val_inputs:
        raise ConfigError("--val needs at least one file")
    if vocab_size is not None and not 2 <= vocab_size <= 65536:
        raise ConfigError(f"--vocab-size {vocab_size} must be in 2..65536 (tokens are stored as uint16)")
    if shard_tokens <= 0:
        raise ConfigError(f"--shard-tokens {shard_tokens} must be positive")
    both = {p.resolve() for p in inputs} & {p.resolve() for p in val_inputs or []}
    if both:
        raise ConfigError(f"{sorted(both)[0]}: given both as an input and as --val; the splits must not overlap")


def _install_tokenizer(data_dir: Path, tokenizer: Path | None, vocab_size: int | None,
                       train_inputs: list[Path], val_fraction: float | None, sample_bytes: int,
                       threads: int) -> dict[str, Any]:
    """Put the tokenizer (given, or trained on the training split) at DATA_DIR/tokenizer.model."""
    from ..artifacts import atomic_write_bytes, sha256_file
    from ..tokenizer import (DATA_DIR_TOKENIZER, check_vocab_fits, has_byte_fallback, load_sentencepiece,
                             train_sentencepiece, write_tokenizer_meta)

    target = data_dir / DATA_DIR_TOKENIZER
    if tokenizer is not None:
        sp = load_sentencepiece(tokenizer)
        size = int(sp.vocab_size())
        if vocab_size is not None and vocab_size != size:
            raise ConfigError(f"--vocab-size {vocab_size} does not match {tokenizer} ({size} tokens)")
        check_vocab_fits(size, str(tokenizer))
        atomic_write_bytes(target, Path(tokenizer).read_bytes())
    else:
        size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        texts = iter_corpus(train_inputs)
        if val_fraction is not None:  # the tokenizer must not see validation documents
            texts = (t for t in texts if validation_score(t) >= val_fraction)
        names = ", ".join(map(str, train_inputs))
        atomic_write_bytes(target, train_sentencepiece(texts, size, max_bytes=sample_bytes, threads=threads,
                                                       source=names))
    return {"file": DATA_DIR_TOKENIZER, "meta": write_tokenizer_meta(target).name,
            "source": str(tokenizer) if tokenizer is not None else None,
            "trained": tokenizer is None, "sha256": sha256_file(target), "vocab_size": size,
            "byte_fallback": has_byte_fallback(load_sentencepiece(target))}


def _tasks(train_inputs: list[Path], val_inputs: list[Path] | None) -> Iterator[EncodeTask]:
    for path in train_inputs:
        for chunk in read_chunks(path, DEFAULT_CHUNK_BYTES):
            yield EncodeTask(chunk, None if val_inputs is None else "train")
    for path in val_inputs or []:
        for chunk in read_chunks(path, DEFAULT_CHUNK_BYTES):
            yield EncodeTask(chunk, "val")


def _describe_inputs(train_inputs: list[Path], val_inputs: list[Path] | None) -> list[dict[str, Any]]:
    from ..artifacts import sha256_file

    role = "train" if val_inputs is not None else "train+val"
    return [{"path": str(p), "split": split, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for split, paths in ((role, train_inputs), ("val", val_inputs or [])) for p in paths]


def prepare(inputs: list[Path], out: Path, *, tokenizer: Path | None = None, vocab_size: int | None = None,
            val_fraction: float | None = None, val_inputs: list[Path] | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int | None = None,
            tokenizer_sample_bytes: int | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> PrepareResult:
    """Tokenize the inputs into DATA_DIR (see the module docstring); returns the manifest.

    Without --val files, a document is validation when validation_score(text) < val_fraction
    (default 0.01). Documents keep their input order within each split. The tokenizer is
    trained on the first tokenizer_sample_bytes of text (default: DEFAULT_TRAIN_SAMPLE_BYTES).
    """
    from ..artifacts import publish_dir
    from ..tokenizer import DEFAULT_TRAIN_SAMPLE_BYTES

    if tokenizer_sample_bytes is None:
        tokenizer_sample_bytes = DEFAULT_TRAIN_SAMPLE_BYTES
    started = time.perf_counter()
    inputs = [Path(p) for p in inputs]
    val_inputs = [Path(p) for p in val_inputs] if val_inputs is not None else None
    _check_settings(inputs, val_inputs, val_fraction, shard_tokens, vocab_size)
    if val_inputs is None and val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION
    check_inputs(inputs + (val_inputs or []))
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers {workers} must be at least 1")
    workers = workers or os.cpu_count() or 1

    def build(data_dir: Path) -> dict[str, Any]:
        return _prepare_into(data_dir, inputs, val_inputs, tokenizer, vocab_size, val_fraction, shard_tokens,
                             workers, tokenizer_sample_bytes, on_progress)

    manifest = publish_dir(Path(out), build)
    return PrepareResult(Path(out), manifest, time.perf_counter() - started)


def _prepare_into(data_dir: Path, inputs: list[Path], val_inputs: list[Path] | None, tokenizer: Path | None,
                  vocab_size: int | None, val_fraction: float | None, shard_tokens: int, workers: int,
                  tokenizer_sample_bytes: int, on_progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    """Write everything into data_dir (a fresh directory); returns the manifest, written last."""
    from ..artifacts import atomic_write_json
    from ..datadir import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION
    from ..shards import SPLITS
    from ..tokenizer import BOS_ID, DATA_DIR_TOKENIZER

    tokenizer_info = _install_tokenizer(data_dir, tokenizer, vocab_size, inputs, val_fraction,
                                        tokenizer_sample_bytes, workers)
    writers = {split: SplitWriter(data_dir, split, shard_tokens) for split in SPLITS}
    total_bytes = sum(p.stat().st_size for p in inputs + (val_inputs or []))
    read_so_far: dict[str, int] = {}
    for task, parts in _encode_all(_tasks(inputs, val_inputs), data_dir / DATA_DIR_TOKENIZER,
                                   val_fraction or 0.0, workers):
        for split, part in parts.items():
            writers[split].add(part)
        read_so_far[task.chunk.source] = task.chunk.raw_position
        if on_progress is not None:
            on_progress(sum(read_so_far.values()), total_bytes)
    for writer in writers.values():
        writer.finish()

    names = ", ".join(map(str, inputs))
    if writers["train"].documents == 0:
        raise DataError(f"{names}: no training documents")
    if writers["val"].documents == 0:
        where = ", ".join(map(str, val_inputs)) if val_inputs else names
        hint = "" if val_inputs else f" fall under --val-fraction {val_fraction}; raise it or give --val files"
        raise DataError(f"{where}: no validation documents{hint}")

    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created_by": f"windowgpt {__version__}",
        "tokenizer": tokenizer_info,
        "splits": {split: writer.summary() for split, writer in writers.items()},
        "inputs": _describe_inputs(inputs, val_inputs),
        "settings": {
            "val_fraction": val_fraction, "val_from_files": val_inputs is not None,
            "val_rule": None if val_inputs is not None else "sha256(utf-8 text)[:8] / 2**64 < val_fraction",
            "shard_tokens": shard_tokens, "bos_id": BOS_ID, "eos": False,
            "vocab_size": tokenizer_info["vocab_size"],
            "tokenizer_sample_bytes": tokenizer_sample_bytes if tokenizer is None else None,
        },
    }
    atomic_write_json(data_dir / MANIFEST_NAME, manifest)
    return manifest


def index_data(data_dir: Path, tokenizer: Path | None = None) -> dict[str, Any]:
    """Give shards made elsewhere a manifest: the tokenizer (copied in as tokenizer.model
    when given) and every shard with its size and hash. The manifest is written last."""
    from ..artifacts import atomic_write_bytes, atomic_write_json, sha256_file
    from ..datadir import MANIFEST_NAME, index_manifest
    from ..shards import SPLITS, open_shard
    from ..tokenizer import DATA_DIR_TOKENIZER, check_vocab_fits, load_sentencepiece, write_tokenizer_meta

    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: no such data directory")
    target = data_dir / DATA_DIR_TOKENIZER
    if tokenizer is not None:
        sp = load_sentencepiece(tokenizer)
        check_vocab_fits(int(sp.vocab_size()), str(tokenizer))
        if not target.is_file() or sha256_file(target) != sha256_file(tokenizer):
            atomic_write_bytes(target, Path(tokenizer).read_bytes())
    elif not target.is_file():
        raise ConfigError(f"{data_dir}: no {DATA_DIR_TOKENIZER}; pass --tokenizer MODEL (the one the shards were "
                          "encoded with)")
    vocab_size = int(load_sentencepiece(target).vocab_size())
    (data_dir / MANIFEST_NAME).unlink(missing_ok=True)
    meta = write_tokenizer_meta(target)
    manifest = index_manifest(data_dir, DATA_DIR_TOKENIZER, {"indexed": True})
    manifest["tokenizer"].update({"meta": meta.name, "vocab_size": vocab_size,
                                  "source": str(tokenizer) if tokenizer is not None else None})
    for split in SPLITS:
        top = max((int(open_shard(data_dir / s["file"]).max()) for s in manifest["splits"][split]["shards"]
                   if s["tokens"]), default=0)
        if top >= vocab_size:
            raise DataError(f"{data_dir}: the {split} shards hold token id {top}, outside the tokenizer's "
                            f"vocabulary of {vocab_size}: they were encoded with another tokenizer")
    atomic_write_json(data_dir / MANIFEST_NAME, manifest)
    return manifest


# --- The command ------------------------------------------------------------------------

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
        help="Documents: .jsonl (field text), .jsonl.xz, .jsonl.gz, or .txt (one document per file).",
        show_default=False)] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="DATA_DIR to write shards, tokenizer and manifest to.",
                                                show_default=False)] = None,
    index: Annotated[Optional[Path], typer.Option(
        "--index", help="Instead: write the manifest of a DATA_DIR of shards made elsewhere (with --tokenizer, "
        "the model they were encoded with).", show_default=False)] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(
        "--tokenizer", help="A SentencePiece model to use; without it one is trained on the training split.",
        show_default=False)] = None,
    vocab_size: Annotated[Optional[int], typer.Option(
        "--vocab-size", help=f"Vocabulary of the tokenizer to train (default: {DEFAULT_VOCAB_SIZE}).",
        show_default=False)] = None,
    val_fraction: Annotated[Optional[float], typer.Option(
        "--val-fraction", help=f"Share of documents (chosen by a hash of their text) for validation "
                               f"(default: {DEFAULT_VAL_FRACTION}).", show_default=False)] = None,
    val: Annotated[Optional[list[Path]], typer.Option(
        "--val", help="Files forming the validation split instead (repeat for several).",
        show_default=False)] = None,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="Tokens per shard file.")]
        = DEFAULT_SHARD_TOKENS,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", help="Encoding processes (default: all cores).", show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Tokenize documents into train/val shards, with the tokenizer and a manifest (replaces DATA_DIR's shards)."""
    from ..datadir import MANIFEST_NAME
    from ..shards import SPLITS
    from ..tokenizer import has_byte_fallback, load_sentencepiece, no_byte_fallback_warning

    if index is not None:
        if inputs or out is not None:
            raise ConfigError("--index DATA_DIR takes no input files and no --out")
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
        err_console.print(f"[bold yellow]warning:[/] {no_byte_fallback_warning(tokenizer)}",
                          highlight=False, soft_wrap=True)
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
                         on_progress=show_progress)
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
                  f"byte fallback {'on' if info['byte_fallback'] else 'off'}); "
                  f"{result.text_bytes / 1e6:.1f} MB of text in {result.seconds:.1f} s "
                  f"({result.megabytes_per_second:.1f} MB/s)", highlight=False, soft_wrap=True)
