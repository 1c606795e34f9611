"""Compilation settings and device start-up shared by the stages."""
from __future__ import annotations

import pytest
import torch

from windowgpt_cli.runtime import ONE_PASS_OPTIONS, compiled, device_started_meanwhile


def scaled_tanh_plus_square(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3 + x.square()


def test_compiled_is_the_function_itself_when_disabled():
    assert compiled(scaled_tanh_plus_square, enabled=False) is scaled_tanh_plus_square


def test_one_pass_compilation_turns_autotuning_off_and_computes_the_same():
    assert compiled(scaled_tanh_plus_square).options is None  # Inductor's defaults, e.g. for training
    one_pass = compiled(scaled_tanh_plus_square, autotune=False)
    assert one_pass.options == ONE_PASS_OPTIONS == {"triton.autotune_pointwise": False}
    x = torch.randn(64, 8)
    assert torch.allclose(one_pass(x), scaled_tanh_plus_square(x), atol=1e-6)


def test_the_device_starts_beside_the_block_and_its_failure_is_raised():
    ran = []
    with device_started_meanwhile(torch.device("cpu")):  # nothing to start
        ran.append("cpu")
    if torch.cuda.is_available():
        with device_started_meanwhile(torch.device("cuda")):
            ran.append("cuda")
        assert torch.cuda.is_initialized()
    else:  # this torch cannot start a CUDA device: the thread's error reaches the caller, after the block
        with pytest.raises((AssertionError, RuntimeError)):
            with device_started_meanwhile(torch.device("cuda")):
                ran.append("cuda")
    assert ran == ["cpu", "cuda"]
