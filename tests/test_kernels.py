"""The fused kernels compute the model's own element-wise steps (`TorchOps`).

On the CPU the kernels run in Triton's interpreter (where Triton is installed); it rounds
to bfloat16 its own way, so kernel and torch agree to a bfloat16 step or two. On CUDA
(tests marked gpu) they are compared compiled, at the model's full size.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from windowgpt_cli.config import RunConfig
from windowgpt_cli.model import TORCH_OPS, Residual, build_model, rotary_inv_freq, rotary_tables

from test_model import perturbed_tiny

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

from windowgpt_cli.kernels import FusedOps  # noqa: E402

FUSED = FusedOps()
BF16_STEPS = 2 ** -6  # two bfloat16 steps, relative


def close(fused: torch.Tensor, reference: torch.Tensor, steps: float = BF16_STEPS) -> bool:
    scale = reference.float().abs().max().clamp(min=1.0)
    return bool(((fused.float() - reference.float()).abs().max() <= steps * scale).item())


@pytest.fixture
def stream() -> tuple[Residual, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    b, t, d = 2, 5, 48  # a width that is not a power of two: masked columns
    stream = Residual(torch.randn(b, t, d), torch.randn(b, t, d).bfloat16(), torch.randn(d),
                      torch.randn(b, t, d), torch.randn(d))
    return stream, torch.randn(b, t, d), torch.randn(2, d)


def test_block_input_forms_the_sum_mixes_and_norms(stream):
    residual, x0, mix = stream
    factor = torch.tensor(0.7)
    kept, x_in, normed = FUSED.block_input(residual, x0, mix, factor, keep_sum=True)
    ref_kept, ref_in, ref_normed = TORCH_OPS.block_input(residual, x0, mix, factor, keep_sum=True)
    assert torch.allclose(kept, ref_kept, atol=1e-5) and torch.allclose(x_in, ref_in, atol=1e-5)
    assert normed.dtype == torch.bfloat16 and close(normed, ref_normed)
    assert FUSED.block_input(residual, x0, mix, factor, keep_sum=False)[0] is None


def test_residual_and_final_norms(stream):
    residual, _, _ = stream
    for partial in (Residual(residual.base), Residual(residual.base, residual.delta, residual.delta_scale), residual):
        out, normed = FUSED.residual_norm(partial, torch.tensor(0.5))
        ref_out, ref_normed = TORCH_OPS.residual_norm(partial, torch.tensor(0.5))
        assert torch.allclose(out, ref_out, atol=1e-5) and close(normed, ref_normed)
        assert close(FUSED.final_norm(partial), TORCH_OPS.final_norm(partial))


@pytest.mark.parametrize("rope_dims", [8, 0])  # part of each head rotated, or all of it
def test_head_prep_norms_rotates_and_scales_each_head(rope_dims):
    torch.manual_seed(1)
    b, t, heads, head_dim = 2, 6, 4, 16
    cos, sin = rotary_tables(t, rotary_inv_freq(rope_dims or head_dim, 10000.0, t, 2048))
    x = torch.randn(b, t, heads, head_dim).bfloat16()
    gain = torch.randn(heads)
    for g in (gain, None):
        assert close(FUSED.head_prep(x, cos, sin, rope_dims, g), TORCH_OPS.head_prep(x.float(), cos, sin, rope_dims, g))
    positions = torch.tensor([[1, 5], [0, 3]])  # queries at chosen positions, each its own rotation
    picked = x[:, :2]
    assert close(FUSED.head_prep(picked, cos[0, positions], sin[0, positions], rope_dims, gain),
                 TORCH_OPS.head_prep(picked.float(), cos[0, positions], sin[0, positions], rope_dims, gain))


def test_exclude_self_value_on_strided_outputs():
    torch.manual_seed(2)
    y = torch.randn(2, 4, 7, 16).bfloat16().transpose(1, 2)  # [B, T, H, D] as attention returns it
    v = torch.randn(2, 7, 2, 16).bfloat16()
    assert close(FUSED.exclude_self_value(y, v), TORCH_OPS.exclude_self_value(y.float(), v.float()))


def test_leaky_square():
    h = torch.randn(3, 7, 33).bfloat16()
    out = FUSED.leaky_square(h, 0.5)
    assert out.dtype == torch.bfloat16 and close(out, TORCH_OPS.leaky_square(h.float(), 0.5))


def test_the_model_scores_the_same_with_fused_steps():
    """The whole tiny model (skips, value embeddings, XSA, windows with sinks, the pruned
    last block) under bf16 autocast: the same logits to bfloat16 precision, and the same
    mean loss to 1e-3 nats."""
    model = perturbed_tiny()
    torch.manual_seed(3)
    x = torch.randint(0, model.cfg.vocab_size, (2, 64))
    positions = torch.stack([torch.arange(40, 64), torch.arange(0, 24)])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = model.logits_at(x, positions, ops=FUSED)
        reference = model.logits_at(x, positions)
    assert fused.shape == reference.shape
    assert close(fused, reference, steps=2 ** -4)
    targets = torch.randint(0, model.cfg.vocab_size, positions.shape)
    loss = [torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            for logits in (fused, reference)]
    assert abs(loss[0] - loss[1]) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_steps_match_the_compiled_model_on_cuda():
    """The full-size model on CUDA: fused and compiled logits agree to bfloat16 precision and
    their mean losses over 2048 predictions to 1e-4 nats (a logit's rounding may go the other
    way: 1/16 at 8 for bfloat16)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(RunConfig().model, device)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(std=0.02)
    model.set_attention_backend("auto", device)
    x = torch.randint(0, model.cfg.vocab_size, (32, 2048), device=device)
    positions = torch.arange(2048 - 64, 2048, device=device).expand(32, 64).contiguous()
    targets = torch.randint(0, model.cfg.vocab_size, positions.shape, device=device)
    compiled = torch.compile(model.logits_at, dynamic=False, fullgraph=True)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        fused = model.logits_at(x, positions, ops=FUSED)
        reference = compiled(x, positions)
    assert close(fused, reference)
    loss = [torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            for logits in (fused, reference)]
    assert abs(loss[0] - loss[1]).item() < 1e-4
