"""The README's first-run commands work as written, from a clone's root."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The walk-through trains for 60 steps; the test trains for 4, which exercises the same path.
SHORTER = {"train": ["--iterations", "4"], "generate": ["--max-new-tokens", "8"]}


def first_run_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- first-run -->\n```sh\n(.*?)```", text, re.S)
    assert block, "README.md has no first-run block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_first_run_works_as_written(tmp_path):
    (tmp_path / "data").symlink_to(REPO / "data")  # the clone's data/demo corpus
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    commands = first_run_commands()
    assert [c[1] for c in commands] == ["prepare", "train", "export", "quantize", "eval", "eval-ttt", "generate"]
    printed = {}
    for words in commands:
        assert words[0] == "windowgpt", words
        args = [sys.executable, "-m", "windowgpt_cli", *words[1:], *SHORTER.get(words[1], [])]
        result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == 0, (words, result.stdout[-2000:], result.stderr[-2000:])
        printed[words[1]] = result.stdout
    demo = tmp_path / "demo"
    assert (demo / "run" / "summary.json").is_file() and (demo / "model.ptz").is_file()
    assert "val_bpb" in printed["eval-ttt"]  # its table
    assert printed["generate"].startswith("It was a dark night, and")  # the text, without --data
