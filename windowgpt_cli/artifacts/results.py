"""Evaluation results, saved by `eval` and `eval-ttt` as JSON beside the artifact they
scored, where `inspect` and `compare` find them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..storage.files import atomic_write_json, read_json
from ..storage.outputs import claim_file
from .checkpoint import FILENAME as CHECKPOINT_FILENAME
from .export import EXPORT_WEIGHTS

EVAL_MODES = ("standard", "sliding", "ttt", "ttt_lora")


def eval_result_path(artifact: Path, mode: str) -> Path:
    """RUN/eval-MODE.json or EXPORT/eval-MODE.json for a directory (or the file in it),
    MODEL.ptz.eval-MODE.json for a .ptz."""
    artifact = Path(artifact)
    if artifact.is_dir():
        return artifact / f"eval-{mode}.json"
    if artifact.name in (CHECKPOINT_FILENAME, EXPORT_WEIGHTS):
        return artifact.parent / f"eval-{mode}.json"
    return artifact.with_name(f"{artifact.name}.eval-{mode}.json")


def save_eval_result(artifact: Path, record: dict[str, Any]) -> Path:
    return atomic_write_json(eval_result_path(artifact, record["mode"]), record)


def find_eval_results(artifact: Path) -> dict[str, dict[str, Any]]:
    """The saved results of `eval` and `eval-ttt` on this artifact, by mode (a file of
    another kind where a score would be is not one)."""
    found = {mode: read_json(eval_result_path(artifact, mode)) for mode in EVAL_MODES}
    return {mode: record for mode, record in found.items() if _is_score(record, mode)}


def _is_score(record: Any, mode: str | None = None) -> bool:
    """Whether a JSON value is a score as `eval` and `eval-ttt` save it: its mode (the one
    given, or any) and a val_bpb that is a number."""
    if not isinstance(record, dict) or record.get("mode") not in ((mode,) if mode else EVAL_MODES):
        return False
    bpb = record.get("val_bpb")
    return isinstance(bpb, (int, float)) and not isinstance(bpb, bool)


def is_eval_result(path: Path) -> bool:
    """Whether a file is a score `eval` or `eval-ttt` saved (they may replace it)."""
    path = Path(path)
    return path.name.endswith(".json") and "eval-" in path.name and _is_score(read_json(path))


def claim_eval_result(artifact: Path, mode: str) -> Path:
    """Where a score of this mode goes, refused now (before scoring) if a file of another
    kind lies there."""
    return claim_file(eval_result_path(artifact, mode), "a saved score", is_eval_result, flag="the score's file")
