"""Where the GPU sat idle in the training steps of a trace kept by `bench/train_profile.py
--trace` (the same as its --gaps, from the file alone, on any machine).

    python3 bench/trace_idle.py TRACE [--gaps 20] [--json PATH]

TRACE is the profiler's Chrome trace (.json or .json.gz). Prints each profiled step's idle
time among its GPU activities (kernels, fills and copies, counted by kind; a step's idle
time starts where the step before left the GPU), the idle time per step by the phase of the
activity that ended each stretch, and the --gaps longest stretches with the activities
around them; --json PATH writes the same as JSON.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mix_order_kernels import inputs_and_output_usable, print_and_write, trace_events  # noqa: E402
from train_profile import idle_lines, idle_stretches  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="The profiled steps' Chrome trace (.json or .json.gz).")
    parser.add_argument("--gaps", type=int, default=20, help="Longest stretches of GPU idle time listed.")
    parser.add_argument("--json", type=Path, help="Write the result as JSON here.")
    args = parser.parse_args(argv)
    if args.gaps < 0:
        parser.error("--gaps must be at least 0")
    if not inputs_and_output_usable([args.trace], args.json):
        return 1
    events = trace_events(args.trace)
    if events is None:
        return 1
    idle = idle_stretches(events, args.gaps)
    print_and_write("\n".join(idle_lines(idle)), idle, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
