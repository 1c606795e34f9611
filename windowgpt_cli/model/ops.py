"""The element-wise steps between the matrix products and the attention, and the blocks'
products themselves, in plain torch: the seam (`TorchOps`) through which the model runs them,
so that `fused_ops.FusedOps` (inference) and `fused_train_ops.TrainingOps` (training) can run
the same steps as fused kernels, and `fp8_ops.Fp8Ops` the products in float8. `Residual` and
`ValueInjection` carry a step's inputs unsummed, so a fused kernel forms the sum while it
reads them once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .rotary import apply_rotary


def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def scaled_rms_norm(x: Tensor, factor: Tensor) -> Tensor:
    """rms_norm(x) * factor, rounded as with a Python float factor: in float32, then back to
    the norm's dtype (a bfloat16 tensor would otherwise round the factor first)."""
    normed = rms_norm(x)
    return (normed.float() * factor).to(normed.dtype)


@dataclass
class Residual:
    """The residual stream as a sum not yet formed: base + scale_1 * delta_1 + ..., then plus
    skip_weight * skip when a skip is added (skip None: the sum itself, as in the first
    decoder block, whose skip is its own input). The step that next reads the stream forms
    the sum, so that a fused kernel can do it while reading its inputs once.

    At the first block, base is x0 as the ops represent it (see `TorchOps.embed`)."""

    base: Any
    deltas: tuple[tuple[Tensor, Tensor | None], ...] = ()  # scale None: in the product that made the delta
    skip: Tensor | None = None
    skip_weight: Tensor | None = None
    skip_gate: Tensor | None = None  # with one: sigmoid(gate) * sum + (1 - sigmoid(gate)) * weight * skip

    # Built directly rather than with dataclasses.replace: decoding one token calls these
    # a dozen times, where replace's introspection would cost more than the arithmetic.
    def plus(self, delta: Tensor, scale: Tensor | None) -> "Residual":
        return Residual(self.base, self.deltas + ((delta, scale),), self.skip, self.skip_weight, self.skip_gate)

    def plus_skip(self, skip: Tensor | None, weight: Tensor, gate: Tensor | None = None) -> "Residual":
        return Residual(self.base, self.deltas, skip, weight, gate)


@dataclass
class ValueInjection:
    """A layer's value embedding: the shared one (`TorchOps.shared_values`) times the layer's
    scale, left as its factors for the step that adds it to the values."""

    shared: Any
    layer_scale: Tensor


def smear(x: Tensor, gate: Tensor, ids: Tensor | None = None, boundary: int = -1) -> Tensor:
    """Blend each position with the previous one through a per-channel gate (sigmoid). A
    position whose id is `boundary` (>= 0) blends with zeros, as the first position does."""
    return smear_with(x, previous_positions(x), gate, ids, boundary)


def smear_with(x: Tensor, x_prev: Tensor, gate: Tensor, ids: Tensor | None = None, boundary: int = -1) -> Tensor:
    """`smear` given each position's predecessor (decoding keeps it from the step before)."""
    if boundary >= 0 and ids is not None:
        x_prev = x_prev * (ids != boundary).unsqueeze(-1).to(x_prev.dtype)
    g = torch.sigmoid(gate.to(dtype=x.dtype))[None, None, :]
    return (1 - g) * x + g * x_prev


def embed_sum(ids: Tensor, table: Tensor, bigram: Tensor | None, bigram_scale: Tensor | None) -> Tensor:
    """Token embeddings plus bigram * bigram_scale, before any norm."""
    x = F.embedding(ids, table)
    return x if bigram is None else x + bigram * bigram_scale.to(dtype=bigram.dtype)


def gated_smear_with(x: Tensor, x_prev: Tensor, weight: Tensor, scale: Tensor, ids: Tensor | None = None,
                     boundary: int = -1) -> Tensor:
    """x + scale * sigmoid(weight . x[..., :N]) * x_prev, N = weight's length: each position
    takes in its predecessor as much as a gate on its own first channels says. A position
    whose id is `boundary` (>= 0) takes in nothing, as the first position does."""
    if boundary >= 0 and ids is not None:
        x_prev = x_prev * (ids != boundary).unsqueeze(-1).to(x_prev.dtype)
    gate = torch.sigmoid(x[..., :weight.numel()] @ weight.to(x.dtype)).unsqueeze(-1)
    return x + scale.to(x.dtype) * gate * x_prev


def previous_positions(x: Tensor) -> Tensor:
    """x [B, T, D] shifted one position on: each position's predecessor, zeros before the first."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


class TorchOps:
    """The element-wise steps between the matrix products and the attention, and the blocks'
    products (`product`), in plain torch: the model's definition (any device, autograd,
    torch.compile). `fused_ops.FusedOps` runs the same steps as fused GPU kernels.

    x0 (the embedding every block mixes in) is whatever `embed` returns: here a tensor.

    fused_heads, fused_head_pair and fused_output: where set (training sets them,
    `kernels.fused_heads.fused_head_prep` and `fused_head_prep_pair`,
    `kernels.attention_output.fused_attention_output`), the ops that `head_prep`,
    `head_prep_pair` and `attention_output` run instead of torch's steps, for the tensors they
    take (they return None for the others).

    sum_in_product: where set (training sets it, `residual_in_product`), a block adds its input to
    the attention's output inside the output projection's product (`product_onto`)."""

    sum_in_product: bool = False
    fused_heads: Callable[[Tensor, Tensor, Tensor, int, Tensor | None, int], Tensor | None] | None = None
    fused_head_pair: Callable[..., tuple[Tensor, Tensor] | None] | None = None
    fused_output: Callable[[Tensor, Tensor, Tensor | None], Tensor | None] | None = None

    def embed(self, ids: Tensor, table: Tensor, bigram: Tensor | None, bigram_scale: Tensor | None,
              gate: Tensor, boundary: int = -1) -> Tensor:
        """x0: token embeddings plus bigram * bigram_scale, normed, then smeared (`smear`)."""
        return smear(self.embed_normed(ids, table, bigram, bigram_scale), gate, ids, boundary)

    def embed_normed(self, ids: Tensor, table: Tensor, bigram: Tensor | None, bigram_scale: Tensor | None) -> Tensor:
        """x0 before the smear: token embeddings plus bigram * bigram_scale, normed."""
        return rms_norm(embed_sum(ids, table, bigram, bigram_scale))

    def stream_sum(self, stream: Residual) -> Tensor:
        x = stream.base
        for delta, scale in stream.deltas:
            x = x + delta if scale is None else x + scale.to(dtype=x.dtype)[None, None, :] * delta
        if stream.skip_weight is not None:
            skip = x if stream.skip is None else stream.skip
            scaled = stream.skip_weight.to(dtype=x.dtype)[None, None, :] * skip
            if stream.skip_gate is None:
                x = x + scaled
            else:
                x = torch.lerp(scaled, x, torch.sigmoid(stream.skip_gate.to(dtype=x.dtype))[None, None, :])
        return x

    def block_input(self, stream: Residual, x0: Tensor, mix: Tensor, factor: Tensor,
                    keep_sum: bool) -> tuple[Tensor | None, Tensor, Tensor]:
        """(the stream's sum if keep_sum, the block's input x_in = mix[0] * x + mix[1] * x0,
        and x_in normed and scaled by the layer's factor)."""
        x = self.stream_sum(stream)
        mix = mix.to(dtype=x.dtype)
        x_in = mix[0][None, None, :] * x + mix[1][None, None, :] * x0
        return (x if keep_sum else None), x_in, scaled_rms_norm(x_in, factor)

    def residual_norm(self, stream: Residual, factor: Tensor) -> tuple[Residual, Tensor]:
        """(the stream, and its sum normed and scaled by factor). The stream comes back
        summed here; a fused kernel may leave it a sum, formed again where it is next read."""
        x = self.stream_sum(stream)
        return Residual(x), scaled_rms_norm(x, factor)

    def final_norm(self, stream: Residual) -> Tensor:
        return rms_norm(self.stream_sum(stream))

    def at_rows(self, value: Tensor, positions: Tensor) -> Tensor:
        """x0 or the shared value embedding (as `embed` and `shared_values` give them) at
        positions [B, R] of each sequence."""
        return pick_positions(value, positions)

    def shared_values(self, projected: Tensor, scale: Tensor) -> Tensor:
        """The value embedding the layers that take one share: projected * scale."""
        return projected * scale.to(dtype=projected.dtype)

    def values(self, v: Tensor, injection: ValueInjection | None) -> tuple[Tensor, Tensor]:
        """(the values the attention reads, the values XSA reads): v plus the layer's value
        embedding, if it has one."""
        if injection is not None:
            shared = injection.shared
            v = v + shared * injection.layer_scale.to(dtype=shared.dtype)
        return v, v

    def head_prep(self, x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int, gain: Tensor | None,
                  copies: int = 1) -> Tensor:
        """Queries or keys [B, T, H, D]: each head normed, rotated, and scaled by its gain;
        [B, T, H * copies, D], each head `copies` times over (keys for attention that takes
        as many key heads as query heads)."""
        if self.fused_heads is not None:
            fused = self.fused_heads(x, cos, sin, rope_dims, gain, copies)
            if fused is not None:
                return fused
        x = rms_norm(x)
        x = apply_rotary(x, cos.to(dtype=x.dtype), sin.to(dtype=x.dtype), rope_dims)
        x = x if gain is None else x * gain.to(dtype=x.dtype)[None, None, :, None]
        return x if copies == 1 else x.repeat_interleave(copies, dim=2)

    def head_prep_pair(self, x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int, gain: Tensor | None,
                       q_heads: int, copies: int = 1) -> tuple[Tensor, Tensor]:
        """`head_prep` of the queries and the keys of x [B, T, q_heads + key heads, D] (a
        stacked product's slice, the queries' heads first): (the queries with gain, the keys
        `copies` times over). Through `fused_head_pair` where set: one op, whose gradient is
        one tensor of x's shape."""
        if self.fused_head_pair is not None:
            fused = self.fused_head_pair(x, cos, sin, rope_dims, gain, q_heads, copies)
            if fused is not None:
                return fused
        return (self.head_prep(x[:, :, :q_heads], cos, sin, rope_dims, gain),
                self.head_prep(x[:, :, q_heads:], cos, sin, rope_dims, None, copies))

    def exclude_self_value(self, y: Tensor, v: Tensor) -> Tensor:
        return exclude_self_value(y, v)

    def attention_output(self, y: Tensor, v: Tensor | None, gate: Tensor | None) -> Tensor:
        """The attention's output y [B, T, H, D] before its projection: XSA against the values
        v [B, T, Hkv, D] where given (`exclude_self_value`), then each head times its gate
        [B, T, H] where given."""
        if v is not None and self.fused_output is not None:
            fused = self.fused_output(y, v, gate)
            if fused is not None:
                return fused
        if v is not None:
            y = self.exclude_self_value(y, v)
        return y if gate is None else y * gate[..., None]

    def leaky_square(self, h: Tensor, negative_slope: float) -> Tensor:
        return F.leaky_relu(h, negative_slope=negative_slope).square()

    def product(self, x: Tensor, weight: Tensor, kind: str) -> Tensor:
        """x's product with a block's matrix (F.linear, no bias); kind says whose: "attention"
        (queries, keys and values; the output) or "mlp"."""
        return F.linear(x, weight)

    def product_onto(self, base: Tensor, x: Tensor, weight: Tensor, kind: str) -> Tensor:
        """base + x's product with a block's matrix as one torch.addmm, whose product adds base
        in its epilogue (cuBLAS), rounding the sum once; base [..., out] as the result."""
        base2d, x2d = base.reshape(-1, base.size(-1)), x.reshape(-1, x.size(-1))
        return torch.addmm(base2d, x2d, weight.t()).view(base.shape)

    def split_product(self, x: Tensor, weight: Tensor, sizes: tuple[int, ...], kind: str) -> tuple[Tensor, ...]:
        """x's product with matrices stacked in weight (of sizes rows each), as the product's
        slices: one product forward, one per matrix back (`split_linear`)."""
        if not torch.is_grad_enabled():  # a decoder's step: no autograd function to pass through
            return F.linear(x, weight).split(sizes, dim=-1)
        return split_linear(x, weight, sizes)

    def mlp_hidden(self, x: Tensor, up_w: Tensor, negative_slope: float) -> Tensor:
        """The MLP's hidden layer: `leaky_square` of x's product with up_w."""
        return self.leaky_square(self.product(x, up_w, "mlp"), negative_slope)

    def mlp(self, x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float) -> Tensor:
        """The MLP: its hidden layer's product with down_w."""
        return self.product(self.mlp_hidden(x, up_w, negative_slope), down_w, "mlp")

    def softcap(self, logits: Tensor, cap: float) -> Tensor:
        return cap * torch.tanh(logits / cap)


TORCH_OPS = TorchOps()


class _SplitLinear(torch.autograd.Function):
    """F.linear(x, weight) split into slices of sizes columns. Backward each slice's gradient
    goes through its own matrix: joined, the slices' gradients (each a tensor of its own,
    made by another kernel) would be copied into one tensor as wide as the product."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
        ctx.save_for_backward(x, weight)
        ctx.sizes = sizes
        ctx.set_materialize_grads(False)  # a slice without a gradient takes no product back
        return tuple(F.linear(x, weight).split(sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        x, weight = ctx.saved_tensors
        dx, dweight = None, []
        for grad, matrix in zip(grads, weight.split(ctx.sizes)):
            if grad is None:
                dweight.append(torch.zeros_like(matrix))
                continue
            matrix, rows = matrix.to(grad.dtype), x.to(grad.dtype)  # as the product multiplied (autocast's dtype)
            dx = grad @ matrix if dx is None else dx + grad @ matrix
            dweight.append((grad.flatten(0, -2).t() @ rows.flatten(0, -2)).to(weight.dtype))
        return (None if dx is None else dx.to(x.dtype)), torch.cat(dweight), None


def split_linear(x: Tensor, weight: Tensor, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
    """F.linear(x, weight).split(sizes, -1), whose gradient never joins the slices' (see
    `_SplitLinear`)."""
    return _SplitLinear.apply(x, weight, tuple(sizes))


def pick_positions(x: Tensor, positions: Tensor) -> Tensor:
    """x[b, positions[b, k]] for x of shape [B, T, ...]: [B, K, ...]."""
    index = positions.reshape(*positions.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def exclude_self_value(y: Tensor, v: Tensor) -> Tensor:
    """XSA: remove from each head's output its component along its own (normalized) value.
    y [B, T, H, D], v [B, T, Hkv, D]; heads of a GQA group share one value."""
    b, t, h, d = y.shape
    hkv = v.size(-2)
    y_grouped = y.reshape(b, t, hkv, h // hkv, d)
    v_unit = F.normalize(v, dim=-1).unsqueeze(-2)
    projection = (y_grouped * v_unit).sum(dim=-1, keepdim=True) * v_unit
    return (y_grouped - projection).reshape(b, t, h, d)
