"""The lineage a `.ptz` records: content hashes only, so that the same weights and settings
give the same bytes wherever they were quantized (paths go to the `.ptz.json` report)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..config import RunConfig
from .export import EXPORT_INFO
from .results import read_json

if TYPE_CHECKING:
    from .weights import LoadedWeights

DATA_PATH_FIELDS = ("data_path", "tokenizer_path", "tokenizer_meta_path")


def weights_lineage(weights: LoadedWeights) -> dict[str, Any]:
    """Where quantized weights came from, by content: the input's kind and sha256 and, for
    an export, the checkpoint's sha256, its step and which of its weights were exported."""
    lineage: dict[str, Any] = {"kind": weights.kind, "sha256": weights.sha256}
    info_path = weights.path.parent / EXPORT_INFO
    if weights.kind == "export" and info_path.is_file():
        info = read_json(info_path) or {}
        lineage.update({"run_sha256": info.get("source_sha256"), "step": info.get("step"),
                        "weights": info.get("weights")})
    return lineage


def without_paths(cfg: RunConfig) -> RunConfig:
    """The configuration with the data and tokenizer locations blanked: where the files lay
    on one machine is no setting of the model."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **{f: "" for f in DATA_PATH_FIELDS}))
