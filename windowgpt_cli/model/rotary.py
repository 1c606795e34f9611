"""Rotary position embeddings: frequencies (NTK-rescaled beyond the training length),
cos/sin tables, and the rotation of a head's channels."""
from __future__ import annotations

import torch
from torch import Tensor


def rotary_inv_freq(rope_dims: int, base: float, seq_len: int, train_seq_len: int,
                    device: torch.device | None = None) -> Tensor:
    """Inverse frequencies; beyond the training length the base is NTK-rescaled."""
    exponents = torch.arange(0, rope_dims, 2, dtype=torch.float32, device=device) / rope_dims
    if seq_len > train_seq_len:
        base = base * (seq_len / train_seq_len) ** (rope_dims / (rope_dims - 2))
    return 1.0 / (base ** exponents)


def rotary_tables(seq_len: int, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of shape [1, T, 1, rope_dims / 2], float32, made fresh per forward so no
    inference-mode table is ever reused by autograd."""
    t = torch.arange(seq_len, device=inv_freq.device, dtype=inv_freq.dtype)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int) -> Tensor:
    """Rotate the first rope_dims channels of each head (all when rope_dims covers it)."""
    if 0 < rope_dims < x.size(-1):
        x_rope, x_pass = x[..., :rope_dims], x[..., rope_dims:]
        return torch.cat((apply_rotary(x_rope, cos, sin, 0), x_pass), dim=-1)
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), dim=-1)
