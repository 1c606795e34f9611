"""`windowgpt prepare`: documents in, token shards out, as the reference's data loader reads them.

DATA_DIR receives `fineweb_{train,val}_NNNNNN.bin` (BOS before each document, no EOS),
`tokenizer.model`, its byte tables `tokenizer.meta.npz`, and `manifest.json` (see
`manifest`). DATA_DIR is built in a temporary sibling and renamed into place when complete,
so an existing DATA_DIR is replaced only by a complete one. The encoding runs in worker
processes (`encoding`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import __version__
from ..config import check_settings
from ..errors import ConfigError, DataError, WindowGPTError
from .corpus import DEFAULT_CHUNK_BYTES, check_inputs, iter_corpus, read_chunks
from .encoding import EncodeTask, SplitWriter, encode_all, validation_score
from .tokenizer_options import DEFAULT_TRAIN_SAMPLE_BYTES, TokenizerOptions

DEFAULT_VOCAB_SIZE = 1024
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SHARD_TOKENS = 100_000_000  # as the FineWeb shards


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
    if val_inputs is not None and not val_inputs:
        raise ConfigError("--val needs at least one file")
    check_settings(val_fraction=val_fraction, vocab_size=vocab_size, shard_tokens=shard_tokens)
    both = {p.resolve() for p in inputs} & {p.resolve() for p in val_inputs or []}
    if both:
        raise ConfigError(f"{sorted(both)[0]}: given both as an input and as --val; the splits must not overlap")


def _check_tokenizer_options(tokenizer: Path | None, options: TokenizerOptions, sample_bytes: int | None) -> None:
    """Options for training a tokenizer apply only where one is trained (or, for case markers,
    where the given one has them)."""
    if tokenizer is None:
        return
    from .case_ops import has_case_markers
    from .tokenizer import load_sentencepiece

    if sample_bytes is not None:
        raise ConfigError(f"--tokenizer-sample-bytes trains a tokenizer; leave it out with --tokenizer {tokenizer}")
    for flag, kept in (("--no-split-scripts", options.split_scripts), ("--no-split-words", options.split_words)):
        if not kept:
            raise ConfigError(f"{flag} trains a tokenizer; leave it out with --tokenizer {tokenizer}")
    if options.case_markers and not has_case_markers(load_sentencepiece(tokenizer)):
        raise ConfigError(f"--case-markers: {tokenizer} has no case markers; give a tokenizer prepare trained "
                          "with --case-markers, or leave --tokenizer out to train one")


def _install_tokenizer(data_dir: Path, tokenizer: Path | None, vocab_size: int | None,
                       train_inputs: list[Path], val_fraction: float | None, sample_bytes: int,
                       options: TokenizerOptions) -> dict[str, Any]:
    """Put the tokenizer (given, or trained on the training split) at DATA_DIR/tokenizer.model."""
    from ..storage.files import atomic_write_bytes, sha256_file
    from .case_ops import has_case_markers
    from .tokenizer import (
        DATA_DIR_TOKENIZER,
        check_vocab_fits,
        has_byte_fallback,
        load_sentencepiece,
        train_sentencepiece,
        write_tokenizer_meta,
    )

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
        atomic_write_bytes(target, train_sentencepiece(texts, size, max_bytes=sample_bytes, source=names,
                                                       options=options))
    meta = write_tokenizer_meta(target)
    installed = load_sentencepiece(target)
    return {"file": DATA_DIR_TOKENIZER, "meta": meta.name, "meta_sha256": sha256_file(meta),
            "source": str(tokenizer) if tokenizer is not None else None,
            "trained": tokenizer is None, "sha256": sha256_file(target), "vocab_size": size,
            "byte_fallback": has_byte_fallback(installed), "case_markers": has_case_markers(installed),
            "split_scripts": options.split_scripts if tokenizer is None else None,
            "split_words": options.split_words if tokenizer is None else None}


def _tasks(train_inputs: list[Path], val_inputs: list[Path] | None) -> Iterator[EncodeTask]:
    for path in train_inputs:
        for chunk in read_chunks(path, DEFAULT_CHUNK_BYTES):
            yield EncodeTask(chunk, None if val_inputs is None else "train")
    for path in val_inputs or []:
        for chunk in read_chunks(path, DEFAULT_CHUNK_BYTES):
            yield EncodeTask(chunk, "val")


def _describe_inputs(train_inputs: list[Path], val_inputs: list[Path] | None) -> list[dict[str, Any]]:
    from ..storage.files import sha256_file

    role = "train" if val_inputs is not None else "train+val"
    return [{"path": str(p), "split": split, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for split, paths in ((role, train_inputs), ("val", val_inputs or [])) for p in paths]


def prepare(inputs: list[Path], out: Path, *, tokenizer: Path | None = None, vocab_size: int | None = None,
            val_fraction: float | None = None, val_inputs: list[Path] | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int | None = None,
            tokenizer_sample_bytes: int | None = None, tokenizer_options: TokenizerOptions = TokenizerOptions(),
            on_progress: Callable[[int, int], None] | None = None) -> PrepareResult:
    """Tokenize the inputs into DATA_DIR (see the module docstring); returns the manifest.

    Without --val files, a document is validation when validation_score(text) < val_fraction
    (default 0.01). Documents keep their input order within each split. The tokenizer is
    trained on the first tokenizer_sample_bytes of text (default: DEFAULT_TRAIN_SAMPLE_BYTES),
    as tokenizer_options say. A tokenizer with case markers (`case_ops`), trained or given,
    encodes the documents so marked.
    """
    from ..storage.files import publish_dir
    from ..storage.outputs import check_apart, claim_dir
    from .manifest import is_data_dir

    check_apart(out, [*inputs, *(val_inputs or []), tokenizer])
    claim_dir(out, "a data directory", is_data_dir)
    _check_tokenizer_options(tokenizer, tokenizer_options, tokenizer_sample_bytes)
    if tokenizer_sample_bytes is None:
        tokenizer_sample_bytes = DEFAULT_TRAIN_SAMPLE_BYTES
    started = time.perf_counter()
    inputs = [Path(p) for p in inputs]
    val_inputs = [Path(p) for p in val_inputs] if val_inputs is not None else None
    _check_settings(inputs, val_inputs, val_fraction, shard_tokens, vocab_size)
    if val_inputs is None and val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION
    check_inputs(inputs + (val_inputs or []))
    check_settings(workers=workers, tokenizer_sample_bytes=tokenizer_sample_bytes)
    workers = workers or os.cpu_count() or 1

    def build(data_dir: Path) -> dict[str, Any]:
        return _prepare_into(data_dir, inputs, val_inputs, tokenizer, vocab_size, val_fraction, shard_tokens,
                             workers, tokenizer_sample_bytes, tokenizer_options, on_progress)

    manifest = publish_dir(Path(out), build)
    return PrepareResult(Path(out), manifest, time.perf_counter() - started)


def _prepare_into(data_dir: Path, inputs: list[Path], val_inputs: list[Path] | None, tokenizer: Path | None,
                  vocab_size: int | None, val_fraction: float | None, shard_tokens: int, workers: int,
                  tokenizer_sample_bytes: int, tokenizer_options: TokenizerOptions,
                  on_progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    """Write everything into data_dir (a fresh directory); returns the manifest, written last."""
    from ..storage.files import atomic_write_json
    from .manifest import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION
    from .shards import SPLITS
    from .tokenizer import BOS_ID, DATA_DIR_TOKENIZER

    tokenizer_info = _install_tokenizer(data_dir, tokenizer, vocab_size, inputs, val_fraction,
                                        tokenizer_sample_bytes, tokenizer_options)
    writers = {split: SplitWriter(data_dir, split, shard_tokens) for split in SPLITS}
    total_bytes = sum(p.stat().st_size for p in inputs + (val_inputs or []))
    read_so_far: dict[str, int] = {}
    for task, parts in encode_all(_tasks(inputs, val_inputs), data_dir / DATA_DIR_TOKENIZER,
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
    when given), its byte tables, and every shard with its size and hash. Everything is
    checked before anything is written; the manifest is written last."""
    from ..storage.files import atomic_write_bytes, atomic_write_json, read_json_object, sha256_bytes, sha256_file
    from ..storage.outputs import claim_file
    from .case_ops import has_case_markers
    from .manifest import MANIFEST_FORMAT, MANIFEST_NAME, index_manifest
    from .shards import SPLITS, open_shard
    from .tokenizer import (
        DATA_DIR_TOKENIZER,
        META_SUFFIX,
        check_vocab_fits,
        encode_tokenizer_meta,
        is_tokenizer_meta,
        load_sentencepiece,
    )

    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: no such data directory")
    target, meta_path = data_dir / DATA_DIR_TOKENIZER, data_dir / ("tokenizer" + META_SUFFIX)
    source = Path(tokenizer) if tokenizer is not None else target
    if tokenizer is None and not target.is_file():
        raise ConfigError(f"{data_dir}: no {DATA_DIR_TOKENIZER}; pass --tokenizer MODEL (the one the shards were "
                          "encoded with)")
    if tokenizer is not None and target.exists() and (not target.is_file() or sha256_file(target) !=
                                                      sha256_file(tokenizer)):
        raise ConfigError(f"{target}: holds another tokenizer than --tokenizer {tokenizer}; nothing was changed: "
                          f"move it away if the shards were encoded with {tokenizer}")
    sp = load_sentencepiece(source)
    vocab_size = int(sp.vocab_size())
    check_vocab_fits(vocab_size, str(source))

    def is_manifest(path: Path) -> bool:
        try:
            return read_json_object(path).get("format") == MANIFEST_FORMAT
        except WindowGPTError:
            return False

    claim_file(data_dir / MANIFEST_NAME, "a data manifest", is_manifest, flag="--index")
    claim_file(meta_path, "tokenizer byte tables", is_tokenizer_meta, flag="--index")
    manifest = index_manifest(data_dir, DATA_DIR_TOKENIZER, {"indexed": True}, tokenizer_sha256=sha256_file(source))
    for split in SPLITS:
        top = max((int(open_shard(data_dir / s["file"]).max()) for s in manifest["splits"][split]["shards"]
                   if s["tokens"]), default=0)
        if top >= vocab_size:
            raise DataError(f"{data_dir}: the {split} shards hold token id {top}, outside the tokenizer's "
                            f"vocabulary of {vocab_size}: they were encoded with another tokenizer")
    tables = encode_tokenizer_meta(sp, DATA_DIR_TOKENIZER)
    given = str(tokenizer) if tokenizer is not None else None
    manifest["tokenizer"].update({"meta": meta_path.name, "meta_sha256": sha256_bytes(tables),
                                  "vocab_size": vocab_size, "source": given, "case_markers": has_case_markers(sp)})
    if tokenizer is not None and not target.exists():
        atomic_write_bytes(target, source.read_bytes())
    atomic_write_bytes(meta_path, tables)
    atomic_write_json(data_dir / MANIFEST_NAME, manifest)
    return manifest
