"""bench/train_variants.sh's profiles side by side: per variant (a bench/train_profile.py
JSON in LOG_DIR, named after the variant) the step's wall time, its ratio to the first
variant's, and each category's GPU time.

    python3 bench/train_variants.py LOG_DIR [--first NAME]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_profile import CATEGORIES  # noqa: E402


def profiles(folder: Path) -> dict[str, dict]:
    """Each train_profile.py JSON in folder by its name, in the order they were written."""
    found = {}
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
        data = json.loads(path.read_text())
        if "step_wall_ms" in data and "categories_ms" in data:
            found[path.stem] = data
    return found


def table(runs: dict[str, dict], first: str | None = None) -> str:
    """A markdown table: a row per variant, the step's ms, its ratio to `first`'s (or the
    first variant's), and the categories any variant spent time in."""
    if not runs:
        return "no profiles"
    base = runs[first] if first else next(iter(runs.values()))
    shown = [c for c in CATEGORIES if any(r["categories_ms"].get(c, 0) for r in runs.values())]
    rows = [["variant", "step ms", "ratio", *shown], ["---", *("---:" for _ in range(2 + len(shown)))]]
    for name, run in runs.items():
        rows.append([name, f"{run['step_wall_ms']:.1f}", f"{run['step_wall_ms'] / base['step_wall_ms']:.3f}",
                     *(f"{run['categories_ms'].get(c, 0.0):.1f}" for c in shown)])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path)
    parser.add_argument("--first", help="the variant the ratios compare with (default: the first written)")
    args = parser.parse_args()
    runs = profiles(args.logs)
    if args.first is not None and args.first not in runs:
        parser.error(f"--first {args.first}: no such variant in {args.logs} ({', '.join(runs) or 'none'})")
    print(table(runs, args.first))


if __name__ == "__main__":
    main()
