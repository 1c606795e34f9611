"""Hostile and careless input to every stage: one line on stderr, the documented exit code,
and nothing new left on disk. The artifacts are built once per module."""
from __future__ import annotations

import contextlib
import io
import json
import signal
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
from windowgpt_cli.storage.files import sha256_file
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
                                          "train": {"iterations": 4, "warmup_steps": 0, "train_batch_tokens": 2048}})
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

    # a user's own folder, and inputs of the kinds a careless user gives
    w["notes"] = root / "notes"
    w["notes"].mkdir()
    (w["notes"] / "notes.txt").write_text("my notes\n")
    (w["notes"] / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n not a plot")
    (w["notes"] / "model.ptz.json").write_text('{"mine": true}\n')
    (w["notes"] / "input.jsonl").write_text(json.dumps({"text": "a document in the user's folder"}) + "\n")
    w["surrogate"] = root / "surrogate.jsonl"
    w["surrogate"].write_text('{"text": "ok"}\n{"text": "lone \\ud800 surrogate"}\n')
    w["deep"] = root / "deep.jsonl"
    w["deep"].write_text("[" * 200_000 + "]" * 200_000 + "\n")
    w["dup_config"] = root / "dup-config.json"
    w["dup_config"].write_text('{"train": {"iterations": 5, "iterations": 6}}')

    w["swapped_tables"] = root / "swapped-tables"  # another tokenizer's byte tables, copied in
    shutil.copytree(tiny_data_dir, w["swapped_tables"])
    shutil.copyfile(w["other_data"] / "tokenizer.meta.npz", w["swapped_tables"] / "tokenizer.meta.npz")

    w["reshaped_export"] = root / "export-reshaped"  # consistent hashes, one tensor of another shape
    shutil.copytree(w["export"], w["reshaped_export"])
    weights = w["reshaped_export"] / "model.safetensors"
    tensors, metadata = tensorfile.load(weights)
    tensors["blocks.0.attn.c_q.weight"] = tensors["blocks.0.attn.c_q.weight"][:, :-1].contiguous()
    tensorfile.save(weights, tensors, metadata)
    info = json.loads((w["reshaped_export"] / "export.json").read_text())
    info["sha256"] = sha256_file(weights)
    (w["reshaped_export"] / "export.json").write_text(json.dumps(info))

    def ptz_with(change) -> bytes:
        tensors, metadata = tensorfile.loads(payload)
        meta = json.loads(metadata[ptz.METADATA_KEY])
        change(meta["tensors"][next(iter(meta["tensors"]))])
        return ptz.compress_payload(tensorfile.dumps(tensors, {ptz.METADATA_KEY: json.dumps(meta)}))

    for name, change in (("vast_shape", lambda t: t.update(shape=[2**70, 0])),
                         ("int_shape", lambda t: t.update(shape=5)),
                         ("list_dtype", lambda t: t.update(dtype=["float32"]))):
        w[name] = root / f"{name}.ptz"
        w[name].write_bytes(ptz_with(change))

    w["altered_state"] = root / "altered-state"  # the weights' hash holds, the optimizer state was changed
    w["altered_state"].mkdir()
    payload_ckpt = torch.load(tiny_run_dir / "checkpoint.pt", weights_only=True)
    payload_ckpt["state"]["optimizers"][0]["param_groups"][0]["lr"] *= 10
    torch.save(payload_ckpt, w["altered_state"] / "checkpoint.pt")
    return w


# --- The cases: (stage args with {placeholders}, exit code, a fragment of the message) --

NEW = "{root}/new"  # where a case's output would go: it must never appear
CASES = [
    # outputs: never over a user's files, never over the command's own input
    ("prepare {corpus} --out {notes}", 1, "holds files that are not a data directory"),
    ("prepare {corpus} --out {run}", 1, "holds files that are not a data directory"),
    ("prepare {notes}/input.jsonl --out {notes}", 1, "contains the command's input"),
    ("prepare {corpus} --out ", 2, "is empty"),
    ("prepare --index {data} --tokenizer {other_tokenizer}", 1, "holds another tokenizer"),
    ("train --preset tiny --data {data} --out {notes}", 1, "holds files that are not a training run"),
    ("train --preset tiny --data {data} --out {export}", 1, "holds files that are not a training run"),
    ("train --preset tiny --data {data} --out {data}", 1, "is the command's own input"),
    ("train --preset tiny --data {data} --out ", 2, "is empty"),
    ("export {run} --out {run}", 1, "is the command's own input"),
    ("export {run} --out {notes}", 1, "holds files that are not an export"),
    ("export {run} --out {data}", 1, "holds files that are not an export"),
    ("export {ptz} --out " + NEW, 1, "a quantized artifact (.ptz), not a training run's checkpoint"),
    ("quantize {export} --out {export}/model.safetensors", 1, "lies inside the command's input"),
    ("quantize {run} --out {run}/checkpoint.pt", 1, "lies inside the command's input"),
    ("quantize {export} --out {notes}/photo.png", 1, "is not a .ptz windowgpt wrote"),
    ("quantize {export} --out {notes}/model.ptz", 1, "is not a quantize report windowgpt wrote; move it away"),
    ("tokenizer-meta {tokenizer} --out {notes}/photo.png", 1, "is not tokenizer byte tables"),
    ("plot {run} --out {notes}/photo.png", 1, "is not a plot"),
    ("pack --out {notes}/photo.png", 1, "is not packed code"),
    # texts and configurations that are not what they claim
    ("prepare {surrogate} --out " + NEW, 1, "line 2: field \"text\" holds a lone surrogate"),
    ("prepare {deep} --out " + NEW, 1, "line 1: JSON nested too deeply"),
    ("train --config {dup_config} --data {data} --out " + NEW, 1, "'iterations' appears twice"),
    # every number bounded before work starts
    ("prepare {corpus} --val-fraction nan --out " + NEW, 1, "--val-fraction nan"),
    ("prepare {corpus} --workers 0 --out " + NEW, 1, "--workers 0"),
    ("train --preset tiny --data {data} --out " + NEW + " --stop-at-step -1", 1, "--stop-at-step -1"),
    ("train --preset tiny --data {data} --out " + NEW + " --train-seq-len 0", 1, "--train-seq-len 0"),
    ("train --preset tiny --data {data} --out " + NEW + " --device tpu", 2, "--device"),
    ("quantize {export} --gptq --gptq-calib-samples 99999999 --out " + NEW + ".ptz", 1,
     "--gptq-calib-samples 99999999"),
    ("quantize {export} --gptq-percdamp nan --out " + NEW + ".ptz", 1, "--gptq-percdamp nan"),
    ("quantize {export} --budget 0 --out " + NEW + ".ptz", 1, "--budget 0"),
    ("generate {ptz} --data {data} --temperature nan", 1, "--temperature nan"),
    ("generate {ptz} --data {data} --max-new-tokens 0", 1, "--max-new-tokens 0"),
    ("inspect {ptz} --budget -5", 1, "--budget -5"),
    ("report {data}", 1, "neither the OUT directory of `make record` (a train/ folder inside) nor a run or export"),
    # what a score depends on, verified
    ("eval {ptz} --data {swapped_tables}", 1, "differs from the byte tables"),
    ("eval {reshaped_export} --data {data}", 1, "blocks.0.attn.c_q.weight is [64, 63]"),
    ("quantize {reshaped_export} --out " + NEW + ".ptz", 1, "blocks.0.attn.c_q.weight is [64, 63]"),
    ("eval {vast_shape} --data {data}", 1, "invalid"),
    ("inspect {int_shape}", 1, "invalid description"),
    ("eval {list_dtype} --data {data}", 1, "invalid description"),
    ("train --out {altered_state} --resume", 1, "random state do not match"),
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
    ("train --preset nope --data {data} --out " + NEW, 2, "'nope' is not one of 'default', 'tiny'"),
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
    ("quantize {export} --out {a_dir}", 1, "is a directory; give a file name for a .ptz"),
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
@pytest.mark.slow
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
    assert stages == {"prepare", "tokenizer-meta", "train", "export", "quantize", "eval", "eval-ttt", "generate",
                      "inspect", "plot", "pack", "report"}
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


@pytest.mark.slow
def test_an_interrupted_run_exits_130_and_force_starts_afresh(world, tmp_path, monkeypatch):
    from windowgpt_cli.train import trainer as training

    run = tmp_path / "run"
    with monkeypatch.context() as m:  # Ctrl-C arrives during the first step
        m.setattr(training.StopRequests, "__init__", lambda self: setattr(self, "signal", signal.SIGINT))
        code, stdout, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run)
    assert code == 130 and stderr.startswith("interrupted:") and "step 1" in stderr, stderr
    assert "checkpoint:interrupted step:1/2" in (run / "train.log").read_text()
    code, _, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run)
    assert code == 1 and "--force" in stderr
    code, stdout, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run, "--force")
    assert code == 0, stderr
    assert "starting afresh in" in stdout and "(--force: removed" in stdout
    assert "checkpoint:interrupted" not in (run / "train.log").read_text()
    assert json.loads((run / "summary.json").read_text())["step"] == 2


@pytest.mark.slow
def test_a_diverging_run_stops_with_an_error_and_writes_no_nan(world, tmp_path):
    run = tmp_path / "run"
    code, stdout, stderr = run_main("train", *TINY_TRAIN, "--iterations", "6", "--data", world["data"], "--out", run,
                                    "--matrix-lr", "1e30", "--scalar-lr", "1e30", "--tied-embed-lr", "1e30")
    assert code == 1 and "training diverged" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (run / "checkpoint.pt").exists() and not (run / "summary.json").exists()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))


@pytest.mark.slow
def test_a_run_that_wrote_no_checkpoint_starts_again_without_force(world, tmp_path):
    """A false start (Ctrl-C in the warm-up, a missing logger extra) leaves a config and a
    log but no checkpoint: the same command simply works again."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(tiny_preset_dict()))
    (run / "train.log").write_text("a run that stopped before its first checkpoint\n")
    code, stdout, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run)
    assert code == 0, stderr
    assert "starting afresh in" in stdout and "a run that wrote no checkpoint" in stdout
    assert "before its first checkpoint" not in (run / "train.log").read_text()


def tiny_preset_dict() -> dict:
    from windowgpt_cli.config import tiny_preset

    return tiny_preset().to_dict()


@pytest.mark.slow
def test_a_stop_after_the_last_step_exits_130_with_the_run_complete(world, tmp_path, monkeypatch):
    from windowgpt_cli.train import trainer as training

    finish = training.Trainer._finish

    def ctrl_c_while_finishing(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the run's handler only notes it
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(training.Trainer, "_finish", ctrl_c_while_finishing)
    run = tmp_path / "run"
    code, _, stderr = run_main("train", *TINY_TRAIN, "--data", world["data"], "--out", run)
    assert code == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted:") and "finished" in stderr
    assert json.loads((run / "summary.json").read_text())["step"] == 2


START = ["-m", "windowgpt_cli", "train", "--preset", "tiny", "--iterations", "3", "--warmup-steps", "0"]


@pytest.mark.parametrize("signum, code, label", [(signal.SIGINT, 130, "interrupted:"),
                                                  (signal.SIGTERM, 143, "terminated:")])
@pytest.mark.parametrize("delay", [0.3, 1.0])
def test_a_signal_at_start_up_exits_with_its_status_and_one_line(world, tmp_path, signum, code, label, delay):
    """Ctrl-C or SIGTERM while the command line is built or torch is imported."""
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, *START, "--data", str(world["data"]), "--out", str(tmp_path / "run")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    child.send_signal(signum)
    stdout, stderr = child.communicate(timeout=120)
    if child.returncode == 0:  # finished before the signal came: nothing to check
        return
    assert child.returncode == code, (child.returncode, stderr)
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith(label), stderr


@pytest.mark.slow
def test_a_closed_stdout_loses_lines_never_the_run(world, tmp_path):
    """`windowgpt train ... | head -2`: training goes on, its log and files complete."""
    import subprocess

    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, *START, "--data", str(world["data"]), "--out", str(run)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline()
    child.stdout.close()
    stderr = child.stderr.read()
    assert child.wait(timeout=300) == 0, stderr
    assert json.loads((run / "summary.json").read_text())["step"] == 3
    assert "step:3/3" in (run / "train.log").read_text()
    assert "Traceback" not in stderr and "standard output was closed" in stderr


def test_a_prompt_of_brackets_is_text(world):
    prompt = "[bold]a [/x] b [/] c [link=x]"
    code, stdout, stderr = run_main("generate", world["ptz"], "--data", world["data"], "--prompt", prompt,
                                    "--max-new-tokens", "8", "--temperature", "0")
    assert code == 0, stderr
    assert stdout.startswith(prompt)


def test_a_document_too_long_to_read_is_refused_naming_its_line(world, monkeypatch):
    from windowgpt_cli.data import corpus

    monkeypatch.setattr(corpus, "MAX_DOCUMENT_BYTES", 1000)
    code, _, stderr = run_main("prepare", world["corpus"], "--out", world["root"] / "new")
    assert code == 1 and "line 1: longer than 1,000 bytes" in stderr, stderr
    assert not (world["root"] / "new").exists()


BOMB_PROBE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
sys.argv = ["windowgpt", *sys.argv[1:]]
from windowgpt_cli.entry import windowgpt
windowgpt()
"""


@pytest.mark.parametrize("command", ["inspect", "eval"])
@pytest.mark.slow
def test_a_ptz_that_declares_the_largest_payload_costs_no_memory(world, tmp_path, command):
    """33 bytes of rANS that declare a 1 GiB payload: refused in one line under a 2 GB limit."""
    import subprocess

    bomb = tmp_path / "bomb.ptz"
    body = compressors._RANS_HEADER.pack(16, 0, 1 << 30, 0, 64) + lzma.compress(b"\0" * 4) + bytes(4 * 64)
    bomb.write_bytes(ptz.MAGIC + bytes([ptz.FORMAT_VERSION, compressors.COMPRESSORS["rans"].id])
                     + ptz._SIZE_AND_HASH.pack(1 << 30, bytes(32)) + body)
    args = [command, str(bomb)] + (["--data", str(world["data"])] if command == "eval" else [])
    done = subprocess.run([sys.executable, "-c", BOMB_PROBE, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(bomb) in lines[0], done.stderr
