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

`QuantPlan` holds the settings that depart from it, each off by default: the token
embedding's bits, clipping at k standard deviations of a row (per group: MLP, attention,
embedding) in place of the percentile searches, int8 rows for small gates, GPTQ on the
embedding (`gptq`) and LQER's low-rank corrections (`lqer`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from ..artifacts.quantized import CONTROL, INT6, INT8, PASSTHROUGH, QuantizedTensor, code_limit, int_scheme
from ..model.state_dict import BANK_NAMES, bank_slots, classify_param, is_control_tensor
from ..model.weight_grid import SCALE_DTYPE, RowGrid, least_scale, round_to_grid, row_scales, sigma_clip

if TYPE_CHECKING:
    from ..config import QuantConfig

INT6_CLIP_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)  # 1.0 = the row's max |w|
INT8_CLIP_QUANTILE = 99.99984 / 100.0
INT8_CLIP_RANGE = 127
PASSTHROUGH_MAX_NUMEL = 65_536
INT6_CATEGORIES = frozenset({"attn", "mlp"})
PASSTHROUGH_DTYPE = torch.float16
_QUANTILE_MAX_NUMEL = 1 << 24  # torch.quantile refuses larger inputs


# --- The plan ------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantPlan:
    """How each tensor is quantized; the defaults are the reference's scheme."""

    clip_range: int = 31
    passthrough_max_numel: int = PASSTHROUGH_MAX_NUMEL
    embed_bits: int = 8
    mlp_clip_sigmas: float = 0.0  # 0: the reference's percentile search
    attn_clip_sigmas: float = 0.0
    embed_clip_sigmas: float = 0.0
    gptq_embed: bool = False
    gates_int8: bool = False
    scale_floor: bool = True  # the reference's least row scale, 1 / the codes' limit
    lqer_rank: int = 0  # 0: no low-rank corrections
    lqer_top_k: int = 3
    lqer_factor_bits: int = 4
    lqer_group_size: int = 64

    @classmethod
    def from_config(cls, q: QuantConfig) -> QuantPlan:
        return cls(q.quant_clip_range, q.quant_passthrough_max_numel, q.quant_embed_bits, q.quant_mlp_clip_sigmas,
                   q.quant_attn_clip_sigmas, q.quant_embed_clip_sigmas, q.quant_gptq_embed, q.quant_gates_int8,
                   q.quant_scale_floor, q.quant_lqer_rank, q.quant_lqer_top_k, q.quant_lqer_factor_bits,
                   q.quant_lqer_group_size)

    def clip_sigmas(self, name: str) -> float:
        """The k of k-sigma clipping for this tensor (0: the reference's clipping)."""
        return {"mlp": self.mlp_clip_sigmas, "attn": self.attn_clip_sigmas,
                "embed": self.embed_clip_sigmas}.get(classify_param(name), 0.0)

    def limit(self, scheme: str) -> int:
        return code_limit(scheme, self.clip_range)


REFERENCE_PLAN = QuantPlan()


def bank_grids(plan: QuantPlan, banks: dict[str, Tensor], num_layers: int) -> tuple[RowGrid | None, ...]:
    """The grid each parameter bank's matrices (in BANK_NAMES' order) are quantized to, for
    training to round them to: int6 rows as the plan scales them, with the reference's
    percentile search taken at its last candidate, the row's largest weight (where every
    weight is under 1, as in the reference's trained models, the floor makes all its
    candidates one grid); None where the matrices stay floats."""
    slots = bank_slots(num_layers)
    grids: list[RowGrid | None] = []
    for bank in BANK_NAMES:
        name = slots[bank][0][1]
        if choose_scheme(name, banks[bank][0], plan) != INT6:
            grids.append(None)
            continue
        grids.append(RowGrid(plan.limit(INT6), plan.clip_sigmas(name), plan.scale_floor))
    return tuple(grids)


# --- Which scheme -------------------------------------------------------------------------

def choose_scheme(name: str, t: Tensor, plan: QuantPlan = REFERENCE_PLAN) -> str:
    if not t.is_floating_point() or t.numel() <= plan.passthrough_max_numel:
        if plan.gates_int8 and t.is_floating_point() and t.ndim == 2 and is_control_tensor(name):
            return INT8
        return PASSTHROUGH
    if is_control_tensor(name):
        return INT8 if plan.gates_int8 and t.ndim == 2 else CONTROL
    category = classify_param(name)
    if category in INT6_CATEGORIES:
        return INT6
    return int_scheme(plan.embed_bits) if category == "embed" else INT8


# --- Rounding to nearest --------------------------------------------------------------------

def row_quantiles(a: Tensor, q: Sequence[float]) -> Tensor:
    """torch.quantile over dim 1 for several q at once -> [len(q), rows], in row chunks
    small enough for torch.quantile."""
    qs = torch.tensor(q, dtype=a.dtype, device=a.device)
    rows_per_chunk = max(1, _QUANTILE_MAX_NUMEL // max(1, a.shape[1]))
    return torch.cat([torch.quantile(chunk, qs, dim=1) for chunk in a.split(rows_per_chunk)], dim=1)


def int6_candidate_scales(w: Tensor, clip_range: int, clip_sigmas: float = 0.0, floor: bool = True) -> Tensor:
    """Float16 row scales [K, rows] for each clip percentile in INT6_CLIP_QUANTILES (at
    least 1 / clip_range with floor, as the reference's), or [1, rows] for clipping at
    clip_sigmas standard deviations."""
    if clip_sigmas > 0:
        return sigma_scales(w, clip_range, clip_sigmas).unsqueeze(0)
    a = w.float().abs()
    partial = [q for q in INT6_CLIP_QUANTILES if q < 1.0]
    clips = list(row_quantiles(a, partial)) if partial else []
    clips += [a.amax(dim=1) for q in INT6_CLIP_QUANTILES if q >= 1.0]
    return torch.stack([row_scales(c, clip_range, least_scale(clip_range, floor)) for c in clips])


def sigma_scales(w: Tensor, limit: int, clip_sigmas: float) -> Tensor:
    """Float16 row scales clipping each row of w at clip_sigmas standard deviations, as
    #1855 does: also where no weight reaches the clip, so the clip sets the grid's step and
    with it the codes' entropy (bytes), not the row's largest weight. A row of zeros keeps
    the smallest scale."""
    return row_scales(sigma_clip(w, clip_sigmas), limit)


def reconstruction_mse(w: Tensor, codes: Tensor, scale: Tensor) -> float:
    """Mean squared error of codes * scale against w, the reference's selection criterion."""
    return (w - codes.float() * scale.float().unsqueeze(-1)).pow(2).mean().item()


def quantize_int6_rtn(t: Tensor, clip_range: int = 31, clip_sigmas: float = 0.0,
                      floor: bool = True) -> tuple[Tensor, Tensor]:
    """int6 codes by rounding to nearest, with the clip percentile of least MSE (or the
    scales of clip_sigmas standard deviations)."""
    w = t.float()
    if w.ndim != 2:  # one scale for the whole tensor, from its max |w|
        amax = w.abs().max().item()
        scale = torch.tensor(amax / clip_range if amax > 0 else 1.0, dtype=SCALE_DTYPE)
        codes = torch.clamp(torch.round(w / scale.float()), -clip_range, clip_range)
        return codes.to(torch.int8), scale
    best: tuple[float, Tensor, Tensor] | None = None
    for scale in int6_candidate_scales(w, clip_range, clip_sigmas, floor):
        codes = round_to_grid(w, scale.float(), clip_range)
        err = reconstruction_mse(w, codes, scale)
        if best is None or err < best[0]:  # strict: the earliest of equal candidates wins
            best = (err, codes, scale)
    assert best is not None
    return best[1].to(torch.int8), best[2]


def quantize_int8(t: Tensor, limit: int = INT8_CLIP_RANGE, floor: bool = True) -> tuple[Tensor, Tensor]:
    """int8 codes per row (per tensor when not 2-D), clipped at INT8_CLIP_QUANTILE (codes
    in [-limit, limit]: 127 is the reference's int8).

    As the reference, codes are computed with the float32 scale and the scale is then
    stored as float16 (per row) or float32 (per tensor).
    """
    w = t.float()
    if w.ndim == 2:
        clip = row_quantiles(w.abs(), [INT8_CLIP_QUANTILE])[0]
        clipped = torch.maximum(torch.minimum(w, clip[:, None]), -clip[:, None])
        scale = (clip / limit).clamp_min(least_scale(limit, floor))
        codes = round_to_grid(clipped, scale, limit)
        return codes.to(torch.int8), scale.to(SCALE_DTYPE)
    clip_abs = float(torch.quantile(w.abs().flatten(), INT8_CLIP_QUANTILE).item())
    scale = torch.tensor(clip_abs / limit if clip_abs > 0 else 1.0, dtype=torch.float32)
    codes = torch.clamp(torch.round(torch.clamp(w, -clip_abs, clip_abs) / scale), -limit, limit)
    return codes.to(torch.int8), scale


def quantize_rows(t: Tensor, limit: int, clip_sigmas: float, floor: bool = True) -> tuple[Tensor, Tensor]:
    """Codes in [-limit, limit] with one scale per row: clipped at clip_sigmas standard
    deviations, or with clip_sigmas 0 at the reference's int8 percentile."""
    if clip_sigmas <= 0 or t.ndim != 2:
        return quantize_int8(t, limit, floor)
    w = t.float()
    scale = sigma_scales(w, limit, clip_sigmas)
    return round_to_grid(w, scale.float(), limit).to(torch.int8), scale


def method_of(base: str, clip_sigmas: float) -> str:
    """How codes were chosen, as a .ptz records it: "sigma" marks k-sigma scales."""
    if clip_sigmas <= 0:
        return base
    return f"{base}_sigma" if base else "sigma"


def quantize_tensor(name: str, t: Tensor, plan: QuantPlan = REFERENCE_PLAN) -> QuantizedTensor:
    """One tensor without calibration data (int6 by rounding to nearest)."""
    t = t.detach().to("cpu").contiguous()
    scheme = choose_scheme(name, t, plan)
    if scheme == PASSTHROUGH:
        kept = t.to(PASSTHROUGH_DTYPE) if t.is_floating_point() else t
        return QuantizedTensor(scheme, t.dtype, kept)
    if scheme == CONTROL:
        return QuantizedTensor(scheme, t.dtype, t.float())
    if is_control_tensor(name):  # a gate's row: its largest |w| sets the scale, no floor
        scale = row_scales(t.float().abs().amax(dim=1), INT8_CLIP_RANGE)
        codes = round_to_grid(t.float(), scale.float(), INT8_CLIP_RANGE).to(torch.int8)
        return QuantizedTensor(scheme, t.dtype, codes, scale, method="max")
    sigmas = plan.clip_sigmas(name)
    if scheme == INT6 and classify_param(name) in INT6_CATEGORIES:
        codes, scale = quantize_int6_rtn(t, plan.clip_range, sigmas, plan.scale_floor)
        return QuantizedTensor(scheme, t.dtype, codes, scale, method=method_of("rtn", sigmas))
    codes, scale = quantize_rows(t, plan.limit(scheme), sigmas, plan.scale_floor)
    return QuantizedTensor(scheme, t.dtype, codes, scale, method=method_of("", sigmas))
