"""`windowgpt quantize`: the scored artifact, a `.ptz`, and what it costs of the budget.

Parameter Golf counts the code plus the compressed weights against 16,000,000 bytes. The
code is the source of the package modules a record run imports (`record.codesize`), as the
challenge counts a training script. GPTQ uses the Hessians training collected within its
budget when the run or export has them, and otherwise calibrates after training, which the
report says.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..artifacts import codecs, compressors, ptz
from ..artifacts.checkpoint import HESSIANS_FILENAME
from ..artifacts.lineage import weights_lineage, without_paths
from ..artifacts.ptz import is_ptz
from ..artifacts.info import quality_rows
from ..artifacts.quantized import QuantizedTensor
from ..artifacts.weights import LoadedWeights, load_weights, located_tokenizer
from ..challenge import AFTER_TRAINING, BUDGET_BYTES, INSIDE_TRAINING
from ..config import RunConfig, apply_overrides, check_settings, validate
from ..data.manifest import check_same_tokenizer, verify_data
from ..errors import ArtifactError, ConfigError
from ..model.gpt import build_model
from ..model.state_dict import GROUPS, tensor_group, unbank_state_dict
from ..record import codesize
from ..runtime import out_of_memory_as_error, resolve_device, synchronize, use_cpu_threads
from ..storage.files import atomic_write_bytes, atomic_write_json, read_json, sha256_bytes, tensors_sha256
from ..storage.outputs import check_apart, claim_file
from .calibration import Calibration, calibrate, load_hessians
from .fit import fit_to_budget
from .gptq import quantize_state_dict
from .schemes import QuantPlan


def report_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


StartPhase = Callable[[str, int], Callable[[int], None]]  # (description, total steps) -> advance(n)


def quantize(model_path: Path, out: Path, *, gptq: bool | None = None, data_dir: Path | None = None,
             calib_batches: int | None = None, clip_range: int | None = None, compressor: str | None = None,
             budget: int = BUDGET_BYTES, device: str = "auto", recalibrate: bool = False,
             settings: dict[str, Any] | None = None, progress: StartPhase | None = None) -> dict[str, Any]:
    """Quantize a run or export into a .ptz at `out` and write the report beside it.

    Settings left as None come from the model's configuration (its `quant` group);
    `settings` ({field: value} of QuantConfig) sets any of them by name. GPTQ uses the
    Hessians training collected (RUN/hessians.safetensors, carried by an export of the EMA
    weights) unless `recalibrate`; without them it calibrates on `data_dir`. The compressor
    defaults to compressors.DEFAULT_COMPRESSOR; the report names the one used (`auto` picks lzma or rans).
    `progress(description, total)` may return a callback advanced as work is done.
    Returns the report (also written as JSON next to the artifact).
    """
    started = time.perf_counter()
    out = Path(out)
    check_settings(budget=budget)
    check_apart(out, [model_path, data_dir])
    claim_file(out, "a .ptz", is_ptz)
    claim_file(report_path(out), "a quantize report", is_quant_report, flag="the report")
    if compressor is None:
        compressor = compressors.DEFAULT_COMPRESSOR
    if compressor not in compressors.COMPRESSOR_CHOICES:
        raise ConfigError(f"--compressor {compressor!r} must be one of {', '.join(compressors.COMPRESSOR_CHOICES)}")
    if compressor in codecs.PACKAGES:
        codecs.require(compressor)
    quant_settings(RunConfig(), gptq, calib_batches, clip_range, settings)  # bounded before anything is read
    weights = load_weights(model_path)
    if weights.kind == "ptz":
        raise ConfigError(f"{model_path} is already quantized; quantize a run or export directory")
    cfg = quant_settings(weights.config, gptq, calib_batches, clip_range, settings)
    dev = resolve_device(device)
    use_cpu_threads(cfg.train.cpu_threads, dev)
    timings: dict[str, float] = {"load": time.perf_counter() - started}

    hessians, calibration, where = None, None, None
    if cfg.quant.use_gptq:
        t0 = time.perf_counter()
        asked = calib_batches if calib_batches is not None else (settings or {}).get("gptq_calib_samples")
        with out_of_memory_as_error(dev, "calibrating", "calibrate on the CPU (--device cpu)"):
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
    plan = QuantPlan.from_config(q)
    if plan.gptq_embed and hessians is not None and not any("tok_emb.weight" in names for names in hessians):
        raise ConfigError("quant_gptq_embed needs the output layer's Hessian, which these Hessians lack (collected "
                          "without it): --recalibrate --data DATA")
    with out_of_memory_as_error(dev, "quantizing", "quantize on the CPU (--device cpu)"):
        tensors = quantize_state_dict(sd, None, hessians, q.gptq_block_size, q.gptq_percdamp, device=dev,
                                      on_progress=advance, timings=phases, plan=plan)
    timings["quantize"] = time.perf_counter() - t0
    if cfg.quant.use_gptq:
        timings["gptq"] = phases["gptq"]
    if plan.lqer_rank:
        timings["lqer"] = phases["lqer"]

    t0 = time.perf_counter()
    code = codesize.count_code()

    last: dict[str, Any] = {}  # the artifact compressed last, which is the one written

    def compress(candidate: dict[str, QuantizedTensor]) -> bytes:
        errors = {name: relative_error(sd[name], qt) for name, qt in candidate.items()}
        last["artifact"] = ptz.PtzArtifact(without_paths(cfg), candidate, weights.tokenizer_sha256,
                                           weights_lineage(weights), q.quant_clip_range, errors)
        last["payload"] = ptz.payload_bytes(last["artifact"])
        return ptz.compress_payload(last["payload"], compressor)

    fit = None
    if q.quant_fit_budget:
        tensors, data, fit = fit_to_budget(sd, tensors, hessians, compress, budget - code.bytes)
    else:
        data = compress(tensors)
    artifact, payload = last["artifact"], last["payload"]
    timings["compress"] = time.perf_counter() - t0
    # The old report goes first: a report beside a .ptz always describes that .ptz.
    report_path(out).unlink(missing_ok=True)
    atomic_write_bytes(out, data)
    timings["total"] = time.perf_counter() - started

    source = {**artifact.source, "path": str(weights.path)}  # the payload holds no paths; the report does
    report = _report(out, data, payload, sd, tensors, artifact.errors, cfg, compressor, budget, dev, timings, source,
                     code)
    report["fit"] = fit
    report.update(_calibration_record(calibration, where, weights) if calibration else {"calibration": None})
    tokenizer = located_tokenizer(weights)  # for generate and eval to find it later
    report["tokenizer"] = {"path": str(tokenizer) if tokenizer else None, "sha256": weights.tokenizer_sha256}
    atomic_write_json(report_path(out), report)
    return report


def is_quant_report(path: Path) -> bool:
    """Whether a file is the report quantize writes beside a .ptz (it may replace that)."""
    return {"artifact", "compressor", "payload_bytes", "budget_bytes"} <= set(read_json(path) or {})


def quant_settings(cfg: RunConfig, gptq: bool | None, calib_batches: int | None, clip_range: int | None,
                   settings: dict[str, Any] | None = None) -> RunConfig:
    """The configuration with this quantization's settings, as the artifact records it."""
    named = {"use_gptq": gptq, "gptq_calib_samples": calib_batches, "quant_clip_range": clip_range}
    given = {**(settings or {}), **{k: v for k, v in named.items() if v is not None}}
    cfg = apply_overrides(cfg, {"quant": given})
    validate(cfg)
    return cfg


def run_calibration(weights: LoadedWeights, cfg: RunConfig, calib_batches: int | None, data_dir: Path | None,
                    dev: torch.device, recalibrate: bool, progress: StartPhase | None) -> tuple[Calibration, str]:
    """The Hessians training collected for these weights, or else a calibration now; and
    which of the two it is."""
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

    info = {"batches": calibration.batches, "tokens": calibration.tokens, "layers": calibration.layers,
            "seconds": round(calibration.seconds, 3)}
    if where == INSIDE_TRAINING:
        info.update(step=calibration.step, hessians=str(hessians_path(weights)))
    return {"calibration": where, "calibration_info": info}


def relative_error(weight: torch.Tensor, qt: QuantizedTensor) -> float:
    """The round trip's squared error over the weight's squared norm (0 for kept values)."""
    w = weight.detach().float().cpu()
    norm = float(w.pow(2).sum())
    return float((w - qt.dequantize().float()).pow(2).sum()) / norm if norm > 0 else 0.0


def group_rows(sd: dict[str, torch.Tensor], tensors: dict[str, QuantizedTensor], errors: dict[str, float],
               clip_range: int) -> dict[str, dict[str, Any]]:
    """Per tensor group: tensors, parameters, bytes before and after quantization, and
    (`info.quality_rows`) the code widths, LQER corrections and round-trip error."""
    groups = {g: {"tensors": 0, "params": 0, "raw_bytes": 0, "quantized_bytes": 0} for g in GROUPS}
    for name, qt in tensors.items():
        row = groups[tensor_group(name)]
        row["tensors"] += 1
        row["params"] += sd[name].numel()
        row["raw_bytes"] += sd[name].numel() * sd[name].element_size()
        row["quantized_bytes"] += qt.stored_bytes
    quality = quality_rows({name: (sd[name].numel(), qt.scheme, qt.correction is not None, errors.get(name))
                            for name, qt in tensors.items()}, clip_range)
    for group, row in quality.items():
        groups[group].update(row)
    return groups


def _report(out: Path, data: bytes, payload: bytes, sd: dict[str, torch.Tensor], tensors: dict[str, QuantizedTensor],
            errors: dict[str, float], cfg: RunConfig, compressor: str, budget: int, dev: torch.device,
            timings: dict[str, float], source: dict[str, Any], code: codesize.CodeCount) -> dict[str, Any]:

    groups = group_rows(sd, tensors, errors, cfg.quant.quant_clip_range)
    schemes: dict[str, int] = {}
    for qt in tensors.values():
        label = f"{qt.scheme}_{qt.method}" if qt.method else qt.scheme
        schemes[label] = schemes.get(label, 0) + 1
    sections = ptz.sections_of(data)
    for row in sections:
        group = str(row["section"]).split("/")[0]
        if group in groups:
            groups[group].setdefault("compressed_bytes", 0)
            groups[group]["compressed_bytes"] += row["compressed_bytes"]
    total = len(data) + code.bytes
    return {
        "artifact": str(out), "sha256": sha256_bytes(data), "format_version": ptz.FORMAT_VERSION,
        "compressor": ptz.compressor_of(data), "compressor_option": compressor, "source": source, "device": str(dev),
        "gptq": cfg.quant.use_gptq, "calib_batches": cfg.quant.gptq_calib_samples if cfg.quant.use_gptq else 0,
        "clip_range": cfg.quant.quant_clip_range, "schemes": schemes, "groups": groups, "sections": sections,
        "payload_bytes": len(payload), "model_bytes": len(data), "code_bytes": code.bytes,
        "code_counted": code.form, "code_modules": code.files, "code_source_bytes": code.source_bytes,
        "code_archive": code.archive, "code_sha256": code.sha256, "total_bytes": total,
        "budget_bytes": budget, "headroom_bytes": budget - total, "within_budget": total <= budget,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }
def hessians_path(weights: LoadedWeights) -> Path | None:
    """Where a run's or an export's Hessians from training would be (None for a .ptz)."""
    return weights.path.parent / HESSIANS_FILENAME if weights.kind in ("run", "export") else None


def stored_calibration(weights: LoadedWeights) -> Calibration | None:
    """The Hessians training collected for these weights, or None when there are none.
    Hessians collected under other weights are refused, never used."""
    path = hessians_path(weights)
    if path is None or not path.is_file():
        return None
    calibration = load_hessians(path)
    if calibration.weights_sha256 != tensors_sha256(weights.state_dict):
        raise ArtifactError(f"{path} was collected under other weights than {weights.path}; remove it, or "
                            "calibrate afresh with --recalibrate --data DATA")
    return calibration
