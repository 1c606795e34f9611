"""Fitting an artifact into its byte budget by zeroing its cheapest codes of +-1.

When the code plus the compressed model exceed the budget, the bytes cheapest to give up
are codes of +-1 whose weights lie nearest zero: moving one to 0 lowers the codes' entropy
for little added error (a dead zone around zero). Candidates are ranked across every
integer matrix by the squared error their zeroing adds against the unquantized weight,
each column's error weighted by its input's energy (the Hessian's diagonal) where the
matrix has a calibration Hessian. How many to zero is read off the codes' zeroth-order
entropy, scaled by what the compressor then actually saved, and checked by compressing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from ..artifacts.quantized import INT_SCHEMES, QuantizedTensor
from ..model.state_dict import is_control_tensor
from .gptq import Hessians

Compress = Callable[[dict[str, QuantizedTensor]], bytes]

MAX_ROUNDS = 6
MARGIN = 1.02  # aim a little past the excess: one round more costs a whole compression


def prunable(name: str, qt: QuantizedTensor) -> bool:
    """Integer matrices with one scale per row; the small gates (int8 control rows) stay."""
    return qt.scheme in INT_SCHEMES and qt.values.ndim == 2 and qt.scale is not None and not is_control_tensor(name)


def column_energies(hessians: Hessians | None) -> dict[str, Tensor]:
    """Each matrix's input energies (its Hessian's diagonal), by tensor name."""
    energies: dict[str, Tensor] = {}
    for names, h in (hessians or {}).items():
        diag = h.diagonal().float().cpu()
        energies.update({name: diag for name in names})
    return energies


def zeroing_costs(weight: Tensor, qt: QuantizedTensor, energy: Tensor | None) -> tuple[Tensor, Tensor]:
    """(flat indices of the codes of +-1, the squared error zeroing each would add)."""
    codes = qt.values
    w = weight.detach().float().cpu()
    residual = w - qt.dequantize().float()
    part = codes.float() * qt.scale.float()[:, None]  # what each code adds to the reconstruction
    cost = part * (2 * residual + part)  # (residual + part)^2 - residual^2
    if energy is not None and energy.numel() == w.shape[1]:
        cost = cost * energy[None, :]
    index = (codes.abs() == 1).flatten().nonzero().squeeze(1)
    return index, cost.flatten()[index]


def entropy_bits(hist: Tensor) -> float:
    """Zeroth-order entropy of a histogram of codes, in bits for all of them."""
    counts = hist[hist > 0].double()
    return float((counts * (counts.sum() / counts).log2()).sum())


@dataclass
class Candidates:
    """Every code of +-1 across the prunable matrices, cheapest first."""

    names: list[str]
    tensor: Tensor  # [N] which matrix (index into names)
    index: Tensor  # [N] flat index of the code in it
    positive: Tensor  # [N] bool: the code is +1
    hists: list[Tensor]  # each matrix's histogram of codes, offset by its limit
    limits: list[int]

    @classmethod
    def collect(cls, sd: Mapping[str, Tensor], tensors: Mapping[str, QuantizedTensor],
                hessians: Hessians | None) -> Candidates:
        energies = column_energies(hessians)
        names, costs, ids, indices, signs, hists, limits = [], [], [], [], [], [], []
        for name, qt in tensors.items():
            if not prunable(name, qt):
                continue
            index, cost = zeroing_costs(sd[name], qt, energies.get(name))
            limit = max(1, int(qt.values.abs().max().item()) if qt.values.numel() else 1)
            ids.append(torch.full_like(index, len(names)))
            names.append(name)
            costs.append(cost)
            indices.append(index)
            signs.append(qt.values.flatten()[index] > 0)
            hists.append(torch.bincount(qt.values.flatten().long() + limit, minlength=2 * limit + 1))
            limits.append(limit)
        if not names:
            empty = torch.zeros(0, dtype=torch.long)
            return cls([], empty, empty, empty.bool(), [], [])
        order = torch.cat(costs).argsort(stable=True)
        return cls(names, torch.cat(ids)[order], torch.cat(indices)[order], torch.cat(signs)[order], hists, limits)

    def __len__(self) -> int:
        return int(self.index.numel())

    def bits_saved(self, count: int) -> float:
        """Estimated bits the codes lose when the `count` cheapest are zeroed."""
        key = self.tensor[:count] * 2 + self.positive[:count].long()
        moved = torch.bincount(key, minlength=2 * len(self.names)).view(-1, 2).tolist()
        saved = 0.0
        for hist, limit, (minus, plus) in zip(self.hists, self.limits, moved):
            if minus or plus:
                after = hist.clone()
                after[limit - 1] -= minus
                after[limit + 1] -= plus
                after[limit] += minus + plus
                saved += entropy_bits(hist) - entropy_bits(after)
        return saved

    def count_for(self, bits: float) -> int:
        """The fewest cheapest codes whose zeroing saves at least `bits` (all of them when none do)."""
        low, high = 0, len(self)
        while low < high:
            mid = (low + high) // 2
            if self.bits_saved(mid) >= bits:
                high = mid
            else:
                low = mid + 1
        return low

    def zeroed(self, tensors: Mapping[str, QuantizedTensor], count: int) -> dict[str, QuantizedTensor]:
        """The tensors with the `count` cheapest codes zeroed (new tensors; the given ones untouched)."""
        out = dict(tensors)
        chosen = self.tensor[:count]
        for i, name in enumerate(self.names):
            index = self.index[:count][chosen == i]
            if index.numel():
                codes = tensors[name].values.clone()
                codes.view(-1)[index] = 0
                out[name] = dataclasses.replace(tensors[name], values=codes)
        return out


def fit_to_budget(sd: Mapping[str, Tensor], tensors: dict[str, QuantizedTensor], hessians: Hessians | None,
                  compress: Compress, allowed: int) -> tuple[dict[str, QuantizedTensor], bytes, dict[str, Any]]:
    """Zero the cheapest codes of +-1 until `compress(tensors)` takes at most `allowed` bytes.

    Returns the tensors, their compressed bytes and a record of the fit. Where even zeroing
    every candidate leaves too many bytes, the record says it did not fit (the caller's budget
    check then fails as it would without fitting)."""
    data = compress(tensors)
    record: dict[str, Any] = {"allowed_bytes": allowed, "bytes_before": len(data), "zeroed_codes": 0, "rounds": 0,
                              "fitted": len(data) <= allowed}
    if len(data) <= allowed:
        return tensors, data, record
    candidates = Candidates.collect(sd, tensors, hessians)
    count, ratio, fitted = 0, 1.0, tensors  # ratio: compressed bytes saved per estimated entropy byte
    for rounds in range(1, MAX_ROUNDS + 1):
        wanted = candidates.bits_saved(count) + 8 * (len(data) - allowed) * MARGIN / ratio
        count = max(candidates.count_for(wanted), min(len(candidates), count + 1))
        fitted = candidates.zeroed(tensors, count)
        data = compress(fitted)
        estimated = candidates.bits_saved(count) / 8
        if estimated > 0 and record["bytes_before"] > len(data):
            ratio = (record["bytes_before"] - len(data)) / estimated
        record.update(rounds=rounds, zeroed_codes=count, fitted=len(data) <= allowed)
        if record["fitted"] or count >= len(candidates):
            break
    record.update(candidates=len(candidates), bytes_after=len(data),
                  zeroed_fraction=round(count / max(1, sum(t.values.numel() for t in tensors.values()
                                                           if t.scheme in INT_SCHEMES)), 6))
    return fitted, data, record
