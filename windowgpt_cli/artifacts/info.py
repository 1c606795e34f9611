"""What a run, an export or a `.ptz` holds, read without building a model: the shared
ground of `inspect`, `compare` and `plot`."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import GROUP_TYPES, RunConfig
from ..errors import ArtifactError
from ..model.state_dict import GROUPS, tensor_group, unbank_state_dict
from ..storage.files import sha256_file
from ..storage.tensorfile import ITEM_SIZES
from . import ptz
from .quantized import CONTROL, code_bits
from .checkpoint import FILENAME as CHECKPOINT_FILENAME
from .checkpoint import describe_checkpoint
from .export import EXPORT_INFO, EXPORT_VERSION, EXPORT_WEIGHTS, describe_export
from .kinds import EXPORT, RUN, locate_artifact
from .lineage import DATA_PATH_FIELDS
from .results import find_eval_results, read_json

# --- Reading an artifact -----------------------------------------------------------------

@dataclass
class GroupSize:
    tensors: int = 0
    params: int = 0
    bytes: int = 0  # as stored in this artifact (codes and scales for a .ptz)
    schemes: dict[str, int] = field(default_factory=dict)  # .ptz: tensors per quantization scheme
    quality: dict[str, Any] = field(default_factory=dict)  # .ptz: code widths, LQER count, round-trip error


@dataclass
class ArtifactInfo:
    path: Path
    kind: str  # run | export | ptz
    format_version: int | str
    config: RunConfig
    sha256: str  # of checkpoint.pt, model.safetensors or the .ptz
    file_bytes: int
    groups: dict[str, GroupSize]
    step: int | None = None
    training_time_ms: float | None = None
    tokenizer_sha256: str | None = None
    lineage: dict[str, Any] = field(default_factory=dict)
    compressor: str | None = None  # .ptz only
    report: dict[str, Any] | None = None  # the .ptz.json quantize wrote
    run_dir: Path | None = None  # the training run, when it can be found
    summary: dict[str, Any] | None = None  # the run's summary.json
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)
    sections: list[dict[str, Any]] = field(default_factory=list)  # .ptz coded per group: its sections

    @property
    def name(self) -> str:
        """How tables and legends call it: the run directory's name, or the file's."""
        return self.path.name if self.kind != "ptz" else self.path.stem

    @property
    def params(self) -> int:
        return sum(g.params for g in self.groups.values())


def read_artifact(path: Path) -> ArtifactInfo:
    path = Path(path)
    kind, where = locate_artifact(path)
    info = _read_run(where) if kind == RUN else _read_export(where) if kind == EXPORT else _read_ptz(where)
    info.evals = find_eval_results(path)
    if info.run_dir is not None:
        info.summary = read_json(info.run_dir / "summary.json")
    return info


# Read without torch: what a file's headers say, the tensors themselves never decoded (each
# stage that loads weights checks them against the model's shapes).

def _read_run(run_dir: Path) -> ArtifactInfo:
    ckpt = describe_checkpoint(run_dir)
    weights = unbank_state_dict(ckpt.model, ckpt.config.model.num_layers)  # the EMA weights take these dtypes
    groups = _group_sizes({name: (t.numel(), t.numel() * t.element_size(), None) for name, t in weights.items()})
    checkpoint = run_dir / CHECKPOINT_FILENAME
    return ArtifactInfo(run_dir, "run", ckpt.version, ckpt.config, sha256_file(checkpoint),
                        checkpoint.stat().st_size, groups, ckpt.step, ckpt.training_time_ms, ckpt.tokenizer_sha256,
                        run_dir=run_dir)


def _read_export(export_dir: Path) -> ArtifactInfo:
    config, entries, info = describe_export(export_dir)
    weights_path = export_dir / EXPORT_WEIGHTS
    groups = _group_sizes({name: (_numel(shape), _numel(shape) * ITEM_SIZES[code], None)
                           for name, (code, shape, _) in entries.items()})
    lineage = {"run_sha256": info.get("source_sha256"), "weights": info.get("weights"),
               "run": info.get("source_checkpoint")}
    return ArtifactInfo(export_dir, "export", EXPORT_VERSION, config, sha256_file(weights_path),
                        weights_path.stat().st_size, groups, info.get("step"), None, info.get("tokenizer_sha256"),
                        lineage={k: v for k, v in lineage.items() if v is not None},
                        run_dir=_existing_run_dir(info.get("source_checkpoint")))


def _read_ptz(path: Path) -> ArtifactInfo:
    artifact = ptz.describe(path)  # its header and its payload's: the payload is not decoded
    version, compressor = artifact.version, artifact.compressor
    groups = _group_sizes({name: (_numel(t.shape), t.stored_bytes, t.scheme + (f"_{t.method}" if t.method else ""))
                           for name, t in artifact.tensors.items()})
    for name, row in quality_rows({n: (_numel(t.shape), t.scheme, t.lqer_rank > 0, t.error)
                                   for n, t in artifact.tensors.items()}, artifact.clip_range).items():
        groups[name].quality = row
    report = read_json(path.with_name(path.name + ".json"))
    lineage = dict(artifact.source)
    run_dir = None
    if report is not None and isinstance(report.get("source"), dict):  # the paths quantize saw
        lineage.update({k: v for k, v in report["source"].items() if k not in lineage})
        run_dir = _run_dir_of(report["source"])
    return ArtifactInfo(path, "ptz", version, artifact.config, sha256_file(path), path.stat().st_size, groups,
                        lineage.get("step"), None, artifact.tokenizer_sha256, lineage, compressor, report, run_dir,
                        sections=ptz.sections_of(path.read_bytes()))


def quality_rows(tensors: dict[str, tuple[int, str, bool, float | None]],
                 clip_range: int) -> dict[str, dict[str, Any]]:
    """Per tensor group, from each tensor's (parameters, scheme, corrected by LQER, relative
    squared error): the code widths (int6 codes by the clip range's levels), the LQER
    corrections, and the round trip's relative squared error averaged over the group's
    parameters (where the errors are recorded)."""
    rows: dict[str, dict[str, Any]] = {}
    weighted: dict[str, list[float]] = {}
    for name, (numel, scheme, corrected, error) in tensors.items():
        group = tensor_group(name)
        row = rows.setdefault(group, {"bits": [], "lqer": 0})
        bits = code_bits(scheme, clip_range) or (32 if scheme == CONTROL else 16)
        row["bits"] = sorted(set(row["bits"]) | {bits})
        row["lqer"] += corrected
        if error is not None:
            total = weighted.setdefault(group, [0.0, 0.0])
            total[0] += error * numel
            total[1] += numel
    for group, (err, numel) in weighted.items():
        rows[group]["rel_error"] = float(f"{err / numel:.4g}") if numel else 0.0
    return rows


def _group_sizes(tensors: dict[str, tuple[int, int, str | None]]) -> dict[str, GroupSize]:
    groups = {g: GroupSize() for g in GROUPS}
    for name, (numel, nbytes, scheme) in tensors.items():
        g = groups[tensor_group(name)]
        g.tensors, g.params, g.bytes = g.tensors + 1, g.params + numel, g.bytes + nbytes
        if scheme is not None:
            g.schemes[scheme] = g.schemes.get(scheme, 0) + 1
    return {name: g for name, g in groups.items() if g.tensors}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _run_dir_of(source: dict[str, Any]) -> Path | None:
    """The run behind a quantized run or export, found through the paths quantize recorded."""
    path = source.get("path")
    if not isinstance(path, str):
        return None
    origin = Path(path).parent
    if source.get("kind") == "run":
        return origin if (origin / CHECKPOINT_FILENAME).is_file() else None
    info = read_json(origin / EXPORT_INFO) or {}
    return _existing_run_dir(info.get("source_checkpoint"))


def _existing_run_dir(checkpoint: Any) -> Path | None:
    if not isinstance(checkpoint, str):
        return None
    run_dir = Path(checkpoint).parent
    return run_dir if (run_dir / CHECKPOINT_FILENAME).is_file() else None


# --- Configurations side by side ---------------------------------------------------------

def flat_settings(cfg: RunConfig) -> dict[str, Any]:
    """group.field -> value, locations left out (they differ between any two machines)."""
    flat = {}
    for group, values in cfg.to_dict().items():
        for name, value in values.items():
            if name not in DATA_PATH_FIELDS:
                flat[f"{group}.{name}"] = value
    return flat


def differing_settings(configs: list[RunConfig]) -> dict[str, list[Any]]:
    """Settings whose values are not all equal, with each configuration's value."""
    flats = [flat_settings(c) for c in configs]
    keys = [k for k in flats[0] if any(f.get(k) != flats[0].get(k) for f in flats[1:])] if flats else []
    return {k: [f.get(k) for f in flats] for k in keys}


def changed_from_defaults(cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """group.field -> (value, the reference's default) where they differ."""
    defaults = flat_settings(RunConfig())
    return {k: (v, defaults[k]) for k, v in flat_settings(cfg).items() if v != defaults.get(k)}


def short_setting(key: str) -> str:
    """`train.matrix_lr` -> `matrix_lr` (field names are unique across groups)."""
    return key.split(".", 1)[1] if "." in key and key.split(".", 1)[0] in GROUP_TYPES else key


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records (unreadable lines skipped: a run may be writing it)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        raise ArtifactError(f"{path}: no metrics here (train writes RUN/metrics.jsonl)") from None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records

