"""Whether the MLP's fused product pays: its hidden layer computed in one kernel
(`kernels._leaky_square_matmul_kernel`, the activation as the product's epilogue) against
cuBLAS's product followed by the activation kernel.

    python bench/fused_products.py [--rows 1048576] [--windows 512] [--repeats 10] [--rounds 4]
        [--full-attention] [--json PATH]
    python bench/fused_products.py --training [--rows 98304] [--tiles default] [--tuning gemm] [--json PATH]

Part 1 times the hidden layer alone at `rows` rows (a scoring batch of 512 windows of 2048)
for several tile shapes (the first is the default), each checked against the unfused pair
(largest difference in bf16 steps). Part 2 times a whole scoring forward (`logits_at`, the
last 64 positions of each of `windows` windows, of the record model or with --full-attention
the default one) with the product fused and not, in turns, and compares the logits. Random
weights: speed does not depend on them. Prints one JSON object per line; --json writes them
all to one file.

--training times the training step's MLP instead (`kernels.fused_mlp.leaky_square_mlp`, what
`train --fused-mlp triton` runs), at `rows` rows (default: a micro-batch of 48 sequences of 2048),
for each of TRAINING_TILE_CHOICES (the first is the default): its forward kernel (the
product stored as well) against cuBLAS's product and torch's activation run eagerly (two
kernels), its gradient kernel against cuBLAS's product and the derivative's kernel, and the
whole MLP forward and backward against torch's under torch.compile (what the training step
runs without the flag: the fair comparison). --tiles default times the default tiles only;
--tuning NAME adds torch's MLP compiled with `train --compile-tuning NAME`'s Inductor settings
(Triton templates benchmarked against cuBLAS for each product, the element-wise work fused
into a chosen template's epilogue; the autotuning takes a minute or more). Where this GPU
has float8 products, it also times the MLP with them (`train --fp8-mlp`), compiled, and where
quack-kernels runs, quack's two products and the MLP through them (`train --fused-mlp
quack`, auto's choice there): its gradient product storing the activation again and storing
the gradient alone, the MLP with the forward's activation kept (`--keep-mlp-activation`'s
auto) and not, and the MLP also replayed as a CUDA graph beside the compiler's (the GPU's time
alone, without the host's dispatch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from windowgpt_cli.challenge import RECORD_WINDOWS  # noqa: E402
from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.eval.ttt import capture_cuda_graph  # noqa: E402
from windowgpt_cli.model.fused_ops import FusedOps  # noqa: E402
from windowgpt_cli.kernels.elementwise import MatmulTiles, leaky_square_matmul_with_product  # noqa: E402
from windowgpt_cli.kernels.elementwise_backward import leaky_square_backward, leaky_square_grad_matmul  # noqa: E402
from windowgpt_cli.kernels.fused_mlp import TRAINING_TILES, leaky_square_mlp  # noqa: E402
from windowgpt_cli.kernels.quack_products import (  # noqa: E402
    leaky_square_back, leaky_square_grad, leaky_square_up, quack_targets)
from windowgpt_cli.kernels.fp8_products import fp8_available  # noqa: E402
from windowgpt_cli.model.fp8_ops import Fp8Ops  # noqa: E402
from windowgpt_cli.model.ops import TorchOps  # noqa: E402
from windowgpt_cli.model.gpt import build_model  # noqa: E402
from windowgpt_cli.runtime import TUNING_OPTIONS, enable_fast_math  # noqa: E402

TILES = [MatmulTiles(128, 256, 64, 8, 3), MatmulTiles(256, 128, 64, 8, 3), MatmulTiles(128, 128, 64, 4, 4),
         MatmulTiles(128, 128, 64, 8, 3), MatmulTiles(128, 128, 32, 4, 4)]
# The training kernels move one more tile through shared memory in their epilogue than the
# scoring kernel (tests/test_hopper_builds.py): these fit a Hopper block or fail to build.
TRAINING_TILE_CHOICES = [TRAINING_TILES, MatmulTiles(128, 128, 64, 8, 4), MatmulTiles(128, 128, 64, 4, 4),
                         MatmulTiles(128, 128, 128, 8, 2), MatmulTiles(128, 256, 64, 8, 2),
                         MatmulTiles(256, 128, 64, 8, 2), MatmulTiles(64, 256, 64, 4, 3),
                         MatmulTiles(128, 64, 64, 4, 4)]


def milliseconds(fn: Callable[[], object], repeats: int) -> float:
    """The median time of fn on the GPU, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def replayed(call: Callable[[], object]) -> Callable[[], None]:
    """A call that replays call's kernels as a CUDA graph, captured at its first use after two
    runs outside the capture (compiling, autotuning): the GPU's time without the host's
    dispatch, which the training step's host, running ahead of its GPU, hides as well."""
    replay = None

    def run() -> None:
        nonlocal replay
        if replay is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                call()
                call()
            torch.cuda.current_stream().wait_stream(stream)
            replay = capture_cuda_graph(call, stream)
        replay()
    return run


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, in bf16 steps of the larger magnitude."""
    a, b = a.float(), b.float()
    return float(((a - b).abs() / (torch.maximum(a.abs(), b.abs()) * 2 ** -8).clamp(min=1e-30)).max())


def _timed_variant(name: str, call: Callable[[], object], repeats: int, base_ms: float,
                   check: Callable[[object], float] | None = None) -> dict:
    """One row: the variant's median time and its ratio to base_ms, or the error a tile shape
    this GPU cannot take gives."""
    try:
        out = call()
        ms = milliseconds(call, repeats)
    except Exception as exc:
        return {"variant": name, "error": str(exc).splitlines()[0][:160]}
    row = {"variant": name, "ms": round(ms, 3), "ratio": round(ms / base_ms, 3)}
    if check is not None:
        row["max_bf16_steps"] = round(check(out), 2)
    return row


def product_rows(a: argparse.Namespace, cfg, device) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(a.rows, cfg.model_dim, device=device).bfloat16()
    up_w = (torch.randn(cfg.mlp_dim, cfg.model_dim, device=device) * cfg.model_dim ** -0.5).bfloat16()
    slope = cfg.negative_slope
    rows = []
    with torch.inference_mode():
        reference = FusedOps(tiles=None).mlp_hidden(x, up_w, slope)
        base_ms = milliseconds(lambda: FusedOps(tiles=None).mlp_hidden(x, up_w, slope), a.repeats)
        rows.append({"variant": "cuBLAS product, then the activation", "ms": round(base_ms, 3)})
        product_ms = milliseconds(lambda: torch.nn.functional.linear(x, up_w), a.repeats)
        rows.append({"variant": "cuBLAS product alone", "ms": round(product_ms, 3)})
        for t in TILES:
            rows.append(_timed_variant(f"fused {t}", lambda t=t: FusedOps(tiles=t).mlp_hidden(x, up_w, slope),
                                       a.repeats, base_ms, lambda out: bf16_steps(out, reference)))
    return rows


def training_rows(a: argparse.Namespace, cfg, device) -> list[dict]:
    """The training MLP's kernels and its whole forward and backward, per tile shape, against
    cuBLAS's products with the element-wise kernels between them."""
    torch.manual_seed(0)
    dim, hidden, slope = cfg.model_dim, cfg.mlp_dim, cfg.negative_slope
    x = torch.randn(a.rows, dim, device=device).bfloat16()
    up_w = (torch.randn(hidden, dim, device=device) * dim ** -0.5).bfloat16()
    down_w = (torch.randn(dim, hidden, device=device) * hidden ** -0.5).bfloat16()
    grad = torch.randn(a.rows, dim, device=device).bfloat16()
    torch_ops = TorchOps()
    tile_choices = TRAINING_TILE_CHOICES if a.tiles == "all" else TRAINING_TILE_CHOICES[:1]
    with_quack = quack_targets(device)  # `--fused-mlp quack` where quack-kernels is installed
    rows = []
    with torch.no_grad():
        product = torch.nn.functional.linear(x, up_w)
        activation = torch_ops.leaky_square(product, slope)
        grad_product = leaky_square_backward(grad @ down_w, product, slope)
        base_ms = milliseconds(lambda: torch_ops.leaky_square(torch.nn.functional.linear(x, up_w), slope), a.repeats)
        rows.append({"variant": "forward: cuBLAS product, then the activation", "ms": round(base_ms, 3)})
        for t in tile_choices:
            rows.append(_timed_variant(f"forward: fused {t}", lambda t=t: leaky_square_matmul_with_product(
                x, up_w, slope, t)[0], a.repeats, base_ms, lambda out: bf16_steps(out, activation)))
        if with_quack:
            rows.append(_timed_variant("forward: quack's product with the activation", lambda: leaky_square_up(
                x, up_w, slope)[0], a.repeats, base_ms, lambda out: bf16_steps(out, activation)))
        base_ms = milliseconds(lambda: leaky_square_backward(grad @ down_w, product, slope), a.repeats)
        rows.append({"variant": "gradient: cuBLAS product, then the derivative", "ms": round(base_ms, 3)})
        for t in tile_choices:
            rows.append(_timed_variant(f"gradient: fused {t}", lambda t=t: leaky_square_grad_matmul(
                grad, down_w, product, slope, t), a.repeats, base_ms, lambda out: bf16_steps(out, grad_product)))
        if with_quack:
            rows.append(_timed_variant("gradient: quack's product with the derivative", lambda: leaky_square_back(
                grad, down_w, product, slope)[0], a.repeats, base_ms, lambda out: bf16_steps(out, grad_product)))
            rows.append(_timed_variant("gradient: quack's product with the derivative, the gradient alone stored",
                                       lambda: leaky_square_grad(grad, down_w, product, slope), a.repeats, base_ms,
                                       lambda out: bf16_steps(out, grad_product)))
    params = [p.detach().clone().requires_grad_(True) for p in (x, up_w, down_w)]

    def step(mlp: Callable[..., torch.Tensor]) -> Callable[[], object]:
        def run() -> None:
            mlp(*params, slope).backward(grad)
        return run
    compiled = torch.compile(torch_ops.mlp)
    base_ms = milliseconds(step(compiled), a.repeats)
    rows.append({"variant": "MLP forward and backward: torch, compiled", "ms": round(base_ms, 3)})
    if a.tuning is not None:
        tuned = torch.compile(torch_ops.mlp, options=TUNING_OPTIONS[a.tuning])
        rows.append(_timed_variant(f"MLP forward and backward: torch, compiled with --compile-tuning {a.tuning}",
                                   step(tuned), a.repeats, base_ms))
    if fp8_available(device):
        rows.append(_timed_variant("MLP forward and backward: float8 products (--fp8-mlp), compiled",
                                   step(torch.compile(Fp8Ops(("mlp",)).mlp)), a.repeats, base_ms))
    for t in tile_choices:
        rows.append(_timed_variant(f"MLP forward and backward: fused {t}",
                                   step(lambda *args, t=t: leaky_square_mlp(*args, tiles=t)), a.repeats, base_ms))
    if with_quack:
        quack_step = step(lambda *args: leaky_square_mlp(*args, products="quack"))
        rows.append(_timed_variant("MLP forward and backward: quack's products", quack_step, a.repeats, base_ms))
        rows.append(_timed_variant("MLP forward and backward: quack's products, the activation not kept",
                                   step(lambda *args: leaky_square_mlp(*args, products="quack", keep_activation=False)),
                                   a.repeats, base_ms))
        graphed = _timed_variant("MLP forward and backward: torch, compiled, replayed as a CUDA graph",
                                 replayed(step(compiled)), a.repeats, base_ms)
        rows.append(graphed)
        if "ms" in graphed:  # quack's against it
            rows.append(_timed_variant("MLP forward and backward: quack's products, replayed as a CUDA graph",
                                       replayed(quack_step), a.repeats, graphed["ms"]))
    return rows


def forward_rows(a: argparse.Namespace, cfg, device) -> list[dict]:
    """Each variant timed in turn, `rounds` times over (so that none is always measured on a
    GPU warmer than the others), its median over the rounds reported."""
    torch.manual_seed(1)
    model = build_model(cfg, device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    model.set_attention_backend("auto", device)
    model.eval()
    x = torch.randint(0, cfg.vocab_size, (a.windows, 2048), device=device)
    positions = torch.arange(2048 - 64, 2048, device=device).expand(a.windows, 64).contiguous()
    variants = {"apart": (FusedOps(tiles=None), False), "fused": (FusedOps(), False),
                "fused, query runs": (FusedOps(), True)}
    logits, times = {}, {name: [] for name in variants}
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for name, (ops, runs) in variants.items():
            ops.warm_up(model, 2048, 64)
            logits[name] = model.logits_at(x, positions, ops=ops, query_runs=runs).float()
        for _ in range(a.rounds):
            for name, (ops, runs) in variants.items():
                times[name].append(milliseconds(lambda: model.logits_at(x, positions, ops=ops, query_runs=runs),
                                                a.repeats))
    base = statistics.median(times["apart"])
    return [{"forward": name, "windows": a.windows, "ms": round(statistics.median(t), 2),
             "ratio": round(statistics.median(t) / base, 4), "rounds_ms": [round(v, 1) for v in t],
             "max_bf16_steps": round(bf16_steps(logits[name], logits["apart"]), 2)} for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, help="rows of the products (default: 512 x 2048, or with "
                        "--training 48 x 2048)")
    parser.add_argument("--windows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4, help="turns of the forward variants")
    parser.add_argument("--full-attention", action="store_true",
                        help="the default model (full attention on every layer) instead of the record's")
    parser.add_argument("--training", action="store_true",
                        help="the training step's MLP (train --fused-mlp) instead of the scoring forward")
    parser.add_argument("--tiles", choices=("all", "default"), default="all",
                        help="--training: every tile shape of TRAINING_TILE_CHOICES, or the default's only")
    parser.add_argument("--tuning", choices=[name for name, options in TUNING_OPTIONS.items() if options],
                        help="--training: also torch's MLP compiled with these Inductor settings")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    if a.rows is None:
        a.rows = (48 if a.training else 512) * 2048
    if not torch.cuda.is_available():
        sys.exit("bench/fused_products.py needs a CUDA GPU")
    device = torch.device("cuda")
    enable_fast_math(device)
    cfg = RunConfig().model
    if not a.full_attention:  # the record model: windows of 512 with 4 sink tokens on layers 2,4,6,8,10
        cfg = dataclasses.replace(cfg, **RECORD_WINDOWS)
    if a.training:
        rows = training_rows(a, cfg, device)
    else:
        rows = product_rows(a, cfg, device) + forward_rows(a, cfg, device)
    for row in rows:
        print(json.dumps(row))
    if a.json:
        a.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(device), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
