"""The queries' and keys' per-head norm, rotation and gain in the epilogue of the stacked
q, k, v product (quack's GEMM under an epilogue of this script's), against the way the
training step makes them now: cuBLAS's product, then the heads' Triton kernel over the
queries and over the keys, each reading its slice and writing it again.

The epilogue turns pairs of adjacent columns (x1, x2) into (x1 cos - x2 sin, x1 sin +
x2 cos); the model pairs channel c of a head with c + rope_dims / 2 and turns the other way.
So the queries' and keys' matrix rows are permuted within each head, each pair's second
channel first (`interleaved_rows`): the scores of attention are the same under one
permutation of both, and the epilogue's turn of (x2, x1) is the model's of (x1, x2). The
values' columns pass unturned (frequency 0) and unnormed (`column_scales`). The epilogue's
queries and keys, brought back to the model's order, are checked against the kernels'.

    python bench/qkv_epilogue_speed.py [--positions 196608] [--repeats 20] [--tuned] [--json PATH]

Needs a Hopper or Blackwell GPU with quack-kernels. Forward only: a training step with the
epilogue would also need the heads' backward from their stored outputs; this times what its
forward would save, one layer at one pass of the record step.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attention_speed import cuda_ms  # noqa: E402
from bench.one_pass import SEQ_LEN, check_pass_args, error_line, pass_parser, relative_difference, report  # noqa: E402
from windowgpt_cli.config import ModelConfig  # noqa: E402
from windowgpt_cli.model.rotary import rotary_inv_freq, rotary_tables  # noqa: E402

CFG = ModelConfig()
HEAD_DIM, HEADS, KV_HEADS = CFG.head_dim, CFG.num_heads, CFG.num_kv_heads
ROPE_HALF = (CFG.rope_dims if 0 < CFG.rope_dims < CFG.head_dim else CFG.head_dim) // 2
EPS = torch.finfo(torch.float32).eps  # the heads' kernels' (`kernels.elementwise.FLOAT32_EPS`)


def interleaved_rows(heads: int, head_dim: int, rope_half: int) -> torch.Tensor:
    """The order of a projection's rows that puts each head's rotated pairs (c, c + rope_half)
    side by side, second channel first: per head h, 0, h + 1, 1, ..., 2h - 1, h - 1, then
    2h .. head_dim - 1 (h = rope_half)."""
    pairs = torch.stack((torch.arange(rope_half) + rope_half, torch.arange(rope_half)), 1).flatten()
    head = torch.cat((pairs, torch.arange(2 * rope_half, head_dim)))
    return (torch.arange(heads)[:, None] * head_dim + head).flatten()


def column_scales(gain: torch.Tensor, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) per column of the stacked product (queries, keys, values): the epilogue scales
    a column by rstd * a + b, its head's rstd from the per-head norm. Queries: (gain, 0);
    keys: (1, 0); values: (0, 1), unnormed."""
    ones = torch.ones(kv_heads * head_dim)
    a = torch.cat((gain.float().repeat_interleave(head_dim), ones, torch.zeros_like(ones)))
    b = torch.cat((torch.zeros(gain.numel() * head_dim), torch.zeros_like(ones), ones))
    return a, b


def pair_frequencies(inv_freq: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The angle per position of each pair of adjacent columns of the permuted product:
    inv_freq[j] for a query's or key's pair j < len(inv_freq), 0 for the rest and for the
    values (what quack's `make_interleaved_inv_freq` packs for the kernel)."""
    head = F.pad(inv_freq.double(), (0, head_dim // 2 - inv_freq.numel()))
    return F.pad(head.repeat(heads + kv_heads), (0, kv_heads * head_dim // 2))


def epilogue_reference(pre: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, head_dim: int, eps: float = EPS) -> torch.Tensor:
    """What the epilogue computes, in float32: pre [M, N] (the permuted product) scaled per
    column by rstd * a + b, then each pair of adjacent columns (x1, x2) turned by the angle
    position * frequency: (x1 cos - x2 sin, x1 sin + x2 cos)."""
    pre = pre.float()
    heads = pre.unflatten(-1, (-1, head_dim))
    rstd = torch.rsqrt(heads.square().mean(-1, keepdim=True) + eps).expand_as(heads).flatten(-2)
    x = pre * (rstd * a + b)
    angle = (positions.double()[:, None] * frequencies).float()
    x1, x2 = x[:, 0::2], x[:, 1::2]
    return torch.stack((x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), -1).flatten(-2)


@functools.cache
def epilogue():
    """quack's GEMM under the epilogue: per-head rstd from a prepass over the accumulator, the
    column scales, then the rotation from per-row positions and per-column frequencies."""
    from quack.epilogue.frontend import gemm_epilogue, pack, unpack
    from quack.epilogue.head_rmsnorm import HeadRstd
    from quack.epilogue.ops import ColVecLoad, RowVecLoad
    from quack.epilogue.rotary import _angle_turns, _sincos_turns

    def squares(acc):
        return {"qk": acc * acc}

    @gemm_epilogue(ops={"pos": ColVecLoad("pos"), "freq": RowVecLoad("freq"), "qk": HeadRstd("qk", eps=EPS),
                        "a": RowVecLoad("a"), "b": RowVecLoad("b")},
                   prepass=squares, prepass_outs=("qk",), mode="acc_pair")
    def windowgpt_qkv_heads(acc, pos, freq, qk, a, b):
        x1, x2 = unpack(acc * (qk * a + b))
        s, c = _sincos_turns(*_angle_turns(pos, freq))
        return {"D": pack(x1 * c - x2 * s, x1 * s + x2 * c)}

    return windowgpt_qkv_heads


def model_order(d: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The epilogue's output [M, N] with the queries' and keys' columns back in the model's order."""
    out = d.clone()
    out[:, rows] = d[:, :rows.numel()]
    return out


def main() -> None:
    parser = pass_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--tuned", action="store_true", help="let quack tune the product's configuration first "
                        "(a compile per candidate) instead of taking its default for this GPU")
    args = parser.parse_args()
    check_pass_args(args, "qkv_epilogue_speed.py")
    from windowgpt_cli.kernels.elementwise import head_prep, head_tables

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(args.positions)
    dim, width = CFG.model_dim, (HEADS + 2 * KV_HEADS) * HEAD_DIM
    x = torch.randn(args.positions, dim, device=device, generator=g).bfloat16()
    weight = (torch.randn(width, dim, device=device, generator=g) * dim ** -0.5).bfloat16()
    gain = 1.5 + 0.1 * torch.randn(HEADS, device=device, generator=g)
    inv_freq = rotary_inv_freq(CFG.rope_dims, CFG.rope_base, SEQ_LEN, SEQ_LEN).to(device)
    cos, sin = rotary_tables(SEQ_LEN, inv_freq)
    batch = args.positions // SEQ_LEN

    def now():  # the training step's way
        qkv = F.linear(x, weight).view(batch, SEQ_LEN, -1)
        q, k = qkv[..., :HEADS * HEAD_DIM], qkv[..., HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM]
        q, k = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k))
        return (head_prep(q, *head_tables(q, cos, sin, CFG.rope_dims), gain, q.dtype),
                head_prep(k, *head_tables(k, cos, sin, CFG.rope_dims), None, k.dtype), qkv)

    rows = interleaved_rows(HEADS + KV_HEADS, HEAD_DIM, ROPE_HALF).to(device)
    permuted = torch.cat((weight[rows], weight[rows.numel():]))
    a, b = (t.to(device) for t in column_scales(gain.cpu(), KV_HEADS, HEAD_DIM))
    positions = torch.arange(args.positions, device=device) % SEQ_LEN
    result = {"positions": args.positions, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "rope_dims": CFG.rope_dims, "tuned": args.tuned,
              "now_ms": {"product": cuda_ms(lambda: F.linear(x, weight), args.repeats),
                         "product_and_heads": cuda_ms(now, args.repeats)}}
    try:
        from quack.epilogue.rotary import make_interleaved_inv_freq

        freq = make_interleaved_inv_freq(inv_freq.double(), (HEADS + KV_HEADS) * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                         HEAD_DIM).to(device)
        pos, a, b = positions.float(), a.float(), b.float()

        def fused():
            return epilogue()(x, permuted.t(), pos=pos, freq=freq, qk=HEAD_DIM, a=a, b=b, tuned=args.tuned)["D"]

        d = model_order(fused(), rows).view(batch, SEQ_LEN, -1)
        q, k, qkv = now()
        result["epilogue_ms"] = cuda_ms(fused, args.repeats)
        result["difference"] = {"queries": relative_difference(d[..., :HEADS * HEAD_DIM], q.flatten(-2)),
                                "keys": relative_difference(d[..., HEADS * HEAD_DIM:-KV_HEADS * HEAD_DIM],
                                                            k.flatten(-2)),
                                "values": relative_difference(d[..., -KV_HEADS * HEAD_DIM:],
                                                              qkv[..., -KV_HEADS * HEAD_DIM:])}
        result["saved_ms_per_layer_pass"] = result["now_ms"]["product_and_heads"] - result["epilogue_ms"]
    except Exception as error:  # quack cannot build or run it here: said beside the figures
        result["epilogue_error"] = error_line(error)
    report(result, args.json)


if __name__ == "__main__":
    main()
