"""Where the sliding evaluation's time goes on one GPU: compilation, steady batches, kernels.

    python bench/eval_profile.py --data DATA_DIR [--batch-seqs 256] [--batches 12] [--cold]
        [--variants compiled,compiled-autotune,eager] [--profile]

Builds the default model (random weights: speed does not depend on them), takes batches of
stride-64 windows from the middle of the validation tokens, and times each variant of the
scorer: its first batch (compilation included) and the median of the next ones, projected
to the whole validation set, with the peak memory per window. Variants:

- compiled:          the scorer as `eval` runs it (Inductor without autotuning)
- compiled-autotune: Inductor's defaults (each element-wise kernel built twice and timed)
- eager:             no compilation
- a "-cudnn" suffix forces cuDNN attention.

--cold runs each variant in a fresh process with empty Inductor and Triton caches (a first
`eval` on a new machine) and adds the compiler's own breakdown; without it the variants
share one process, and later ones reuse what earlier ones compiled. --profile also lists
each variant's CUDA kernels. Ends with a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fresh import run_fresh  # noqa: E402
from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.evaluation import WindowScorer, load_validation_tokens, plan_windows  # noqa: E402
from windowgpt_cli.model import build_model  # noqa: E402
from windowgpt_cli.runtime import enable_fast_math  # noqa: E402
from windowgpt_cli.tokenizer import load_byte_luts  # noqa: E402

# The compiler's phases worth reporting (torch._dynamo.utils.compile_times).
COMPILE_PHASES = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
                  "GraphLowering.codegen", "async_compile.wait")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="directory with fineweb_val_*.bin and tokenizer.model")
    p.add_argument("--batch-seqs", type=int, default=256)
    p.add_argument("--batches", type=int, default=12, help="timed batches after the first")
    p.add_argument("--variants", default="compiled,eager",
                   help="comma-separated: compiled, compiled-autotune, eager, each optionally with -cudnn")
    p.add_argument("--cold", action="store_true", help="each variant in a fresh process with empty caches")
    p.add_argument("--profile", action="store_true", help="print each variant's top CUDA kernels")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one variant, its result as a JSON line
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


class Bench:
    """The model, the validation windows and the scorer's inputs, shared by the variants."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.device = a, torch.device("cuda")
        enable_fast_math(self.device)
        cfg = RunConfig().resolved()
        torch.manual_seed(0)
        self.model = build_model(cfg.model, self.device)
        with torch.no_grad():  # no zero matrices: they can run faster than real weights
            for p in self.model.parameters():
                if p.ndim >= 2:
                    p.normal_(std=0.02)
        self.model.set_attention_backend("auto", self.device)
        self.model.eval()
        self.seq_len, self.stride = cfg.eval.eval_seq_len, cfg.eval.eval_stride
        val = load_validation_tokens(a.data, self.seq_len, cfg.model.vocab_size)
        self.luts = load_byte_luts(a.data / "tokenizer.model", None, cfg.model.vocab_size).to(self.device)
        full_plan = plan_windows(val.numel() - 1, self.seq_len, self.stride)
        self.full_batches = len(full_plan) / a.batch_seqs
        middle = len(full_plan) // 4
        self.plan = full_plan.select(slice(middle, middle + (a.batches + 1) * a.batch_seqs))
        self.tokens = val.to(device=self.device, dtype=torch.int64)
        self.windows = len(full_plan)

    def run(self, variant: str) -> dict:
        a = self.a
        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()
        attention = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if variant.endswith("-cudnn") else nullcontext()
        with attention:
            scorer = WindowScorer(self.model, self.tokens, self.luts, seq_len=self.seq_len, width=self.stride,
                                  batch_rows=a.batch_seqs, device=self.device,
                                  compile_model=variant.startswith("compiled"), autotune="-autotune" in variant)
            first, steady = timed_batches(scorer, self.plan, a.batch_seqs, a.batches)
            if a.profile:
                print(f"{variant}: kernels of three batches", flush=True)
                print_kernels(scorer, self.plan, a.batch_seqs)
        per_batch = statistics.median(steady)
        phases = torch._dynamo.utils.compile_times(repr="csv")
        phases = dict(zip(*phases)) if isinstance(phases, tuple) else {}
        return {
            "variant": variant, "first": first, "per_batch": per_batch, "spread": [min(steady), max(steady)],
            "projected": first - per_batch + per_batch * self.full_batches,
            "mib_per_window": torch.cuda.max_memory_allocated() / 2**20 / a.batch_seqs,
            "phases": {name: _seconds(phases.get(name)) for name in COMPILE_PHASES},
            "windows": self.windows, "batches": self.full_batches,
        }


def _seconds(value) -> float | None:
    """compile_times lists one time per compile; the total."""
    if value is None:
        return None
    return sum(float(v) for v in str(value).split(",") if v.strip())


def run_cold(a: argparse.Namespace, variant: str) -> dict:
    return run_fresh([__file__, "--data", str(a.data), "--batch-seqs", str(a.batch_seqs), "--batches",
                      str(a.batches), "--child", variant] + (["--profile"] if a.profile else []))


def describe(r: dict) -> str:
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in r["phases"].items() if v is not None)
    return (f"{r['variant']}: first batch {r['first']:.2f}s, then {r['per_batch'] * 1e3:.1f} ms/batch "
            f"(spread {r['spread'][0] * 1e3:.1f}-{r['spread'][1] * 1e3:.1f}), {r['mib_per_window']:.1f} MiB/window"
            + (f"; compiler: {phases}" if phases else ""))


def main() -> None:
    a = parse_args()
    if a.child:
        print(json.dumps(Bench(a).run(a.child)))
        return
    bench = None if a.cold else Bench(a)
    results = []
    for variant in a.variants.split(","):
        result = run_cold(a, variant) if a.cold else bench.run(variant)
        if not results:
            print(f"{result['windows']:,} windows, {result['batches']:.0f} batches of {a.batch_seqs}")
        results.append(result)
        print(describe(result), flush=True)

    print(f"\n{'variant':<24} {'first batch s':>13} {'ms/batch':>9} {'projected s':>12}"
          + (f" {'process s':>10}" if a.cold else ""))
    for r in results:
        print(f"{r['variant']:<24} {r['first']:>13.2f} {r['per_batch'] * 1e3:>9.1f} {r['projected']:>12.1f}"
              + (f" {r['process']:>10.1f}" if a.cold else ""))


if __name__ == "__main__":
    main()
