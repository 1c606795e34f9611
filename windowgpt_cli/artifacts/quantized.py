"""Quantized tensors as a `.ptz` stores them: int8 codes with their scales, or kept values,
and how each scheme turns back into the original tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # the scheme names alone need no torch
    import torch
    from torch import Tensor

# Schemes, as recorded in a .ptz
INT6, INT8, PASSTHROUGH, CONTROL = "int6", "int8", "passthrough", "passthrough_ctrl"
SCHEMES = (INT6, INT8, PASSTHROUGH, CONTROL)


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


def dequantize_state_dict(tensors: Mapping[str, QuantizedTensor]) -> dict[str, Tensor]:
    return {name: qt.dequantize() for name, qt in tensors.items()}
