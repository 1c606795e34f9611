"""`windowgpt report`: the record report of a `make record` run and its rule checks, or the
report card of one run, export or `.ptz` (`artifacts.report_card`)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from ..config import check_settings
from ..errors import ArtifactError, RecordError
from ..record.rules import FAIL, PASS, RECORD_JSON, RECORD_README, Rules, failed_checks, is_record_out, write_report
from .support import console, user_errors_exit_1

STATUS_STYLE = {PASS: "green", FAIL: "bold red"}


@user_errors_exit_1
def command(
    out: Annotated[Path, typer.Argument(
        metavar="PATH", help="The OUT directory of `make record` or `make smoke-gpu` (the record report), or a "
        "training run, an export or a .ptz (its report card, written beside it).", show_default=False)],
    train_budget: Annotated[float, typer.Option("--train-budget", help="Seconds allowed for training "
                            "plus GPTQ calibration.")] = Rules.train_seconds,
    eval_budget: Annotated[float, typer.Option("--eval-budget", help="Seconds allowed for evaluation "
                           "(sliding and TTT commands together).")] = Rules.eval_seconds,
    artifact_budget: Annotated[int, typer.Option("--artifact-budget", help="Bytes allowed for code plus "
                               "compressed model.")] = Rules.artifact_bytes,
    gpus: Annotated[int, typer.Option("--gpus", help="The GPU count the time limits are defined on.")] = Rules.gpus,
    json_output: Annotated[bool, typer.Option("--json", help="Print record.json instead of a table.")] = False,
) -> None:
    """Write a record run's OUT/record.json and OUT/README.md (exit 1 when it breaks a rule), or an
    artifact's report card.

    Example: windowgpt report demo-out/model.ptz
    """
    check_settings(train_budget=train_budget, eval_budget=eval_budget, artifact_budget=artifact_budget, gpus=gpus)
    if not is_record_out(out):
        _report_card(out, artifact_budget, json_output)
        return
    rules = Rules(train_seconds=train_budget, eval_seconds=eval_budget, artifact_bytes=artifact_budget, gpus=gpus)
    record = write_report(out, rules)
    if json_output:
        console.print_json(data=record)
    else:
        table = Table(title=f"record {out}: val_bpb {record['val_bpb']['sliding']:.8f} (sliding), "
                            f"{record['val_bpb']['ttt']:.8f} (TTT)")
        for column in ("rule", "status", "value", "limit", "note"):
            table.add_column(column)
        for c in record["checks"]:
            style = STATUS_STYLE.get(c["status"], "yellow")
            table.add_row(c["rule"], Text(c["status"], style=style), c["value"], c["limit"], c["note"])
        console.print(table)
        console.print(f"wrote {Path(out) / RECORD_JSON} and {Path(out) / RECORD_README}", highlight=False)
    failed = failed_checks(record)
    if failed:
        raise RecordError("the run breaks " + "; ".join(f"{c['rule']} ({c['value']} against {c['limit']})"
                                                        for c in failed))


def _report_card(artifact: Path, budget: int, json_output: bool) -> None:
    from ..artifacts.kinds import locate_artifact
    from ..artifacts.report_card import write_report_card  # imports torch: only when the command runs

    if Path(artifact).is_dir():  # a folder of neither kind: say every kind report takes
        try:
            locate_artifact(artifact)
        except ArtifactError:
            raise ArtifactError(f"{artifact}: neither the OUT directory of `make record` (a train/ folder inside) "
                                f"nor a run or export directory (checkpoint.pt, model.safetensors)") from None
    card = write_report_card(artifact, budget)
    if json_output:
        console.print_json(data=card)
        return
    files = card["files"]
    written = ", ".join(p for p in (files["markdown"], files["json"], files["curves"]) if p)
    scores = "; ".join(f"{mode} {e['val_bpb']:.6f}" for mode, e in card["evaluations"].items()) or "none saved"
    console.print(f"{card['artifact']}: val_bpb {scores}; {len(card['settings_changed'])} setting(s) differ "
                  f"from the {card['closest_preset']} preset; wrote {written}", highlight=False, soft_wrap=True)
