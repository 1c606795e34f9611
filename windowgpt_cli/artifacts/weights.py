"""The one way evaluation stages get weights: from a run, an export or a `.ptz`.

- a run directory (or its checkpoint.pt): the EMA weights, which the reference applies;
- an export directory (or its model.safetensors): the exported per-layer tensors;
- a `.ptz` file: its dequantized tensors.

None of them is read with pickle's ability to run code.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..config import RunConfig
from ..errors import ArtifactError, DataError
from ..model.gpt import GPT
from ..model.gpt import build_model as build_gpt
from ..model.state_dict import rebank_state_dict
from ..runtime import device_started_meanwhile
from ..storage.files import sha256_file
from . import ptz
from .checkpoint import FILENAME as CHECKPOINT_FILENAME
from .checkpoint import load_checkpoint
from .export import EXPORT_WEIGHTS, read_export


@dataclass
class LoadedWeights:
    config: RunConfig
    state_dict: dict[str, Tensor]  # banked: the live model's names, ready for load_state_dict(strict=True)
    kind: str  # "run" | "export" | "ptz"
    sha256: str  # of checkpoint.pt, model.safetensors or the .ptz
    tokenizer_sha256: str | None
    path: Path  # the file the weights were read from


def load_weights(artifact: Path) -> LoadedWeights:
    artifact = Path(artifact)
    if artifact.is_dir():
        if (artifact / CHECKPOINT_FILENAME).is_file():
            return _load_run(artifact / CHECKPOINT_FILENAME)
        if (artifact / EXPORT_WEIGHTS).is_file():
            return _load_export(artifact)
        raise ArtifactError(f"{artifact}: neither a run directory ({CHECKPOINT_FILENAME}) "
                            f"nor an export directory ({EXPORT_WEIGHTS})")
    if not artifact.exists():
        raise ArtifactError(f"{artifact}: no such file or directory")
    if artifact.name == CHECKPOINT_FILENAME:
        return _load_run(artifact)
    if artifact.name == EXPORT_WEIGHTS:
        return _load_export(artifact.parent)
    return _load_ptz(artifact)


def build_model(artifact: Path, device: torch.device) -> tuple[LoadedWeights, GPT]:
    """Load weights and the model they belong to, on `device`, in eval mode."""
    with device_started_meanwhile(device):
        weights = load_weights(artifact)
    model = build_gpt(weights.config.model, device, initialize=False)
    try:
        model.load_state_dict(weights.state_dict, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "mismatch"
        raise ArtifactError(f"{weights.path}: weights do not fit the model its config describes ({first})") from None
    model.eval()
    return weights, model


def _load_run(path: Path) -> LoadedWeights:
    ckpt = load_checkpoint(path)
    return LoadedWeights(ckpt.config, ckpt.weights("ema"), "run", sha256_file(path), ckpt.tokenizer_sha256, path)


def _load_export(export_dir: Path) -> LoadedWeights:
    config, tensors, info = read_export(export_dir)
    path = export_dir / EXPORT_WEIGHTS
    return LoadedWeights(config, _rebank(tensors, config, path), "export", info["sha256"],
                         info["tokenizer_sha256"], path)


def _load_ptz(path: Path) -> LoadedWeights:
    artifact = ptz.load(path)
    return LoadedWeights(artifact.config, _rebank(artifact.dequantized(), artifact.config, path), "ptz",
                         sha256_file(path), artifact.tokenizer_sha256, path)


def _rebank(tensors: dict[str, Tensor], config: RunConfig, source: Path) -> dict[str, Tensor]:
    try:
        return rebank_state_dict(tensors, config.model.num_layers)
    except (KeyError, RuntimeError) as exc:
        raise ArtifactError(f"{source}: per-layer tensors do not fit {config.model.num_layers} layers "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def check_tokenizer(weights: LoadedWeights, tokenizer_path: Path, artifact: Path) -> None:
    """Refuse a tokenizer file other than the one these weights were trained with (by sha256)."""
    if not tokenizer_path.is_file():
        raise DataError(f"{tokenizer_path}: no such tokenizer file")
    expected = weights.tokenizer_sha256
    actual = sha256_file(tokenizer_path)
    if actual != expected:
        raise DataError(f"{tokenizer_path}: sha256 {actual[:16]}... differs from the tokenizer {artifact} was "
                        f"trained with ({str(expected)[:16]}...)")
