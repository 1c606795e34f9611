"""Where the sliding evaluation's time goes on one GPU: compilation, steady batches, kernels.

    python bench/eval_profile.py --data DATA_DIR [--batch-seqs 256] [--batches 12] [--cold [--warm]]
        [--variants fused,compiled,compiled-autotune,eager] [--profile] [--phases] [--cprofile N]

Builds the default model (random weights: speed does not depend on them), takes batches of
stride-64 windows from the middle of the validation tokens, and times each variant of the
scorer: its set-up and first batch (compilation included) and the median of the next ones, projected
to the whole validation set, with the peak memory per window. Variants:

- fused:             the scorer as `eval` runs it on CUDA (windowgpt's fused kernels)
- compiled:          the whole forward through torch.compile (Inductor without autotuning)
- compiled-autotune: Inductor's defaults (each element-wise kernel built twice and timed)
- eager:             the model's torch code, not compiled
- a "-cudnn" suffix forces cuDNN attention;
- "+nopm" turns Inductor's pattern-matching passes off, "+nolo" its loop reordering after
  fusion, "+cg" runs the graph as a CUDA graph, "+mat" lets Inductor time its own matrix
  product kernels against cuBLAS and fuse element-wise work into them (max_autotune; e.g.
  compiled+nopm+cg).

--cold runs each variant in a fresh process with empty Inductor and Triton caches (a first
`eval` on a new machine) and adds the compiler's own breakdown; --warm then runs it again in
another fresh process that finds those caches filled (a second `eval`). Without --cold the
variants share one process, and later ones reuse what earlier ones compiled. --profile also
lists each variant's CUDA kernels; --cprofile N the N Python functions of its first batch
(compilation) that take longest. Each variant reports the kernels Inductor generated and its
cache hits. Ends with a table.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fresh import run_fresh  # noqa: E402
from windowgpt_cli import runtime  # noqa: E402
from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.eval.scoring import WindowScorer, plan_windows
from windowgpt_cli.data.loader import load_validation_tokens  # noqa: E402
from windowgpt_cli.model.gpt import build_model  # noqa: E402
from windowgpt_cli.runtime import enable_fast_math  # noqa: E402
from windowgpt_cli.data.tokenizer import load_byte_luts  # noqa: E402

# Variant flags that set an Inductor option for the evaluation's one-pass graphs.
INDUCTOR_FLAGS = {"+nopm": ("pattern_matcher", False), "+nolo": ("loop_ordering_after_fusion", False),
                  "+cg": ("triton.cudagraphs", True), "+mat": ("max_autotune", True)}

ONE_PASS_DEFAULTS = dict(runtime.ONE_PASS_OPTIONS)


def set_inductor_flags(variant: str) -> None:
    """The scorer's Inductor options: eval's, with the variant's flags on top (and no flag of
    an earlier variant of this process)."""
    runtime.ONE_PASS_OPTIONS.clear()
    runtime.ONE_PASS_OPTIONS.update(ONE_PASS_DEFAULTS)
    runtime.ONE_PASS_OPTIONS.update({option: value for flag, (option, value) in INDUCTOR_FLAGS.items()
                                     if flag in variant})


# The compiler's phases worth reporting (torch._dynamo.utils.compile_times); --phases lists all.
COMPILE_PHASES = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
                  "GraphLowering.codegen", "async_compile.wait")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="directory with fineweb_val_*.bin and tokenizer.model")
    p.add_argument("--batch-seqs", type=int, default=256)
    p.add_argument("--batches", type=int, default=12, help="timed batches after the first")
    p.add_argument("--variants", default="fused,compiled,eager",
                   help="comma-separated: fused, compiled, compiled-autotune, eager; each may end in -cudnn")
    p.add_argument("--cold", action="store_true", help="each variant in a fresh process with empty caches")
    p.add_argument("--warm", action="store_true", help="with --cold: then again on the caches the first run filled")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the first batch's N slowest functions")
    p.add_argument("--profile", action="store_true", help="print each variant's top CUDA kernels")
    p.add_argument("--phases", action="store_true", help="print every compiler phase's seconds")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one variant, its result as a JSON line
    return p.parse_args()


def timed_batches(scorer: WindowScorer, plan, batch: int, count: int, cprofile: int = 0) -> tuple[float, list[float]]:
    """Seconds of the first batch and of each of the next `count`; with cprofile, the first
    batch runs under cProfile and its `cprofile` slowest functions are printed."""
    times = []
    for i in range(count + 1):
        profiler = cProfile.Profile() if cprofile and i == 0 else None
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profiler or nullcontext():
            scorer.score(plan.select(slice(i * batch, (i + 1) * batch))).tolist()
        times.append(time.perf_counter() - start)
        if profiler:
            print_slowest_functions(profiler, cprofile)
    return times[0], times[1:]


def print_slowest_functions(profiler: cProfile.Profile, count: int) -> None:
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(count)
        text = out.getvalue()
        print(f"first batch, by {order}:\n" + text[text.find("ncalls"):], flush=True)


def compiler_counters() -> dict:
    """Kernels Inductor generated and the compiler caches' hits and misses, as counted."""
    from torch._inductor import metrics

    found = {"kernels": metrics.generated_kernel_count}
    for group, names in torch._dynamo.utils.counters.items():
        found.update({f"{group}.{name}": n for name, n in names.items() if "cache" in name and n})
    return found


def print_kernels(scorer: WindowScorer, plan, batch: int) -> None:
    """The CUDA kernels of three batches of a warmed-up scorer, by total time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_batches(scorer, plan, batch, 2)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=110))


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
        set_inductor_flags(variant)
        torch.cuda.reset_peak_memory_stats()
        attention = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if variant.endswith("-cudnn") else nullcontext()
        with attention:
            start = time.perf_counter()  # the scorer builds its kernels when it is made (fused)
            scorer = WindowScorer(self.model, self.tokens, self.luts, seq_len=self.seq_len, width=self.stride,
                                  batch_rows=a.batch_seqs, device=self.device,
                                  compile_model=variant.startswith("compiled"), fused=variant.startswith("fused"),
                                  autotune="-autotune" in variant)
            set_up = time.perf_counter() - start
            first, steady = timed_batches(scorer, self.plan, a.batch_seqs, a.batches, a.cprofile)
            first += set_up
            if a.profile:
                print(f"{variant}: kernels of three batches", flush=True)
                print_kernels(scorer, self.plan, a.batch_seqs)
        per_batch = statistics.median(steady)
        phases = torch._dynamo.utils.compile_times(repr="csv")
        phases = {name: _seconds(value) for name, value in zip(*phases)} if isinstance(phases, tuple) else {}
        if a.phases:
            for name, seconds in sorted(phases.items(), key=lambda item: -item[1])[:30]:
                print(f"{variant} phase {name}: {seconds:.2f}s")
        return {
            "variant": variant, "first": first, "per_batch": per_batch, "spread": [min(steady), max(steady)],
            "projected": first - per_batch + per_batch * self.full_batches,
            "mib_per_window": torch.cuda.max_memory_allocated() / 2**20 / a.batch_seqs,
            "phases": {name: phases.get(name) for name in COMPILE_PHASES},
            "counters": compiler_counters(),
            "windows": self.windows, "batches": self.full_batches,
        }


def _seconds(value) -> float:
    """compile_times lists one time per compile; the total."""
    return sum(float(v) for v in str(value).split(",") if v.strip())


def run_cold(a: argparse.Namespace, variant: str) -> list[dict]:
    """The variant in a fresh process on empty caches, and with --warm again on those caches."""
    argv = [__file__, "--data", str(a.data), "--batch-seqs", str(a.batch_seqs), "--batches", str(a.batches),
            "--cprofile", str(a.cprofile), "--child", variant]
    argv += [flag for flag, on in (("--profile", a.profile), ("--phases", a.phases)) if on]
    with tempfile.TemporaryDirectory() as cache:
        results = [run_fresh(argv, cache)]
        # Distinct kernels compiled (each kernel, and each configuration tried, is one cubin).
        results[0]["counters"]["cubins"] = sum(1 for _ in Path(cache).rglob("*.cubin"))
        if a.warm:
            results.append(dict(run_fresh(argv, cache), variant=f"{variant} (warm)"))
    return results


def describe(r: dict) -> str:
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in r["phases"].items() if v is not None)
    counters = ", ".join(f"{k} {v}" for k, v in r["counters"].items())
    return (f"{r['variant']}: first batch {r['first']:.2f}s, then {r['per_batch'] * 1e3:.1f} ms/batch "
            f"(spread {r['spread'][0] * 1e3:.1f}-{r['spread'][1] * 1e3:.1f}), {r['mib_per_window']:.1f} MiB/window"
            + (f"; compiler: {phases}" if phases else "") + f"; {counters}")


def main() -> None:
    a = parse_args()
    if a.child:
        print(json.dumps(Bench(a).run(a.child)))
        return
    bench = None if a.cold else Bench(a)
    results = []
    for variant in a.variants.split(","):
        for result in run_cold(a, variant) if a.cold else [bench.run(variant)]:
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
