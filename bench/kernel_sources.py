"""What a compiled step's kernels compute: for each kernel named, the model's steps and the
ATen operators Inductor fused into it, and the graph fragment it reads and writes, from the
step's generated code.

    TORCH_LOGS=output_code python3 bench/train_profile.py --data DATA --record --steps 1 2> CODE.log
    python3 bench/kernel_sources.py CODE.log NAME [NAME ...] [--fragment-lines N] [--json PATH]

A profile names its kernels (`train_profile.py`'s top_kernels) by the operators they fuse,
which says little of where in the model they are: `triton_poi_fused__to_copy_mul_unsqueeze_16`
could be any scale of any block. Inductor writes above each kernel's definition a comment
with its source nodes (the names of the model code's steps, for a forward graph) and the
fragment of the graph it computes, with every tensor's shape; this prints those. A name can
be defined in several graphs (the forward's and the backward's, a recompiled one): each
definition is listed. CODE.log may be gzipped (.gz).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mix_order_kernels import inputs_and_output_usable, open_text, print_and_write  # noqa: E402

SOURCES = re.compile(r"#\s*(?:Topologically Sorted|Unsorted) Source Nodes: \[(.*?)\], Original ATen: \[(.*?)\]")
DEFINITION = re.compile(r"^\s*(\w+) = async_compile\.\w+\('(\w+)'")
LOG_PREFIX = re.compile(r"^.*?\[__output_code\] ?")  # the logger's, where each line of the code has one


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def kernel_sources(code_lines: Iterable[str], wanted: set[str], fragment_lines: int = 40) -> dict[str, list[dict]]:
    """{name: [{"source_nodes", "aten", "fragment"}, one per definition]} for the kernels of
    `wanted` that the code defines; the comment block above a definition is its own (Inductor
    writes it there), its graph fragment cut to fragment_lines lines."""
    found: dict[str, list[dict]] = {}
    comment: list[str] = []
    for line in code_lines:
        line = LOG_PREFIX.sub("", line, count=1)
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        definition = DEFINITION.match(line)
        if definition and definition.group(2) in wanted:
            found.setdefault(definition.group(2), []).append(_described(comment, fragment_lines))
        if stripped:
            comment = []
    return found


def _described(comment: list[str], fragment_lines: int) -> dict[str, Any]:
    """The source nodes, ATen operators and graph fragment of one kernel's comment block."""
    sources = next((m for m in map(SOURCES.search, comment) if m), None)
    start = next((i + 1 for i, text in enumerate(comment) if text.endswith("Graph fragment:")), len(comment))
    fragment = [text.lstrip("#").strip() for text in comment[start:] if text.lstrip("#").strip()]
    return {"source_nodes": _names(sources.group(1)) if sources else [],
            "aten": _names(sources.group(2)) if sources else [],
            "fragment": fragment[:fragment_lines]}


def report(found: dict[str, list[dict]], names: list[str]) -> str:
    """Each name's definitions as text; a name the code does not define says so."""
    lines = []
    for name in names:
        definitions = found.get(name)
        if not definitions:
            lines.append(f"{name}: not defined in this code")
            continue
        for i, definition in enumerate(definitions, 1):
            lines.append(f"{name} ({i} of {len(definitions)})")
            lines.append(f"  source nodes: {', '.join(definition['source_nodes']) or '-'}")
            lines.append(f"  aten: {', '.join(definition['aten']) or '-'}")
            lines += [f"    {text}" for text in definition["fragment"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("code_log", type=Path, help="Inductor's output code (TORCH_LOGS=output_code).")
    parser.add_argument("names", nargs="+", help="Kernel names, as a profile gives them.")
    parser.add_argument("--fragment-lines", type=int, default=40, help="Lines of each graph fragment shown.")
    parser.add_argument("--json", type=Path, help="Write the result as JSON here.")
    args = parser.parse_args(argv)
    if args.fragment_lines < 0:
        parser.error("--fragment-lines must be at least 0")
    if not inputs_and_output_usable([args.code_log], args.json):
        return 1
    try:
        with open_text(args.code_log) as f:
            found = kernel_sources(f, set(args.names), args.fragment_lines)
    except (OSError, EOFError):
        print(f"error: {args.code_log}: not readable as text or its gzip", file=sys.stderr)
        return 1
    print_and_write(report(found, args.names), {name: found.get(name, []) for name in args.names}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
