"""`TrainingOps`: the model's costliest element-wise steps in an eager training step as
fused kernels that autograd differentiates (`kernels.fused_heads`, `kernels.elementwise_backward`).

Test-time training runs its steps eagerly: compiling a backward graph costs more than the
few hundred small steps it would speed up. Eagerly, torch runs each element-wise step as
several kernels, and autograd as several more, so those kernels, not the matrix products,
fill most of a step. `TrainingOps` runs the per-head norm, rotation and gain of queries and
keys, and the MLP's LeakyReLU², as one kernel forward and one backward.

`ProductEpilogueOps` is the compiled training step's (`train --fused-mlp`): torch's steps,
which the compiler fuses, but the MLP's activation and its derivative in the epilogues of the
products around it (`kernels.fused_mlp`). Importing this module imports Triton.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from ..kernels.elementwise import MatmulTiles, head_prep, leaky_square, powers_of_two, rotated_half
from ..kernels.elementwise_backward import head_prep_backward, leaky_square_backward
from ..kernels.fused_heads import fused_head_prep
from ..kernels.fused_mlp import TRAINING_TILES, leaky_square_mlp, mlp_fits
from .gpt import GPT
from .ops import TorchOps


class _LeakySquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, negative_slope: float) -> Tensor:
        h = h.contiguous()
        ctx.save_for_backward(h)
        ctx.negative_slope = negative_slope
        return leaky_square(h, negative_slope, h.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (h,) = ctx.saved_tensors
        return leaky_square_backward(grad, h, ctx.negative_slope), None


class TrainingOps(TorchOps):
    """`TorchOps` whose costliest element-wise steps in an eager training step are fused
    kernels, forward and backward (see the module's docstring); the rest is torch's."""

    fused_heads = staticmethod(fused_head_prep)

    def leaky_square(self, h: Tensor, negative_slope: float) -> Tensor:
        return _LeakySquare.apply(h, negative_slope)

    def kernel_builds(self, model: GPT, seq_len: int) -> list[Callable[[], object]]:
        """Launches on one sequence of zeros that build this class's kernels, forward and
        backward, for steps over sequences of seq_len (to run in parallel threads,
        `runtime.run_in_threads`). The arguments keep the real ones' dtypes and layouts."""
        cfg = model.cfg
        device = model.tok_emb.weight.device
        zeros = functools.partial(torch.zeros, device=device, dtype=torch.bfloat16)
        rope_half = rotated_half(cfg.head_dim, cfg.rope_dims)
        table = torch.zeros(1, seq_len, 1, rope_half, device=device)
        q, gain = zeros(1, seq_len, cfg.num_heads, cfg.head_dim), torch.zeros(cfg.num_heads, device=device)
        hidden = zeros(1, seq_len, cfg.mlp_dim)
        builds: list[Callable[[], object]] = [
            lambda: leaky_square(hidden, cfg.negative_slope, hidden.dtype),
            lambda: leaky_square_backward(hidden, hidden, cfg.negative_slope),
        ]
        if powers_of_two(cfg.head_dim, rope_half):
            builds += [lambda: head_prep(q, table, table, gain, q.dtype),
                       lambda: head_prep_backward(q, q, table, table, gain)]
        return builds


class ProductEpilogueOps(TorchOps):
    """`TorchOps` with the MLP as `kernels.fused_mlp.leaky_square_mlp` (its epilogue products
    windowgpt's Triton kernels or quack's: `products`; whether quack's keep the forward's
    activation: `keep_activation`) where its operands, cast as autocast casts them, fit those
    products (the rest as torch's, for the compiler)."""

    def __init__(self, tiles: MatmulTiles = TRAINING_TILES, products: str = "triton", keep_activation: bool = True):
        self.tiles, self.products, self.keep_activation = tiles, products, keep_activation

    def mlp(self, x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float) -> Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, up_w, down_w = x.to(dtype), up_w.to(dtype), down_w.to(dtype)
        if mlp_fits(x, up_w, down_w, self.tiles, self.products):
            return leaky_square_mlp(x, up_w, down_w, negative_slope, self.tiles, self.products, self.keep_activation)
        return super().mlp(x, up_w, down_w, negative_slope)
