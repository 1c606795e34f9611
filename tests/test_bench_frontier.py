"""bench/frontier_results.py: one run's figures from frontier.sh's logs, the merge of
several calls' runs into one JSON, and its table."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def write_run(logs: Path, name: str, steps: int, val_bpb: float, model_bytes: int, post_ema: float | None,
              kernels: dict | None = None, fit: dict | None = None) -> None:
    folder = logs / name
    folder.mkdir(parents=True)
    summary = {"step": steps, "ms_per_step": 900.0, "training_plus_calibration_ms": 240_000.0,
               "calibration": {"seconds": 4.0}, "graphs_compiled_in_training": 0, "post_ema_val_bpb": post_ema,
               **({"kernels": kernels} if kernels else {})}  # older summaries have none
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text(json.dumps({"model": {"vocab_size": 8192}}))
    quantize = {"model_bytes": model_bytes, "compressor": "groups", **({"fit": fit} if fit else {})}
    (folder / "quantize.json").write_text(json.dumps(quantize))
    (folder / "eval.json").write_text(json.dumps({"val_bpb": val_bpb}))


def collect(*args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH / "frontier_results.py"), *args], capture_output=True,
                          text=True, env={"COMMIT": "abc1234", "PATH": ""}, check=True)
    return done.stdout


def test_runs_merge_over_calls_and_count_the_code_with_the_model(tmp_path):
    first, second, out = tmp_path / "call1", tmp_path / "call2", tmp_path / "frontier_h200.json"
    write_run(first, "default", 400, 1.5056, 10_000_000, 1.49)
    write_run(first, "frontier", 238, 1.4978, 15_700_000, 1.50)
    (first / "packed_code_bytes").write_text("250000")
    kernels = {"attn_backend": "triton_fa4", "fused_mlp": "quack", "fold_output_scales": "on"}
    fit = {"allowed_bytes": 15_740_000, "bytes_before": 15_900_000, "zeroed_codes": 1_000, "rounds": 1,
           "fitted": True, "candidates": 9_000, "bytes_after": 15_600_000, "zeroed_fraction": 0.01}
    write_run(second, "frontier", 270, 1.4744, 15_600_000, None, kernels, fit)  # again, its pre-quant score unknown
    (second / "packed_code_bytes").write_text("260000")
    collect(str(first), "--out", str(out))
    table = collect(str(second), "--out", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["default", "frontier"] and runs["frontier"]["steps"] == 270
    assert runs["frontier"]["total_bytes"] == 15_600_000 + 260_000 and runs["frontier"]["within_16mb"]
    assert runs["default"]["total_bytes"] == 10_250_000 and runs["default"]["commit"] == "abc1234"
    assert runs["default"]["within_16mb"] and runs["default"]["pre_quant_val_bpb"] == 1.49
    assert runs["frontier"]["kernels"] == kernels and "kernels" not in runs["default"]
    assert runs["frontier"]["fit"] == {"zeroed_codes": 1_000, "zeroed_fraction": 0.01, "bytes_before": 15_900_000}
    assert "fit" not in runs["default"]
    assert "| frontier | 270 | 900.0 |  | 1.47440 | -0.0312 | 15,860,000 |" in table


# A stand-in for `python3` on PATH: `-m windowgpt_cli CMD ... --out P` (or `CODE.pyz CMD ...`, logged
# as packed:CMD) logs CMD and writes what
# frontier.sh reads from CMD (eval fails while FAIL_EVAL is set; its val_bpb names --seq-len);
# anything else runs Python.
FAKE_PYTHON = r'''#!/usr/bin/env bash
via=; if [ "${1##*.}" = pyz ]; then via=packed:; set -- -m windowgpt_cli "${@:2}"; fi
if [ "$1" != "-m" ] || [ "$2" != "windowgpt_cli" ]; then exec "$REAL_PYTHON" "$@"; fi
cmd=$3; shift 3; [ -z "${ARGS:-}" ] || echo "$via$cmd $*" >> "$ARGS"
out=; seq=; while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; [ "$1" = --seq-len ] && seq=$2; shift; done
echo "$via$cmd" >> "$CALLS"
case $cmd in
  pack) echo zip > "$out" ;;
  prepare|export) mkdir -p "$out" ;;
  train) mkdir -p "$out"; echo "stopping_early: wallclock_cap"
    echo '{"step": 9, "ms_per_step": 500.0, "training_plus_calibration_ms": 240000.0, "post_ema_val_bpb": 1.6}' \
      > "$out/summary.json"
    echo '{"model": {"vocab_size": 1024}}' > "$out/config.json" ;;
  quantize) echo ptz > "$out"; echo '{"model_bytes": 9000000, "compressor": "groups"}' ;;
  eval) [ -z "${FAIL_EVAL:-}" ] || exit 1  # its val_bpb 1.4096 at --seq-len 4096
    echo "{\"val_bpb\": 1.${seq:-55}, \"seq_len\": ${seq:-2048}}" ;;
esac
'''


def run_frontier(tmp_path: Path, **env: str) -> list[str]:
    """bench/frontier.sh's default run with the stand-in; the commands it ran, in order."""
    fake = tmp_path / "bin" / "python3"
    if not fake.exists():
        fake.parent.mkdir()
        fake.write_text(FAKE_PYTHON)
        fake.chmod(0o755)
        (tmp_path / "shared").mkdir()
    calls = tmp_path / "calls.txt"
    calls.unlink(missing_ok=True)
    subprocess.run(["bash", str(BENCH / "frontier.sh"), str(tmp_path / "shared"), str(tmp_path / "work"),
                    str(tmp_path / "logs")], capture_output=True, text=True, check=True,
                   env={"PATH": f"{fake.parent}:/usr/bin:/bin", "REAL_PYTHON": sys.executable, "CALLS": str(calls),
                        "RUNS": "default", "COMMIT": "abc1234", **env})
    return calls.read_text().split()


def test_resume_keeps_a_finished_training_and_runs_the_later_stages(tmp_path):
    assert run_frontier(tmp_path, FAIL_EVAL="1") == ["pack", "prepare", "train", "export", "packed:quantize", "eval"]
    assert not (tmp_path / "logs" / "frontier_h200.json").exists()
    assert run_frontier(tmp_path, RESUME="1") == ["pack", "export", "packed:quantize", "eval"]
    runs = json.loads((tmp_path / "logs" / "frontier_h200.json").read_text())["runs"]
    assert runs["default"]["steps"] == 9 and runs["default"]["val_bpb"] == 1.55
    # Without RESUME: trained again.
    assert run_frontier(tmp_path) == ["pack", "train", "export", "packed:quantize", "eval"]


def test_tokenizer_runs_prepare_their_own_data_and_train_the_preset_as_it_is(tmp_path):
    args = tmp_path / "args.txt"
    run_frontier(tmp_path, RUNS="frontier_case_markers frontier_sample_64mb frontier_no_split_words", ARGS=str(args))
    lines = args.read_text().splitlines()
    prepares = [line for line in lines if line.startswith("prepare ")]
    trains = [line.split() for line in lines if line.startswith("train ")]
    assert len(prepares) == 3 and "--case-markers" in prepares[0] and "--vocab-size 8192" in prepares[0]
    assert "--tokenizer-sample-bytes 67108864" in prepares[1] and "--case-markers" not in prepares[1]
    assert "--no-split-words" in prepares[2] and "--case-markers" not in prepares[2]
    data = [t[t.index("--data") + 1] for t in trains]
    assert len(set(data)) == 3 and all("sp8192" in d for d in data)
    assert all(t[t.index("--preset") + 1] == "frontier" and "--fp8-mlp" not in t for t in trains)


def test_quantize_runs_from_the_packed_code_against_the_record_budget(tmp_path):
    args = tmp_path / "args.txt"
    run_frontier(tmp_path, ARGS=str(args))
    quantize = next(line.split() for line in args.read_text().splitlines() if "quantize " in line)
    assert quantize[0] == "packed:quantize" and quantize[quantize.index("--budget") + 1] == "16000000"
    pack = next(line.split() for line in args.read_text().splitlines() if line.startswith("pack "))
    assert pack[1:3] == ["--strip", "--lzma"]


def test_longer_windows_score_the_same_ptz_and_are_collected(tmp_path):
    args = tmp_path / "args.txt"
    run_frontier(tmp_path, EVAL_SEQ_LENS="4096 3072", ARGS=str(args))
    evals = [line.split() for line in args.read_text().splitlines() if line.startswith("eval ")]
    assert [e[e.index("--seq-len") + 1] if "--seq-len" in e else None for e in evals] == [None, "4096", "3072"]
    assert len({e[1] for e in evals}) == 1 and evals[0][1].endswith("model.ptz")
    run = json.loads((tmp_path / "logs" / "frontier_h200.json").read_text())["runs"]["default"]
    assert run["val_bpb_by_eval_seq_len"] == {"2048": 1.55, "3072": 1.3072, "4096": 1.4096}  # its own length too
    assert run["val_bpb"] == 1.55


@pytest.mark.parametrize("run, group, changed", [
    ("frontier_reference_optim", "optim", {"muon_row_normalize", "muon_momentum", "muon_wd", "adam_wd", "embed_wd"}),
    ("frontier_reference_forms", "model", {"smear_gate_width", "parallel_mlp_reads_x0"}),
])
def test_the_reference_runs_are_the_preset_with_the_reference_s_values(tmp_path, run, group, changed):
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app
    from windowgpt_cli.config import RunConfig, preset

    args = tmp_path / "args.txt"
    run_frontier(tmp_path, RUNS=run, ARGS=str(args))
    train = next(line.split() for line in args.read_text().splitlines() if line.startswith("train "))[1:]
    for flag in ("--data", "--out"):  # what --print-config does not take
        at = train.index(flag)
        del train[at:at + 2]
    printed = CliRunner().invoke(app, ["train", "--print-config", *train])
    assert printed.exit_code == 0, printed.output
    printed = json.loads(printed.stdout)[group]
    reference, frontier = (json.loads(json.dumps(dataclasses.asdict(c)))[group]
                           for c in (RunConfig(), preset("frontier")))
    assert {k: printed[k] for k in changed} == {k: reference[k] for k in changed}
    assert {k: v for k, v in printed.items() if k not in changed} == \
        {k: v for k, v in frontier.items() if k not in changed}
    assert all(frontier[k] != reference[k] for k in changed)


def test_a_compile_cache_reaches_every_training_and_only_when_named(tmp_path):
    args = tmp_path / "args.txt"
    run_frontier(tmp_path, RUNS="default frontier", COMPILE_CACHE=str(tmp_path / "c.cache"), ARGS=str(args))
    trains = [line.split() for line in args.read_text().splitlines() if line.startswith("train ")]
    assert len(trains) == 2 and all(t[t.index("--compile-cache") + 1] == str(tmp_path / "c.cache") for t in trains)
    args.unlink()
    run_frontier(tmp_path, ARGS=str(args))
    assert all("--compile-cache" not in line for line in args.read_text().splitlines())
