"""`windowgpt compare`: runs and artifacts side by side, one column each: their scores,
speed and size, and the settings in which they differ."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .results import EVAL_MODES
from .info import ArtifactInfo, differing_settings, read_artifact


def column(info: ArtifactInfo) -> dict[str, Any]:
    """One column's figures; None where the artifact has none (no eval result saved, ...)."""
    summary = info.summary or {}
    steps = summary.get("step", info.step)
    time_ms = summary.get("training_time_ms", info.training_time_ms)
    timed = bool(steps) and bool(time_ms)
    return {
        "name": info.name, "artifact": str(info.path), "kind": info.kind,
        "val_bpb": summary.get("val_bpb"), "post_ema_val_bpb": summary.get("post_ema_val_bpb"),
        **{f"{mode}_bpb": info.evals.get(mode, {}).get("val_bpb") for mode in EVAL_MODES},
        "steps": steps,
        "ms_per_step": time_ms / steps if timed else None,
        "tokens_per_s": info.config.train.train_batch_tokens * steps / (time_ms / 1000) if timed else None,
        "ptz_bytes": info.file_bytes if info.kind == "ptz" else None,
    }


def compare(paths: list[Path]) -> dict[str, Any]:
    """Everything `compare --json` prints: the columns and the differing settings."""
    if not paths:
        raise ConfigError("give at least one run or artifact to compare")
    infos = [read_artifact(Path(p)) for p in paths]
    columns = [column(info) for info in infos]
    names = [c["name"] for c in columns]
    if len(set(names)) < len(names):  # same-named runs in different folders: say which is which
        for c in columns:
            c["name"] = c["artifact"]
    return {"columns": columns, "settings": differing_settings([info.config for info in infos])}
