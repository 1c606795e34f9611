"""`Fp8Ops`: the training step's products in float8 (`train --fp8-mlp`, `--fp8-attention`).

The MLP holds two thirds of the step's matrix products, the attention's projections most of
the rest. Here the products of the kinds asked for, and their gradients to their inputs, run in
float8 (`kernels.fp8_products`); the weights' gradients and everything else stay as torch's.
Only what trains is rounded so: without gradients (validation, scoring) the products are
bfloat16's, so a run's scores are the model's own.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.fp8_products import fp8_fits, fp8_linear
from ..runtime import matmul_dtype
from .ops import TorchOps

KINDS = ("attention", "mlp")


def _as_multiplied(*tensors: Tensor) -> list[Tensor]:
    """The operands cast as F.linear would multiply them: to autocast's dtype where it is on."""
    dtype = matmul_dtype(tensors[0])
    return [t.to(dtype) for t in tensors]


class Fp8Ops(TorchOps):
    """`TorchOps` whose products of the given kinds (`TorchOps.product`) run in float8 while
    gradients are recorded, where their operands, cast as autocast casts them, fit.
    mlp_kernels: the MLP's activation and the rounding of its rows in Triton kernels
    (`kernels.fp8_mlp`), one pass each way, where the compiler's would read each row twice."""

    def __init__(self, kinds: tuple[str, ...], mlp_kernels: bool = False):
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"products of kinds {sorted(unknown)}: the kinds are {', '.join(KINDS)}")
        self.kinds = frozenset(kinds)
        self.kernel_mlp = None
        if mlp_kernels and "mlp" in self.kinds:
            from ..kernels import fp8_mlp  # imports Triton: only when used

            self.kernel_mlp = fp8_mlp

    def mlp(self, x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float) -> Tensor:
        if self.kernel_mlp is not None and torch.is_grad_enabled():
            x, up_w, down_w = _as_multiplied(x, up_w, down_w)
            if self.kernel_mlp.fp8_mlp_fits(x, up_w, down_w):
                return self.kernel_mlp.fp8_leaky_square_mlp(x, up_w, down_w, negative_slope)
        return super().mlp(x, up_w, down_w, negative_slope)

    def split_product(self, x: Tensor, weight: Tensor, sizes: tuple[int, ...], kind: str) -> tuple[Tensor, ...]:
        if kind not in self.kinds or not torch.is_grad_enabled():
            return super().split_product(x, weight, sizes, kind)
        return self.product(x, weight, kind).split(sizes, dim=-1)

    def product_onto(self, base: Tensor, x: Tensor, weight: Tensor, kind: str) -> Tensor:
        if kind not in self.kinds or not torch.is_grad_enabled():
            return super().product_onto(base, x, weight, kind)
        return base + self.product(x, weight, kind)

    def product(self, x: Tensor, weight: Tensor, kind: str) -> Tensor:
        if kind not in self.kinds or not torch.is_grad_enabled():
            return super().product(x, weight, kind)
        x, weight = _as_multiplied(x, weight)
        return fp8_linear(x, weight) if fp8_fits(x, weight) else super().product(x, weight, kind)
