"""Quantization against a plain transcription of the reference's algorithms."""
from __future__ import annotations

import pytest
import torch

from windowgpt_cli.artifacts.quantized import CONTROL, INT6, INT8, PASSTHROUGH, QuantizedTensor
from windowgpt_cli.quant.schemes import choose_scheme, quantize_int6_rtn, quantize_int8
from windowgpt_cli.quant.calibration import HESSIAN_DAMPING, collect_hessians
from windowgpt_cli.quant.gptq import gptq_quantize_batch, quantize_state_dict

pytestmark = pytest.mark.usefixtures("quant_single_thread")

PERCENTILES = [0.9990, 0.9995, 0.9999, 0.99999, 1.0]


# --- The reference, transcribed as written (one matrix at a time, column by column) -----

def reference_int6(t: torch.Tensor, clip_range: int = 31):
    t32 = t.float()
    best_q, best_s, best_err = None, None, float("inf")
    for pct in PERCENTILES:
        row_clip = torch.quantile(t32.abs(), pct, dim=1) if pct < 1.0 else t32.abs().amax(dim=1)
        s = (row_clip / clip_range).clamp_min(1.0 / clip_range).to(torch.float16)
        q = torch.clamp(torch.round(t32 / s.float()[:, None]), -clip_range, clip_range).to(torch.int8)
        err = (t32 - q.float() * s.float()[:, None]).pow(2).mean().item()
        if err < best_err:
            best_q, best_s, best_err = q, s, err
    return best_q, best_s


def reference_int8(t: torch.Tensor):
    t32 = t.float()
    clip_abs = torch.quantile(t32.abs(), 99.99984 / 100.0, dim=1)
    clipped = torch.maximum(torch.minimum(t32, clip_abs[:, None]), -clip_abs[:, None])
    scale = (clip_abs / 127.0).clamp_min(1.0 / 127.0)
    q = torch.clamp(torch.round(clipped / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale.to(torch.float16)


def reference_dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if s.ndim > 0:
        return (q.float() * s.float().view(q.shape[0], *([1] * (q.ndim - 1)))).to(dtype)
    return (q.float() * float(s.item())).to(dtype)


def reference_gptq(W: torch.Tensor, H: torch.Tensor, clip_range: int = 31, block_size: int = 128,
                   percdamp: float = 0.01):
    W_orig = W.float().clone()
    rows, cols = W_orig.shape
    H = H.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H.diagonal().add_(percdamp * H.diag().mean())
    perm = torch.argsort(H.diag(), descending=True)
    invperm = torch.argsort(perm)
    W_perm = W_orig[:, perm].clone()
    W_perm[:, dead[perm]] = 0
    H = H[perm][:, perm]
    try:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError:
        return reference_int6(W_orig, clip_range)
    best_q, best_scale, best_err = None, None, float("inf")
    for pct in PERCENTILES:
        row_clip = torch.quantile(W_orig.abs(), pct, dim=1) if pct < 1.0 else W_orig.abs().amax(dim=1)
        s = (row_clip / clip_range).clamp_min(1.0 / clip_range).to(torch.float16)
        sf = s.float()
        Q = torch.zeros(rows, cols, dtype=torch.int8)
        W_work = W_perm.clone()
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            W_block = W_work[:, i1:i2].clone()
            Hinv_block = Hinv[i1:i2, i1:i2]
            Err = torch.zeros(rows, i2 - i1)
            for j in range(i2 - i1):
                w_col = W_block[:, j]
                q_col = torch.clamp(torch.round(w_col / sf), -clip_range, clip_range)
                Q[:, i1 + j] = q_col.to(torch.int8)
                err = (w_col - q_col.float() * sf) / Hinv_block[j, j]
                Err[:, j] = err
                W_block[:, j:] -= err.unsqueeze(1) * Hinv_block[j, j:].unsqueeze(0)
            if i2 < cols:
                W_work[:, i2:] -= Err @ Hinv[i1:i2, i2:]
        mse = (W_perm - Q.float() * sf[:, None]).pow(2).mean().item()
        if mse < best_err:
            best_q, best_scale, best_err = Q, s, mse
    return best_q[:, invperm], best_scale


# --- Helpers -------------------------------------------------------------------------------

def weights_with_outliers(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:, 3] *= 8.0  # an outlier input channel
    w[1, 5] = 1.5  # an outlier weight: this row's best clip cuts it
    return w


def correlated_hessian(cols: int, seed: int, dead: tuple[int, ...] = ()) -> torch.Tensor:
    """E[x^T x] of inputs with strongly correlated channels, damped as after calibration."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(cols, cols, generator=g) / cols**0.5 + 2.0 * torch.eye(cols)
    x = torch.randn(4 * cols, cols, generator=g) @ mixing + torch.randn(4 * cols, 1, generator=g)
    x[:, list(dead)] = 0.0
    h = x.T @ x / x.shape[0]
    if not dead:
        h += 0.01 * h.diag().mean() * torch.eye(cols)
    return h


def h_error(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, h: torch.Tensor) -> float:
    """The layer-output error GPTQ minimizes: tr(E H E^T), E = W - Q*s."""
    e = w.float() - q.float() * s.float()[:, None]
    return torch.einsum("ri,ij,rj->", e, h, e).item()


def mse(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> float:
    return (w.float() - q.float() * s.float()[:, None]).pow(2).mean().item()


# --- Rounding to nearest ----------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int6_rounding_to_nearest_matches_the_reference(seed: int):
    w = weights_with_outliers(48, 200, seed)
    q, s = quantize_int6_rtn(w)
    q_ref, s_ref = reference_int6(w)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert q.dtype == torch.int8 and s.dtype == torch.float16


def test_int6_round_trip_error_is_at_most_half_a_step_on_unclipped_rows():
    w = weights_with_outliers(64, 256, 3)
    q, s = quantize_int6_rtn(w, clip_range=31)
    deq = QuantizedTensor(INT6, torch.float32, q, s).dequantize()
    step = s.float()[:, None]
    unclipped = (w.abs() <= 31 * step).all(dim=1)
    assert 0 < unclipped.sum() < len(w)  # the outlier row is clipped, most are not
    err = (w - deq).abs()
    assert torch.all(err[unclipped] <= step.expand_as(w)[unclipped] / 2 * (1 + 1e-5))
    assert q.abs().max() <= 31


def test_int8_per_row_matches_the_reference():
    g = torch.Generator().manual_seed(4)
    emb = (torch.randn(300, 64, generator=g) * 0.02).bfloat16()
    q, s = quantize_int8(emb)
    q_ref, s_ref = reference_int8(emb)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    deq = QuantizedTensor(INT8, torch.bfloat16, q, s).dequantize()
    assert deq.dtype == torch.bfloat16
    assert torch.equal(deq, reference_dequantize(q_ref, s_ref, torch.bfloat16))


def test_dequantization_equals_the_reference_for_every_scheme():
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-31, 32, (20, 30), generator=g, dtype=torch.int8)
    row_scales = (torch.rand(20, generator=g) / 10).half()
    for dtype in (torch.float32, torch.bfloat16):
        got = QuantizedTensor(INT6, dtype, codes, row_scales).dequantize()
        assert got.dtype == dtype and torch.equal(got, reference_dequantize(codes, row_scales, dtype))
    scalar = torch.tensor(0.0123, dtype=torch.float32)
    got = QuantizedTensor(INT8, torch.float32, codes, scalar).dequantize()
    assert torch.equal(got, reference_dequantize(codes, scalar, torch.float32))
    kept = torch.randn(7, generator=g)
    assert torch.equal(QuantizedTensor(PASSTHROUGH, torch.bfloat16, kept.half()).dequantize(), kept.half().bfloat16())


def test_schemes_follow_the_reference_precedence():
    big = torch.zeros(300, 300)
    assert choose_scheme("blocks.0.attn.c_q.weight", big) == INT6
    assert choose_scheme("blocks.0.mlp.proj.weight", big) == INT6
    assert choose_scheme("bigram.proj.weight", big) == INT6  # the reference's ".proj." rule
    assert choose_scheme("tok_emb.weight", big) == INT8
    assert choose_scheme("bigram.embed.weight", big) == INT8
    assert choose_scheme("skip_weights", big) == CONTROL
    assert choose_scheme("skip_weights", torch.zeros(5, 512)) == PASSTHROUGH  # small first, as the reference
    assert choose_scheme("blocks.0.attn.c_q.weight", torch.zeros(256, 256)) == PASSTHROUGH  # 65,536 is small
    assert choose_scheme("steps", torch.zeros(100_000, dtype=torch.int64)) == PASSTHROUGH
    sd = {"skip_weights": big, "blocks.0.attn_scale": torch.ones(8), "ids": torch.arange(3)}
    out = quantize_state_dict(sd)
    assert out["skip_weights"].values.dtype == torch.float32
    assert out["blocks.0.attn_scale"].values.dtype == torch.float16
    assert torch.equal(out["ids"].dequantize(), sd["ids"])


# --- GPTQ ----------------------------------------------------------------------------------

def test_batched_gptq_is_no_worse_than_the_reference_algorithm():
    """Three problems at once (one with dead input columns), each of two matrices sharing
    a Hessian, against the reference run on every matrix separately."""
    cols, splits = 160, [40, 24]
    weights = torch.stack([weights_with_outliers(sum(splits), cols, seed) for seed in range(3)])
    hessians = torch.stack([correlated_hessian(cols, 10), correlated_hessian(cols, 11, dead=(7, 150)),
                            correlated_hessian(cols, 12)])
    results = gptq_quantize_batch(weights, hessians, splits, block_size=64)
    for w_all, h, per_matrix in zip(weights, hessians, results):
        lo = 0
        for rows, (q, s, method) in zip(splits, per_matrix):
            w = w_all[lo:lo + rows]
            lo += rows
            q_ref, s_ref = reference_gptq(w, h, block_size=64)
            assert method == "gptq" and q.shape == w.shape and s.shape == (rows,)
            assert h_error(w, q, s, h) <= h_error(w, q_ref, s_ref, h) * (1 + 1e-4) + 1e-9
            assert mse(w, q, s) <= mse(w, q_ref, s_ref) * (1 + 1e-4) + 1e-12


def test_gptq_error_is_at_most_rounding_to_nearest_on_correlated_inputs():
    cols = 128
    w = weights_with_outliers(64, cols, 6)
    h = correlated_hessian(cols, 13)
    [[(q, s, _)]] = gptq_quantize_batch(w[None], h[None], [64])
    q_rtn, s_rtn = quantize_int6_rtn(w)
    assert h_error(w, q, s, h) < h_error(w, q_rtn, s_rtn, h)


def test_gptq_falls_back_to_rounding_when_the_hessian_is_not_positive_definite():
    w = weights_with_outliers(16, 32, 7)
    indefinite = -torch.eye(32)
    [[(q, s, method)]] = gptq_quantize_batch(w[None], indefinite[None], [16])
    q_ref, s_ref = reference_int6(w)
    assert method == "rtn" and torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_state_dict_gptq_covers_the_matrices_with_hessians_and_keeps_order():
    layers, cols = 3, 96
    sd: dict[str, torch.Tensor] = {"tok_emb.weight": torch.randn(1024, 72)}
    hessians = {}
    for i in range(layers):
        sd[f"blocks.{i}.attn.c_q.weight"] = weights_with_outliers(720, cols, i)
        sd[f"blocks.{i}.attn.c_k.weight"] = weights_with_outliers(700, cols, 10 + i)
        sd[f"blocks.{i}.attn.c_v.weight"] = torch.randn(8, cols)  # small: kept, though it shares the input
        sd[f"blocks.{i}.attn_scale"] = torch.ones(cols)
        hessians[tuple(f"blocks.{i}.attn.c_{k}.weight" for k in "qkv")] = correlated_hessian(cols, 20 + i)
    sd["blocks.0.mlp.fc.weight"] = weights_with_outliers(720, cols, 30)  # no Hessian: rounded
    out = quantize_state_dict(sd, hessians=hessians, block_size=32, max_batch_elements=2 * 1420 * 5 * cols)
    assert list(out) == list(sd)
    methods = {name: (qt.scheme, qt.method) for name, qt in out.items()}
    for i in range(layers):
        assert methods[f"blocks.{i}.attn.c_q.weight"] == (INT6, "gptq")
        assert methods[f"blocks.{i}.attn.c_k.weight"] == (INT6, "gptq")
        assert methods[f"blocks.{i}.attn.c_v.weight"] == (PASSTHROUGH, "")
        name = f"blocks.{i}.attn.c_k.weight"
        q_ref, s_ref = reference_gptq(sd[name], hessians[tuple(f"blocks.{i}.attn.c_{k}.weight" for k in "qkv")],
                                      block_size=32)
        h = hessians[tuple(f"blocks.{i}.attn.c_{k}.weight" for k in "qkv")]
        ours = h_error(sd[name], out[name].values, out[name].scale, h)
        assert ours <= h_error(sd[name], q_ref, s_ref, h) * (1 + 1e-4)
    assert methods["blocks.0.mlp.fc.weight"] == (INT6, "rtn")
    assert methods["tok_emb.weight"] == (INT8, "")


# --- Calibration -----------------------------------------------------------------------------

def test_hessians_are_averaged_per_batch_and_damped(quant_config):
    from windowgpt_cli.model.gpt import build_model

    torch.manual_seed(0)
    model = build_model(quant_config.model, torch.device("cpu"))
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 1024, (2, 32), generator=g)
    once = collect_hessians(model, [(x, x)], torch.device("cpu"))
    twice = collect_hessians(model, [(x, x), (x, x)], torch.device("cpu"))
    n, dim = quant_config.model.num_layers, quant_config.model.model_dim
    expected = {tuple(f"blocks.{i}.attn.c_{k}.weight" for k in "qkv") for i in range(n)}
    expected |= {(f"blocks.{i}.{w}.weight",) for i in range(n) for w in ("attn.proj", "mlp.fc", "mlp.proj")}
    assert set(once) == expected
    for names, h in once.items():
        assert torch.allclose(h, twice[names], rtol=1e-5, atol=1e-6)  # a mean over batches, not a sum
        assert torch.allclose(h, h.T, atol=1e-5)
        assert torch.linalg.eigvalsh(h.double()).min() > 0
    # Block 0's attention sees rms_norm(x0) while resid_mix is at its initial (1, 0).
    with torch.no_grad():
        x0 = model.embed(x)
        inputs = torch.nn.functional.rms_norm(x0, (dim,)).reshape(-1, dim)
    raw = inputs.T @ inputs
    expected = raw + HESSIAN_DAMPING * raw.diag().mean() * torch.eye(dim)
    assert torch.allclose(once[tuple(f"blocks.0.attn.c_{k}.weight" for k in "qkv")], expected, rtol=1e-4, atol=1e-4)
