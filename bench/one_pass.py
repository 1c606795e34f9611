"""What the benches that time kernels at one forward pass of the record step share (two
micro-batches of 48 x 2,048 positions on one H200): their common arguments, the checks of
them, the pass's random inputs, a relative difference, an error's line and the report, a
JSON object printed and, with --json, written to a file."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Callable

import torch

SEQ_LEN = 2048
PASS_POSITIONS = 196_608


def pass_randn(positions: int, device: str = "cuda") -> Callable[..., torch.Tensor]:
    """randn(*shape): bfloat16 normal draws [batch, SEQ_LEN, *shape] of one pass of `positions`,
    from a generator seeded by them (the same numbers on each run)."""
    generator = torch.Generator(device=device).manual_seed(positions)
    batch = positions // SEQ_LEN

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(batch, SEQ_LEN, *shape, device=device, generator=generator).bfloat16()

    return randn


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of got from want, as a fraction of want's largest magnitude."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def error_line(error: Exception) -> str:
    """An error's type and first line, for a bench's JSON: a way that cannot build or run is
    reported beside the others (without the terminal colours CUTLASS's DSL writes)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def pass_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--positions", type=int, default=PASS_POSITIONS,
                   help=f"positions of one pass (a multiple of {SEQ_LEN:,})")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path)
    return p


def check_pass_args(args: argparse.Namespace, script: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    if args.positions <= 0 or args.positions % SEQ_LEN:
        raise SystemExit(f"--positions must be a positive multiple of {SEQ_LEN}")
    if args.repeats <= 0:
        raise SystemExit("--repeats must be positive")


def report(result: dict, path: Path | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        path.write_text(text + "\n")
