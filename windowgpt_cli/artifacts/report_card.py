"""`windowgpt report ARTIFACT`: one run's, export's or `.ptz`'s report card, in Markdown and
JSON: the settings that differ from the closest preset, the training's figures, every
score saved beside it, its bytes against the budget, where it came from, and its curves
when matplotlib is installed and the run's metrics are found.

Written beside the artifact: DIR/report.{md,json,png} for a run or export directory,
MODEL.ptz.report.{md,json,png} for a `.ptz`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..challenge import BUDGET_BYTES
from ..config import PRESETS, preset
from ..errors import ArtifactError
from ..storage.files import atomic_write_json, atomic_write_text, read_json, starts_with
from ..storage.outputs import claim_file
from .curves import is_plot, load_run_curves, write_plot
from .info import flat_settings
from .inspect import PACKED_CODE, eval_windows_text, inspect_artifact

CARD_KIND = "windowgpt.report_card"
CARD_MARK = "<!-- windowgpt report card -->"



def card_paths(artifact: Path) -> dict[str, Path]:
    artifact = Path(artifact)
    if artifact.is_dir():
        return {suffix: artifact / f"report.{suffix}" for suffix in ("md", "json", "png")}
    return {suffix: artifact.with_name(f"{artifact.name}.report.{suffix}") for suffix in ("md", "json", "png")}


def write_report_card(artifact: Path, budget: int = BUDGET_BYTES) -> dict[str, Any]:
    """Write the card's files beside the artifact; returns the JSON card (with `files`).
    Each file is claimed and the card rendered before any is written."""
    paths = card_paths(artifact)
    claim_file(paths["md"], "a report card", is_card_markdown, flag="the report")
    claim_file(paths["json"], "a report card", is_card_json, flag="the report")
    card = build_card(artifact, budget)
    run_dir = _curves_run(card)
    if run_dir is not None:
        claim_file(paths["png"], "a plot", is_plot, flag="the report")
    card["files"] = {"markdown": str(paths["md"]), "json": str(paths["json"]),
                     "curves": str(paths["png"]) if run_dir is not None else None}
    markdown = render_card(card)
    if run_dir is not None:
        write_plot([load_run_curves(run_dir)], paths["png"], flag="the report")
    atomic_write_json(paths["json"], card)
    atomic_write_text(paths["md"], markdown)
    return card


def build_card(artifact: Path, budget: int = BUDGET_BYTES) -> dict[str, Any]:
    record = inspect_artifact(artifact, budget)
    if record["kind"] == PACKED_CODE:
        raise ArtifactError(f"{artifact}: packed code, not a model (`windowgpt inspect` describes it)")
    name, changes = closest_preset(record["settings"])
    size = {"file_bytes": record["file_bytes"], "parameters": record["parameters"], "groups": record["groups"]}
    if record["kind"] == "ptz":
        size.update({k: record[k] for k in ("code_bytes", "code_counted", "code_from", "total_bytes", "budget_bytes",
                                            "within_budget")})
        size["headroom_bytes"] = record["budget_bytes"] - record["total_bytes"]
    return {
        "kind": CARD_KIND, "artifact": record["artifact"], "artifact_kind": record["kind"],
        "sha256": record["sha256"], "step": record["step"], "training_time_ms": record["training_time_ms"],
        "closest_preset": name, "settings_changed": changes, "training": record["training"],
        "evaluations": record["evals"], "size": size, "lineage": record["lineage"], "run_dir": record["run_dir"],
    }


def closest_preset(settings: dict[str, Any]) -> tuple[str, dict[str, dict[str, Any]]]:
    """The preset the settings differ least from, and those differences."""
    best: tuple[str, dict[str, dict[str, Any]]] | None = None
    for name in PRESETS:
        base = flat_settings(preset(name))
        changes = {k: {"value": v, "preset": base.get(k)} for k, v in settings.items()
                   if v != base.get(k) and k != "model.rope_train_seq_len"}  # derived from the sequence lengths
        if best is None or len(changes) < len(best[1]):
            best = (name, changes)
    assert best is not None
    return best


def _curves_run(card: dict[str, Any]) -> Path | None:
    """The run whose curves the card draws: where the run's metrics and matplotlib (the plot
    extra) are there."""
    run_dir = card["run_dir"]
    if run_dir is None or not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    return Path(run_dir) if importlib.util.find_spec("matplotlib") is not None else None


def render_card(card: dict[str, Any]) -> str:
    kind = {"run": "training run", "export": "export", "ptz": "quantized model (.ptz)"}[card["artifact_kind"]]
    lines = [CARD_MARK, f"# {Path(card['artifact']).name}: report card", "",
             f"A windowgpt {kind}: `{card['artifact']}`", "", f"sha256 `{card['sha256']}`", ""]
    if card["step"] is not None:
        seconds = card["training_time_ms"]
        lines += [f"Trained {card['step']:,} steps" + (f" in {seconds / 1000:.1f} s" if seconds else "") + ".", ""]
    lines += ["## Scores", "", "| what | val_bpb | val_loss |", "| --- | ---: | ---: |"]
    training = card["training"] or {}
    for label, bpb, loss in (("end of training", "val_bpb", "val_loss"),
                             ("end of training, EMA weights", "post_ema_val_bpb", "post_ema_val_loss")):
        if training.get(bpb) is not None:
            lines.append(f"| {label} | {training[bpb]:.6f} | {_number(training.get(loss))} |")
    for mode, e in card["evaluations"].items():
        lines.append(f"| eval {mode} ({eval_windows_text(mode, e)}) | {e['val_bpb']:.6f} | "
                     f"{_number(e.get('val_loss'))} |")
    if not training and not card["evaluations"]:
        lines.append("| (none saved: run `windowgpt eval`) | | |")
    lines += ["", "## Size", ""]
    size = card["size"]
    lines.append(f"{size['parameters']:,} parameters; {size['file_bytes']:,} bytes on disk.")
    if "total_bytes" in size:
        verdict = "within" if size["within_budget"] else "**over**"
        lines.append(f"With the code ({size['code_bytes']:,} bytes): {size['total_bytes']:,} of "
                     f"{size['budget_bytes']:,} bytes, {verdict} the budget ({size['headroom_bytes']:,} to spare). "
                     f"The code counted: {size.get('code_counted') or 'not recorded'} (from {size.get('code_from')}).")
    else:
        lines.append("Not quantized: `windowgpt quantize` gives the bytes that count against the budget.")
    lines += ["", "| group | tensors | parameters | bytes |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {g} | {v['tensors']} | {v['params']:,} | {v['bytes']:,} |" for g, v in size["groups"].items()]
    lines += ["", f"## Settings that differ from the {card['closest_preset']} preset", ""]
    if card["settings_changed"]:
        lines += ["| setting | value | preset |", "| --- | --- | --- |"]
        lines += [f"| {k} | {_number(c['value'])} | {_number(c['preset'])} |"
                  for k, c in card["settings_changed"].items()]
    else:
        lines.append("None.")
    if card["lineage"]:
        lines += ["", "## Lineage", ""] + [f"- {k}: `{v}`" for k, v in card["lineage"].items()]
    if card["files"].get("curves"):
        lines += ["", "## Curves", "", f"![curves]({Path(card['files']['curves']).name})"]
    return "\n".join(lines) + "\n"


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def is_card_json(path: Path) -> bool:
    return (read_json(path) or {}).get("kind") == CARD_KIND


def is_card_markdown(path: Path) -> bool:
    return starts_with(path, CARD_MARK)
