"""GPTQ (Frantar et al. 2023) for the int6 matrices, and `quantize_state_dict`, which
quantizes a whole per-layer state dict: its int6 matrices (and, when the plan says so, the
token embedding, on the output layer's Hessian) by GPTQ where they have calibration
Hessians, every other tensor by `schemes.quantize_tensor`, then adds LQER's corrections
where the plan asks for them (`lqer`).

This computes what the reference's column-by-column CPU loop computes, but for all five
clip candidates at once (stacked as extra rows) and for all layers of one shape at once
(batched Cholesky and matrix products), on the GPU when there is one.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..artifacts.quantized import INT6, QuantizedTensor
from ..model.state_dict import classify_param
from ..runtime import synchronize
from .lqer import add_corrections
from .schemes import (
    INT6_CATEGORIES,
    INT6_CLIP_QUANTILES,
    REFERENCE_PLAN,
    QuantPlan,
    choose_scheme,
    int6_candidate_scales,
    method_of,
    quantize_int6_rtn,
    quantize_tensor,
    reconstruction_mse,
)

Hessians = Mapping[tuple[str, ...], Tensor]  # weights that share one input -> E[x^T x]


Progress = Callable[[int], None]  # called with the number of tensors just finished


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
                        block_size: int = 128, percdamp: float = 0.01,
                        clip_sigmas: float = 0.0, scale_floor: bool = True) -> list[list[tuple[Tensor, Tensor, str]]]:
    """GPTQ int6 for B problems of one shape: weights [B, R, C], hessians [B, C, C].

    The R rows of a problem may be several matrices sharing one Hessian (row_splits gives
    their row counts, e.g. c_q, c_k, c_v); each picks its own clip percentile, by MSE over
    the matrix as the reference. Returns, per problem and matrix, (codes int8 [rows, C] in
    the original column order, float16 scales [rows], method); a problem whose Hessian
    cannot be factored falls back to rounding to nearest, as the reference. With
    clip_sigmas > 0 each row has one candidate scale, clip_sigmas standard deviations;
    without scale_floor the percentiles' scales may go under the reference's 1 / clip_range.
    """
    w = weights.float()
    b, r, c = w.shape
    dead, order, upper = prepare_gptq_hessians(hessians.to(w.device), percdamp)
    candidates = int6_candidate_scales(w.reshape(b * r, c), clip_range, clip_sigmas, scale_floor)
    k = candidates.shape[0]
    scales = candidates.view(k, b, r).transpose(0, 1)  # [B, K, R]
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
                q, s = quantize_int6_rtn(w[i, lo:hi].cpu(), clip_range, clip_sigmas, scale_floor)
                per_matrix.append((q, s, method_of("rtn", clip_sigmas)))
                continue
            errs = [reconstruction_mse(w_ordered[i, lo:hi], codes[i, j, lo:hi], scales[i, j, lo:hi]) for j in range(k)]
            best = min(range(k), key=lambda j: (errs[j], j))
            q = codes[i, best, lo:hi][:, inverse[i]]
            per_matrix.append((q.to(torch.int8).cpu(), scales[i, best, lo:hi].cpu(), method_of("gptq", clip_sigmas)))
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
    scheme: str
    limit: int  # the codes' largest magnitude
    clip_sigmas: float
    scale_floor: bool = True

    def key(self, sd: Mapping[str, Tensor]) -> tuple:
        return (tuple(sd[n].shape[0] for n in self.names), self.hessian.shape[0], self.scheme, self.limit,
                self.clip_sigmas, self.scale_floor)


def gptq_member(name: str, t: Tensor, h: Tensor, plan: QuantPlan) -> bool:
    """Whether GPTQ quantizes this tensor on Hessian h: an int6 matrix, or the token
    embedding when the plan says so; its columns the Hessian's size."""
    if t.ndim != 2 or t.shape[1] != h.shape[0]:
        return False
    category = classify_param(name)
    if category == "embed":
        return plan.gptq_embed and choose_scheme(name, t, plan) != "passthrough"
    return category in INT6_CATEGORIES and choose_scheme(name, t, plan) == INT6


def plan_gptq(sd: Mapping[str, Tensor], hessians: Hessians,
              plan: QuantPlan = REFERENCE_PLAN) -> list[list[GPTQProblem]]:
    """Group the matrices that have a Hessian into batches of identical shape and scheme."""
    batches: dict[tuple, list[GPTQProblem]] = {}
    for names, h in hessians.items():
        members = tuple(n for n in names if n in sd and gptq_member(n, sd[n], h, plan))
        if members:
            scheme = choose_scheme(members[0], sd[members[0]], plan)
            problem = GPTQProblem(members, h, scheme, plan.limit(scheme), plan.clip_sigmas(members[0]),
                                  plan.scale_floor)
            batches.setdefault(problem.key(sd), []).append(problem)
    return list(batches.values())


def quantize_state_dict(sd: Mapping[str, Tensor], clip_range: int | None = None, hessians: Hessians | None = None,
                        block_size: int = 128, percdamp: float = 0.01, device: torch.device | None = None,
                        max_batch_elements: int = 1 << 28, on_progress: Progress | None = None,
                        timings: dict[str, float] | None = None,
                        plan: QuantPlan = REFERENCE_PLAN) -> dict[str, QuantizedTensor]:
    """Quantize a per-layer state dict as the plan says (clip_range, when given, replaces
    the plan's); with Hessians, its matrices by GPTQ on `device`.

    `timings`, when given, receives the seconds spent in GPTQ ("gptq"), on the other
    tensors ("rounding") and on LQER's corrections ("lqer").
    """
    if clip_range is not None:
        plan = dataclasses.replace(plan, clip_range=clip_range)
    device = device or torch.device("cpu")
    done: dict[str, QuantizedTensor] = {}
    started = time.perf_counter()
    for batch in plan_gptq(sd, hessians or {}, plan):
        candidates = 1 if batch[0].clip_sigmas > 0 else len(INT6_CLIP_QUANTILES)
        rows = sum(sd[n].shape[0] for n in batch[0].names) * candidates
        per_chunk = max(1, max_batch_elements // (rows * batch[0].hessian.shape[0]))
        for start in range(0, len(batch), per_chunk):
            chunk = batch[start:start + per_chunk]
            done.update(_gptq_chunk(sd, chunk, block_size, percdamp, device))
            if on_progress:
                on_progress(sum(len(p.names) for p in chunk))
    synchronize(device)
    gptq_done = time.perf_counter()
    for name, t in sd.items():
        if name not in done:
            done[name] = quantize_tensor(name, t, plan)
            if on_progress:
                on_progress(1)
    rounded = time.perf_counter()
    out = {name: done[name] for name in sd}
    if plan.lqer_rank > 0:
        add_corrections(sd, out, plan, device)
    if timings is not None:
        timings.update(gptq=gptq_done - started, rounding=rounded - gptq_done, lqer=time.perf_counter() - rounded)
    return out


def _gptq_chunk(sd: Mapping[str, Tensor], problems: list[GPTQProblem], block_size: int, percdamp: float,
                device: torch.device) -> dict[str, QuantizedTensor]:
    weights = torch.stack([torch.cat([sd[n].detach().float() for n in p.names]) for p in problems]).to(device)
    hessians = torch.stack([p.hessian.float() for p in problems]).to(device)
    row_splits = [sd[n].shape[0] for n in problems[0].names]
    first = problems[0]
    results = gptq_quantize_batch(weights, hessians, row_splits, first.limit, block_size, percdamp, first.clip_sigmas,
                                  first.scale_floor)
    out: dict[str, QuantizedTensor] = {}
    for problem, per_matrix in zip(problems, results):
        for name, (codes, scale, method) in zip(problem.names, per_matrix):
            out[name] = QuantizedTensor(problem.scheme, sd[name].dtype, codes.contiguous(), scale.contiguous(), method)
    return out
