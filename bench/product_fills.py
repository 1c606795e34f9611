"""The fills (4-byte memsets) cuBLAS launches beside the training step's matrix products.

In the record step's trace one 4-byte fill comes before each of cuBLAS's 256 x 128 products
(`bench/results/train_variants_h200/idle/`), each with a gap of a microsecond or two on
either side; products of the same shapes called alone have none. This calls each product of
one pass of the record model (forward and backward, one layer's shapes) in the ways the step
can reach cuBLAS, and counts per call the GPU's kernels and fills and times the call:

    mm        a @ b, operands as the step lays them out
    mm_out    torch.mm(a, b, out=buffer), as Inductor calls its extern products
    linear    F.linear(x, float32 weight) under bfloat16 autocast, as eager training does
    compiled  the product and an addition after it under torch.compile (Inductor's own call)
    stepwise  mm again, after the step's packages' products ran once (quack's GEMM, FA4), in
              case their set-up changes cuBLAS's choice

    python3 bench/product_fills.py [--positions 196608] [--repeats 20] [--json PATH]

Needs a CUDA GPU. A way whose set-up fails (quack or FA4 missing) reports its error line.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attention_speed import cuda_ms  # noqa: E402
from bench.one_pass import check_pass_args, error_line, pass_parser, report  # noqa: E402
from windowgpt_cli.config import ModelConfig  # noqa: E402

CFG = ModelConfig()
WAYS = ("mm", "mm_out", "linear", "compiled", "stepwise")
FILL = "Memset"


def products(positions: int, device: str = "cuda") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) of each product of one layer at one pass, b as the step lays it out (a
    weight's transpose is a view)."""
    dim, kv, mlp = CFG.model_dim, CFG.kv_dim, CFG.mlp_dim
    qkv = dim + 2 * kv

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    x, h, g = randn(positions, dim), randn(positions, mlp), randn(positions, dim)
    return {"qkv": (x, randn(qkv, dim).t()), "out": (x, randn(dim, dim).t()), "down": (h, randn(dim, mlp).t()),
            "down_dx": (g, randn(dim, mlp)), "up_dw": (h.t(), x)}


def counted(call: Callable[[], object], repeats: int) -> dict[str, float]:
    """Kernels and fills per call, from the profiler over `repeats` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            call()
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    fills = sum(n for name, n in names.items() if FILL in name)
    return {"kernels_per_call": round((sum(names.values()) - fills) / repeats, 2),
            "fills_per_call": round(fills / repeats, 2)}


def way_call(way: str, a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    if way in ("mm", "stepwise"):
        return lambda: a @ b
    if way == "mm_out":
        out = torch.empty(a.size(0), b.size(1), device=a.device, dtype=a.dtype)
        return lambda: torch.mm(a, b, out=out)
    if way == "linear":
        weight = b.t().float()
        if a.is_contiguous():
            return lambda: _autocast_linear(a, weight)
        return lambda: a @ b  # a weight gradient's product: no linear layer calls it
    c = torch.randn(a.size(0), b.size(1), device=a.device, dtype=a.dtype)
    run = torch.compile(lambda a, b, c: a @ b + c, dynamic=False)
    return lambda: run(a, b, c)


def _autocast_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return F.linear(x, weight)


def run_the_step_packages(device: str = "cuda") -> None:
    """One product of quack's and one attention of FA4's, as the step runs them."""
    from windowgpt_cli.kernels.flash4 import FULL, fa4_attention
    from windowgpt_cli.kernels.quack_products import leaky_square_up

    x = torch.randn(4096, CFG.model_dim, device=device, dtype=torch.bfloat16)
    leaky_square_up(x, torch.randn(CFG.mlp_dim, CFG.model_dim, device=device, dtype=torch.bfloat16), 0.5)
    q = torch.randn(2, 2048, CFG.num_heads, CFG.head_dim, device=device, dtype=torch.bfloat16)
    fa4_attention(q, q, q, FULL)
    torch.cuda.synchronize()


def main() -> None:
    p = pass_parser(__doc__.split("\n\n")[0])
    args = p.parse_args()
    check_pass_args(args, "product_fills.py")
    shapes = products(args.positions)
    result: dict = {"positions": args.positions, "gpu": torch.cuda.get_device_name(), "ways": {}}
    for way in WAYS:
        rows = {}
        try:
            if way == "stepwise":
                run_the_step_packages()
            for name, (a, b) in shapes.items():
                call = way_call(way, a, b)
                ms = cuda_ms(call, args.repeats)
                rows[name] = {"ms": round(ms, 4), **counted(call, args.repeats)}
        except Exception as error:  # a way that cannot run here is reported beside the others
            rows = {"error": error_line(error)}
        result["ways"][way] = rows
    report(result, args.json)


if __name__ == "__main__":
    main()
