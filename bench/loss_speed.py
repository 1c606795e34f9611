"""Whether the fused soft-capped cross-entropy pays (`train --fused-cross-entropy`): the loss
and its gradient for one pass of a training step's logits, through `kernels.cross_entropy`
against the soft cap and cross-entropy as torch.compile fuses them. With --chunk-rows, the
output layer's product too, and `train --loss-chunk-rows` (the product and the loss over
chunks of rows in one op) beside them.

    python bench/loss_speed.py [--rows 196608] [--vocab 1024,8192] [--repeats 20] [--json PATH]
                               [--chunk-rows 4096,16384 [--dim 512]]

rows: the tokens of one forward pass (the record's step of 786,432 tokens runs as four
passes of two micro-batches on one H200). For each vocabulary: each way's milliseconds
(forward and backward, the median of `repeats`), the ratios to the compiled way's, the bytes
of the bf16 logits, and the largest differences of loss and gradient; with --chunk-rows also
each way's peak memory above its inputs. Prints one JSON object per line; --json writes them
all to one file.
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
from windowgpt_cli.kernels.cross_entropy import head_softcap_cross_entropy, softcap_cross_entropy  # noqa: E402

CAP = 30.0


def torch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((CAP * torch.tanh(logits / CAP)).float(), targets)


def fused_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return softcap_cross_entropy(logits, targets, CAP).mean()


def timed_way(fn, params: list[torch.Tensor], repeats: int) -> tuple[float, int, list[torch.Tensor]]:
    """fn(*params) compiled, forward and backward: its median ms, the peak memory of one call
    above what was allocated before it, and that call's loss and gradients (float32)."""
    compiled = torch.compile(fn, dynamic=False)

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        loss = compiled(*params)
        loss.backward()
        return loss

    ms = milliseconds(step, repeats)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = step()
    peak = torch.cuda.max_memory_allocated() - base
    return ms, peak, [loss.detach().float(), *(p.grad.float() for p in params)]


def measure(rows: int, vocab: int, repeats: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = (8 * torch.randn(rows, vocab, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    result: dict = {"rows": rows, "vocab": vocab, "logits_bytes": logits.numel() * logits.element_size()}
    outputs = {}
    for name, fn in (("compiled", torch_loss), ("fused", fused_loss)):
        ms, _, outputs[name] = timed_way(lambda x, fn=fn: fn(x, targets), [logits], repeats)
        result[f"{name}_ms"] = round(ms, 3)
    result["ratio"] = round(result["fused_ms"] / result["compiled_ms"], 3)
    result["loss_difference"] = float((outputs["fused"][0] - outputs["compiled"][0]).abs())
    result["grad_difference"] = float((outputs["fused"][1] - outputs["compiled"][1]).abs().max())
    return result


def measure_with_head(rows: int, vocab: int, dim: int, chunks: list[int], repeats: int) -> dict:
    """The output layer's product and the loss, forward and backward, three ways: compiled by
    torch.compile, with the fused loss, and over chunks of rows for each of `chunks`."""
    g = torch.Generator(device="cuda").manual_seed(vocab)
    hidden = torch.randn(rows, dim, device="cuda", generator=g).bfloat16().requires_grad_(True)
    weight = (torch.randn(vocab, dim, device="cuda", generator=g) / 4).bfloat16().requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    ways = {"compiled": lambda h, w: torch_loss(h @ w.t(), targets),
            "fused": lambda h, w: fused_loss(h @ w.t(), targets)}
    ways |= {f"chunked_{n}": (lambda h, w, n=n: head_softcap_cross_entropy(h, w, targets, CAP, n) / rows)
             for n in chunks}
    result: dict = {"rows": rows, "vocab": vocab, "dim": dim, "logits_bytes": rows * vocab * 2}
    outputs = {}
    for name, way in ways.items():
        ms, result[f"{name}_peak_bytes"], outputs[name] = timed_way(way, [hidden, weight], repeats)
        result[f"{name}_ms"] = round(ms, 3)
    for name in ways:
        result[f"{name}_ratio"] = round(result[f"{name}_ms"] / result["compiled_ms"], 3)
        result[f"{name}_differences"] = [float((got - want).abs().max())
                                         for got, want in zip(outputs[name], outputs["compiled"])]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=196_608)
    parser.add_argument("--vocab", default="1024,8192")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--chunk-rows", help="comma-separated chunk sizes: time the output layer with the loss")
    parser.add_argument("--dim", type=int, default=512, help="the output layer's input width (with --chunk-rows)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/loss_speed.py needs a CUDA GPU")
    chunks = [int(n) for n in args.chunk_rows.split(",")] if args.chunk_rows else None
    rows = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        figures = (measure_with_head(args.rows, vocab, args.dim, chunks, args.repeats) if chunks
                   else measure(args.rows, vocab, args.repeats))
        rows.append({"gpu": torch.cuda.get_device_name(0), **figures})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
