"""`windowgpt eval`: val_loss and val_bpb of an artifact, scored as the reference scores them.

A stride of 0, or one equal to the sequence length, gives the standard evaluation
(consecutive sequences); a smaller stride gives sliding windows. The model, and the
default sequence length, stride and batch, come from the artifact alone.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..cli_support import FROM_ARTIFACT, console, err_console, option_help, user_errors_exit_1
from ..config import RunConfig
from ..errors import ConfigError, DataError

if TYPE_CHECKING:  # torch is imported only when a command runs, so that --help answers at once
    from .. import model_io
    from ..datadir import DataManifest
    from ..distributed import DistContext
    from ..evaluation import EvalResult
    from ..model import GPT
    from ..tokenizer import ByteLuts


# --- Shared with eval-ttt ---------------------------------------------------------------

@dataclass
class EvalInputs:
    """An artifact's model on the device, with the byte tables of its tokenizer."""

    weights: model_io.LoadedWeights
    model: GPT
    luts: ByteLuts
    tokenizer: Path
    ctx: DistContext
    attn_backend: str
    data: DataManifest | None = None  # the validation data, checked against its manifest

    @property
    def config(self) -> RunConfig:
        return self.weights.config


def load_inputs(artifact: Path, data_dir: Path, tokenizer: Path | None, ctx: DistContext,
                attn_backend: str = "auto") -> EvalInputs:
    """Build the artifact's model and check that the data and the tokenizer are those it
    was trained with."""
    from ..datadir import verify_data

    data = verify_data(data_dir, hash_splits=("val",))
    return load_model(artifact, Path(tokenizer) if tokenizer is not None else data.tokenizer, ctx, attn_backend, data)


def load_model(artifact: Path, tokenizer_path: Path, ctx: DistContext, attn_backend: str = "auto",
               data: DataManifest | None = None) -> EvalInputs:
    """Build the artifact's model, with the byte tables of its tokenizer (checked by hash),
    and check that the data, when given, was encoded with that tokenizer."""
    # torch is imported only when a command runs, so that --help answers at once
    from .. import model_io
    from ..artifacts import sha256_file
    from ..datadir import check_same_tokenizer
    from ..runtime import enable_fast_math
    from ..tokenizer import load_byte_luts

    weights, model = model_io.build_model(Path(artifact), ctx.device)
    if data is not None:
        check_same_tokenizer(data, weights.tokenizer_sha256, f"{artifact} was trained with")
    if not tokenizer_path.is_file():
        raise DataError(f"{tokenizer_path}: no such tokenizer file")
    expected = weights.tokenizer_sha256
    actual = sha256_file(tokenizer_path)
    if actual != expected:
        raise DataError(f"{tokenizer_path}: sha256 {actual[:16]}... differs from the tokenizer {artifact} was "
                        f"trained with ({expected[:16]}...)")
    luts = load_byte_luts(tokenizer_path, None, weights.config.model.vocab_size).to(ctx.device)
    backend = model.set_attention_backend(attn_backend, ctx.device)
    enable_fast_math(ctx.device)
    return EvalInputs(weights, model, luts, tokenizer_path, ctx, backend, data)


def eval_record(result: EvalResult, inputs: EvalInputs, artifact: Path) -> dict[str, Any]:
    """What --json prints and the table shows."""
    return {
        "mode": result.mode, "val_loss": result.val_loss, "val_bpb": result.val_bpb, "tokens": result.tokens,
        "bytes": result.bytes, "seconds": result.seconds, "tokens_per_second": result.tokens_per_second,
        "seq_len": result.seq_len, "stride": result.stride, "batch_seqs": result.batch_seqs,
        "artifact": str(artifact),
        "artifact_kind": inputs.weights.kind, "artifact_sha256": inputs.weights.sha256,
        "tokenizer": str(inputs.tokenizer), "attn_backend": inputs.attn_backend,
    }


def add_timings(record: dict[str, Any], phases, result: EvalResult) -> None:
    """The command's wall time by phase (timing.Phases), scoring's own phases beside it."""
    phases.add("scoring", result.seconds)
    record["timings_s"] = phases.as_dict()
    record["scoring_timings_s"] = result.timings


def timings_line(record: dict[str, Any]) -> str:
    inner = ", ".join(f"{name} {s:.1f}s" for name, s in record.get("scoring_timings_s", {}).items())
    line = "time: " + ", ".join(f"{name} {s:.1f}s" for name, s in record["timings_s"].items())
    return f"{line} (scoring: {inner})" if inner else line


def results_table(record: dict[str, Any], title: str) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("val_bpb", f"{record['val_bpb']:.8f}"),
        ("val_loss", f"{record['val_loss']:.8f}"),
        ("mode", record["mode"]),
        ("seq_len / stride", f"{record['seq_len']} / {record['stride']}"),
        ("windows per batch", str(record["batch_seqs"])),
        ("tokens scored", f"{record['tokens']:,}"),
        ("bytes", f"{record['bytes']:,}"),
        ("seconds", f"{record['seconds']:.2f}"),
        ("tokens / second", f"{record['tokens_per_second']:,.0f}"),
        ("artifact", f"{record['artifact']} ({record['artifact_kind']}, sha256 {record['artifact_sha256'][:16]})"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def report(record: dict[str, Any], title: str, as_json: bool) -> None:
    from ..artifacts import json_text

    if as_json:
        typer.echo(json_text(record))
    else:
        console.print(results_table(record, title))
    if "timings_s" in record:
        err_console.print(timings_line(record), highlight=False, soft_wrap=True)


@contextlib.contextmanager
def batch_progress(enabled: bool, label: str, compiling: bool = False) -> Iterator[Callable[[int, int], None] | None]:
    """A transient rich bar over batches on stderr, or no callback at all. With compiling,
    it says so until the first batch is done (compiling takes most of a first run's start)."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task(f"{label} (compiling)" if compiling else label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=label)

        yield update


# --- The stage --------------------------------------------------------------------------

@dataclass
class EvalReport:
    result: EvalResult
    record: dict[str, Any]  # what --json prints
    is_main: bool  # rank 0 (only it prints)


def evaluate_artifact(artifact: Path, data_dir: Path, *, stride: int | None = None, seq_len: int | None = None,
                      batch_seqs: int | None = None, tokenizer: Path | None = None, device: str = "auto",
                      attn_backend: str = "auto", score_once: bool = False, compile_model: bool | None = None,
                      fused: bool | None = None, show_progress: bool = False) -> EvalReport:
    """Score the artifact on DATA_DIR's validation shards (standard or sliding evaluation)."""
    from ..distributed import init_distributed, shutdown
    from ..eval_results import save_eval_result
    from ..evaluation import (batch_windows, evaluate_sliding, evaluate_standard, load_validation_tokens,
                              should_compile, should_fuse)
    from ..runtime import compiled
    from ..timing import Phases

    phases = Phases()
    ctx = init_distributed(device)
    try:
        with phases.timed("load"):
            inputs = load_inputs(artifact, data_dir, tokenizer, ctx, attn_backend)
        cfg = inputs.config
        seq_len = cfg.eval.eval_seq_len if seq_len is None else seq_len
        stride = cfg.eval.eval_stride if stride is None else stride
        batch_seqs = cfg.eval.eval_batch_seqs if batch_seqs is None else batch_seqs
        check_eval_settings(seq_len, stride, batch_seqs)
        # As the reference: the tokens are cut to whole sequences of the longer of the
        # training and evaluation lengths.
        with phases.timed("tokens"):
            val_tokens = load_validation_tokens(data_dir, max(cfg.train.train_seq_len, seq_len),
                                                cfg.model.vocab_size, inputs.data.shards("val"))
        standard = stride == 0 or stride == seq_len
        compile_model = should_compile(compile_model, ctx.device)
        compiling = compile_model or (not standard and should_fuse(fused, ctx.device))
        with batch_progress(show_progress and ctx.is_main, "eval", compiling=compiling) as progress:
            if standard:
                loss_fn = compiled(inputs.model, compile_model, autotune=False)
                batch = batch_windows(batch_seqs, cfg.model, seq_len, ctx.device, full_logits=True)
                result = evaluate_standard(loss_fn, val_tokens, inputs.luts, seq_len=seq_len,
                                           batch_tokens=batch * seq_len, device=ctx.device, rank=ctx.rank,
                                           world_size=ctx.world_size, progress=progress)
            else:
                result = evaluate_sliding(inputs.model, val_tokens, inputs.luts, seq_len=seq_len, stride=stride,
                                          batch_seqs=batch_seqs, device=ctx.device, rank=ctx.rank,
                                          world_size=ctx.world_size, score_once=score_once,
                                          compile_model=compile_model, fused=fused, progress=progress)
        record = eval_record(result, inputs, Path(artifact))
        if result.mode == "sliding":
            record["score_once"] = score_once
        add_timings(record, phases, result)
        if ctx.is_main:  # beside the artifact, for `compare` and `inspect`
            save_eval_result(Path(artifact), record)
        return EvalReport(result, record, ctx.is_main)
    finally:
        shutdown()


def check_eval_settings(seq_len: int, stride: int, batch_seqs: int) -> None:
    if seq_len < 1:
        raise ConfigError(f"--seq-len {seq_len} must be positive")
    if not 0 <= stride <= seq_len:
        raise ConfigError(f"--stride {stride} must be in 0..seq_len ({seq_len}); 0 or {seq_len} scores "
                          "consecutive sequences")
    if batch_seqs < 0:
        raise ConfigError(f"--batch-seqs {batch_seqs} must not be negative (0: as many as fit in memory)")


# --- Command-line options shared with eval-ttt ------------------------------------------

ArtifactArg = Annotated[Path, typer.Argument(
    help="A training run directory (its EMA weights), an export directory, or a .ptz.", show_default=False)]
DataOption = Annotated[Path, typer.Option(
    "--data", help="Directory with the fineweb_val_*.bin shards (and tokenizer.model).", show_default=False)]
SeqLenOption = Annotated[Optional[int], typer.Option(
    "--seq-len", help=option_help("Tokens per window.", FROM_ARTIFACT), show_default=False)]
BatchOption = Annotated[Optional[int], typer.Option(
    "--batch-seqs", help=option_help("Windows per forward pass; 0 = as many as fit in memory.", FROM_ARTIFACT),
    show_default=False)]
TokenizerOption = Annotated[Optional[Path], typer.Option(
    "--tokenizer", help=option_help("SentencePiece model for byte counts.", "DATA/tokenizer.model"),
    show_default=False)]
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu or cuda.")]
AttnOption = Annotated[str, typer.Option("--attn-backend", help="Attention kernels: auto, fa3, flex, triton or sdpa.")]
ScoreOnceOption = Annotated[bool, typer.Option(
    "--score-once", help="Score every token exactly once. The reference scores the last STRIDE tokens again "
    "in each of its final, shorter windows; by default so does this, to give its numbers.")]
CompileOption = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", help=option_help("torch.compile the model.", "on CUDA"), show_default=False)]
FusedOption = Annotated[Optional[bool], typer.Option(
    "--fused/--no-fused", help=option_help("Score sliding windows (and train eval-ttt's steps) with windowgpt's "
    "fused GPU kernels; --no-fused runs the model's torch code, its scoring compiled with --compile.",
    "on CUDA with Triton"), show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the results as JSON on stdout (and nothing else).")]


def show_progress_bars() -> bool:
    return err_console.is_terminal


@user_errors_exit_1
def command(
    artifact: ArtifactArg,
    data: DataOption,
    stride: Annotated[Optional[int], typer.Option(
        "--stride", help=option_help("Score the last STRIDE tokens of a window every STRIDE tokens; 0 or the "
        "sequence length = consecutive sequences.", FROM_ARTIFACT), show_default=False)] = None,
    seq_len: SeqLenOption = None,
    batch_seqs: BatchOption = None,
    tokenizer: TokenizerOption = None,
    device: DeviceOption = "auto",
    attn_backend: AttnOption = "auto",
    score_once: ScoreOnceOption = False,
    compile_model: CompileOption = None,
    fused: FusedOption = None,
    as_json: JsonOption = False,
) -> None:
    """Score an artifact on the validation shards: val_loss and val_bpb (standard or sliding window)."""
    out = evaluate_artifact(artifact, data, stride=stride, seq_len=seq_len, batch_seqs=batch_seqs,
                            tokenizer=tokenizer, device=device, attn_backend=attn_backend, score_once=score_once,
                            compile_model=compile_model, fused=fused, show_progress=show_progress_bars())
    if out.is_main:
        report(out.record, f"eval ({out.result.mode})", as_json)
