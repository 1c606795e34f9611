"""Decoding speed of `windowgpt generate`: the record model on one GPU, the tiny one on one CPU core.

    PYTHONPATH=$PWD python3 bench/generate_speed.py [--new-tokens 256] [--json PATH] [--cpu-only]

On CUDA, the record model (windows of 512 with 4 sinks on layers 2,4,6,8,10; random
weights, the dtypes `generate` runs it in) continues an 8-token prompt greedily with
`decoding.generate`, as `windowgpt generate` does:

- batch 1 and batch 64 (`--num-samples 64`, one batch), over the static key/value
  buffers, the step compiled and replayed as a CUDA graph: tokens/s after the first
  call, the first call's seconds (compilation and capture) and the time to the first
  token (prefill);
- batch 1 without the cache (the whole context recomputed for every token).

On the CPU, with one thread: the tiny preset's model, eager, batch 1 (its context of
128 tokens restarts while 256 new tokens are decoded, prefills counted).

Each configuration runs twice in one process; the second run's numbers are reported
(except first_call_s, the first run's). --json PATH writes them:
{"gpu", "batch1_tokens_per_s", "batch64_tokens_per_s", "first_token_s", "first_call_s", ...}.
Takes about two minutes on an H200, most of it compiling.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from windowgpt_cli.challenge import RECORD_WINDOWS  # noqa: E402
from windowgpt_cli.config import RunConfig, apply_overrides, tiny_preset  # noqa: E402
from windowgpt_cli.generate.decoding import Generation, StaticDecoder, generate  # noqa: E402
from windowgpt_cli.model.gpt import GPT, build_model, use_cuda_dtypes  # noqa: E402
from windowgpt_cli.runtime import enable_fast_math  # noqa: E402

PROMPT = [1, 412, 77, 935, 60, 18, 702, 5]  # BOS and seven tokens: a short prompt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens per sample")
    p.add_argument("--batch", type=int, default=64, help="samples of the batched run")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    p.add_argument("--cpu-only", action="store_true", help="only the tiny model on one CPU core")
    p.add_argument("--profile", action="store_true", help="also list the GPU kernels of one batch-1 step")
    return p.parse_args(argv)


def timed(model: GPT, new_tokens: int, **options: Any) -> tuple[Generation, Generation]:
    """(first run, second run) of one configuration; greedy, no stop token."""
    runs = tuple(generate(model, PROMPT, new_tokens, temperature=0.0, **options) for _ in range(2))
    assert all(len(sample) == new_tokens for run in runs for sample in run.samples)
    assert runs[0].samples == runs[1].samples, "two runs of the same greedy decoding differ"
    return runs


def row(name: str, runs: tuple[Generation, Generation]) -> dict[str, Any]:
    first, second = runs
    out = {"run": name, "samples": len(second.samples), "tokens_per_s": round(second.tokens_per_second, 1),
           "first_token_s": round(second.prefill_seconds, 4), "first_call_s": round(first.first_call_seconds, 3),
           "context_restarts": second.context_restarts}
    print(json.dumps(out), flush=True)
    return out


def gpu_rows(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    device = torch.device("cuda")
    enable_fast_math(device)
    cfg = apply_overrides(RunConfig(), {"model": dict(RECORD_WINDOWS)}).resolved().model
    torch.manual_seed(0)
    model = build_model(cfg, device)
    use_cuda_dtypes(model)
    model.set_attention_backend("sdpa", device)  # as `windowgpt generate`
    rows = [row("batch1", timed(model, args.new_tokens, compile_step=True)),
            row(f"batch{args.batch}", timed(model, args.new_tokens, num_samples=args.batch, compile_step=True)),
            row("batch1_no_cache", timed(model, args.new_tokens, use_cache=False))]
    cached, batched, recomputed = rows
    if args.profile:
        profile_step(model)
    summary = {
        "gpu": torch.cuda.get_device_name(device),
        "model": {"layers": cfg.num_layers, "dim": cfg.model_dim, "context": cfg.rope_train_seq_len,
                  **{k: list(v) if isinstance(v, tuple) else v for k, v in RECORD_WINDOWS.items()}},
        "new_tokens": args.new_tokens,
        "batch1_tokens_per_s": cached["tokens_per_s"],
        "batch64_tokens_per_s": batched["tokens_per_s"] if args.batch == 64 else None,
        "first_token_s": cached["first_token_s"],
        "first_call_s": cached["first_call_s"],
        "batch64_first_token_s": batched["first_token_s"] if args.batch == 64 else None,
        "batch1_no_cache_tokens_per_s": recomputed["tokens_per_s"],
        "torch": torch.__version__,
    }
    return summary, rows


def profile_step(model: GPT, steps: int = 50) -> None:
    """The kernels of the replayed batch-1 step, by GPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), StaticDecoder(model, 1, compile_step=True) as decoder:
        decoder.prefill(torch.tensor([PROMPT], device="cuda"), 0)
        for _ in range(3):
            decoder.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                decoder.step()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / steps
    print(f"GPU time per step: {total:.1f} us in {sum(e.count for e in events) / steps:.0f} kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / steps:8.1f} us {e.count / steps:5.1f}x  {e.key[:110]}")


def cpu_rows(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(tiny_preset().model, torch.device("cpu"))
    rows = [row("cpu_tiny_batch1", timed(model, args.new_tokens)),
            row("cpu_tiny_batch1_no_cache", timed(model, args.new_tokens, use_cache=False))]
    return {"cpu_tiny_tokens_per_s": rows[0]["tokens_per_s"],
            "cpu_tiny_no_cache_tokens_per_s": rows[1]["tokens_per_s"]}, rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    summary: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    if not args.cpu_only:
        if not torch.cuda.is_available():
            sys.exit("bench/generate_speed.py needs a CUDA GPU (or --cpu-only)")
        summary, rows = gpu_rows(args)
    cpu_summary, more = cpu_rows(args)
    summary.update(cpu_summary)
    summary["runs"] = rows + more
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
