"""`train --compile-cache FILE`: torch.compile's caches written by one process and found by
another that starts with empty caches (a fresh machine); files of another machine, damaged
ones and anything not a compile cache are never loaded, and never written over."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.cli.app import app
from windowgpt_cli.errors import OutputRefused
from windowgpt_cli.storage.compile_cache import (
    MAGIC,
    claim_compile_cache,
    load_compile_cache,
    machine,
    read_compile_cache,
    save_compile_cache,
)
from windowgpt_cli.storage.files import sha256_bytes

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()

# A compiled function run in a process of its own, whose Inductor and Triton caches start
# empty; it prints the cache's log lines and then torch's counts of cache hits and misses.
COMPILE_IN_A_FRESH_PROCESS = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from windowgpt_cli.storage.compile_cache import load_compile_cache, save_compile_cache
    path = sys.argv[1]
    print(load_compile_cache(path))
    def step(x):
        return torch.nn.functional.rms_norm(x, (x.size(-1),)) * 2.0 + torch.tanh(x)
    torch.compile(step, dynamic=False, fullgraph=True)(torch.randn(4, 32))
    print(save_compile_cache(path))
    print(json.dumps(dict(counters["inductor"])))
""")


def compile_in_a_fresh_process(path: Path, caches: Path) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "TRITON_CACHE_DIR": str(caches / "triton")}
    done = subprocess.run([sys.executable, "-c", COMPILE_IN_A_FRESH_PROCESS, str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


def write_cache(path: Path, payload: bytes, **header) -> None:
    header = {"machine": machine(), "artifacts": 1, "bytes": len(payload), "sha256": sha256_bytes(payload), **header}
    path.write_bytes(MAGIC.encode() + json.dumps(header).encode() + b"\n" + payload)


@pytest.mark.slow
def test_a_second_process_with_empty_caches_finds_the_first_ones_compiled_graph(tmp_path):
    path = tmp_path / "compile.cache"
    lines, counts = compile_in_a_fresh_process(path, tmp_path / "first")
    assert "does not exist yet" in lines[0] and lines[1].startswith("compile_cache: wrote ")
    assert counts.get("fxgraph_cache_miss", 0) >= 1 and not counts.get("fxgraph_cache_hit")
    header = read_compile_cache(path).header
    assert header["machine"] == machine() and header["artifacts"] >= 1

    written = path.stat().st_mtime_ns
    lines, counts = compile_in_a_fresh_process(path, tmp_path / "second")
    assert lines[0].startswith(f"compile_cache: loaded {header['artifacts']} cached artifacts")
    assert counts.get("fxgraph_cache_hit", 0) >= 1 and not counts.get("fxgraph_cache_miss"), counts
    assert lines[1] == f"compile_cache: {path} already holds these {header['artifacts']} artifacts; left as it was"
    assert path.stat().st_mtime_ns == written


def test_a_cache_of_another_machine_is_not_loaded(tmp_path, monkeypatch):
    path = tmp_path / "compile.cache"
    elsewhere = {**machine(), "torch": "0.0.0", "device": {"type": "cuda", "name": "another GPU"}}
    write_cache(path, b"not torch's artifacts", machine=elsewhere)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: pytest.fail("loaded"))
    line = load_compile_cache(path)
    assert "was made with torch 0.0.0, Triton" in line and "on another GPU" in line and "compiling anew" in line


@pytest.mark.parametrize("damage", ["payload", "header", "truncated"])
def test_a_damaged_cache_is_not_loaded(tmp_path, monkeypatch, damage):
    path = tmp_path / "compile.cache"
    write_cache(path, b"0123456789")
    data = path.read_bytes()
    damaged = {"payload": data[:-1] + b"X", "header": data.replace(b'"bytes": 10', b'"bytes": 11'),
               "truncated": data[:-3]}[damage]
    path.write_bytes(damaged)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: pytest.fail("loaded"))
    assert "does not match its header (damaged); compiling anew" in load_compile_cache(path)


def test_only_a_compile_cache_is_claimed(tmp_path):
    ours, theirs = tmp_path / "compile.cache", tmp_path / "notes.txt"
    write_cache(ours, b"x")
    theirs.write_text("a user's file")
    assert claim_compile_cache(ours) == ours and claim_compile_cache(tmp_path / "new.cache")
    for refused in (theirs, tmp_path):
        with pytest.raises(OutputRefused):
            claim_compile_cache(refused)
    assert theirs.read_text() == "a user's file"


@pytest.mark.parametrize("where", ["a user's file", "in the data", "in the run", "the run"])
def test_train_refuses_a_compile_cache_path_that_is_not_its_own(tiny_data_dir, tmp_path, where):
    run = tmp_path / "run"
    user_file = tmp_path / "notes.txt"
    user_file.write_text("a user's file")
    path = {"a user's file": user_file, "in the data": tiny_data_dir / "compile.cache",
            "in the run": run / "compile.cache", "the run": run}[where]
    result = runner.invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(run),
                                 "--iterations", "2", "--compile-cache", str(path)])
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1 and "--compile-cache" in result.output
    assert not run.exists() and not (tiny_data_dir / "compile.cache").exists()
    assert user_file.read_text() == "a user's file"


def test_train_on_the_cpu_says_it_compiled_nothing_and_writes_no_cache(tiny_data_dir, tmp_path):
    run, path = tmp_path / "run", tmp_path / "compile.cache"
    result = runner.invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(run),
                                 "--iterations", "2", "--compile-cache", str(path)])
    assert result.exit_code == 0, result.output
    log = (run / "train.log").read_text()
    assert f"compile_cache: {path} does not exist yet" in log
    assert log.count("compile_cache: nothing was compiled") == 1  # after the warm-up, not again at the end
    assert not path.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_second_run_with_empty_caches_loads_the_first_runs(tiny_data_dir, tmp_path, monkeypatch):
    path = tmp_path / "compile.cache"
    logs = []
    for name in ("first", "second"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name / "inductor"))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-m", "windowgpt_cli", "train", "--preset", "tiny", "--data",
                               str(tiny_data_dir), "--out", str(tmp_path / name / "run"), "--device", "cuda",
                               "--compile", "--iterations", "4", "--compile-cache", str(path)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        logs.append((tmp_path / name / "run" / "train.log").read_text())
    assert "compile_cache: wrote " in logs[0]
    assert "compile_cache: loaded " in logs[1] and "compile_cache: loaded 0 " not in logs[1]


def test_a_cache_torch_cannot_load_or_a_path_that_cannot_be_written_ends_nothing(tmp_path, monkeypatch):
    path = tmp_path / "compile.cache"
    write_cache(path, b"x")

    def refuse(data):
        raise RuntimeError("unpickling failed")
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", refuse)
    assert "could not be loaded (RuntimeError: unpickling failed); compiling anew" in load_compile_cache(path)

    info = type("Info", (), {"artifacts": {"inductor": ["key"]}})()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"payload", info))
    user_file = tmp_path / "notes.txt"
    user_file.write_text("a user's file")
    assert save_compile_cache(user_file).startswith("compile_cache: not written (")
    assert user_file.read_text() == "a user's file"
    assert save_compile_cache(path) == f"compile_cache: wrote 1 artifacts (7 bytes) to {path}"
    assert read_compile_cache(path).payload == b"payload"
    assert save_compile_cache(path) == f"compile_cache: {path} already holds these 1 artifacts; left as it was"


def test_the_bench_script_trains_twice_on_empty_caches_and_writes_its_result(tiny_data_dir, tmp_path):
    """bench/compile_cache.sh on the CPU (the model eager: nothing compiled, nothing cached):
    two runs, each with caches of its own, both given the cache, and the result's shape."""
    logs, bin_dir = tmp_path / "logs", tmp_path / "bin"
    (tmp_path / "shared").mkdir()
    bin_dir.mkdir()
    python = bin_dir / "python3"  # the scripts' python3: this one
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / "bench" / "compile_cache.sh"), str(tmp_path / "shared"),
                           str(tmp_path / "work"), str(logs)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DATA": str(tiny_data_dir),
                               "TRAIN_FLAGS": "--preset tiny --iterations 2 --device cpu"})
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((logs / "compile_cache.json").read_text())
    assert result["gpu"] == "cpu" and result["cache_bytes"] is None
    assert set(result["runs"]) == {"cold", "from_cache"}
    for run in result["runs"].values():
        assert run["warmup_s"] is not None and run["compile_s"] == 0
        assert any("nothing was compiled" in line for line in run["compile_cache_lines"])
    assert "warm-up from the cache / cold:" in done.stdout
