"""`windowgpt train`: train a model from shards, with checkpoints and exact resume."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..calibration import HESSIANS_FILENAME
from ..checkpoint import FILENAME as CHECKPOINT_FILENAME, checkpoint_path, load_checkpoint
from ..cli_support import (EXIT_INTERRUPTED, ConfigFileOption, PresetOption, build_config, console, print_error,
                           user_errors_exit_1, with_config_flags)
from ..artifacts import atomic_write_json
from ..config import RunConfig, apply_overrides
from ..distributed import init_distributed, shutdown
from ..errors import ArtifactError, ConfigError, DataError
from ..metric_sinks import open_sink
from ..runlock import run_lock
from ..training import RunLog, StopRequests, Trainer, TrainResult, build_setup, describe

RESUMABLE_OVERRIDES = {"data_path", "tokenizer_path", "tokenizer_meta_path", "device", "attn_backend", "compile",
                       "sample_every", "sample_prompt", "logger"}
SUMMARY = "summary.json"  # written when a run finishes
RUN_FILES = ("config.json", "train.log", "metrics.jsonl", CHECKPOINT_FILENAME, HESSIANS_FILENAME, SUMMARY)


def train(cfg: RunConfig, out_dir: Path, *, resume: bool = False, force: bool = False,
          stop_at_step: int | None = None, show_progress: bool = False,
          notify: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) into out_dir: config.json, train.log, metrics.jsonl, checkpoint.pt.

    One process writes to a run at a time (RUN/.lock). A new run refuses a directory that
    holds one unless `force` (the old run's files are removed first); resuming a finished
    run changes nothing.
    """
    out_dir = Path(out_dir)
    if resume and force:
        raise ConfigError("--resume continues a run and --force replaces it: give one of them")
    if out_dir.exists() and not out_dir.is_dir():
        raise ArtifactError(f"{out_dir}: exists and is not a directory")
    cfg = cfg.resolved()
    if not resume and not force:
        _claim_run_dir(out_dir, resume, force, notify)  # refuse before touching the directory (checked again below)
    ctx = init_distributed(cfg.train.device)
    created = not out_dir.exists()
    try:
        with run_lock(out_dir) if ctx.is_main else contextlib.nullcontext():
            try:
                if ctx.is_main:  # under the lock; the other ranks only read what it leaves
                    ckpt = _claim_run_dir(out_dir, resume, force, notify)
                else:
                    ckpt = load_checkpoint(out_dir) if resume else None
                if ckpt is not None and (out_dir / SUMMARY).is_file():
                    if ctx.is_main:
                        notify(f"{out_dir}: the run finished at step {ckpt.step}; nothing to do")
                    return TrainResult(ckpt.step, ckpt.training_time_ms, finished=True,
                                       checkpoint=checkpoint_path(out_dir))
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
            return _train_locked(cfg, ctx, setup, ckpt, out_dir, stop_at_step, show_progress)
    finally:
        shutdown()


def _claim_run_dir(out_dir: Path, resume: bool, force: bool, notify: Callable[[str], None]):
    """The checkpoint to resume (or None), after refusing to overwrite a run by mistake."""
    if resume:
        return load_checkpoint(out_dir)
    existing = [name for name in RUN_FILES if (out_dir / name).exists()]
    if existing and not force:
        what = "a checkpoint" if CHECKPOINT_FILENAME in existing else f"a run ({existing[0]})"
        raise ConfigError(f"{out_dir} already holds {what}: pass --resume to continue it, --force to start "
                          "afresh, or choose a new --out")
    if existing:
        for name in existing:
            (out_dir / name).unlink(missing_ok=True)
        notify(f"--force: starting afresh in {out_dir} (removed {', '.join(existing)})")
    return None


def _train_locked(cfg, ctx, setup, ckpt, out_dir: Path, stop_at_step: int | None,
                  show_progress: bool) -> TrainResult:
    sink = open_sink(cfg.train.logger, out_dir, cfg) if ctx.is_main else None
    try:
        with _ProgressBar(show_progress and ctx.is_main, cfg.train.iterations) as (echo, on_step):
            log = RunLog(out_dir, enabled=ctx.is_main, echo=echo, sink=sink)
            trainer = Trainer(setup, out_dir, log, progress=on_step)
            if ckpt is not None:
                trainer.restore(ckpt)
                log.line(f"resume:step:{trainer.step}/{cfg.train.iterations} from {checkpoint_path(out_dir)}")
            else:
                describe(setup, log)
                trainer.warm_up()
            with StopRequests().installed() as stops:
                result = trainer.run(stop_at_step, stops)
    finally:
        if sink is not None:
            sink.close()
    if ctx.is_main and result.finished:
        atomic_write_json(out_dir / SUMMARY, _summary(result, cfg))
    return result


def _summary(result: TrainResult, cfg: RunConfig) -> dict[str, Any]:
    calibration = result.calibration
    total_ms = result.training_time_ms + (1000.0 * calibration["seconds"] if calibration else 0.0)
    return {"step": result.step, "training_time_ms": round(result.training_time_ms, 1),
            "val_loss": result.val_loss, "val_bpb": result.val_bpb,
            "post_ema_val_loss": result.post_ema_val_loss, "post_ema_val_bpb": result.post_ema_val_bpb,
            "checkpoint": str(result.checkpoint),
            "max_wallclock_seconds": cfg.train.max_wallclock_seconds, "calibration": calibration,
            "training_plus_calibration_ms": round(total_ms, 1),
            "world_size": len(result.devices or [None]), "devices": result.devices}


class _ProgressBar:
    """A rich bar (step, loss, tokens/s) on a terminal; plain printed lines otherwise."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self.progress: Progress | None = None

    def __enter__(self):
        if not self.enabled:
            return (lambda line: print(line, flush=True)), None
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                 TimeElapsedColumn(), console=console, transient=True)
        task = self.progress.add_task("train", total=self.total, loss="-", tps="-")
        self.progress.start()
        last_loss_step = [0]

        def on_step(info: dict) -> None:
            fields = {"tps": f"{info['tokens_per_s']:,.0f}"}
            if info["step"] - last_loss_step[0] >= 10 or info["step"] <= 1:  # .item() syncs: not every step
                fields["loss"] = f"{info['loss'].item():.4f}"
                last_loss_step[0] = info["step"]
            self.progress.update(task, completed=info["step"], **fields)

        return self.progress.console.print, on_step

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
        return False


@user_errors_exit_1
@with_config_flags("model", "optim", "train", "eval", "quant")
def command(
    out: Annotated[Path, typer.Option("--out", help="Run directory for config, logs, metrics and checkpoint.")],
    data: Annotated[Optional[Path], typer.Option("--data", help="Directory of fineweb_{train,val}_*.bin shards.",
                                                 show_default=False)] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="SentencePiece model "
                                                      "(default: DATA/tokenizer.model)", show_default=False)] = None,
    config_file: ConfigFileOption = None,
    preset_name: PresetOption = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the checkpoint in --out to the end.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Start afresh in an --out that holds a run, removing "
                                                        "its files.")] = False,
    stop_at_step: Annotated[Optional[int], typer.Option(
        "--stop-at-step", help="Stop at this step with a checkpoint; the schedule stays planned for --iterations.",
        show_default=False)] = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Train a model on token shards; logs like the reference, checkpoints atomically."""
    overrides = dict(overrides or {})
    paths = {k: str(v) for k, v in (("data_path", data), ("tokenizer_path", tokenizer)) if v is not None}
    overrides["data"] = {**overrides.get("data", {}), **paths}
    if resume:
        given = {name for values in overrides.values() for name in values} - RESUMABLE_OVERRIDES
        if given or config_file or preset_name:
            raise ConfigError("--resume takes its settings from the checkpoint; only --data, --tokenizer, --device, "
                              "--sample-every, --sample-prompt, --logger, "
                              "--attn-backend and --compile may change")
        cfg = apply_overrides(load_checkpoint(out).config, overrides)
    else:
        if data is None:
            raise ConfigError("--data DATA_DIR is required")
        cfg = build_config(config_file, preset_name, overrides)
    result = train(cfg, out, resume=resume, force=force, stop_at_step=stop_at_step,
                   show_progress=console.is_terminal, notify=lambda line: console.print(line, highlight=False,
                                                                                         markup=False))
    if not result.finished:
        console.print(f"stopped at step {result.step}; continue with: windowgpt train --out {out} --resume",
                      highlight=False, markup=False)
    if result.interrupted:
        print_error(f"stopped at step {result.step} with its checkpoint written", label="interrupted")
        raise typer.Exit(EXIT_INTERRUPTED)
