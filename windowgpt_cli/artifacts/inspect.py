"""`windowgpt inspect`: what a run, an export, a `.ptz` or the packed code holds, without
building its model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..challenge import BUDGET_BYTES
from ..config import check_settings
from ..errors import ArtifactError
from ..record.codesize import CodeCount, archive_count, count_code, is_packed_code
from .info import ArtifactInfo, changed_from_defaults, flat_settings, read_artifact

PACKED_CODE = "packed code"


def inspect_artifact(path: Path, budget: int = BUDGET_BYTES, code: Path | None = None) -> dict[str, Any]:
    """Everything `inspect --json` prints. A .ptz's budget counts `code` (packed code) if
    given, else the code its quantize report counted, else this windowgpt's record code."""
    check_settings(budget=budget)
    path = Path(path)
    packed = path.is_file() and is_packed_code(path)
    info = None if packed else read_artifact(path)
    kind = PACKED_CODE if info is None else info.kind
    if code is not None and kind != "ptz":
        raise ArtifactError(f"--code is the code a .ptz's budget counts; {path} is a {kind}, not a .ptz")
    if info is None:
        return _packed_code_record(path)
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
        counted = _counted_code(info, code)
        total = info.file_bytes + counted["code_bytes"]
        record.update({"compressor": info.compressor, "sections": info.sections, **counted,
                       "total_bytes": total, "budget_bytes": budget, "within_budget": total <= budget})
    return record


def _counted_code(info: ArtifactInfo, code: Path | None) -> dict[str, Any]:
    """The code a .ptz's budget counts: code_bytes, code_counted (what, in words), code_from."""
    report = info.report or {}
    if code is not None:
        count, origin = _packed_count(Path(code)), str(code)
    elif report.get("sha256") == info.sha256 and isinstance(report.get("code_bytes"), int):
        return {"code_bytes": report["code_bytes"], "code_counted": report.get("code_counted"),
                "code_from": f"{info.path.name}.json, its quantize report"}
    else:
        count, origin = count_code(), "this windowgpt's record code"
    return {"code_bytes": count.bytes, "code_counted": count.form, "code_from": origin}


def _packed_count(path: Path) -> CodeCount:
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    if not is_packed_code(path):
        raise ArtifactError(f"{path}: not packed code (`windowgpt pack` writes it)")
    return archive_count(path)


def _packed_code_record(path: Path) -> dict[str, Any]:
    """What `inspect` says of an archive `pack` wrote (is_packed_code has said so)."""
    count = archive_count(path)
    return {"artifact": str(path), "kind": PACKED_CODE, "sha256": count.sha256, "file_bytes": count.bytes,
            "form": count.form, "files": count.files, "source_bytes": count.source_bytes}


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
