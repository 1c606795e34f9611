"""`windowgpt train`: train a model from shards, with checkpoints and exact resume."""
from __future__ import annotations

import contextlib
import json
import math
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..cli_support import (EXIT_INTERRUPTED, ConfigFileOption, PresetOption, build_config, console, err_console,
                           option_help, print_error, user_errors_exit_1, with_config_flags)
from ..config import RunConfig, apply_overrides
from ..errors import ArtifactError, ConfigError, DataError
from ..metric_sinks import open_sink
from ..runlock import run_lock

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    from ..training import TrainResult

Echo = Callable[[str], None]

RESUMABLE_OVERRIDES = {"data_path", "tokenizer_path", "tokenizer_meta_path", "device", "attn_backend", "compile",
                       "micro_batches_per_pass", "sample_every", "sample_prompt", "logger"}
SUMMARY = "summary.json"  # written when a run finishes


@dataclass
class TrainReport:
    result: TrainResult
    record: dict[str, Any] | None  # summary.json's record: the first rank's, of a finished run
    is_main: bool  # rank 0 (only it prints)


def train(cfg: RunConfig, out_dir: Path, *, resume: bool = False, force: bool = False,
          stop_at_step: int | None = None, show_progress: bool = False, echo: Echo | None = None) -> TrainResult:
    """Train (or resume) into out_dir: config.json, train.log, metrics.jsonl, checkpoint.pt,
    and summary.json when it finishes. echo receives the log lines (default: stdout)."""
    return train_and_report(cfg, out_dir, resume=resume, force=force, stop_at_step=stop_at_step,
                            show_progress=show_progress, echo=echo).result


def train_and_report(cfg: RunConfig, out_dir: Path, *, resume: bool = False, force: bool = False,
                     stop_at_step: int | None = None, show_progress: bool = False,
                     echo: Echo | None = None) -> TrainReport:
    """train(), with what the command prints.

    One process writes to a run at a time (RUN/.lock). A new run refuses a directory that
    holds one unless `force` (the old run's files are removed first); resuming a finished
    run changes nothing.
    """
    # torch is imported only when a command runs, so that --help answers at once
    from ..checkpoint import checkpoint_path, load_checkpoint
    from ..distributed import init_distributed, shutdown
    from ..timing import Phases
    from ..training import TrainResult, build_setup

    phases = Phases()
    echo = echo or (lambda line: print(line, flush=True))
    out_dir = Path(out_dir)
    if resume and force:
        raise ConfigError("--resume continues a run and --force replaces it: give one of them")
    if out_dir.exists() and not out_dir.is_dir():
        raise ArtifactError(f"{out_dir}: exists and is not a directory")
    cfg = cfg.resolved()
    if not resume and not force:
        _claim_run_dir(out_dir, resume, force, echo)  # refuse before touching the directory (checked again below)
    ctx = init_distributed(cfg.train.device)
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
                cfg.save(out_dir / "config.json")
            return _train_locked(cfg, ctx, setup, ckpt, out_dir, stop_at_step, show_progress, echo, phases)
    finally:
        shutdown()


def _claim_run_dir(out_dir: Path, resume: bool, force: bool, notify: Echo):
    """The checkpoint to resume (or None), after refusing to overwrite a run by mistake."""
    from ..calibration import HESSIANS_FILENAME
    from ..checkpoint import FILENAME as CHECKPOINT_FILENAME, load_checkpoint

    if resume:
        return load_checkpoint(out_dir)
    run_files = ("config.json", "train.log", "metrics.jsonl", CHECKPOINT_FILENAME, HESSIANS_FILENAME, SUMMARY)
    existing = [name for name in run_files if (out_dir / name).exists()]
    if existing and not force:
        what = "a checkpoint" if CHECKPOINT_FILENAME in existing else f"a run ({existing[0]})"
        raise ConfigError(f"{out_dir} already holds {what}: pass --resume to continue it, --force to start "
                          "afresh, or choose a new --out")
    if existing:
        for name in existing:
            (out_dir / name).unlink(missing_ok=True)
        notify(f"--force: starting afresh in {out_dir} (removed {', '.join(existing)})")
    return None


def _train_locked(cfg, ctx, setup, ckpt, out_dir: Path, stop_at_step: int | None, show_progress: bool,
                  echo: Echo, phases) -> TrainReport:
    from ..artifacts import atomic_write_json
    from ..checkpoint import checkpoint_path
    from ..timing import compile_line, compile_seconds
    from ..training import RunLog, StopRequests, Trainer, describe

    sink = open_sink(cfg.train.logger, out_dir, cfg) if ctx.is_main else None
    try:
        with _ProgressBar(show_progress and ctx.is_main, cfg.train.iterations, echo) as (echo, on_step):
            log = RunLog(out_dir, enabled=ctx.is_main, echo=echo, sink=sink)
            trainer = Trainer(setup, out_dir, log, progress=on_step, phases=phases)
            if ckpt is not None:
                trainer.restore(ckpt)
                log.line(f"resume:step:{trainer.step}/{cfg.train.iterations} from {checkpoint_path(out_dir)}")
            else:
                describe(setup, log)
                trainer.warm_up()
            trained_before_ms = trainer.training_time_ms
            with StopRequests().installed() as stops:
                result = trainer.run(stop_at_step, stops)
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
            "world_size": len(result.devices or [None]), "devices": result.devices}


def summary_table(record: dict[str, Any], out_dir: Path) -> Table:
    table = Table(title=f"trained {out_dir}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    tokens_per_s = record["tokens_per_s"]
    rows = [
        ("steps", f"{record['step']:,}"),
        ("training time", f"{record['training_time_ms'] / 1000.0:.1f} s"),
        ("ms per step", f"{record['ms_per_step']:.1f}"),
        ("tokens / second", f"{tokens_per_s:,}" if tokens_per_s is not None else "-"),
        *([("training + GPTQ calibration", f"{record['training_plus_calibration_ms'] / 1000.0:.1f} s")]
          if record.get("calibration") else []),
        ("val_bpb (final weights)", _bpb(record["val_bpb"])),
        ("val_bpb (EMA weights)", _bpb(record["post_ema_val_bpb"])),
        ("checkpoint", record["checkpoint"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _bpb(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


class _FinishedLoss:
    """The latest training loss the device has finished computing, read without waiting:
    on CUDA each step's loss is copied to pinned memory behind an event, and shown once the
    event has passed (usually the previous step's), so the bar never syncs the GPU."""

    MAX_PENDING = 8

    def __init__(self) -> None:
        self.pending: deque = deque()
        self.text = "-"

    def read(self, loss: Any) -> str:
        import torch

        if loss.device.type != "cuda":
            self.text = f"{loss.item():.4f}"
            return self.text
        host = torch.empty((), dtype=loss.dtype, pin_memory=True)
        host.copy_(loss.detach(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append((host, done))
        while self.pending and self.pending[0][1].query():
            self.text = f"{self.pending.popleft()[0].item():.4f}"
        while len(self.pending) > self.MAX_PENDING:
            self.pending.popleft()
        return self.text


def planned_steps(info: dict[str, Any]) -> tuple[int, float]:
    """The step training will end at and the seconds left: the wallclock cap, when there is
    one, ends it before `iterations` at the pace so far."""
    step, iterations, elapsed_ms = info["step"], info["iterations"], info["elapsed_ms"]
    ms_per_step = elapsed_ms / max(step, 1)
    left_ms = (iterations - step) * ms_per_step
    cap = info.get("wallclock_ms")
    if cap:
        left_ms = min(left_ms, max(cap - elapsed_ms, 0.0))
        return min(iterations, step + math.ceil(left_ms / max(ms_per_step, 1e-9))), left_ms / 1000.0
    return iterations, left_ms / 1000.0


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class _ProgressBar:
    """A rich bar (step, loss, tokens/s, time left) on a terminal; plain lines otherwise."""

    def __init__(self, enabled: bool, total: int, echo: Echo):
        self.enabled, self.total, self.echo = enabled, total, echo
        self.progress: Progress | None = None

    def __enter__(self):
        if not self.enabled:
            return self.echo, None
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                 TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
                                 console=err_console, transient=True)
        task = self.progress.add_task("train", total=self.total, loss="-", tps="-", eta="-")
        self.progress.start()
        loss = _FinishedLoss()

        def on_step(info: dict) -> None:
            total, seconds_left = planned_steps(info)
            self.progress.update(task, completed=info["step"], total=total, loss=loss.read(info["loss"]),
                                 tps=f"{info['tokens_per_s']:,.0f}", eta=_clock(seconds_left))

        def echo(line: str) -> None:  # above the bar
            self.progress.console.print(line, highlight=False, soft_wrap=True, markup=False)

        return echo, on_step

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
        return False


@user_errors_exit_1
@with_config_flags("model", "optim", "train", "eval", "quant")
def command(
    out: Annotated[Optional[Path], typer.Option("--out", help="Run directory for config, logs, metrics and "
                                                "checkpoint (required unless --print-config).",
                                                show_default=False)] = None,
    data: Annotated[Optional[Path], typer.Option("--data", help="Directory of fineweb_{train,val}_*.bin shards "
                                                 "(required unless --config gives data_path).",
                                                 show_default=False)] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help=option_help(
        "SentencePiece model.", "DATA/tokenizer.model"), show_default=False)] = None,
    config_file: ConfigFileOption = None,
    preset_name: PresetOption = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the checkpoint in --out to the end.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Start afresh in an --out that holds a run, removing "
                                                        "its files.")] = False,
    stop_at_step: Annotated[Optional[int], typer.Option(
        "--stop-at-step", help="Stop at this step with a checkpoint; the schedule stays planned for --iterations.",
        show_default=False)] = None,
    print_config: Annotated[bool, typer.Option(
        "--print-config", help="Print the resolved configuration (JSON, usable as --config) and exit.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the resolved configuration, check the data and tokenizer, and exit without "
        "training.")] = False,
    json_output: Annotated[bool, typer.Option(
        "--json", help="Print the final summary as JSON on stdout (log lines go to stderr).")] = False,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Train a model on token shards; logs like the reference, checkpoints atomically."""
    from ..artifacts import json_text
    from ..checkpoint import load_checkpoint
    from ..training import find_inputs

    overrides = dict(overrides or {})
    paths = {k: str(v) for k, v in (("data_path", data), ("tokenizer_path", tokenizer)) if v is not None}
    overrides["data"] = {**overrides.get("data", {}), **paths}
    if resume:
        given = {name for values in overrides.values() for name in values} - RESUMABLE_OVERRIDES
        if given or config_file or preset_name:
            raise ConfigError("--resume takes its settings from the checkpoint; only --data, --tokenizer, --device, "
                              "--sample-every, --sample-prompt, --logger, "
                              "--attn-backend, --compile and --micro-batches-per-pass may change")
        if out is None:
            raise ConfigError("--resume needs --out RUN_DIR")
        cfg = apply_overrides(load_checkpoint(out).config, overrides)
    else:
        cfg = build_config(config_file, preset_name, overrides)
    if print_config or dry_run:
        resolved = cfg.resolved()
        typer.echo(json.dumps(resolved.to_dict(), indent=2))
        if dry_run:
            inputs = find_inputs(resolved)
            err_console.print(f"ok: {len(inputs.train_files)} train and {len(inputs.val_files)} val shard(s) in "
                              f"{resolved.data.data_path}, tokenizer {inputs.tokenizer} ({inputs.vocab_size} tokens); "
                              "nothing trained", highlight=False, soft_wrap=True)
        return
    if out is None:
        raise ConfigError("--out RUN_DIR is required")
    if not cfg.data.data_path:
        raise ConfigError("--data DATA_DIR is required")
    log_console = err_console if json_output else console
    done = train_and_report(cfg, out, resume=resume, force=force, stop_at_step=stop_at_step,
                            show_progress=err_console.is_terminal,
                            echo=lambda line: log_console.print(line, highlight=False, soft_wrap=True, markup=False))
    if not done.is_main:
        return
    result = done.result
    if not result.finished:
        log_console.print(f"stopped at step {result.step}; continue with: windowgpt train --out {out} --resume",
                          highlight=False, soft_wrap=True, markup=False)
        if result.interrupted:
            print_error(f"stopped at step {result.step} with its checkpoint written", label="interrupted")
            raise typer.Exit(EXIT_INTERRUPTED)
        return
    if done.record is None:
        return
    if json_output:
        typer.echo(json_text(done.record))
    else:
        console.print(summary_table(done.record, Path(out)))
