"""`windowgpt eval-ttt`: score-first test-time training on an artifact (`eval.evaluate`)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .evaluate import EVAL_FLAG_ALIASES, SCORING_OPTIONS, ArtifactArg, DataOption, JsonOption, progress_display, report
from .support import console, err_console, user_errors_exit_1, with_config_flags, with_options

if TYPE_CHECKING:
    from ..eval.ttt import ChunkProgress



@contextlib.contextmanager
def chunk_progress(compiling: bool) -> Iterator[Callable[[ChunkProgress], None]]:
    """A rich bar over chunks with the running bpb (until the first chunk is scored: whether
    the scorer is compiling)."""
    with Progress(TextColumn("[bold]ttt"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("bpb {task.fields[bpb]}"), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task("ttt", total=None, bpb="- (compiling)" if compiling else "-")

        def update_bar(info: ChunkProgress) -> None:
            progress.update(task, completed=info.chunk, total=info.num_chunks, bpb=f"{info.val_bpb:.6f}")

        yield update_bar


@user_errors_exit_1
@with_config_flags("eval", "ttt", from_artifact=True, leave_out=("eval_seq_len",),
                   aliases={**EVAL_FLAG_ALIASES, "ttt_seq_len": ("--seq-len",)})
@with_options("scoring", SCORING_OPTIONS)
def command(
    artifact: ArtifactArg,
    data: DataOption,
    as_json: JsonOption = False,
    scoring: dict[str, Any] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Score an artifact with score-first test-time training (settings default to the artifact's)."""
    from ..eval.evaluate import ttt_evaluate_artifact  # imports torch: only when the command runs

    log_console = err_console if as_json else console
    out = ttt_evaluate_artifact(artifact, data, settings=overrides, **(scoring or {}),
                                progress=progress_display(chunk_progress),
                                echo=lambda line: log_console.print(line, highlight=False, soft_wrap=True))
    if out.is_main:
        report(out.record, "eval-ttt (score-first test-time training)", as_json)
