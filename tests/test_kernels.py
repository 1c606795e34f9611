"""The fused kernels compute the model's own element-wise steps (`TorchOps`).

They round where the compiled forward stores a tensor, not after every operation as eager
torch does, and on the CPU they run in Triton's interpreter (where Triton is installed),
which rounds to bfloat16 its own way: kernel and torch agree to a bfloat16 step or two. On
CUDA (tests marked gpu) they are compared with the compiled model at its full size.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from windowgpt_cli.challenge import RECORD_WINDOWS
from windowgpt_cli.config import RunConfig
from windowgpt_cli.model.ops import TORCH_OPS, Residual, ValueInjection, smear
from windowgpt_cli.model.gpt import build_model
from windowgpt_cli.model.rotary import rotary_inv_freq, rotary_tables

from conftest import interpret_kernels_without_cuda
from test_model import perturbed_tiny

interpret_kernels_without_cuda()

import triton  # noqa: E402

from windowgpt_cli.kernels import elementwise as kernels  # noqa: E402
from windowgpt_cli.model.fused_ops import FusedOps  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_fixes")
FUSED = FusedOps()
BF16_STEPS = 2 ** -6  # two bfloat16 steps, relative


def close(fused: torch.Tensor, reference: torch.Tensor, steps: float = BF16_STEPS) -> bool:
    scale = reference.float().abs().max().clamp(min=1.0)
    return bool(((fused.float() - reference.float()).abs().max() <= steps * scale).item())


@pytest.fixture
def embedded():
    """x0 both ways for a small batch: (fused, torch)."""
    torch.manual_seed(0)
    b, t, d, vocab = 2, 5, 48, 11  # a width that is not a power of two: masked columns
    ids, table = torch.randint(0, vocab, (b, t)), torch.randn(vocab, d)
    bigram, scale, gate = torch.randn(b, t, d).bfloat16(), torch.tensor(0.3), torch.randn(d)
    return FUSED.embed(ids, table, bigram, scale, gate), TORCH_OPS.embed(ids, table, bigram, scale, gate)


def test_embed_norms_and_leaves_the_smear_to_its_readers(embedded):
    fused, reference = embedded
    assert close(smear(fused.normed, fused.gate), reference)
    ids, table = torch.tensor([[2, 0, 1]]), torch.randn(3, 16)  # no bigram table
    assert close(FUSED.embed(ids, table, None, None, torch.zeros(16)).normed,
                 torch.nn.functional.rms_norm(table[ids], (16,)))


def _streams(x_in: torch.Tensor) -> list[Residual]:
    torch.manual_seed(4)
    b, t, d = x_in.shape
    attn, mlp, skip = (torch.randn(b, t, d).bfloat16() for _ in range(3))
    scale_a, scale_m, weight = torch.randn(d), torch.randn(d), torch.randn(d)
    base = Residual(x_in).plus(attn, scale_a).plus(mlp, scale_m)
    return [Residual(x_in), Residual(x_in).plus(attn, scale_a), base, base.plus_skip(skip, weight),
            base.plus_skip(None, weight)]


def test_block_input_forms_the_sum_mixes_and_norms(embedded):
    fused_x0, x0 = embedded
    mix, factor = torch.randn(2, x0.size(-1)), torch.tensor(0.7)
    streams = [(Residual(fused_x0), Residual(x0))] + [(s, s) for s in _streams(torch.randn_like(x0))]
    for fused_stream, stream in streams:
        kept, x_in, normed = FUSED.block_input(fused_stream, fused_x0, mix, factor, keep_sum=True)
        ref_kept, ref_in, ref_normed = TORCH_OPS.block_input(stream, x0, mix, factor, keep_sum=True)
        assert close(kept, ref_kept) and close(x_in, ref_in) and kept.dtype == x_in.dtype == x0.dtype
        assert normed.dtype == torch.bfloat16 and close(normed, ref_normed)
        assert FUSED.block_input(fused_stream, fused_x0, mix, factor, keep_sum=False)[0] is None


def test_x0_at_chosen_rows_and_a_block_input_that_reads_it(embedded):
    """x0 formed at chosen positions (the first of a sequence too) as float32 values, and a
    block's input mixing them in, as with the whole x0."""
    fused_x0, x0 = embedded
    positions = torch.tensor([[0, 3, 4], [1, 2, 4]])
    rows = FUSED.at_rows(fused_x0, positions)
    assert rows.dtype == torch.float32 and close(rows, TORCH_OPS.at_rows(x0, positions))
    mix, factor = torch.randn(2, x0.size(-1)), torch.tensor(0.7)
    stream = Residual(torch.randn(2, 3, x0.size(-1)).to(fused_x0.normed.dtype))
    _, x_in, normed = FUSED.block_input(stream, rows, mix, factor, keep_sum=False)
    _, ref_in, ref_normed = TORCH_OPS.block_input(stream, TORCH_OPS.at_rows(x0, positions), mix, factor,
                                                  keep_sum=False)
    assert x_in.dtype == stream.base.dtype and close(x_in, ref_in) and close(normed, ref_normed)


def test_residual_and_final_norms(embedded):
    for stream in _streams(torch.randn_like(embedded[1])):
        same, normed = FUSED.residual_norm(stream, torch.tensor(0.5))
        assert same is stream and close(normed, TORCH_OPS.residual_norm(stream, torch.tensor(0.5))[1])
        assert close(FUSED.final_norm(stream), TORCH_OPS.final_norm(stream))


def test_values_add_the_value_embedding():
    torch.manual_seed(5)
    v, projected = torch.randn(2, 3, 32).bfloat16(), torch.randn(2, 3, 32).bfloat16()
    scale, layer_scale = torch.tensor(0.1), torch.tensor([0.8])
    for_attention, for_xsa = FUSED.values(v, ValueInjection(FUSED.shared_values(projected, scale), layer_scale))
    exact = ValueInjection(TORCH_OPS.shared_values(projected.float(), scale), layer_scale)  # no bf16 product
    reference = TORCH_OPS.values(v.float(), exact)[0]
    assert for_attention.dtype == v.dtype and for_xsa.dtype == torch.float32
    assert torch.allclose(for_xsa, reference, atol=1e-6) and close(for_attention, reference)
    assert FUSED.values(v, None) == (v, v)


@pytest.mark.parametrize("rope_dims", [8, 0])  # part of each head rotated, or all of it
@pytest.mark.parametrize("t", [6, 37])  # positions of one program, or of several (the last one part-filled)
def test_head_prep_norms_rotates_and_scales_each_head(rope_dims, t):
    torch.manual_seed(1)
    b, heads, head_dim = 2, 4, 16
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


SMALL_TILES = kernels.MatmulTiles(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
TINY_MODEL_TILES = kernels.MatmulTiles(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=2)  # its MLP: 128


class _CountedLaunches:
    """A kernel that counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def products(monkeypatch) -> _CountedLaunches:
    """`_leaky_square_matmul_kernel`, its launches counted."""
    counted = _CountedLaunches(kernels._leaky_square_matmul_kernel)
    monkeypatch.setattr(kernels, "_leaky_square_matmul_kernel", counted)
    return counted


def test_mlp_hidden_applies_the_activation_to_the_product(products):
    torch.manual_seed(6)
    x, up_w = torch.randn(2, 5, 48).bfloat16(), torch.randn(64, 48).bfloat16()  # 10 rows: a part tile
    fused = FusedOps(tiles=SMALL_TILES).mlp_hidden(x, up_w, 0.5)
    assert products.launches == 1 and fused.shape == (2, 5, 64) and fused.dtype == torch.bfloat16
    # the product rounded to bf16 first, as a stored product is; then the activation
    product = torch.nn.functional.linear(x.float(), up_w.float()).bfloat16().float()
    assert close(fused, TORCH_OPS.leaky_square(product, 0.5))


def test_a_product_the_kernel_cannot_take_runs_apart(products):
    x, up_w = torch.randn(3, 48).bfloat16(), torch.randn(40, 48).bfloat16()  # 40 columns: no whole tiles
    for ops in (FusedOps(tiles=SMALL_TILES), FusedOps(tiles=None)):
        assert close(ops.mlp_hidden(x, up_w, 0.5), TORCH_OPS.mlp_hidden(x.float(), up_w.float(), 0.5))
    shifted = torch.randn(3 * 48 + 1).bfloat16()[1:].view(3, 48)  # 2 bytes past a 16-byte boundary: no TMA
    up_w = torch.randn(64, 48).bfloat16()
    assert close(FusedOps(tiles=SMALL_TILES).mlp_hidden(shifted, up_w, 0.5),
                 TORCH_OPS.mlp_hidden(shifted.float(), up_w.float(), 0.5))
    assert products.launches == 0


# Model settings beyond the reference (tests/test_model_options.py): gated skips, the
# attention output gate, the document boundary (whose x0 the fused steps take formed),
# parallel lanes in the last two blocks (which score without the pruned last block) and
# layer 1 run twice.
GATES = dict(skip_gates=True, attn_out_gate_width=12, attn_out_gate_scale=0.5, doc_boundary_token=1,
             parallel_start_layer=2, recur_layers=(1,), recur_count=2)


FRONTIER_FORMS = {"parallel_mlp_reads_x0": False, "smear_gate_width": 12}  # the lane and the gate by token


@pytest.mark.parametrize("query_runs,options", [(False, {}), (True, {}), (True, GATES), (True, GATES | FRONTIER_FORMS)])
@pytest.mark.slow
def test_the_model_scores_the_same_with_fused_steps(products, query_runs, options):
    """The whole tiny model (skips, value embeddings, XSA, windows with sinks, the pruned
    last block, the MLP's fused products; with query_runs the block before the last at the
    rows the last reads, x0 given there) under bf16 autocast: the same logits to bfloat16
    precision, and the same mean loss to 2e-3 nats (with the gates and lanes, other inputs' losses
    differ by up to 1.6e-3 where the logits agree to bfloat16 precision)."""
    model = perturbed_tiny(**options)
    torch.manual_seed(3)
    x = torch.randint(0, model.cfg.vocab_size, (2, 64))
    x[:, 30] = 1  # a document boundary where one is set
    positions = torch.stack([torch.arange(40, 64), torch.arange(0, 24)])
    # the tiny model's last block: windowed (pruned, unless it runs on lanes)
    assert (model.last_block_reads(positions, 64) is not None) == (not options)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = model.logits_at(x, positions, ops=FusedOps(tiles=TINY_MODEL_TILES), query_runs=query_runs)
        reference = model.logits_at(x, positions)
    assert fused.shape == reference.shape and products.launches == len(model.cfg.block_order())  # one per block run
    assert close(fused, reference, steps=2 ** -4)
    targets = torch.randint(0, model.cfg.vocab_size, positions.shape)
    loss = [torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            for logits in (fused, reference)]
    assert abs(loss[0] - loss[1]) < 2e-3


@pytest.fixture(scope="module", params=["full", "record"])
def cuda_model(request):
    """The full-size model on CUDA (full attention, or the record's windows), every weight
    (gates and scales too) off its initial value."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    cfg = RunConfig().model
    if request.param == "record":
        cfg = dataclasses.replace(cfg, **RECORD_WINDOWS)
    model = build_model(cfg, device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    model.set_attention_backend("auto", device)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_builds_every_kernel_that_scoring_runs(cuda_model):
    """After `warm_up` (parallel builds on one window), a scoring forward of another batch
    size builds nothing more. (The first GPU test of this module: nothing is built before.)"""
    jitted = [k for k in vars(kernels).values() if isinstance(k, triton.runtime.JITFunction)]

    def built() -> int:
        return sum(len(caches[0]) for kernel in jitted for caches in kernel.device_caches.values())

    FUSED.warm_up(cuda_model, 2048, 64)
    after_warm_up = built()
    x = torch.randint(0, cuda_model.cfg.vocab_size, (3, 2048), device="cuda")
    # runs of queries as scoring asks for them: 3 x 580 rows for the record model's last block
    positions = (torch.tensor([[0], [1000], [1984]], device="cuda") + torch.arange(64, device="cuda"))
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        cuda_model.logits_at(x, positions, ops=FUSED, query_runs=True)
    assert after_warm_up >= 7 and built() == after_warm_up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_scoring_matches_the_compiled_model_on_cuda(cuda_model):
    """Logits at chosen positions (the last block pruned to them, the one before it to the
    rows the last reads): within two bf16 steps of the compiled model's, and the mean loss
    over 2048 predictions as near the float32 model's as the compiled bf16 model's is (bf16
    rounding alone moves this random model's mean loss by about 1e-4 nats)."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randint(0, cuda_model.cfg.vocab_size, (32, 2048), device="cuda", generator=generator)
    positions = torch.arange(2048 - 64, 2048, device="cuda").expand(32, 64).contiguous()
    targets = torch.randint(0, cuda_model.cfg.vocab_size, positions.shape, device="cuda", generator=generator)
    compiled = torch.compile(cuda_model.logits_at, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fused, reference = cuda_model.logits_at(x, positions, ops=FUSED, query_runs=True), compiled(x, positions)
        cuda_model.set_attention_backend("sdpa", x.device)  # masks in float32, where the kernels take bf16
        try:
            exact = cuda_model.logits_at(x, positions)
        finally:
            cuda_model.set_attention_backend("auto", x.device)
    fused_loss, compiled_loss, exact_loss = [
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()
        for logits in (fused, reference, exact)]
    assert close(fused, reference)
    assert abs(fused_loss - exact_loss) <= max(2 * abs(compiled_loss - exact_loss), 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_hidden_layer_matches_cublas_and_the_activation_on_cuda():
    """At a scoring batch's scale: the TMA product kernel with its epilogue against cuBLAS's
    product and the activation kernel, within a bf16 step (the same values but for the odd
    rounding of a product summed in another order)."""
    cfg = RunConfig().model
    torch.manual_seed(8)
    x = torch.randn(64 * 2048 + 96, cfg.model_dim, device="cuda").bfloat16()  # a partial last tile of rows
    up_w = (torch.randn(cfg.mlp_dim, cfg.model_dim, device="cuda") * cfg.model_dim ** -0.5).bfloat16()
    fused = FusedOps().mlp_hidden(x, up_w, cfg.negative_slope)
    apart = FusedOps(tiles=None).mlp_hidden(x, up_w, cfg.negative_slope)
    assert close(fused, apart, steps=2 ** -8)
    assert (fused != apart).float().mean().item() < 1e-3
