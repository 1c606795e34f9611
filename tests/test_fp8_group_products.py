"""bench/fp8_group_products.py's Triton products (float8 with LeakyReLU² and its rounding by
groups of 128 columns in the up product's epilogue; the down product taking those groups'
scales) against torch's steps on the same codes, in Triton's interpreter on a CPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import interpret_kernels_without_cuda

interpret_kernels_without_cuda()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fp8_group_products as groups  # noqa: E402
from windowgpt_cli.kernels.fp8_products import to_fp8_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.usefixtures("interpreter_fixes")


def codes_of(rows: int, cols: int, seed: int, spread: bool = False):
    """float8 codes and row scales of random rows (their magnitudes 2^-6 to 2^5 apart with spread)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    return to_fp8_rows(x.to(DEVICE, torch.bfloat16))


# 40 rows: not a whole number of the 32-row programs; 256 hidden: two groups of 128
def test_the_up_products_epilogue_writes_the_product_and_the_activations_codes_by_groups():
    (x8, x_scale), (w8, w_scale) = codes_of(40, 64, 0, spread=True), codes_of(256, 64, 1)
    pre, codes, scales = groups.up_product(x8, x_scale, w8, w_scale, block_m=32, block_k=32, warps=4, stages=1)
    want_pre = groups.up_reference(x8, x_scale, w8, w_scale)[0]
    # the sums' order and bfloat16's rounding differ (the interpreter's against torch's): within a step
    torch.testing.assert_close(pre.float(), want_pre.float(), rtol=2 ** -7, atol=0)
    want_codes, want_scales = groups.group_codes(pre)  # the activation of the product as written
    assert scales.shape == (40, 2) and codes.dtype == want_codes.dtype
    assert torch.equal(scales, want_scales) and torch.equal(codes.float(), want_codes.float())
    assert not torch.equal(scales[:, 0], scales[:, 1])  # each group its own scale


def test_the_down_product_takes_each_groups_scales():
    h8, _ = codes_of(40, 256, 2)
    g = torch.Generator().manual_seed(3)
    h_scales = torch.exp2(torch.randint(-8, 4, (40, 2), generator=g).float()).to(DEVICE)
    w8, w_scale = codes_of(96, 256, 4)
    got = groups.down_product(h8, h_scales, w8, w_scale, block_m=32, block_n=32, warps=4, stages=1)
    want = groups.down_reference(h8, h_scales, w8, w_scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    one_scale = groups.down_reference(h8, h_scales[:, :1].expand(40, 2), w8, w_scale)
    assert (one_scale.float() - want.float()).abs().max() > 0.1 * want.float().abs().max()


def test_the_products_refuse_widths_not_in_groups_of_128():
    (x8, x_scale), (w8, w_scale) = codes_of(8, 64, 0), codes_of(96, 64, 1)
    with pytest.raises(AssertionError):
        groups.up_product(x8, x_scale, w8, w_scale, block_m=32, block_k=32)
