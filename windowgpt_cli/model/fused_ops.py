"""`FusedOps`: the model's element-wise steps (`ops.TorchOps`) as the fused GPU kernels of
`kernels.elementwise`, for inference (sliding evaluation and test-time training's scoring).

Every step reads its inputs once and writes its outputs once. The matrix products stay
cuBLAS's, except the MLP's first, which on Hopper and later is one kernel with its
activation; the attention stays SDPA's (and the window attention's Triton kernels for
windowed layers). They round as the compiled forward does (see `kernels.elementwise`), so
sliding evaluation gives the reference's val_bpb to within 1e-8.

Inference only (no autograd). Importing this module imports Triton;
`runtime.triton_available` says whether its kernels can run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor

from ..kernels import elementwise as kernels
from ..kernels.elementwise import MatmulTiles, float32_values
from ..runtime import run_in_threads
from .attention import window_kernel_builds
from .gpt import GPT
from .ops import TORCH_OPS, Residual, TorchOps, ValueInjection, smear


@dataclass
class ScaledProjection:
    """The shared value embedding as `FusedOps` passes it: projected and scale, multiplied
    where the values are formed."""

    projected: Tensor
    scale: Tensor


@dataclass
class SmearedEmbedding:
    """x0 as `FusedOps` passes it: the normed embedding [B, T, D] and the SmearGate's gate.
    The kernels that read x0 blend each position with the previous one themselves."""

    normed: Tensor
    gate: Tensor


class FusedOps(TorchOps):
    """`TorchOps` with its per-layer steps as fused kernels (CUDA, inference, bf16 autocast).

    Outputs that feed a matrix product or the attention are bf16, as autocast would cast
    them there; the residual stream's stored parts (a block's input, a kept skip) have the
    embedding table's dtype, as the stream has in torch. The MLP's hidden layer is one
    kernel, product and activation (`tiles`; None: cuBLAS's product, then the activation):
    the product never makes a round trip through memory."""

    def __init__(self, tiles: MatmulTiles | None = MatmulTiles()):
        self.tiles = tiles

    def warm_up(self, model: GPT, seq_len: int, queries: int,
                other_builds: Iterable[Callable[[], object]] = ()) -> None:
        """Build every kernel that scoring windows of seq_len with `queries` predictions per
        row runs (the window attention's too), each on one window of zeros, in parallel
        threads: a build mostly waits on Triton's ptxas and C compiler processes, so the
        builds overlap, where a first forward would run them one after another. Arguments
        keep the real ones' dtypes and shapes' divisibility, so the real calls find the
        kernels built. other_builds (a caller's own) run in the same threads."""
        cfg, table = model.cfg, model.tok_emb.weight.detach()
        device, width = table.device, table.size(1)
        activations = functools.partial(torch.zeros, device=device, dtype=torch.bfloat16)
        ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
        zeros = torch.zeros(1, seq_len, width, device=device, dtype=table.dtype)
        # x0 as scoring will pass it: the gate by token gives a tensor formed in torch (`GPT.embed`)
        x0 = zeros if model.smear.width else SmearedEmbedding(zeros, float32_values(model.smear.gate, table))
        block = model.blocks[0]
        cos, sin = model.rotary(seq_len, device)  # the tables scoring will pass
        y = activations(1, queries, cfg.num_heads, cfg.head_dim)
        tasks = [
            lambda: model.embed(ids, self) if model.smear.width else
            self.embed(ids, table, activations(1, seq_len, width) if model.bigram is not None else None,
                       model.bigram.scale if model.bigram is not None else None, model.smear.gate),
            lambda: self.block_input(Residual(x0), x0, block.resid_mix, block.ln_scale_factor, keep_sum=True),
            lambda: self.head_prep(activations(1, seq_len, cfg.num_heads, cfg.head_dim), cos, sin, cfg.rope_dims,
                                   block.attn.q_gain),
            lambda: self.mlp_hidden(activations(1, seq_len, width), activations(cfg.mlp_dim, width),
                                    cfg.negative_slope),
        ]
        if cfg.xsa_last_n > 0:  # values in bf16, and in float32 where a value embedding was added
            dtypes = (torch.bfloat16, torch.float32) if model.ve_shared is not None else (torch.bfloat16,)
            tasks.append(lambda: [self.exclude_self_value(y, torch.zeros(1, queries, cfg.num_kv_heads, cfg.head_dim,
                                                                         device=device, dtype=dtype))
                                  for dtype in dtypes])
        if model.ve_shared is not None:
            shared = self.shared_values(activations(1, seq_len, cfg.kv_dim), model.ve_shared.scale)
            tasks.append(lambda: self.values(activations(1, seq_len, cfg.kv_dim),
                                             ValueInjection(shared, model.ve_layer_scales[0])))
        keys = model.last_block_reads(torch.zeros(1, queries, dtype=torch.long, device=device), seq_len)
        if keys is not None:  # the last block over the rows it reads, x0 given there
            rows = torch.zeros(1, keys.positions.size(1), width, device=device, dtype=table.dtype)
            tasks.append(lambda: self.block_input(Residual(rows), self.at_rows(x0, keys.positions), block.resid_mix,
                                                  block.ln_scale_factor, keep_sum=False))
        tasks += window_kernel_builds(cfg, model.attention_backend, seq_len, device, eager=True, backward=False)
        run_in_threads([*tasks, *other_builds], device)

    def embed(self, ids: Tensor, table: Tensor, bigram: Tensor | None, bigram_scale: Tensor | None,
              gate: Tensor, boundary: int = -1) -> SmearedEmbedding | Tensor:
        normed = kernels.embed_normed(ids, table, bigram, bigram_scale)
        if boundary >= 0:  # the kernels blend every position: x0 formed here, in float32, as they would
            return smear(normed.float(), gate.detach().float(), ids, boundary)
        return SmearedEmbedding(normed, gate.detach().float().contiguous())

    def block_input(self, stream: Residual, x0: SmearedEmbedding | Tensor, mix: Tensor, factor: Tensor,
                    keep_sum: bool) -> tuple[Tensor | None, Tensor, Tensor]:
        like = _activation(stream, x0)
        kept = torch.empty_like(like) if keep_sum else None
        x_in = torch.empty_like(like)
        normed = _stream_norm(stream, x0, factor, mix=mix, kept=kept, x_in=x_in)
        return kept, x_in, normed

    def residual_norm(self, stream: Residual, factor: Tensor) -> tuple[Residual, Tensor]:
        return stream, _stream_norm(stream, None, factor)

    def final_norm(self, stream: Residual) -> Tensor:
        return _stream_norm(stream, None, None)

    def at_rows(self, value: SmearedEmbedding | ScaledProjection, positions: Tensor) -> Tensor | ScaledProjection:
        """x0 at the rows as float32 values (what the kernels would form there), or the
        shared value embedding's projection at the rows."""
        if isinstance(value, ScaledProjection):
            return ScaledProjection(super().at_rows(value.projected, positions).contiguous(), value.scale)
        if isinstance(value, Tensor):  # x0 formed already (`embed` with a boundary token)
            return super().at_rows(value, positions).contiguous()
        return kernels.smeared_rows(value.normed, value.gate, positions)

    def shared_values(self, projected: Tensor, scale: Tensor) -> ScaledProjection:
        return ScaledProjection(projected.contiguous(), float32_values(scale, projected))

    def values(self, v: Tensor, injection: ValueInjection | None) -> tuple[Tensor, Tensor]:
        if injection is None:
            return v, v
        shared = injection.shared
        return kernels.add_values(v, shared.projected, shared.scale, float32_values(injection.layer_scale, v))

    def head_prep(self, x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int, gain: Tensor | None,
                  copies: int = 1) -> Tensor:
        tables = kernels.head_tables(x, cos, sin, rope_dims)
        if tables is None:
            return super().head_prep(x, cos, sin, rope_dims, gain, copies)
        return kernels.head_prep(x, *tables, gain, torch.bfloat16, copies=copies)

    def exclude_self_value(self, y: Tensor, v: Tensor) -> Tensor:
        out = kernels.exclude_self_value(y, v)
        return super().exclude_self_value(y, v) if out is None else out

    def leaky_square(self, h: Tensor, negative_slope: float) -> Tensor:
        return kernels.leaky_square(h, negative_slope, torch.bfloat16)

    def mlp_hidden(self, x: Tensor, up_w: Tensor, negative_slope: float) -> Tensor:
        out = kernels.leaky_square_matmul(x, up_w, negative_slope, self.tiles) if self.tiles is not None else None
        return super().mlp_hidden(x, up_w, negative_slope) if out is None else out

    def softcap(self, logits: Tensor, cap: float) -> Tensor:
        # times the reciprocal, as the compiled forward divides by a constant
        return (torch.tanh(logits.float() * (1.0 / cap)) * cap).to(logits.dtype)


def _activation(stream: Residual, x0: SmearedEmbedding | Tensor | None) -> Tensor:
    """A tensor of the stream's rows in its stored dtype (x0's normed embedding, or the
    stream's base): the shape of a step's outputs, and any tensor argument it does not use."""
    if isinstance(x0, SmearedEmbedding):
        return x0.normed
    return stream.base.normed if isinstance(stream.base, SmearedEmbedding) else stream.base


def _stream_norm(stream: Residual, x0: SmearedEmbedding | Tensor | None, factor: Tensor | None, *,
                 mix: Tensor | None = None, kept: Tensor | None = None, x_in: Tensor | None = None) -> Tensor:
    """`_stream_norm_kernel` over every row of the stream: returns normed (bf16, times factor
    if given); fills kept and x_in where given. x0 is the normed embedding and the gate, or
    its float32 values at the stream's rows (`FusedOps.at_rows`). Arguments the call does not
    use are filled with tensors of the used ones' dtypes, so that every call shares one
    compiled kernel (calls with float32 x0 values, a second one)."""
    if stream.skip_gate is not None:  # a gated skip: the sum formed in torch first
        stream = Residual(TORCH_OPS.stream_sum(stream).contiguous())
    if len(stream.deltas) > 2:
        raise ValueError(f"the fused residual stream sums at most two scaled terms, not {len(stream.deltas)}")
    base_is_x0 = isinstance(stream.base, SmearedEmbedding)
    x0 = stream.base if base_is_x0 else x0
    x0_stored = isinstance(x0, Tensor)
    like = _activation(stream, x0)
    factor = factor.float() if factor is not None else torch.ones((), device=like.device)  # any unused parameter
    deltas = [(delta.contiguous(), float32_values(scale, factor)) for delta, scale in stream.deltas]
    deltas += [(like, factor)] * (2 - len(deltas))
    flags = ((kernels.STREAM_BASE_IS_X0, base_is_x0), (kernels.STREAM_NEEDS_X0, x0 is not None),
             (kernels.STREAM_X0_STORED, x0_stored), (kernels.STREAM_DELTA1, len(stream.deltas) > 0),
             (kernels.STREAM_DELTA2, len(stream.deltas) > 1), (kernels.STREAM_MIX, mix is not None),
             (kernels.STREAM_KEEP, kept is not None),
             (kernels.STREAM_SKIP_ITSELF, stream.skip_weight is not None and stream.skip is None),
             (kernels.STREAM_SKIP_TENSOR, stream.skip_weight is not None and stream.skip is not None))
    mode = sum(flag.value for flag, on in flags if on)
    return kernels.stream_norm(
        like, like if base_is_x0 else stream.base.contiguous(), deltas,
        stream.skip.contiguous() if stream.skip is not None else like, float32_values(stream.skip_weight, factor),
        x0 if x0_stored else x0.normed if x0 is not None else like,
        x0.gate if isinstance(x0, SmearedEmbedding) else factor, float32_values(mix, factor),
        factor, kept if kept is not None else like, x_in if x_in is not None else like, mode)
