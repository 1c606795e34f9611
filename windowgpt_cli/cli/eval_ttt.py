"""`windowgpt eval-ttt`: score-first test-time training on an artifact (`eval.evaluate`)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .evaluate import EVAL_FLAG_ALIASES, SCORING_OPTIONS, ArtifactArg, DataOption, JsonOption, progress_display, report
from .support import console, err_console, user_errors_exit_1, with_config_flags, with_options

if TYPE_CHECKING:
    from ..eval.ttt import ChunkProgress



class LogAndBar:
    """eval-ttt's log lines and its bar over chunks (with the running bpb; until the first
    chunk is scored, whether the scorer is compiling). While the bar is up, the log's lines
    are printed above it on its console, never onto its line."""

    def __init__(self, log_console: Console):
        self.log_console = log_console
        self.bar: Progress | None = None

    def line(self, text: str) -> None:
        target = self.bar.console if self.bar is not None and self.log_console.is_terminal else self.log_console
        target.print(text, highlight=False, soft_wrap=True)

    @contextlib.contextmanager
    def chunks(self, compiling: bool) -> Iterator[Callable[[ChunkProgress], None]]:
        with Progress(TextColumn("[bold]ttt"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("bpb {task.fields[bpb]}"), TimeElapsedColumn(),
                      console=err_console, transient=True) as progress:
            task = progress.add_task("ttt", total=None, bpb="- (compiling)" if compiling else "-")

            def update_bar(info: ChunkProgress) -> None:
                progress.update(task, completed=info.chunk, total=info.num_chunks, bpb=f"{info.val_bpb:.6f}")

            self.bar = progress
            try:
                yield update_bar
            finally:
                self.bar = None


@user_errors_exit_1
@with_config_flags("eval", "ttt", from_artifact=True, leave_out=("eval_seq_len",),
                   aliases={**EVAL_FLAG_ALIASES, "ttt_seq_len": ("--seq-len",), "ttt_method": ("--method",)})
@with_options("scoring", SCORING_OPTIONS)
def command(
    artifact: ArtifactArg,
    data: DataOption,
    as_json: JsonOption = False,
    scoring: dict[str, Any] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Score an artifact with score-first test-time training (settings default to the artifact's).

    Example: windowgpt eval-ttt demo-out/model.ptz --data demo-out/data
    """
    from ..eval.evaluate import ttt_evaluate_artifact  # imports torch: only when the command runs

    output = LogAndBar(err_console if as_json else console)
    out = ttt_evaluate_artifact(artifact, data, settings=overrides, **(scoring or {}),
                                progress=progress_display(output.chunks), echo=output.line)
    if out.is_main:
        report(out.record, "eval-ttt (score-first test-time training)", as_json)
