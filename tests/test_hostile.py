"""Hostile and careless input to every stage: one line on stderr, the documented exit code,
and nothing new left on disk. The artifacts are built once per module."""
from __future__ import annotations

import contextlib
import io
import json
import lzma
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from windowgpt_cli.cli import app as cli
from windowgpt_cli.artifacts import compressors, ptz
from windowgpt_cli.storage import tensorfile
from windowgpt_cli.data.shards import shard_name

pytestmark = pytest.mark.usefixtures("eval_single_thread")


def run_main(*args) -> tuple[int, str, str]:
    """`windowgpt ARGS` through the entry point, as a shell runs it: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["windowgpt", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and time (a run's lock file only names its holder)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.name != ".lock"}


# --- What the cases work on (built once) -----------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_data_dir: Path, tiny_run_dir: Path, eval_tokenizer: Path) -> dict[str, Path]:
    from windowgpt_cli.artifacts.export import export
    from windowgpt_cli.data.prepare import index_data
    from windowgpt_cli.quant.quantize import quantize
    from windowgpt_cli.train.run import train
    from windowgpt_cli.config import apply_overrides, tiny_preset

    root = tmp_path_factory.mktemp("hostile")
    w = {"root": root, "data": tiny_data_dir, "run": tiny_run_dir}
    w["export"] = root / "export"
    export(tiny_run_dir, w["export"])
    w["ptz"] = root / "model.ptz"
    quantize(w["export"], w["ptz"], device="cpu")
    w["tokenizer"] = tiny_data_dir / "tokenizer.model"

    # the same shards, indexed with another tokenizer of the same vocabulary size
    w["other_data"] = root / "other-data"
    w["other_data"].mkdir()
    for shard in tiny_data_dir.glob("fineweb_*.bin"):
        shutil.copyfile(shard, w["other_data"] / shard.name)
    index_data(w["other_data"], eval_tokenizer)
    w["other_tokenizer"] = eval_tokenizer

    w["no_manifest"] = root / "no-manifest"
    shutil.copytree(tiny_data_dir, w["no_manifest"])
    (w["no_manifest"] / "manifest.json").unlink()

    w["short_val"] = root / "short-val"  # a val shard cut short (prepare killed, disk full)
    shutil.copytree(tiny_data_dir, w["short_val"])
    val = w["short_val"] / shard_name("val", 0)
    val.write_bytes(val.read_bytes()[: val.stat().st_size // 3])

    w["flipped_val"] = root / "flipped-val"  # same size, one token changed
    shutil.copytree(tiny_data_dir, w["flipped_val"])
    val = w["flipped_val"] / shard_name("val", 0)
    data = bytearray(val.read_bytes())
    data[-2] ^= 1
    val.write_bytes(bytes(data))

    w["paused"] = root / "paused"  # an unfinished run, to resume
    cfg = apply_overrides(tiny_preset(), {"data": {"data_path": str(tiny_data_dir)},
                                          "train": {"iterations": 4, "warmup_steps": 0}})
    train(cfg, w["paused"], stop_at_step=2, echo=lambda _: None)

    w["flipped_ckpt"] = root / "flipped-run"
    w["flipped_ckpt"].mkdir()
    raw = bytearray((tiny_run_dir / "checkpoint.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x10  # inside the tensor data, which makes up most of the file
    (w["flipped_ckpt"] / "checkpoint.pt").write_bytes(bytes(raw))

    w["huge_ckpt"] = root / "huge-run"  # a consistent checkpoint whose config asks for model_dim 100000
    w["huge_ckpt"].mkdir()
    payload = torch.load(tiny_run_dir / "checkpoint.pt", weights_only=True)
    payload["config"]["model"]["model_dim"] = 100_000
    torch.save(payload, w["huge_ckpt"] / "checkpoint.pt")

    w["no_info"] = root / "export-no-info"
    shutil.copytree(w["export"], w["no_info"])
    (w["no_info"] / "export.json").unlink()

    w["flipped_export"] = root / "export-flipped"
    shutil.copytree(w["export"], w["flipped_export"])
    weights = w["flipped_export"] / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x01
    weights.write_bytes(bytes(raw))

    w["huge_export"] = root / "export-huge"
    shutil.copytree(w["export"], w["huge_export"])
    config = json.loads((w["huge_export"] / "config.json").read_text())
    config["model"]["model_dim"] = 100_000
    (w["huge_export"] / "config.json").write_text(json.dumps(config))

    good = w["ptz"].read_bytes()
    payload = ptz.decompress_payload(good, "x")
    tensors, metadata = tensorfile.loads(payload)
    meta = json.loads(metadata[ptz.METADATA_KEY])
    meta["config"]["model"]["model_dim"] = 100_000
    w["huge_ptz"] = root / "huge.ptz"
    w["huge_ptz"].write_bytes(ptz.compress_payload(tensorfile.dumps(tensors, {ptz.METADATA_KEY: json.dumps(meta)})))
    w["old_ptz"] = root / "old.ptz"  # version 1: no size or hash in the header
    w["old_ptz"].write_bytes(ptz.MAGIC + bytes([1, 1]) + lzma.compress(payload))
    w["bomb_ptz"] = root / "bomb.ptz"  # a few kB that would inflate to 20 MB
    w["bomb_ptz"].write_bytes(ptz.MAGIC + bytes([ptz.FORMAT_VERSION, compressors.COMPRESSORS["lzma"].id])
                              + ptz._SIZE_AND_HASH.pack(len(payload), bytes(32)) + lzma.compress(bytes(20_000_000)))
    w["rans_flipped_ptz"] = root / "rans-flipped.ptz"  # one bit of the rANS-coded words changed
    coded = bytearray(ptz.compress_payload(payload, "rans"))
    coded[-40] ^= 0x08
    w["rans_flipped_ptz"].write_bytes(bytes(coded))

    w["a_file"] = root / "a-file"
    w["a_file"].write_text("not a directory\n")
    w["a_dir"] = root / "a-dir"
    w["a_dir"].mkdir()
    w["text"] = root / "notes.txt"
    w["text"].write_text("hello\n")
    w["huge_config"] = root / "huge-config.json"
    w["huge_config"].write_text(json.dumps({"model": {"model_dim": 100_000}}))
    w["corpus"] = Path(__file__).resolve().parents[1] / "data" / "demo" / "gutenberg_1mb.jsonl"
    return w


# --- The cases: (stage args with {placeholders}, exit code, a fragment of the message) --

NEW = "{root}/new"  # where a case's output would go: it must never appear
CASES = [
    # prepare
    ("prepare {root}/missing.jsonl --out " + NEW, 1, "no such file"),
    ("prepare {corpus} --vocab-size 0 --out " + NEW, 1, "--vocab-size 0"),
    ("prepare {corpus} --vocab-size 70000 --out " + NEW, 1, "--vocab-size 70000"),
    ("prepare {corpus} --val-fraction nan --out " + NEW, 1, "--val-fraction nan"),
    ("prepare {corpus} --shard-tokens 0 --tokenizer {tokenizer} --out " + NEW, 1, "--shard-tokens 0"),
    ("prepare {corpus} --workers 0 --tokenizer {tokenizer} --out " + NEW, 1, "--workers 0"),
    ("prepare {corpus} --tokenizer {tokenizer} --out {a_file}", 1, "not a directory"),
    ("prepare {corpus} --tokenizer {a_file}/x.model --out " + NEW, 1, "x.model"),
    ("prepare {root}/in[1].jsonl --out " + NEW, 1, "in[1].jsonl"),
    ("prepare {corpus} --vocab-size lots --out " + NEW, 2, "--vocab-size"),
    ("prepare {corpus} --colour --out " + NEW, 2, "--colour"),
    ("prepare --index {a_dir}", 1, "tokenizer.model"),
    ("prepare {corpus} --index {a_dir}", 1, "--index"),
    ("prepare {corpus}", 1, "--out"),
    ("prepare {text} --tokenizer {tokenizer} --val-fraction 0.001 --out " + NEW, 1, "no validation documents"),
    ("prepare {text} --tokenizer {tokenizer} --out {data}", 1, "contains the command's input"),
    # tokenizer-meta
    ("tokenizer-meta {root}/missing.model", 1, "missing.model"),
    ("tokenizer-meta {text}", 1, "notes.txt"),
    ("tokenizer-meta {tokenizer} --out {a_dir}", 1, "is a directory"),
    ("tokenizer-meta {tokenizer} --out {a_file}/x.npz", 1, "a-file"),
    ("tokenizer-meta {tokenizer} --check {root}/missing.npz", 1, "missing.npz"),
    ("tokenizer-meta {tokenizer} --out {root}/m.npz --check {root}/m.npz", 1, "not both"),
    ("tokenizer-meta {tokenizer} --check {root}/[x].npz", 1, "[x].npz"),
    ("tokenizer-meta", 2, "Missing argument"),
    # train
    ("train --preset tiny --data {data} --out " + NEW + " --num-heads 0", 1, "--num-heads 0"),
    ("train --preset tiny --data {data} --out " + NEW + " --mlp-mult nan", 1, "--mlp-mult nan"),
    ("train --preset tiny --data {data} --out " + NEW + " --seed -1", 1, "--seed -1"),
    ("train --preset tiny --data {data} --out " + NEW + " --vocab-size 0", 1, "--vocab-size 0"),
    ("train --preset tiny --data {data} --out " + NEW + " --matrix-lr nan", 1, "--matrix-lr nan"),
    ("train --preset tiny --data {data} --out " + NEW + " --train-batch-tokens 1000", 1, "--train-batch-tokens 1000"),
    ("train --preset tiny --data {data} --out " + NEW + " --model-dim 100000", 1, "--model-dim 100000"),
    ("train --preset tiny --data {data} --out " + NEW + " --iterations -1", 1, "--iterations -1"),
    ("train --preset tiny --data {data} --out " + NEW + " --adam-eps inf", 1, "--adam-eps inf"),
    ("train --preset tiny --data {root}/nowhere --out " + NEW, 1, "no such data directory"),
    ("train --preset tiny --data {no_manifest} --out " + NEW, 1, "windowgpt prepare"),
    ("train --preset tiny --data {short_val} --out " + NEW, 1, "bytes, but manifest.json records"),
    ("train --preset tiny --data {flipped_val} --out " + NEW, 1, "differ from the sha256"),
    ("train --preset tiny --data {data} --out {run}", 1, "already holds a checkpoint"),
    ("train --preset tiny --data {data} --out {a_file}", 1, "not a directory"),
    ("train --data {data} --out " + NEW + " --resume", 1, "no checkpoint"),
    ("train --data {data} --out {paused} --resume --force", 1, "give one of them"),
    ("train --out {paused} --resume --num-layers 2", 1, "--resume takes its settings"),
    ("train --out {paused} --resume --data {other_data}", 1, "another tokenizer"),
    ("train --preset tiny --data {data} --out " + NEW + " --matrix-lr fast", 2, "--matrix-lr"),
    ("train --preset nope --data {data} --out " + NEW, 1, "unknown preset"),
    ("train --config {root}/missing.json --data {data} --out " + NEW, 1, "missing.json"),
    ("train --config {huge_config} --data {data} --out " + NEW, 1, "model_dim=100000"),
    ("train --preset tiny --data {root}/d[1] --out " + NEW, 1, "d[1]"),
    # export
    ("export {root}/missing --out " + NEW, 1, "missing"),
    ("export {run} --weights best --out " + NEW, 1, "--weights"),
    ("export {run} --out {a_file}", 1, "not a directory"),
    ("export {flipped_ckpt} --out " + NEW, 1, "flipped-run"),
    ("export {ptz} --out " + NEW, 1, "not a"),
    ("export {huge_ckpt} --out " + NEW, 1, "model_dim=100000"),
    ("export {run} --out {a_file}/sub", 1, "a-file"),
    ("export", 2, "Missing argument"),
    # quantize
    ("quantize {root}/missing --out {root}/new.ptz", 1, "missing"),
    ("quantize {ptz} --out {root}/new.ptz", 1, "already quantized"),
    ("quantize {no_info} --out {root}/new.ptz", 1, "export.json"),
    ("quantize {flipped_export} --out {root}/new.ptz", 1, "differs from the weights"),
    ("quantize {huge_export} --out {root}/new.ptz", 1, "differs from the configuration"),
    ("quantize {export} --quant-clip-range 0 --out {root}/new.ptz", 1, "--quant-clip-range 0"),
    ("quantize {export} --compressor zip --out {root}/new.ptz", 1, "--compressor"),
    ("quantize {export} --out {a_dir}", 1, "is a directory"),
    ("quantize {export} --gptq --data {no_manifest} --out {root}/new.ptz", 1, "windowgpt prepare"),
    ("quantize {export} --gptq --data {other_data} --out {root}/new.ptz", 1, "another tokenizer"),
    ("quantize {export} --gptq --gptq-calib-samples 0 --data {data} --out {root}/new.ptz", 1, "--gptq-calib-samples 0"),
    ("quantize {export} --budget lots --out {root}/new.ptz", 2, "--budget"),
    # eval
    ("eval {old_ptz} --data {data}", 1, "version 1 is not supported"),
    ("eval {bomb_ptz} --data {data}", 1, "declares"),
    ("eval {huge_ptz} --data {data}", 1, "model_dim=100000"),
    ("eval {rans_flipped_ptz} --data {data}", 1, "rANS stream"),
    ("eval {flipped_ckpt} --data {data}", 1, "flipped-run"),
    ("eval {no_info} --data {data}", 1, "export.json"),
    ("eval {ptz} --data {no_manifest}", 1, "windowgpt prepare"),
    ("eval {ptz} --data {short_val}", 1, "manifest.json records"),
    ("eval {ptz} --data {other_data}", 1, "another tokenizer"),
    ("eval {ptz} --data {data} --tokenizer {other_tokenizer}", 1, "sha256"),
    ("eval {ptz} --data {data} --stride -1", 1, "--stride -1"),
    ("eval {ptz} --data {data} --seq-len 0", 1, "--seq-len 0"),
    ("eval {ptz} --data {root}/[x]", 1, "[x]"),
    ("eval {ptz} --data {data} --stride x", 2, "--stride"),
    # eval-ttt
    ("eval-ttt {ptz} --data {data} --ttt-lr nan", 1, "--ttt-lr nan"),
    ("eval-ttt {ptz} --data {data} --ttt-epochs -1", 1, "--ttt-epochs -1"),
    ("eval-ttt {ptz} --data {data} --ttt-chunk-tokens 0", 1, "--ttt-chunk-tokens 0"),
    ("eval-ttt {ptz} --data {data} --ttt-momentum 1.5", 1, "--ttt-momentum 1.5"),
    ("eval-ttt {no_info} --data {data}", 1, "export.json"),
    ("eval-ttt {ptz} --data {flipped_val}", 1, "differ from the sha256"),
    ("eval-ttt {huge_export} --data {data}", 1, "differs from the configuration"),
    ("eval-ttt {ptz} --data {data} --stride 0", 1, "--stride"),
    ("eval-ttt {ptz}", 2, "--data"),
]


@pytest.mark.parametrize("line,code,fragment", CASES, ids=[c[0].split(" {")[0] + f"-{i}" for i, c in enumerate(CASES)])
def test_hostile_input_is_one_line_and_leaves_nothing(world, line, code, fragment):
    args = [part.format(**{k: str(v) for k, v in world.items()}) for part in line.split(" ")]
    before = tree(world["root"]), tree(world["run"]), tree(world["data"])
    exit_code, stdout, stderr = run_main(*args)
    assert exit_code == code, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert "Traceback" not in stderr + stdout
    assert fragment in lines[0], lines[0]
    assert (tree(world["root"]), tree(world["run"]), tree(world["data"])) == before


def test_hostile_suite_covers_every_stage():
    stages = {line.split(" ")[0] for line, _, _ in CASES}
    assert stages == {"prepare", "tokenizer-meta", "train", "export", "quantize", "eval", "eval-ttt"}
    assert len(CASES) >= 60


def test_resuming_a_finished_run_changes_nothing(world):
    before = tree(world["run"])
    code, stdout, stderr = run_main("train", "--out", world["run"], "--resume")
    assert code == 0 and "nothing to do" in stdout, stderr
    assert tree(world["run"]) == before


def test_a_full_disk_is_one_line_naming_the_path(world, monkeypatch):
    from windowgpt_cli.storage import files as artifacts

    def full(src, dst):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(artifacts, "rename", full)
    before = tree(world["root"])
    code, _, stderr = run_main("quantize", world["export"], "--out", world["root"] / "full.ptz")
    assert code == 1 and stderr.strip() == f"error: {world['root'] / 'full.ptz'}: No space left on device"
    assert tree(world["root"]) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_is_one_line(world, tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, stderr = run_main("quantize", world["export"], "--out", locked / "m.ptz")
        assert code == 1 and "Permission denied" in stderr and len(stderr.strip().splitlines()) == 1
    finally:
        locked.chmod(0o700)


# --- One writer per run, interrupts and divergence -------------------------------------

TINY_TRAIN = ["--preset", "tiny", "--iterations", "2", "--warmup-steps", "0"]


def test_a_second_writer_fails_at_once_naming_the_holder(world, tmp_path):
    from windowgpt_cli.storage.runlock import run_lock

    run = tmp_path / "run"
    with run_lock(run):
        code, _, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run)
    assert code == 1 and f"pid {os.getpid()} on " in stderr and len(stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


def test_an_interrupted_run_exits_130_and_force_starts_afresh(world, tmp_path, monkeypatch):
    from windowgpt_cli.train import trainer as training

    run = tmp_path / "run"
    with monkeypatch.context() as m:  # Ctrl-C arrives during the first step
        m.setattr(training.StopRequests, "__init__", lambda self: setattr(self, "requested", True))
        code, stdout, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run)
    assert code == 130 and stderr.startswith("interrupted:") and "step 1" in stderr, stderr
    assert "checkpoint:interrupted step:1/2" in (run / "train.log").read_text()
    code, _, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run)
    assert code == 1 and "--force" in stderr
    code, stdout, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run, "--force")
    assert code == 0, stderr
    assert "--force: starting afresh" in stdout
    assert "checkpoint:interrupted" not in (run / "train.log").read_text()
    assert json.loads((run / "summary.json").read_text())["step"] == 2


def test_a_diverging_run_stops_with_an_error_and_writes_no_nan(world, tmp_path):
    run = tmp_path / "run"
    code, stdout, stderr = run_main("train", *TINY_TRAIN, "--iterations", "6", "--data", world["data"], "--out", run,
                                    "--matrix-lr", "1e30", "--scalar-lr", "1e30", "--tied-embed-lr", "1e30")
    assert code == 1 and "training diverged" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (run / "checkpoint.pt").exists() and not (run / "summary.json").exists()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
