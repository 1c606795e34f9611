"""The training benchmarks' pure parts: log comparison, the reference's sampler seed, the
kernels' sources in generated code, the profile's kernel classification and breakdown (plus
one tiny profiled run on the CPU), and the FA4 backward tiles' candidates and choice."""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import typer

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import compare_logs  # noqa: E402
import kernel_sources  # noqa: E402
import mix_order_kernels  # noqa: E402
import reference_seed  # noqa: E402
import train_profile  # noqa: E402
import trace_idle  # noqa: E402
import train_variants  # noqa: E402
from windowgpt_cli.train.trainer import PHASES  # noqa: E402


# --- compare_logs ---------------------------------------------------------------------------

def train_lines(step_avgs: dict[int, float], losses: dict[int, float] | None = None, total: int = 40) -> str:
    """Log lines as both the reference and windowgpt print them (with noise around)."""
    lines = ["warmup_step:20/20", "model_params:26993756"]
    for step, avg in step_avgs.items():
        loss = (losses or {}).get(step, 5.0)
        lines.append(f"step:{step}/{total} train_loss:{loss:.4f} train_time:{avg * step:.0f}ms step_avg:{avg:.2f}ms")
    return "\n".join(lines) + "\n"


def write_pair(log_dir: Path, name: str, ref: str, ours: str) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"ref_{name}.log").write_text(ref)
    (log_dir / f"ours_{name}.log").write_text(ours)


def test_step_time_is_the_mean_over_steps_11_to_the_last_common_step():
    ref = compare_logs.parse_log(train_lines({10: 1000.0, 20: 800.0, 40: 700.0}))
    ours = compare_logs.parse_log(train_lines({10: 900.0, 20: 600.0, 30: 550.0}))
    # last common step: 20; reference (800*20 - 1000*10) / 10 = 600, ours (600*20 - 900*10) / 10 = 300
    assert compare_logs.step_time(ref, ours) == {"reference_ms": 600.0, "windowgpt_ms": 300.0, "ratio": 0.5}
    no_step_10 = compare_logs.parse_log(train_lines({20: 800.0, 40: 700.0}))
    assert compare_logs.step_time(no_step_10, ours)["ratio"] is None
    assert compare_logs.step_time(ref, None)["reference_ms"] is None


def test_the_result_file_has_its_shape_and_takes_later_directories_first(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    write_pair(first, "record_786k", train_lines({10: 700.0, 40: 670.0}), train_lines({10: 650.0, 40: 610.0}))
    write_pair(first, "full_786k", train_lines({10: 1.0, 40: 1.0}), train_lines({10: 1.0, 40: 1.0}))
    write_pair(second, "full_786k", train_lines({10: 700.0, 40: 640.0}), train_lines({10: 600.0, 40: 560.0}))
    parity_steps = {10: 120.0, 50: 110.0, 100: 105.0, 200: 104.0}
    ref = train_lines(parity_steps, {50: 4.1234, 100: 3.5, 200: 3.1}, total=200)
    ref += "step:200/200 val_loss:3.0000 val_bpb:1.8000 train_time:20800ms step_avg:104.00ms\n"
    ours = train_lines({**parity_steps, 200: 102.0}, {50: 4.1200, 100: 3.51, 200: 3.12}, total=200)
    ours += "step:200/200 val_loss:3.0100 val_bpb:1.8100 train_time:20400ms step_avg:102.00ms\n"
    write_pair(second, "parity", ref, ours)
    (second / "gpu.txt").write_text("NVIDIA H200\n")
    out = tmp_path / "results" / "train_step_h200.json"

    compare_logs.main([str(first), str(second), "--json", str(out)])

    result = json.loads(out.read_text())
    assert set(result) == {"gpu", "configs", "parity"} and result["gpu"] == "NVIDIA H200"
    assert list(result["configs"]) == ["record_786k", "full_786k", "record_131k"]
    assert result["configs"]["record_786k"] == {"reference_ms": 660.0, "windowgpt_ms": 596.67, "ratio": 0.904}
    assert result["configs"]["full_786k"]["reference_ms"] == 620.0  # the second directory's pair
    # No record_131k pair: the parity run's steps 11..200
    assert result["configs"]["record_131k"]["reference_ms"] == pytest.approx((104.0 * 200 - 1200.0) / 190, abs=0.01)
    assert result["parity"] == {"train_loss_50": [4.1234, 4.12], "train_loss_100": [3.5, 3.51],
                                "train_loss_200": [3.1, 3.12], "val_bpb": [1.8, 1.81]}
    table = capsys.readouterr().out
    assert "| record_786k | 660.0 | 596.7 | 0.904 |" in table
    assert "| val_bpb | 1.8000 | 1.8100 | 0.0100 |" in table


def test_missing_runs_are_null(tmp_path):
    write_pair(tmp_path, "record_786k", train_lines({10: 700.0, 40: 670.0}), "")  # ours died before logging
    result = compare_logs.assemble("gpu", compare_logs.read_pairs([tmp_path]))
    assert all(v is None for row in result["configs"].values() for v in row.values())
    assert result["parity"]["val_bpb"] == [None, None]
    assert "| record_786k | - | - | - |" in compare_logs.markdown(result)


# --- reference_seed ---------------------------------------------------------------------------

def test_the_reference_seed_hashes_the_train_shard_paths_as_given(tmp_path):
    from windowgpt_cli.config import apply_overrides, preset

    data = tmp_path / "data"
    data.mkdir()
    for name in ("fineweb_train_000000.bin", "fineweb_train_000001.bin"):
        (data / name).write_bytes(b"")
    seed = reference_seed.reference_data_seed(str(data))
    (data / "fineweb_val_000000.bin").write_bytes(b"")
    (data / "manifest.json").write_text("{}")
    assert reference_seed.reference_data_seed(str(data)) == seed  # only train shards count
    link = tmp_path / "link"
    link.symlink_to(data)
    assert reference_seed.reference_data_seed(str(link)) != seed  # the path as given, not resolved
    (data / "fineweb_train_000002.bin").write_bytes(b"")
    assert reference_seed.reference_data_seed(str(data)) != seed
    # A 64-bit seed, which --data-seed takes.
    assert apply_overrides(preset("default"), {"train": {"data_seed": seed}}).resolved().train.data_seed == seed


# --- train_profile ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, phase, kind, category", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", PHASES.forward, "kernel", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", PHASES.backward, "kernel",
     "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", PHASES.forward,
     "kernel", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", PHASES.forward,
     "kernel", "attention_fwd"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", PHASES.backward,
     "kernel", "attention_bwd"),
    ("triton_tem_fused_flex_attention_0", PHASES.forward, "kernel", "attention_fwd"),
    ("triton_tem_fused_flex_attention_backward_1", PHASES.backward, "kernel", "attention_bwd"),
    ("cutlass::device_kernel<flash::enable_sm90<flash::FlashAttnFwdSm90<...>>>", PHASES.forward, "kernel",
     "attention_fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128", None, "kernel",
     "attention_bwd"),
    ("triton_red_fused__log_softmax__to_copy_mul_tanh_0", PHASES.forward, "kernel", "cross_entropy"),
    ("triton_per_fused_nll_loss_backward_3", PHASES.backward, "kernel", "cross_entropy"),
    ("triton_poi_fused_add_mul_rms_norm_3", PHASES.forward, "kernel", "elementwise_norm"),
    ("_stream_norm_kernel", PHASES.forward, "kernel", "elementwise_norm"),
    ("_leaky_square_kernel", PHASES.backward, "kernel", "elementwise_norm"),
    ("_leaky_square_matmul_kernel", PHASES.forward, "kernel", "matmul"),
    ("_leaky_square_grad_matmul_kernel", PHASES.backward, "kernel", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", PHASES.backward,
     "kernel", "elementwise_norm"),
    ("Memset (Device)", PHASES.backward, "memset", "elementwise_norm"),
    ("mystery_op", PHASES.forward, "kernel", "other"),
    # The phase decides for the optimizer, EMA, clipping and data phases, whatever the name.
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", PHASES.muon, "kernel", "muon"),
    ("triton_poi_fused_add_mul_0", PHASES.muon, "kernel", "muon"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>", PHASES.adam,
     "kernel", "adamw"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, BinaryOpListAlphaFunctor>", PHASES.ema,
     "kernel", "ema"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, NormTwoOps>>", PHASES.grad_clip, "kernel",
     "grad_clip"),
    ("Memcpy HtoD (Pinned -> Device)", PHASES.data, "memcpy", "data_h2d"),
    ("Memcpy HtoD (Pinned -> Device)", None, "memcpy", "data_h2d"),
    ("Memcpy DtoD (Device -> Device)", PHASES.forward, "memcpy", "elementwise_norm"),
    # NCCL is communication wherever it runs.
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", PHASES.muon, "kernel", "communication"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", PHASES.grad_sync, "kernel", "communication"),
])
def test_kernels_are_classified(name, phase, kind, category):
    assert train_profile.classify(name, phase, kind) == category


def _range(name: str, start: float, end: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": start, "dur": end - start, "tid": 1}


def _kernel(name: str, start: float, dur: float, launched: float, correlation: int, cat: str = "kernel") -> list[dict]:
    return [{"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "args": {"correlation": correlation}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched, "dur": 2.0,
             "args": {"correlation": correlation}, "tid": 2}]


def test_the_breakdown_attributes_kernels_by_their_launch_phase():
    events = [_range(train_profile.STEP_RANGE, 0, 1000), _range(PHASES.data, 0, 10), _range(PHASES.forward, 10, 100),
              _range(PHASES.backward, 100, 300), _range(PHASES.muon, 300, 400), _range(PHASES.ema, 400, 450),
              _range(train_profile.STEP_RANGE, 1000, 2000)]
    events += _kernel("Memcpy HtoD (Pinned -> Device)", 20, 10, 5, 1, cat="gpu_memcpy")
    events += _kernel("nvjet_tst_128x256", 30, 200, 50, 2)  # runs on after its phase ends
    events += _kernel("triton_tem_fused_flex_attention_0", 230, 100, 60, 3)
    events += _kernel("triton_tem_fused_flex_attention_1", 330, 300, 150, 4)  # launched from another thread
    events += _kernel("nvjet_tst_64x8", 630, 100, 310, 5)  # Newton-Schulz
    events += _kernel("multi_tensor_apply_kernel", 700, 50, 420, 6)
    events += _kernel("triton_poi_fused_add_0", 700, 100, 1100, 7)  # overlaps the one above: another stream
    events += _kernel("nvjet_outside_the_steps", 5000, 1000, 3000, 8)
    events.append({"ph": "X", "cat": "kernel", "name": "mystery_op", "ts": 1200, "dur": 50, "args": {}})

    result = train_profile.breakdown(events, step_wall_ms=0.5, top=1)

    ms = result["categories_ms"]
    assert result["steps_profiled"] == 2
    assert ms["data_h2d"] == 0.005 and ms["matmul"] == 0.1 and ms["attention_fwd"] == 0.05
    assert ms["attention_bwd"] == 0.15 and ms["muon"] == 0.05 and ms["ema"] == 0.025
    assert ms["elementwise_norm"] == 0.05 and ms["other"] == 0.025  # no launch event: its own start
    assert result["kernel_sum_ms"] == 0.455
    assert result["gpu_busy_ms"] == 0.415  # 20..800 and 1200..1250 µs, over 2 steps
    assert ms["host_gaps"] == pytest.approx(0.5 - 0.415)
    assert result["top_kernels"]["matmul"] == [["nvjet_tst_128x256", 0.1, 0.5]]  # one call over two steps
    text = train_profile.table(result)
    assert "host gaps" in text and "0.100 ms in 0.5 calls  nvjet_tst_128x256" in text
    result["top_kernels"]["matmul"] = [["nvjet_tst_128x256", 0.1]]  # as profiles written before the count
    assert "0.100 ms  nvjet_tst_128x256" in train_profile.table(result)


def test_the_idle_stretches_name_the_kernels_around_them_the_phase_and_the_host_call_meanwhile():
    events = [_range(train_profile.STEP_RANGE, 0, 1000), _range(PHASES.forward, 0, 100), _range(PHASES.muon, 100, 300),
              _range(PHASES.ema, 300, 900), _range(train_profile.STEP_RANGE, 1000, 2000),
              _range(PHASES.forward, 1000, 1100)]
    events += _kernel("fwd_a", 10, 40, 5, 1)
    events += _kernel("fwd_b", 60, 20, 8, 2)  # 10 µs idle, launched long before: not the host's doing
    events += _kernel("ns_gram", 70, 100, 120, 3)  # overlaps fwd_b: no idle between them
    events += _kernel("ema_mul", 470, 30, 465, 4)  # 300 µs idle: the GPU waited for its launch
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 180, "dur": 250,
                   "args": {}})
    events += _kernel("fwd_a", 1600, 40, 1050, 5)  # the next step: 1100 µs idle, forward's
    events += _kernel("outside_any_step", 2500, 10, 2400, 6)

    idle = train_profile.idle_stretches(events, count=2)

    assert idle["idle_by_phase_ms"] == {PHASES.forward: 0.555, PHASES.ema: 0.15}  # per step, over two steps
    assert idle["steps"] == [{"idle_ms": 0.31, "activities": 4, "kernel": 4},
                             {"idle_ms": 1.1, "activities": 1, "kernel": 1}]  # the steps' boundary: the second's
    first, second = idle["longest_idle"]
    assert (first["idle_us"], first["before"], first["after"], first["after_phase"]) == (1100.0, "ema_mul", "fwd_a",
                                                                                       PHASES.forward)
    assert (second["idle_us"], second["before"], second["after"], second["after_phase"]) == (300.0, "ns_gram",
                                                                                            "ema_mul", PHASES.ema)
    assert second["after_launch_lag_us"] == 5.0 and second["longest_host_call"] == ["cudaStreamSynchronize", 250.0]
    result = {**train_profile.breakdown(events, step_wall_ms=1.0), "idle": idle}
    assert "GPU idle by step: 0.310 ms among 4 activities, 1.100 ms among 1 activities" in train_profile.table(result)
    assert f"300.0 us idle before ema_mul ({PHASES.ema}, began 5.0 us after its launch" in train_profile.table(result)


def test_inductor_settings_are_parsed_checked_and_set_for_the_process():
    import torch._inductor.config as inductor

    assert train_profile.inductor_settings(["combo_kernels=True", " triton.multi_kernel = 2"]) == {
        "combo_kernels": True, "triton.multi_kernel": 2}
    for bad, why in (("no_such_setting=1", "Inductor settings"), ("combo_kernels", "NAME=VALUE"),
                     ("combo_kernels=yes", "not a Python literal")):
        with pytest.raises(typer.BadParameter, match=why):
            train_profile.inductor_settings([bad])
    before = (inductor.combo_kernels, inductor.triton.multi_kernel)
    # Inductor's own patch puts these back on leaving (monkeypatch's undo would delete them)
    with inductor.patch({"combo_kernels": before[0], "triton.multi_kernel": before[1]}):
        train_profile.apply_torch_settings("default", {"combo_kernels": True, "triton.multi_kernel": 2})
        assert inductor.combo_kernels is True and inductor.triton.multi_kernel == 2
    assert (inductor.combo_kernels, inductor.triton.multi_kernel) == before


def test_a_saved_trace_is_read_back_gzipped_and_refused_as_its_own_output(tmp_path, capsys):
    import gzip

    events = [_range(train_profile.STEP_RANGE, 0, 1000), _range(PHASES.forward, 0, 900)]
    events += _kernel("fwd_a", 10, 40, 5, 1) + _kernel("fwd_b", 100, 20, 8, 2)
    events += _kernel("Memset (Device)", 130, 1, 9, 3, cat="gpu_memset")
    trace, out = tmp_path / "trace.json.gz", tmp_path / "idle.json"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert trace_idle.main([str(trace), "--gaps", "1", "--json", str(out)]) == 0
    assert "GPU idle by step: 0.060 ms among 3 activities" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["steps"] == [{"idle_ms": 0.06, "activities": 3, "kernel": 2, "memset": 1}]
    assert [g["after"] for g in written["longest_idle"]] == ["fwd_b"]
    assert trace_idle.main([str(trace), "--json", str(trace)]) == 1
    assert "--json" in capsys.readouterr().err and trace.stat().st_size > 0
    assert trace_idle.main([str(out)]) == 1  # JSON, but no trace
    assert "not a profiler's Chrome trace" in capsys.readouterr().err
    assert trace_idle.main([str(tmp_path / "missing.json")]) == 1
    assert "no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_a_profiled_tiny_run_on_the_cpu_marks_every_phase(tiny_data_dir, tmp_path):
    from typer.testing import CliRunner

    out, trace = tmp_path / "profile.json", tmp_path / "trace.json"
    args = ["--data", str(tiny_data_dir), "--preset", "tiny", "--steps", "1", "--timed-steps", "1",
            "--train-batch-tokens", "1024", "--grad-accum-steps", "1", "--warmup-steps", "1", "--json", str(out),
            "--trace", str(trace)]
    run = CliRunner().invoke(train_profile.app, args)
    assert run.exit_code == 0, run.output
    result = json.loads(out.read_text())
    assert result["gpu"] == "cpu" and result["steps_profiled"] == 1 and result["step_wall_ms"] > 0
    assert set(result["categories_ms"]) == {*train_profile.CATEGORIES, train_profile.HOST_GAPS}
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {PHASES.data, PHASES.forward, PHASES.backward, PHASES.grad_clip, PHASES.grad_sync, PHASES.adam,
            PHASES.muon, PHASES.ema, train_profile.STEP_RANGE} <= names
    assert "host gaps" in run.output


def test_the_variants_table_sets_profiles_side_by_side(tmp_path):
    import os

    for i, (name, wall, matmul, elementwise) in enumerate([("base", 100.0, 50.0, 30.0), ("fused", 80.0, 52.0, 9.0)]):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"step_wall_ms": wall, "categories_ms": {"matmul": matmul,
                                                                           "elementwise_norm": elementwise}}))
        os.utime(path, (1000 + i, 1000 + i))  # written in this order
    (tmp_path / "other.json").write_text("{}")  # not a profile
    rows = train_variants.table(train_variants.profiles(tmp_path)).splitlines()
    assert rows[0].startswith("| variant | step ms | ratio | matmul | elementwise_norm |") and len(rows) == 4
    assert rows[2] == "| base | 100.0 | 1.000 | 50.0 | 30.0 |"
    assert rows[3] == "| fused | 80.0 | 0.800 | 52.0 | 9.0 |"
    against_fused = train_variants.table(train_variants.profiles(tmp_path), "fused").splitlines()
    assert against_fused[2] == "| base | 100.0 | 1.250 | 50.0 | 30.0 |"



# --- mix_order_kernels ------------------------------------------------------------------------

def kernel_meta_line(name: str, grid: str, loads: int) -> str:
    """One kernel's metadata line as TORCH_LOGS=output_code prints it, with the log's prefix."""
    return (f"V1202 23:56:23.036000 745 torch/_inductor/graph.py:2552] [0/0] [__output_code]     "
            f"inductor_meta={{'grid_type': '{grid}', 'autotune_hints': set(), 'kernel_name': '{name}', "
            f"'mutated_arg_names': [], 'num_load': {loads}, 'num_store': 2}}\n")


def kernel_event(name: str, us: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": 0.0, "dur": us}


def test_the_mix_order_kernels_are_listed_with_their_loads_calls_and_time(tmp_path, capsys):
    import gzip

    code = tmp_path / "code.log"
    code.write_text("def triton_per_fused_a(in_ptr0):\n"
                    + kernel_meta_line("triton_per_fused_a", "MixOrderReductionGrid", 29)
                    + kernel_meta_line("triton_per_fused_b", "MixOrderReductionGrid", 7)
                    + kernel_meta_line("triton_poi_fused_c", "Grid1D", 3)
                    + kernel_meta_line("triton_per_fused_unlaunched", "MixOrderReductionGrid", 5))
    # two profiled steps: a twice per step at 17 ms, b four times at 0.3 ms, c (not mix-order) once
    events = [kernel_event("triton_per_fused_a", 17_000.0) for _ in range(4)]
    events += [kernel_event("triton_per_fused_b", 300.0) for _ in range(8)]
    events += [kernel_event("triton_poi_fused_c", 5_000.0), {"ph": "X", "cat": "cuda_runtime", "name": "launch"}]
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = tmp_path / "mix.json"
    assert mix_order_kernels.main([str(code), str(trace), "--steps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and result["total_ms"] == pytest.approx(34.0 + 1.2)
    assert result["kernels"] == [
        {"name": "triton_per_fused_a", "loads": 29, "calls": 2, "ms": 34.0, "ms_per_call": 17.0},
        {"name": "triton_per_fused_b", "loads": 7, "calls": 4, "ms": 1.2, "ms_per_call": 0.3}]
    assert "2 mix-order kernels, 35.2 ms per step" in capsys.readouterr().out


def test_the_mix_order_listing_refuses_a_missing_or_bad_input_and_its_input_as_output(tmp_path, capsys):
    code, trace = tmp_path / "code.log", tmp_path / "trace.json"
    code.write_text("")
    assert mix_order_kernels.main([str(code), str(trace)]) == 1
    assert "trace.json: no such file" in capsys.readouterr().err
    trace.write_text('{"traceEvents": [')  # cut short
    assert mix_order_kernels.main([str(code), str(trace)]) == 1
    assert "trace.json: not a profiler's Chrome trace" in capsys.readouterr().err
    trace.write_text('{"traceEvents": []}')
    assert mix_order_kernels.main([str(code), str(trace), "--json", str(trace)]) == 1
    assert "--json" in capsys.readouterr().err and trace.read_text() == '{"traceEvents": []}'


# --- kernel_sources ---------------------------------------------------------------------------

def kernel_definition(name: str, nodes: str, aten: str, fragment: list[str], prefix: str = "") -> str:
    """A kernel's definition in Inductor's generated code, with the comment block above it."""
    lines = ["", "", f"# kernel path: /tmp/torchinductor/ab/{name}.py",
             f"# Topologically Sorted Source Nodes: [{nodes}], Original ATen: [{aten}]",
             "# Source node to ATen node mapping:", "#   x => mul_3", "# Graph fragment:",
             *[f"#   {text}" for text in fragment],
             f"{name} = async_compile.triton('{name}', '''", "import triton", "# a comment in the body",
             "@triton.jit", f"def {name}(in_ptr0, out_ptr0):", "    pass", "''', device_str='cuda')"]
    return "".join(f"{prefix}{line}\n" for line in lines)


def test_each_named_kernel_is_described_by_its_own_comment_block(tmp_path, capsys):
    prefix = "V1203 10:00:00.000000 745 torch/_inductor/graph.py:2552] [0/0] [__output_code] "
    mix = ['%mul_4 : Tensor "bf16[196608, 512][512, 1]cuda:0" = call_function[target=torch.ops.aten.mul.Tensor]',
           '%select_1 : Tensor "f32[512][1]cuda:0" = call_function[target=torch.ops.aten.select.int]']
    code = tmp_path / "code.log"
    code.write_text(kernel_definition("triton_poi_fused_mul_0", "mul, x0", "aten.mul, aten.select", mix, prefix)
                    + kernel_definition("triton_red_fused_sum_1", "sum_2", "aten.sum", ["%sum_2 : [num_users=1]"])
                    + "def call(args):\n    # Topologically Sorted Source Nodes: [launch], Original ATen: []\n"
                    + "    triton_poi_fused_mul_0.run(buf0, buf1)\n"
                    + kernel_definition("triton_poi_fused_mul_0", "mul_9", "aten.mul", []))
    out = tmp_path / "sources.json"
    assert kernel_sources.main([str(code), "triton_poi_fused_mul_0", "triton_missing", "--fragment-lines", "1",
                                "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "triton_poi_fused_mul_0 (1 of 2)\n  source nodes: mul, x0\n  aten: aten.mul, aten.select\n" in printed
    assert "triton_missing: not defined in this code" in printed and "select_1" not in printed  # one line shown
    result = json.loads(out.read_text())
    assert result["triton_missing"] == [] and len(result["triton_poi_fused_mul_0"]) == 2
    first, second = result["triton_poi_fused_mul_0"]
    assert first == {"source_nodes": ["mul", "x0"], "aten": ["aten.mul", "aten.select"], "fragment": mix[:1]}
    assert second == {"source_nodes": ["mul_9"], "aten": ["aten.mul"], "fragment": []}
    assert kernel_sources.kernel_sources(code.read_text().splitlines(), {"triton_red_fused_sum_1"}) == {
        "triton_red_fused_sum_1": [{"source_nodes": ["sum_2"], "aten": ["aten.sum"],
                                    "fragment": ["%sum_2 : [num_users=1]"]}]}


def test_the_kernel_sources_refuse_a_missing_input_and_their_input_as_output(tmp_path, capsys):
    code = tmp_path / "code.log"
    assert kernel_sources.main([str(code), "k"]) == 1
    assert "code.log: no such file" in capsys.readouterr().err
    code.write_text("k = async_compile.triton('k', '')\n")
    assert kernel_sources.main([str(code), "k", "--json", str(code)]) == 1
    assert "--json" in capsys.readouterr().err and code.read_text() == "k = async_compile.triton('k', '')\n"
    with pytest.raises(SystemExit) as info:
        kernel_sources.main([str(code), "k", "--fragment-lines", "-1"])
    assert info.value.code == 2


def test_the_fills_bench_calls_each_product_of_a_layer_at_its_shape_the_ways_agreeing():
    import product_fills

    shapes = product_fills.products(4096, "cpu")
    got = {name: tuple(product_fills.way_call("mm", a, b)().shape) for name, (a, b) in shapes.items()}
    assert got == {"qkv": (4096, 1024), "out": (4096, 512), "down": (4096, 512), "down_dx": (4096, 1536),
                   "up_dw": (1536, 512)}  # the record model: 512 wide, 4 key heads of 64, an MLP of 1,536
    a, b = shapes["qkv"]
    assert not b.is_contiguous()  # the weight's transpose, a view, as the step passes it
    assert torch.equal(product_fills.way_call("mm_out", a, b)(), a @ b)


@pytest.mark.parametrize("argv, message", [
    (["--positions", "3000"], "--positions must be a positive multiple of 2048"),
    (["--repeats", "0"], "--repeats must be positive"),
])
def test_the_one_pass_benches_check_their_arguments(argv, message, monkeypatch):
    """bench/one_pass.py, shared by bench/head_kernels_speed.py and bench/fa4_gqa_speed.py:
    a wrong argument is one line (the GPU taken as present, so the argument is checked)."""
    import one_pass

    monkeypatch.setattr(one_pass.torch.cuda, "is_available", lambda: True)
    args = one_pass.pass_parser("a bench").parse_args(argv)
    with pytest.raises(SystemExit, match=message):
        one_pass.check_pass_args(args, "a bench")
    args = one_pass.pass_parser("a bench").parse_args([])
    one_pass.check_pass_args(args, "a bench")
    assert (args.positions, args.repeats, args.json) == (196_608, 20, None)


def test_the_head_kernels_bench_reads_its_launch_shapes_and_names_them_back():
    """bench/head_kernels_speed.py's --launches: POSITIONSxWARPS, an s after it for the
    forward's rotated channels apart; each shape named back as it was given; a wrong one is
    one line."""
    import head_kernels_speed as bench
    from windowgpt_cli.kernels.elementwise import HeadLaunch

    assert bench.parse_launches("16x4,32x8,16x4s") == [HeadLaunch(16, 4), HeadLaunch(32, 8),
                                                       HeadLaunch(16, 4, rotated_apart=True)]
    assert ",".join(launch.name for launch in bench.parse_launches(bench.DEFAULT_LAUNCHES)) == bench.DEFAULT_LAUNCHES
    for wrong in ("16x3", "12x4", "16x4q", "16x4p", "x4", "16x4ss", "s16x4"):
        with pytest.raises(SystemExit, match="is not POSITIONSxWARPS"):
            bench.parse_launches(wrong)


def test_a_pass_draws_the_same_bf16_inputs_for_the_same_positions():
    """bench/one_pass.pass_randn, the FA4 benches' inputs: [batch, 2,048, *shape] bfloat16,
    the same numbers for the same positions, others for others."""
    import torch

    import one_pass

    first, again = one_pass.pass_randn(4096, "cpu"), one_pass.pass_randn(4096, "cpu")
    q = first(3, 8)
    assert q.shape == (2, 2048, 3, 8) and q.dtype == torch.bfloat16
    assert torch.equal(q, again(3, 8)) and not torch.equal(first(3, 8), q)
    assert not torch.equal(one_pass.pass_randn(2048, "cpu")(3, 8), q[:1])


def test_the_one_pass_report_prints_and_writes_the_same_object(tmp_path, capsys):
    import one_pass

    one_pass.report({"gpu": "X", "ms": 1.5}, tmp_path / "r.json")
    assert json.loads(capsys.readouterr().out) == json.loads((tmp_path / "r.json").read_text()) == {"gpu": "X",
                                                                                                   "ms": 1.5}


# --- fa4_backward_tiles ---------------------------------------------------------------------

@dataclasses.dataclass
class _Tiles:
    m_block_size: int = 128
    n_block_size: int = 128
    AtomLayoutMdQ: int = 2


def _fake_interface():
    return types.SimpleNamespace(_tile_size_bwd_sm90=lambda head_dim, head_dim_v, causal, local: _Tiles())


def test_the_backward_tiles_change_fa4s_choice_inside_the_block_only():
    import fa4_backward_tiles

    interface = _fake_interface()
    with fa4_backward_tiles.chosen_tiles(interface, "_tile_size_bwd_sm90", {"m_block_size": 64, "AtomLayoutMdQ": 1}):
        assert interface._tile_size_bwd_sm90(64, 64, True, False) == _Tiles(64, 128, 1)
    assert interface._tile_size_bwd_sm90(64, 64, True, False) == _Tiles()
    with pytest.raises(RuntimeError), fa4_backward_tiles.chosen_tiles(interface, "_tile_size_bwd_sm90",
                                                                      {"n_block_size": 64}):
        raise RuntimeError("a candidate FA4 cannot build")
    assert interface._tile_size_bwd_sm90(64, 64, True, False) == _Tiles()


def test_a_candidate_naming_a_field_fa4_lacks_is_refused_before_anything_runs():
    import fa4_backward_tiles

    fa4_backward_tiles.check_candidates(_Tiles, {"fa4": {}, "m64": {"m_block_size": 64}})
    with pytest.raises(SystemExit, match="candidate odd: num_stages_PdS not in FA4's _Tiles"):
        fa4_backward_tiles.check_candidates(_Tiles, {"odd": {"num_stages_PdS": 1}})


def test_the_best_tiles_are_the_fastest_whose_gradients_match():
    import torch

    import fa4_backward_tiles

    want = (torch.tensor([1.0, -4.0]), torch.tensor([2.0]))
    assert fa4_backward_tiles.gradient_difference(want, (torch.tensor([1.0, -3.9]), torch.tensor([2.0]))) \
        == pytest.approx(0.025)
    figures = {"fa4": {"backward_ms": 3.0, "gradient_difference": 0.0},
               "fast_but_wrong": {"backward_ms": 1.0, "gradient_difference": 0.5},
               "broken": {"error": "RuntimeError: no"},
               "faster": {"backward_ms": 2.5, "gradient_difference": 0.004}}
    assert fa4_backward_tiles.fastest_matching(figures) == "faster"
    assert fa4_backward_tiles.fastest_matching({"broken": {"error": "x"}}) is None


def test_the_forward_bench_changes_fa4s_forward_choice_and_picks_by_forward_time():
    import fa4_backward_tiles
    import fa4_forward_tiles

    interface = types.SimpleNamespace(_tile_size_fwd_sm90=lambda head_dim, head_dim_v, causal, local: _Tiles(192))
    with fa4_backward_tiles.chosen_tiles(interface, "_tile_size_fwd_sm90", fa4_forward_tiles.CANDIDATES["m128"]):
        assert interface._tile_size_fwd_sm90(64, 64, True, True) == _Tiles(128)
    assert interface._tile_size_fwd_sm90(64, 64, True, True) == _Tiles(192)
    figures = {"fa4": {"forward_ms": 1.2, "output_difference": 0.0},
               "m128": {"forward_ms": 1.0, "output_difference": 0.001},
               "n64": {"forward_ms": 0.5, "output_difference": 0.3}}
    assert fa4_backward_tiles.fastest_matching(figures, "forward_ms", "output_difference") == "m128"


def test_each_candidate_is_timed_under_its_tiles_and_checked_against_fa4s_own(monkeypatch):
    """time_candidates: the call runs under each candidate's tiles; one that fails is its error's
    line, one whose results differ does not count as best."""
    import torch

    import fa4_backward_tiles

    interface = _fake_interface()
    times = {128: 2.0, 64: 1.0, 32: 0.5}

    def call():
        tiles = interface._tile_size_bwd_sm90(64, 64, True, False)
        if tiles.n_block_size == 96:
            raise RuntimeError("\x1b[91mno such tiles\x1b[0m\nmore")
        return (torch.tensor([1.0, 2.0 if tiles.m_block_size != 32 else 3.0]),)

    monkeypatch.setattr(fa4_backward_tiles, "milliseconds",
                        lambda fn, repeats: times[interface._tile_size_bwd_sm90(64, 64, True, False).m_block_size])
    result = fa4_backward_tiles.time_candidates(
        interface, "_tile_size_bwd_sm90", {"own": {}, "m64": {"m_block_size": 64}, "m32": {"m_block_size": 32},
                                           "n96": {"n_block_size": 96}}, call, repeats=3)
    assert result["candidates"] == {"own": {"backward_ms": 2.0, "gradient_difference": 0.0},
                                    "m64": {"backward_ms": 1.0, "gradient_difference": 0.0},
                                    "m32": {"backward_ms": 0.5, "gradient_difference": 0.5},
                                    "n96": {"error": "RuntimeError: no such tiles"}}
    assert result["best"] == "m64" and interface._tile_size_bwd_sm90(64, 64, True, False) == _Tiles()


def test_a_candidates_error_is_its_first_line_without_terminal_colours():
    import one_pass

    error = RuntimeError("\x1b[91m\x1b[1merror[CUDA_LAUNCH_INVALID_CONFIG]:\x1b[0m launch failed\nmore detail")
    assert one_pass.error_line(error) == "RuntimeError: error[CUDA_LAUNCH_INVALID_CONFIG]: launch failed"
    assert one_pass.error_line(AssertionError()) == "AssertionError: "


def test_the_epilogues_permuted_product_gives_the_models_queries_and_keys_back():
    """bench/qkv_epilogue_speed.py's layout, in torch: the q and k rows permuted within each
    head, the columns scaled and adjacent pairs turned as the epilogue does, then put back in
    the model's order, give the model's heads' steps (norm, rotation, gain) and the values as
    they were."""
    import torch

    import qkv_epilogue_speed as bench
    from windowgpt_cli.model.ops import TORCH_OPS
    from windowgpt_cli.model.rotary import rotary_inv_freq, rotary_tables

    heads, kv_heads, head_dim, rope_dims, t = 4, 2, 16, 8, 12
    g = torch.Generator().manual_seed(3)
    pre = torch.randn(2 * t, (heads + 2 * kv_heads) * head_dim, generator=g)
    gain = torch.rand(heads, generator=g) + 0.5
    inv_freq = rotary_inv_freq(rope_dims, 10000.0, t, t)
    cos, sin = rotary_tables(t, inv_freq)
    q_width, k_width = heads * head_dim, kv_heads * head_dim
    want_q = TORCH_OPS.head_prep(pre[:, :q_width].view(2, t, heads, head_dim), cos, sin, rope_dims, gain)
    want_k = TORCH_OPS.head_prep(pre[:, q_width:q_width + k_width].view(2, t, kv_heads, head_dim), cos, sin,
                                 rope_dims, None)
    rows = bench.interleaved_rows(heads + kv_heads, head_dim, rope_dims // 2)
    assert sorted(rows.tolist()) == list(range(q_width + k_width)) and rows[:2].tolist() == [rope_dims // 2, 0]
    a, b = bench.column_scales(gain, kv_heads, head_dim)
    frequencies = bench.pair_frequencies(inv_freq, heads, kv_heads, head_dim)
    permuted = torch.cat((pre[:, rows], pre[:, q_width + k_width:]), 1)
    got = bench.model_order(bench.epilogue_reference(permuted, torch.arange(2 * t) % t, frequencies, a, b, head_dim),
                            rows)
    assert torch.allclose(got[:, :q_width], want_q.reshape(2 * t, -1), atol=1e-5)
    assert torch.allclose(got[:, q_width:q_width + k_width], want_k.reshape(2 * t, -1), atol=1e-5)
    assert torch.allclose(got[:, q_width + k_width:], pre[:, q_width + k_width:], atol=1e-6)
    wrong = bench.model_order(bench.epilogue_reference(permuted, torch.arange(2 * t) % t, -frequencies, a, b,
                                                       head_dim), rows)
    assert not torch.allclose(wrong[:, :q_width], want_q.reshape(2 * t, -1), atol=1e-3)  # the turn's sense matters
