"""LQER (Zhang et al. 2024): a low-rank correction of the quantization error of the
matrices that lose the most.

For each of the plan's top-k quantized matrices by squared error, the error E = W - Q is
approximated by its leading singular directions, E ~ A B with A = U_r sqrt(S_r) and
B = sqrt(S_r) V_r^T, and both factors are stored as asymmetric integer codes in groups of
their flattened values (a scale and an offset per group). Loading adds A B back
(`artifacts.quantized.LowRank`).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ..artifacts.quantized import INT_SCHEMES, LowRank, LowRankFactor, QuantizedTensor
from ..model.state_dict import is_control_tensor
from .schemes import QuantPlan

FACTOR_DTYPE = torch.float16


def quantize_factor(values: Tensor, bits: int, group_size: int) -> LowRankFactor:
    """Asymmetric codes in [0, 2**bits - 1] per group of group_size flattened values (the
    last group padded with its own first value, which changes neither its min nor max)."""
    flat = values.float().flatten()
    groups = -(-flat.numel() // group_size)
    pad = groups * group_size - flat.numel()
    padded = torch.cat([flat, flat[-group_size + pad:][:1].expand(pad)]) if pad else flat
    rows = padded.view(groups, group_size)
    lo, hi = rows.amin(dim=1), rows.amax(dim=1)
    top = (1 << bits) - 1
    scale = ((hi - lo) / top).clamp_min(1e-12).to(FACTOR_DTYPE)
    offset = lo.to(FACTOR_DTYPE)
    codes = torch.clamp(torch.round((rows - offset.float()[:, None]) / scale.float()[:, None]), 0, top)
    codes = codes.flatten()[:flat.numel()].to(torch.uint8).view(values.shape)
    return LowRankFactor(codes.cpu(), scale.cpu(), offset.cpu())


def low_rank(error: Tensor, rank: int, bits: int, group_size: int) -> LowRank:
    """The quantized rank-`rank` approximation of error [rows, cols]."""
    u, s, vh = torch.linalg.svd(error.float(), full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    a = quantize_factor(u[:, :r] * root, bits, group_size)
    b = quantize_factor(root[:, None] * vh[:r], bits, group_size)
    return LowRank(a, b, bits, group_size)


def correctable(name: str, qt: QuantizedTensor) -> bool:
    return qt.scheme in INT_SCHEMES and qt.values.ndim == 2 and not is_control_tensor(name)


def add_corrections(sd: Mapping[str, Tensor], tensors: dict[str, QuantizedTensor], plan: QuantPlan,
                    device: torch.device) -> list[str]:
    """Give the plan's top-k matrices by squared quantization error their corrections (in
    place); returns their names, largest error first."""
    errors: dict[str, float] = {}
    for name, qt in tensors.items():
        if correctable(name, qt):
            errors[name] = float((sd[name].float() - qt.dequantize().float()).pow(2).sum())
    chosen = sorted(errors, key=lambda n: (-errors[n], n))[:plan.lqer_top_k]
    for name in chosen:
        qt = tensors[name]
        error = sd[name].to(device).float() - qt.dequantize().to(device).float()
        qt.correction = low_rank(error, plan.lqer_rank, plan.lqer_factor_bits, plan.lqer_group_size)
    return chosen
