"""Whether the MLP's products in float8 would pay with the activation and its rounding inside
their epilogues, before such kernels join the package: two Triton products, timed on one
training pass's shape against what the step runs now.

- up: x's float8 codes (a scale per row) times the up weight's (a scale per row), whose
  epilogue writes the product in bfloat16 (kept for the backward), LeakyReLU(0.5)² of it as
  float8 codes with a power-of-two scale per row and group of 128 columns (one tile's
  width, so no row is read twice), and those scales; against quack's bfloat16 product with
  LeakyReLU² in its epilogue (the step's `fused_mlp quack`) and cuBLAS's float8 product with
  rowwise scales, whose activation would still be a pass of its own.
- down: those codes times the down weight's, each step of 128 along the reduction taking its
  group's scales; against cuBLAS's bfloat16 product and cuBLAS's float8 one (rowwise).

    python3 bench/fp8_group_products.py [--rows 196608] [--dim 512] [--hidden 1536]
                                        [--repeats 20] [--json PATH]

rows: one pass of the record step (two micro-batches of 48 x 2,048); hidden 1,536 is the
record model's MLP, 2,048 the frontier preset's. Each way's milliseconds (the median of
`repeats`) and TFLOP/s, and the kernels' largest differences from torch's steps on the same
codes (relative to the largest magnitude). The backward's products (the activation's
derivative in the down product's epilogue, the weight gradients with scales per group of
128 tokens) are not built here: the forward decides whether they are worth building.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from windowgpt_cli.kernels.elementwise import leaky_square_values  # noqa: E402
from windowgpt_cli.kernels.fp8_mlp import fp8_row_codes  # noqa: E402
from windowgpt_cli.kernels.fp8_products import FP8, scaled_product, to_fp8_rows  # noqa: E402

SLOPE = 0.5
GROUP = 128  # columns of the activation sharing a scale: the up product's tile width


@triton.jit
def _up_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, pre_ptr, codes_ptr, scales_ptr, rows, cols, inner,
               negative_slope, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.program_id(1) * GROUP_N + tl.arange(0, GROUP_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, GROUP_N), tl.float32)
    for start in range(0, inner, BLOCK_K):
        a = tl.load(x_ptr + row[:, None].to(tl.int64) * inner + (start + k)[None, :], mask=row[:, None] < rows)
        b = tl.load(w_ptr + col[:, None].to(tl.int64) * inner + (start + k)[None, :], mask=col[:, None] < cols)
        acc = tl.dot(a, tl.trans(b), acc)
    pre = acc * tl.load(x_scale_ptr + row, mask=row < rows)[:, None] * tl.load(w_scale_ptr + col)[None, :]
    pre = pre.to(tl.bfloat16)
    offsets = row[:, None].to(tl.int64) * cols + col[None, :]
    mask = row[:, None] < rows
    tl.store(pre_ptr + offsets, pre, mask=mask)
    codes, scale = fp8_row_codes(leaky_square_values(pre.to(tl.float32), negative_slope))  # the tile's rows: groups
    tl.store(codes_ptr + offsets, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    groups = cols // GROUP_N
    tl.store(scales_ptr + row[:, None] * groups + tl.program_id(1), scale, mask=mask)


@triton.jit
def _down_kernel(h_ptr, h_scales_ptr, w_ptr, w_scale_ptr, out_ptr, rows, cols, inner,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, GROUP_K)
    groups = inner // GROUP_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for group in range(0, groups):
        a = tl.load(h_ptr + row[:, None].to(tl.int64) * inner + (group * GROUP_K + k)[None, :],
                    mask=row[:, None] < rows)
        b = tl.load(w_ptr + col[:, None].to(tl.int64) * inner + (group * GROUP_K + k)[None, :],
                    mask=col[:, None] < cols)
        scale = tl.load(h_scales_ptr + row * groups + group, mask=row < rows)
        acc += tl.dot(a, tl.trans(b)) * scale[:, None]
    out = acc * tl.load(w_scale_ptr + col, mask=col < cols)[None, :]
    tl.store(out_ptr + row[:, None].to(tl.int64) * cols + col[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(row[:, None] < rows) & (col[None, :] < cols))


def up_product(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
               block_m: int = 128, block_k: int = 64, warps: int = 8, stages: int = 3):
    """(product [R, H] bfloat16, activation codes [R, H] float8, their scales [R, H / 128])
    of x8 [R, D] (scales [R, 1]) and w8 [H, D] (scales [H, 1])."""
    rows, inner = x8.shape
    cols = w8.shape[0]
    assert cols % GROUP == 0 and inner % block_k == 0, (cols, inner)
    pre = torch.empty(rows, cols, device=x8.device, dtype=torch.bfloat16)
    codes = torch.empty(rows, cols, device=x8.device, dtype=FP8)
    scales = torch.empty(rows, cols // GROUP, device=x8.device, dtype=torch.float32)
    grid = (triton.cdiv(rows, block_m), cols // GROUP)
    _up_kernel[grid](x8, x_scale, w8, w_scale, pre, codes, scales, rows, cols, inner, SLOPE,
                     BLOCK_M=block_m, GROUP_N=GROUP, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return pre, codes, scales


def down_product(h8: torch.Tensor, h_scales: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                 block_m: int = 128, block_n: int = 128, warps: int = 8, stages: int = 3) -> torch.Tensor:
    """h8 [R, H] with a scale per row and group of 128 [R, H / 128] times w8 [D, H] (scales
    [D, 1]): [R, D] in bfloat16."""
    rows, inner = h8.shape
    cols = w8.shape[0]
    assert inner % GROUP == 0 and h_scales.shape == (rows, inner // GROUP), h_scales.shape
    out = torch.empty(rows, cols, device=h8.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _down_kernel[grid](h8, h_scales, w8, w_scale, out, rows, cols, inner, BLOCK_M=block_m, BLOCK_N=block_n,
                       GROUP_K=GROUP, num_warps=warps, num_stages=stages)
    return out


def up_reference(x8, x_scale, w8, w_scale):
    """The up kernel's three outputs by torch's steps on the same codes."""
    pre = ((x8.float() @ w8.float().t()) * x_scale * w_scale.reshape(1, -1)).to(torch.bfloat16)
    return pre, *group_codes(pre)


def group_codes(pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LeakyReLU² of pre [R, H] as float8 codes with a scale per row and group of 128 columns."""
    act = F.leaky_relu(pre.float(), SLOPE).square()
    grouped = act.reshape(act.shape[0], -1, GROUP)
    codes, scales = to_fp8_rows(grouped.reshape(-1, GROUP))
    return codes.reshape(act.shape), scales.reshape(grouped.shape[:2])


def down_reference(h8, h_scales, w8, w_scale):
    h = (h8.float().reshape(h8.shape[0], -1, GROUP) * h_scales[..., None]).reshape(h8.shape)
    return ((h @ w8.float().t()) * w_scale.reshape(1, -1)).to(torch.bfloat16)


def main() -> None:
    from bench.fused_products import milliseconds
    from bench.one_pass import error_line, relative_difference, report
    from windowgpt_cli.kernels.quack_products import leaky_square_up, quack_targets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=196_608)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_group_products.py needs a CUDA GPU with float8 products (Hopper or later)")
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.rows, args.dim, device=device, dtype=torch.bfloat16, generator=generator)
    up_w = torch.randn(args.hidden, args.dim, device=device, dtype=torch.bfloat16, generator=generator) * 0.04
    down_w = torch.randn(args.dim, args.hidden, device=device, dtype=torch.bfloat16, generator=generator) * 0.02
    (x8, x_scale), (up8, up_scale), (down8, down_scale) = map(to_fp8_rows, (x, up_w, down_w))
    pre = x @ up_w.t()
    codes, scales = group_codes(pre)  # the down product's operand, should the up kernel fail
    result = {"gpu": torch.cuda.get_device_name(), "rows": args.rows, "dim": args.dim, "hidden": args.hidden}
    try:
        pre, codes, scales = up_product(x8, x_scale, up8, up_scale)
        want_pre, want_codes, want_scales = up_reference(x8, x_scale, up8, up_scale)
        result["differences"] = {
            "product": relative_difference(pre, want_pre),
            "activation": relative_difference(codes.float() * scales.repeat_interleave(GROUP, 1),
                                              want_codes.float() * want_scales.repeat_interleave(GROUP, 1)),
            "down": relative_difference(down_product(codes, scales, down8, down_scale),
                                        down_reference(codes, scales, down8, down_scale))}
    except Exception as error:  # the timings below still run, each reported apart
        result["differences"] = {"error": error_line(error)}
    rows8 = to_fp8_rows(F.leaky_relu(pre.float(), SLOPE).square())  # the activation by whole rows, for cuBLAS
    up_flops = down_flops = 2 * args.rows * args.dim * args.hidden
    ways = {
        "up_fp8_epilogue": (lambda: up_product(x8, x_scale, up8, up_scale), up_flops),
        "up_cublas_fp8_rowwise": (lambda: scaled_product(x8, x_scale, up8, up_scale, torch.bfloat16), up_flops),
        "up_cublas_bf16": (lambda: x @ up_w.t(), up_flops),
        "down_fp8_groups": (lambda: down_product(codes, scales, down8, down_scale), down_flops),
        "down_cublas_fp8_rowwise": (lambda: scaled_product(*rows8, down8, down_scale, torch.bfloat16), down_flops),
        "down_cublas_bf16": (lambda: pre @ down_w.t(), down_flops),
    }
    if quack_targets(device):
        ways["up_quack_bf16_epilogue"] = (lambda: leaky_square_up(x, up_w, SLOPE), up_flops)
    result["ways"] = {}
    for name, (call, flops) in ways.items():
        try:
            ms = milliseconds(call, args.repeats)
            result["ways"][name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as error:  # a way that cannot build or run here: reported, the others timed
            result["ways"][name] = {"error": error_line(error)}
    report(result, args.json)


if __name__ == "__main__":
    main()
