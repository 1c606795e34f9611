"""Fused GPU kernels for the element-wise steps of an inference forward (Triton), and
the functions that launch them on plain tensors (`model.fused_ops.FusedOps` calls them for
the model's steps).

They round as the compiled forward does (Inductor, which the reference's own evaluation
runs): arithmetic in float32 from the stored values, rounded only where the compiled forward
stores a tensor. So the residual stream is summed afresh from its bf16 parts where it is
read, x0 is formed again from the normed embedding in every block, and a rotation's four
products are each rounded before their sums. On the reference's weights, sliding evaluation
then gives the reference's val_bpb to within 1e-8; eager torch, which rounds after every
operation, is 3e-5 away.

Importing this module imports Triton; `runtime.triton_available` says whether its kernels
can run. Nothing here knows the model: the launchers take tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..runtime import has_tma

FLOAT32_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default epsilon for float32
NORMALIZE_EPS = 1e-12  # F.normalize's
# Rows per program: a program per row of a million-row batch would spend its time starting.
STREAM_ROWS, STREAM_WARPS = 4, 4  # rows of the residual stream (model_dim wide), warps per program
HEAD_ROWS, HEAD_WARPS = 32, 4  # rows of one head (head_dim wide)
ELEMENTS = 4096  # elements per program of an element-wise kernel


@dataclass(frozen=True)
class HeadLaunch:
    """Positions per program and warps of a kernel that loops over each position's heads
    (`head_prep`, `elementwise_backward.head_prep_backward`; bench/head_kernels_speed.py
    times others). 16 positions: the backward 14% faster than with 32 on an H200, the
    forward the same. `rotated_apart`: the forward computes a head's rotated channels in a
    block of their own, 2 * ROPE_HALF wide, and only norms and scales the others, so that the
    rotation's arithmetic runs on those channels alone (a quarter of a record model's head)
    rather than on all of them: the same bits in fewer instructions and registers
    (bench/head_kernels_sass.py). The backward is the same either way."""

    positions: int = 16
    warps: int = HEAD_WARPS
    rotated_apart: bool = False

    @property
    def name(self) -> str:
        """As bench/head_kernels_speed.py names it: 16x4, or 16x4s with the rotation apart."""
        return f"{self.positions}x{self.warps}{'s' if self.rotated_apart else ''}"


HEAD_LAUNCH = HeadLaunch()


# --- Kernels -----------------------------------------------------------------------------

@triton.jit
def _embed_kernel(ids_ptr, table_ptr, extra_ptr, extra_scale_ptr, out_ptr, rows, width, eps,
                  HAS_EXTRA: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS positions: n = rms_norm(table[id] + extra * extra_scale), stored in out's dtype."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    live = row < rows
    mask = live & (cols < width)
    token = tl.load(ids_ptr + row, mask=live, other=0).to(tl.int64)
    x = tl.load(table_ptr + token * width + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        x = x + tl.load(extra_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(extra_scale_ptr)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    tl.store(out_ptr + row * width + cols, x * inv_rms[:, None], mask=mask)


@triton.jit
def _x0_rows(n_ptr, gate_ptr, row, cols, mask, col_mask, rows_per_seq, width):
    """x0 at these rows: the normed embedding n blended with the previous position's through
    the SmearGate, (1 - g) * n + g * n_prev (zeros before a sequence's first position)."""
    g = tl.sigmoid(tl.load(gate_ptr + cols, mask=col_mask, other=0.0).to(tl.float32))
    n = tl.load(n_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    n_prev = tl.load(n_ptr + (row - 1) * width + cols, mask=mask & (row % rows_per_seq != 0), other=0.0)
    return (1.0 - g) * n + g * n_prev.to(tl.float32)


@triton.jit(do_not_specialize=["rows", "picked_per_seq"])
def _smeared_rows_kernel(n_ptr, gate_ptr, positions_ptr, out_ptr, rows, picked_per_seq, seq_len, width,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """x0 (`_x0_rows`, in float32) at chosen positions: out's row r is sequence
    r // picked_per_seq's x0 at position positions[r]."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    live = row < rows
    col_mask = cols < width
    mask = live & col_mask
    position = tl.load(positions_ptr + row, mask=live, other=0)
    source = (row // picked_per_seq) * seq_len + position
    x0 = _x0_rows(n_ptr, gate_ptr, source, cols, mask, col_mask, seq_len, width)
    tl.store(out_ptr + row * width + cols, x0, mask=mask)


# What a `_stream_norm_kernel` call does: a bit mask, read at run time, so that one compiled
# kernel serves every block (each variant would cost a compilation on a fresh machine). For
# the same reason the kernels take row counts and sequence lengths unspecialized: Triton
# would otherwise build a variant for each count's divisibility by 16, and the rows the last
# block reads (`model.gpt.window_key_rows`) come in counts that are not.
STREAM_BASE_IS_X0: tl.constexpr = tl.constexpr(1)
STREAM_NEEDS_X0: tl.constexpr = tl.constexpr(2)
STREAM_DELTA1: tl.constexpr = tl.constexpr(4)
STREAM_DELTA2: tl.constexpr = tl.constexpr(8)
STREAM_SKIP_TENSOR: tl.constexpr = tl.constexpr(16)
STREAM_SKIP_ITSELF: tl.constexpr = tl.constexpr(32)
STREAM_MIX: tl.constexpr = tl.constexpr(64)
STREAM_KEEP: tl.constexpr = tl.constexpr(128)
STREAM_X0_STORED: tl.constexpr = tl.constexpr(256)  # x0 given as float32 values (in n), not formed from n and the gate


@triton.jit(do_not_specialize=["mode", "rows", "rows_per_seq"])
def _stream_norm_kernel(base_ptr, delta1_ptr, scale1_ptr, delta2_ptr, scale2_ptr, skip_ptr, skip_weight_ptr,
                        n_ptr, gate_ptr, mix_ptr, factor_ptr, kept_ptr, x_in_ptr, normed_ptr,
                        rows, rows_per_seq, width, eps, mode, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows of the residual stream: x = base + scale1 * delta1 + scale2 * delta2, plus
    skip_weight * skip (STREAM_SKIP_TENSOR) or skip_weight * x (STREAM_SKIP_ITSELF), stored in kept with
    STREAM_KEEP; with STREAM_MIX, x = mix[0] * x + mix[1] * x0, stored in x_in; then normed =
    rms_norm(x) * factor. With STREAM_NEEDS_X0, x0 is formed from n and the gate (and is the base
    with STREAM_BASE_IS_X0), or with STREAM_X0_STORED read from n."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    col_mask = cols < width
    mask = (row < rows) & col_mask
    offsets = row * width + cols
    x0 = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    if (mode & STREAM_X0_STORED) != 0:
        x0 = tl.load(n_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    elif (mode & STREAM_NEEDS_X0) != 0:
        x0 = _x0_rows(n_ptr, gate_ptr, row, cols, mask, col_mask, rows_per_seq, width)
    if (mode & STREAM_BASE_IS_X0) != 0:
        x = x0
    else:
        x = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if (mode & STREAM_DELTA1) != 0:
        x = x + tl.load(scale1_ptr + cols, mask=col_mask, other=0.0) * tl.load(
            delta1_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if (mode & STREAM_DELTA2) != 0:
        x = x + tl.load(scale2_ptr + cols, mask=col_mask, other=0.0) * tl.load(
            delta2_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if (mode & STREAM_SKIP_TENSOR) != 0:
        x = x + tl.load(skip_weight_ptr + cols, mask=col_mask, other=0.0) * tl.load(
            skip_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if (mode & STREAM_SKIP_ITSELF) != 0:
        x = x + tl.load(skip_weight_ptr + cols, mask=col_mask, other=0.0) * x
    if (mode & STREAM_KEEP) != 0:
        tl.store(kept_ptr + offsets, x, mask=mask)
    if (mode & STREAM_MIX) != 0:
        x = tl.load(mix_ptr + cols, mask=col_mask, other=0.0) * x + tl.load(
            mix_ptr + width + cols, mask=col_mask, other=0.0) * x0
        tl.store(x_in_ptr + offsets, x, mask=mask)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    tl.store(normed_ptr + offsets, x * inv_rms[:, None] * tl.load(factor_ptr), mask=mask)


@triton.jit
def head_positions(positions, rows_per_seq, HEAD_DIM: tl.constexpr, POSITIONS: tl.constexpr):
    """This program's POSITIONS positions ([POSITIONS, 1], counted over every sequence) and a
    head's channels ([1, HEAD_DIM]): which positions are live, and each one's sequence and
    position in its sequence. A position's heads are `heads` contiguous rows of HEAD_DIM."""
    position = tl.program_id(0).to(tl.int64) * POSITIONS + tl.arange(0, POSITIONS)[:, None]
    col = tl.arange(0, HEAD_DIM)[None, :]
    return position, col, position < positions, position // rows_per_seq, position % rows_per_seq


@triton.jit
def rotary_at(cos_ptr, sin_ptr, seq, pos, col, live, cos_seq_stride, cos_row_stride, ROPE_HALF: tl.constexpr):
    """cos and sin of each channel of the rows (1 and 0 past the 2 * ROPE_HALF rotated ones;
    a pair's two channels share theirs)."""
    in_first = col < ROPE_HALF
    rotated = col < 2 * ROPE_HALF
    table = seq * cos_seq_stride + pos * cos_row_stride + tl.where(in_first, col, col - ROPE_HALF)
    return (tl.load(cos_ptr + table, mask=live & rotated, other=1.0),
            tl.load(sin_ptr + table, mask=live & rotated, other=0.0))


@triton.jit
def pair_partners(x, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr):
    """Each channel's partner in its rotated pair (c + ROPE_HALF or c - ROPE_HALF): the halves
    of every group of 2 * ROPE_HALF channels swapped in registers (only the first group's
    are used)."""
    groups = tl.reshape(x, (ROWS, HEAD_DIM // (2 * ROPE_HALF), 2, ROPE_HALF))
    return tl.reshape(tl.flip(groups, 2), (ROWS, HEAD_DIM))


@triton.jit
def rotated_normed(x, x_partner, inv_rms, cos, sin, dtype, WIDTH: tl.constexpr, ROPE_HALF: tl.constexpr):
    """Rows of a head's first WIDTH channels x (each channel's pair partner given) times
    inv_rms, their first 2 * ROPE_HALF rotated, in float32: a rotated channel is the sum of
    two products, each rounded to dtype first."""
    col = tl.arange(0, WIDTH)[None, :]
    x, x_partner = x * inv_rms, x_partner * inv_rms
    # (x1, x2) -> (x1 cos + x2 sin, x1 (-sin) + x2 cos), x1 the first channel of a pair
    first = (x * cos).to(dtype).to(tl.float32) + (x_partner * sin).to(dtype).to(tl.float32)
    second = (x_partner * -sin).to(dtype).to(tl.float32) + (x * cos).to(dtype).to(tl.float32)
    return tl.where(col < ROPE_HALF, first, tl.where(col < 2 * ROPE_HALF, second, x))


@triton.jit(do_not_specialize=["positions", "heads", "has_gain", "rows_per_seq", "copies"])
def _head_prep_kernel(x_ptr, cos_ptr, sin_ptr, gain_ptr, out_ptr, positions, rows_per_seq, x_stride, cos_seq_stride,
                      cos_row_stride, eps, heads, has_gain, copies, HEAD_DIM: tl.constexpr,
                      ROPE_HALF: tl.constexpr, POSITIONS: tl.constexpr, ROTATED_APART: tl.constexpr):
    """Every head at POSITIONS positions (`head_positions`): each normed, its first
    2 * ROPE_HALF channels rotated (pairs c, c + ROPE_HALF; `rotated_normed`), times its gain
    if has_gain, and stored `copies` times, as heads h * copies .. h * copies + copies - 1 of
    out. The rotary tables are read once per position, for all its heads. x's positions lie
    x_stride elements apart (its heads contiguous within one: a slice of a stacked product's
    output reads in place). ROTATED_APART: `HeadLaunch.rotated_apart`, the same bits."""
    position, col, live, seq, pos = head_positions(positions, rows_per_seq, HEAD_DIM, POSITIONS)
    dtype = out_ptr.dtype.element_ty
    if ROTATED_APART:
        col_rotated = tl.arange(0, 2 * ROPE_HALF)[None, :]
        cos, sin = rotary_at(cos_ptr, sin_ptr, seq, pos, col_rotated, live, cos_seq_stride, cos_row_stride, ROPE_HALF)
    else:
        cos, sin = rotary_at(cos_ptr, sin_ptr, seq, pos, col, live, cos_seq_stride, cos_row_stride, ROPE_HALF)
    for head in range(heads):
        x_at = x_ptr + position * x_stride + head * HEAD_DIM
        x = tl.load(x_at + col, mask=live, other=0.0).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        if ROTATED_APART:
            gain = tl.load(gain_ptr + head, mask=has_gain != 0, other=1.0)
            rotated = tl.load(x_at + col_rotated, mask=live, other=0.0).to(tl.float32)
            rotated = rotated_normed(rotated, pair_partners(rotated, POSITIONS, 2 * ROPE_HALF, ROPE_HALF), inv_rms,
                                     cos, sin, dtype, 2 * ROPE_HALF, ROPE_HALF) * gain
            plain = x * inv_rms * gain
            for copy in range(copies):
                out_at = out_ptr + ((position * heads + head) * copies + copy) * HEAD_DIM
                tl.store(out_at + col, plain, mask=live & (col >= 2 * ROPE_HALF))
                tl.store(out_at + col_rotated, rotated, mask=live)
        else:
            out = rotated_normed(x, pair_partners(x, POSITIONS, HEAD_DIM, ROPE_HALF), inv_rms, cos, sin, dtype,
                                 HEAD_DIM, ROPE_HALF)
            if has_gain:
                out = out * tl.load(gain_ptr + head)
            for copy in range(copies):
                tl.store(out_ptr + ((position * heads + head) * copies + copy) * HEAD_DIM + col, out, mask=live)


@triton.jit
def _values_kernel(v_ptr, projected_ptr, scale_ptr, layer_scale_ptr, attn_ptr, xsa_ptr, numel, BLOCK: tl.constexpr):
    """v + projected * scale * layer_scale, stored twice: for the attention (attn's dtype) and
    for XSA (xsa's, float32)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    projected = tl.load(projected_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = v + projected * tl.load(scale_ptr) * tl.load(layer_scale_ptr)
    tl.store(attn_ptr + offsets, v, mask=mask)
    tl.store(xsa_ptr + offsets, v, mask=mask)


@triton.jit(do_not_specialize=["heads", "group", "rows_per_seq"])
def _exclude_self_value_kernel(y_ptr, v_ptr, out_ptr, rows, rows_per_seq, y_seq_stride, y_row_stride,
                               y_head_stride, v_seq_stride, v_row_stride, v_head_stride, eps, heads, group,
                               HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """XSA for ROWS heads (a row is one head at one position): each head's output minus its
    component along its group's normalized value; stored contiguous in bf16."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, HEAD_DIM)[None, :]
    live = row < rows
    position, head = row // heads, row % heads
    seq, pos = position // rows_per_seq, position % rows_per_seq
    y = tl.load(y_ptr + seq * y_seq_stride + pos * y_row_stride + head * y_head_stride + col, mask=live, other=0.0)
    v = tl.load(v_ptr + seq * v_seq_stride + pos * v_row_stride + (head // group) * v_head_stride + col,
                mask=live, other=0.0)
    y, v = y.to(tl.float32), v.to(tl.float32)
    v_unit = v / tl.maximum(tl.sqrt_rn(tl.sum(v * v, axis=1)), eps)[:, None]
    projection = tl.sum(y * v_unit, axis=1)[:, None] * v_unit
    tl.store(out_ptr + row * HEAD_DIM + col, (y - projection).to(tl.bfloat16), mask=live)


@triton.jit
def leaky_square_values(h, negative_slope):
    leaky = tl.where(h > 0, h, h * negative_slope)
    return leaky * leaky


@triton.jit
def _leaky_square_kernel(h_ptr, out_ptr, numel, negative_slope, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, leaky_square_values(h, negative_slope).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def product_tile(x_desc, w_desc, tile, col_tiles, depth, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, W_BY_COLUMNS: tl.constexpr):
    """(row0, col0, float32 tile) of output tile `tile` of x @ w, tiles taken row by row:
    x [rows, depth] by a descriptor of BLOCK_M x BLOCK_K blocks; w [cols, depth] (W_BY_COLUMNS,
    the product is x @ w.T) or [depth, cols]."""
    row0, col0 = (tile // col_tiles) * BLOCK_M, (tile % col_tiles) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, depth, BLOCK_K):
        if W_BY_COLUMNS:
            acc = tl.dot(x_desc.load([row0, k]), w_desc.load([col0, k]).T, acc)
        else:
            acc = tl.dot(x_desc.load([row0, k]), w_desc.load([k, col0]), acc)
    return row0, col0, acc


@triton.jit(do_not_specialize=["rows"])
def _leaky_square_matmul_kernel(x_desc, w_desc, out_desc, product_desc, rows, cols, depth, negative_slope,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                PROGRAMS: tl.constexpr, STORE_PRODUCT: tl.constexpr):
    """out = leaky_square(x @ w.T) for x [rows, depth], w [cols, depth] and out [rows, cols]
    given by TMA descriptors (cols a multiple of BLOCK_N, depth of BLOCK_K): the product
    rounded to bf16, as a stored product is, then the activation in float32 and one store;
    with STORE_PRODUCT the bf16 product too (training's backward reads it).
    Persistent: PROGRAMS programs (one per multiprocessor) walk the output tiles, so that
    the next tile's loads start while this one's epilogue runs."""
    col_tiles = cols // BLOCK_N
    tiles = tl.cdiv(rows, BLOCK_M) * col_tiles
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        row0, col0, acc = product_tile(x_desc, w_desc, tile, col_tiles, depth, BLOCK_M, BLOCK_N, BLOCK_K, True)
        product = acc.to(tl.bfloat16)
        if STORE_PRODUCT:
            product_desc.store([row0, col0], product)
        out_desc.store([row0, col0], leaky_square_values(product.to(tl.float32), negative_slope).to(tl.bfloat16))


# --- Launchers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulTiles:
    """How `_leaky_square_matmul_kernel` cuts a product: output tiles of block_m x block_n,
    depth in steps of block_k, and the launch's warps and software-pipeline stages. The
    default is the fastest of those bench/fused_products.py tried on an H200."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def _fits(x: Tensor, weight: Tensor, tiles: MatmulTiles) -> bool:
    """Whether `_leaky_square_matmul_kernel` takes this product: bf16 operands (autocast's),
    whole tiles of columns and depth, and a GPU with TMA (Hopper or later; Triton's
    interpreter on the CPU)."""
    return (product_fits(x, weight, tiles) and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0)  # TMA reads from 16-byte boundaries


def product_fits(x: Tensor, weight: Tensor, tiles: MatmulTiles) -> bool:
    """`_fits` but for where the tensors lie (what a traced function can ask of its inputs):
    bf16 operands, x [..., depth] and weight [cols, depth] in whole tiles, a GPU with TMA."""
    return (x.dtype == weight.dtype == torch.bfloat16 and weight.dim() == 2 and x.size(-1) == weight.size(1)
            and weight.size(0) % tiles.block_n == 0 and weight.size(1) % tiles.block_k == 0
            and (x.device.type != "cuda" or has_tma(x.device)))


def tma_ready(t: Tensor) -> Tensor:
    """t contiguous and starting on a 16-byte boundary, as TMA reads it (copied if not)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def programs_for(device: torch.device) -> int:
    """A persistent kernel's programs: one per multiprocessor (two in the interpreter, which
    then runs several tiles per program too)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def rotated_half(head_dim: int, rope_dims: int) -> int:
    """Half the channels of a head that the rotary embedding rotates."""
    return (rope_dims if 0 < rope_dims < head_dim else head_dim) // 2


def head_tables(x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int) -> tuple[Tensor, Tensor] | None:
    """The rotary tables ([1 or B, T, 1, rope_dims / 2]) as the head kernels read them for
    queries or keys x [B, T, H, D]: float32, contiguous, a row per position (of every
    sequence, where a table has one per sequence). None where the kernels cannot take x's
    heads (a head or its rotated half not a power of two)."""
    rope_half = rotated_half(x.size(-1), rope_dims)
    if not powers_of_two(x.size(-1), rope_half):
        return None
    b, t = x.shape[:2]
    return tuple(table.expand(b if table.size(0) > 1 else 1, t, 1, rope_half).float().contiguous()
                 for table in (cos, sin))


def head_table_strides(table: Tensor) -> tuple[int, int]:
    """A table's strides from sequence to sequence (0: one table serves every sequence) and
    from position to position, as the head kernels take them."""
    return (table.stride(0) if table.size(0) > 1 else 0), table.stride(1)


def evenly_spaced(x: Tensor) -> bool:
    """Whether x [B, T, H, D] lies as the head kernels read and write it: each position's heads
    contiguous and the positions evenly spaced over every sequence, as in a slice of a stacked
    product's output [B, T, width]."""
    b, t, heads, head_dim = x.shape
    return x.stride(3) == 1 and x.stride(2) == head_dim and (b == 1 or x.stride(0) == t * x.stride(1))


def by_positions(x: Tensor) -> tuple[Tensor, int]:
    """(x, the elements from one position to the next) as the head kernels read it
    (`evenly_spaced`; copied contiguous where not)."""
    x = x if evenly_spaced(x) else x.contiguous()
    return x, x.stride(1)


def head_prep(x: Tensor, cos: Tensor, sin: Tensor, gain: Tensor | None, dtype: torch.dtype,
              launch: HeadLaunch = HEAD_LAUNCH, copies: int = 1) -> Tensor:
    """`_head_prep_kernel` over queries or keys x [B, T, H, D], the tables as `head_tables`
    gives them; the result [B, T, H * copies, D] (each head `copies` times over) in dtype."""
    b, t, heads, head_dim = x.shape
    out = torch.empty(b, t, heads * copies, head_dim, device=x.device, dtype=dtype)
    x, x_stride = by_positions(x)
    _head_prep_kernel[(triton.cdiv(b * t, launch.positions),)](
        x, cos, sin, float32_values(gain, cos), out, b * t, t, x_stride, *head_table_strides(cos), FLOAT32_EPS,
        heads, int(gain is not None), copies, HEAD_DIM=head_dim, ROPE_HALF=cos.size(-1),
        POSITIONS=launch.positions, ROTATED_APART=launch.rotated_apart, num_warps=launch.warps)
    return out


def leaky_square(h: Tensor, negative_slope: float, dtype: torch.dtype) -> Tensor:
    """`_leaky_square_kernel` over h; the result in dtype."""
    h = h.contiguous()
    out = torch.empty_like(h, dtype=dtype)
    _leaky_square_kernel[(triton.cdiv(h.numel(), ELEMENTS),)](h, out, h.numel(), negative_slope, BLOCK=ELEMENTS)
    return out


def powers_of_two(*sizes: int) -> bool:
    """Tiles of these sizes (a head, half its rotated channels) fit a kernel's block shape."""
    return all(n > 0 and n & (n - 1) == 0 for n in sizes)


def float32_values(t: Tensor | None, placeholder: Tensor) -> Tensor:
    """A parameter as float32 values (or any tensor where the kernel reads nothing)."""
    return t.detach().float().contiguous() if t is not None else placeholder


def embed_normed(ids: Tensor, table: Tensor, extra: Tensor | None, extra_scale: Tensor | None) -> Tensor:
    """rms_norm(table[ids] + extra * extra_scale) [*ids.shape, width], in table's dtype."""
    width = table.size(1)
    normed = torch.empty(*ids.shape, width, device=ids.device, dtype=table.dtype)
    rows = ids.numel()
    _embed_kernel[(triton.cdiv(rows, STREAM_ROWS),)](
        ids.contiguous(), table.contiguous(), extra.contiguous() if extra is not None else normed,
        float32_values(extra_scale, normed), normed, rows, width, FLOAT32_EPS, HAS_EXTRA=extra is not None,
        ROWS=STREAM_ROWS, BLOCK=triton.next_power_of_2(width), num_warps=STREAM_WARPS)
    return normed


def smeared_rows(normed: Tensor, gate: Tensor, positions: Tensor) -> Tensor:
    """x0 (the normed embedding [B, T, D] smeared through the gate) at positions [B, R], in float32."""
    _, seq_len, width = normed.shape
    positions = positions.contiguous()
    out = torch.empty(*positions.shape, width, device=positions.device, dtype=torch.float32)
    rows = positions.numel()
    _smeared_rows_kernel[(triton.cdiv(rows, STREAM_ROWS),)](
        normed.contiguous(), gate, positions, out, rows, positions.size(1), seq_len, width,
        ROWS=STREAM_ROWS, BLOCK=triton.next_power_of_2(width), num_warps=STREAM_WARPS)
    return out


def stream_norm(like: Tensor, base: Tensor, deltas: list[tuple[Tensor, Tensor]], skip: Tensor, skip_weight: Tensor,
                n: Tensor, gate: Tensor, mix: Tensor, factor: Tensor, kept: Tensor, x_in: Tensor, mode: int) -> Tensor:
    """`_stream_norm_kernel` over every row of `like` (the shape of its outputs); mode (the
    STREAM_* flags) says which arguments it reads. Returns the normed rows (bf16)."""
    width = like.size(-1)
    rows = like.numel() // width
    normed = torch.empty(*like.shape, device=like.device, dtype=torch.bfloat16)
    (delta1, scale1), (delta2, scale2) = deltas
    _stream_norm_kernel[(triton.cdiv(rows, STREAM_ROWS),)](
        base, delta1, scale1, delta2, scale2, skip, skip_weight, n, gate, mix, factor, kept, x_in, normed,
        rows, like.size(-2), width, FLOAT32_EPS, mode, ROWS=STREAM_ROWS, BLOCK=triton.next_power_of_2(width),
        num_warps=STREAM_WARPS)
    return normed


def add_values(v: Tensor, projected: Tensor, scale: Tensor, layer_scale: Tensor) -> tuple[Tensor, Tensor]:
    """v + projected * scale * layer_scale: in v's dtype for the attention, in float32 for XSA."""
    v = v.contiguous()
    for_attention, for_xsa = torch.empty_like(v), torch.empty_like(v, dtype=torch.float32)
    _values_kernel[(triton.cdiv(v.numel(), ELEMENTS),)](
        v, projected, scale, layer_scale, for_attention, for_xsa, v.numel(), BLOCK=ELEMENTS)
    return for_attention, for_xsa


def exclude_self_value(y: Tensor, v: Tensor) -> Tensor | None:
    """XSA over y [B, T, H, D] with values v [B, T, Hkv, D], in bf16; None where the kernel
    cannot take them (a head not a power of two, or channels not contiguous)."""
    b, t, heads, head_dim = y.shape
    if not powers_of_two(head_dim) or y.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    out = torch.empty(b, t, heads, head_dim, device=y.device, dtype=torch.bfloat16)
    rows = b * t * heads
    _exclude_self_value_kernel[(triton.cdiv(rows, HEAD_ROWS),)](
        y, v, out, rows, t, y.stride(0), y.stride(1), y.stride(2), v.stride(0), v.stride(1), v.stride(2),
        NORMALIZE_EPS, heads, heads // v.size(2), HEAD_DIM=head_dim, ROWS=HEAD_ROWS)
    return out


def leaky_square_matmul(x: Tensor, w: Tensor, negative_slope: float, tiles: MatmulTiles) -> Tensor | None:
    """leaky_square(x @ w.T) in one kernel (bf16), x [..., depth], w [cols, depth]; None
    where the product does not fit the kernel (`_fits`)."""
    if not _fits(x, w, tiles):
        return None
    out, _ = _launch_leaky_square_matmul(x.reshape(-1, x.size(-1)).contiguous(), w.contiguous(), negative_slope,
                                         tiles, keep_product=False)
    return out.view(*x.shape[:-1], w.size(0))


def leaky_square_matmul_with_product(x: Tensor, w: Tensor, negative_slope: float,
                                     tiles: MatmulTiles) -> tuple[Tensor, Tensor]:
    """(leaky_square(x @ w.T), x @ w.T), both bf16 from one kernel, for x [rows, depth] and
    w [cols, depth] that `product_fits`."""
    return _launch_leaky_square_matmul(tma_ready(x), tma_ready(w), negative_slope, tiles, keep_product=True)


def _launch_leaky_square_matmul(x2: Tensor, w: Tensor, negative_slope: float, tiles: MatmulTiles,
                                keep_product: bool) -> tuple[Tensor, Tensor | None]:
    rows, depth = x2.shape
    cols = w.size(0)
    out = torch.empty(rows, cols, device=x2.device, dtype=torch.bfloat16)
    product = torch.empty_like(out) if keep_product else None
    programs = programs_for(x2.device)
    out_desc = TensorDescriptor.from_tensor(out, [tiles.block_m, tiles.block_n])
    _leaky_square_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(x2, [tiles.block_m, tiles.block_k]),
        TensorDescriptor.from_tensor(w, [tiles.block_n, tiles.block_k]), out_desc,
        TensorDescriptor.from_tensor(product, [tiles.block_m, tiles.block_n]) if keep_product else out_desc,
        rows, cols, depth, negative_slope, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        PROGRAMS=programs, STORE_PRODUCT=keep_product, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out, product
