"""The GPT of the reference, with one trunk shared by the loss and the logits.

Matrices of all blocks live in four parameter banks (3-D tensors) so that Muon
orthogonalizes every layer in one batched call. Names, shapes and initialization follow
the reference, so its state dicts load with `strict=True`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig, parameter_estimate
from ..errors import ConfigError
from ..runtime import matmul_dtype, memory_bytes
from .attention import attention, attention_at, resolve_backend
from .ops import (TORCH_OPS, Residual, TorchOps, ValueInjection, embed_sum, gated_smear_with, pick_positions,
                  previous_positions, rms_norm, smear_with)
from .rotary import rotary_inv_freq, rotary_magnitude, rotary_tables
from .state_dict import BANK_NAMES, is_control_tensor
from .weight_grid import RowGrid

LinearObserver = Callable[[tuple[str, ...], Tensor], None]
# What an adapter (per-document LoRA in test-time training) adds to a matrix product: given
# the weight's name and the product's input [B, T, in], a tensor of the output's shape, or
# None where it adapts nothing.
LinearAdapter = Callable[[str, Tensor], "Tensor | None"]


def adapted(adapter: LinearAdapter | None, name: str, x: Tensor, out: Tensor) -> Tensor:
    """out, plus what the adapter adds for the weight `name` given the product's input x."""
    delta = adapter(name, x) if adapter is not None else None
    return out if delta is None else out + delta.to(out.dtype)


class CastedLinear(nn.Linear):
    """A linear layer whose float32 weight is cast to the activations' dtype."""

    @classmethod
    def uninitialized(cls, in_features: int, out_features: int) -> "CastedLinear":
        """One without bias whose weight is left to be loaded: no initialization runs (on
        the meta device it would import TorchDynamo, seconds on a CPU)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = in_features, out_features
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))
        layer.register_parameter("bias", None)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight.to(x.dtype), bias)


# --- Blocks ------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_dims = cfg.rope_dims
        self.projection_sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                                 cfg.num_kv_heads * cfg.head_dim)  # of q, k and v
        self.q_gain = nn.Parameter(torch.full((cfg.num_heads,), cfg.qk_gain_init, dtype=torch.float32))
        windowed = cfg.window_attn_size > 0 and layer in cfg.window_attn_layers
        self.window = cfg.window_attn_size if windowed else 0
        self.sinks = cfg.num_sink_tokens if windowed else 0
        self.use_xsa = layer >= cfg.num_layers - cfg.xsa_last_n
        # The sparse output gate: per head, from the first gate_width channels of the input.
        self.gate_width, self.gate_scale = cfg.attn_out_gate_width, cfg.attn_out_gate_scale
        self.attn_gate = (nn.Parameter(torch.zeros(cfg.num_heads, self.gate_width, dtype=torch.float32))
                          if self.gate_width > 0 else None)
        self.backend = "sdpa"
        self.kv_copies = 1  # each key and value head handed to the attention this many times (`GPT.copy_kv_heads`)
        self.observer: LinearObserver | None = None
        self.adapter: LinearAdapter | None = None
        self.kv_cache: Any = None  # set during incremental decoding (`generate.decoding.StaticCache`)

    def forward(self, x: Tensor, q_w: Tensor, k_w: Tensor | None, v_w: Tensor | None, out_w: Tensor,
                rotary: tuple[Tensor, Tensor], v_embed: ValueInjection | None, queries: Tensor | None = None,
                ops: TorchOps = TORCH_OPS, rows: Tensor | None = None, keys: KeyRows | None = None,
                onto: Tensor | None = None) -> Tensor:
        """Attention output at every position, or only at `queries` [B, K] (keys and values
        still come from every position). With `rows` [B, R]: attention at every position,
        the output kept only at those rows. With `keys`: x holds only the rows keys.positions
        of the sequences (rotary given there too) and queries index them; the attention sees
        their keys and values where the whole sequence's would be, so it adds as before.
        With `onto` (the block's input, at every position, no adapter): onto plus the output,
        summed in the output projection's product (`TorchOps.product_onto`)."""
        b, t, dim = x.shape
        self._observe(("c_q", "c_k", "c_v"), x)
        x_q = x if queries is None else pick_positions(x, queries)
        # q_w may stack the q, k and v matrices (`GPT.layer_weights`: k_w None): one product for the three, whose
        # queries and keys then go through one step together where the ops have one (`TorchOps.head_prep_pair`)
        paired = k_w is None and queries is None and self.adapter is None and ops.fused_head_pair is not None
        if paired:
            q_size, k_size, v_size = self.projection_sizes
            qk, v = ops.split_product(x, q_w, (q_size + k_size, v_size), "attention")
        elif k_w is None:
            q, k, v = self._adapted_qkv(x, x, *ops.split_product(x, q_w, self.projection_sizes, "attention"))
            q = q if queries is None else pick_positions(q, queries)
        else:
            q, k, v = (ops.product(x_q, q_w, "attention"), ops.product(x, k_w, "attention"),
                       ops.product(x, v_w, "attention"))
            q, k, v = self._adapted_qkv(x_q, x, q, k, v)
        v, v_xsa = ops.values(v, v_embed)
        v, v_xsa = (values.reshape(b, t, self.num_kv_heads, self.head_dim) for values in (v, v_xsa))
        copies = self.kv_copies if queries is None and self.kv_cache is None else 1
        v = v if copies == 1 else v.repeat_interleave(copies, dim=2)  # XSA keeps v_xsa's heads
        cos, sin = rotary
        if paired:
            q, k = ops.head_prep_pair(qk.unflatten(-1, (self.num_heads + self.num_kv_heads, self.head_dim)), cos, sin,
                                      self.rope_dims, self.q_gain, self.num_heads, copies)
        else:
            k = ops.head_prep(k.reshape(b, t, self.num_kv_heads, self.head_dim), cos, sin, self.rope_dims, None,
                              copies)
            q_cos, q_sin = (cos, sin) if queries is None else (table_rows(cos, queries), table_rows(sin, queries))
            q = ops.head_prep(q.reshape(b, x_q.size(1), self.num_heads, self.head_dim), q_cos, q_sin, self.rope_dims,
                              self.q_gain)
        if self.kv_cache is not None:  # new positions against the cached ones
            y, v_q = self.kv_cache.attend(q, k, v, self.window, self.sinks), v_xsa
        elif queries is None:
            y, v_q = attention(q, k, v, self.window, self.sinks, self.backend), v_xsa
            if rows is not None:
                y, v_q = pick_positions(y, rows), pick_positions(v_xsa, rows)
        elif keys is None:
            y, v_q = attention_at(q, k, v, queries, self.window, self.sinks), pick_positions(v_xsa, queries)
        else:
            y = attention_at(q, keys.spread(k), keys.spread(v), pick_positions(keys.positions, queries), self.window,
                             self.sinks)
            v_q = pick_positions(v_xsa, queries)
        gate = (None if self.attn_gate is None
                else self._gate(x_q if rows is None else pick_positions(x, rows), y.dtype))
        y = ops.attention_output(y, v_q if self.use_xsa else None, gate).reshape(b, y.size(1), dim)
        self._observe(("proj",), y)
        if onto is not None:
            return ops.product_onto(onto, y, out_w, "attention")
        return adapted(self.adapter, self._name("proj"), y, ops.product(y, out_w, "attention"))

    def _name(self, weight: str) -> str:
        return f"blocks.{self.layer}.attn.{weight}.weight"

    def _gate(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """Each head's output gate [B, T, H] in dtype: sigmoid(scale * its gate . x[..., :width]),
        x [B, T, dim] the attention's input at the outputs' positions."""
        logits = F.linear(x[..., :self.gate_width], self.attn_gate.to(x.dtype)) * self.gate_scale
        return torch.sigmoid(logits.float()).to(dtype)

    def _adapted_qkv(self, x_q: Tensor, x: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k and v, each plus what the adapter adds (q's input is x_q, k's and v's x)."""
        if self.adapter is None:
            return q, k, v
        return (adapted(self.adapter, self._name("c_q"), x_q, q), adapted(self.adapter, self._name("c_k"), x, k),
                adapted(self.adapter, self._name("c_v"), x, v))

    def _observe(self, weights: tuple[str, ...], x: Tensor) -> None:
        if self.observer is not None:
            self.observer(tuple(self._name(w) for w in weights), x.detach())


def table_rows(table: Tensor, positions: Tensor) -> Tensor:
    """A rotary table [1 or B, T, 1, R] at positions [B, K]: [B, K, 1, R]."""
    return pick_positions(table.expand(positions.size(0), *table.shape[1:]), positions)


@dataclass(frozen=True)
class KeyRows:
    """The rows of sequences of seq_len that a last block attending in windows reads when
    it serves a run of queries per sequence (`window_key_rows`)."""

    positions: Tensor  # [B, R] sequence positions, sorted (clamped into the sequence)
    valid: Tensor  # [B, R] which rows stand for their position (the others repeat one or lie outside)
    queries: Tensor  # [B, K] each query's index among the rows
    seq_len: int

    def spread(self, x: Tensor) -> Tensor:
        """x [B, R, ...] at the rows, placed at their positions in zeros [B, seq_len, ...]."""
        # rows that stand for no position go to one extra slot, cut off after
        index = torch.where(self.valid, self.positions, self.seq_len)
        index = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand_as(x)
        out = x.new_zeros(x.size(0), self.seq_len + 1, *x.shape[2:])
        return out.scatter(1, index, x)[:, :self.seq_len]


def window_key_rows(queries: Tensor, seq_len: int, window: int, sinks: int) -> KeyRows:
    """For queries [B, K] that lie within K consecutive positions of each sequence (a run,
    as sliding evaluation's rows do), the positions a layer attending in windows of `window`
    with `sinks` sink tokens reads: the sinks, then the window + K positions that end with
    the run. A sink the second part holds too (or that follows every query) is left out
    there; so is a position outside the sequence."""
    batch, count = queries.shape
    start = queries.min(dim=1, keepdim=True).values - window
    span = start + torch.arange(window + count, device=queries.device)
    sink = torch.arange(sinks, device=queries.device).expand(batch, sinks)
    positions = torch.cat([sink, span], dim=1)
    valid = torch.cat([sink < start, (span >= 0) & (span < seq_len)], dim=1)
    return KeyRows(positions.clamp(0, seq_len - 1), valid, sinks + queries - start, seq_len)


class MLP(nn.Module):
    """LeakyReLU(slope) squared."""

    def __init__(self, layer: int, negative_slope: float):
        super().__init__()
        self.layer = layer
        self.negative_slope = negative_slope
        self.observer: LinearObserver | None = None
        self.adapter: LinearAdapter | None = None

    def forward(self, x: Tensor, up_w: Tensor, down_w: Tensor, ops: TorchOps = TORCH_OPS) -> Tensor:
        if self.adapter is None and self.observer is None:
            return ops.mlp(x, up_w, down_w, self.negative_slope)
        self._observe("fc", x)
        if self.adapter is None:
            hidden = ops.mlp_hidden(x, up_w, self.negative_slope)
        else:  # the adapter's term joins the product before the activation
            hidden = ops.leaky_square(adapted(self.adapter, self._name("fc"), x, F.linear(x, up_w)),
                                      self.negative_slope)
        self._observe("proj", hidden)
        return adapted(self.adapter, self._name("proj"), hidden, F.linear(hidden, down_w))

    def _name(self, weight: str) -> str:
        return f"blocks.{self.layer}.mlp.{weight}.weight"

    def _observe(self, weight: str, x: Tensor) -> None:
        if self.observer is not None:
            self.observer((self._name(weight),), x.detach())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        dim = cfg.model_dim
        self.attn = CausalSelfAttention(cfg, layer)
        self.mlp = MLP(layer, cfg.negative_slope)
        self.attn_scale = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.mlp_scale = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        mix = torch.zeros(2, dim, dtype=torch.float32)  # rows (1, 0): not torch.stack, which on the
        mix[0] = 1.0  # meta device (`artifacts.shapes`) imports TorchDynamo, seconds on a CPU
        self.resid_mix = nn.Parameter(mix)
        self.parallel_mlp_reads_x0 = cfg.parallel_mlp_reads_x0
        # A tensor, not a Python float: a compiled model then has one set of kernels for all
        # its blocks, instead of one per layer with its factor written into the code.
        self.ln_factor = 1.0 / math.sqrt(layer + 1) if cfg.ln_scale else 1.0
        self.register_buffer("ln_scale_factor", torch.tensor(self.ln_factor, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def restore_constants(self) -> None:
        """Set the tensors a state dict does not hold (a loader that builds on the meta
        device leaves them unset)."""
        self.ln_scale_factor.fill_(self.ln_factor)

    def forward(self, stream: Residual, x0: Any, weights: tuple[Tensor | None, ...], rotary: tuple[Tensor, Tensor],
                v_embed: ValueInjection | None, queries: Tensor | None = None, ops: TorchOps = TORCH_OPS,
                keep_input: bool = False, rows: Tensor | None = None,
                keys: KeyRows | None = None, fold_scales: bool = False) -> tuple[Tensor | None, Residual]:
        """(the stream's sum at the block's input if keep_input, the stream at its output),
        at every position or, with `queries` [B, K] (or `rows`, see `CausalSelfAttention`),
        only there. fold_scales: see `output_weights`."""
        q_w, k_w, v_w, out_w, up_w, down_w = weights
        out_w, down_w, attn_scale, mlp_scale = self.output_weights(out_w, down_w, fold_scales)
        kept, x_in, normed = ops.block_input(stream, x0, self.resid_mix, self.ln_scale_factor, keep_input)
        # the input added in the output product: with the scale folded (so no adapter), at every position
        everywhere = queries is None and rows is None and keys is None
        onto = x_in if ops.sum_in_product and attn_scale is None and everywhere else None
        attn_out = self.attn(normed, q_w, k_w, v_w, out_w, rotary, v_embed, queries, ops, rows, keys, onto)
        if queries is not None or rows is not None:
            x_in = pick_positions(x_in, queries if queries is not None else rows)
        summed = Residual(attn_out) if onto is not None else Residual(x_in).plus(attn_out, attn_scale)
        stream, normed = ops.residual_norm(summed, self.ln_scale_factor)
        mlp_out = self.mlp(normed, up_w, down_w, ops)
        return kept, stream.plus(mlp_out, mlp_scale)

    def output_weights(self, out_w: Tensor, down_w: Tensor, fold_scales: bool
                       ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(out_w, down_w, attn_scale, mlp_scale) as the block applies them. With fold_scales
        (and no adapter, whose term the scale multiplies as well) each output scale is
        multiplied into its projection's rows, a product over the weights instead of the
        [tokens x dim] outputs, and comes back None: the same function, rounded elsewhere."""
        if not fold_scales or self.attn.adapter is not None or self.mlp.adapter is not None:
            return out_w, down_w, self.attn_scale, self.mlp_scale
        return (out_w * self.attn_scale.to(out_w.dtype)[:, None], down_w * self.mlp_scale.to(down_w.dtype)[:, None],
                None, None)

    def parallel(self, lanes: tuple[Residual, Residual], x0: Any, weights: tuple[Tensor | None, ...],
                 rotary: tuple[Tensor, Tensor], v_embed: ValueInjection | None, mix: Tensor,
                 queries: Tensor | None = None, ops: TorchOps = TORCH_OPS,
                 fold_scales: bool = False) -> tuple[Residual, Residual]:
        """The block on two lanes side by side: the attention reads the first lane, the MLP
        the second (each mixed with x0 and normed as a block's input; the MLP's lane unmixed
        where parallel_mlp_reads_x0 is off), and lane k becomes
        mix[2, k] * lane_k + mix[0, k] * attention + mix[1, k] * MLP (mix [3, 2]: the block's
        learned lane mix, `GPT.lane_mix`). With queries, only there."""
        q_w, k_w, v_w, out_w, up_w, down_w = weights
        out_w, down_w, attn_scale, mlp_scale = self.output_weights(out_w, down_w, fold_scales)
        lane0, _, normed_attn = ops.block_input(lanes[0], x0, self.resid_mix, self.ln_scale_factor, True)
        mlp_mix = self.resid_mix if self.parallel_mlp_reads_x0 else torch.cat(  # (1, 0): the lane alone, through
            (torch.ones_like(self.resid_mix[:1]), torch.zeros_like(self.resid_mix[1:])))  # the same kernels
        lane1, _, normed_mlp = ops.block_input(lanes[1], x0, mlp_mix, self.ln_scale_factor, True)
        attn_out = self.attn(normed_attn, q_w, k_w, v_w, out_w, rotary, v_embed, queries, ops)
        if queries is not None:
            lane0, lane1, normed_mlp = (pick_positions(t, queries) for t in (lane0, lane1, normed_mlp))
        mlp_out = self.mlp(normed_mlp, up_w, down_w, ops)
        dtype = lane0.dtype
        outputs = tuple(out if scale is None else scale.to(dtype) * out
                        for out, scale in ((attn_out, attn_scale), (mlp_out, mlp_scale)))
        mix = mix.to(dtype)
        return tuple(Residual(mix[2, k] * lane + mix[0, k] * outputs[0] + mix[1, k] * outputs[1])
                     for k, lane in enumerate((lane0, lane1)))


# --- Embeddings --------------------------------------------------------------------------

class SmearGate(nn.Module):
    """How each position of x0 takes in the one before it (`ModelConfig.smear_gate_width`):
    the reference's learned per-channel blend of the normed embeddings (`gate` [dim]), or,
    with a width N, the final records' gate by token on the embeddings before their norm,
    x + scale * sigmoid(gate . x[:N]) * x_prev, then normed (`gate` [N] and `scale` zero at
    first: no smear). The reference's form runs in `TorchOps.embed` (and the fused scoring
    kernels); the other is formed in torch here, for every path."""

    def __init__(self, dim: int, width: int = 0):
        super().__init__()
        self.width = width
        self.gate = nn.Parameter(torch.zeros(width or dim, dtype=torch.float32))
        self.scale = nn.Parameter(torch.zeros(1, dtype=torch.float32)) if width else None

    def source(self, summed: Tensor) -> Tensor:
        """What the smear blends, from the summed embeddings: normed for the reference's form."""
        return summed if self.width else rms_norm(summed)

    def blend(self, x: Tensor, x_prev: Tensor, ids: Tensor | None = None, boundary: int = -1) -> Tensor:
        """x0 from each position's source x and its predecessor's x_prev (decoding keeps it)."""
        if not self.width:
            return smear_with(x, x_prev, self.gate, ids, boundary)
        return rms_norm(gated_smear_with(x, x_prev, self.gate, self.scale, ids, boundary))

    def forward(self, x: Tensor, ids: Tensor | None = None, boundary: int = -1) -> Tensor:
        """x0 from the sources x [B, T, D] of whole sequences: each blended with the one before."""
        return self.blend(x, previous_positions(x), ids, boundary)


class ProjectedEmbedding(nn.Module):
    """A low-dimensional embedding table projected to out_dim, and a learned scale that the
    step adding the embedding applies (`TorchOps.embed`, `TorchOps.shared_values`)."""

    def __init__(self, num: int, dim: int, out_dim: int, scale: float, init_embed: Callable[[Tensor], object],
                 initialize: bool = True):
        super().__init__()
        self.embed = embedding(num, dim, initialize)
        if initialize:
            init_embed(self.embed.weight)  # before the projection exists: keeps the reference's draw order
        self.proj = linear(dim, out_dim, initialize) if dim != out_dim else None
        if self.proj is not None and initialize:
            nn.init.zeros_(self.proj.weight)
        self.scale = nn.Parameter(torch.tensor(scale, dtype=torch.float32))

    def forward(self, ids: Tensor) -> Tensor:
        """The looked-up rows, projected but not yet scaled."""
        h = self.embed(ids)
        return self.proj(h) if self.proj is not None else h


def embedding(num: int, dim: int, initialize: bool) -> nn.Embedding:
    """An embedding table; initialize=False leaves it to be loaded (see CastedLinear.uninitialized)."""
    return nn.Embedding(num, dim) if initialize else nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def linear(in_features: int, out_features: int, initialize: bool) -> CastedLinear:
    if initialize:
        return CastedLinear(in_features, out_features, bias=False)
    return CastedLinear.uninitialized(in_features, out_features)


class BigramHashEmbedding(ProjectedEmbedding):
    """An embedding of (previous token, token) pairs hashed into a small table."""

    def __init__(self, buckets: int, dim: int, model_dim: int, initialize: bool = True, boundary: int = -1):
        super().__init__(buckets, dim, model_dim, scale=0.05, init_embed=nn.init.zeros_, initialize=initialize)
        self.buckets = buckets
        self.boundary = boundary  # a token (>= 0) whose position has no predecessor, as the first has none

    def hash(self, tokens: Tensor) -> Tensor:
        t = tokens.to(torch.int32)
        out = torch.empty_like(t)
        out[..., 0] = self.buckets - 1  # the first position has no predecessor
        out[..., 1:] = self.pair_hash(t[..., :-1], t[..., 1:])
        return out.long()

    def pair_hash(self, previous: Tensor, tokens: Tensor) -> Tensor:
        """The bucket of each (previous token, token) pair (int32 arithmetic, as the reference)."""
        pairs = torch.bitwise_xor(36313 * tokens.to(torch.int32), 27191 * previous.to(torch.int32)) % (self.buckets - 1)
        if self.boundary >= 0:
            pairs = torch.where(tokens == self.boundary, self.buckets - 1, pairs)
        return pairs

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(self.hash(tokens))

    def of_pairs(self, previous: Tensor, tokens: Tensor) -> Tensor:
        """The embedding of given pairs (decoding knows each token's predecessor)."""
        return super().forward(self.pair_hash(previous, tokens).long())


class ValueEmbedding(ProjectedEmbedding):
    """Token identity re-injected into the attention values of chosen layers."""

    def __init__(self, vocab_size: int, dim: int, kv_dim: int, initialize: bool = True):
        super().__init__(vocab_size, dim, kv_dim, scale=0.1, init_embed=lambda w: nn.init.normal_(w, std=0.01),
                         initialize=initialize)


# --- The model ---------------------------------------------------------------------------

ROTARY_CACHE_MAX_LEN = 1 << 16  # longest training length whose rotary tables the model keeps


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, initialize: bool = True):
        """initialize=False skips the reference's initialization, for weights loaded next."""
        super().__init__()
        self.cfg = cfg
        n, dim = cfg.num_layers, cfg.model_dim
        # Creation order matters: it fixes which random numbers each tensor's init draws.
        self.tok_emb = embedding(cfg.vocab_size, dim, initialize)
        self.bigram = (BigramHashEmbedding(cfg.bigram_vocab_size, cfg.bigram_dim, dim, initialize,
                                           cfg.doc_boundary_token)
                       if cfg.bigram_vocab_size > 0 else None)
        self.smear = SmearGate(dim, cfg.smear_gate_width)
        # U-Net skips pair the first half of the blocks run with the second (depth recurrence
        # runs more of them: enough skip weights for its longer order).
        steps = len(cfg.block_order())
        self.skip_weights = nn.Parameter(torch.ones(min(steps // 2, steps - steps // 2), dim))
        self.recurring = True  # depth recurrence on (training turns it on part way; see block_order)
        # Quantization-aware training: each bank's grid (None: stays float), applied while
        # rounding_weights is on (training turns it on part way; see layer_weights).
        self.weight_grids: tuple[RowGrid | None, ...] | None = None
        self.rounding_weights = False
        self.fused_loss = False  # the training loss through kernels.cross_entropy (training sets it)
        self.loss_chunk_rows = 0  # with fused_loss: the output layer and loss over chunks of rows (training sets it)
        self.train_ops: TorchOps | None = None  # the training forward's steps, if not torch's (training sets it)
        self.fold_output_scales = False  # the training forward's output scales in its weights (training sets it)
        self.stack_qkv = False  # the training forward's q, k and v in one product (training sets it)
        # forward runs through train_ops while this is on (training turns it off to validate
        # where they change the numbers: float8 products)
        self.train_ops_on = True
        self.qo_bank = nn.Parameter(torch.empty(2 * n, dim, dim))
        self.kv_bank = nn.Parameter(torch.empty(2 * n, cfg.kv_dim, dim))
        self.mlp_up_bank = nn.Parameter(torch.empty(n, cfg.mlp_dim, dim))
        self.mlp_down_bank = nn.Parameter(torch.empty(n, dim, cfg.mlp_dim))
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(n)])
        self.ve_layer_indices = list(cfg.ve_layers) if cfg.ve_enabled else []
        self.ve_shared = (ValueEmbedding(cfg.vocab_size, cfg.ve_dim, cfg.kv_dim, initialize)
                          if self.ve_layer_indices else None)
        self.ve_layer_scales = nn.ParameterList(
            [nn.Parameter(torch.ones(1, dtype=torch.float32)) for _ in self.ve_layer_indices])
        self.lm_head = None if cfg.tie_embeddings else linear(dim, cfg.vocab_size, initialize)
        self.skip_gates = nn.Parameter(torch.zeros_like(self.skip_weights)) if cfg.skip_gates else None
        # Each parallel block's lane mix: rows 0 and 1 how its attention and its MLP add to each
        # lane (ones at first), row 2 how much of each lane it keeps (1.1 at first).
        parallel = n - cfg.parallel_start_layer if cfg.parallel_start_layer > 0 else 0
        mix = torch.ones(parallel, 3, 2, dtype=torch.float32)
        mix[:, 2] = 1.1
        self.lane_mix = nn.Parameter(mix) if parallel else None
        self.head_observer: LinearObserver | None = None  # GPTQ calibration of the output layer
        self.head_adapter: LinearAdapter | None = None
        # cos and sin up to the training length, made once: a compiled step reads them as
        # inputs instead of computing them again (sequences longer than that are computed per call)
        cos, sin = self._rotary_base_tables()
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        if initialize:
            self._init_weights()

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def rotary_dims(self) -> int:
        return self.cfg.rope_dims or self.cfg.head_dim

    def _init_weights(self) -> None:
        cfg, n = self.cfg, self.cfg.num_layers
        if cfg.tie_embeddings:
            nn.init.normal_(self.tok_emb.weight, mean=0.0, std=cfg.tied_embed_init_std)
        proj_scale = 1.0 / math.sqrt(2 * n)
        for i in range(n):  # output projections start at zero
            nn.init.orthogonal_(self.qo_bank.data[i])
            nn.init.zeros_(self.qo_bank.data[n + i])
            nn.init.orthogonal_(self.kv_bank.data[i])
            nn.init.orthogonal_(self.kv_bank.data[n + i])
            nn.init.orthogonal_(self.mlp_up_bank.data[i])
            nn.init.zeros_(self.mlp_down_bank.data[i])
            self.qo_bank.data[n + i].mul_(proj_scale)
            self.mlp_down_bank.data[i].mul_(proj_scale)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head:
                    nn.init.zeros_(module.weight)
                elif module.weight.shape[0] >= 64 and module.weight.shape[1] >= 64:
                    nn.init.orthogonal_(module.weight)

    # --- backends and observation ---

    @torch.no_grad()
    def restore_constants(self) -> None:
        """The tensors a state dict does not hold, set from the configuration again."""
        for block in self.blocks:
            block.restore_constants()
        cos, sin = self._rotary_base_tables()
        self.rotary_cos.copy_(cos)
        self.rotary_sin.copy_(sin)

    def _rotary_base_tables(self) -> tuple[Tensor, Tensor]:
        """cos and sin of positions 0 .. rope_train_seq_len - 1 (none past ROTARY_CACHE_MAX_LEN),
        on the CPU also where the model is built on the meta device (whose sin and cos would
        import TorchDynamo, seconds on a CPU)."""
        length = self.cfg.rope_train_seq_len if self.cfg.rope_train_seq_len <= ROTARY_CACHE_MAX_LEN else 0
        return self._rotary_tables(length, torch.device("cpu"))

    def _rotary_tables(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin of a sequence of seq_len tokens, rescaled beyond the training length."""
        cfg = self.cfg
        inv_freq = rotary_inv_freq(self.rotary_dims, cfg.rope_base, seq_len, cfg.rope_train_seq_len, device=device,
                                   scaling=cfg.rope_scaling)
        cos, sin = rotary_tables(seq_len, inv_freq)
        magnitude = rotary_magnitude(seq_len, cfg.rope_train_seq_len, cfg.rope_scaling)
        return (cos * magnitude, sin * magnitude) if magnitude != 1.0 else (cos, sin)

    def set_attention_backend(self, name: str, device: torch.device, training: bool = False) -> str:
        backend = resolve_backend(name, device, training)
        for block in self.blocks:
            block.attn.backend, block.attn.kv_copies = backend, 1
        return backend

    def copy_kv_heads(self) -> list[int]:
        """Hands the layers that attend in windows through FA4 (the backend fa4) keys and
        values of as many heads as the queries, each head once per query head of its group,
        so that FA4's backward writes their gradients directly instead of summing each
        group's in float32 and converting them after; the same function. Returns those
        layers (none without grouped heads). Undone by `set_attention_backend`."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        for block in self.blocks:
            attn = block.attn
            attn.kv_copies = group if attn.window > 0 and attn.backend == "fa4" else 1
        return [block.attn.layer for block in self.blocks if block.attn.kv_copies > 1]

    @property
    def attention_backend(self) -> str:
        return self.blocks[0].attn.backend

    @contextlib.contextmanager
    def observe_linear_inputs(self, callback: LinearObserver, head: bool = False) -> Iterator[None]:
        """Call callback(weight_names, x) with the input of every block matrix (for GPTQ),
        and with head, of the output layer too."""
        modules = [m for block in self.blocks for m in (block.attn, block.mlp)]
        for m in modules:
            m.observer = callback
        self.head_observer = callback if head else None
        try:
            yield
        finally:
            for m in modules:
                m.observer = None
            self.head_observer = None

    @property
    def head_name(self) -> str:
        """The output layer's weight: the tied embedding's or the head's own."""
        return "tok_emb.weight" if self.lm_head is None else "lm_head.weight"

    @contextlib.contextmanager
    def adapt_linears(self, adapter: LinearAdapter) -> Iterator[None]:
        """Every block matrix's product, and the output layer's, plus what adapter adds."""
        modules = [m for block in self.blocks for m in (block.attn, block.mlp)]
        for m in modules:
            m.adapter = adapter
        self.head_adapter = adapter
        try:
            yield
        finally:
            for m in modules:
                m.adapter = None
            self.head_adapter = None

    # --- forward ---

    def layer_weights(self, dtype: torch.dtype, stack_qkv: bool = False) -> list[tuple[Tensor | None, ...]]:
        """Each layer's (q, k, v, out, up, down) matrices in `dtype`: slices of the banks,
        each bank cast once (one kernel per bank, not one per slice). stack_qkv: q, k and v
        stacked into one matrix in q's place (k and v None), for a decoder, whose one-token
        steps are bound by the number of kernels more than by their work. With rounding_weights,
        the matrices are rounded to their banks' grids, gradients passing straight through."""
        banks: tuple[Tensor, ...] = (self.qo_bank, self.kv_bank, self.mlp_up_bank, self.mlp_down_bank)
        if self.rounding_weights and self.weight_grids is not None:
            banks = tuple(b if grid is None else grid.snap(b) for grid, b in zip(self.weight_grids, banks))
        qo, kv, up, down = (bank.to(dtype) for bank in banks)
        n = self.num_layers
        if stack_qkv:
            return [(torch.cat((qo[i], kv[i], kv[n + i])), None, None, qo[n + i], up[i], down[i]) for i in range(n)]
        return [(qo[i], kv[i], kv[n + i], qo[n + i], up[i], down[i]) for i in range(n)]

    def embed(self, input_ids: Tensor, ops: TorchOps = TORCH_OPS) -> Any:
        """x0: token and bigram embeddings, normed, each position blended with the previous."""
        bigram, bigram_scale = None, None
        if self.bigram is not None:
            bigram, bigram_scale = self.bigram(input_ids), self.bigram.scale
        if self.smear.width:  # formed in torch, a tensor x0 that every ops takes
            return self.smear(embed_sum(input_ids, self.tok_emb.weight, bigram, bigram_scale), input_ids,
                              self.cfg.doc_boundary_token)
        return ops.embed(input_ids, self.tok_emb.weight, bigram, bigram_scale, self.smear.gate,
                         self.cfg.doc_boundary_token)

    def hidden_states(self, input_ids: Tensor, queries: Tensor | None = None, ops: TorchOps = TORCH_OPS,
                      query_runs: bool = False, fold_scales: bool = False) -> Tensor:
        """The trunk: final-normed hidden states [B, T, model_dim], or [B, K, model_dim] at
        queries [B, K] only (the last block then runs its queries and MLP only there). With
        query_runs (each sequence's queries lie within K consecutive positions) and a last
        block that attends in windows, the block before it runs everything after its
        attention only at the rows the last block reads (`window_key_rows`), and the last
        block only over those.

        The encoder's outputs come back in reverse order as skips into the decoder. An
        encoder block's output is the next block's input sum, kept when that block forms it;
        the last one is the first decoder block's own input sum, so that block adds its sum
        to itself. fold_scales: see `Block.output_weights`."""
        x0 = self.embed(input_ids, ops)
        return self.trunk(input_ids, x0, self.rotary(input_ids.shape[1], input_ids.device), queries, ops, query_runs,
                          fold_scales=fold_scales)

    def rotary(self, seq_len: int, device: torch.device, start: int = 0) -> tuple[Tensor, Tensor]:
        """cos and sin at positions start..seq_len - 1 of a sequence of seq_len tokens: up to
        the training length (where no rescaling applies) slices of the tables made once."""
        if seq_len <= self.rotary_cos.shape[1] and self.rotary_cos.device == device:
            return self.rotary_cos[:, start:seq_len], self.rotary_sin[:, start:seq_len]
        cos, sin = self._rotary_tables(seq_len, device)
        return cos[:, start:], sin[:, start:]

    def trunk(self, input_ids: Tensor, x0: Any, rotary: tuple[Tensor, Tensor], queries: Tensor | None = None,
              ops: TorchOps = TORCH_OPS, query_runs: bool = False,
              weights: list[tuple[Tensor | None, ...]] | None = None, fold_scales: bool = False) -> Tensor:
        """The blocks and the final norm over the positions of input_ids, whose x0 and rotary
        tables are given (see `hidden_states`); weights: `layer_weights`, cast already (a
        decoder casts them once, not at every token)."""
        ve_shared = None
        if self.ve_shared is not None:
            ve_shared = ops.shared_values(self.ve_shared(input_ids), self.ve_shared.scale)
        weights = weights or self.layer_weights(matmul_dtype(self.tok_emb.weight), self.stack_qkv)
        stream, skips = Residual(x0), []
        order = self.cfg.block_order(self.recurring)
        encoder, last = len(order) // 2, len(order) - 1  # steps of the order, not layers
        keys = self.last_block_reads(queries, input_ids.shape[1]) if query_runs and queries is not None else None
        lanes: tuple[Residual, Residual] | None = None  # from parallel_start_layer on
        for i, layer in enumerate(order):
            block = self.blocks[layer]
            skip = self._skip_into(i, encoder, skips, keys if i == last else None)
            injection = self._value_injection(layer, ve_shared)
            if lanes is not None or self._is_parallel(layer):
                lanes = lanes or (stream, stream)  # the skip goes into the attention's lane
                lanes = block.parallel((lanes[0].plus_skip(*skip) if skip else lanes[0], lanes[1]), x0,
                                       weights[layer], rotary, injection,
                                       self.lane_mix[layer - self.cfg.parallel_start_layer],
                                       queries if i == last else None, ops, fold_scales)
                continue
            if skip:
                stream = stream.plus_skip(*skip)
            keep = 0 < i < encoder
            if keys is None:
                kept, stream = block(stream, x0, weights[layer], rotary, injection, queries if i == last else None,
                                     ops, keep_input=keep, fold_scales=fold_scales)
            elif i == last - 1:  # past its attention, this block runs only where the last one reads
                kept, stream = block(stream, x0, weights[layer], rotary, injection, ops=ops, keep_input=keep,
                                     rows=keys.positions, fold_scales=fold_scales)
                x0 = ops.at_rows(x0, keys.positions)
                ve_shared = ops.at_rows(ve_shared, keys.positions) if ve_shared is not None else None
                rotary = (table_rows(rotary[0], keys.positions), table_rows(rotary[1], keys.positions))
            else:
                kept, stream = block(stream, x0, weights[layer], rotary, injection,
                                     keys.queries if i == last else None, ops, keep_input=keep,
                                     keys=keys if i == last else None, fold_scales=fold_scales)
            if keep:
                skips.append(kept)
        if lanes is not None:  # the two lanes' mean
            stream = Residual(0.5 * (ops.stream_sum(lanes[0]) + ops.stream_sum(lanes[1])))
        return ops.final_norm(stream)

    def _skip_into(self, i: int, encoder: int, skips: list[Tensor], keys: KeyRows | None) -> tuple[Any, ...] | None:
        """What step i's input adds from the first `encoder` steps: (the skip, or None for the
        stream itself, its weight, its gate) for `Residual.plus_skip`; None for none. Pops
        the skip it uses."""
        if i == encoder and encoder > 0:  # the last encoder block's output: this block's input
            return None, self.skip_weights[0], self._skip_gate(0)
        if i > encoder and skips:
            skip = skips.pop()
            if keys is not None:
                skip = pick_positions(skip, keys.positions)
            return skip, self.skip_weights[i - encoder], self._skip_gate(i - encoder)
        return None

    def _skip_gate(self, index: int) -> Tensor | None:
        return self.skip_gates[index] if self.skip_gates is not None else None

    def _is_parallel(self, i: int) -> bool:
        return 0 < self.cfg.parallel_start_layer <= i

    def last_block_reads(self, queries: Tensor, seq_len: int) -> KeyRows | None:
        """The rows the last block reads for runs of queries (`window_key_rows`), where it
        attends in windows and they are fewer than the sequence; else None."""
        attn = self.blocks[-1].attn
        if self.num_layers < 2 or attn.window <= 0 or self.lane_mix is not None \
                or attn.sinks + attn.window + queries.size(1) >= seq_len:
            return None
        return window_key_rows(queries, seq_len, attn.window, attn.sinks)

    def _value_injection(self, layer: int, ve_shared: Any) -> ValueInjection | None:
        if ve_shared is None or layer not in self.ve_layer_indices:
            return None
        return ValueInjection(ve_shared, self.ve_layer_scales[self.ve_layer_indices.index(layer)])

    def logits(self, hidden: Tensor, ops: TorchOps = TORCH_OPS) -> Tensor:
        """Soft-capped logits for hidden states of any leading shape."""
        return ops.softcap(self._head(hidden), self.cfg.logit_softcap)

    def _head(self, hidden: Tensor) -> Tensor:
        """The output layer's logits before the soft cap."""
        weight = self._head_weight()
        if self.head_observer is not None:
            self.head_observer((self.head_name,), hidden.detach())
        return adapted(self.head_adapter, self.head_name, hidden, F.linear(hidden, weight.to(hidden.dtype)))

    def _head_weight(self) -> Tensor:
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def forward_logits(self, input_ids: Tensor) -> Tensor:
        return self.logits(self.hidden_states(input_ids))

    def token_nll(self, input_ids: Tensor, target_ids: Tensor) -> Tensor:
        """Per-token cross-entropy [B, T] in float32."""
        logits = self.forward_logits(input_ids)
        return F.cross_entropy(logits.float().flatten(0, 1), target_ids.flatten(), reduction="none").view_as(target_ids)

    def logits_at(self, input_ids: Tensor, positions: Tensor, ops: TorchOps = TORCH_OPS,
                  query_runs: bool = False) -> Tensor:
        """Logits [B, K, V] at positions[b, k] of input_ids[b]: the trunk runs over whole
        windows, the last block's queries, its MLP and the output layer only where a
        prediction is scored (query_runs: see `hidden_states`)."""
        return self.logits(self.hidden_states(input_ids, positions, ops, query_runs), ops)

    def forward(self, input_ids: Tensor, target_ids: Tensor, ops: TorchOps = TORCH_OPS) -> Tensor:
        """Mean cross-entropy, as the reference's training forward (with fused_loss, the soft
        cap and the cross-entropy as one kernel each way, `kernels.cross_entropy`, and with
        loss_chunk_rows the output layer with them over chunks of rows; with train_ops, while
        train_ops_on, its steps run through those ops; with fold_output_scales, each block's
        output scales multiply its weights, `Block.output_weights`)."""
        if ops is TORCH_OPS and self.train_ops is not None and self.train_ops_on:
            ops = self.train_ops
        hidden = self.hidden_states(input_ids, ops=ops, fold_scales=self.fold_output_scales).flatten(0, 1)
        if self.fused_loss:
            from ..kernels import cross_entropy  # imports Triton: only when used

            targets, cap = target_ids.reshape(-1), self.cfg.logit_softcap
            if self.loss_chunk_rows and self.head_adapter is None and self.head_observer is None:
                total = cross_entropy.head_softcap_cross_entropy(hidden, self._head_weight(), targets, cap,
                                                                 self.loss_chunk_rows)
            else:
                total = cross_entropy.softcap_cross_entropy(self._head(hidden), targets, cap).sum()
            return total / (targets >= 0).sum()  # F.cross_entropy's mean: over the targets not ignored
        logits = self.logits(hidden, ops)
        return F.cross_entropy(logits.float(), target_ids.reshape(-1), reduction="mean")


def check_fits(cfg: ModelConfig, device: torch.device, bytes_per_parameter: int, what: str) -> None:
    """ConfigError, with the estimate, when the model's parameters alone would not fit in
    the device's memory at bytes_per_parameter each (so that nothing is allocated first)."""
    need, have = parameter_estimate(cfg) * bytes_per_parameter, memory_bytes(device)
    if have is not None and need > have:
        raise ConfigError(f"the model's {parameter_estimate(cfg):,} parameters need about {need / 2**30:.1f} GiB "
                          f"to {what}, more than the {have / 2**30:.1f} GiB {device} has; choose a smaller model")


def build_model(cfg: ModelConfig, device: torch.device, initialize: bool = True) -> GPT:
    """Build on the CPU (so initialization draws the same numbers everywhere), then move.
    On CUDA the reference's dtypes apply (`use_cuda_dtypes`); on the CPU all is float32.
    initialize=False leaves the weights to be loaded (`load_state_dict`)."""
    model = GPT(cfg, initialize)
    if device.type == "cuda":
        use_cuda_dtypes(model)
    return model.to(device)


def use_cuda_dtypes(model: GPT) -> None:
    """The reference's dtype policy: embedding tables in bf16; banks, linear weights, control
    and low-dimensional tensors in float32, their values rounded to bf16 first as the
    reference's model.bfloat16() does. Buffers (constants such as ln_scale_factor) are kept
    exact in float32."""
    for name, p in model.named_parameters():
        p.data = p.data.bfloat16()
        if name in BANK_NAMES or p.ndim < 2 or is_control_tensor(name) or _is_linear_weight(model, name):
            p.data = p.data.float()


def _is_linear_weight(model: GPT, name: str) -> bool:
    module_name = name.rsplit(".", 1)[0]
    return isinstance(model.get_submodule(module_name), nn.Linear) if "." in name else False
