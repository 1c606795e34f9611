"""Post-training quantization with the reference's mixed scheme.

Per tensor (per-layer names, as `model.unbank_state_dict` gives them), in the reference's
order of precedence:

- non-float tensors and tensors of at most 65,536 elements: kept, floats stored as float16;
- control tensors (`model.CONTROL_TENSOR_NAME_PATTERNS`): kept in float32 (every control
  tensor of the reference's model is small, so the rule above already caught it);
- attention and MLP matrices: int6 codes in [-clip, clip] with one float16 scale per row,
  the scale chosen among five clip percentiles by mean squared error, either by rounding
  to nearest or by GPTQ against calibration Hessians;
- everything else (embeddings): int8 per row, clipped at the 99.99984th percentile.

GPTQ here computes what the reference's column-by-column CPU loop computes, but for all
five clip candidates at once (stacked as extra rows) and for all layers of one shape at
once (batched Cholesky and matrix products), on the GPU when there is one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from .model import is_control_tensor
from .runtime import autocast, synchronize

INT6_CLIP_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)  # 1.0 = the row's max |w|
INT8_CLIP_QUANTILE = 99.99984 / 100.0
INT8_CLIP_RANGE = 127
PASSTHROUGH_MAX_NUMEL = 65_536
INT6_CATEGORIES = frozenset({"attn", "mlp"})
SCALE_DTYPE = torch.float16
PASSTHROUGH_DTYPE = torch.float16
HESSIAN_DAMPING = 0.01  # added (times the mean diagonal) when calibration ends
_QUANTILE_MAX_NUMEL = 1 << 24  # torch.quantile refuses larger inputs

# Schemes, as recorded in a .ptz
INT6, INT8, PASSTHROUGH, CONTROL = "int6", "int8", "passthrough", "passthrough_ctrl"
SCHEMES = (INT6, INT8, PASSTHROUGH, CONTROL)

Hessians = Mapping[tuple[str, ...], Tensor]  # weights that share one input -> E[x^T x]
Progress = Callable[[int], None]  # called with the number of tensors just finished


@dataclass
class QuantizedTensor:
    """One tensor as stored: codes and scales, or the kept values."""

    scheme: str
    dtype: torch.dtype  # the original dtype, restored by dequantize()
    values: Tensor  # int8 codes (int6/int8) or the stored tensor (passthrough schemes)
    scale: Tensor | None = None  # per row [rows], or a scalar for tensors that are not 2-D
    method: str = ""  # how int6 codes were chosen: "gptq" or "rtn"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def stored_bytes(self) -> int:
        scale_bytes = 0 if self.scale is None else _nbytes(self.scale)
        return _nbytes(self.values) + scale_bytes

    def dequantize(self) -> Tensor:
        """The reference's dequantization: codes times scales, cast to the original dtype."""
        if self.scheme in (PASSTHROUGH, CONTROL):
            return self.values.to(self.dtype)
        assert self.scale is not None
        codes = self.values.float()
        if self.scale.ndim > 0:
            scale = self.scale.float().view(codes.shape[0], *([1] * (codes.ndim - 1)))
            return (codes * scale).to(self.dtype)
        return (codes * float(self.scale.item())).to(self.dtype)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# --- Which scheme -------------------------------------------------------------------------

def classify_param(name: str) -> str:
    """The reference's tensor categories: embed, mlp, attn or other.

    Like the reference, any ".proj." outside an MLP counts as attention (so a large
    BigramHash or value-embedding projection would be int6).
    """
    if "tok_emb" in name or "lm_head" in name:
        return "embed"
    if ".mlp." in name:
        return "mlp"
    if ".attn." in name or ".proj." in name:
        return "attn"
    return "other"


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


def dequantize_state_dict(tensors: Mapping[str, QuantizedTensor]) -> dict[str, Tensor]:
    return {name: qt.dequantize() for name, qt in tensors.items()}


# --- GPTQ --------------------------------------------------------------------------------

def prepare_gptq_hessians(h: Tensor, percdamp: float) -> tuple[Tensor, Tensor, Tensor]:
    """For Hessians [B, C, C]: (dead columns [B, C], activation order [B, C], upper Cholesky
    factor of the inverse of the permuted, damped Hessian [B, C, C], or NaN where the
    Hessian is not positive definite)."""
    h = h.float().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0  # inputs never seen: any value works, so quantize them as zero
    diag.masked_fill_(dead, 1.0)
    diag.add_((percdamp * diag.mean(dim=-1)).unsqueeze(-1))
    order = torch.argsort(diag, dim=-1, descending=True)  # activation order: large inputs first
    h = torch.gather(torch.gather(h, 1, order.unsqueeze(-1).expand_as(h)), 2, order.unsqueeze(1).expand_as(h))
    lower, info = torch.linalg.cholesky_ex(h)
    h_inv = torch.cholesky_inverse(lower)
    upper, info_inv = torch.linalg.cholesky_ex(h_inv, upper=True)
    upper[(info != 0) | (info_inv != 0)] = float("nan")
    return dead, order, upper


def gptq_codes(w: Tensor, h_inv_upper: Tensor, scale: Tensor, clip_range: int, block_size: int) -> Tensor:
    """The GPTQ sweep (Frantar et al. 2023) for B independent problems at once.

    w [B, N, C] in activation order, h_inv_upper [B, C, C], scale [B, N] (float32).
    Returns codes [B, N, C] (floats). Each column is rounded, and its error, scaled by the
    inverse Hessian's Cholesky factor, is pushed onto the columns not yet quantized:
    lazily within a block of columns, by one matrix product for the rest.
    """
    w = w.clone()
    codes = torch.empty_like(w)
    cols = w.shape[-1]
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        block = w[..., i1:i2].clone()
        u_block = h_inv_upper[:, i1:i2, i1:i2]
        errors = torch.empty_like(block)
        for j in range(i2 - i1):
            col = block[..., j]
            q = torch.clamp(torch.round(col / scale), -clip_range, clip_range)
            codes[..., i1 + j] = q
            err = (col - q * scale) / u_block[:, j, j].unsqueeze(-1)
            errors[..., j] = err
            block[..., j:] -= err.unsqueeze(-1) * u_block[:, j, j:].unsqueeze(1)
        if i2 < cols:
            w[..., i2:] -= torch.bmm(errors, h_inv_upper[:, i1:i2, i2:])
    return codes


def gptq_quantize_batch(weights: Tensor, hessians: Tensor, row_splits: Sequence[int], clip_range: int = 31,
                        block_size: int = 128, percdamp: float = 0.01) -> list[list[tuple[Tensor, Tensor, str]]]:
    """GPTQ int6 for B problems of one shape: weights [B, R, C], hessians [B, C, C].

    The R rows of a problem may be several matrices sharing one Hessian (row_splits gives
    their row counts, e.g. c_q, c_k, c_v); each picks its own clip percentile, by MSE over
    the matrix as the reference. Returns, per problem and matrix, (codes int8 [rows, C] in
    the original column order, float16 scales [rows], method); a problem whose Hessian
    cannot be factored falls back to rounding to nearest, as the reference.
    """
    w = weights.float()
    b, r, c = w.shape
    dead, order, upper = prepare_gptq_hessians(hessians.to(w.device), percdamp)
    k = len(INT6_CLIP_QUANTILES)
    scales = int6_candidate_scales(w.reshape(b * r, c), clip_range).view(k, b, r).transpose(0, 1)  # [B, K, R]
    w_ordered = torch.gather(w, 2, order.unsqueeze(1).expand_as(w))
    w_ordered.masked_fill_(torch.gather(dead, 1, order).unsqueeze(1), 0.0)
    factored = ~torch.isnan(upper).flatten(1).any(dim=1)
    safe_upper = torch.where(factored[:, None, None], upper, torch.eye(c, device=w.device).expand_as(upper))
    codes = gptq_codes(w_ordered.repeat(1, k, 1), safe_upper, scales.reshape(b, k * r).float(), clip_range, block_size)
    codes = codes.view(b, k, r, c)
    inverse = torch.argsort(order, dim=-1)
    results: list[list[tuple[Tensor, Tensor, str]]] = []
    for i in range(b):
        per_matrix = []
        for lo, hi in _row_ranges(row_splits):
            if not factored[i]:
                q, s = quantize_int6_rtn(w[i, lo:hi].cpu(), clip_range)
                per_matrix.append((q, s, "rtn"))
                continue
            errs = [reconstruction_mse(w_ordered[i, lo:hi], codes[i, j, lo:hi], scales[i, j, lo:hi]) for j in range(k)]
            best = min(range(k), key=lambda j: (errs[j], j))
            q = codes[i, best, lo:hi][:, inverse[i]]
            per_matrix.append((q.to(torch.int8).cpu(), scales[i, best, lo:hi].cpu(), "gptq"))
        results.append(per_matrix)
    return results


def _row_ranges(row_splits: Sequence[int]) -> Iterator[tuple[int, int]]:
    lo = 0
    for rows in row_splits:
        yield lo, lo + rows
        lo += rows


@dataclass
class GPTQProblem:
    names: tuple[str, ...]  # matrices sharing one input, quantized together
    hessian: Tensor

    def key(self, sd: Mapping[str, Tensor]) -> tuple[tuple[int, ...], int]:
        return tuple(sd[n].shape[0] for n in self.names), self.hessian.shape[0]


def plan_gptq(sd: Mapping[str, Tensor], hessians: Hessians,
              passthrough_max_numel: int = PASSTHROUGH_MAX_NUMEL) -> list[list[GPTQProblem]]:
    """Group the int6 matrices that have a Hessian into batches of identical shape."""
    batches: dict[tuple[tuple[int, ...], int], list[GPTQProblem]] = {}
    for names, h in hessians.items():
        members = tuple(n for n in names if n in sd and choose_scheme(n, sd[n], passthrough_max_numel) == INT6
                        and sd[n].ndim == 2 and sd[n].shape[1] == h.shape[0])
        if members:
            problem = GPTQProblem(members, h)
            batches.setdefault(problem.key(sd), []).append(problem)
    return list(batches.values())


def quantize_state_dict(sd: Mapping[str, Tensor], clip_range: int = 31, hessians: Hessians | None = None,
                        block_size: int = 128, percdamp: float = 0.01, device: torch.device | None = None,
                        max_batch_elements: int = 1 << 28, on_progress: Progress | None = None,
                        timings: dict[str, float] | None = None,
                        passthrough_max_numel: int = PASSTHROUGH_MAX_NUMEL) -> dict[str, QuantizedTensor]:
    """Quantize a per-layer state dict; with Hessians, their int6 matrices by GPTQ on `device`.

    `timings`, when given, receives the seconds spent in GPTQ ("gptq") and on the other
    tensors ("rounding").
    """
    device = device or torch.device("cpu")
    done: dict[str, QuantizedTensor] = {}
    started = time.perf_counter()
    for batch in plan_gptq(sd, hessians or {}, passthrough_max_numel):
        rows = sum(sd[n].shape[0] for n in batch[0].names) * len(INT6_CLIP_QUANTILES)
        per_chunk = max(1, max_batch_elements // (rows * batch[0].hessian.shape[0]))
        for start in range(0, len(batch), per_chunk):
            chunk = batch[start:start + per_chunk]
            done.update(_gptq_chunk(sd, chunk, clip_range, block_size, percdamp, device))
            if on_progress:
                on_progress(sum(len(p.names) for p in chunk))
    synchronize(device)
    gptq_done = time.perf_counter()
    for name, t in sd.items():
        if name not in done:
            done[name] = quantize_tensor(name, t, clip_range, passthrough_max_numel)
            if on_progress:
                on_progress(1)
    if timings is not None:
        timings.update(gptq=gptq_done - started, rounding=time.perf_counter() - gptq_done)
    return {name: done[name] for name in sd}


def _gptq_chunk(sd: Mapping[str, Tensor], problems: list[GPTQProblem], clip_range: int, block_size: int,
                percdamp: float, device: torch.device) -> dict[str, QuantizedTensor]:
    weights = torch.stack([torch.cat([sd[n].detach().float() for n in p.names]) for p in problems]).to(device)
    hessians = torch.stack([p.hessian.float() for p in problems]).to(device)
    row_splits = [sd[n].shape[0] for n in problems[0].names]
    results = gptq_quantize_batch(weights, hessians, row_splits, clip_range, block_size, percdamp)
    out: dict[str, QuantizedTensor] = {}
    for problem, per_matrix in zip(problems, results):
        for name, (codes, scale, method) in zip(problem.names, per_matrix):
            out[name] = QuantizedTensor(INT6, sd[name].dtype, codes.contiguous(), scale.contiguous(), method)
    return out


# --- Calibration -------------------------------------------------------------------------

def collect_hessians(model: torch.nn.Module, batches: Iterable[tuple[Tensor, Tensor]], device: torch.device,
                     on_batch: Callable[[], None] | None = None) -> dict[tuple[str, ...], Tensor]:
    """The calibration Hessians of the batches: their sums, averaged per batch and damped."""
    sums, count = accumulate_hessians(model, batches, device, on_batch)
    return finalize_hessians(sums, count)


def accumulate_hessians(model: torch.nn.Module, batches: Iterable[tuple[Tensor, Tensor]], device: torch.device,
                        on_batch: Callable[[], None] | None = None) -> tuple[dict[tuple[str, ...], Tensor], int]:
    """Sum x^T x of every block matrix's input over the batches (the model's
    `observe_linear_inputs`), as the reference; returns the sums and the number of batches."""
    sums: dict[tuple[str, ...], Tensor] = {}

    def accumulate(names: tuple[str, ...], x: Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        if names not in sums:
            sums[names] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float32, device=flat.device)
        with torch.autocast(device_type=flat.device.type, enabled=False):  # sum in float32
            sums[names].addmm_(flat.T, flat)

    was_training = model.training
    model.eval()
    count = 0
    try:
        with torch.no_grad(), autocast(device), model.observe_linear_inputs(accumulate):
            for inputs, targets in batches:
                model(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
                count += 1
                if on_batch:
                    on_batch()
    finally:
        model.train(was_training)
    return sums, count


def finalize_hessians(sums: Mapping[tuple[str, ...], Tensor], num_batches: int) -> dict[tuple[str, ...], Tensor]:
    """Average over batches and add 0.01 x the mean diagonal, so that every Hessian is
    positive definite before GPTQ adds its own damping."""
    out = {}
    for names, total in sums.items():
        h = total / max(num_batches, 1)
        damp = HESSIAN_DAMPING * torch.diag(h).mean().clamp_min(1e-6)
        out[names] = h + damp * torch.eye(h.shape[0], device=h.device)
    return out
