"""Each writing stage killed at each of its renames (just before and just after): the next
stage then sees the previous complete output, the new complete one, or a clear refusal.

The kill is a BaseException raised from `artifacts.rename`, which skips ordinary cleanup
as a real kill would."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from windowgpt_cli.storage import files as artifacts
from windowgpt_cli.artifacts import weights as model_io, ptz
from windowgpt_cli.storage.files import sha256_file
from windowgpt_cli.data.manifest import verify_data
from windowgpt_cli.errors import WindowGPTError

pytestmark = pytest.mark.usefixtures("eval_single_thread")


class Killed(BaseException):
    """Stands for SIGKILL: no except Exception clause sees it."""


def kill_runs(monkeypatch, stage: Callable[[], None], reset: Callable[[], None], check: Callable[[], None]) -> int:
    """Run `stage` once per rename it makes, killed just before and just after that rename;
    after each kill, `check` what the next stage sees. Returns the number of renames."""
    real = artifacts.rename
    k = 0
    while True:
        k += 1
        for after in (False, True):
            calls = [0]

            def rename(src, dst, k=k, after=after, calls=calls):
                calls[0] += 1
                if calls[0] == k and not after:
                    raise Killed
                real(src, dst)
                if calls[0] == k and after:
                    raise Killed

            reset()
            monkeypatch.setattr(artifacts, "rename", rename)
            try:
                stage()
            except Killed:
                pass
            else:
                assert calls[0] < k, "the stage finished although it was killed"
                monkeypatch.setattr(artifacts, "rename", real)
                return k - 1
            finally:
                monkeypatch.setattr(artifacts, "rename", real)
            check()


def refused_or(accept: Callable[[], None]) -> str:
    """'ok' when the next stage accepts the output (and `accept` found it complete),
    'refused' when it refuses with a WindowGPTError."""
    try:
        accept()
    except WindowGPTError as exc:
        assert "\n" not in str(exc)
        return "refused"
    return "ok"


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_prepare_killed_at_each_write(monkeypatch, tmp_path, eval_tokenizer, data_demo_corpus):
    from windowgpt_cli.data.prepare import prepare

    texts = [json.loads(line)["text"][:2000] for line in data_demo_corpus.read_text().splitlines()[:40]]
    a_train, a_val = write_jsonl(tmp_path / "a.jsonl", texts[:15]), write_jsonl(tmp_path / "av.jsonl", texts[15:20])
    b_train, b_val = write_jsonl(tmp_path / "b.jsonl", texts[20:35]), write_jsonl(tmp_path / "bv.jsonl", texts[35:])
    data = tmp_path / "data"

    def run(train, val):
        return prepare([train], data, tokenizer=eval_tokenizer, val_inputs=[val], workers=1, shard_tokens=4000)

    old = run(a_train, a_val).manifest
    saved = tmp_path / "saved"
    shutil.copytree(data, saved)
    new = run(b_train, b_val).manifest
    seen = set()

    def reset():
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(saved, data)

    def check():
        def accept():
            manifest = verify_data(data, hash_splits=("train", "val")).raw
            assert manifest["splits"] in (old["splits"], new["splits"])
            seen.add("old" if manifest["splits"] == old["splits"] else "new")
        seen.add(refused_or(accept))

    renames = kill_runs(monkeypatch, lambda: run(b_train, b_val), reset, check)
    assert renames >= 6  # shards, tokenizer, its tables, the manifest, and the directory twice
    assert {"old", "new", "ok"} <= seen


def test_export_killed_at_each_write(monkeypatch, tmp_path, quant_run_dir):
    from windowgpt_cli.artifacts.export import export

    out = tmp_path / "export"
    old = export(quant_run_dir, out, "ema")["sha256"]
    saved = tmp_path / "saved"
    shutil.copytree(out, saved)
    seen = set()

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(saved, out)

    def check():
        def accept():
            loaded = model_io.load_weights(out)
            assert loaded.sha256 == old or loaded.sha256 == sha256_file(out / "model.safetensors")
            seen.add("old" if loaded.sha256 == old else "new")
        seen.add(refused_or(accept))

    assert kill_runs(monkeypatch, lambda: export(quant_run_dir, out, "last"), reset, check) == 5
    assert {"old", "new"} <= seen


@pytest.mark.slow
def test_quantize_killed_at_each_write(monkeypatch, tmp_path, quant_run_dir):
    from windowgpt_cli.quant.quantize import quantize, report_path

    out = tmp_path / "m.ptz"
    quantize(quant_run_dir, out, compressor="lzma", device="cpu")
    old = sha256_file(out)
    saved = out.read_bytes(), report_path(out).read_bytes()
    seen = set()

    def reset():
        out.write_bytes(saved[0])
        report_path(out).write_bytes(saved[1])

    def check():
        def accept():
            ptz.load(out)
            current = sha256_file(out)
            seen.add("old" if current == old else "new")
            if report_path(out).exists():  # a report always describes the .ptz beside it
                assert json.loads(report_path(out).read_text())["sha256"] == current
        seen.add(refused_or(accept))

    assert kill_runs(monkeypatch, lambda: quantize(quant_run_dir, out, compressor="rans", device="cpu"),
                     reset, check) == 2
    assert {"old", "new"} <= seen


@pytest.mark.slow
def test_train_killed_at_each_write(monkeypatch, tmp_path, tiny_data_dir):
    from windowgpt_cli.config import apply_overrides, tiny_preset
    from windowgpt_cli.artifacts.export import export
    from windowgpt_cli.train.run import train

    cfg = apply_overrides(tiny_preset(), {"data": {"data_path": str(tiny_data_dir)},
                                          "train": {"iterations": 2, "warmup_steps": 0}})
    run = tmp_path / "run"
    seen = set()

    def reset():
        shutil.rmtree(run, ignore_errors=True)

    def check():
        seen.add(refused_or(lambda: export(run, tmp_path / "export")))

    # config.json, the checkpoint, summary.json
    assert kill_runs(monkeypatch, lambda: train(cfg, run, echo=lambda _: None), reset, check) == 3
    assert seen == {"ok", "refused"}
