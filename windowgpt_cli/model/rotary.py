"""Rotary position embeddings: frequencies (rescaled beyond the training length, NTK's way
or YaRN's), cos/sin tables, and the rotation of a head's channels."""
from __future__ import annotations

import math

import torch
from torch import Tensor

# YaRN's ramp (Peng et al., 2023): dimensions turning fewer than YARN_LOW times over the
# training length are interpolated, more than YARN_HIGH times kept, those between blended.
YARN_LOW, YARN_HIGH = 1.0, 32.0


def rotary_inv_freq(rope_dims: int, base: float, seq_len: int, train_seq_len: int,
                    device: torch.device | None = None, scaling: str = "ntk") -> Tensor:
    """Inverse frequencies; beyond the training length the base is NTK-rescaled, or with
    scaling="yarn" each frequency is interpolated by YaRN's ramp."""
    exponents = torch.arange(0, rope_dims, 2, dtype=torch.float32, device=device) / rope_dims
    if seq_len <= train_seq_len:
        return 1.0 / (base ** exponents)
    if scaling == "yarn":
        inv_freq = 1.0 / (base ** exponents)
        turns = train_seq_len * inv_freq / (2 * math.pi)  # rotations over the training length
        kept = ((turns - YARN_LOW) / (YARN_HIGH - YARN_LOW)).clamp(0.0, 1.0)
        return inv_freq * kept + inv_freq * train_seq_len / seq_len * (1.0 - kept)
    base = base * (seq_len / train_seq_len) ** (rope_dims / (rope_dims - 2))
    return 1.0 / (base ** exponents)


def rotary_magnitude(seq_len: int, train_seq_len: int, scaling: str) -> float:
    """YaRN's factor on the rotated channels beyond the training length (which sharpens the
    attention as 0.1 ln(s) + 1 does its logits' temperature); 1 otherwise."""
    if scaling != "yarn" or seq_len <= train_seq_len:
        return 1.0
    return 0.1 * math.log(seq_len / train_seq_len) + 1.0


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
