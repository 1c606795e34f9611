"""`windowgpt quantize`: the scored artifact, a `.ptz`, and what it costs of the budget.

Parameter Golf counts the code plus the compressed weights against 16,000,000 bytes. The
code is the source of the package modules a record run imports (`codesize`), as the
challenge counts a training script. GPTQ uses the Hessians training collected within its
budget when the run or export has them, and otherwise calibrates after training, which the
report says.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .. import codesize
from ..cli_support import console, err_console, option_help, user_errors_exit_1, with_config_flags
from ..config import RunConfig, apply_overrides
from ..errors import ArtifactError, ConfigError

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    import torch

    from ..calibration import Calibration
    from ..model_io import LoadedWeights
    from ..quant import QuantizedTensor

DEFAULT_BUDGET = 16_000_000
GROUPS = ("attn", "mlp", "embed", "other", "control")


def report_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


def tensor_group(name: str) -> str:
    from ..model import is_control_tensor
    from ..quant import classify_param

    return "control" if is_control_tensor(name) else classify_param(name)


StartPhase = Callable[[str, int], Callable[[int], None]]  # (description, total steps) -> advance(n)


def quantize(model_path: Path, out: Path, *, gptq: bool | None = None, data_dir: Path | None = None,
             calib_batches: int | None = None, clip_range: int | None = None, compressor: str | None = None,
             budget: int = DEFAULT_BUDGET, device: str = "auto", recalibrate: bool = False,
             settings: dict[str, Any] | None = None, progress: StartPhase | None = None) -> dict[str, Any]:
    """Quantize a run or export into a .ptz at `out` and write the report beside it.

    Settings left as None come from the model's configuration (its `quant` group);
    `settings` ({field: value} of QuantConfig) sets any of them by name. GPTQ uses the
    Hessians training collected (RUN/hessians.safetensors, carried by an export of the EMA
    weights) unless `recalibrate`; without them it calibrates on `data_dir`. The compressor
    defaults to ptz.DEFAULT_COMPRESSOR; the report names the one used (`auto` picks lzma or rans).
    `progress(description, total)` may return a callback advanced as work is done.
    Returns the report (also written as JSON next to the artifact).
    """
    # torch is imported only when a command runs, so that --help answers at once
    from .. import ptz
    from ..artifacts import atomic_write_bytes, atomic_write_json
    from ..lineage import weights_lineage, without_paths
    from ..model import unbank_state_dict
    from ..model_io import load_weights
    from ..quant import quantize_state_dict
    from ..runtime import resolve_device, synchronize

    started = time.perf_counter()
    out = Path(out)
    if out.is_dir() or report_path(out).is_dir():
        raise ArtifactError(f"{out if out.is_dir() else report_path(out)}: is a directory; give a file name to write")
    if compressor is None:
        compressor = ptz.DEFAULT_COMPRESSOR
    if compressor not in ptz.COMPRESSOR_CHOICES:
        raise ConfigError(f"--compressor {compressor!r} must be one of {', '.join(ptz.COMPRESSOR_CHOICES)}")
    weights = load_weights(model_path)
    if weights.kind == "ptz":
        raise ConfigError(f"{model_path} is already quantized; quantize a run or export directory")
    cfg = quant_settings(weights.config, gptq, calib_batches, clip_range, settings)
    dev = resolve_device(device)
    timings: dict[str, float] = {"load": time.perf_counter() - started}

    hessians, calibration, where = None, None, None
    if cfg.quant.use_gptq:
        t0 = time.perf_counter()
        asked = calib_batches if calib_batches is not None else (settings or {}).get("gptq_calib_samples")
        calibration, where = run_calibration(weights, cfg, asked, data_dir, dev, recalibrate, progress)
        cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, gptq_calib_samples=calibration.batches))
        hessians = calibration.hessians
        synchronize(dev)
        timings["hessians"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sd = unbank_state_dict(weights.state_dict, cfg.model.num_layers)
    advance = progress("quantizing", len(sd)) if progress else None
    q = cfg.quant
    phases: dict[str, float] = {}
    tensors = quantize_state_dict(sd, q.quant_clip_range, hessians, q.gptq_block_size, q.gptq_percdamp,
                                  device=dev, on_progress=advance, timings=phases,
                                  passthrough_max_numel=q.quant_passthrough_max_numel)
    timings["quantize"] = time.perf_counter() - t0
    if cfg.quant.use_gptq:
        timings["gptq"] = phases["gptq"]

    t0 = time.perf_counter()
    artifact = ptz.PtzArtifact(without_paths(cfg), tensors, weights.tokenizer_sha256, weights_lineage(weights),
                               q.quant_clip_range)
    payload = ptz.payload_bytes(artifact)
    data = ptz.compress_payload(payload, compressor)
    timings["compress"] = time.perf_counter() - t0
    # The old report goes first: a report beside a .ptz always describes that .ptz.
    report_path(out).unlink(missing_ok=True)
    atomic_write_bytes(out, data)
    timings["total"] = time.perf_counter() - started

    source = {**artifact.source, "path": str(weights.path)}  # the payload holds no paths; the report does
    report = _report(out, data, payload, sd, tensors, cfg, compressor, budget, dev, timings, source)
    report.update(_calibration_record(calibration, where, weights) if calibration else {"calibration": None})
    atomic_write_json(report_path(out), report)
    return report


def quant_settings(cfg: RunConfig, gptq: bool | None, calib_batches: int | None, clip_range: int | None,
                   settings: dict[str, Any] | None = None) -> RunConfig:
    """The configuration with this quantization's settings, as the artifact records it."""
    named = {"use_gptq": gptq, "gptq_calib_samples": calib_batches, "quant_clip_range": clip_range}
    given = {**(settings or {}), **{k: v for k, v in named.items() if v is not None}}
    cfg = apply_overrides(cfg, {"quant": given})
    q = cfg.quant
    if not 1 <= q.quant_clip_range <= 127:
        raise ConfigError(f"--quant-clip-range {q.quant_clip_range} must be in 1..127")
    if q.use_gptq and q.gptq_calib_samples < 1:
        raise ConfigError(f"--gptq-calib-samples {q.gptq_calib_samples} must be at least 1")
    if q.gptq_block_size < 1 or q.gptq_percdamp < 0 or q.quant_passthrough_max_numel < 0:
        raise ConfigError("--gptq-block-size must be positive; --gptq-percdamp and --quant-passthrough-max-numel "
                          "must not be negative")
    return cfg


def run_calibration(weights: LoadedWeights, cfg: RunConfig, calib_batches: int | None, data_dir: Path | None,
                    dev: torch.device, recalibrate: bool, progress: StartPhase | None) -> tuple[Calibration, str]:
    """The Hessians training collected for these weights, or else a calibration now; and
    which of the two it is."""
    from ..calibration import AFTER_TRAINING, INSIDE_TRAINING, stored_calibration

    stored = None if recalibrate else stored_calibration(weights)
    if stored is None:
        return calibration_hessians(weights, cfg, data_dir, dev, progress), AFTER_TRAINING
    if calib_batches is not None and calib_batches != stored.batches:
        raise ConfigError(f"the Hessians from training cover {stored.batches} batches; --calib-batches "
                          f"{calib_batches} needs --recalibrate")
    return stored, INSIDE_TRAINING


def calibration_hessians(weights: LoadedWeights, cfg: RunConfig, data_dir: Path | None, dev: torch.device,
                         progress: StartPhase | None) -> Calibration:
    """Calibrate the weights now, on the batches training would have calibrated on."""
    from ..calibration import calibrate
    from ..datadir import check_same_tokenizer, verify_data
    from ..model import build_model

    data = data_dir or (Path(cfg.data.data_path) if cfg.data.data_path else None)
    if data is None:
        raise ConfigError("--gptq needs --data DATA_DIR (the training shards to calibrate on): "
                          f"{weights.path} holds no Hessians from training")
    if data_dir is None and not data.is_dir():
        raise ConfigError(f"GPTQ calibrates on the training shards, but the model's data_path {data} is not a "
                          "directory here; pass --data DATA_DIR")
    manifest = verify_data(Path(data))
    check_same_tokenizer(manifest, weights.tokenizer_sha256, f"{weights.path} was trained with")
    model = build_model(cfg.model, dev, initialize=False)
    model.load_state_dict(weights.state_dict, strict=True)
    model.set_attention_backend(cfg.train.attn_backend, dev)
    advance = progress("calibrating", cfg.quant.gptq_calib_samples) if progress else None
    calibration = calibrate(model, cfg, manifest.shards("train"), dev,
                            on_batch=(lambda: advance(1)) if advance else None)
    del model
    return calibration


def _calibration_record(calibration: Calibration, where: str, weights: LoadedWeights) -> dict[str, Any]:
    from ..calibration import INSIDE_TRAINING, hessians_path

    info = {"batches": calibration.batches, "tokens": calibration.tokens, "layers": calibration.layers,
            "seconds": round(calibration.seconds, 3)}
    if where == INSIDE_TRAINING:
        info.update(step=calibration.step, hessians=str(hessians_path(weights)))
    return {"calibration": where, "calibration_info": info}


def _report(out: Path, data: bytes, payload: bytes, sd: dict[str, torch.Tensor], tensors: dict[str, QuantizedTensor],
            cfg: RunConfig, compressor: str, budget: int, dev: torch.device, timings: dict[str, float],
            source: dict[str, Any]) -> dict[str, Any]:
    from .. import ptz
    from ..artifacts import sha256_bytes
    from ..quant import INT6

    groups = {g: {"tensors": 0, "params": 0, "raw_bytes": 0, "quantized_bytes": 0} for g in GROUPS}
    schemes: dict[str, int] = {}
    for name, qt in tensors.items():
        row = groups[tensor_group(name)]
        row["tensors"] += 1
        row["params"] += sd[name].numel()
        row["raw_bytes"] += sd[name].numel() * sd[name].element_size()
        row["quantized_bytes"] += qt.stored_bytes
        label = f"{qt.scheme}_{qt.method}" if qt.scheme == INT6 else qt.scheme
        schemes[label] = schemes.get(label, 0) + 1
    code = codesize.count_code()
    total = len(data) + code.bytes
    return {
        "artifact": str(out), "sha256": sha256_bytes(data), "format_version": ptz.FORMAT_VERSION,
        "compressor": ptz.compressor_of(data), "compressor_option": compressor, "source": source, "device": str(dev),
        "gptq": cfg.quant.use_gptq, "calib_batches": cfg.quant.gptq_calib_samples if cfg.quant.use_gptq else 0,
        "clip_range": cfg.quant.quant_clip_range, "schemes": schemes, "groups": groups,
        "payload_bytes": len(payload), "model_bytes": len(data), "code_bytes": code.bytes,
        "code_counted": code.form, "code_modules": code.files, "code_source_bytes": code.source_bytes,
        "code_archive": code.archive, "code_sha256": code.sha256, "total_bytes": total,
        "budget_bytes": budget, "headroom_bytes": budget - total, "within_budget": total <= budget,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }


# --- The command -------------------------------------------------------------------------

@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[StartPhase | None]:
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description:12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bars:
        def start(description: str, total: int) -> Callable[[int], None]:
            task = bars.add_task(description, total=total)
            return lambda n: bars.advance(task, n)

        yield start


def _budget_table(report: dict[str, Any]) -> Table:
    chosen = f" by {report['compressor_option']}" if report["compressor_option"] != report["compressor"] else ""
    table = Table(title=f"{report['artifact']} ({report['compressor']}{chosen}, clip {report['clip_range']}"
                        f"{', GPTQ' if report['gptq'] else ''})")
    for col in ("group", "tensors", "params", "raw bytes", "quantized bytes"):
        table.add_column(col, justify="left" if col == "group" else "right")
    for name, row in report["groups"].items():
        if row["tensors"]:
            table.add_row(name, str(row["tensors"]), f"{row['params']:,}", f"{row['raw_bytes']:,}",
                          f"{row['quantized_bytes']:,}")
    table.add_section()
    table.add_row("payload", "", "", "", f"{report['payload_bytes']:,}")
    table.add_row("compressed model", "", "", "", f"{report['model_bytes']:,}")
    table.add_row("code", "", "", "", f"{report['code_bytes']:,}")
    style = "green" if report["within_budget"] else "bold red"
    table.add_row("total", "", "", "", f"[{style}]{report['total_bytes']:,}[/]")
    table.add_row("budget", "", "", "", f"{report['budget_bytes']:,}")
    table.add_row("headroom", "", "", "", f"[{style}]{report['headroom_bytes']:,}[/]")
    return table


def _timing_line(report: dict[str, Any]) -> str:
    return "time: " + ", ".join(f"{k} {v:.2f}s" for k, v in report["timings_s"].items()) + f" on {report['device']}"


def _code_line(report: dict[str, Any]) -> str:
    """Which form of the code was counted, with the source figure beside a packed one."""
    line = f"code: {report['code_counted']}, {report['code_bytes']:,} bytes"
    if report["code_archive"]:
        return line + f" ({report['code_archive']}; its source uncompressed: {report['code_source_bytes']:,} bytes)"
    return line + f" ({len(report['code_modules'])} modules; `windowgpt pack` packs them smaller)"


def _calibration_line(report: dict[str, Any]) -> str | None:
    """Where GPTQ's Hessians came from: only Hessians from inside training make a record artifact."""
    from ..calibration import INSIDE_TRAINING

    if report["calibration"] is None:
        return None
    info = report["calibration_info"]
    line = (f"calibration: {report['calibration']} ({info['batches']} batches, {info['tokens']:,} tokens, "
            f"{info['seconds']:.1f}s")
    if report["calibration"] == INSIDE_TRAINING:
        return line + f" at step {info['step']}, {info['hessians']})"
    return line + "): outside the training budget, not a record artifact"


QUANT_FLAG_ALIASES = {"use_gptq": ("--gptq",), "gptq_calib_samples": ("--calib-batches",),
                      "quant_clip_range": ("--clip-range",)}


@user_errors_exit_1
@with_config_flags("quant", from_artifact=True, aliases=QUANT_FLAG_ALIASES)
def command(
    model_dir: Annotated[Path, typer.Argument(help="An export directory, or a run directory (its EMA weights).",
                                              show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="The .ptz file to write.", show_default=False)],
    data: Annotated[Optional[Path], typer.Option("--data", help=option_help(
        "Training shards for GPTQ calibration, when the run holds no Hessians from training.",
        "the artifact's data_path"), show_default=False)] = None,
    compressor: Annotated[Optional[str], typer.Option("--compressor", help=option_help(
        "Payload compressor: auto (rans, or lzma where that is smaller on a small payload), rans, or lzma "
        "(the reference's xz preset 6).", "auto"), show_default=False)] = None,
    budget: Annotated[int, typer.Option("--budget", help="Bytes allowed for code plus compressed model; "
                      "exceeding it exits 1 (the artifact is still written).")] = DEFAULT_BUDGET,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu or cuda.")] = "auto",
    recalibrate: Annotated[bool, typer.Option("--recalibrate", help="Calibrate GPTQ on --data even when the run "
                           "holds Hessians from training.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of a table.")] = False,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Quantize to int6/int8 (optionally GPTQ), compress, and check the size budget."""
    with _progress_bars(not json_output) as progress:
        report = quantize(model_dir, out, data_dir=data, compressor=compressor, budget=budget, device=device,
                          recalibrate=recalibrate, settings=(overrides or {}).get("quant"), progress=progress)
    if json_output:
        console.print_json(data=report)
    else:
        console.print(_budget_table(report))
        console.print(_timing_line(report), highlight=False)
        console.print(_code_line(report), highlight=False, soft_wrap=True)
        calibration = _calibration_line(report)
        if calibration:
            console.print(calibration, highlight=False)
        console.print(f"wrote {out} (sha256 {report['sha256'][:16]}...) and {report_path(out)}", highlight=False)
    if not report["within_budget"]:
        raise ArtifactError(f"{out}: {report['total_bytes']:,} bytes (model {report['model_bytes']:,} + code "
                            f"{report['code_bytes']:,}) exceed the budget of {report['budget_bytes']:,} by "
                            f"{-report['headroom_bytes']:,}")
