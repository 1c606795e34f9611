"""Every Python file of the project fits the line length that pyproject.toml declares (the
width its linter, ruff, is set to)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("windowgpt_cli", "tests", "bench")


def declared_width() -> int:
    """[tool.ruff]'s line-length (read by a pattern: tomllib needs Python 3.11, the project 3.10)."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r"^\[tool\.ruff\][^\[]*?^line-length\s*=\s*(\d+)", text, re.MULTILINE | re.DOTALL)
    assert found, "pyproject.toml declares no [tool.ruff] line-length"
    return int(found.group(1))


def test_every_python_line_fits_the_declared_width():
    width = declared_width()
    files = [p for folder in SOURCE_FOLDERS for p in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 50
    too_long = [f"{path.relative_to(REPO)}:{number}: {len(line)} characters"
                for path in files
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if len(line) > width]
    assert not too_long, f"lines over {width} characters:\n" + "\n".join(too_long)
