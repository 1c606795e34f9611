"""Training checkpoints: everything needed to resume, and the weights later stages use;
and the names of the other files of a run directory.

A checkpoint is read with `torch.load(weights_only=True)`, which refuses to run code, and
records a hash of its weights (live, EMA and SWA) that loading checks, with the sha256 of
the tokenizer the run trained with.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import RunConfig
from ..errors import ArtifactError, ConfigError
from ..storage.files import atomic_torch_save, atomic_write_bytes, is_sha256, read_json, tensors_sha256
from ..storage.runlock import LOCK_NAME
from ..storage.torchfile import TensorInfo, describe_torch_file
from .ptz import is_ptz
from .shapes import check_tensors, described

if TYPE_CHECKING:  # the run directory's names and layout need no torch; its checkpoint does
    import torch

FORMAT = "windowgpt.checkpoint"
VERSION = 3  # 2: weights_sha256, and tokenizer_sha256 required; 3: state_sha256
READABLE_VERSIONS = (2, 3)
# A run directory's files: train writes them, later stages find them by these names.
FILENAME = "checkpoint.pt"
RUN_CONFIG = "config.json"
TRAIN_LOG = "train.log"
METRICS = "metrics.jsonl"
HESSIANS_FILENAME = "hessians.safetensors"  # GPTQ's Hessians, collected inside training
SUMMARY = "summary.json"  # written when a run finishes
REPORT_FILES = ("report.md", "report.json", "report.png")  # what `report` writes beside a run's files
RUN_FILES = (RUN_CONFIG, TRAIN_LOG, METRICS, FILENAME, HESSIANS_FILENAME, SUMMARY, *REPORT_FILES)
EXPORT_INFO = "export.json"  # what marks an export's directory (artifacts.export), which has a config.json too
WEIGHT_CHOICES = ("ema", "swa", "last")


@dataclass
class Checkpoint:
    config: RunConfig
    model: dict[str, torch.Tensor]  # the live weights after the last step
    ema: dict[str, torch.Tensor]  # float32 exponential moving average
    swa: dict[str, torch.Tensor] | None  # running sum of SWA snapshots
    swa_count: int
    step: int
    training_time_ms: float
    tokenizer_sha256: str
    state: dict[str, Any]  # optimizer, loader and RNG state for resuming

    def weights_sha256(self) -> str:
        named = {f"model.{k}": v for k, v in self.model.items()}
        named.update({f"ema.{k}": v for k, v in self.ema.items()})
        named.update({f"swa.{k}": v for k, v in (self.swa or {}).items()})
        return tensors_sha256(named)

    def weights(self, which: str = "ema") -> dict[str, torch.Tensor]:
        """The chosen weights, cast to the live model's dtypes."""
        if which == "last":
            return dict(self.model)
        if which == "ema":
            source = self.ema
        elif which == "swa":
            if not self.swa or self.swa_count < 1:
                raise ArtifactError("this run collected no SWA snapshots (SWA starts once the learning rate "
                                    "falls below 0.2 of its peak); export --weights ema or last instead")
            source = {k: v.float() / self.swa_count for k, v in self.swa.items()}
        else:
            raise ArtifactError(f"unknown weights {which!r}; choose from {', '.join(WEIGHT_CHOICES)}")
        return {k: source[k].to(self.model[k].dtype) for k in self.model}


KEPT_PATTERN = "checkpoint-*.pt"  # the periodic checkpoints a run keeps (train --keep-checkpoints)


def kept_checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"checkpoint-{step:07d}.pt"


def keep_checkpoint(run_dir: Path, step: int, keep: int) -> Path:
    """A copy of the run's checkpoint.pt (a hard link where the file system has them: the
    next checkpoint replaces checkpoint.pt by a rename, never in place; else a copy written
    atomically) as checkpoint-STEP.pt, the oldest beyond `keep` removed."""
    import os

    source, target = checkpoint_path(run_dir), kept_checkpoint_path(run_dir, step)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        atomic_write_bytes(target, source.read_bytes())
    for old in sorted(Path(run_dir).glob(KEPT_PATTERN))[:-keep]:
        old.unlink(missing_ok=True)
    return target


def checkpoint_path(run_dir_or_file: Path) -> Path:
    path = Path(run_dir_or_file)
    return path / FILENAME if path.is_dir() else path


def save_checkpoint(path: Path, ckpt: Checkpoint) -> Path:
    payload = {
        "format": FORMAT, "version": VERSION, "config": ckpt.config.to_dict(),
        "model": ckpt.model, "ema": ckpt.ema, "swa": ckpt.swa, "swa_count": ckpt.swa_count,
        "step": ckpt.step, "training_time_ms": ckpt.training_time_ms,
        "tokenizer_sha256": ckpt.tokenizer_sha256, "weights_sha256": ckpt.weights_sha256(), "state": ckpt.state,
        "state_sha256": state_sha256(ckpt.state),
    }
    return atomic_torch_save(payload, path)


def load_checkpoint(run_dir_or_file: Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    import torch

    path = _existing(run_dir_or_file)
    try:
        raw = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, pickle refused by weights_only, ...
        if is_ptz(path):
            raise ArtifactError(f"{path}: a quantized artifact (.ptz), not a training run's checkpoint: give the run's "
                                "directory") from None
        raise ArtifactError(f"{path}: not a readable windowgpt checkpoint ({type(exc).__name__})") from None
    _check_format(raw, path)
    try:
        config = RunConfig.from_dict(raw["config"], source=f"{path} config")
        ckpt = Checkpoint(
            config=config, model=_tensors(raw["model"]), ema=_tensors(raw["ema"]),
            swa=None if raw["swa"] is None else _tensors(raw["swa"]), swa_count=int(raw["swa_count"]),
            step=int(raw["step"]), training_time_ms=float(raw["training_time_ms"]),
            tokenizer_sha256=raw["tokenizer_sha256"], state=raw["state"],
        )
    except ConfigError as exc:
        raise ArtifactError(str(exc)) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{path}: malformed checkpoint ({type(exc).__name__}: {exc})") from None
    if not is_sha256(ckpt.tokenizer_sha256):
        raise ArtifactError(f"{path}: the checkpoint records no tokenizer sha256")
    if raw.get("weights_sha256") != ckpt.weights_sha256():
        raise ArtifactError(f"{path}: its weights do not match the hash it records (corrupt or altered)")
    if "state_sha256" in raw and raw["state_sha256"] != state_sha256(ckpt.state):  # version 2 records none
        raise ArtifactError(f"{path}: its optimizer, loader and random state do not match the hash it records "
                            "(corrupt or altered); it cannot be resumed exactly")
    for name, weights in (("model", ckpt.model), ("ema", ckpt.ema), ("swa", ckpt.swa or ckpt.model)):
        check_tensors(config.model, described(weights), f"{path} ({name} weights)", per_layer=False)
    return ckpt


@dataclass
class CheckpointDescription:
    """What a checkpoint holds, read without torch (`storage.torchfile`): its tensors as
    shapes and dtypes; its hashes are not checked (loading does)."""

    version: int
    config: RunConfig
    model: dict[str, TensorInfo]
    step: int
    training_time_ms: float
    tokenizer_sha256: str | None


def describe_checkpoint(run_dir_or_file: Path) -> CheckpointDescription:
    path = _existing(run_dir_or_file)
    raw = describe_torch_file(path)
    _check_format(raw, path)
    try:
        model = raw["model"]
        if not isinstance(model, dict) or not all(isinstance(t, TensorInfo) for t in model.values()):
            raise TypeError("expected a dict of tensors")
        return CheckpointDescription(raw["version"], RunConfig.from_dict(raw["config"], source=f"{path} config"),
                                     model, int(raw["step"]), float(raw["training_time_ms"]),
                                     raw.get("tokenizer_sha256"))
    except ConfigError as exc:
        raise ArtifactError(str(exc)) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{path}: malformed checkpoint ({type(exc).__name__}: {exc})") from None


def _existing(run_dir_or_file: Path) -> Path:
    path = checkpoint_path(run_dir_or_file)
    if not path.is_file():
        raise ArtifactError(f"{path}: no checkpoint here (train writes RUN_DIR/{FILENAME})")
    return path


def _check_format(raw: Any, path: Path) -> None:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a windowgpt checkpoint")
    if raw.get("version") not in READABLE_VERSIONS:
        raise ArtifactError(f"{path}: checkpoint version {raw.get('version')} is not supported (this windowgpt "
                            f"reads {', '.join(map(str, READABLE_VERSIONS))})")


def _tensors(value: Any) -> dict[str, torch.Tensor]:
    import torch

    if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
        raise TypeError("expected a dict of tensors")
    return value


def is_run_dir(path: Path) -> bool:
    """Whether a directory is a training run (train may go on in it, or with --force start
    afresh there): it holds a checkpoint, the run lock, or a windowgpt configuration that
    is not an export's (an export holds the configuration too, beside its export.json)."""
    path = Path(path)
    if (path / FILENAME).is_file() or (path / LOCK_NAME).is_file():
        return True
    return not (path / EXPORT_INFO).exists() and {"model", "train"} <= set(read_json(path / RUN_CONFIG) or {})


def state_sha256(state: Any) -> str:
    """A fingerprint of the resume state (optimizer, loader, random state): its nested
    dicts, lists, numbers, strings and tensors, in order."""
    import torch

    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(b"T" + tensors_sha256({"": value}).encode())
        elif isinstance(value, dict):
            digest.update(f"D{len(value)}".encode())
            for key in sorted(value, key=repr):
                digest.update(repr(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            digest.update(("V" + repr(value)).encode())

    feed(state)
    return digest.hexdigest()
