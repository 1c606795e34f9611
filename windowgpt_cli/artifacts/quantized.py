"""Quantized tensors as a `.ptz` stores them: integer codes with their scales, or kept
values, optionally with a low-rank correction of the codes' error (LQER), and how each
scheme turns back into the original tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # the scheme names alone need no torch
    import torch
    from torch import Tensor

# Schemes, as recorded in a .ptz. int6 codes lie within the artifact's clip range (31 by
# default); every other intB scheme within +-(2**(B-1) - 1), one float scale per row.
INT6, INT8, PASSTHROUGH, CONTROL = "int6", "int8", "passthrough", "passthrough_ctrl"
ROW_BITS = (2, 3, 4, 5, 6, 7, 8)
INT_SCHEMES = tuple(f"int{b}" for b in ROW_BITS)
SCHEMES = (*INT_SCHEMES, PASSTHROUGH, CONTROL)


def int_scheme(bits: int) -> str:
    return f"int{bits}"


def scheme_bits(scheme: str) -> int | None:
    """The code width of an integer scheme (None for kept tensors)."""
    return int(scheme[3:]) if scheme in INT_SCHEMES else None


def code_bits(scheme: str, clip_range: int) -> int | None:
    """The bits an integer scheme's codes span: int6 codes within a clip range of 15 take 31
    levels, 5 bits (None for kept tensors)."""
    bits = scheme_bits(scheme)
    return (2 * clip_range).bit_length() if scheme == INT6 else bits


def code_limit(scheme: str, clip_range: int) -> int:
    """The largest |code| a scheme allows: the artifact's clip range for int6."""
    bits = scheme_bits(scheme)
    assert bits is not None, scheme
    return clip_range if scheme == INT6 else (1 << (bits - 1)) - 1


@dataclass
class LowRankFactor:
    """One factor of a low-rank correction, quantized asymmetrically in groups of its
    flattened values: value = codes * scale + offset, codes in [0, 2**bits - 1]."""

    codes: Tensor  # uint8, the factor's shape
    scale: Tensor  # float16 [groups]
    offset: Tensor  # float16 [groups]

    @property
    def stored_bytes(self) -> int:
        return _nbytes(self.codes) + _nbytes(self.scale) + _nbytes(self.offset)

    def dequantize(self, group_size: int) -> Tensor:
        flat = self.codes.flatten().float()
        groups, numel = self.scale.numel(), flat.numel()
        if groups * group_size > numel:  # the last group is partial
            padded = flat.new_zeros(groups * group_size)
            padded[:numel] = flat
            flat = padded
        values = flat.view(groups, group_size) * self.scale.float()[:, None] + self.offset.float()[:, None]
        return values.flatten()[:numel].view(self.codes.shape)


@dataclass
class LowRank:
    """W ~ dequantized codes + a @ b (LQER): a [rows, rank], b [rank, cols]."""

    a: LowRankFactor
    b: LowRankFactor
    bits: int
    group_size: int

    @property
    def rank(self) -> int:
        return int(self.a.codes.shape[1])

    @property
    def stored_bytes(self) -> int:
        return self.a.stored_bytes + self.b.stored_bytes

    def product(self) -> Tensor:
        return self.a.dequantize(self.group_size) @ self.b.dequantize(self.group_size)


@dataclass
class QuantizedTensor:
    """One tensor as stored: codes and scales, or the kept values."""

    scheme: str
    dtype: torch.dtype  # the original dtype, restored by dequantize()
    values: Tensor  # int8 codes (integer schemes) or the stored tensor (passthrough schemes)
    scale: Tensor | None = None  # per row [rows], or a scalar for tensors that are not 2-D
    method: str = ""  # how the codes were chosen: "gptq" or "rtn" (int6), "sigma" appended for SD clipping
    correction: LowRank | None = None  # LQER's low-rank correction of the codes' error

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def stored_bytes(self) -> int:
        scale_bytes = 0 if self.scale is None else _nbytes(self.scale)
        correction = 0 if self.correction is None else self.correction.stored_bytes
        return _nbytes(self.values) + scale_bytes + correction

    def dequantize(self) -> Tensor:
        """The reference's dequantization: codes times scales, cast to the original dtype
        (plus the low-rank correction, in float32, where there is one)."""
        if self.scheme in (PASSTHROUGH, CONTROL):
            return self.values.to(self.dtype)
        assert self.scale is not None
        codes = self.values.float()
        if self.scale.ndim > 0:
            w = codes * self.scale.float().view(codes.shape[0], *([1] * (codes.ndim - 1)))
        else:
            w = codes * float(self.scale.item())
        if self.correction is not None:
            w = w + self.correction.product()
        return w.to(self.dtype)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def dequantize_state_dict(tensors: Mapping[str, QuantizedTensor]) -> dict[str, Tensor]:
    return {name: qt.dequantize() for name, qt in tensors.items()}
