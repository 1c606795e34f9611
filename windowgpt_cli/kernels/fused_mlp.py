"""The MLP's two products with LeakyReLU² between them as one differentiable op for the
training step (`leaky_square_mlp`): the activation is the epilogue of the up product (which
stores the product too, for the backward), and its derivative the epilogue of the product
that brings the gradient back through the down projection. Unfused, an element-wise kernel
reads the product and writes the activation, and another reads the activation's gradient
and the product and writes the product's gradient: two passes over [tokens x mlp_dim]
tensors each way. The other four products are cuBLAS's.

The two epilogue products are windowgpt's Triton kernels (`elementwise`, products "triton")
or quack's CuTe GEMMs (`quack_products`, products "quack"). The down projection's weight
gradient reads the activation: the forward's copy, kept until the backward, or with quack's
products and `keep_activation` off, the one its backward product stores again (a pass more
over [rows x mlp_dim] in the backward, for a tensor of that size less held between them).

A custom op, opaque to torch.compile (its fake implementation gives the shapes), with its own
backward op, so a compiled step keeps one graph. Importing this module imports Triton.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from .elementwise import MatmulTiles, leaky_square_matmul_with_product, product_fits
from .elementwise_backward import leaky_square_grad_matmul
from .quack_products import leaky_square_back, leaky_square_grad, leaky_square_up, quack_fits


# Tiles of 128 x 128 (the scoring kernel's are 128 x 256): a persistent kernel loads the next
# tile's operands while this tile's epilogue moves two more tiles through shared memory (the
# product and the activation stored, or the product read and the gradient stored). At 128 x
# 256 the gradient's kernel would need 278,568 bytes of it, over a Hopper block's 232,448
# (tests/test_hopper_builds.py builds them for sm_90).
TRAINING_TILES = MatmulTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


@torch.library.custom_op("windowgpt::leaky_square_mlp", mutates_args=())
def _mlp_op(x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float, tiles: list[int], products: str,
            keep_activation: bool) -> tuple[Tensor, Tensor, Tensor]:
    if products == "quack":
        hidden, product = leaky_square_up(x, up_w, negative_slope)
    else:
        hidden, product = leaky_square_matmul_with_product(x, up_w, negative_slope, MatmulTiles(*tiles))
    return F.linear(hidden, down_w), product, hidden


@_mlp_op.register_fake
def _mlp_shapes(x, up_w, down_w, negative_slope, tiles, products, keep_activation):
    rows, cols = x.size(0), up_w.size(0)
    return x.new_empty(rows, down_w.size(0)), x.new_empty(rows, cols), x.new_empty(rows, cols)


@torch.library.custom_op("windowgpt::leaky_square_mlp_backward", mutates_args=())
def _mlp_backward_op(grad: Tensor, x: Tensor, up_w: Tensor, down_w: Tensor, product: Tensor, hidden: Tensor,
                     negative_slope: float, tiles: list[int], products: str,
                     keep_activation: bool) -> tuple[Tensor, Tensor, Tensor]:
    grad = grad.contiguous()
    if products == "quack" and keep_activation:
        grad_product = leaky_square_grad(grad, down_w, product, negative_slope)
    elif products == "quack":  # not kept: it comes back from the product
        grad_product, hidden = leaky_square_back(grad, down_w, product, negative_slope)
    else:
        grad_product = leaky_square_grad_matmul(grad, down_w, product, negative_slope, MatmulTiles(*tiles))
    return grad_product @ up_w, grad_product.t() @ x, grad.t() @ hidden


@_mlp_backward_op.register_fake
def _mlp_backward_shapes(grad, x, up_w, down_w, product, hidden, negative_slope, tiles, products, keep_activation):
    return x.new_empty(x.shape), up_w.new_empty(up_w.shape), down_w.new_empty(down_w.shape)


def _save_for_backward(ctx, inputs, output) -> None:
    x, up_w, down_w, negative_slope, tiles, products, keep_activation = inputs
    _, product, hidden = output
    kept = hidden if keep_activation or products != "quack" else hidden.new_empty(0)  # else made again
    ctx.save_for_backward(x, up_w, down_w, product, kept)
    ctx.negative_slope, ctx.tiles, ctx.products, ctx.keep_activation = negative_slope, tiles, products, keep_activation


def _mlp_grads(ctx, grad, grad_product, grad_hidden):
    # product and hidden leave the op only to be saved: no gradient reaches them
    x, up_w, down_w, product, hidden = ctx.saved_tensors
    dx, d_up, d_down = _mlp_backward_op(grad, x, up_w, down_w, product, hidden, ctx.negative_slope, ctx.tiles,
                                        ctx.products, ctx.keep_activation)
    return dx, d_up, d_down, None, None, None, None


_mlp_op.register_autograd(_mlp_grads, setup_context=_save_for_backward)


def mlp_fits(x: Tensor, up_w: Tensor, down_w: Tensor, tiles: MatmulTiles, products: str = "triton") -> bool:
    """Whether `leaky_square_mlp` takes these operands (x [..., dim], up_w [mlp_dim, dim],
    down_w [dim, mlp_dim]): bf16, and for the Triton products both products' columns and
    depths in whole tiles (`quack_products.quack_fits` for quack's)."""
    if products == "quack":
        return quack_fits(x.reshape(-1, x.size(-1)), up_w, down_w)
    return (product_fits(x, up_w, tiles) and down_w.dtype == torch.bfloat16
            and down_w.shape == (up_w.size(1), up_w.size(0)))


def leaky_square_mlp(x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float,
                     tiles: MatmulTiles = TRAINING_TILES, products: str = "triton",
                     keep_activation: bool = True) -> Tensor:
    """leaky_square(x @ up_w.T) @ down_w.T, bf16, differentiable in x, up_w and down_w, for
    operands that `mlp_fits`; x [..., dim]; products: whose epilogue products, "triton" or
    "quack" (`fused_mlp`); keep_activation: whether quack's keep the forward's activation
    for the backward (`keep_mlp_activation`; Triton's always do)."""
    out = _mlp_op(x.reshape(-1, x.size(-1)), up_w, down_w, negative_slope, list(dataclasses.astuple(tiles)),
                  products, keep_activation)[0]
    return out.view(*x.shape[:-1], down_w.size(0))
