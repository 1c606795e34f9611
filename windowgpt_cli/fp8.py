"""FP8 matrix products for training (`train --fp8`): the MLP's two and the output layer's.

Each product scales its operands per tensor by their current absolute maximum (no history
to keep or to checkpoint) and casts them to FP8: the input and the weight to float8_e4m3fn
(largest value 448, 3 mantissa bits), the incoming gradient to float8_e5m2 (largest value
57344, 2 mantissa bits, for its wider range). torch._scaled_mm multiplies them, sums in
float32 and scales back. The backward's two products reuse the forward's FP8 input and
weight. GPUs of compute capability 8.9 or later (Ada, Hopper) have FP8 tensor cores;
torch also runs these products on the CPU, slowly, which the tests use.

Everything else, evaluation and GPTQ's calibration included, keeps its matrix products in
bf16: a model trained with FP8 is scored as any other.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .errors import ConfigError
from .model import TorchOps

FORWARD_DTYPE = torch.float8_e4m3fn
GRADIENT_DTYPE = torch.float8_e5m2
MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """A clear error where FP8 matrix products cannot run: a CUDA GPU without FP8 tensor cores."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(f"--fp8 needs a GPU with FP8 tensor cores (compute capability "
                          f"{'.'.join(map(str, MIN_CAPABILITY))} or later); "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")


def quantize(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(x / scale in `dtype`, scale): the scale maps x's absolute maximum onto dtype's largest
    value, a float32 scalar tensor (an all-zero x gets scale 1)."""
    largest = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float()
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    return (x.float() / scale).clamp(-largest, largest).to(dtype), scale


def _column_major(x: Tensor) -> Tensor:
    """x's values in column-major order, as torch._scaled_mm wants its second operand."""
    return x.t().contiguous().t()


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        rows = x.reshape(-1, x.size(-1))
        x_fp8, x_scale = quantize(rows, FORWARD_DTYPE)
        w_fp8, w_scale = quantize(weight, FORWARD_DTYPE)
        out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
        ctx.save_for_backward(x_fp8, x_scale, w_fp8, w_scale)
        ctx.shapes_dtypes = (x.shape, x.dtype, weight.dtype)
        return out.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
        x_shape, x_dtype, w_dtype = ctx.shapes_dtypes
        g_fp8, g_scale = quantize(grad.reshape(-1, grad.size(-1)), GRADIENT_DTYPE)
        grad_x = torch._scaled_mm(g_fp8, _column_major(w_fp8), scale_a=g_scale, scale_b=w_scale, out_dtype=x_dtype)
        grad_w = torch._scaled_mm(g_fp8.t().contiguous(), _column_major(x_fp8), scale_a=g_scale, scale_b=x_scale,
                                  out_dtype=w_dtype)
        return grad_x.view(x_shape), grad_w


def fp8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) (no bias) as an FP8 product, forward and backward."""
    return _Float8Linear.apply(x, weight)


class Float8Ops(TorchOps):
    """`TorchOps` whose MLP and output-layer products run in FP8."""

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return fp8_linear(x, weight)


FLOAT8_OPS = Float8Ops()
