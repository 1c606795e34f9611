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
from ..model.gpt import GPT, check_fits
from ..model.gpt import build_model as build_gpt
from ..model.state_dict import rebank_state_dict
from ..runtime import device_started_meanwhile
from ..storage.files import sha256_file
from . import ptz
from .checkpoint import FILENAME as CHECKPOINT_FILENAME
from .checkpoint import load_checkpoint
from .export import EXPORT_INFO, EXPORT_WEIGHTS, TOKENIZER_FILE, read_export
from .kinds import EXPORT, RUN, locate_artifact
from .results import read_json


@dataclass
class LoadedWeights:
    config: RunConfig
    state_dict: dict[str, Tensor]  # banked: the live model's names, ready for load_state_dict(strict=True)
    kind: str  # "run" | "export" | "ptz"
    sha256: str  # of checkpoint.pt, model.safetensors or the .ptz
    tokenizer_sha256: str | None
    path: Path  # the file the weights were read from


def load_weights(artifact: Path) -> LoadedWeights:
    kind, where = locate_artifact(artifact)
    if kind == RUN:
        return _load_run(where / CHECKPOINT_FILENAME)
    return _load_export(where) if kind == EXPORT else _load_ptz(where)


def build_model(artifact: Path, device: torch.device) -> tuple[LoadedWeights, GPT]:
    """Load weights and the model they belong to, on `device`, in eval mode."""
    with device_started_meanwhile(device):
        weights = load_weights(artifact)
    check_fits(weights.config.model, device, 4, "load")  # its tensors were checked against it on reading
    model = build_gpt(weights.config.model, device, initialize=False)
    model.load_state_dict(weights.state_dict, strict=True)
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
    ptz.check_model_tensors(artifact, str(path))
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


def recorded_tokenizers(weights: LoadedWeights) -> list[Path]:
    """Where the tokenizer these weights were trained with may be, as the artifact records
    it: a run's data, an export's copy and the path it came from, a .ptz's report."""
    data = weights.config.data
    if weights.kind == "run":
        return [Path(data.tokenizer_path) if data.tokenizer_path else Path(data.data_path or ".") / TOKENIZER_FILE]
    if weights.kind == "export":
        info = read_json(weights.path.parent / EXPORT_INFO) or {}
        paths = [weights.path.parent / TOKENIZER_FILE]
        return paths + ([Path(info["tokenizer_path"])] if isinstance(info.get("tokenizer_path"), str) else [])
    report = read_json(weights.path.with_name(weights.path.name + ".json")) or {}
    recorded = report.get("tokenizer") if isinstance(report.get("tokenizer"), dict) else {}
    return [Path(recorded["path"])] if isinstance(recorded.get("path"), str) else []


def located_tokenizer(weights: LoadedWeights) -> Path | None:
    """The first recorded place that still holds the weights' tokenizer (by sha256)."""
    for path in recorded_tokenizers(weights):
        if path.is_file() and sha256_file(path) == weights.tokenizer_sha256:
            return path.absolute()
    return None


def find_tokenizer(weights: LoadedWeights, artifact: Path, data_dir: Path | None = None,
                   tokenizer: Path | None = None) -> Path:
    """The tokenizer the weights were trained with: --tokenizer or DATA/tokenizer.model when
    given (refused if it is another), else the first place the artifact recorded that holds
    it; one line naming its sha256 when none does."""
    given = tokenizer if tokenizer is not None else Path(data_dir) / TOKENIZER_FILE if data_dir is not None else None
    if given is not None:
        check_tokenizer(weights, Path(given), artifact)
        return Path(given)
    found = located_tokenizer(weights)
    if found is not None:
        return found
    places = ", ".join(map(str, recorded_tokenizers(weights))) or "nowhere"
    raise DataError(f"{artifact} was trained with the tokenizer of sha256 {str(weights.tokenizer_sha256)[:16]}..., "
                    f"which is not where the artifact recorded it ({places}); pass --tokenizer MODEL or --data DATA")
