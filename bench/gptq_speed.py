"""How long quantization takes, with and without GPTQ, and what each compressor gives.

    python bench/gptq_speed.py MODEL_DIR DATA_DIR [--reference train_gpt_window.py] [--shim DIR]
                               [--layers NAME,NAME] [--calib-batches N] [--device auto] [--out DIR]

MODEL_DIR is a run directory (its EMA weights) or an export directory; DATA_DIR holds the
training shards used for calibration. It measures, on this machine:

1. `quantize` end to end (the stage function) without and with GPTQ: compressed bytes and
   the time of each phase;
2. Hessian collection and the batched GPTQ on their own, and the reference's
   `gptq_quantize_weight` (CPU, column by column) on the same weights and Hessians for a
   few layers: time, and reconstruction error (H-weighted and plain MSE) of both;
3. every compressor of bench/compressors.py on the real payload (size, compress and
   decompress time) and the order-0 entropy of the int6/int8 codes, a bound no byte-wise
   coder of the codes beats without modelling context;
4. the reference's own artifact (torch.save + lzma preset 6 of mixed_quantize_int6) from
   the same weights, and whether its dequantized tensors equal ours bit for bit.

The reference imports flash_attn_interface when imported; --shim names a folder with a
stand-in (default: shim/ beside the reference).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import lzma
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compressors import CANDIDATES, run_all  # noqa: E402  (bench/compressors.py)
from compressors import table as compressor_table  # noqa: E402
from windowgpt_cli.artifacts import ptz  # noqa: E402
from windowgpt_cli.model.state_dict import unbank_state_dict  # noqa: E402
from windowgpt_cli.artifacts.weights import load_weights  # noqa: E402
from windowgpt_cli.artifacts.quantized import INT6, INT8
from windowgpt_cli.quant.gptq import quantize_state_dict  # noqa: E402
from windowgpt_cli.runtime import resolve_device, synchronize  # noqa: E402
from windowgpt_cli.quant.quantize import calibration_hessians, quant_settings, quantize  # noqa: E402

console = Console(width=160)


def import_reference(script: Path, shim: Path):
    sys.path.insert(0, str(shim))
    spec = importlib.util.spec_from_file_location("train_gpt_window", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn, device: torch.device):
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def errors(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, h: torch.Tensor) -> dict[str, float]:
    e = w.double() - q.double() * s.double()[:, None]
    return {"h_weighted": float(torch.einsum("ri,ij,rj->", e, h.double(), e)), "mse": float(e.pow(2).mean())}


def _entropy_of(codes: torch.Tensor) -> float:
    counts = np.bincount(codes.flatten().numpy().astype(np.int64) + 128)
    p = counts[counts > 0] / codes.numel()
    return float(-(p * np.log2(p)).sum()) * codes.numel() / 8


def code_entropy_bytes(artifact: ptz.PtzArtifact) -> tuple[float, int]:
    """Order-0 entropy of each tensor's codes (bytes), and the bytes of everything else."""
    entropy, other = 0.0, 0
    for qt in artifact.tensors.values():
        if qt.scheme in (INT6, INT8):
            entropy += _entropy_of(qt.values)
            other += qt.scale.numel() * qt.scale.element_size()
        else:
            other += qt.values.numel() * qt.values.element_size()
    return entropy, other


def bucketed_entropy_bytes(artifact: ptz.PtzArtifact, axis: int, buckets: int = 8) -> float:
    """Entropy of the int6 codes with one symbol distribution per bucket of columns (axis 0)
    or rows (axis 1) of similar code magnitude: what a coder conditioned on that could save."""
    total = 0.0
    for qt in artifact.tensors.values():
        if qt.scheme != INT6:
            continue
        q = qt.values.numpy().astype(np.int64)
        rms = np.sqrt((q.astype(np.float64) ** 2).mean(axis=axis))
        bucket = np.searchsorted(np.quantile(rms, np.linspace(0, 1, buckets + 1)[1:-1]), rms)
        for b in range(buckets):
            part = q[:, bucket == b] if axis == 0 else q[bucket == b]
            if part.size:
                counts = np.bincount(part.ravel() + 128)
                p = counts[counts > 0] / part.size
                total += float(-(p * np.log2(p)).sum()) * part.size / 8
    return total


def bench_end_to_end(model: Path, data: Path, out: Path, calib: int, device: str) -> dict:
    results = {}
    for label, gptq in (("rtn", False), ("gptq", True)):
        report, seconds = timed(lambda: quantize(model, out / f"{label}.ptz", gptq=gptq, data_dir=data,
                                                 calib_batches=calib, device=device), resolve_device(device))
        results[label] = {"model_bytes": report["model_bytes"], "total_bytes": report["total_bytes"],
                          "timings_s": report["timings_s"], "wall_s": round(seconds, 3)}
        console.print(f"quantize {label}: model {report['model_bytes']:,} B, total {report['total_bytes']:,} B, "
                      f"phases {report['timings_s']}")
    return results


def bench_gptq(model: Path, data: Path, calib: int, device: str, reference, layers: list[str]) -> dict:
    dev = resolve_device(device)
    weights = load_weights(model)
    cfg = quant_settings(weights.config, True, calib, None)
    calibration, t_hessians = timed(lambda: calibration_hessians(weights, cfg, data, dev, None), dev)
    hessians = calibration.hessians
    sd = unbank_state_dict(weights.state_dict, cfg.model.num_layers)
    q = cfg.quant
    ours, t_gptq = timed(lambda: quantize_state_dict(sd, q.quant_clip_range, hessians, q.gptq_block_size,
                                                     q.gptq_percdamp, device=dev), dev)
    result = {"hessians_s": round(t_hessians, 3), "quantize_all_s": round(t_gptq, 3), "layers": {}}
    console.print(f"Hessians ({calib} batches): {t_hessians:.2f}s; all tensors incl. batched GPTQ: {t_gptq:.2f}s")
    for name in layers:
        h = next(h for names, h in hessians.items() if name in names).cpu()
        w = sd[name].detach().float().cpu()
        (q_ref, s_ref), t_ref = timed(lambda: reference.gptq_quantize_weight(w, h, clip_range=q.quant_clip_range),
                                      torch.device("cpu"))
        mine = ours[name]
        row = {"reference_cpu_s": round(t_ref, 3), "reference": errors(w, q_ref, s_ref, h),
               "ours": errors(w, mine.values, mine.scale, h), "method": mine.method,
               "codes_equal_fraction": float((q_ref == mine.values).float().mean())}
        result["layers"][name] = row
        console.print(f"{name}: reference CPU GPTQ {t_ref:.2f}s; H-weighted error ours/reference "
                      f"{row['ours']['h_weighted'] / row['reference']['h_weighted']:.5f}, MSE ratio "
                      f"{row['ours']['mse'] / row['reference']['mse']:.5f}, "
                      f"codes equal {row['codes_equal_fraction']:.4f}")
    return result


def bench_compressors(artifact_path: Path) -> dict:
    artifact = ptz.load(artifact_path)
    payload = ptz.payload_bytes(artifact)
    entropy, other = code_entropy_bytes(artifact)
    int6_entropy = sum(_entropy_of(qt.values) for qt in artifact.tensors.values() if qt.scheme == INT6)
    by_column, by_row = bucketed_entropy_bytes(artifact, 0), bucketed_entropy_bytes(artifact, 1)
    console.print(f"int6 code entropy: order-0 per tensor {int6_entropy:,.0f} B; with 8 column buckets "
                  f"{by_column:,.0f} B ({by_column / int6_entropy - 1:+.2%}); with 8 row buckets {by_row:,.0f} B "
                  f"({by_row / int6_entropy - 1:+.2%})")
    rows = {"payload_bytes": len(payload), "code_entropy_bytes": round(entropy), "other_raw_bytes": other,
            "int6_entropy_bytes": round(int6_entropy), "int6_entropy_column_buckets": round(by_column),
            "int6_entropy_row_buckets": round(by_row), "compressors": {}}
    results = run_all(payload, list(CANDIDATES), os.cpu_count() or 1)
    rows["compressors"] = results
    console.print(compressor_table(results, f"compressors on {artifact_path.name} (payload {len(payload):,} B; "
                                            f"order-0 entropy of codes {entropy:,.0f} B + {other:,} B of scales "
                                            "and kept tensors)"))
    return rows


def bench_reference_format(model: Path, reference, ours_path: Path) -> dict:
    weights = load_weights(model)
    cfg = weights.config
    sd = {k: v.detach().cpu() for k, v in weights.state_dict.items()}
    unbanked = reference._unbank_state_dict(sd, cfg.model.num_layers)
    result, meta = reference.mixed_quantize_int6(unbanked, {"mlp", "attn"}, clip_range=cfg.quant.quant_clip_range)
    buf = io.BytesIO()
    torch.save({"w": result, "m": meta}, buf)
    blob = lzma.compress(buf.getvalue(), preset=6)
    theirs = reference.dequantize_mixed_int6(result, meta, unbanked)
    mine = ptz.load(ours_path).dequantized()
    equal = sum(torch.equal(theirs[k], mine[k].to(theirs[k].dtype)) for k in theirs)
    console.print(f"reference artifact (RTN): {len(blob):,} B vs ours {ours_path.stat().st_size:,} B; "
                  f"dequantized tensors equal bit for bit: {equal}/{len(theirs)}")
    return {"reference_bytes": len(blob), "ours_bytes": ours_path.stat().st_size, "equal_tensors": equal,
            "tensors": len(theirs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="run directory or export directory")
    parser.add_argument("data", type=Path, help="directory with the training shards")
    parser.add_argument("--reference", type=Path, default=Path("/work/shared/seed/train_gpt_window.py"))
    parser.add_argument("--shim", type=Path, default=None, help="folder with flash_attn_interface.py")
    parser.add_argument("--layers", default="blocks.0.attn.c_q.weight,blocks.0.mlp.proj.weight")
    parser.add_argument("--calib-batches", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="where the .ptz files and bench.json go")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gptq_speed_"))
    out.mkdir(parents=True, exist_ok=True)
    reference = import_reference(args.reference, args.shim or args.reference.parent / "shim")
    console.print(f"device {resolve_device(args.device)}, torch {torch.__version__}, threads {torch.get_num_threads()}")

    results = {"end_to_end": bench_end_to_end(args.model, args.data, out, args.calib_batches, args.device)}
    results["gptq"] = bench_gptq(args.model, args.data, args.calib_batches, args.device, reference,
                                 [n for n in args.layers.split(",") if n])
    results["compressors_rtn"] = bench_compressors(out / "rtn.ptz")
    results["compressors_gptq"] = bench_compressors(out / "gptq.ptz")
    results["reference_format"] = bench_reference_format(args.model, reference, out / "rtn.ptz")
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out / 'bench.json'}")


if __name__ == "__main__":
    main()
