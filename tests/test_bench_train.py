"""The training benchmarks' pure parts: log comparison and the reference's sampler seed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import compare_logs  # noqa: E402
import reference_seed  # noqa: E402


# --- compare_logs ---------------------------------------------------------------------------

def train_lines(step_avgs: dict[int, float], losses: dict[int, float] | None = None, total: int = 40) -> str:
    """Log lines as both the reference and windowgpt print them (with noise around)."""
    lines = ["warmup_step:20/20", "model_params:26993756"]
    for step, avg in step_avgs.items():
        loss = (losses or {}).get(step, 5.0)
        lines.append(f"step:{step}/{total} train_loss:{loss:.4f} train_time:{avg * step:.0f}ms step_avg:{avg:.2f}ms")
    return "\n".join(lines) + "\n"


def write_pair(log_dir: Path, name: str, ref: str, ours: str) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"ref_{name}.log").write_text(ref)
    (log_dir / f"ours_{name}.log").write_text(ours)


def test_step_time_is_the_mean_over_steps_11_to_the_last_common_step():
    ref = compare_logs.parse_log(train_lines({10: 1000.0, 20: 800.0, 40: 700.0}))
    ours = compare_logs.parse_log(train_lines({10: 900.0, 20: 600.0, 30: 550.0}))
    # last common step: 20; reference (800*20 - 1000*10) / 10 = 600, ours (600*20 - 900*10) / 10 = 300
    assert compare_logs.step_time(ref, ours) == {"reference_ms": 600.0, "windowgpt_ms": 300.0, "ratio": 0.5}
    no_step_10 = compare_logs.parse_log(train_lines({20: 800.0, 40: 700.0}))
    assert compare_logs.step_time(no_step_10, ours)["ratio"] is None
    assert compare_logs.step_time(ref, None)["reference_ms"] is None


def test_the_result_file_has_its_shape_and_takes_later_directories_first(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    write_pair(first, "record_786k", train_lines({10: 700.0, 40: 670.0}), train_lines({10: 650.0, 40: 610.0}))
    write_pair(first, "full_786k", train_lines({10: 1.0, 40: 1.0}), train_lines({10: 1.0, 40: 1.0}))
    write_pair(second, "full_786k", train_lines({10: 700.0, 40: 640.0}), train_lines({10: 600.0, 40: 560.0}))
    parity_steps = {10: 120.0, 50: 110.0, 100: 105.0, 200: 104.0}
    ref = train_lines(parity_steps, {50: 4.1234, 100: 3.5, 200: 3.1}, total=200)
    ref += "step:200/200 val_loss:3.0000 val_bpb:1.8000 train_time:20800ms step_avg:104.00ms\n"
    ours = train_lines({**parity_steps, 200: 102.0}, {50: 4.1200, 100: 3.51, 200: 3.12}, total=200)
    ours += "step:200/200 val_loss:3.0100 val_bpb:1.8100 train_time:20400ms step_avg:102.00ms\n"
    write_pair(second, "parity", ref, ours)
    (second / "gpu.txt").write_text("NVIDIA H200\n")
    out = tmp_path / "results" / "train_step_h200.json"

    compare_logs.main([str(first), str(second), "--json", str(out)])

    result = json.loads(out.read_text())
    assert set(result) == {"gpu", "configs", "parity"} and result["gpu"] == "NVIDIA H200"
    assert list(result["configs"]) == ["record_786k", "full_786k", "record_131k"]
    assert result["configs"]["record_786k"] == {"reference_ms": 660.0, "windowgpt_ms": 596.67, "ratio": 0.904}
    assert result["configs"]["full_786k"]["reference_ms"] == 620.0  # the second directory's pair
    # No record_131k pair: the parity run's steps 11..200
    assert result["configs"]["record_131k"]["reference_ms"] == pytest.approx((104.0 * 200 - 1200.0) / 190, abs=0.01)
    assert result["parity"] == {"train_loss_50": [4.1234, 4.12], "train_loss_100": [3.5, 3.51],
                                "train_loss_200": [3.1, 3.12], "val_bpb": [1.8, 1.81]}
    table = capsys.readouterr().out
    assert "| record_786k | 660.0 | 596.7 | 0.904 |" in table
    assert "| val_bpb | 1.8000 | 1.8100 | 0.0100 |" in table


def test_missing_runs_are_null(tmp_path):
    write_pair(tmp_path, "record_786k", train_lines({10: 700.0, 40: 670.0}), "")  # ours died before logging
    result = compare_logs.assemble("gpu", compare_logs.read_pairs([tmp_path]))
    assert all(v is None for row in result["configs"].values() for v in row.values())
    assert result["parity"]["val_bpb"] == [None, None]
    assert "| record_786k | - | - | - |" in compare_logs.markdown(result)


# --- reference_seed ---------------------------------------------------------------------------

def test_the_reference_seed_hashes_the_train_shard_paths_as_given(tmp_path):
    from windowgpt_cli.config import apply_overrides, preset

    data = tmp_path / "data"
    data.mkdir()
    for name in ("fineweb_train_000000.bin", "fineweb_train_000001.bin"):
        (data / name).write_bytes(b"")
    seed = reference_seed.reference_data_seed(str(data))
    (data / "fineweb_val_000000.bin").write_bytes(b"")
    (data / "manifest.json").write_text("{}")
    assert reference_seed.reference_data_seed(str(data)) == seed  # only train shards count
    link = tmp_path / "link"
    link.symlink_to(data)
    assert reference_seed.reference_data_seed(str(link)) != seed  # the path as given, not resolved
    (data / "fineweb_train_000002.bin").write_bytes(b"")
    assert reference_seed.reference_data_seed(str(data)) != seed
    # A 64-bit seed, which --data-seed takes.
    assert apply_overrides(preset("default"), {"train": {"data_seed": seed}}).resolved().train.data_seed == seed
