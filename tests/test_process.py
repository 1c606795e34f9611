"""A windowgpt process keeps Python's bytecode where the environment forbids writing it
beside the sources, and leaves Python alone everywhere else."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

import windowgpt_cli
from windowgpt_cli.process import bytecode_cache_dir

CLI_SOURCE = Path(windowgpt_cli.__file__).parent / "cli.py"


def run_version(tmp_path: Path, *python_flags: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in {"PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX"}}
    environ.update(XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    done = subprocess.run([sys.executable, *python_flags, "-m", "windowgpt_cli", "--version"], env=environ,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("windowgpt ")
    return done


def cached_bytecode(prefix: Path, source: Path) -> list[Path]:
    """The .pyc files of `source` that Python keeps under a pycache prefix."""
    mirrored = prefix / source.parent.relative_to(source.anchor)
    return sorted(mirrored.glob(f"{source.stem}.*.pyc"))


@pytest.mark.parametrize("flags,env", [(("-B",), {}), ((), {"PYTHONDONTWRITEBYTECODE": "1"})])
def test_bytecode_goes_to_the_cache_folder_when_python_may_not_write_it(tmp_path, monkeypatch, flags, env):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prefix = bytecode_cache_dir()
    assert prefix == tmp_path / "cache" / "windowgpt" / "bytecode"
    run_version(tmp_path, *flags, **env)
    assert cached_bytecode(prefix, CLI_SOURCE), "the command line's own module was not kept"
    assert cached_bytecode(prefix, Path(typer.__file__)), "its libraries' modules were not kept"


def test_python_is_left_alone_where_it_writes_bytecode_or_was_told_where(tmp_path):
    run_version(tmp_path)
    assert not (tmp_path / "cache").exists()
    run_version(tmp_path, "-B", PYTHONPYCACHEPREFIX=str(tmp_path / "theirs"))
    assert not (tmp_path / "cache").exists() and not (tmp_path / "theirs").exists()


def test_a_cache_folder_that_cannot_be_written_only_costs_the_speed_up(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    run_version(tmp_path, "-B")
    assert blocker.read_text() == "a file where the cache folder would be"
