"""The record report: what a record run scored, what it cost, and whether it kept the rules.

`make record` leaves in OUT: code.pyz (the packed code every record stage runs from),
train/ (config.json, summary.json, train.log), model.ptz and its report model.ptz.json,
eval.json (sliding, stride 64), eval-ttt.json, and STAGE.wall_s, the wall-clock seconds of
each stage's whole command. `write_report(OUT)` reads them and
writes OUT/record.json and OUT/README.md. The challenge's rules, as checked here:

- training, GPTQ calibration on training data included, takes at most 600 s on 8 GPUs;
- the artifact (code plus compressed model) holds at most 16,000,000 bytes;
- evaluation takes at most 600 s on 8 GPUs (here: both evaluation commands together);
- test-time training trains only on tokens already scored.

The time limits are defined on 8 GPUs: on another number they are marked not applicable.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..challenge import (
    AFTER_TRAINING,
    BUDGET_BYTES,
    EVAL_SECONDS,
    GPU_MODEL,
    GPUS,
    INSIDE_TRAINING,
    TRAIN_SECONDS,
    TTT_ORDER,
)
from ..errors import ArtifactError

# artifacts, calibration and evaluation import torch: the functions that need them import
# them, so that `windowgpt report --help` answers at once.

SUMMARY, CONFIG, QUANT_REPORT = "train/summary.json", "train/config.json", "model.ptz.json"
SLIDING, TTT = "eval.json", "eval-ttt.json"
RECORD_JSON, RECORD_README, PACKED_CODE = "record.json", "README.md", "code.pyz"
WALL_SUFFIX = ".wall_s"  # OUT/eval.wall_s: seconds of the whole `eval` command, written by make
TIMED_STAGES = ("train", "quantize", "eval", "eval-ttt")
PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "n/a"
README_MARK = "<!-- windowgpt report: rewritten by each run of `windowgpt report OUT` -->"


@dataclass(frozen=True)
class Rules:
    """The challenge's limits; tests lower them."""

    train_seconds: float = TRAIN_SECONDS
    eval_seconds: float = EVAL_SECONDS
    artifact_bytes: int = BUDGET_BYTES
    gpus: int = GPUS
    gpu_model: str = GPU_MODEL


@dataclass
class Check:
    rule: str
    status: str  # pass | fail | n/a
    value: str
    limit: str
    note: str = ""


@dataclass
class RunFiles:
    """The stages' outputs, as read from OUT."""

    summary: dict[str, Any]
    config: dict[str, Any]
    quant: dict[str, Any]
    sliding: dict[str, Any]
    ttt: dict[str, Any]
    wall: dict[str, float]  # stage -> whole-command seconds (the stages make timed)
    packed_code_sha256: str | None  # OUT/code.pyz's, if there is one


def is_record_out(path: Path) -> bool:
    """Whether a path is the OUT directory of `make record` (its stages' folders and files),
    rather than one run, export or .ptz."""
    path = Path(path)
    return path.is_dir() and (path / "train").is_dir() and not (path / "checkpoint.pt").exists()


def read_run(out: Path) -> RunFiles:
    from ..storage.files import sha256_file

    out = Path(out)
    docs = [_read_json(out / name) for name in (SUMMARY, CONFIG, QUANT_REPORT, SLIDING, TTT)]
    wall = {}
    for stage in TIMED_STAGES:
        path = out / f"{stage}{WALL_SUFFIX}"
        try:
            if path.is_file():
                wall[stage] = float(path.read_text().strip())
        except ValueError:
            raise ArtifactError(f"{path}: not a number of seconds") from None
    packed = out / PACKED_CODE
    return RunFiles(*docs, wall=wall, packed_code_sha256=sha256_file(packed) if packed.is_file() else None)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: the record report reads what `make record` writes into OUT")
    from ..storage.files import read_json_object

    return read_json_object(path)


# --- Figures -------------------------------------------------------------------------------

def training_seconds(run: RunFiles) -> dict[str, Any]:
    """Training time as the reference counts it (steps only, not warm-up, compilation or
    validation) plus GPTQ calibration, wherever it happened."""

    summary = run.summary
    train_s = summary["training_time_ms"] / 1000.0
    inside = (summary.get("calibration") or {}).get("seconds")
    after = run.quant["calibration_info"]["seconds"] if run.quant.get("calibration") == AFTER_TRAINING else None
    return {"training": train_s, "calibration_inside_training": inside, "calibration_after_training": after,
            "total": train_s + (inside or 0.0) + (after or 0.0), "steps": summary["step"],
            "max_wallclock_seconds": summary.get("max_wallclock_seconds"),
            "gptq_reserve_seconds": (summary.get("calibration") or {}).get("reserve_seconds"),
            "train_command_wall_seconds": run.wall.get("train")}


def evaluation_seconds(run: RunFiles) -> dict[str, Any]:
    """Each evaluation's whole-command wall time when make recorded it, else the scoring
    time the command reports (which leaves out start-up and loading)."""
    timed = all(stage in run.wall for stage in ("eval", "eval-ttt"))
    sliding = run.wall["eval"] if timed else run.sliding["seconds"]
    ttt = run.wall["eval-ttt"] if timed else run.ttt["seconds"]
    how = ("wall time of each whole command, recorded by make" if timed
           else "scoring time reported by each command (no wall time recorded)")
    return {"sliding": sliding, "ttt": ttt, "total": sliding + ttt, "measured": how}


def hardware(run: RunFiles) -> dict[str, Any]:
    devices = run.summary.get("devices") or []
    return {"world_size": run.summary.get("world_size", len(devices)), "devices": devices}


# --- Checks --------------------------------------------------------------------------------

def check_rules(run: RunFiles, rules: Rules) -> list[Check]:
    hw, train, evals = hardware(run), training_seconds(run), evaluation_seconds(run)
    gpus = hw["world_size"]
    timed_here = gpus == rules.gpus
    not_here = f"not applicable on {gpus} GPU{'s' if gpus != 1 else ''}"
    checks = [
        _limit("training + GPTQ calibration", train["total"], rules.train_seconds, "s", timed_here, not_here),
        _calibration_check(run),
        _limit("artifact (code + compressed model)", run.quant["model_bytes"] + run.quant["code_bytes"],
               rules.artifact_bytes, "bytes", True, ""),
        _limit("evaluation (sliding + TTT)", evals["total"], rules.eval_seconds, "s", timed_here, not_here),
        _ttt_order_check(run),
        _same_artifact_check(run),
        _packed_code_check(run),
        _hardware_check(hw, rules),
    ]
    return checks


def _limit(rule: str, value: float, limit: float, unit: str, applies: bool, why_not: str) -> Check:
    shown = (f"{value:,.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}")
    limit_shown = (f"{limit:,.0f} {unit}" if unit == "bytes" else f"{limit:.0f} {unit}")
    if not applies:
        return Check(rule, NOT_APPLICABLE, shown, limit_shown, why_not)
    return Check(rule, PASS if value <= limit else FAIL, shown, limit_shown)


def _calibration_check(run: RunFiles) -> Check:

    where = run.quant.get("calibration")
    rule = "GPTQ calibrated inside the training budget"
    if where is None:
        return Check(rule, NOT_APPLICABLE, "no GPTQ", INSIDE_TRAINING, "rounding to nearest needs no calibration")
    note = "" if where == INSIDE_TRAINING else "calibration on training data counts as training"
    return Check(rule, PASS if where == INSIDE_TRAINING else FAIL, where, INSIDE_TRAINING, note)


def _ttt_order_check(run: RunFiles) -> Check:

    order = run.ttt.get("ttt_order")
    note = "" if order else "the eval-ttt record does not state its order"
    return Check("TTT trains only on tokens already scored", PASS if order == TTT_ORDER else FAIL,
                 str(order), TTT_ORDER, note)


def _same_artifact_check(run: RunFiles) -> Check:
    measured = run.quant["sha256"]
    scored = {run.sliding.get("artifact_sha256"), run.ttt.get("artifact_sha256")}
    ok = scored == {measured}
    return Check("the evaluated artifact is the one measured", PASS if ok else FAIL,
                 "same sha256" if ok else "different sha256", measured[:16],
                 "" if ok else "eval or eval-ttt scored another file than model.ptz")


def _packed_code_check(run: RunFiles) -> Check:
    rule = f"the code counted is the packed {PACKED_CODE}"
    counted = run.quant.get("code_sha256")
    if counted is None:
        return Check(rule, NOT_APPLICABLE, "source counted", PACKED_CODE,
                     "quantize ran from the source tree: its uncompressed source was counted")
    ok = counted == run.packed_code_sha256
    return Check(rule, PASS if ok else FAIL, "same sha256" if ok else "different sha256", counted[:16],
                 "" if ok else f"quantize ran from {run.quant.get('code_archive')}, not from OUT/{PACKED_CODE}")


def _hardware_check(hw: dict[str, Any], rules: Rules) -> Check:
    names = sorted(set(hw["devices"]))
    shown = f"{hw['world_size']} x {', '.join(names) or '?'}"
    limit = f"{rules.gpus} x {rules.gpu_model}"
    if hw["world_size"] == rules.gpus and names and all(rules.gpu_model in name for name in names):
        return Check("hardware", PASS, shown, limit)
    return Check("hardware", NOT_APPLICABLE, shown, limit, "the time limits are defined on " + limit)


# --- The report ----------------------------------------------------------------------------

def build_record(out: Path, rules: Rules = Rules()) -> dict[str, Any]:
    run = read_run(out)
    checks = check_rules(run, rules)
    q = run.quant
    return {
        "out": str(out),
        "val_bpb": {"sliding": run.sliding["val_bpb"], "sliding_stride": run.sliding.get("stride"),
                    "ttt": run.ttt["val_bpb"]},
        "bytes": {"model": q["model_bytes"], "code": q["code_bytes"], "total": q["model_bytes"] + q["code_bytes"],
                  "budget": rules.artifact_bytes, "code_counted": q.get("code_counted"),
                  "code_files": q.get("code_modules"), "code_source": q.get("code_source_bytes"),
                  "code_archive": q.get("code_archive")},
        "training_seconds": training_seconds(run),
        "evaluation_seconds": evaluation_seconds(run),
        "stage_wall_seconds": run.wall,
        "steps": run.summary["step"],
        "hardware": hardware(run),
        "gptq": {"calibration": q.get("calibration"), **(q.get("calibration_info") or {})},
        "settings": {"config": run.config, "ttt": run.ttt.get("ttt"), "compressor": q.get("compressor"),
                     "clip_range": q.get("clip_range"), "eval_stride": run.sliding.get("stride")},
        "rules": asdict(rules),
        "checks": [asdict(c) for c in checks],
        "passed": all(c.status != FAIL for c in checks),
    }


def write_report(out: Path, rules: Rules = Rules()) -> dict[str, Any]:
    """Write OUT/record.json and OUT/README.md; returns the record."""
    from ..storage.files import atomic_write_json, atomic_write_text
    from ..storage.outputs import claim_file

    out = Path(out)
    claim_file(out / RECORD_JSON, "a record report", is_record_json, flag="the report")
    claim_file(out / RECORD_README, "a record report", is_record_readme, flag="the report")
    record = build_record(out, rules)
    atomic_write_json(out / RECORD_JSON, record)
    atomic_write_text(out / RECORD_README, render_markdown(record))
    return record


def is_record_json(path: Path) -> bool:
    from ..storage.files import read_json

    return {"checks", "val_bpb", "passed"} <= set(read_json(path) or {})


def is_record_readme(path: Path) -> bool:
    from ..storage.files import starts_with

    return starts_with(path, README_MARK)


def failed_checks(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in record["checks"] if c["status"] == FAIL]


def render_markdown(record: dict[str, Any]) -> str:
    t, e, b, hw = record["training_seconds"], record["evaluation_seconds"], record["bytes"], record["hardware"]
    cfg = record["settings"]["config"]
    verdict = "keeps every rule checked" if record["passed"] else "BREAKS A RULE"
    devices = ", ".join(sorted(set(hw["devices"]))) or "?"
    lines = [
        README_MARK,
        f"# Record run: {record['out']}",
        "",
        f"The run {verdict} (`windowgpt report`).",
        "",
        "| result | value |",
        "| --- | --- |",
        f"| val_bpb, sliding windows (stride {record['val_bpb']['sliding_stride']}) "
        f"| {record['val_bpb']['sliding']:.8f} |",
        f"| val_bpb, score-first TTT | {record['val_bpb']['ttt']:.8f} |",
        f"| compressed model | {b['model']:,} bytes |",
        f"| code: {b['code_counted']} | {_code_cell(b)} |",
        f"| total / budget | {b['total']:,} / {b['budget']:,} bytes |",
        f"| training steps | {record['steps']:,} |",
        f"| training time (steps only) | {t['training']:.1f} s |",
        f"| GPTQ calibration | {_calibration_cell(record)} |",
        f"| training + calibration | {t['total']:.1f} s |",
        f"| evaluation: sliding / TTT | {e['sliding']:.1f} s / {e['ttt']:.1f} s ({e['measured']}) |",
        f"| GPUs | {hw['world_size']} x {devices} |",
        f"| whole commands' wall times | {_wall_cell(record['stage_wall_seconds'])} |",
        "",
        "## Checks",
        "",
        "| rule | status | value | limit | note |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {c['rule']} | {c['status']} | {c['value']} | {c['limit']} | {c['note']} |" for c in record["checks"]),
        "",
        "## Settings",
        "",
        "| setting | value |",
        "| --- | --- |",
        *(f"| {name} | {value} |" for name, value in _key_settings(cfg, record["settings"])),
        "",
        "The whole configuration is in record.json (`settings`). Training time is the reference's "
        "`train_time` (optimizer steps, without warm-up steps, compilation or validation) plus GPTQ's "
        "calibration on training data.",
        "",
    ]
    return "\n".join(lines)


def _code_cell(b: dict[str, Any]) -> str:
    if b["code_archive"] and b["code_source"]:
        return f"{b['code']:,} bytes (its source uncompressed: {b['code_source']:,} bytes)"
    return f"{b['code']:,} bytes"


def _wall_cell(wall: dict[str, float]) -> str:
    return ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in wall.items()) or "not recorded"


def _calibration_cell(record: dict[str, Any]) -> str:
    g = record["gptq"]
    if g["calibration"] is None:
        return "none (rounding to nearest)"
    return f"{g['calibration']}: {g['batches']} batches, {g['tokens']:,} tokens, {g['seconds']:.1f} s"


def _key_settings(cfg: dict[str, Any], settings: dict[str, Any]) -> list[tuple[str, Any]]:
    m, t, q = cfg.get("model", {}), cfg.get("train", {}), cfg.get("quant", {})
    ttt = settings.get("ttt") or {}
    return [
        ("layers x width", f"{m.get('num_layers')} x {m.get('model_dim')}"),
        ("window attention", f"{m.get('window_attn_size')} tokens, {m.get('num_sink_tokens')} sink tokens, "
                             f"layers {m.get('window_attn_layers')}"),
        ("iterations / batch tokens / sequence", f"{t.get('iterations')} / {t.get('train_batch_tokens')} / "
                                                 f"{t.get('train_seq_len')}"),
        ("wallclock cap / GPTQ reserve", f"{t.get('max_wallclock_seconds')} s / {q.get('gptq_reserve_seconds')} s"),
        ("GPTQ calibration batches", q.get("gptq_calib_samples")),
        ("compressor / int6 clip", f"{settings.get('compressor')} / {settings.get('clip_range')}"),
        ("TTT lr / epochs / chunk tokens / frozen blocks",
         f"{ttt.get('ttt_lr')} / {ttt.get('ttt_epochs')} / {ttt.get('ttt_chunk_tokens')} / "
         f"{ttt.get('ttt_freeze_blocks')}"),
    ]
