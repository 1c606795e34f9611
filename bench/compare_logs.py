"""Compare the reference's and windowgpt's training logs.

usage: compare_logs.py LOG_DIR... [--json PATH]    (the logs bench/train_parity.sh writes)
       compare_logs.py --reference LOG --ours LOG  (one parity pair)

With LOG_DIRs: reads ref_NAME.log and ours_NAME.log for NAME in record_786k, full_786k,
record_131k and parity (a later LOG_DIR's pair replaces an earlier one's, so that runs
split over several calls are put together), and gpu.txt (the GPU's name, else torch's
first CUDA device). Prints a markdown table and, with --json, writes

    {"gpu": NAME,
     "configs": {"record_786k": {"reference_ms": MS, "windowgpt_ms": MS, "ratio": R}, "full_786k": {...},
                 "record_131k": {...}},
     "parity": {"train_loss_50": [REF, OURS], "train_loss_100": [...], "train_loss_200": [...],
                "val_bpb": [REF, OURS]}}

A step time is the mean over steps 11..last, where last is the last step both logs hold
(the logs' step_avg is cumulative, and the first steps are the slowest); ratio is
windowgpt's over the reference's. Without a record_131k pair, record_131k's step time is
the parity run's (the same model and batch). val_bpb is each log's final validation.
Missing values are null.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_CONFIGS = ("record_786k", "full_786k", "record_131k")
PARITY = "parity"
PARITY_STEPS = (50, 100, 200)
UNTIMED_STEPS = 10  # steps 1..10 are left out of step times

TRAIN = re.compile(r"step:(\d+)/\d+ train_loss:([\d.]+) train_time:\d+ms step_avg:([\d.]+)ms")
VAL = re.compile(r"step:(\d+)/\d+ val_loss:([\d.]+) val_bpb:([\d.]+)")
REFERENCE_FINALS = re.compile(r"^(final_int6_\w+|DIAGNOSTIC post_ema) .*$", re.M)


@dataclass
class TrainLog:
    """What one training log says, by step."""

    train_loss: dict[int, float] = field(default_factory=dict)
    step_avg_ms: dict[int, float] = field(default_factory=dict)
    val_bpb: dict[int, float] = field(default_factory=dict)

    @property
    def final_val_bpb(self) -> float | None:
        return self.val_bpb[max(self.val_bpb)] if self.val_bpb else None


def parse_log(text: str) -> TrainLog:
    """The train and validation lines of a reference or windowgpt log (both print the same)."""
    log = TrainLog()
    for m in TRAIN.finditer(text):
        log.train_loss[int(m[1])] = float(m[2])
        log.step_avg_ms[int(m[1])] = float(m[3])
    for m in VAL.finditer(text):
        log.val_bpb[int(m[1])] = float(m[3])
    return log


def read_log(path: Path) -> TrainLog | None:
    return parse_log(path.read_text(errors="replace")) if path.is_file() else None


def mean_step_ms(step_avg_ms: dict[int, float], last: int) -> float | None:
    """The mean step time over steps 11..last, from the cumulative averages at 10 and last."""
    if last <= UNTIMED_STEPS or UNTIMED_STEPS not in step_avg_ms or last not in step_avg_ms:
        return None
    return (step_avg_ms[last] * last - step_avg_ms[UNTIMED_STEPS] * UNTIMED_STEPS) / (last - UNTIMED_STEPS)


def step_time(reference: TrainLog | None, ours: TrainLog | None) -> dict[str, float | None]:
    """Both step times over the same steps, and windowgpt's over the reference's."""
    none = {"reference_ms": None, "windowgpt_ms": None, "ratio": None}
    if reference is None or ours is None:
        return none
    last = max(set(reference.step_avg_ms) & set(ours.step_avg_ms), default=0)
    ref_ms, our_ms = mean_step_ms(reference.step_avg_ms, last), mean_step_ms(ours.step_avg_ms, last)
    if ref_ms is None or our_ms is None:
        return none
    return {"reference_ms": round(ref_ms, 2), "windowgpt_ms": round(our_ms, 2), "ratio": round(our_ms / ref_ms, 3)}


def parity(reference: TrainLog | None, ours: TrainLog | None) -> dict[str, list[float | None]]:
    """train_loss at PARITY_STEPS and the final val_bpb, each as [reference, windowgpt]."""
    logs = (reference or TrainLog(), ours or TrainLog())
    result: dict[str, list[float | None]] = {f"train_loss_{step}": [log.train_loss.get(step) for log in logs]
                                             for step in PARITY_STEPS}
    result["val_bpb"] = [log.final_val_bpb for log in logs]
    return result


Pair = tuple[TrainLog | None, TrainLog | None]


def read_pairs(log_dirs: list[Path]) -> dict[str, Pair]:
    """Each run's (reference, windowgpt) logs: the last directory holding both wins."""
    pairs: dict[str, Pair] = {}
    for log_dir in log_dirs:
        for name in (*STEP_CONFIGS, PARITY):
            reference, ours = read_log(log_dir / f"ref_{name}.log"), read_log(log_dir / f"ours_{name}.log")
            if reference is not None and ours is not None:
                pairs[name] = (reference, ours)
    return pairs


def assemble(gpu: str, pairs: dict[str, Pair]) -> dict[str, Any]:
    """bench/results/train_step_h200.json's object (shape in the module's docstring)."""
    configs = {}
    for name in STEP_CONFIGS:
        source = name if name in pairs or name != "record_131k" else PARITY
        configs[name] = step_time(*pairs.get(source, (None, None)))
    return {"gpu": gpu, "configs": configs, "parity": parity(*pairs.get(PARITY, (None, None)))}


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def step_table(configs: dict[str, dict[str, float | None]]) -> str:
    lines = ["| configuration | reference ms/step | windowgpt ms/step | windowgpt / reference |",
             "| --- | ---: | ---: | ---: |"]
    for name, row in configs.items():
        lines.append(f"| {name} | {_cell(row['reference_ms'], 1)} | {_cell(row['windowgpt_ms'], 1)} "
                     f"| {_cell(row['ratio'], 3)} |")
    return "\n".join(lines)


def parity_table(values: dict[str, list[float | None]]) -> str:
    lines = ["| parity (record model, 131,072 tokens/step) | reference | windowgpt | abs diff |",
             "| --- | ---: | ---: | ---: |"]
    for name, (ref, ours) in values.items():
        diff = abs(ref - ours) if ref is not None and ours is not None else None
        lines.append(f"| {name} | {_cell(ref, 4)} | {_cell(ours, 4)} | {_cell(diff, 4)} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The result as markdown: a title, the step times, then parity."""
    return "\n\n".join((f"Training step on {result['gpu']}", step_table(result["configs"]),
                         parity_table(result["parity"])))


def gpu_name(log_dirs: list[Path]) -> str:
    """gpu.txt's first line (the last directory's that has one), else torch's CUDA device 0."""
    for log_dir in reversed(log_dirs):
        path = log_dir / "gpu.txt"
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip().splitlines()[0].strip()
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown"


def print_parity(reference: Path, ours: Path) -> None:
    print(parity_table(parity(read_log(reference), read_log(ours))))
    if reference.is_file():
        for match in REFERENCE_FINALS.finditer(reference.read_text(errors="replace")):
            print("reference:", match[0])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log_dirs", nargs="*", type=Path, help="directories of ref_NAME.log / ours_NAME.log")
    p.add_argument("--json", type=Path, help="write the result here (atomically)")
    p.add_argument("--reference", type=Path, help="one reference log (with --ours): its parity only")
    p.add_argument("--ours", type=Path)
    a = p.parse_args(argv)
    if a.reference is not None or a.ours is not None:
        if a.reference is None or a.ours is None or a.log_dirs:
            p.error("--reference and --ours go together, without LOG_DIRs")
        print_parity(a.reference, a.ours)
        return
    if not a.log_dirs:
        p.error("give LOG_DIR(s), or --reference LOG --ours LOG")
    result = assemble(gpu_name(a.log_dirs), read_pairs(a.log_dirs))
    print(markdown(result))
    if a.json is not None:
        from windowgpt_cli.storage.files import atomic_write_json

        a.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(a.json, result)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
