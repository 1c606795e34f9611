"""The heads' kernels (`train --fused-head-prep`) as a Hopper GPU would run them, counted on
any machine, no GPU needed: for each launch shape given, the forward
(`elementwise._head_prep_kernel`) and the backward
(`elementwise_backward._head_prep_backward_kernel`) built for sm_90 at the record model's
heads (64 channels, 16 of them rotated): the registers a thread takes and the bytes it
spills, as a launch builds the kernel, and the instructions of one turn of its loop over a
position's heads, in all and by kind, on the path of the queries (with their gain) and of
the keys (without), each head stored once.

    python bench/head_kernels_sass.py [--launches 16x4,16x4s] [--json PATH]

A turn handles one head at POSITIONS positions, each thread `channels_a_thread` of its
values: its instructions lie between a head's load and the next head's, and the registers
say how many programs share a multiprocessor. Launches as bench/head_kernels_speed.py takes
them (16x4s: the forward's rotated channels apart). Prints a table; --json writes the JSON.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from head_kernels_speed import parse_launches  # noqa: E402
from hopper_sass import compile_for_hopper, longest_loop, opcodes, registers, sass_lines  # noqa: E402
from mix_order_kernels import print_and_write  # noqa: E402
from windowgpt_cli.kernels import elementwise, elementwise_backward  # noqa: E402
from windowgpt_cli.kernels.elementwise import HeadLaunch  # noqa: E402

HEAD_DIM, ROPE_HALF = 64, 8
KINDS = {  # opcode -> kind, the rest "other"
    **dict.fromkeys(("FMUL", "FADD", "FFMA", "FMNMX", "MUFU", "FSEL", "FSETP"), "float"),
    **dict.fromkeys(("F2F", "F2FP", "PRMT"), "conversion"),
    **dict.fromkeys(("SHFL",), "shuffle"),
    **dict.fromkeys(("LDG", "STG", "LDS", "STS", "LDC", "ULDC"), "memory"),
    **dict.fromkeys(("IMAD", "IADD3", "LEA", "ISETP", "SHF", "LOP3", "SEL", "MOV", "IABS", "UIADD3", "UIMAD"),
                    "integer"),
}
# pointers, and the strides that a launch at the record step's shapes passes as multiples of 16
ALIGNED = ("x_ptr", "cos_ptr", "sin_ptr", "gain_ptr", "out_ptr", "grad_ptr", "dx_ptr", "gain_rows_ptr", "x_stride",
           "dx_stride", "cos_seq_stride")


def head_arg_types(name: str) -> str:
    """The type of each argument of the heads' kernels that a build does not fix."""
    if name.endswith("_ptr"):
        return "*fp32" if name in ("cos_ptr", "sin_ptr", "gain_ptr", "gain_rows_ptr") else "*bf16"
    return "fp32" if name == "eps" else "i32"


def build_figures(kernel, launch: HeadLaunch, has_gain: bool) -> dict:
    """Registers and spilled bytes of the kernel as a launch builds it (copies and has_gain
    run-time values), and the instructions of one turn of its loop on the path a launch with
    one copy and has_gain takes (the two fixed, so the build holds that path alone)."""
    constants = {"HEAD_DIM": HEAD_DIM, "ROPE_HALF": ROPE_HALF, "POSITIONS": launch.positions,
                 "ROTATED_APART": launch.rotated_apart}
    constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
    regs, local = registers(compile_for_hopper(kernel, head_arg_types, constants, launch.warps, 3, ALIGNED))
    turn = compile_for_hopper(kernel, head_arg_types, {**constants, "copies": 1, "has_gain": int(has_gain)},
                              launch.warps, 3, ALIGNED)
    loop = longest_loop(sass_lines(turn))
    kinds: dict[str, int] = {}
    for opcode, count in opcodes(loop).items():
        kinds[KINDS.get(opcode, "other")] = kinds.get(KINDS.get(opcode, "other"), 0) + count
    channels = launch.positions * HEAD_DIM // (launch.warps * 32)
    return {"registers": regs, "local_bytes": local, "loop_instructions": len(loop),
            "channels_a_thread": channels, "instructions_a_channel": round(len(loop) / channels, 1),
            "by_kind": dict(sorted(kinds.items()))}


def measure(launches: list[HeadLaunch]) -> dict:
    result = {"target": "sm_90", "head_dim": HEAD_DIM, "rotated_channels": 2 * ROPE_HALF, "launches": []}
    for launch in launches:
        figures = {"launch": launch.name}
        for direction, kernel in (("forward", elementwise._head_prep_kernel),
                                  ("backward", elementwise_backward._head_prep_backward_kernel)):
            for heads, has_gain in (("queries", True), ("keys", False)):
                figures[f"{direction}_{heads}"] = build_figures(kernel, launch, has_gain)
        result["launches"].append(figures)
    return result


COLUMNS = "launch  kernel            registers  spilled  loop  a channel  float  conversion  integer  memory  shuffle"


def table(result: dict) -> str:
    """A line per launch and kernel: registers, spilled bytes, the loop's instructions in all,
    a channel, and by kind."""
    lines = [COLUMNS]
    for figures in result["launches"]:
        for name, build in figures.items():
            if name == "launch":
                continue
            kinds = build["by_kind"]
            lines.append(f"{figures['launch']:7s} {name:17s} {build['registers']:9d} {build['local_bytes']:8d} "
                         f"{build['loop_instructions']:5d} {build['instructions_a_channel']:10.1f} "
                         f"{kinds.get('float', 0):6d} {kinds.get('conversion', 0):11d} {kinds.get('integer', 0):8d} "
                         f"{kinds.get('memory', 0):7d} {kinds.get('shuffle', 0):8d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", default="16x4,16x4s", help="POSITIONSxWARPS[s] shapes, comma-separated")
    p.add_argument("--json", type=Path, help="also write the JSON object here")
    args = p.parse_args(argv)
    result = measure(parse_launches(args.launches))
    print_and_write(table(result), result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
