"""Where the sliding evaluation's time goes on one GPU: compilation, steady batches, kernels.

    python bench/eval_profile.py --data DATA_DIR [--batch-seqs 256] [--batches 12]

Builds the default model (random weights: speed does not depend on them), takes batches of
stride-64 windows from the middle of the validation tokens, and times each variant of the
scorer: its first batch (compilation included) and the median of the next ones, projected
to the whole validation set. --profile also lists each variant's CUDA kernels. Ends with
a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.evaluation import WindowScorer, load_validation_tokens, plan_windows  # noqa: E402
from windowgpt_cli.model import build_model  # noqa: E402
from windowgpt_cli.runtime import enable_fast_math  # noqa: E402
from windowgpt_cli.tokenizer import load_byte_luts  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="directory with fineweb_val_*.bin and tokenizer.model")
    p.add_argument("--batch-seqs", type=int, default=256)
    p.add_argument("--batches", type=int, default=12, help="timed batches after the first")
    p.add_argument("--variants", default="compiled,eager", help="compiled, eager, eager-cudnn, compiled-cudnn")
    p.add_argument("--profile", action="store_true", help="print each variant's top CUDA kernels")
    return p.parse_args()


def timed_batches(scorer: WindowScorer, plan, batch: int, count: int) -> tuple[float, list[float]]:
    """Seconds of the first batch and of each of the next `count`."""
    times = []
    for i in range(count + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        scorer.score(plan.select(slice(i * batch, (i + 1) * batch))).tolist()
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def print_kernels(scorer: WindowScorer, plan, batch: int) -> None:
    """The CUDA kernels of three batches of a warmed-up scorer, by total time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_batches(scorer, plan, batch, 2)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


def main() -> None:
    a = parse_args()
    device = torch.device("cuda")
    enable_fast_math(device)
    cfg = RunConfig().resolved()
    torch.manual_seed(0)
    model = build_model(cfg.model, device)
    with torch.no_grad():  # no zero matrices: they can run faster than real weights
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(std=0.02)
    model.set_attention_backend("auto", device)
    model.eval()
    seq_len, stride = cfg.eval.eval_seq_len, cfg.eval.eval_stride
    val = load_validation_tokens(a.data, seq_len, cfg.model.vocab_size)
    luts = load_byte_luts(a.data / "tokenizer.model", None, cfg.model.vocab_size).to(device)
    full_plan = plan_windows(val.numel() - 1, seq_len, stride)
    full_batches = len(full_plan) / a.batch_seqs
    plan = full_plan.select(slice(len(full_plan) // 4, len(full_plan) // 4 + (a.batches + 1) * a.batch_seqs))
    tokens = val.to(device=device, dtype=torch.int64)
    print(f"{len(full_plan):,} windows of {seq_len}, stride {stride}: {full_batches:.0f} batches of {a.batch_seqs}",
          flush=True)

    rows = []
    for variant in a.variants.split(","):
        torch._dynamo.reset()
        attention = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if variant.endswith("cudnn") else nullcontext()
        with attention:
            scorer = WindowScorer(model, tokens, luts, seq_len=seq_len, width=stride, batch_rows=a.batch_seqs,
                                  device=device, compile_model=variant.startswith("compiled"))
            first, steady = timed_batches(scorer, plan, a.batch_seqs, a.batches)
            if a.profile:
                print(f"{variant}: kernels of three batches", flush=True)
                print_kernels(scorer, plan, a.batch_seqs)
        per_batch = statistics.median(steady)
        rows.append((variant, first, per_batch, first - per_batch + per_batch * full_batches))
        print(f"{variant}: first batch {first:.2f}s, then {per_batch * 1e3:.1f} ms/batch "
              f"(spread {min(steady) * 1e3:.1f}-{max(steady) * 1e3:.1f})", flush=True)

    print(f"\n{'variant':<16} {'first batch s':>13} {'ms/batch':>9} {'projected s':>12}")
    for variant, first, per_batch, projected in rows:
        print(f"{variant:<16} {first:>13.2f} {per_batch * 1e3:>9.1f} {projected:>12.1f}")


if __name__ == "__main__":
    main()
