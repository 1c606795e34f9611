"""Triton kernels compiled for a Hopper GPU (sm_90) on any machine, and what their machine
code holds: Triton builds the cubin with its own ptxas, and its own cuobjdump and nvdisasm
read it back. No GPU is needed. `tests/test_hopper_builds.py` and
`bench/head_kernels_sass.py` compile through it.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")


def compile_for_hopper(kernel, types, constants: dict, warps: int, stages: int, aligned: tuple[str, ...] = ()):
    """kernel (a triton.jit function) built for sm_90: `types(name)` gives each argument's
    type that `constants` does not fix; the arguments named in `aligned` are taken as
    multiples of 16 (pointers and strides as Triton's launches specialize them)."""
    signature = {name: "constexpr" if name in constants else types(name) for name in kernel.arg_names}
    attrs = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names) if name in aligned}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=TARGET,
                          options={"num_warps": warps, "num_stages": stages})


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _with_cubin(compiled, args: list[str]) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([*args, cubin.name], capture_output=True, text=True, check=True).stdout


def registers(compiled) -> tuple[int, int]:
    """(registers a thread, bytes of local memory: spills) of a compiled kernel."""
    usage = _with_cubin(compiled, [_tool("cuobjdump"), "-res-usage"])
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage)
    if found is None:
        raise ValueError(f"no resource usage in cuobjdump's output: {usage[-300:]}")
    return int(found.group(1)), int(found.group(2))


def sass_lines(compiled) -> list[str]:
    """The kernel's machine code, a line per instruction or label (nvdisasm's)."""
    return _with_cubin(compiled, [_tool("nvdisasm"), "-c"]).splitlines()


def longest_loop(lines: list[str]) -> list[str]:
    """The instructions of the longest loop: from a label to the last branch back to it."""
    labels = {match.group(1): index for index, line in enumerate(lines) if (match := LABEL.match(line))}
    loops = [(labels[match.group(1)], index) for index, line in enumerate(lines)
             if (match := BRANCH.search(line)) and labels.get(match.group(1), index) < index]
    if not loops:
        raise ValueError("the kernel has no loop")
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [line for line in lines[start:end + 1] if INSTRUCTION.match(line)]


def opcodes(instructions: list[str]) -> Counter:
    """How many of each opcode (its first word before a '.': FMUL, F2F, LDG, ...)."""
    return Counter(INSTRUCTION.match(line).group(1) for line in instructions)
