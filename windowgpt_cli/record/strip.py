"""Python source without its comments and docstrings, line for line.

The record counts the packed code's bytes, and about a third of them are prose. `pack
--strip` packs each module as this gives it: every comment and every docstring that stands
on lines of its own becomes blank lines, so a traceback (and Triton, which reads a kernel's
source) still finds each statement on its line. A docstring that is its body's only
statement stays (removing it would leave the body empty).
"""
from __future__ import annotations

import ast
import io
import tokenize


def docstring_lines(text: str, tree: ast.Module) -> set[int]:
    """0-based lines held by docstrings that can go: on lines of their own, not a body's only statement."""
    lines = text.splitlines()
    removable: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if len(body) < 2 or not _is_docstring(body[0]):
            continue
        first, after = body[0], body[1]
        alone = not lines[first.lineno - 1][:first.col_offset].strip() and after.lineno > first.end_lineno
        if alone:
            removable.update(range(first.lineno - 1, first.end_lineno))
    return removable


def _is_docstring(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def strip_source(source: bytes) -> bytes:
    """The source with its comments and removable docstrings blanked; the same lines and statements."""
    text = source.decode("utf-8")
    lines = text.splitlines(keepends=True)
    blank = docstring_lines(text, ast.parse(text))
    cut: dict[int, int] = {}  # 0-based line -> column where its comment starts
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            cut[token.start[0] - 1] = token.start[1]
    out = []
    for i, line in enumerate(lines):
        ending = "\n" if line.endswith("\n") else ""
        if i in blank:
            out.append(ending)
        elif i in cut:
            kept = line[:cut[i]].rstrip()
            out.append(kept + ending if kept else ending)
        else:
            out.append(line)
    return "".join(out).encode("utf-8")
