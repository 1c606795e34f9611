"""Where one training step's GPU time goes, on one GPU, by category.

    python3 bench/train_profile.py --data DATA_DIR [--record] [--steps 3] [--timed-steps 10]
        [--json PATH] [--trace PATH] [--top 3] [--gaps 0] [--blas-library cublaslt]
        [--inductor-setting NAME=VALUE ...] [any `windowgpt train` setting: --train-batch-tokens 131072,
        --window-attn-size 512, --attn-backend flex, --warmup-steps 20, ...]

Builds the run as `windowgpt train` does (training.build_setup and Trainer, the same flags;
--record adds the record model's windows: 512 tokens with 4 sink tokens on layers
2,4,6,8,10), runs the warm-up (compilation), times --timed-steps steps without the profiler
(the step's wall time), then runs torch.profiler over --steps steps. Each GPU kernel is
attributed to the step phase (training.PHASES: data, forward, backward, grad_clip,
grad_sync, adam, muon, ema) during which it was launched, and put in a category by
`classify`: the phase decides for the optimizer, EMA, clipping and data phases (so
Newton-Schulz's matrix products count as Muon), the kernel's name for forward and backward.

Prints, per step: each category's GPU time (ms and % of the step's wall time), the
kernels' summed time, the GPU's busy time (the union of its kernels' intervals: streams may
overlap) and the host gaps (wall time minus busy time), then the --top longest kernels of
each category with their calls per step. --gaps N lists the N longest stretches the GPU sat
idle, each with the activities around it, the phase the next one was launched in, how long
after its launch it began (near zero: the GPU waited for the host) and the longest host
runtime call meanwhile (a synchronization shows there), and sums the idle time by that
phase. --blas-library and --inductor-setting (repeatable: `combo_kernels=True`) change a
process-wide setting of torch's for the run, for settings windowgpt does not expose.
--json PATH writes the same as JSON; --trace PATH
keeps the profiler's Chrome trace (open it in Perfetto). Run it on one GPU
(CUDA_VISIBLE_DEVICES=0); the communication category is then empty.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Optional

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from windowgpt_cli.cli.support import (PresetOption, build_config, option_help, run_app, user_errors_exit_1,
                                       with_config_flags)
from windowgpt_cli.challenge import RECORD_WINDOWS  # noqa: E402
from windowgpt_cli.config import apply_overrides  # noqa: E402
from windowgpt_cli.train.trainer import PHASES  # noqa: E402

STEP_RANGE = "bench.step"  # the profiler range around each profiled step

# Categories, in the order the table lists them.
CATEGORIES = {
    "matmul": "matrix products (forward and backward)",
    "attention_fwd": "attention forward",
    "attention_bwd": "attention backward",
    "elementwise_norm": "element-wise, norm and reduction kernels",
    "cross_entropy": "cross-entropy",
    "grad_clip": "gradient clipping",
    "muon": "Muon (Newton-Schulz and update)",
    "adamw": "AdamW",
    "ema": "EMA",
    "data_h2d": "data loading / H2D copies",
    "communication": "communication (NCCL)",
    "other": "other kernels",
}
HOST_GAPS = "host_gaps"

# Phases whose kernels all belong to one category, whatever their names.
PHASE_CATEGORIES = {PHASES.data: "data_h2d", PHASES.grad_clip: "grad_clip", PHASES.grad_sync: "communication",
                    PHASES.adam: "adamw", PHASES.muon: "muon", PHASES.ema: "ema"}

ATTENTION = re.compile(r"flash|fmha|flex|attention|sdpa|triton_tem_(?!.*mm)", re.I)
# windowgpt's fused products (`_..._matmul_kernel`: a product with an element-wise epilogue)
# count as matrix products.
MATMUL = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|splitk|triton_tem_.*mm|^_\w+_matmul_kernel$", re.I)
CROSS_ENTROPY = re.compile(r"cross_entropy|nll_loss|log_softmax|logsumexp", re.I)
# Inductor's fused kernels, ATen's element-wise and reduction kernels, and windowgpt's own
# Triton kernels (named after their Python functions, all element-wise or norm fusions).
ELEMENTWISE = re.compile(r"triton_|elementwise|reduce|vectorized|norm|softmax|fill|copy|cat|index|embed|"
                         r"foreach|multi_tensor|scatter|gather|^_\w+_kernel$", re.I)


def classify(name: str, phase: str | None, kind: str = "kernel") -> str:
    """The category of a GPU activity: `name` as the profiler shows it, `phase` the step
    phase it was launched in (None: outside any), `kind` kernel, memcpy or memset."""
    if "nccl" in name.lower():
        return "communication"
    if kind == "memcpy" and "htod" in name.lower():
        return "data_h2d"
    if phase in PHASE_CATEGORIES:
        return PHASE_CATEGORIES[phase]
    if ATTENTION.search(name):
        backward = phase == PHASES.backward or re.search(r"bwd|backward|bprop", name, re.I)
        return "attention_bwd" if backward else "attention_fwd"
    if MATMUL.search(name):
        return "matmul"
    if CROSS_ENTROPY.search(name):
        return "cross_entropy"
    if kind != "kernel" or ELEMENTWISE.search(name):
        return "elementwise_norm"
    return "other"


# --- the Chrome trace torch.profiler exports -------------------------------------------

DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}


@dataclass(frozen=True)
class Activity:
    """One GPU kernel, copy or fill: when it ran and when the host launched it (µs)."""

    name: str
    kind: str
    start: float
    duration: float
    launched: float


def device_activities(events: list[dict[str, Any]]) -> list[Activity]:
    """The trace's GPU activities, each with its launch time (its own start when the
    launching call is missing from the trace)."""
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    found = []
    for e in events:
        kind = DEVICE_KINDS.get(e.get("cat", ""))
        if kind is None or e.get("ph") != "X":
            continue
        start = float(e["ts"])
        found.append(Activity(e["name"], kind, start, float(e.get("dur", 0.0)),
                              launches.get(e.get("args", {}).get("correlation"), start)))
    return found


def ranges(events: list[dict[str, Any]], names: Iterable[str]) -> list[tuple[float, float, str]]:
    """(start, end, name) of the host's profiler ranges with one of these names, by start."""
    wanted = set(names)
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in wanted)


def range_at(spans: list[tuple[float, float, str]], starts: list[float], t: float) -> str | None:
    """The name of the (non-overlapping, sorted) range holding time t, or None."""
    i = bisect.bisect_right(starts, t) - 1
    return spans[i][2] if i >= 0 and t <= spans[i][1] else None


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def breakdown(events: list[dict[str, Any]], step_wall_ms: float, top: int = 3) -> dict[str, Any]:
    """Per step: each category's GPU time, the busy time and the host gaps, from a trace of
    whole steps (each inside a STEP_RANGE range), and the longest kernels per category."""
    steps = ranges(events, [STEP_RANGE])
    if not steps:
        raise SystemExit(f"the trace holds no {STEP_RANGE!r} range: nothing to break down")
    phases = ranges(events, dataclasses.astuple(PHASES))
    phase_starts, step_starts = [p[0] for p in phases], [s[0] for s in steps]
    per_category: dict[str, float] = defaultdict(float)
    per_kernel: dict[tuple[str, str], float] = defaultdict(float)
    launches: dict[tuple[str, str], int] = defaultdict(int)
    intervals = []
    for a in device_activities(events):
        if range_at(steps, step_starts, a.launched) is None:
            continue
        category = classify(a.name, range_at(phases, phase_starts, a.launched), a.kind)
        per_category[category] += a.duration
        per_kernel[(category, a.name)] += a.duration
        launches[(category, a.name)] += 1
        intervals.append((a.start, a.start + a.duration))
    n = len(steps)
    busy_ms = busy_time(intervals) / 1000.0 / n
    categories = {c: round(per_category.get(c, 0.0) / 1000.0 / n, 3) for c in CATEGORIES}
    categories[HOST_GAPS] = round(max(step_wall_ms - busy_ms, 0.0), 3)
    longest: dict[str, list[list[Any]]] = defaultdict(list)
    for (category, name), us in sorted(per_kernel.items(), key=lambda item: -item[1]):
        if len(longest[category]) < top:  # a long time over few calls marks a slow kernel
            longest[category].append([name, round(us / 1000.0 / n, 3), launches[(category, name)] / n])
    return {"steps_profiled": n, "step_wall_ms": round(step_wall_ms, 3), "gpu_busy_ms": round(busy_ms, 3),
            "kernel_sum_ms": round(sum(per_category.values()) / 1000.0 / n, 3),
            "categories_ms": categories, "top_kernels": dict(longest)}


def idle_stretches(events: list[dict[str, Any]], count: int) -> dict[str, Any]:
    """Where the profiled steps' GPU sat idle: per step, its activities by kind and the idle
    time between them; the idle time per step by the phase the activity ending each stretch
    was launched in; and the `count` longest stretches (µs)."""
    steps = ranges(events, [STEP_RANGE])
    phases = ranges(events, dataclasses.astuple(PHASES))
    phase_starts, step_starts = [p[0] for p in phases], [s[0] for s in steps]
    per_step: list[list[Activity]] = [[] for _ in steps]
    for a in device_activities(events):
        if range_at(steps, step_starts, a.launched) is not None:
            per_step[bisect.bisect_right(step_starts, a.launched) - 1].append(a)
    stretches, by_phase, each_step = [], defaultdict(float), []
    last, end = None, float("-inf")  # a step's idle starts where the step before left the GPU
    for activities in per_step:
        activities.sort(key=lambda a: a.start)
        idle = 0.0
        for a in activities:
            if last is not None and a.start > end:
                phase = range_at(phases, phase_starts, a.launched) or "outside"
                by_phase[phase] += a.start - end
                idle += a.start - end
                stretches.append((end, a.start, last, a, phase))
            if a.start + a.duration > end:
                last, end = a, a.start + a.duration
        kinds = Counter(a.kind for a in activities)
        each_step.append({"idle_ms": round(idle / 1000.0, 3), "activities": len(activities),
                          **dict(sorted(kinds.items()))})
    stretches.sort(key=lambda g: g[0] - g[1])
    host_calls = sorted((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]) for e in events
                        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES)
    n = max(len(steps), 1)
    return {"steps": each_step,
            "idle_by_phase_ms": {k: round(v / 1000.0 / n, 3) for k, v in sorted(by_phase.items(), key=lambda i: -i[1])},
            "longest_idle": [{"idle_us": round(hi - lo, 1), "before": before.name[:80], "after": after.name[:80],
                              "after_phase": phase, "after_launch_lag_us": round(after.start - after.launched, 1),
                              "longest_host_call": _longest_call(host_calls, lo, hi)}
                             for lo, hi, before, after, phase in stretches[:count]]}


def _longest_call(calls: list[tuple[float, float, str]], lo: float, hi: float) -> list[Any]:
    """[name, µs] of the longest host runtime call (start, duration, name) overlapping [lo, hi]."""
    best: list[Any] = ["", 0.0]
    for ts, dur, name in calls:
        if ts <= hi and ts + dur >= lo and dur > best[1]:
            best = [name, round(dur, 1)]
    return best


def table(result: dict[str, Any]) -> str:
    wall = result["step_wall_ms"]
    share = (lambda ms: f"{100.0 * ms / wall:5.1f}%") if wall > 0 else (lambda ms: "    -")
    labels = {**CATEGORIES, HOST_GAPS: "host gaps (wall - GPU busy)"}
    lines = [f"{'category':<44} {'ms/step':>9} {'% step':>7}"]
    for category, ms in result["categories_ms"].items():
        lines.append(f"{labels[category]:<44} {ms:9.2f} {share(ms):>7}")
    lines += [f"{'step wall time (without the profiler)':<44} {wall:9.2f}",
              f"{'GPU busy (union of kernels)':<44} {result['gpu_busy_ms']:9.2f} {share(result['gpu_busy_ms']):>7}",
              f"{'kernels summed':<44} {result['kernel_sum_ms']:9.2f}"]
    for category, kernels in result["top_kernels"].items():
        lines.append(f"{category}:")
        lines += [f"  {kernel[1]:8.3f} ms{_calls(kernel)}  {kernel[0][:100]}" for kernel in kernels]
    if "idle" in result:
        lines += idle_lines(result["idle"])
    return "\n".join(lines)


def idle_lines(idle: dict[str, Any]) -> list[str]:
    """`idle_stretches`' result as lines of text."""
    lines = ["GPU idle by step: " + ", ".join(f"{step['idle_ms']:.3f} ms among {step['activities']} activities"
                                              for step in idle["steps"]),
             "GPU idle per step by the phase that ended it: "
             + ", ".join(f"{phase} {ms:.3f} ms" for phase, ms in idle["idle_by_phase_ms"].items())]
    lines += [f"  {g['idle_us']:8.1f} us idle before {g['after'][:40]} ({g['after_phase']}, began "
              f"{g['after_launch_lag_us']:.1f} us after its launch; after {g['before'][:40]}; longest host "
              f"call {g['longest_host_call'][0]} {g['longest_host_call'][1]:.1f} us)" for g in idle["longest_idle"]]
    return lines


def _calls(kernel: list[Any]) -> str:
    """ " in N calls" for a top kernel [name, ms, calls per step] (profiles written before
    the count have none)."""
    return f" in {kernel[2]:g} calls" if len(kernel) > 2 else ""


# --- the run -----------------------------------------------------------------------------

BLAS_LIBRARIES = ("default", "cublas", "cublaslt")


def inductor_settings(texts: list[str]) -> dict[str, Any]:
    """NAME=VALUE pairs as Inductor's settings (VALUE a Python literal: True, 4, "name"); each
    NAME must be one of this torch's (a section's as "section.name")."""
    import ast

    from windowgpt_cli.runtime import inductor_has

    settings = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not inductor_has(name.strip()):
            raise typer.BadParameter(f"{text!r}: not NAME=VALUE with NAME one of this torch's Inductor settings")
        try:
            settings[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise typer.BadParameter(f"{text!r}: the value is not a Python literal (True, 4, 'name')") from None
    return settings


def apply_torch_settings(blas_library: str, inductor: dict[str, Any]) -> None:
    """Process-wide: the BLAS library of torch's products and Inductor's settings."""
    import torch
    import torch._inductor.config as inductor_config

    if blas_library != "default":
        torch.backends.cuda.preferred_blas_library(blas_library)
    for name, value in inductor.items():
        *sections, last = name.split(".")
        owner = inductor_config
        for section in sections:
            owner = getattr(owner, section)
        setattr(owner, last, value)


def peak_memory_gib(device) -> float:
    """The most memory the run's tensors held at once (0 off CUDA)."""
    import torch

    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else 0.0


def profile_training(cfg, steps: int, timed_steps: int, trace: Path) -> tuple[float, dict[str, Any]]:
    """Warm up, time `timed_steps` steps, profile `steps` more into `trace`; the wall time
    per step and a description of the run."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from windowgpt_cli.data.loader import Prefetcher
    from windowgpt_cli.distributed import init_distributed, shutdown
    from windowgpt_cli.runtime import device_name, synchronize
    from windowgpt_cli.train.trainer import RunLog, Trainer, build_setup

    ctx = init_distributed(cfg.train.device)
    try:
        setup = build_setup(cfg, ctx)
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(setup, Path(run_dir), RunLog(Path(run_dir), enabled=False))
            t0 = time.perf_counter()
            trainer.warm_up()
            synchronize(ctx.device)
            warm_up_s = time.perf_counter() - t0
            t = cfg.train
            prefetcher = Prefetcher(trainer.stream, t.train_batch_tokens, setup.seq_len, setup.grad_accum_steps,
                                    ctx.device, per_pass=setup.micro_batches_per_pass)
            try:
                trainer.train_step(prefetcher.next, 1.0)  # the loop's first step (EMA's first update)
                synchronize(ctx.device)
                t0 = time.perf_counter()
                for _ in range(timed_steps):
                    trainer.train_step(prefetcher.next, 1.0)
                synchronize(ctx.device)
                wall_ms = 1000.0 * (time.perf_counter() - t0) / max(timed_steps, 1)
                print(f"warm-up {warm_up_s:.1f} s; step {wall_ms:.1f} ms over {timed_steps} steps; profiling",
                      flush=True)
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
                with profile(activities=activities) as prof:
                    for _ in range(steps):
                        with record_function(STEP_RANGE):
                            trainer.train_step(prefetcher.next, 1.0)
                    synchronize(ctx.device)
            finally:
                prefetcher.close()
        if ctx.is_main:
            prof.export_chrome_trace(str(trace))
        m = cfg.model
        about = {"gpu": device_name(ctx.device), "train_batch_tokens": t.train_batch_tokens,
                 "train_seq_len": t.train_seq_len, "grad_accum_steps": setup.grad_accum_steps,
                 "micro_batches_per_pass": setup.micro_batches_per_pass,
                 "window_attn_size": m.window_attn_size, "num_sink_tokens": m.num_sink_tokens,
                 "window_attn_layers": list(m.window_attn_layers) if m.window_attn_size else [],
                 "attn_backend": setup.model.blocks[0].attn.backend, "warm_up_s": round(warm_up_s, 1),
                 "timed_steps": timed_steps, "peak_memory_gib": round(peak_memory_gib(ctx.device), 2)}
        return wall_ms, about
    finally:
        shutdown()


@user_errors_exit_1
@with_config_flags("model", "optim", "train")
def command(
    data: Annotated[Path, typer.Option("--data", help="Directory of shards (with its manifest).")],
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help=option_help(
        "SentencePiece model.", "DATA/tokenizer.model"))] = None,
    preset_name: PresetOption = None,
    record: Annotated[bool, typer.Option("--record", help="The record model: windows of 512 tokens with 4 sink "
                                         "tokens on layers 2,4,6,8,10 (flags given win).")] = False,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps to profile.")] = 3,
    timed_steps: Annotated[int, typer.Option("--timed-steps", min=1, help="Steps timed without the profiler.")] = 10,
    top: Annotated[int, typer.Option("--top", min=0, help="Longest kernels listed per category.")] = 3,
    gaps: Annotated[int, typer.Option("--gaps", min=0, help="Longest stretches of GPU idle time listed.")] = 0,
    blas_library: Annotated[str, typer.Option("--blas-library", help=f"torch's BLAS library for the products: "
                                              f"{', '.join(BLAS_LIBRARIES)}.")] = "default",
    inductor_setting: Annotated[Optional[list[str]], typer.Option(
        "--inductor-setting", help="NAME=VALUE: one of Inductor's settings for the run (repeatable).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the result as JSON here.")] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Keep the profiler's Chrome trace here.")] = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Break one training step's GPU time down by category."""
    base = build_config(None, preset_name, {"model": dict(RECORD_WINDOWS)} if record else {})
    paths = {"data_path": str(data), **({"tokenizer_path": str(tokenizer)} if tokenizer else {})}
    cfg = apply_overrides(base, {**(overrides or {}), "data": paths}).resolved()
    if blas_library not in BLAS_LIBRARIES:
        raise typer.BadParameter(f"{blas_library!r}: one of {', '.join(BLAS_LIBRARIES)}", param_hint="--blas-library")
    apply_torch_settings(blas_library, inductor_settings(inductor_setting or []))
    with tempfile.TemporaryDirectory() as scratch:
        trace_path = trace or Path(scratch) / "trace.json"
        wall_ms, about = profile_training(cfg, steps, timed_steps, trace_path)
        if not trace_path.is_file():  # not the first rank
            return
        events = json.loads(trace_path.read_text())["traceEvents"]
    result = {**about, **breakdown(events, wall_ms, top)}
    if gaps:
        result["idle"] = idle_stretches(events, gaps)
    print(f"{about['gpu']}: {about['train_batch_tokens']:,} tokens/step, window {about['window_attn_size']} "
          f"on layers {about['window_attn_layers']}, attention {about['attn_backend']}, "
          f"warm-up {about['warm_up_s']} s, peak memory {about['peak_memory_gib']} GiB")
    print(table(result))
    if json_path is not None:
        from windowgpt_cli.storage.files import atomic_write_json

        atomic_write_json(json_path, result)
        print(f"wrote {json_path}")


app = typer.Typer(add_completion=False)
app.command()(command)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
