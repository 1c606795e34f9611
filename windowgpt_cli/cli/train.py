"""`windowgpt train`: train a model from shards, with checkpoints and exact resume."""
from __future__ import annotations

import contextlib
import json
import math
import signal
from collections import deque
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..config import RESUMABLE_SETTINGS, apply_overrides, check_settings
from ..errors import ConfigError, Interrupted, Terminated
from .support import (
    ConfigFileOption,
    PresetOption,
    build_config,
    console,
    err_console,
    flag_name,
    option_help,
    out_option,
    print_error,
    print_warning,
    user_errors_exit_1,
    with_config_flags,
)

Echo = Callable[[str], None]


def summary_table(record: dict[str, Any], out_dir: Path) -> Table:
    table = Table(title=f"trained {out_dir}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right", overflow="fold")  # paths whole, never cut
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
        *([("step kernels", _kernels_text(record["kernels"]))] if record.get("kernels") else []),
        ("checkpoint", record["checkpoint"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _kernels_text(kernels: dict[str, str]) -> str:
    attention, mlp, fold = kernels["attn_backend"], kernels["fused_mlp"], kernels["fold_output_scales"]
    # runs from before the fused heads and XSA had settings ran neither
    heads, xsa = kernels.get("fused_head_prep", "off"), kernels.get("fused_xsa", "off")
    return f"attention {attention}, fused MLP {mlp}, fold {fold}, fused heads {heads}, fused XSA {xsa}"


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


@contextlib.contextmanager
def progress_bar(total: int, echo: Echo) -> Iterator[tuple[Echo, Callable[[dict], None]]]:
    """A rich bar on stderr (step, loss, tokens/s, time left), with the log's lines printed above it."""
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                        TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"), console=err_console, transient=True)
    task = progress.add_task("train", total=total, loss="-", tps="-", eta="-")
    loss = _FinishedLoss()

    def on_step(info: dict) -> None:
        planned, seconds_left = planned_steps(info)
        progress.update(task, completed=info["step"], total=planned, loss=loss.read(info["loss"]),
                        tps=f"{info['tokens_per_s']:,.0f}", eta=_clock(seconds_left))

    def above_the_bar(line: str) -> None:
        progress.console.print(line, highlight=False, soft_wrap=True, markup=False)

    with progress:
        yield above_the_bar, on_step


@user_errors_exit_1
@with_config_flags("model", "optim", "train", "eval", "quant")
def command(
    out: Annotated[Optional[Path], out_option(
        "Run directory for config, logs, metrics and checkpoint (required unless --print-config).",
        "a training run's files, and only with --force once it holds a checkpoint (a run that wrote none starts "
        "afresh)")] = None,
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
    compile_cache: Annotated[Optional[Path], typer.Option(
        "--compile-cache", help="A file of torch.compile's caches, loaded before the first step where it was made "
        "with this torch, Triton and GPU, and written after the warm-up: a fresh machine starts with what another "
        "compiled. Replaces only a compile cache.", show_default=False)] = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Train a model on token shards; logs like the reference, checkpoints atomically.

    Example: windowgpt train --preset tiny --data demo-out/data --out demo-out/run
    """
    # torch is imported only when a command runs, so that --help answers at once
    from ..artifacts.checkpoint import load_checkpoint
    from ..storage.files import json_text
    from ..train.run import check_requirements, train_and_report
    from ..train.trainer import find_inputs

    check_settings(stop_at_step=stop_at_step)
    overrides = dict(overrides or {})
    paths = {k: str(v) for k, v in (("data_path", data), ("tokenizer_path", tokenizer)) if v is not None}
    overrides["data"] = {**overrides.get("data", {}), **paths}
    if resume:
        given = {name for values in overrides.values() for name in values} - set(RESUMABLE_SETTINGS)
        if given or config_file or preset_name:
            flags = ", ".join(flag_name(name) for name in RESUMABLE_SETTINGS)
            raise ConfigError(f"--resume takes its settings from the checkpoint; only {flags} may change")
        if out is None:
            raise ConfigError("--resume needs --out RUN_DIR")
        cfg = apply_overrides(load_checkpoint(out).config, overrides)
    else:
        cfg = build_config(config_file, preset_name, overrides)
        if "vocab_size" not in overrides.get("model", {}) and cfg.data.data_path:
            cfg = _with_data_vocab(cfg)
    if print_config or dry_run:
        resolved = cfg.resolved()
        typer.echo(json.dumps(resolved.to_dict(), indent=2))
        if dry_run:
            check_requirements(resolved)
            _warn_if_slow(resolved)
            inputs = find_inputs(resolved)
            err_console.print(f"ok: {len(inputs.train_files)} train and {len(inputs.val_files)} val shard(s) in "
                              f"{resolved.data.data_path}, tokenizer {inputs.tokenizer} ({inputs.vocab_size} tokens); "
                              "nothing trained", highlight=False, soft_wrap=True)
        return
    if out is None:
        raise ConfigError("--out RUN_DIR is required")
    if not cfg.data.data_path:
        raise ConfigError("--data DATA_DIR is required")
    _warn_if_slow(cfg)
    say = Output(json_output)
    done = train_and_report(cfg, out, resume=resume, force=force, stop_at_step=stop_at_step,
                            progress=progress_bar if err_console.is_terminal else None, echo=say.line,
                            compile_cache=compile_cache)
    if not done.is_main:
        return
    result = done.result
    if not result.finished:
        say.line(f"stopped at step {result.step}; continue with: windowgpt train --out {out} --resume")
        if result.interrupted:
            _stopped_by(result.stop_signal, f"stopped at step {result.step} with its checkpoint written")
        return
    if done.record is not None:
        say.out(json_text(done.record) if json_output else summary_table(done.record, Path(out)))
    if say.closed:
        print_error(f"standard output was closed, so some lines went nowhere; {out}/train.log holds the whole "
                    "log and the run's files are complete", label="note")
    if result.stop_signal is not None:
        _stopped_by(result.stop_signal, "the stop came after the last step: the run finished and its files are "
                                        "complete")


def _with_data_vocab(cfg: Any) -> Any:
    """cfg with the vocabulary of its data's tokenizer (--vocab-size not given), saying so
    where that differs from the preset's or the configuration file's."""
    from ..train.trainer import data_vocab_size

    vocab = data_vocab_size(cfg)
    if vocab is None or vocab == cfg.model.vocab_size:
        return cfg
    err_console.print(f"note: vocab_size={vocab}, the data's tokenizer's (not {cfg.model.vocab_size}); "
                      "--vocab-size sets it", highlight=False, soft_wrap=True)
    return apply_overrides(cfg, {"model": {"vocab_size": vocab}})


def _warn_if_slow(cfg: Any) -> None:
    from ..train.run import cpu_slowness

    slowness = cpu_slowness(cfg.resolved())  # of settings within their bounds
    if slowness is not None:
        print_warning(slowness)


def _stopped_by(signum: int | None, what: str) -> None:
    """One line and the exit status of the signal that stopped the run (130 for Ctrl-C)."""
    stop = Terminated if signum == signal.SIGTERM else Interrupted
    print_error(what, label=stop.label)
    raise typer.Exit(stop.exit_status)


class Output:
    """Where the command prints: its log lines (to stderr with --json) and its result (to
    stdout). A closed stdout (`windowgpt train ... | head`) loses lines, never the run."""

    def __init__(self, json_output: bool):
        self.log_console = err_console if json_output else console
        self.closed = False

    def line(self, text: str) -> None:
        self._print(self.log_console, text)

    def out(self, renderable: Any) -> None:
        self._print(console, renderable)

    def _print(self, target: Console, renderable: Any) -> None:
        try:
            target.print(renderable, highlight=False, soft_wrap=True, markup=False)
        except BrokenPipeError:
            self.closed = True
