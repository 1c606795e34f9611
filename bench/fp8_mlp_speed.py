"""How fast the float8 MLP's kernels move their bytes (`kernels.fp8_mlp`, `train --fp8-mlp`):
LeakyReLU² with its rows' rounding to float8, and its derivative with the same, against the
compiler's kernels for the same work and against the bfloat16 activation alone (the memory
speed an element-wise kernel reaches), for each cut of the rows given.

    python bench/fp8_mlp_speed.py [--rows 196608] [--cols 1536,2048] [--launches 8192x8,4096x4,...]
                                  [--repeats 20] [--json PATH]

rows: one forward pass of the record step (two micro-batches of 48 x 2,048 on one H200);
cols: the record model's MLP (3x of 512) and the frontier preset's (4x). A launch ExW is
`RowLaunch(elements=E, warps=W)`. For each width: milliseconds (the median of `repeats`) and
GB/s of every way, the compiled ways' kernels as torch.compile builds them by default, and
whether each launch's codes and scales equal the compiled ones. Prints one JSON object per
width; --json writes them all to one file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fused_products import milliseconds  # noqa: E402
from windowgpt_cli.kernels.fp8_mlp import RowLaunch, leaky_square_fp8_backward_rows, leaky_square_fp8_rows  # noqa: E402
from windowgpt_cli.kernels.fp8_products import to_fp8_rows  # noqa: E402

SLOPE = 0.5
# 8192x8: the kernels' default; 2048x1: a row a warp, whose maximum needs no shared memory
# and no barrier (sm_90's code for the others passes each row's through shared memory)
DEFAULT_LAUNCHES = "8192x8,2048x1,2048x2,2048x4,2048x8,4096x4,4096x8,8192x16"


def activation(h: torch.Tensor) -> torch.Tensor:
    return F.leaky_relu(h, SLOPE).square()


def rounded_activation(h: torch.Tensor):
    a = activation(h)
    return a, *to_fp8_rows(a)


def rounded_derivative(grad: torch.Tensor, h: torch.Tensor):
    slope = torch.where(h > 0, 1.0, SLOPE)
    dh = (grad.float() * 2.0 * h.float() * slope * slope).to(h.dtype)
    return dh, *to_fp8_rows(dh)


def parse_launches(text: str) -> list[RowLaunch]:
    launches = []
    for item in text.split(","):
        elements, _, warps = item.partition("x")
        if not (elements.isdigit() and warps.isdigit() and int(elements) > 0 and int(warps) in (1, 2, 4, 8, 16, 32)):
            raise SystemExit(f"--launches: {item!r} is not ELEMENTSxWARPS (e.g. 8192x8; warps a power of two up to 32)")
        launches.append(RowLaunch(int(elements), int(warps)))
    return launches


def timed(name: str, fn, moved_bytes: int, repeats: int) -> dict:
    ms = milliseconds(fn, repeats)
    return {f"{name}_ms": round(ms, 4), f"{name}_gb_per_s": round(moved_bytes / ms / 1e6, 1)}


def measure(rows: int, cols: int, launches: list[RowLaunch], repeats: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(cols)
    h = torch.randn(rows, cols, device="cuda", generator=g).bfloat16()
    grad = (torch.randn(rows, cols, device="cuda", generator=g) / 64).bfloat16()
    plane = rows * cols  # elements of one tensor: bf16 two bytes each, float8 codes one
    forward_bytes, backward_bytes = plane * (2 + 2 + 1), plane * (2 + 2 + 2 + 1)
    result: dict = {"rows": rows, "cols": cols, "forward_bytes": forward_bytes, "backward_bytes": backward_bytes}
    plain = torch.compile(activation, dynamic=False)
    compiled_forward = torch.compile(rounded_activation, dynamic=False)
    compiled_backward = torch.compile(rounded_derivative, dynamic=False)
    result |= timed("bf16_activation", lambda: plain(h), plane * 4, repeats)
    result |= timed("compiled_forward", lambda: compiled_forward(h), forward_bytes, repeats)
    result |= timed("compiled_backward", lambda: compiled_backward(grad, h), backward_bytes, repeats)
    want_forward, want_backward = compiled_forward(h), compiled_backward(grad, h)
    result["launches"] = []
    for launch in launches:
        figures = {"elements": launch.elements, "warps": launch.warps}
        figures |= timed("forward", lambda: leaky_square_fp8_rows(h, SLOPE, launch), forward_bytes, repeats)
        figures |= timed("backward", lambda: leaky_square_fp8_backward_rows(grad, h, SLOPE, launch), backward_bytes,
                         repeats)
        got_forward, got_backward = leaky_square_fp8_rows(h, SLOPE, launch), leaky_square_fp8_backward_rows(
            grad, h, SLOPE, launch)
        figures["forward_codes_equal"] = all(torch.equal(a.float(), b.float())
                                             for a, b in zip(got_forward[1:], want_forward[1:]))
        # the derivative rounds once in float32 here and as the compiler orders it there
        figures["backward_codes_share"] = round(float((got_backward[1].float() == want_backward[1].float())
                                                      .float().mean()), 6)
        result["launches"].append(figures)
    best = min(result["launches"], key=lambda f: f["forward_ms"] + f["backward_ms"])
    result["best"] = f"{best['elements']}x{best['warps']}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=196_608)
    parser.add_argument("--cols", default="1536,2048")
    parser.add_argument("--launches", default=DEFAULT_LAUNCHES, help="comma-separated ELEMENTSxWARPS")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    launches = parse_launches(args.launches)
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_mlp_speed.py needs a CUDA GPU")
    results = []
    for cols in (int(c) for c in args.cols.split(",")):
        results.append({"gpu": torch.cuda.get_device_name(0), **measure(args.rows, cols, launches, args.repeats)})
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
