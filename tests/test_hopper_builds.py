"""The Triton kernels with the largest tiles build for a Hopper GPU on any machine: each is
compiled for sm_90 by Triton (ptxas included) in a fresh process (the other CPU tests run the
kernels in Triton's interpreter, which builds nothing) and must fit a Hopper
multiprocessor's shared memory. A kernel that needs more fails at its first launch on the
GPU; this finds it without one. The float8 MLP's kernels build too, and divide as the
interpreter does (correctly rounded), not by the GPU's approximate division; so do the
training step's XSA op's kernels, the heads' kernels (the forward's rotated channels apart
too), FA4's window's sink kernels and bench/fp8_group_products.py's float8 products. The
builds go through `bench/hopper_sass.py`, which bench/head_kernels_sass.py reads the machine
code of."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOPPER_SHARED_BYTES = 232_448  # 227 KB: the most shared memory one block may take on an H100 or H200

BUILDS = r'''
import json
import sys
from windowgpt_cli.kernels import (attention_output, attention_sinks, elementwise, elementwise_backward, fp8_mlp,
                                   fused_mlp, window_attention)

sys.path.insert(0, "bench")
import fp8_group_products  # noqa: E402
from head_kernels_sass import head_arg_types  # noqa: E402
from hopper_sass import compile_for_hopper  # noqa: E402


def build(kernel, types, constants, warps, stages):
    return compile_for_hopper(kernel, types, constants, warps, stages).metadata.shared


def fp8_rows_types(name):
    return {"codes_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "negative_slope": "fp32"}.get(
        name, "*bf16" if name.endswith("_ptr") else "i32")


def approximate_divisions(kernel):
    """Rows of 1,536 (the record model's MLP) as the kernel's launch cuts them."""
    launch = fp8_mlp.RowLaunch()
    constants = {"ROWS": launch.elements // 2048, "COLS": 2048}
    ptx = compile_for_hopper(kernel, fp8_rows_types, constants, launch.warps, 3).asm["ptx"]
    return ptx.count("div.full") + ptx.count("div.approx")


def product_types(blocks):
    return lambda name: (f"tensordesc<bf16[{blocks[name][0]},{blocks[name][1]}]>" if name in blocks
                         else "fp32" if name == "negative_slope" else "i32")


def up_product(tiles, store_product):
    m, n, k = tiles.block_m, tiles.block_n, tiles.block_k
    blocks = {"x_desc": (m, k), "w_desc": (n, k), "out_desc": (m, n), "product_desc": (m, n)}
    constants = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "PROGRAMS": 132, "STORE_PRODUCT": store_product}
    return build(elementwise._leaky_square_matmul_kernel, product_types(blocks), constants, tiles.num_warps,
                 tiles.num_stages)


def gradient_product(tiles):
    m, n, k = tiles.block_m, tiles.block_n, tiles.block_k
    blocks = {"g_desc": (m, k), "w_desc": (k, n), "h_desc": (m, n), "out_desc": (m, n)}
    constants = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "PROGRAMS": 132}
    return build(elementwise_backward._leaky_square_grad_matmul_kernel, product_types(blocks), constants,
                 tiles.num_warps, tiles.num_stages)


def key_gradients(tuning):
    def types(name):
        if name.endswith("_ptr"):
            return "*fp32" if name in ("lse_ptr", "delta_ptr") else "*bf16"
        return "fp32" if name in ("qk_scale", "sm_scale") else "i32"
    constants = {"BLOCK_M": tuning.bwd_block_loop, "BLOCK_N": tuning.bwd_block_own, "HEAD_DIM": 64}
    return build(window_attention._attention_dkdv_kernel, types, constants, tuning.bwd_warps, tuning.bwd_stages)


def xsa(kernel):
    """The training step's XSA op at the record model's heads (8 over 4 values), gated."""
    types = lambda name: "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else "i32"
    constants = {"HAS_GATE": True, "GROUP": 2, "HEAD_DIM": 64, "ROWS": attention_output.ROWS}
    return build(kernel, types, constants, attention_output.WARPS, 3)


def heads(kernel, launch=elementwise.HEAD_LAUNCH):
    """The heads' norm, rotation and gain at the record model's head size and rotated half,
    at the default launch (or another: the forward's rotated channels apart)."""
    constants = {"HEAD_DIM": 64, "ROPE_HALF": 8, "POSITIONS": launch.positions, "ROTATED_APART": launch.rotated_apart}
    return build(kernel, head_arg_types, {k: v for k, v in constants.items() if k in kernel.arg_names}, launch.warps, 3)


def sinks(kernel):
    """FA4's window's sink kernels at the record model's head size and four sinks."""
    def types(name):
        if name.endswith("_ptr"):
            return "*fp32" if name in ("lse_ptr", "dk_ptr", "dv_ptr") else "*bf16"
        return "fp32" if name == "scale" else "i32"
    constants = {"BLOCK_M": attention_sinks.BLOCK_M, "SINKS_PAD": 16, "HEAD_DIM": 64}
    return build(kernel, types, constants, 4, 3)


def fp8_group_product(kernel, constants):
    """bench/fp8_group_products.py's products at its default launch (8 warps, 3 stages), on
    Hopper's float8 tensor-core instructions (wgmma on e4m3 operands)."""
    codes = ("x_ptr", "w_ptr", "h_ptr", "codes_ptr")
    types = lambda name: ("*fp8e4nv" if name in codes else "*bf16" if name in ("pre_ptr", "out_ptr")
                          else "*fp32" if name.endswith("_ptr") else "fp32" if name == "negative_slope" else "i32")
    compiled = compile_for_hopper(kernel, types, constants, 8, 3)
    assert "f32.e4m3.e4m3" in compiled.asm["ptx"] and "wgmma.mma_async" in compiled.asm["ptx"], kernel.fn.__name__
    return compiled.metadata.shared


print(json.dumps({
    "sinks_forward": sinks(attention_sinks._attention_sinks_forward_kernel),
    "sinks_backward": sinks(attention_sinks._attention_sinks_backward_kernel),
    "heads_forward": heads(elementwise._head_prep_kernel),
    "heads_backward": heads(elementwise_backward._head_prep_backward_kernel),
    "heads_forward_apart": heads(elementwise._head_prep_kernel, elementwise.HeadLaunch(rotated_apart=True)),
    "xsa_forward": xsa(attention_output._xsa_forward_kernel),
    "xsa_backward": xsa(attention_output._xsa_backward_kernel),
    "scoring_up_product": up_product(elementwise.MatmulTiles(), False),
    "training_up_product": up_product(fused_mlp.TRAINING_TILES, True),
    "training_gradient_product": gradient_product(fused_mlp.TRAINING_TILES),
    "window_key_gradients": key_gradients(window_attention.DEFAULT_TUNING),
    "fp8_group_up": fp8_group_product(fp8_group_products._up_kernel, {"BLOCK_M": 128, "GROUP_N": 128, "BLOCK_K": 64}),
    "fp8_group_down": fp8_group_product(fp8_group_products._down_kernel,
                                        {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_K": 128}),
    "fp8_approximate_divisions": approximate_divisions(fp8_mlp._leaky_square_fp8_kernel)
                                 + approximate_divisions(fp8_mlp._leaky_square_fp8_backward_kernel),
}))
'''


@pytest.mark.slow
def test_the_largest_tiles_fit_a_hopper_multiprocessors_shared_memory():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", BUILDS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr.lower() and "not found" in done.stderr.lower():
        pytest.skip("Triton's ptxas is missing here")
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert shared.pop("fp8_approximate_divisions") == 0
    assert all(0 <= shared.pop(name) <= HOPPER_SHARED_BYTES for name in ("heads_forward", "heads_backward",
                                                                    "heads_forward_apart"))
    assert all(0 < shared.pop(name) <= HOPPER_SHARED_BYTES
               for name in ("xsa_forward", "xsa_backward", "sinks_forward", "sinks_backward"))
    assert len(shared) == 6 and all(0 < size <= HOPPER_SHARED_BYTES for size in shared.values()), shared


@pytest.mark.slow
def test_the_forward_with_its_rotated_channels_apart_runs_fewer_instructions(tmp_path):
    """bench/head_kernels_sass.py reads the heads' kernels' machine code for sm_90: a turn of
    the forward's loop with the rotated channels apart issues fewer instructions, in no more
    registers, for the queries and the keys, and the backward is the same build either way."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "bench/head_kernels_sass.py", "--launches", "16x4,16x4s", "--json",
                           str(tmp_path / "sass.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr.lower() and "not found" in done.stderr.lower():
        pytest.skip("Triton's ptxas is missing here")
    assert done.returncode == 0, done.stderr[-3000:]
    default, apart = json.loads((tmp_path / "sass.json").read_text())["launches"]
    assert (default["launch"], apart["launch"]) == ("16x4", "16x4s")
    for heads in ("queries", "keys"):
        before, after = default[f"forward_{heads}"], apart[f"forward_{heads}"]
        assert 0 < after["loop_instructions"] < before["loop_instructions"]
        assert after["registers"] <= before["registers"] and after["local_bytes"] == before["local_bytes"] == 0
        assert apart[f"backward_{heads}"] == default[f"backward_{heads}"]
    assert "forward_queries" in done.stdout.splitlines()[1]
