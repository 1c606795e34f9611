"""`windowgpt train`: train (or resume) a run directory, with checkpoints and exact resume.

One process writes to a run at a time (RUN/.lock). A new run refuses a directory that holds
one unless `force`; resuming a finished run changes nothing. The run directory's files are
named in `artifacts.checkpoint`.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from ..artifacts.checkpoint import FILENAME as CHECKPOINT_FILENAME
from ..artifacts.checkpoint import (
    KEPT_PATTERN,
    RUN_CONFIG,
    RUN_FILES,
    SUMMARY,
    checkpoint_path,
    is_run_dir,
    load_checkpoint,
)
from ..config import RunConfig, parameter_estimate
from ..distributed import init_distributed, shutdown
from ..errors import ArtifactError, ConfigError, DataError, OutputRefused
from ..model.attention import resolve_backend
from ..runtime import out_of_memory_as_error, resolve_device, use_cpu_threads
from ..storage.compile_cache import FLAG as COMPILE_CACHE_FLAG
from ..storage.compile_cache import claim_compile_cache, load_compile_cache, save_compile_cache
from ..storage.files import atomic_write_json
from ..storage.outputs import check_apart, claim_dir
from ..storage.runlock import run_lock
from ..timing import Phases, compile_line, compile_seconds, compiled_graphs
from .metric_sinks import check_logger, open_sink
from .trainer import RunLog, StopRequests, Trainer, TrainResult, build_setup, describe

Echo = Callable[[str], None]
StepProgress = Callable[[dict], None]
# What shows training's progress: given the planned steps and the log's echo, a context
# that yields the echo to use meanwhile and a callback for each step (or None).
ProgressDisplay = Callable[[int, Echo], ContextManager[tuple[Echo, StepProgress | None]]]



# What one CPU thread sustains training a small model, in FLOP/s (the tiny preset: 1.0 s a
# step of 8,192 tokens and 224k parameters on one core of a 2-core machine).
CPU_FLOPS_PER_THREAD = 1.1e10
SLOW_CPU_STEP_SECONDS = 30.0


def check_requirements(cfg: RunConfig) -> None:
    """What the settings need beyond the core dependencies (a logger's extra, an attention
    backend's package or device), checked before anything is written or trained."""
    check_logger(cfg.train.logger)
    resolve_backend(cfg.train.attn_backend, resolve_device(cfg.train.device), training=True)


def cpu_slowness(cfg: RunConfig) -> str | None:
    """Where the run would train on the CPU for minutes a step: a line saying roughly how
    slow (6 FLOPs per parameter and token), and what to train instead."""
    if resolve_device(cfg.train.device).type != "cpu":
        return None
    threads = cfg.train.cpu_threads or torch.get_num_threads()
    params = parameter_estimate(cfg.model)
    seconds = 6 * params * cfg.train.train_batch_tokens / (CPU_FLOPS_PER_THREAD * threads)
    if seconds < SLOW_CPU_STEP_SECONDS:
        return None
    return (f"training {params / 1e6:.1f}M parameters on {cfg.train.train_batch_tokens:,} tokens a step on the CPU "
            f"({threads} thread{'s' * (threads != 1)}) takes roughly {_duration(seconds)} a step, "
            f"{cfg.train.iterations:,} steps planned; for a model that trains here in about a minute: --preset tiny")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


@dataclass
class TrainReport:
    result: TrainResult
    record: dict[str, Any] | None  # summary.json's record: the first rank's, of a finished run
    is_main: bool  # rank 0 (only it prints)


def train(cfg: RunConfig, out_dir: Path, *, resume: bool = False, force: bool = False,
          stop_at_step: int | None = None, progress: ProgressDisplay | None = None,
          echo: Echo | None = None, compile_cache: Path | None = None) -> TrainResult:
    """Train (or resume) into out_dir: config.json, train.log, metrics.jsonl, checkpoint.pt,
    and summary.json when it finishes. echo receives the log lines (default: stdout)."""
    return train_and_report(cfg, out_dir, resume=resume, force=force, stop_at_step=stop_at_step,
                            progress=progress, echo=echo, compile_cache=compile_cache).result


def train_and_report(cfg: RunConfig, out_dir: Path, *, resume: bool = False, force: bool = False,
                     stop_at_step: int | None = None, progress: ProgressDisplay | None = None,
                     echo: Echo | None = None, compile_cache: Path | None = None) -> TrainReport:
    """train(), with what the command prints. `progress` shows the steps on the first rank.

    One process writes to a run at a time (RUN/.lock). A new run refuses a directory that
    holds one unless `force` (the old run's files are removed first); resuming a finished
    run changes nothing. `compile_cache` names a file of torch.compile's caches, loaded
    before the first step and written (by the first rank) after the warm-up and at the end.
    """
    phases = Phases()
    echo = echo or (lambda line: print(line, flush=True))
    out_dir = Path(out_dir)
    if resume and force:
        raise ConfigError("--resume continues a run and --force replaces it: give one of them")
    if out_dir.exists() and not out_dir.is_dir():
        raise ArtifactError(f"{out_dir}: exists and is not a directory")
    cfg = cfg.resolved()
    inputs = [Path(p) if p else None for p in (cfg.data.data_path, cfg.data.tokenizer_path,
                                               cfg.data.tokenizer_meta_path)]
    check_apart(out_dir, inputs)
    if compile_cache is not None:
        _check_compile_cache_path(Path(compile_cache), inputs, out_dir)
    if not resume:
        claim_dir(out_dir, "a training run", is_run_dir)  # before the directory is touched (and again, locked)
    check_requirements(cfg)
    ctx = init_distributed(cfg.train.device)
    use_cpu_threads(cfg.train.cpu_threads, ctx.device)
    created = not out_dir.exists()
    try:
        with run_lock(out_dir) if ctx.is_main else contextlib.nullcontext():
            try:
                if ctx.is_main:  # under the lock; the other ranks only read what it leaves
                    ckpt = _claim_run_dir(out_dir, resume, force, echo)
                else:
                    ckpt = load_checkpoint(out_dir) if resume else None
                if ckpt is not None and (out_dir / SUMMARY).is_file():
                    if ctx.is_main:
                        echo(f"{out_dir}: the run finished at step {ckpt.step}; nothing to do")
                    record = json.loads((out_dir / SUMMARY).read_text(encoding="utf-8")) if ctx.is_main else None
                    return TrainReport(TrainResult(ckpt.step, ckpt.training_time_ms, finished=True,
                                                   checkpoint=checkpoint_path(out_dir)), record, ctx.is_main)
                with phases.timed("setup"):
                    setup = build_setup(cfg, ctx)
                if ckpt is not None and ckpt.tokenizer_sha256 != setup.tokenizer_sha256:
                    raise DataError(f"{cfg.data.data_path}: encoded with another tokenizer than the run in {out_dir} "
                                    "was trained with; resume with the run's data")
            except BaseException:
                if created and ctx.is_main:  # nothing was trained: leave nothing behind
                    shutil.rmtree(out_dir, ignore_errors=True)
                raise
            if ctx.is_main:
                atomic_write_json(out_dir / RUN_CONFIG, cfg.to_dict())
            with out_of_memory_as_error(ctx.device, "training", "lower --train-batch-tokens, raise "
                                        "--grad-accum-steps, or train a smaller model; the last checkpoint, if any, "
                                        "is unchanged"):
                return _train_locked(cfg, ctx, setup, ckpt, out_dir, stop_at_step, progress, echo, phases,
                                     compile_cache)
    finally:
        shutdown()


def _check_compile_cache_path(path: Path, inputs: list[Path | None], out_dir: Path) -> None:
    """A compile cache outside the inputs and the run (it serves every run), naming nothing
    yet or a compile cache."""
    check_apart(path, inputs, flag=COMPILE_CACHE_FLAG)
    run = out_dir.resolve()
    if run == path.resolve() or run in path.resolve().parents:
        where = "is" if run == path.resolve() else "lies in"
        raise OutputRefused(f"{COMPILE_CACHE_FLAG} {path} {where} the run directory {out_dir}; give a file outside "
                            "it, where other runs find it")
    claim_compile_cache(path)


def _claim_run_dir(out_dir: Path, resume: bool, force: bool, notify: Echo):
    """The checkpoint to resume (or None), after refusing to write over what is not a run,
    or over a run by mistake. A run that holds no checkpoint finished no step that could be
    resumed: it starts afresh without --force."""
    if resume:
        return load_checkpoint(out_dir)
    claim_dir(out_dir, "a training run", is_run_dir)
    existing = [name for name in RUN_FILES if (out_dir / name).exists()]
    existing += sorted(p.name for p in out_dir.glob(KEPT_PATTERN)) if out_dir.is_dir() else []
    if (out_dir / CHECKPOINT_FILENAME).exists() and not force:
        raise ConfigError(f"{out_dir} already holds a checkpoint: pass --resume to continue it, --force to start "
                          "afresh, or choose a new --out")
    if existing:
        for name in existing:
            (out_dir / name).unlink(missing_ok=True)
        why = "--force" if force else "a run that wrote no checkpoint"
        notify(f"starting afresh in {out_dir} ({why}: removed {', '.join(existing)})")
    return None


def _train_locked(cfg, ctx, setup, ckpt, out_dir: Path, stop_at_step: int | None, progress: ProgressDisplay | None,
                  echo: Echo, phases: Phases, compile_cache: Path | None) -> TrainReport:

    sink = open_sink(cfg.train.logger, out_dir, cfg) if ctx.is_main else None
    try:
        display = progress if progress is not None and ctx.is_main else _no_display
        with display(cfg.train.iterations, echo) as (echo, on_step):
            log = RunLog(out_dir, enabled=ctx.is_main, echo=echo, sink=sink)
            trainer = Trainer(setup, out_dir, log, progress=on_step, phases=phases)
            save_cache = _compile_cache_saver(compile_cache, log, ctx.is_main)
            if compile_cache is not None:
                log.line(load_compile_cache(compile_cache))
            if ckpt is not None:
                trainer.restore(ckpt)
                log.line(f"resume:step:{trainer.step}/{cfg.train.iterations} from {checkpoint_path(out_dir)}")
            else:
                describe(setup, log)
                trainer.warm_up()
                save_cache()
            trained_before_ms = trainer.training_time_ms
            with StopRequests().installed() as stops:
                result = trainer.run(stop_at_step, stops)
            save_cache()
            result.stop_signal = stops.signal  # a stop asked after the last step too
            phases.add("training", (result.training_time_ms - trained_before_ms) / 1000.0)
            timings = phases.as_dict()
            if compile_seconds() > 0:
                log.line(compile_line())
            log.line(phases.line())
    finally:
        if sink is not None:
            sink.close()
    record = summary(result, cfg) if ctx.is_main and result.finished else None
    if record is not None:
        record.update(timings_s=timings, compile_s=round(compile_seconds(), 3))
        atomic_write_json(out_dir / SUMMARY, record)
    return TrainReport(result, record, ctx.is_main)


def _compile_cache_saver(path: Path | None, log: RunLog, is_main: bool) -> Callable[[], None]:
    """What writes the compile cache (on the first rank only): after the warm-up, every
    graph of the run is compiled; at the end, again where training compiled more."""
    graphs_when_saved: int | None = None

    def save() -> None:
        nonlocal graphs_when_saved
        if path is None or not is_main or compiled_graphs() == graphs_when_saved:
            return
        log.line(save_compile_cache(path))
        graphs_when_saved = compiled_graphs()
    return save


@contextlib.contextmanager
def _no_display(total: int, echo: Echo):
    yield echo, None


def summary(result: TrainResult, cfg: RunConfig) -> dict[str, Any]:
    """What summary.json records, the final table shows and --json prints."""
    seconds = result.training_time_ms / 1000.0
    calibration = result.calibration
    total_ms = result.training_time_ms + (1000.0 * calibration["seconds"] if calibration else 0.0)
    return {"step": result.step, "training_time_ms": round(result.training_time_ms, 1),
            "ms_per_step": round(result.training_time_ms / max(result.step, 1), 2),
            "tokens_per_s": round(cfg.train.train_batch_tokens * result.step / seconds) if seconds > 0 else None,
            "val_loss": result.val_loss, "val_bpb": result.val_bpb,
            "post_ema_val_loss": result.post_ema_val_loss, "post_ema_val_bpb": result.post_ema_val_bpb,
            "checkpoint": str(result.checkpoint),
            "max_wallclock_seconds": cfg.train.max_wallclock_seconds, "calibration": calibration,
            "training_plus_calibration_ms": round(total_ms, 1),
            "world_size": len(result.devices or [None]), "devices": result.devices,
            "graphs_compiled_in_training": result.graphs_compiled_in_training, "kernels": result.kernels}
