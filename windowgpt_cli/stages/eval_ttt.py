"""`windowgpt eval-ttt`: score-first test-time training, scored as the reference scores it.

Every chunk of the validation tokens is scored with sliding windows before the model
trains on it, so no token is scored by a model that has seen it. Settings default to the
artifact's saved configuration; the windows are the training length, as in the reference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..cli_support import FROM_ARTIFACT, console, err_console, option_help, user_errors_exit_1, with_config_flags
from ..config import apply_overrides, validate
from ..errors import ConfigError
from .evaluate import (ArtifactArg, AttnOption, BatchOption, CompileOption, DataOption, DeviceOption, EvalReport,
                       FusedOption, JsonOption, ScoreOnceOption, TokenizerOption, add_timings, check_eval_settings,
                       eval_record, load_inputs, report, show_progress_bars)

if TYPE_CHECKING:
    from ..evaluation import ChunkProgress

LOG_EVERY_CHUNKS = 10  # without a terminal, a line every this many chunks (as the reference)

Echo = Callable[[str], None]


def ttt_evaluate_artifact(artifact: Path, data_dir: Path, *, ttt_overrides: dict[str, Any] | None = None,
                          stride: int | None = None, seq_len: int | None = None, batch_seqs: int | None = None,
                          tokenizer: Path | None = None, device: str = "auto", attn_backend: str = "auto",
                          score_once: bool = False, compile_model: bool | None = None, fused: bool | None = None,
                          show_progress: bool = False, echo: Echo | None = None) -> EvalReport:
    """Score the artifact with score-first TTT on DATA_DIR's validation shards.

    ttt_overrides ({field: value} of TTTConfig) change the artifact's saved TTT settings.
    echo receives the log lines (settings, parameter counts, running bpb without a bar).
    """
    # torch is imported only when a command runs, so that --help answers at once
    from ..distributed import init_distributed, shutdown
    from ..eval_results import save_eval_result
    from ..evaluation import TTT_ORDER, evaluate_ttt, load_validation_tokens, should_compile, should_fuse
    from ..timing import Phases

    phases = Phases()
    ctx = init_distributed(device)
    try:
        with phases.timed("load"):
            inputs = load_inputs(artifact, data_dir, tokenizer, ctx, attn_backend)
        cfg = apply_overrides(inputs.config, {"ttt": dict(ttt_overrides or {})})
        validate(cfg)
        ttt = cfg.ttt
        if ttt.ttt_epochs < 0 or ttt.ttt_freeze_blocks < 0:
            raise ConfigError("--ttt-epochs and --ttt-freeze-blocks must not be negative")
        seq_len = cfg.train.train_seq_len if seq_len is None else seq_len
        stride = cfg.eval.eval_stride if stride is None else stride
        batch_seqs = cfg.eval.eval_batch_seqs if batch_seqs is None else batch_seqs
        check_eval_settings(seq_len, stride, batch_seqs)
        if stride == 0:
            raise ConfigError("test-time training scores sliding windows: --stride must be in 1..seq_len")
        # As the reference: the tokens are cut to whole sequences of the longer of the
        # training (here: TTT window) and evaluation lengths.
        with phases.timed("tokens"):
            val_tokens = load_validation_tokens(data_dir, max(seq_len, cfg.eval.eval_seq_len), cfg.model.vocab_size,
                                                inputs.data.shards("val"))
        echo = echo if ctx.is_main else None
        compiling = should_fuse(fused, ctx.device) or should_compile(compile_model, ctx.device)
        with chunk_progress(show_progress and ctx.is_main, echo, compiling) as on_chunk:
            result = evaluate_ttt(inputs.model, val_tokens, inputs.luts, ttt, seq_len=seq_len, stride=stride,
                                  batch_seqs=batch_seqs, device=ctx.device, rank=ctx.rank,
                                  world_size=ctx.world_size, score_once=score_once, compile_model=compile_model,
                                  fused=fused, on_chunk=on_chunk, log=echo)
        record = eval_record(result, inputs, Path(artifact))
        record["score_once"] = score_once
        record["ttt"] = dataclasses.asdict(ttt)
        record["ttt_order"] = TTT_ORDER
        record["ttt_steps"] = result.ttt_steps
        record["per_chunk"] = [{"loss_sum": c.loss_sum, "tokens": c.tokens, "bytes": c.bytes, "val_bpb": c.val_bpb}
                               for c in result.per_chunk]
        add_timings(record, phases, result)
        if ctx.is_main:  # beside the artifact, for `compare` and `inspect`
            save_eval_result(Path(artifact), record)
        return EvalReport(result, record, ctx.is_main)
    finally:
        shutdown()


@contextlib.contextmanager
def chunk_progress(show_bar: bool, echo: Echo | None,
                   compiling: bool = False) -> Iterator[Callable[[ChunkProgress], None] | None]:
    """A rich bar over chunks with the running bpb (until the first chunk is scored: whether
    the scorer is compiling), or (without a terminal) a line every few chunks; None when
    there is nothing to show."""
    if show_bar:
        with Progress(TextColumn("[bold]ttt"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("bpb {task.fields[bpb]}"), TimeElapsedColumn(),
                      console=err_console, transient=True) as progress:
            task = progress.add_task("ttt", total=None, bpb="- (compiling)" if compiling else "-")

            def update_bar(info: ChunkProgress) -> None:
                progress.update(task, completed=info.chunk, total=info.num_chunks, bpb=f"{info.val_bpb:.6f}")

            yield update_bar
        return
    if echo is None:
        yield None
        return
    start = time.perf_counter()

    def print_line(info: ChunkProgress) -> None:
        if info.chunk % LOG_EVERY_CHUNKS == 1 or info.chunk == info.num_chunks:
            echo(f"  ttt_chunk [{info.chunk}/{info.num_chunks}] bpb={info.val_bpb:.6f} "
                 f"time={time.perf_counter() - start:.1f}s")

    yield print_line


@user_errors_exit_1
@with_config_flags("ttt", from_artifact=True)
def command(
    artifact: ArtifactArg,
    data: DataOption,
    stride: Annotated[Optional[int], typer.Option(
        "--stride", help=option_help("Windows every STRIDE tokens, each scoring its last STRIDE.", FROM_ARTIFACT),
        show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", help=option_help("Tokens per window and per training sequence.",
                                      "the artifact's train_seq_len"), show_default=False)] = None,
    batch_seqs: BatchOption = None,
    tokenizer: TokenizerOption = None,
    device: DeviceOption = "auto",
    attn_backend: AttnOption = "auto",
    score_once: ScoreOnceOption = False,
    compile_model: CompileOption = None,
    fused: FusedOption = None,
    as_json: JsonOption = False,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Score an artifact with score-first test-time training (TTT settings default to the artifact's)."""
    log_console = err_console if as_json else console
    out = ttt_evaluate_artifact(artifact, data, ttt_overrides=(overrides or {}).get("ttt"), stride=stride,
                                seq_len=seq_len, batch_seqs=batch_seqs, tokenizer=tokenizer, device=device,
                                attn_backend=attn_backend, score_once=score_once, compile_model=compile_model,
                                fused=fused, show_progress=show_progress_bars(),
                                echo=lambda line: log_console.print(line, highlight=False, soft_wrap=True))
    if out.is_main:
        report(out.record, "eval-ttt (score-first test-time training)", as_json)
