"""The export: a checkpoint's chosen weights as per-layer tensors (`windowgpt export`).

EXPORT/model.safetensors holds the weights under the reference's per-layer names
(blocks.{i}.attn.c_q.weight, ...), EXPORT/config.json the run configuration and
EXPORT/export.json what was exported from where, with the sha256 of the weights, of the
configuration and of the tokenizer, which loading checks (`read_export`). An export of the
EMA weights carries the Hessians training collected for them (EXPORT/hessians.safetensors);
one of other weights does not, since those Hessians belong to the EMA weights. EXPORT is
built beside its destination and renamed into place, so a re-export that fails half way
leaves the previous export whole.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config import RunConfig
from ..errors import ArtifactError, ConfigError
from ..model.state_dict import unbank_state_dict
from ..storage import tensorfile
from ..storage.files import (
    atomic_write_bytes,
    atomic_write_json,
    is_sha256,
    publish_dir,
    read_json,
    read_json_object,
    sha256_file,
)
from ..storage.outputs import check_apart, claim_dir
from .checkpoint import (EXPORT_INFO, HESSIANS_FILENAME, REPORT_FILES, WEIGHT_CHOICES, Checkpoint, checkpoint_path,
                         load_checkpoint)
from .shapes import check_tensors, described

if TYPE_CHECKING:
    from torch import Tensor

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
EXPORT_FORMAT = "windowgpt.export"
EXPORT_VERSION = "1"
# model.safetensors's metadata: "format: pt", as torch's safetensors files say (transformers
# and others read them so), and windowgpt's own key naming the export's version.
WEIGHTS_METADATA = {"format": "pt", EXPORT_FORMAT: EXPORT_VERSION}
TOKENIZER_FILE = "tokenizer.model"  # an export's copy of its tokenizer, as a data directory holds it


def read_export(export_dir: Path) -> tuple[RunConfig, dict[str, Tensor], dict]:
    """An export's config, per-layer tensors and export.json, each checked against the
    hashes export.json records."""
    config, info = _checked_description(export_dir)
    weights_path = export_dir / EXPORT_WEIGHTS
    tensors, metadata = tensorfile.load(weights_path)
    if not _is_export_weights(metadata):
        raise ArtifactError(f"{weights_path}: not a windowgpt export of format version {EXPORT_VERSION}")
    check_tensors(config.model, described(tensors), str(weights_path), per_layer=True)
    return config, tensors, info


def describe_export(export_dir: Path) -> tuple[RunConfig, dict[str, tensorfile.Entry], dict]:
    """read_export's checks and figures without its tensors: the weights' entries (dtype code,
    shape, offsets) from their file's header."""
    config, info = _checked_description(export_dir)
    weights_path = export_dir / EXPORT_WEIGHTS
    entries, metadata = tensorfile.read_file_header(weights_path)
    if not _is_export_weights(metadata):
        raise ArtifactError(f"{weights_path}: not a windowgpt export of format version {EXPORT_VERSION}")
    return config, entries, info


def _checked_description(export_dir: Path) -> tuple[RunConfig, dict]:
    """The export's configuration and export.json, the files checked against its hashes."""
    weights_path, config_path, info_path = (export_dir / EXPORT_WEIGHTS, export_dir / EXPORT_CONFIG,
                                            export_dir / EXPORT_INFO)
    for path in (config_path, info_path):
        if not path.is_file():
            raise ArtifactError(f"{export_dir}: export has no {path.name} (incomplete; export it again)")
    info = read_json_object(info_path)
    if info.get("format") != EXPORT_FORMAT:
        raise ArtifactError(f"{info_path}: not a windowgpt export description")
    for key in ("sha256", "config_sha256", "tokenizer_sha256"):
        if not is_sha256(info.get(key)):
            raise ArtifactError(f"{info_path}: lacks {key} (written by an older windowgpt? export it again)")
    if sha256_file(config_path) != info["config_sha256"]:
        raise ArtifactError(f"{config_path}: differs from the configuration {EXPORT_INFO} records")
    if sha256_file(weights_path) != info["sha256"]:
        raise ArtifactError(f"{weights_path}: differs from the weights {EXPORT_INFO} records (corrupt or altered)")
    try:
        return RunConfig.load(config_path), info
    except ConfigError as exc:
        raise ArtifactError(str(exc)) from None


def checkpoint_to_export(run_dir: Path, out: Path, weights: str, kind: str,
                         is_own: Callable[[Path], bool]) -> Checkpoint:
    """The run's checkpoint, once the weights asked for and the output are checked: `out`
    apart from the run, and new, empty or an export of this kind."""
    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"--weights {weights!r} must be one of {', '.join(WEIGHT_CHOICES)}")
    check_apart(out, [run_dir])
    claim_dir(out, kind, is_own)
    return load_checkpoint(run_dir)


def _is_export_weights(metadata: dict[str, str]) -> bool:
    current = metadata.get("format") == "pt" and metadata.get(EXPORT_FORMAT) == EXPORT_VERSION
    before = metadata.get("format") == EXPORT_FORMAT and metadata.get("format_version") == EXPORT_VERSION  # 0.1
    return current or before


def export(run_dir: Path, out: Path, weights: str = "ema") -> dict[str, Any]:
    """Write the export directory `out`; returns what export.json records."""
    ckpt = checkpoint_to_export(run_dir, out, weights, "an export", is_export_dir)
    tensors = unbank_state_dict(ckpt.weights(weights), ckpt.config.model.num_layers)
    return publish_dir(Path(out), lambda folder: _write_export(folder, run_dir, ckpt, tensors, weights))


def _write_export(out: Path, run_dir: Path, ckpt: Checkpoint, tensors: dict[str, Tensor],
                  weights: str) -> dict[str, Any]:
    tensorfile.save(out / EXPORT_WEIGHTS, tensors, WEIGHTS_METADATA)
    atomic_write_json(out / EXPORT_CONFIG, ckpt.config.to_dict())
    hessians = _carry_hessians(Path(run_dir), out, weights)
    tokenizer = copy_tokenizer(ckpt, out)
    info = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "weights": weights,
        "swa_snapshots": ckpt.swa_count if weights == "swa" else None,
        "source_checkpoint": str(checkpoint_path(run_dir)),
        "source_sha256": sha256_file(checkpoint_path(run_dir)),
        "step": ckpt.step,
        "tokenizer_sha256": ckpt.tokenizer_sha256,
        "tokenizer_path": str(tokenizer) if tokenizer is not None else None,  # where it was copied from
        "tensor_count": len(tensors),
        "parameter_count": sum(t.numel() for t in tensors.values()),
        "sha256": sha256_file(out / EXPORT_WEIGHTS),
        "hessians": hessians,
        "config_sha256": sha256_file(out / EXPORT_CONFIG),
    }
    atomic_write_json(out / EXPORT_INFO, info)  # written last: its presence marks a complete export
    return info


def copy_tokenizer(ckpt: Checkpoint, out: Path) -> Path | None:
    """Copy the run's tokenizer beside the weights, when it is still where the run read it
    (and still the one it trained with); returns where it was."""
    data = ckpt.config.data
    source = Path(data.tokenizer_path) if data.tokenizer_path else Path(data.data_path or ".") / TOKENIZER_FILE
    if not source.is_file() or sha256_file(source) != ckpt.tokenizer_sha256:
        return None
    atomic_write_bytes(out / TOKENIZER_FILE, source.read_bytes())
    return source


def _carry_hessians(run_dir: Path, out: Path, weights: str) -> str | None:
    """Copy the run's Hessians (collected under its EMA weights) into an export of those
    weights; leave none behind in an export of other weights."""

    source, target = checkpoint_path(run_dir).parent / HESSIANS_FILENAME, out / HESSIANS_FILENAME
    if weights != "ema" or not source.is_file():
        target.unlink(missing_ok=True)
        return None
    atomic_write_bytes(target, source.read_bytes())
    return HESSIANS_FILENAME


EXPORT_FILES = {EXPORT_WEIGHTS, EXPORT_CONFIG, EXPORT_INFO, HESSIANS_FILENAME, TOKENIZER_FILE, *REPORT_FILES}


def is_export_dir(path: Path) -> bool:
    """Whether a directory is an export (export may replace it): its export.json, and only
    the export's files and the scores `eval` saved in it."""
    path = Path(path)
    info = read_json(path / EXPORT_INFO) or {}
    return info.get("format") == EXPORT_FORMAT and all(
        p.name in EXPORT_FILES or re.fullmatch(r"eval-[a-z]+\.json", p.name) for p in path.iterdir())
