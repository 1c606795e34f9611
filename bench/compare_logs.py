"""Compare the reference's and windowgpt's training logs.

usage: compare_logs.py WORK_DIR                        (the layout bench/train_parity.sh writes)
       compare_logs.py --reference LOG --ours LOG      (one parity pair)
"""
import argparse
import re
from pathlib import Path

TRAIN = re.compile(r"step:(\d+)/\d+ train_loss:([\d.]+) train_time:\d+ms step_avg:([\d.]+)ms")
VAL = re.compile(r"step:(\d+)/\d+ val_loss:([\d.]+) val_bpb:([\d.]+)")
REFERENCE_FINALS = re.compile(r"^(final_int6_\w+|DIAGNOSTIC post_ema) .*$", re.M)


def parse(path: Path) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    text = path.read_text(errors="replace") if path.exists() else ""
    losses = {int(m[1]): float(m[2]) for m in TRAIN.finditer(text)}
    avgs = {int(m[1]): float(m[3]) for m in TRAIN.finditer(text)}
    bpb = {int(m[1]): float(m[3]) for m in VAL.finditer(text)}
    return losses, avgs, bpb


def _row(label: str, r: float | None, o: float | None) -> str:
    diff = f"{abs(r - o):.4f}" if r is not None and o is not None else "-"
    return f"{label:>14} {r if r is not None else '-':>10} {o if o is not None else '-':>10} {diff:>8}"


def parity(reference: Path, ours: Path) -> None:
    ref_l, _, ref_b = parse(reference)
    our_l, _, our_b = parse(ours)
    last = max(ref_b, default=None)
    print(f"parity ({reference.name} vs {ours.name}):")
    print(f"{'':>14} {'reference':>10} {'windowgpt':>10} {'|diff|':>8}")
    for step in (50, 100, 200):
        print(_row(f"train_loss@{step}", ref_l.get(step), our_l.get(step)))
    if last is not None:
        print(_row(f"val_bpb@{last}", ref_b.get(last), our_b.get(last)))
    if reference.exists():
        for match in REFERENCE_FINALS.finditer(reference.read_text(errors="replace")):
            print("reference:", match[0])


def step_time(reference: Path, ours: Path) -> None:
    _, ref_a, _ = parse(reference)
    _, our_a, _ = parse(ours)
    last = max(set(ref_a) & set(our_a), default=None)
    if last is None or 10 not in ref_a or 10 not in our_a:
        print("step time: missing logs")
        return

    def window(avgs):  # step_avg is cumulative: this is the average over steps 11..last
        return (avgs[last] * last - avgs[10] * 10) / (last - 10)

    r, o = window(ref_a), window(our_a)
    print(f"step time (steps 11-{last}): reference {r:.1f} ms, windowgpt {o:.1f} ms, ratio {o / r:.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work", nargs="?", type=Path)
    p.add_argument("--reference", type=Path)
    p.add_argument("--ours", type=Path)
    a = p.parse_args()
    if a.work is not None:
        parity(a.work / "ref_parity.log", a.work / "ours_parity.log")
        step_time(a.work / "ref_steptime.log", a.work / "ours_steptime.log")
    else:
        parity(a.reference, a.ours)


if __name__ == "__main__":
    main()
