"""A data directory's manifest: the one check every stage that reads shards makes first.

`prepare` writes DATA/manifest.json last, listing each shard with its size and sha256 and
the tokenizer's sha256. A stage refuses a directory without one, or whose files differ
from it; sizes are always checked, contents are hashed where a stage reads them whole.
Shards made elsewhere (e.g. the reference's FineWeb download) get a manifest from
`windowgpt prepare --index DATA --tokenizer MODEL`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..errors import DataError, WindowGPTError
from ..storage.files import is_sha256, read_json_object, sha256_file
from .shards import SPLITS, list_shards, read_token_count

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "windowgpt.data"
MANIFEST_VERSION = 2  # 2: every shard with bytes and sha256
# Everything `prepare` writes into a data directory, and nothing else: a directory of only
# these, with windowgpt's manifest, is one that prepare may replace.
PREPARED_FILES = re.compile(r"fineweb_(train|val)_\d{6}\.bin|tokenizer\.model|tokenizer\.meta\.npz|manifest\.json")
HOW_TO_MAKE = ("make one with `windowgpt prepare TEXT... --out DATA`, or for existing shards "
               "`windowgpt prepare --index DATA --tokenizer MODEL`")


@dataclass
class DataManifest:
    data_dir: Path
    raw: dict[str, Any]

    @property
    def tokenizer(self) -> Path:
        return self.data_dir / self.raw["tokenizer"]["file"]

    @property
    def tokenizer_sha256(self) -> str:
        return self.raw["tokenizer"]["sha256"]

    @property
    def byte_tables(self) -> Path | None:
        """The tokenizer's byte tables, where the manifest lists them."""
        meta = self.raw["tokenizer"].get("meta")
        return self.data_dir / meta if isinstance(meta, str) else None

    def shards(self, split: str) -> list[Path]:
        return [self.data_dir / s["file"] for s in self.raw["splits"][split]["shards"]]


def describe_shard(path: Path) -> dict[str, Any]:
    """What the manifest records of one shard (its header checked first)."""
    return {"file": path.name, "tokens": read_token_count(path), "bytes": path.stat().st_size,
            "sha256": sha256_file(path)}


def is_data_dir(path: Path) -> bool:
    """Whether a directory is one `prepare` wrote: its manifest, and only its files."""
    try:
        raw = read_json_object(Path(path) / MANIFEST_NAME)
    except WindowGPTError:
        return False
    return raw.get("format") == MANIFEST_FORMAT and all(PREPARED_FILES.fullmatch(p.name) for p in Path(path).iterdir())


def read_manifest(data_dir: Path) -> DataManifest:
    """The manifest, its structure checked (not yet the files it lists)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: no such data directory")
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{data_dir}: no {MANIFEST_NAME}, so it may be incomplete; {HOW_TO_MAKE}")
    raw = read_json_object(path, DataError, HOW_TO_MAKE)
    if raw.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path}: not a windowgpt data manifest")
    if raw.get("version") != MANIFEST_VERSION:
        raise DataError(f"{path}: manifest version {raw.get('version')!r} is not supported (expected "
                        f"{MANIFEST_VERSION}); {HOW_TO_MAKE}")
    tok, splits = raw.get("tokenizer"), raw.get("splits")
    if not isinstance(tok, dict) or not isinstance(tok.get("file"), str) or not is_sha256(tok.get("sha256")):
        raise DataError(f"{path}: the tokenizer entry lacks its file or sha256")
    if not isinstance(splits, dict) or set(SPLITS) - set(splits):
        raise DataError(f"{path}: the manifest lacks the train or val split")
    for split in SPLITS:
        shards = splits[split].get("shards") if isinstance(splits[split], dict) else None
        if not isinstance(shards, list) or not shards or not all(_valid_entry(s) for s in shards):
            raise DataError(f"{path}: the {split} split lists no shards, or a shard without file, bytes and sha256")
    return DataManifest(data_dir, raw)


def _valid_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("file"), str) and "/" not in entry["file"]
            and isinstance(entry.get("bytes"), int) and is_sha256(entry.get("sha256")))


def verify_data(data_dir: Path, hash_splits: Iterable[str] = ()) -> DataManifest:
    """Check DATA against its manifest: the tokenizer's hash, every listed shard's size, and
    the hashes of the shards of `hash_splits` (those the stage reads whole)."""
    manifest = read_manifest(data_dir)
    if not manifest.tokenizer.is_file():
        raise DataError(f"{manifest.tokenizer}: missing, but {MANIFEST_NAME} lists it")
    if sha256_file(manifest.tokenizer) != manifest.tokenizer_sha256:
        raise DataError(f"{manifest.tokenizer}: differs from the tokenizer {MANIFEST_NAME} records (replaced "
                        "after the shards were encoded?)")
    check_byte_tables(manifest)
    hashed = set(hash_splits)
    for split in SPLITS:
        for entry in manifest.raw["splits"][split]["shards"]:
            path = manifest.data_dir / entry["file"]
            if not path.is_file():
                raise DataError(f"{path}: missing, but {MANIFEST_NAME} lists it")
            if path.stat().st_size != entry["bytes"]:
                raise DataError(f"{path}: {path.stat().st_size} bytes, but {MANIFEST_NAME} records {entry['bytes']}")
            if split in hashed and sha256_file(path) != entry["sha256"]:
                raise DataError(f"{path}: contents differ from the sha256 {MANIFEST_NAME} records")
    return manifest


def check_byte_tables(manifest: DataManifest) -> None:
    """The byte tables the manifest binds to its tokenizer must be the ones it recorded."""
    tables, recorded = manifest.byte_tables, manifest.raw["tokenizer"].get("meta_sha256")
    if tables is None or recorded is None:  # a manifest of an older windowgpt: the tables are checked when read
        return
    if not tables.is_file():
        raise DataError(f"{tables}: missing, but {MANIFEST_NAME} lists it")
    if sha256_file(tables) != recorded:
        raise DataError(f"{tables}: differs from the byte tables {MANIFEST_NAME} records for {manifest.tokenizer} "
                        "(replaced or altered); rewrite them with `windowgpt tokenizer-meta` and index the data "
                        "again, or prepare it again")


def check_same_tokenizer(manifest: DataManifest, expected_sha256: str | None, what: str) -> None:
    """Refuse data encoded with another tokenizer than the one `what` was trained with."""
    if manifest.tokenizer_sha256 != expected_sha256:
        raise DataError(f"{manifest.data_dir}: its shards were encoded with another tokenizer (sha256 "
                        f"{manifest.tokenizer_sha256[:16]}...) than {what} ({str(expected_sha256)[:16]}...)")


def index_manifest(data_dir: Path, tokenizer_file: str, extra: dict[str, Any] | None = None,
                   tokenizer_sha256: str | None = None) -> dict[str, Any]:
    """A manifest for the shards already in data_dir and the tokenizer (by default the one
    there; tokenizer_sha256 gives one about to be copied in)."""
    from .. import __version__

    data_dir = Path(data_dir)
    tokenizer_sha256 = tokenizer_sha256 or sha256_file(data_dir / tokenizer_file)
    splits = {}
    for split in SPLITS:
        shards = [describe_shard(p) for p in list_shards(data_dir, split)]
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "shards": shards}
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "created_by": f"windowgpt {__version__}",
            "tokenizer": {"file": tokenizer_file, "sha256": tokenizer_sha256}, "splits": splits, **(extra or {})}
