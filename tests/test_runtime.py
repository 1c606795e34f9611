"""Compilation settings and device start-up shared by the stages."""
from __future__ import annotations

import threading

import pytest
import torch

from windowgpt_cli.config import CHOICES
from windowgpt_cli.runtime import (
    MIX_ORDER_OFF,
    MULTI_KERNEL_ON,
    ONE_PASS_OPTIONS,
    TUNING_OPTIONS,
    compiled,
    device_started_meanwhile,
    inductor_has,
    threads_meanwhile,
)


def scaled_tanh_plus_square(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3 + x.square()


def test_compiled_is_the_function_itself_when_disabled():
    assert compiled(scaled_tanh_plus_square, enabled=False) is scaled_tanh_plus_square


@pytest.mark.slow
def test_one_pass_compilation_turns_autotuning_off_and_computes_the_same():
    assert compiled(scaled_tanh_plus_square).options is None  # Inductor's defaults, e.g. for training
    one_pass = compiled(scaled_tanh_plus_square, autotune=False)
    assert one_pass.options == ONE_PASS_OPTIONS == {"triton.autotune_pointwise": False}
    x = torch.randn(64, 8)
    assert torch.allclose(one_pass(x), scaled_tanh_plus_square(x), atol=1e-6)


def test_each_compile_tuning_names_settings_inductor_has():
    """The training step's --compile-tuning choices: default leaves Inductor's settings alone;
    the others set options that this torch's Inductor knows, so torch.compile accepts them."""
    assert set(TUNING_OPTIONS) == set(CHOICES["compile_tuning"])
    assert compiled(scaled_tanh_plus_square, tuning="default").options is None
    for name in ("gemm", "full"):
        options = compiled(scaled_tanh_plus_square, tuning=name).options
        assert options["max_autotune_gemm"] is True and "TRITON" in options["max_autotune_gemm_backends"]
        for key in options:
            assert inductor_has(key), key
    assert TUNING_OPTIONS["full"]["coordinate_descent_tuning"] is True


def test_mix_order_off_joins_every_other_option_and_names_a_setting_inductor_has():
    import torch._inductor.config as inductor

    assert compiled(scaled_tanh_plus_square, mix_order=False).options == MIX_ORDER_OFF
    gemm = compiled(scaled_tanh_plus_square, tuning="gemm", mix_order=False).options
    assert gemm == {**TUNING_OPTIONS["gemm"], **MIX_ORDER_OFF}
    assert compiled(scaled_tanh_plus_square, autotune=False, mix_order=False).options == {
        **ONE_PASS_OPTIONS, **MIX_ORDER_OFF}
    for key, value in MIX_ORDER_OFF.items():  # a dotted name: a setting of one of Inductor's sections
        section, name = key.split(".")
        assert isinstance(getattr(getattr(inductor, section), name), bool) and value is False
        assert inductor_has(key)
    assert TUNING_OPTIONS["gemm"].keys().isdisjoint(MIX_ORDER_OFF)  # the shared dicts stay unchanged
    assert inductor_has("max_autotune_gemm") and not inductor_has("triton.no_such_setting")
    assert not inductor_has("no_such_section.mix_order_reduction")


def test_multi_kernels_join_the_other_options_and_compile_to_the_same_numbers():
    import torch._inductor.config as inductor

    options = compiled(scaled_tanh_plus_square, tuning="gemm", mix_order=False, multi_kernel=True).options
    assert options == {**TUNING_OPTIONS["gemm"], **MIX_ORDER_OFF, **MULTI_KERNEL_ON}
    assert compiled(scaled_tanh_plus_square).options is None  # off unless asked
    for key, value in MULTI_KERNEL_ON.items():  # 1: both variants built, the faster kept
        section, name = key.split(".")
        assert getattr(getattr(inductor, section), name) in (0, 1, 2, 3) and value == 1
    x = torch.randn(8, 24)
    torch._dynamo.reset()
    assert torch.allclose(compiled(scaled_tanh_plus_square, multi_kernel=True)(x), scaled_tanh_plus_square(x))


def test_without_mix_order_reductions_in_inductor_turning_them_off_sets_nothing(monkeypatch):
    """An older torch's Inductor has no such setting, and torch.compile would refuse it."""
    from windowgpt_cli import runtime

    monkeypatch.setattr(runtime, "inductor_has", lambda key: False)
    assert compiled(scaled_tanh_plus_square, mix_order=False).options is None
    assert compiled(scaled_tanh_plus_square, tuning="gemm", mix_order=False).options == TUNING_OPTIONS["gemm"]
    assert compiled(scaled_tanh_plus_square, mix_order=False, multi_kernel=True).options is None


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


def test_threads_run_beside_the_block_and_are_waited_for_after_it():
    block_ran, results = threading.Event(), []

    def build() -> None:  # needs the block to have started: the threads run beside it, not before it
        assert block_ran.wait(timeout=30)
        results.append(torch.is_inference_mode_enabled())

    with threads_meanwhile([build, build], torch.device("cpu")):
        block_ran.set()
    assert results == [True, True]  # both done once the block is left, without autograd

    def failing() -> None:
        raise ValueError("a build failed")

    with pytest.raises(ValueError, match="a build failed"):
        with threads_meanwhile([failing], torch.device("cpu")):
            results.append("block")
    assert results[-1] == "block"
