"""Each quantization scheme and compressor on one model: its compressed bytes, its
stride-64 sliding val_bpb, and what quantization costs against the unquantized weights.

    python3 bench/quant_schemes.py EXPORT --data DATA --work WORK --out RESULT.json
        [--schemes reference,sdclip,...] [--model NAME] [--stride 64] [--budget 16000000]

EXPORT is an export of a run trained with `--use-gptq --quant-gptq-embed` (its Hessians
cover the output layer too, for the schemes that quantize the embedding by GPTQ). Every
scheme quantizes with GPTQ on those Hessians and the `auto` compressor (`own`: with the
export's own settings, a preset's scheme), run from the packed code (`windowgpt pack
--strip --lzma`) so that its report counts the code as a record does and a scheme that fits its
artifact into the budget (`--quant-fit-budget`, `pr1855_fit`) aims at `--budget` less that
code; a scheme over the budget is measured all the same; a scheme that fails is recorded
with its error and the others are still measured; `reference` is also
written with each whole-payload compressor (the same weights and codes), so the file
compares the compressors too, and every .ptz's decoding is timed. `--compressor rans`
measures schemes quickly (rans is within 0.2% of auto on the record model). Writes RESULT.json
{"gpu", "model", "unquantized_val_bpb", "schemes": {NAME: {"bytes", "val_bpb",
"quant_loss", ...}}, "compressors": {NAME: {"bytes", "decode_s"}}} and prints a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SDCLIP = ["--quant-mlp-clip-sigmas", "11.5", "--quant-attn-clip-sigmas", "13", "--quant-embed-clip-sigmas", "14"]


def lqer(rank: int = 4, top_k: int = 3) -> list[str]:
    """LQER's flags: PR #1855's by default (rank 4 on the 3 matrices of the largest error)."""
    return ["--quant-lqer-rank", str(rank), "--quant-lqer-top-k", str(top_k), "--quant-lqer-factor-bits", "4",
            "--quant-lqer-group-size", "64"]


LQER = lqer()
PR1855 = SDCLIP + ["--quant-embed-bits", "7", "--quant-gptq-embed", "--quant-gates-int8"]
# Every scheme sets every setting it departs in, so that the export's own values never leak in.
OFF = ["--clip-range", "31", "--no-quant-gptq-embed", "--quant-embed-bits", "8", "--quant-mlp-clip-sigmas", "0",
       "--quant-attn-clip-sigmas", "0", "--quant-embed-clip-sigmas", "0", "--no-quant-gates-int8",
       "--quant-lqer-rank", "0", "--quant-scale-floor", "--no-quant-fit-budget"]
SCHEMES = {
    "reference": [],
    "lqer": LQER,
    # each row's own grid, without the reference's scale floor of 1 / the codes' limit
    "nofloor": ["--no-quant-scale-floor"],
    "int5_nofloor": ["--clip-range", "15", "--no-quant-scale-floor"],
    "int4_nofloor": ["--clip-range", "7", "--no-quant-scale-floor"],
    # PR #1855's clips at k standard deviations: the clip sets each row's grid (wider: coarser)
    **{f"sdclip{k}": ["--quant-mlp-clip-sigmas", str(k), "--quant-attn-clip-sigmas", str(k)] for k in (14, 17, 20)},
    "sdclip": SDCLIP,
    "sdclip_int7embed": SDCLIP + ["--quant-embed-bits", "7"],
    "sdclip_int7embed_gptqembed": SDCLIP + ["--quant-embed-bits", "7", "--quant-gptq-embed"],
    "pr1855": PR1855 + LQER,
    # fitted into --budget by zeroing its cheapest codes of +-1 (the frontier preset's scheme)
    "pr1855_fit": PR1855 + LQER + ["--quant-fit-budget"],
    # LQER on more matrices or at a higher rank: a few kB each where the artifact has room
    "pr1855_lqer_top8": PR1855 + lqer(top_k=8),
    "pr1855_lqer_rank8": PR1855 + lqer(rank=8),
    "pr1855_lqer_rank8_top8": PR1855 + lqer(rank=8, top_k=8),
    # the MLP's and the attention's clips a step either side of #1855's (tuned on its model)
    **{f"pr1855_mlp_clip{k}": PR1855 + LQER + ["--quant-mlp-clip-sigmas", str(k)] for k in (10, 13)},
    **{f"pr1855_attn_clip{k}": PR1855 + LQER + ["--quant-attn-clip-sigmas", str(k)] for k in (11.5, 15)},
    # the export's own settings (a preset's scheme, e.g. --preset frontier's), nothing turned off
    "own": None,
}
WHOLE_PAYLOAD = ("lzma", "rans", "brotli", "zstd")


class CommandFailed(Exception):
    """A windowgpt command exited non-zero; the message is its last line of errors."""


def windowgpt(*args: str, code: Path | None = None) -> dict:
    """A windowgpt command's --json output (its stderr passed through), run from the packed
    `code` when given. A quantize report over its budget is returned all the same."""
    program = [str(code)] if code else ["-m", "windowgpt_cli"]
    done = subprocess.run([sys.executable, *program, *args, "--json"], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sys.stderr.write(done.stderr)
    if done.returncode == 1 and args[0] == "quantize":
        try:
            report = json.loads(done.stdout)
        except ValueError:  # no report: a failure like any other
            report = {}
        if report.get("within_budget") is False:
            return report
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exited {done.returncode}"])[-1]
        raise CommandFailed(f"windowgpt {' '.join(args[:2])}: {last}")
    return json.loads(done.stdout)


def scheme_flags(name: str) -> list[str]:
    """quantize's flags for a scheme: every departing setting reset, then the scheme's own."""
    return [] if SCHEMES[name] is None else [*OFF, *SCHEMES[name]]


def decode_seconds(path: Path) -> float:
    from windowgpt_cli.artifacts import ptz

    started = time.perf_counter()
    ptz.load(path)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--model", default="record model, 240 s on one H200")
    parser.add_argument("--stride", default="64")
    parser.add_argument("--compressor", default="auto", help="the schemes' compressor; the comparison of every "
                        "compressor on the reference scheme runs only with auto")
    parser.add_argument("--budget", type=int, default=16_000_000, help="bytes of code and model a fitting scheme "
                        "aims at")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    code = args.work / "code.pyz"
    subprocess.run([sys.executable, "-m", "windowgpt_cli", "pack", "--strip", "--lzma", "--out", str(code)], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    import torch

    result: dict = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "model": args.model, "stride": int(args.stride), "schemes": {}, "compressors": {}}
    base = windowgpt("eval", str(args.export), "--data", str(args.data), "--stride", args.stride)
    result["unquantized_val_bpb"] = base["val_bpb"]
    print(f"unquantized: val_bpb {base['val_bpb']:.5f}", flush=True)
    for name in args.schemes.split(","):
        out = args.work / f"{name}.ptz"
        try:
            report = windowgpt("quantize", str(args.export), "--out", str(out), "--gptq", "--budget",
                               str(args.budget), *scheme_flags(name), "--compressor", args.compressor, code=code)
            score = windowgpt("eval", str(out), "--data", str(args.data), "--stride", args.stride)
        except CommandFailed as failed:  # the others are still measured
            result["schemes"][name] = {"error": str(failed)}
            print(f"{name}: failed: {failed}", flush=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
            continue
        result["schemes"][name] = {
            "bytes": report["model_bytes"], "total_bytes": report["total_bytes"], "fit": report.get("fit"),
            "val_bpb": score["val_bpb"],
            "quant_loss": score["val_bpb"] - base["val_bpb"], "compressor": report["compressor"],
            "decode_s": round(decode_seconds(out), 3), "compress_s": report["timings_s"]["compress"],
            "groups": {g: {k: row.get(k) for k in ("bits", "lqer", "rel_error", "compressed_bytes")}
                       for g, row in report["groups"].items() if row["tensors"]},
            "sections": report["sections"]}
        print(f"{name}: {report['model_bytes']:,} bytes, val_bpb {score['val_bpb']:.5f} "
              f"(quantization +{score['val_bpb'] - base['val_bpb']:.5f})", flush=True)
        if name == "reference" and args.compressor == "auto":
            for compressor in WHOLE_PAYLOAD:
                path = args.work / f"reference_{compressor}.ptz"
                again = windowgpt("quantize", str(args.export), "--out", str(path), "--gptq", *OFF,
                                  "--compressor", compressor, "--budget", str(1 << 40), code=code)
                result["compressors"][compressor] = {"bytes": again["model_bytes"],
                                                     "compress_s": again["timings_s"]["compress"],
                                                     "decode_s": round(decode_seconds(path), 3)}
            result["compressors"]["auto"] = {"bytes": report["model_bytes"], "compress_s":
                                             report["timings_s"]["compress"],
                                             "decode_s": result["schemes"]["reference"]["decode_s"]}
            print("compressors: " + ", ".join(f"{k} {v['bytes']:,}" for k, v in result["compressors"].items()),
                  flush=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # what is measured so far survives a stop
    lzma_bytes = result["compressors"].get("lzma", {}).get("bytes")
    for row in result["schemes"].values():
        if lzma_bytes and "bytes" in row:
            row["bytes_vs_reference_lzma"] = round(row["bytes"] / lzma_bytes, 4)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
