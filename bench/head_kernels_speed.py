"""How fast the training step's per-head kernels move their bytes (`train --fused-head-prep`,
`--fused-xsa`): the queries' and keys' norm, rotation and gain forward and backward for each
launch shape given, XSA with the output gate forward and backward, beside a plain copy of
the queries (the memory speed an element-wise kernel can reach) and the compiler's kernels
for the same head steps.

    python bench/head_kernels_speed.py [--positions 196608] [--launches 32x4,64x4,...]
                                       [--repeats 20] [--json PATH]

positions: one forward pass of the record step (two micro-batches of 48 x 2,048 on one
H200), 8 query heads over 4 key heads of 64, 16 rotated channels. A launch PxW is
`elementwise.HeadLaunch(positions=P, warps=W)`; PxWs the same with the forward's rotated
channels computed apart (`rotated_apart`). For each: milliseconds (the median of
`repeats`) and GB/s forward and backward, queries and keys together, and whether its outputs
equal the default launch's. Prints the JSON object; --json writes it to a file.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fused_products import milliseconds  # noqa: E402
from bench.one_pass import SEQ_LEN, check_pass_args, pass_parser, report  # noqa: E402
from windowgpt_cli.kernels.attention_output import fused_attention_output  # noqa: E402
from windowgpt_cli.kernels.elementwise import HEAD_LAUNCH, HeadLaunch, head_prep, head_tables  # noqa: E402
from windowgpt_cli.kernels.elementwise_backward import head_prep_backward  # noqa: E402
from windowgpt_cli.model.ops import TORCH_OPS  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, ROPE_DIMS = 8, 4, 64, 16
DEFAULT_LAUNCHES = "16x4,32x4,32x8,64x4,8x4,16x4s,32x4s,32x8s,64x8s"


def parse_launches(text: str) -> list[HeadLaunch]:
    launches = []
    for item in text.split(","):
        apart = item.endswith("s")
        positions, _, warps = item.removesuffix("s").partition("x")
        if not (positions.isdigit() and warps.isdigit() and int(positions) > 0 and int(positions) & (int(positions) - 1)
                == 0 and int(warps) in (1, 2, 4, 8, 16)):
            raise SystemExit(f"--launches: {item!r} is not POSITIONSxWARPS[s] (e.g. 32x4, 16x4s; each a power of two, "
                             f"warps up to 16)")
        launches.append(HeadLaunch(int(positions), int(warps), apart))
    return launches


def timed(name: str, fn, moved_bytes: int, repeats: int) -> dict:
    ms = milliseconds(fn, repeats)
    return {f"{name}_ms": round(ms, 4), f"{name}_gb_per_s": round(moved_bytes / ms / 1e6, 1)}


def heads_inputs(positions: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(positions)
    batch = positions // SEQ_LEN

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g).bfloat16()

    angles = torch.rand(1, SEQ_LEN, 1, ROPE_DIMS // 2, device="cuda", generator=g) * 6.28
    return {"q": randn(batch, SEQ_LEN, HEADS, HEAD_DIM), "k": randn(batch, SEQ_LEN, KV_HEADS, HEAD_DIM),
            "gain": torch.full((HEADS,), 1.5, device="cuda"), "cos": angles.cos(), "sin": angles.sin(),
            "v": randn(batch, SEQ_LEN, KV_HEADS, HEAD_DIM), "gate": randn(batch, SEQ_LEN, HEADS).sigmoid()}


def launch_figures(x: dict, launch: HeadLaunch, repeats: int, want: list[torch.Tensor]) -> dict:
    """One launch shape: the queries (with their gain) and the keys, forward and backward."""
    q_tables, k_tables = head_tables(x["q"], x["cos"], x["sin"], ROPE_DIMS), head_tables(x["k"], x["cos"], x["sin"],
                                                                                          ROPE_DIMS)

    def forward():
        return head_prep(x["q"], *q_tables, x["gain"], x["q"].dtype, launch), head_prep(x["k"], *k_tables, None,
                                                                                       x["k"].dtype, launch)

    def backward():
        return (*head_prep_backward(x["q"], x["q"], *q_tables, x["gain"], launch),
                head_prep_backward(x["k"], x["k"], *k_tables, None, launch)[0])

    plane = (x["q"].numel() + x["k"].numel()) * 2  # bytes of the queries and keys, bf16
    figures = {"launch": launch.name, "positions": launch.positions, "warps": launch.warps,
               "rotated_apart": launch.rotated_apart}
    figures |= timed("forward", forward, 2 * plane, repeats)  # read, write
    figures |= timed("backward", backward, 3 * plane, repeats)  # read the gradient and the input, write
    figures["outputs_equal_default"] = all(torch.equal(a, b) for a, b in zip((*forward(), *backward()), want))
    return figures


def measure(positions: int, launches: list[HeadLaunch], repeats: int) -> dict:
    x = heads_inputs(positions)
    plane = (x["q"].numel() + x["k"].numel()) * 2
    result: dict = {"positions": positions, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    result |= timed("copy", lambda: (x["q"].clone(), x["k"].clone()), 2 * plane, repeats)
    compiled = torch.compile(lambda q, k, cos, sin, gain: (TORCH_OPS.head_prep(q, cos, sin, ROPE_DIMS, gain),
                                                          TORCH_OPS.head_prep(k, cos, sin, ROPE_DIMS, None)),
                             dynamic=False)
    result |= timed("compiled_forward", lambda: compiled(x["q"], x["k"], x["cos"], x["sin"], x["gain"]), 2 * plane,
                    repeats)
    q_tables, k_tables = head_tables(x["q"], x["cos"], x["sin"], ROPE_DIMS), head_tables(x["k"], x["cos"], x["sin"],
                                                                                          ROPE_DIMS)
    want = [head_prep(x["q"], *q_tables, x["gain"], x["q"].dtype), head_prep(x["k"], *k_tables, None, x["k"].dtype),
            *head_prep_backward(x["q"], x["q"], *q_tables, x["gain"]),
            head_prep_backward(x["k"], x["k"], *k_tables, None)[0]]
    result["launches"] = [launch_figures(x, launch, repeats, want) for launch in launches]
    best = min(result["launches"], key=lambda f: f["forward_ms"] + f["backward_ms"])
    result["best"] = best["launch"]
    result["default"] = HEAD_LAUNCH.name
    result["xsa"] = xsa_figures(x, repeats)
    return result


def xsa_figures(x: dict, repeats: int) -> dict:
    """XSA with the gate (`--fused-xsa`) over the queries as heads: forward reads the heads,
    values and gates and writes the output; backward reads the gradient, heads and values and
    writes the heads' and values' gradients."""
    y, v, gate = (x[name].clone().requires_grad_() for name in ("q", "v", "gate"))
    out = fused_attention_output(y, v, gate)
    grad = torch.randn_like(out)
    heads_bytes, values_bytes = y.numel() * 2, v.numel() * 2
    figures = timed("forward", lambda: fused_attention_output(y, v, gate), 2 * heads_bytes + values_bytes, repeats)
    figures |= timed("backward", lambda: torch.autograd.grad(out, (y, v, gate), grad, retain_graph=True),
                     3 * heads_bytes + 2 * values_bytes, repeats)
    return figures


def main() -> None:
    p = pass_parser(__doc__.split("\n\n")[0])
    p.add_argument("--launches", default=DEFAULT_LAUNCHES, help="POSITIONSxWARPS[s] shapes, comma-separated")
    args = p.parse_args()
    check_pass_args(args, "head_kernels_speed.py")
    result = measure(args.positions, parse_launches(args.launches), args.repeats)
    result["gpu"] = torch.cuda.get_device_name()
    report(result, args.json)


if __name__ == "__main__":
    main()
