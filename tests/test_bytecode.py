"""A windowgpt process keeps Python's bytecode where the environment forbids writing it
beside the sources, and leaves Python alone everywhere else."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer

import windowgpt_cli
from windowgpt_cli import bytecode as process
from windowgpt_cli.bytecode import bytecode_cache_dir

CLI_SOURCE = Path(windowgpt_cli.__file__).parent / "cli" / "app.py"


# `windowgpt --version` in an environment whose torch ships no bytecode (SHIPS: False), or as
# this environment is (SHIPS: None).
VERSION_PROBE = """
import sys
from windowgpt_cli import bytecode
if {ships} is not None:
    bytecode.ships_bytecode = lambda package: {ships}
sys.argv = ["windowgpt", "--version"]
from windowgpt_cli.entry import windowgpt
windowgpt()
"""


def run_version(tmp_path: Path, *python_flags: str, ships: bool | None = False,
                **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in {"PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX"}}
    environ.update(XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    done = subprocess.run([sys.executable, *python_flags, "-c", VERSION_PROBE.format(ships=ships)], env=environ,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("windowgpt ")
    return done


def cached_bytecode(prefix: Path, source: Path) -> list[Path]:
    """The .pyc files of `source` that Python keeps under a pycache prefix."""
    mirrored = prefix / source.parent.relative_to(source.anchor)
    return sorted(mirrored.glob(f"{source.stem}.*.pyc"))


@pytest.mark.parametrize("flags,env", [(("-B",), {}), ((), {"PYTHONDONTWRITEBYTECODE": "1"})])
@pytest.mark.slow
def test_bytecode_goes_to_the_cache_folder_when_python_may_not_write_it(tmp_path, monkeypatch, flags, env):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prefix = bytecode_cache_dir()
    assert prefix == tmp_path / "cache" / "windowgpt" / "bytecode"
    run_version(tmp_path, *flags, **env)
    assert cached_bytecode(prefix, CLI_SOURCE), "the command line's own module was not kept"
    assert cached_bytecode(prefix, Path(typer.__file__)), "its libraries' modules were not kept"


@pytest.mark.slow
def test_python_is_left_alone_where_it_writes_bytecode_or_was_told_where(tmp_path):
    run_version(tmp_path)
    assert not (tmp_path / "cache").exists()
    run_version(tmp_path, "-B", PYTHONPYCACHEPREFIX=str(tmp_path / "theirs"))
    assert not (tmp_path / "cache").exists() and not (tmp_path / "theirs").exists()


@pytest.mark.slow
def test_a_cache_folder_that_cannot_be_written_only_costs_the_speed_up(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    run_version(tmp_path, "-B")
    assert blocker.read_text() == "a file where the cache folder would be"


# --- Compiling the libraries' bytecode in the background ---------------------------------

def make_package(root: Path, name: str = "pkg") -> Path:
    package = root / name
    (package / "sub").mkdir(parents=True)
    for module in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (package / module).write_text(f"VALUE = {module!r}\n")
    return package


def test_precompile_writes_every_module_s_bytecode_under_the_prefix_once(tmp_path):
    package, prefix = make_package(tmp_path / "src"), tmp_path / "prefix"
    assert process.precompile(prefix, [package])
    for source in package.rglob("*.py"):
        assert cached_bytecode(prefix, source), f"{source} was not compiled"
    assert process.precompile_marker(prefix, [package]).exists()
    assert not process.precompile(prefix, [package]), "a second run compiled again"
    (package / "__init__.py").write_text("VALUE = 'a new version'\n")  # the package changed: its marker did too
    assert not process.precompile_marker(prefix, [package]).exists()


def test_only_one_process_precompiles_at_a_time(tmp_path):
    import fcntl

    package, prefix = make_package(tmp_path / "src"), tmp_path / "prefix"
    prefix.mkdir()
    with open(prefix / "precompile.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert not process.precompile(prefix, [package])
    assert not cached_bytecode(prefix, package / "a.py")
    assert process.precompile(prefix, [package])  # the lock released


def test_start_precompile_compiles_in_a_background_process_and_then_never_again(tmp_path, monkeypatch):
    package, prefix = make_package(tmp_path / "src", "wg_background_pkg"), tmp_path / "prefix"
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    process.start_precompile(prefix, ["wg_background_pkg", "no_such_package_here"])
    marker = process.precompile_marker(prefix, [package])
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists() and cached_bytecode(prefix, package / "sub" / "b.py")

    def no_process(*args, **kwargs):
        raise AssertionError("a precompile started although its marker is there")

    monkeypatch.setattr(process.subprocess, "Popen", no_process)
    process.start_precompile(prefix, ["wg_background_pkg"])


@pytest.mark.parametrize("cpus,starts", [(2, False), (16, True)])
def test_the_precompile_starts_only_on_a_machine_with_cores_to_spare(tmp_path, monkeypatch, cpus, starts):
    started = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(process, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(process, "start_precompile", lambda prefix, packages: started.append((prefix, packages)))
    monkeypatch.setattr(process, "ships_bytecode", lambda package: False)
    monkeypatch.setattr(process, "start_prune", lambda prefix: None)
    process.keep_bytecode()
    assert sys.pycache_prefix == str(tmp_path / "cache" / "windowgpt" / "bytecode")
    assert started == ([(Path(sys.pycache_prefix), process.PRECOMPILED_PACKAGES)] if starts else [])


def test_the_precompile_process_without_its_arguments_says_how_to_call_it():
    done = subprocess.run([sys.executable, "-m", "windowgpt_cli.bytecode"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("usage: ") and len(done.stderr.splitlines()) == 1


@pytest.mark.slow
def test_no_cache_where_the_libraries_ship_their_bytecode(tmp_path):
    if not process.ships_bytecode("torch"):
        pytest.skip("this environment's torch ships no bytecode")
    run_version(tmp_path, "-B", ships=None)
    assert not (tmp_path / "cache").exists()


def test_prune_drops_the_bytecode_of_sources_gone_and_bounds_the_rest(tmp_path):
    prefix = tmp_path / "cache"
    here = tmp_path / "env" / "lib"
    here.mkdir(parents=True)
    (here / "kept.py").write_text("")
    kept = prefix / here.relative_to("/")  # Python's pycache_prefix layout: the source folder's path
    gone = prefix / (tmp_path / "deleted-env" / "lib").relative_to("/")
    for folder in (kept, gone):
        folder.mkdir(parents=True)
        (folder / "m.cpython-311.pyc").write_bytes(b"x" * 1000)
    process.prune(prefix, max_bytes=10_000)
    assert (kept / "m.cpython-311.pyc").exists() and not gone.parent.exists()  # its whole folder
    (prefix / "precompiled-abc").touch()
    process.prune(prefix, max_bytes=500)  # over the bound: emptied
    assert list(prefix.iterdir()) == []
