"""Sliding-window attention on one GPU: FlexAttention against windowgpt's Triton kernels.

    PYTHONPATH=$PWD python3 bench/attention_speed.py [--json PATH] [--sweep] [--warm-caches]

At the record model's shapes (H=8 query heads, Hkv=4, head size 64, T=2048, window 512 with
4 sinks, bf16), for a training micro-batch (B=48: forward, and forward + backward) and an
evaluation batch (B=512: forward in inference mode), it times

- flex:   FlexAttention compiled (`attention._flex`, the kernel the compiled model traces);
- triton: `window_attention.window_attention`, the Triton kernels;
- sdpa:   SDPA's full causal attention (as the model's full causal layers), a yardstick
          that does about twice the work;
- where flash-attn-4 is installed: fa4 (`--attn-backend fa4`'s windowed layer, compiled:
          FA4's window, the sinks folded in by `attention_sinks`' kernels), fa4_no_sinks (FA4's
          window alone) and fa4_full (FA4's full causal attention, beside sdpa);

with CUDA events after a warm-up, as milliseconds and TFLOP/s counting only the (query,
key) pairs each computes (2 matrix products forward, 5 backward). "first call" is the wall
time of each kernel's first call at that shape: compilation or kernel builds included. By
default the compiler caches are emptied first (a fresh machine); --warm-caches keeps them.
It then compares out, dq, dk and dv of triton and flex (and fa4) on the training batch (max
abs difference, and each one's difference from a float32 reference). --sweep times a dozen
block/warps/stages settings of each of the Triton forward, dK/dV and dQ kernels at the
training shape and prints the best. --json PATH writes every number. Takes under a minute on
an H200 without --sweep.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from windowgpt_cli.model import attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, SEQ_LEN, WINDOW, SINKS = 8, 4, 64, 2048, 512, 4
TRAIN_BATCH, EVAL_BATCH = 48, 512
FWD_MATMULS, BWD_MATMULS = 2, 5

# (block owned, block looped over, warps, stages) of the forward (queries, keys), the dK/dV
# kernel (keys, queries) and the dQ kernel (queries, keys), each swept with the others at
# their defaults
FWD_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 4), (64, 32, 4, 3), (64, 16, 4, 4),
             (32, 32, 4, 4), (64, 32, 2, 4), (128, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 5)]
DKDV_SWEEP = [(64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 4, 5), (64, 32, 4, 2), (64, 16, 4, 3), (64, 64, 4, 2),
              (128, 32, 4, 3), (128, 32, 4, 4), (128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 2), (32, 64, 4, 3)]
DQ_SWEEP = [(64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 4, 5), (64, 64, 4, 3), (64, 16, 4, 3), (128, 32, 4, 3),
            (128, 32, 8, 3), (128, 64, 8, 3), (128, 32, 4, 5), (32, 32, 4, 3), (32, 64, 4, 3), (64, 32, 2, 3)]

console = Console(width=140)
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    p.add_argument("--sweep", action="store_true", help="also time a few Triton block settings")
    p.add_argument("--warm-caches", action="store_true", help="keep Triton's and Inductor's caches")
    p.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    return p.parse_args(argv)


def inputs(batch: int, requires_grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(batch)
    shapes = ((batch, SEQ_LEN, HEADS, HEAD_DIM), (batch, SEQ_LEN, KV_HEADS, HEAD_DIM),
              (batch, SEQ_LEN, KV_HEADS, HEAD_DIM))
    return tuple(torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(requires_grad)
                 for s in shapes)


def kernels(tuning=None) -> dict[str, Attention]:
    from windowgpt_cli.kernels.window_attention import DEFAULT_TUNING, window_attention

    def flex(q, k, v):
        return attention._flex(q, k, v, attention._flex_block_mask(SEQ_LEN, WINDOW, SINKS, q.device))

    def triton(q, k, v):
        return window_attention(q, k, v, WINDOW, SINKS, tuning or DEFAULT_TUNING)

    def sdpa(q, k, v):
        return attention._sdpa(q, k, v, mask=None)

    impls = {"flex": flex, "triton": triton, "sdpa": sdpa}
    if attention.fa4_available():
        impls["fa4"] = torch.compile(lambda q, k, v: attention.attention(q, k, v, WINDOW, SINKS, "fa4"))
        impls["fa4_no_sinks"] = lambda q, k, v: attention._fa4(q, k, v, WINDOW)[0]
        impls["fa4_full"] = lambda q, k, v: attention._fa4(q, k, v, None)[0]
    return impls


@functools.cache
def visible_pairs(window: int, sinks: int) -> int:
    return int(attention.window_mask(SEQ_LEN, window, sinks, torch.device("cpu")).sum())


def tflops(name: str, batch: int, matmuls: int, ms: float) -> float:
    full, no_sinks = name in ("sdpa", "fa4_full"), name == "fa4_no_sinks"
    pairs = visible_pairs(0, 0) if full else visible_pairs(WINDOW, 0 if no_sinks else SINKS)
    return 2 * matmuls * pairs * HEAD_DIM * HEADS * batch / (ms * 1e-3) / 1e12


def cuda_ms(fn: Callable[[], object], iters: int, warm_up: int = 2) -> float:
    for _ in range(warm_up):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def first_call_s(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def forward_backward(fn: Attention, q, k, v, grad) -> Callable[[], object]:
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)


def time_eval(impls: dict[str, Attention], iters: int) -> dict[str, dict]:
    q, k, v = inputs(EVAL_BATCH, requires_grad=False)
    results = {}
    with torch.inference_mode():
        for name, fn in impls.items():
            call = lambda: fn(q, k, v)  # noqa: E731
            first = first_call_s(call)
            ms = cuda_ms(call, iters)
            results[name] = {"first_call_s": first, "fwd_ms": ms,
                             "fwd_tflops": tflops(name, EVAL_BATCH, FWD_MATMULS, ms)}
    return results


def time_train(impls: dict[str, Attention], iters: int) -> dict[str, dict]:
    q, k, v = inputs(TRAIN_BATCH, requires_grad=True)
    grad = torch.randn_like(q)
    results = {}
    for name, fn in impls.items():
        step = forward_backward(fn, q, k, v, grad)
        first = first_call_s(step)
        fwd_ms = cuda_ms(lambda: fn(q, k, v), iters)
        step_ms = cuda_ms(step, iters)
        results[name] = {"first_call_s": first, "fwd_ms": fwd_ms,
                         "fwd_tflops": tflops(name, TRAIN_BATCH, FWD_MATMULS, fwd_ms), "fwd_bwd_ms": step_ms,
                         "fwd_bwd_tflops": tflops(name, TRAIN_BATCH, FWD_MATMULS + BWD_MATMULS, step_ms)}
    return results


def errors(impls: dict[str, Attention]) -> dict[str, dict]:
    """Max abs differences of out, dq, dk, dv: triton against flex, and each against float32."""
    q, k, v = inputs(TRAIN_BATCH, requires_grad=True)  # the shape flex is compiled for already
    grad = torch.randn_like(q)

    def outputs(fn, q, k, v, grad):
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    def reference(q, k, v):
        group = HEADS // KV_HEADS
        k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
        return attention._sdpa(q, k, v, mask=attention.window_mask(SEQ_LEN, WINDOW, SINKS, q.device))

    got = {name: outputs(impls[name], q, k, v, grad) for name in ("triton", "flex", "fa4") if name in impls}
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]  # float32 gradients too
    want = outputs(reference, *exact, grad.float())
    names = ("out", "dq", "dk", "dv")

    def diff(a, b):
        return {n: (x.float() - y.float()).abs().max().item() for n, x, y in zip(names, a, b)}

    found = {"triton_vs_flex": diff(got["triton"], got["flex"])}
    found.update({f"{name}_vs_fp32": diff(result, want) for name, result in got.items()})
    return found


def sweep(iters: int) -> dict[str, list]:
    """Forward time per forward setting, backward time (forward + backward less forward) per
    dK/dV setting and per dQ setting, at the training shape; the first of each list is the
    fastest."""
    from windowgpt_cli.kernels.window_attention import DEFAULT_TUNING

    q, k, v = inputs(TRAIN_BATCH, requires_grad=True)
    grad = torch.randn_like(q)
    fwd = []
    for m, n, warps, stages in FWD_SWEEP:
        tuning = dataclasses.replace(DEFAULT_TUNING, fwd_block_m=m, fwd_block_n=n, fwd_warps=warps, fwd_stages=stages)
        fn = kernels(tuning)["triton"]
        fwd.append({"setting": [m, n, warps, stages], "fwd_ms": cuda_ms(lambda: fn(q, k, v), iters)})
    default = kernels()["triton"]  # built once: building it inside the timed call would time the host
    base_fwd = cuda_ms(lambda: default(q, k, v), iters)
    found = {"fwd": sorted(fwd, key=lambda r: r["fwd_ms"])}
    for part, settings in (("bwd", DKDV_SWEEP), ("dq", DQ_SWEEP)):
        rows = []
        for own, loop, warps, stages in settings:
            tuning = dataclasses.replace(DEFAULT_TUNING, **{f"{part}_block_own": own, f"{part}_block_loop": loop,
                                                            f"{part}_warps": warps, f"{part}_stages": stages})
            step_ms = cuda_ms(forward_backward(kernels(tuning)["triton"], q, k, v, grad), iters)
            rows.append({"setting": [own, loop, warps, stages], "bwd_ms": step_ms - base_fwd})
        found[part] = sorted(rows, key=lambda r: r["bwd_ms"])
    return found


def show(results: dict) -> None:
    table = Table(title=f"attention on {results['device']}: T={SEQ_LEN}, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, "
                        f"window {WINDOW} + {SINKS} sinks (sdpa: full causal), bf16")
    for column in ("case", "kernel", "first call s", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s"):
        table.add_column(column, justify="left" if column in ("case", "kernel") else "right")
    for case, batch in (("eval", EVAL_BATCH), ("train", TRAIN_BATCH)):
        for name, r in results[case].items():
            step = (f"{r['fwd_bwd_ms']:.2f}", f"{r['fwd_bwd_tflops']:.0f}") if "fwd_bwd_ms" in r else ("-", "-")
            table.add_row(f"{case} B={batch}", name, f"{r['first_call_s']:.2f}", f"{r['fwd_ms']:.2f}",
                          f"{r['fwd_tflops']:.0f}", *step)
    console.print(table)
    for label, diffs in results["errors"].items():
        console.print(f"max abs diff {label:15s} " + "  ".join(f"{n} {d:.2e}" for n, d in diffs.items()))
    if "sweep" in results:
        for part, rows in results["sweep"].items():
            key = "fwd_ms" if part == "fwd" else "bwd_ms"
            console.print(f"sweep {part}: " + ", ".join(f"{r['setting']} {r[key]:.2f} ms" for r in rows))
            console.print(f"best {part} (block, block, warps, stages): {rows[0]['setting']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_speed.py needs a CUDA device", file=sys.stderr)
        return 1
    if not args.warm_caches:  # a fresh machine: nothing built yet
        cache = tempfile.mkdtemp(prefix="attention-speed-")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    impls = kernels()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "warm_caches": args.warm_caches, "iters": args.iters}
    results["eval"] = time_eval(impls, args.iters)  # first: the eager evaluation's first batch
    results["train"] = time_train(impls, args.iters)
    results["errors"] = errors(impls)
    if args.sweep:
        results["sweep"] = sweep(max(3, args.iters // 2))
    show(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
