"""`Fp8MlpOps`: the training step's MLP with its products in float8 (`train --fp8-mlp`).

The MLP holds two thirds of the step's matrix products. Here its two products and their
gradients to their inputs run in float8 (`kernels.fp8_products`); the activation, the
weights' gradients and everything else stay as torch's. Only what trains is rounded so:
without gradients (validation, scoring) the products are bfloat16's, so a run's scores are
the model's own.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.fp8_products import fp8_fits, fp8_linear
from .ops import TorchOps


class Fp8MlpOps(TorchOps):
    """`TorchOps` whose MLP runs its products in float8 while gradients are recorded, where
    its operands, cast as autocast casts them, fit (`fp8_fits`)."""

    def mlp(self, x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float) -> Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, up_w, down_w = x.to(dtype), up_w.to(dtype), down_w.to(dtype)
        if not (torch.is_grad_enabled() and fp8_fits(x, up_w) and up_w.shape[::-1] == down_w.shape):
            return super().mlp(x, up_w, down_w, negative_slope)
        return fp8_linear(self.leaky_square(fp8_linear(x, up_w), negative_slope), down_w)
