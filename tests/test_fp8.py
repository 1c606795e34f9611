"""FP8 matrix products for training (`train --fp8`): exact against their FP8 operands,
close to full precision, and a tiny model trains with them (torch runs them on the CPU)."""
import json

import pytest
import torch
import torch.nn.functional as F

from windowgpt_cli.config import ModelConfig
from windowgpt_cli.errors import ConfigError
from windowgpt_cli.fp8 import FLOAT8_OPS, FORWARD_DTYPE, GRADIENT_DTYPE, check_fp8_device, fp8_linear, quantize
from windowgpt_cli.model import build_model
from test_model import perturbed_tiny


def dequantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values, scale = quantize(x, dtype)
    return values.float() * scale


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_quantize_maps_the_largest_magnitude_onto_the_format_and_keeps_zeros_finite():
    x = torch.tensor([[-3.0, 0.5], [1e-3, 2.0]])
    for dtype in (FORWARD_DTYPE, GRADIENT_DTYPE):
        values, scale = quantize(x, dtype)
        assert values.dtype == dtype and scale.dtype == torch.float32
        assert values.float().abs().max().item() == torch.finfo(dtype).max
        assert torch.allclose(values.float() * scale, x, rtol=0.13, atol=1e-2 * 3.0)
    zeros, scale = quantize(torch.zeros(3, 4), FORWARD_DTYPE)
    assert scale.item() == 1.0 and torch.equal(zeros.float(), torch.zeros(3, 4))


def test_fp8_linear_is_the_product_of_its_fp8_operands_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 16, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    out = fp8_linear(x, w)
    x_q, w_q = dequantized(x.detach().reshape(-1, 64), FORWARD_DTYPE), dequantized(w.detach(), FORWARD_DTYPE)
    assert out.shape == (3, 16, 48)
    assert torch.allclose(out.reshape(-1, 48), x_q @ w_q.t(), rtol=1e-5, atol=1e-4)
    grad = torch.randn_like(out)
    out.backward(grad)
    g_q = dequantized(grad.reshape(-1, 48), GRADIENT_DTYPE)
    assert torch.allclose(x.grad.reshape(-1, 64), g_q @ w_q, rtol=1e-5, atol=1e-4)
    assert torch.allclose(w.grad, g_q.t() @ x_q, rtol=1e-5, atol=1e-3)


def test_fp8_linear_is_close_to_the_full_precision_product():
    torch.manual_seed(1)
    x = torch.randn(256, 128, requires_grad=True)
    w = (torch.randn(96, 128) * 0.05).requires_grad_()
    grad = torch.randn(256, 96)
    fp8_linear(x, w).backward(grad)
    fp8_grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    exact = F.linear(x, w)
    exact.backward(grad)
    assert relative_error(fp8_linear(x, w).detach(), exact.detach()) < 0.05  # 3 mantissa bits per operand
    assert relative_error(fp8_grads[0], x.grad) < 0.1  # the gradient keeps 2
    assert relative_error(fp8_grads[1], w.grad) < 0.1


def test_the_model_with_fp8_products_stays_close_and_trains_the_same_parameters():
    model = perturbed_tiny()
    vocab = model.cfg.vocab_size
    x, y = torch.randint(0, vocab, (2, 32)), torch.randint(0, vocab, (2, 32))
    exact = model(x, y)
    exact.backward()
    exact_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = model(x, y, ops=FLOAT8_OPS)
    loss.backward()
    assert abs(loss.item() - exact.item()) < 0.02 * exact.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == exact_grads.keys()
    for name in ("mlp_up_bank", "mlp_down_bank", "tok_emb.weight", "qo_bank"):
        cosine = F.cosine_similarity(grads[name].flatten(), exact_grads[name].flatten(), dim=0).item()
        assert cosine > 0.95, (name, cosine)


def test_a_gpu_without_fp8_tensor_cores_is_a_clear_error(monkeypatch):
    check_fp8_device(torch.device("cpu"))  # torch runs the products there
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"compute capability 8\.9 or later.*A100 has 8\.0"):
        check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compiled_cuda_training_step_runs_its_fp8_products():
    """On the GPU, under bf16 autocast and torch.compile, as `train --fp8` runs them."""
    device = torch.device("cuda")
    check_fp8_device(device)
    torch.manual_seed(3)
    x = torch.randn(4096, 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(1536, 512, device=device, dtype=torch.bfloat16)
    out = fp8_linear(x, w)
    expected = dequantized(x, FORWARD_DTYPE) @ dequantized(w, FORWARD_DTYPE).t()
    assert out.dtype == torch.bfloat16 and relative_error(out.float(), expected) < 1e-2
    cfg = ModelConfig(num_layers=4, model_dim=256, num_heads=4, num_kv_heads=2, ve_layers=(3,), xsa_last_n=1)
    model = build_model(cfg, device)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8, 256), device=device)
    step = torch.compile(lambda a, b: model(a, b, ops=FLOAT8_OPS), fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fp8_loss = step(tokens[0], tokens[1])
        exact = model(tokens[0], tokens[1])
    fp8_loss.backward()
    assert abs(fp8_loss.item() - exact.item()) < 0.02 * exact.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_train_with_fp8_learns_and_the_bench_compares_it_with_bf16(tiny_data_dir, tmp_path):
    """bench/fp8_check.sh end to end on the CPU (TINY=1, on data it finds prepared): two
    `train` runs, one with --fp8, which learns and says so, and one JSON."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "data").symlink_to(tiny_data_dir)
    env = {**os.environ, "TINY": "1", "STEPS": "8", "RESULT": str(tmp_path / "fp8.json"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(repo / "bench" / "fp8_check.sh"), str(tmp_path), str(tmp_path / "work"),
                           str(tmp_path / "logs")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "fp8.json").read_text())
    assert report["gpu"] == "cpu" and report["steps"] == 8
    runs = {v: tmp_path / "work" / v for v in ("bf16", "fp8")}
    assert {v: json.loads((run / "config.json").read_text())["train"]["fp8"] for v, run in runs.items()} == \
        {"bf16": False, "fp8": True}
    assert "matmuls:fp8" in (runs["fp8"] / "train.log").read_text()
    assert "matmuls:fp8" not in (runs["bf16"] / "train.log").read_text()
    losses = [json.loads(line)["train_loss"] for line in (runs["fp8"] / "metrics.jsonl").read_text().splitlines()
              if "train_loss" in line]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    assert report["val_bpb_difference"] == report["fp8"]["val_bpb"] - report["bf16"]["val_bpb"]
    assert report["step_ratio"] == report["fp8"]["ms_per_step"] / report["bf16"]["ms_per_step"]
    assert "bar 0.005" in done.stdout
