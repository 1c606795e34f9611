"""`windowgpt export`: a training checkpoint's chosen weights as per-layer tensors.

MODEL_DIR/model.safetensors holds the weights under the reference's per-layer names
(blocks.{i}.attn.c_q.weight, ...), MODEL_DIR/config.json the run configuration and
MODEL_DIR/export.json what was exported from where, with the sha256 of the weights, of the
configuration and of the tokenizer, which loading checks. An export of the EMA weights
carries the Hessians training collected for them (MODEL_DIR/hessians.safetensors); one of
other weights does not, since those Hessians belong to the EMA weights. MODEL_DIR is built
beside its destination and renamed into place, so a re-export that fails half way leaves
the previous export whole.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..cli_support import console, user_errors_exit_1
from ..errors import ConfigError


def export(run_dir: Path, out: Path, weights: str = "ema") -> dict[str, Any]:
    """Write MODEL_DIR (out); returns what export.json records."""
    # torch is imported only when a command runs, so that --help answers at once
    from ..artifacts import publish_dir
    from ..checkpoint import WEIGHT_CHOICES, load_checkpoint
    from ..model import unbank_state_dict

    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"--weights {weights!r} must be one of {', '.join(WEIGHT_CHOICES)}")
    ckpt = load_checkpoint(run_dir)
    tensors = unbank_state_dict(ckpt.weights(weights), ckpt.config.model.num_layers)
    return publish_dir(Path(out), lambda folder: _write_export(folder, run_dir, ckpt, tensors, weights))


def _write_export(out: Path, run_dir: Path, ckpt, tensors: dict, weights: str) -> dict[str, Any]:
    from .. import tensorfile
    from ..artifacts import atomic_write_json, sha256_file
    from ..checkpoint import checkpoint_path
    from ..model_io import EXPORT_CONFIG, EXPORT_FORMAT, EXPORT_INFO, EXPORT_VERSION, EXPORT_WEIGHTS

    tensorfile.save(out / EXPORT_WEIGHTS, tensors, {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION})
    ckpt.config.save(out / EXPORT_CONFIG)
    hessians = _carry_hessians(Path(run_dir), out, weights)
    info = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "weights": weights,
        "swa_snapshots": ckpt.swa_count if weights == "swa" else None,
        "source_checkpoint": str(checkpoint_path(run_dir)),
        "source_sha256": sha256_file(checkpoint_path(run_dir)),
        "step": ckpt.step,
        "tokenizer_sha256": ckpt.tokenizer_sha256,
        "tensor_count": len(tensors),
        "parameter_count": sum(t.numel() for t in tensors.values()),
        "sha256": sha256_file(out / EXPORT_WEIGHTS),
        "hessians": hessians,
        "config_sha256": sha256_file(out / EXPORT_CONFIG),
    }
    atomic_write_json(out / EXPORT_INFO, info)  # written last: its presence marks a complete export
    return info


def _carry_hessians(run_dir: Path, out: Path, weights: str) -> str | None:
    """Copy the run's Hessians (collected under its EMA weights) into an export of those
    weights; leave none behind in an export of other weights."""
    from ..artifacts import atomic_write_bytes
    from ..calibration import HESSIANS_FILENAME
    from ..checkpoint import checkpoint_path

    source, target = checkpoint_path(run_dir).parent / HESSIANS_FILENAME, out / HESSIANS_FILENAME
    if weights != "ema" or not source.is_file():
        target.unlink(missing_ok=True)
        return None
    atomic_write_bytes(target, source.read_bytes())
    return HESSIANS_FILENAME


@user_errors_exit_1
def command(
    run_dir: Annotated[Path, typer.Argument(help="A training run directory (holds checkpoint.pt).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="The export directory to write.", show_default=False)],
    weights: Annotated[str, typer.Option(help="Which weights: ema (what the reference applies), swa (averaged "
                                                "snapshots) or last (the final step).")] = "ema",
    json_output: Annotated[bool, typer.Option("--json", help="Print export.json instead of a table.")] = False,
) -> None:
    """Export a checkpoint's weights as per-layer tensors (safetensors) with its config."""
    info = export(run_dir, out, weights)
    if json_output:
        console.print_json(data=info)
        return
    table = Table(title=f"exported {out}", show_header=False)
    for key in ("weights", "step", "tensor_count", "parameter_count", "source_sha256", "tokenizer_sha256"):
        value = info[key]
        table.add_row(key, f"{value:,}" if isinstance(value, int) and key != "step" else str(value))
    console.print(table)
