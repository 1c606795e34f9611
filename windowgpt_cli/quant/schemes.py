"""The reference's mixed quantization scheme, tensor by tensor.

Per tensor (per-layer names, as `model.state_dict.unbank_state_dict` gives them), in the
reference's order of precedence:

- non-float tensors and tensors of at most 65,536 elements: kept, floats stored as float16;
- control tensors (`model.state_dict.CONTROL_TENSOR_NAME_PATTERNS`): kept in float32
  (every control tensor of the reference's model is small, so the rule above already
  caught it);
- attention and MLP matrices: int6 codes in [-clip, clip] with one float16 scale per row,
  the scale chosen among five clip percentiles by mean squared error, either by rounding
  to nearest (here) or by GPTQ against calibration Hessians (`gptq`);
- everything else (embeddings): int8 per row, clipped at the 99.99984th percentile.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..artifacts.quantized import CONTROL, INT6, INT8, PASSTHROUGH, QuantizedTensor
from ..model.state_dict import classify_param, is_control_tensor

INT6_CLIP_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)  # 1.0 = the row's max |w|
INT8_CLIP_QUANTILE = 99.99984 / 100.0
INT8_CLIP_RANGE = 127
PASSTHROUGH_MAX_NUMEL = 65_536
INT6_CATEGORIES = frozenset({"attn", "mlp"})
SCALE_DTYPE = torch.float16
PASSTHROUGH_DTYPE = torch.float16
_QUANTILE_MAX_NUMEL = 1 << 24  # torch.quantile refuses larger inputs


# --- Which scheme -------------------------------------------------------------------------

def choose_scheme(name: str, t: Tensor, passthrough_max_numel: int = PASSTHROUGH_MAX_NUMEL) -> str:
    if not t.is_floating_point() or t.numel() <= passthrough_max_numel:
        return PASSTHROUGH
    if is_control_tensor(name):
        return CONTROL
    if classify_param(name) in INT6_CATEGORIES:
        return INT6
    return INT8


# --- Rounding to nearest --------------------------------------------------------------------

def row_quantiles(a: Tensor, q: Sequence[float]) -> Tensor:
    """torch.quantile over dim 1 for several q at once -> [len(q), rows], in row chunks
    small enough for torch.quantile."""
    qs = torch.tensor(q, dtype=a.dtype, device=a.device)
    rows_per_chunk = max(1, _QUANTILE_MAX_NUMEL // max(1, a.shape[1]))
    return torch.cat([torch.quantile(chunk, qs, dim=1) for chunk in a.split(rows_per_chunk)], dim=1)


def int6_candidate_scales(w: Tensor, clip_range: int) -> Tensor:
    """Float16 row scales [K, rows] for each clip percentile in INT6_CLIP_QUANTILES."""
    a = w.float().abs()
    partial = [q for q in INT6_CLIP_QUANTILES if q < 1.0]
    clips = list(row_quantiles(a, partial)) if partial else []
    clips += [a.amax(dim=1) for q in INT6_CLIP_QUANTILES if q >= 1.0]
    return torch.stack([(c / clip_range).clamp_min(1.0 / clip_range).to(SCALE_DTYPE) for c in clips])


def round_to_grid(w: Tensor, scale: Tensor, clip_range: int) -> Tensor:
    """Codes (as floats) of w [..., cols] with one float32 scale per row [...]."""
    return torch.clamp(torch.round(w / scale.unsqueeze(-1)), -clip_range, clip_range)


def reconstruction_mse(w: Tensor, codes: Tensor, scale: Tensor) -> float:
    """Mean squared error of codes * scale against w, the reference's selection criterion."""
    return (w - codes.float() * scale.float().unsqueeze(-1)).pow(2).mean().item()


def quantize_int6_rtn(t: Tensor, clip_range: int = 31) -> tuple[Tensor, Tensor]:
    """int6 codes by rounding to nearest, with the clip percentile of least MSE."""
    w = t.float()
    if w.ndim != 2:  # one scale for the whole tensor, from its max |w|
        amax = w.abs().max().item()
        scale = torch.tensor(amax / clip_range if amax > 0 else 1.0, dtype=SCALE_DTYPE)
        codes = torch.clamp(torch.round(w / scale.float()), -clip_range, clip_range)
        return codes.to(torch.int8), scale
    best: tuple[float, Tensor, Tensor] | None = None
    for scale in int6_candidate_scales(w, clip_range):
        codes = round_to_grid(w, scale.float(), clip_range)
        err = reconstruction_mse(w, codes, scale)
        if best is None or err < best[0]:  # strict: the earliest of equal candidates wins
            best = (err, codes, scale)
    assert best is not None
    return best[1].to(torch.int8), best[2]


def quantize_int8(t: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes per row (per tensor when not 2-D), clipped at INT8_CLIP_QUANTILE.

    As the reference, codes are computed with the float32 scale and the scale is then
    stored as float16 (per row) or float32 (per tensor).
    """
    w = t.float()
    if w.ndim == 2:
        clip = row_quantiles(w.abs(), [INT8_CLIP_QUANTILE])[0]
        clipped = torch.maximum(torch.minimum(w, clip[:, None]), -clip[:, None])
        scale = (clip / INT8_CLIP_RANGE).clamp_min(1.0 / INT8_CLIP_RANGE)
        codes = round_to_grid(clipped, scale, INT8_CLIP_RANGE)
        return codes.to(torch.int8), scale.to(SCALE_DTYPE)
    clip_abs = float(torch.quantile(w.abs().flatten(), INT8_CLIP_QUANTILE).item())
    scale = torch.tensor(clip_abs / INT8_CLIP_RANGE if clip_abs > 0 else 1.0, dtype=torch.float32)
    codes = torch.clamp(torch.round(torch.clamp(w, -clip_abs, clip_abs) / scale), -INT8_CLIP_RANGE, INT8_CLIP_RANGE)
    return codes.to(torch.int8), scale


def quantize_tensor(name: str, t: Tensor, clip_range: int = 31,
                    passthrough_max_numel: int = PASSTHROUGH_MAX_NUMEL) -> QuantizedTensor:
    """One tensor without calibration data (int6 by rounding to nearest)."""
    t = t.detach().to("cpu").contiguous()
    scheme = choose_scheme(name, t, passthrough_max_numel)
    if scheme == PASSTHROUGH:
        kept = t.to(PASSTHROUGH_DTYPE) if t.is_floating_point() else t
        return QuantizedTensor(scheme, t.dtype, kept)
    if scheme == CONTROL:
        return QuantizedTensor(scheme, t.dtype, t.float())
    if scheme == INT6:
        codes, scale = quantize_int6_rtn(t, clip_range)
        return QuantizedTensor(scheme, t.dtype, codes, scale, method="rtn")
    codes, scale = quantize_int8(t)
    return QuantizedTensor(scheme, t.dtype, codes, scale)
