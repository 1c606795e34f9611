"""The grids `quantize` rounds a matrix's rows to, and the rounding a training forward may
apply with them (quantization-aware training, `GPT.weight_grids`).

A row's scale is its clip over the codes' limit, stored in float16: the clip is k standard
deviations of the row (k-sigma clipping) or its largest weight, at least 1 / limit where
the reference floors it. `quant.schemes` takes its scales from here, so that the grid a
model trains on is the one its matrices are later quantized to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SCALE_DTYPE = torch.float16  # as a .ptz stores row scales
LEAST_SCALE = 1e-8  # a row of zeros keeps a usable scale


def row_scales(clip: Tensor, limit: int, least: float = LEAST_SCALE) -> Tensor:
    """Float16 scales for rows clipped at `clip` [rows] with codes in [-limit, limit]."""
    return (clip / limit).clamp_min(least).to(SCALE_DTYPE)


def least_scale(limit: int, floor: bool) -> float:
    """The smallest row scale: the reference's 1 / limit with its floor, else LEAST_SCALE."""
    return 1.0 / limit if floor else LEAST_SCALE


def round_to_grid(w: Tensor, scale: Tensor, limit: int) -> Tensor:
    """Codes (as floats) of w [..., cols] with one float32 scale per row [...]."""
    return torch.clamp(torch.round(w / scale.unsqueeze(-1)), -limit, limit)


def sigma_clip(w: Tensor, sigmas: float) -> Tensor:
    """Each row of w [..., rows, cols] clipped at `sigmas` standard deviations of its weights."""
    return sigmas * w.float().std(dim=-1, correction=0)


@dataclass(frozen=True)
class RowGrid:
    """Codes in [-limit, limit] times one scale per row: the row's clip (sigmas standard
    deviations, or with sigmas 0 its largest weight) over limit, at least 1 / limit with
    floor."""

    limit: int
    sigmas: float = 0.0
    floor: bool = True

    def __str__(self) -> str:
        floor = f"(floor 1/{self.limit})" if self.floor else ""
        clip = f"{self.sigmas:g}sigma" if self.sigmas > 0 else "rowmax" + floor
        return f"+-{self.limit}/{clip}"

    def scales(self, w: Tensor) -> Tensor:
        """The float16 scales [..., rows] of w [..., rows, cols]."""
        if self.sigmas > 0:
            return row_scales(sigma_clip(w, self.sigmas), self.limit)
        return row_scales(w.float().abs().amax(dim=-1), self.limit, least_scale(self.limit, self.floor))

    def snap(self, w: Tensor) -> Tensor:
        """w rounded to the grid in the forward; its gradient passes straight through."""
        with torch.no_grad():
            scale = self.scales(w).float()
            snapped = round_to_grid(w.float(), scale, self.limit) * scale.unsqueeze(-1)
        return snapped.to(w.dtype) + (w - w.detach())  # exactly the grid's values; gradient one
