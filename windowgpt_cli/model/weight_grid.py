"""The grids `quantize` rounds a matrix's rows to: a row's scale is its clip over the codes'
limit, stored in float16, the clip k standard deviations of the row (k-sigma clipping) or
one of its quantiles, at least 1 / limit where the reference floors it."""
from __future__ import annotations

import torch
from torch import Tensor

SCALE_DTYPE = torch.float16  # as a .ptz stores row scales
LEAST_SCALE = 1e-8  # a row of zeros keeps a usable scale


def row_scales(clip: Tensor, limit: int, least: float = LEAST_SCALE) -> Tensor:
    """Float16 scales for rows clipped at `clip` [rows] with codes in [-limit, limit]."""
    return (clip / limit).clamp_min(least).to(SCALE_DTYPE)


def sigma_clip(w: Tensor, sigmas: float) -> Tensor:
    """Each row of w [..., rows, cols] clipped at `sigmas` standard deviations of its weights."""
    return sigmas * w.float().std(dim=-1, correction=0)
