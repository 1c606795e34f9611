"""`windowgpt inspect`: what a run, an export or a `.ptz` holds, without building its model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..challenge import BUDGET_BYTES
from ..config import check_settings
from ..record.codesize import code_bytes
from .info import ArtifactInfo, changed_from_defaults, flat_settings, read_artifact


def inspect_artifact(path: Path, budget: int = BUDGET_BYTES) -> dict[str, Any]:
    """Everything `inspect --json` prints."""
    check_settings(budget=budget)
    info = read_artifact(Path(path))
    record: dict[str, Any] = {
        "artifact": str(info.path), "kind": info.kind, "format_version": info.format_version,
        "sha256": info.sha256, "file_bytes": info.file_bytes, "step": info.step,
        "training_time_ms": info.training_time_ms or (info.summary or {}).get("training_time_ms"),
        "tokenizer_sha256": info.tokenizer_sha256,
        "parameters": info.params,
        "groups": {name: {"tensors": g.tensors, "params": g.params, "bytes": g.bytes,
                          **({"schemes": g.schemes} if g.schemes else {}), **g.quality}
                   for name, g in info.groups.items()},
        "config_changes": {k: {"value": v, "default": d} for k, (v, d) in changed_from_defaults(info.config).items()},
        "settings": flat_settings(info.config),
        "lineage": info.lineage, "run_dir": str(info.run_dir) if info.run_dir else None,
        "training": _training_summary(info), "evals": {mode: _eval_summary(r) for mode, r in info.evals.items()},
    }
    if info.kind == "ptz":
        code = code_bytes()
        total = info.file_bytes + code
        record.update({"compressor": info.compressor, "sections": info.sections, "code_bytes": code,
                       "total_bytes": total, "budget_bytes": budget, "within_budget": total <= budget})
    return record


def _training_summary(info: ArtifactInfo) -> dict[str, Any] | None:
    s = info.summary
    if s is None:
        return None
    keys = ("step", "training_time_ms", "val_loss", "val_bpb", "post_ema_val_loss", "post_ema_val_bpb")
    return {k: s.get(k) for k in keys}


def _eval_summary(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("val_bpb", "val_loss", "seq_len", "stride", "batch_seqs", "tokens", "seconds", "artifact_sha256")
    return {k: record.get(k) for k in keys}


def eval_windows_text(mode: str, summary: dict[str, Any]) -> str:
    """How an evaluation read the tokens: "seq_len 2048, stride 64", or for LoRA TTT, its
    documents per batch."""
    if mode == "ttt_lora":
        return f"seq_len {summary['seq_len']}, {summary.get('batch_seqs')} documents per batch"
    return f"seq_len {summary['seq_len']}, stride {summary['stride']}"
