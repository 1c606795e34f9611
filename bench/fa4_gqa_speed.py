"""What FA4's backward pays for grouped keys and values: with fewer key heads than query heads
its sm90 backward sums dK and dV over each group in float32 buffers (zeroed first, converted
after), where with one key head a query head it writes them directly. This times one layer's
attention, forward and backward, three ways for each kind of layer:

    grouped   k, v of 4 heads, as the model makes them
    expanded  k, v repeated to 8 heads inside the timed call (the copy forward, the pairs'
              sum backward, as eager torch does them)
    repeated  k, v already of 8 heads: the bound for an expansion fused into the kernels
              that make k and v

    python bench/fa4_gqa_speed.py [--positions 196608] [--repeats 20] [--json PATH]

Needs a CUDA GPU and flash-attn-4. Prints the JSON object; --json writes it to a file.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fused_products import milliseconds  # noqa: E402
from bench.one_pass import check_pass_args, pass_parser, pass_randn, report  # noqa: E402
from windowgpt_cli.kernels.flash4 import FULL, fa4_attention, fa4_window_sinks  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, WINDOW, SINKS = 8, 4, 64, 512, 4


def attend(kind: str, q, k, v):
    if kind == "full":
        return fa4_attention(q, k, v, FULL)[0]
    return fa4_window_sinks(q, k, v, WINDOW, SINKS)[0]


def layer_figures(kind: str, positions: int, repeats: int) -> dict:
    randn = pass_randn(positions)

    def leaf(heads: int) -> torch.Tensor:
        return randn(heads, HEAD_DIM).requires_grad_()

    q, k, v = leaf(HEADS), leaf(KV_HEADS), leaf(KV_HEADS)
    k8, v8 = (t.detach().repeat_interleave(HEADS // KV_HEADS, 2).requires_grad_() for t in (k, v))
    grad = torch.randn_like(q)
    group = HEADS // KV_HEADS
    ways = {"grouped": lambda: attend(kind, q, k, v),
            "expanded": lambda: attend(kind, q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)),
            "repeated": lambda: attend(kind, q, k8, v8)}
    inputs = {"grouped": (q, k, v), "expanded": (q, k, v), "repeated": (q, k8, v8)}
    figures: dict = {}
    for name, forward in ways.items():
        def step(forward=forward, leaves=inputs[name]):
            return torch.autograd.grad(forward(), leaves, grad)

        figures[name] = {"forward_ms": round(milliseconds(forward, repeats), 4),
                         "forward_backward_ms": round(milliseconds(step, repeats), 4)}
    want = torch.autograd.grad(ways["grouped"](), (q, k, v), grad)
    got = torch.autograd.grad(ways["expanded"](), (q, k, v), grad)
    figures["expanded_max_grad_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got))
    return figures


def main() -> None:
    args = pass_parser(__doc__.split("\n\n")[0]).parse_args()
    check_pass_args(args, "fa4_gqa_speed.py")
    result = {"gpu": torch.cuda.get_device_name(), "positions": args.positions, "heads": HEADS,
              "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    for kind in ("full", "window"):
        result[kind] = layer_figures(kind, args.positions, args.repeats)
    report(result, args.json)


if __name__ == "__main__":
    main()
