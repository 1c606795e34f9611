"""The train stage on the CPU: it learns, it logs, it checkpoints, it resumes exactly."""
import json
import re
import threading
import time

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.artifacts.checkpoint import load_checkpoint
from windowgpt_cli.cli.app import app
from windowgpt_cli.config import RunConfig, apply_overrides, tiny_preset
from windowgpt_cli.train.run import train

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tiny_cfg(data_dir, **train_settings):
    return apply_overrides(tiny_preset(), {"data": {"data_path": str(data_dir)}, "train": train_settings})


def test_tiny_run_learns_and_writes_its_artifacts(tiny_run_dir):
    names = {p.name for p in tiny_run_dir.iterdir()}
    assert {"config.json", "train.log", "metrics.jsonl", "checkpoint.pt", "summary.json"} <= names
    rows = [r for r in metrics(tiny_run_dir) if "train_loss" in r]
    first, last = rows[0]["train_loss"], rows[-1]["train_loss"]
    assert first > 6.5  # about ln(1024): an untrained model
    assert last < first - 1.5, (first, last)
    summary = json.loads((tiny_run_dir / "summary.json").read_text())
    assert summary["step"] == 30 and summary["val_bpb"] < 3.0
    assert summary["post_ema_val_bpb"] < 3.2  # EMA warm-up: the average follows the weights
    log = (tiny_run_dir / "train.log").read_text()
    assert "step:30/30 val_loss:" in log and "DIAGNOSTIC post_ema" in log
    saved = RunConfig.load(tiny_run_dir / "config.json")
    assert saved.model.num_layers == 4 and saved.train.iterations == 30
    ckpt = load_checkpoint(tiny_run_dir)
    assert ckpt.step == 30 and ckpt.swa_count > 0 and ckpt.tokenizer_sha256


@pytest.mark.slow
@pytest.mark.parametrize("switched", [{}, {"qat_start_fraction": 0.25}])  # stopped after the rounding began
def test_interrupted_then_resumed_run_matches_an_uninterrupted_one(tiny_data_dir, tmp_path, switched):
    cfg = tiny_cfg(tiny_data_dir, iterations=12, train_log_every=1, train_batch_tokens=2048,  # small steps: quick
                   **switched)
    train(cfg, tmp_path / "straight")
    assert ("qat:on step:3" in (tmp_path / "straight" / "train.log").read_text()) == bool(switched)
    paused = train(cfg, tmp_path / "paused", stop_at_step=5)
    assert not paused.finished and paused.step == 5
    assert load_checkpoint(tmp_path / "paused").step == 5
    train(cfg, tmp_path / "paused", resume=True)
    straight = {r["step"]: r["train_loss"] for r in metrics(tmp_path / "straight") if "train_loss" in r}
    resumed = {r["step"]: r["train_loss"] for r in metrics(tmp_path / "paused") if "train_loss" in r}
    assert sorted(resumed) == list(range(1, 13))
    assert all(straight[s] == resumed[s] for s in range(1, 13)), (straight, resumed)
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "paused")
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert all(torch.equal(a.ema[k], b.ema[k]) for k in a.ema)


@pytest.mark.slow
def test_the_final_checkpoint_is_written_while_the_ema_weights_are_scored(tiny_data_dir, tmp_path, monkeypatch):
    """Its file is written by a thread alongside the EMA evaluation: a failed write still
    fails the run (no summary), and what is written does not depend on when: the last
    step's weights, not the EMA weights the model holds meanwhile."""
    from windowgpt_cli.train import trainer as training
    from windowgpt_cli.errors import ArtifactError

    writers = []

    def failing_save(path, ckpt):
        writers.append(threading.current_thread())
        raise ArtifactError(f"{path}: disk full")

    cfg = tiny_cfg(tiny_data_dir, iterations=3, warmup_steps=0)
    monkeypatch.setattr(training, "save_checkpoint", failing_save)
    with pytest.raises(ArtifactError, match="disk full"):
        train(cfg, tmp_path / "failed")
    assert writers and writers[0] is not threading.main_thread()
    assert not (tmp_path / "failed" / "summary.json").exists()
    monkeypatch.undo()
    train(cfg, tmp_path / "prompt")
    real_save = training.save_checkpoint

    def slow_save(path, ckpt):  # writes once the model holds the EMA weights
        time.sleep(0.5)
        return real_save(path, ckpt)

    monkeypatch.setattr(training, "save_checkpoint", slow_save)
    train(cfg, tmp_path / "slow")
    a, b = load_checkpoint(tmp_path / "prompt"), load_checkpoint(tmp_path / "slow")
    assert a.step == b.step == 3
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert all(torch.equal(a.ema[k], b.ema[k]) for k in a.ema)
    assert not all(torch.equal(b.model[k], b.ema[k].to(b.model[k].dtype)) for k in b.model)


def test_refuses_to_overwrite_a_run(tiny_run_dir):
    result = runner.invoke(app, ["train", "--preset", "tiny", "--data", "x", "--out", str(tiny_run_dir)], env=WIDE)
    assert result.exit_code == 1 and "already holds a checkpoint" in result.output


def test_help_lists_the_settings_as_kebab_case_flags():
    result = runner.invoke(app, ["train", "--help"], env=WIDE)
    assert result.exit_code == 0
    for flag in ("--window-attn-size", "--num-sink-tokens", "--matrix-lr", "--max-wallclock-seconds",
                 "--attn-backend", "--resume", "--stop-at-step", "--ve-layers", "--no-tie-embeddings",
                 "--use-gptq", "--gptq-calib-samples", "--gptq-reserve-seconds"):
        assert flag in result.output


@pytest.mark.parametrize("flags,message", [
    (["--num-heads", "3"], "does not divide model_dim"),
    (["--window-attn-size", "16", "--window-attn-layers", "1,9"], "window_attn_layers names layer 9"),
    (["--vocab-size", "2048"], "has 1024 tokens but vocab_size=2048"),
    (["--use-gptq", "--max-wallclock-seconds", "10", "--gptq-reserve-seconds", "10"], "leaves no training time"),
])
def test_invalid_settings_are_one_line_errors(tiny_data_dir, tmp_path, flags, message):
    args = ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(tmp_path / "r"), *flags]
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code != 0
    assert message in result.output
    if result.exit_code == 1:
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_missing_data_is_a_one_line_error(tmp_path):
    result = runner.invoke(app, ["train", "--preset", "tiny", "--data", str(tmp_path / "nope"), "--out",
                                 str(tmp_path / "r")], env=WIDE)
    assert result.exit_code == 1 and "no such data directory" in result.output


def test_a_malformed_flag_value_is_a_one_line_error(tmp_path):
    """Through the installed entry point, usage errors are one line and exit code 2 (click's)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "windowgpt_cli", "train", "--preset", "tiny",
                             "--data", str(tmp_path), "--out", str(tmp_path / "r"), "--matrix-lr", "fast"],
                            capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--matrix-lr" in lines[0] and lines[0].startswith("error:")


@pytest.mark.slow
def test_train_ends_with_a_table_or_json(tiny_data_dir, tmp_path):
    args = ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--iterations", "3", "--warmup-steps", "0"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "a"), "--json"], env=WIDE)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)  # the log lines went to stderr
    assert record == json.loads((tmp_path / "a" / "summary.json").read_text())
    assert record["step"] == 3 and record["checkpoint"] == str(tmp_path / "a" / "checkpoint.pt")
    assert record["ms_per_step"] == pytest.approx(record["training_time_ms"] / 3, abs=0.05)
    assert record["tokens_per_s"] == pytest.approx(3 * tiny_preset().train.train_batch_tokens
                                                   / (record["training_time_ms"] / 1000), rel=1e-3)
    assert "step:3/3 val_loss:" in result.stderr
    timings = record["timings_s"]  # where the command's wall time went, from the process's start
    assert {"start", "setup", "validation", "checkpoint", "training", "other", "total"} <= set(timings)
    assert timings["training"] == pytest.approx(record["training_time_ms"] / 1000, abs=1e-3)
    assert sum(v for k, v in timings.items() if k != "total") == pytest.approx(timings["total"], abs=0.01)
    assert "time: start" in result.stderr
    table = runner.invoke(app, [*args, "--out", str(tmp_path / "b")], env=WIDE)
    assert table.exit_code == 0, table.output
    cells = re.sub(r"[\s│]", "", table.stdout)  # a long path is folded over lines, never cut
    for row in ("steps", "training time", "ms per step", "tokens / second", "val_bpb (EMA weights)",
                str(tmp_path / "b" / "checkpoint.pt")):
        assert row.replace(" ", "") in cells


def test_the_bar_plans_for_the_wallclock_cap():
    from windowgpt_cli.cli.train import planned_steps

    info = {"step": 2, "iterations": 1000, "elapsed_ms": 2000.0, "wallclock_ms": 3000.0}
    assert planned_steps(info) == (3, 1.0)  # the cap stops it after one more step of 1 s
    assert planned_steps({**info, "wallclock_ms": None}) == (1000, 998.0)
    assert planned_steps({**info, "elapsed_ms": 3500.0}) == (2, 0.0)  # the cap is reached: this step is the last


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_bar_shows_a_finished_cuda_loss_without_waiting_for_the_current_one():
    from windowgpt_cli.cli.train import _FinishedLoss

    loss = _FinishedLoss()
    assert loss.read(torch.tensor(1.5, device="cuda")) in {"-", "1.5000"}
    torch.cuda.synchronize()
    assert loss.read(torch.tensor(2.5, device="cuda")) in {"1.5000", "2.5000"}  # the previous one at least
    third, fourth = torch.tensor(3.5, device="cuda"), torch.tensor(4.5, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the GPU busy: the third loss cannot be ready at once
    assert loss.read(third) == "2.5000"
    torch.cuda.synchronize()
    assert loss.read(fourth) in {"3.5000", "4.5000"}


@pytest.mark.slow
def test_validation_runs_through_the_compiled_training_graph(tiny_data_dir, tmp_path):
    """Validating at the start and the end compiles nothing beyond the training step's graph."""
    from torch._dynamo.testing import CompileCounter

    from windowgpt_cli.distributed import DistContext
    from windowgpt_cli.train.trainer import RunLog, Trainer, build_setup

    cfg = tiny_cfg(tiny_data_dir, iterations=2, warmup_steps=1).resolved()
    setup = build_setup(cfg, DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    counter = CompileCounter()
    torch._dynamo.reset()
    setup.forward = torch.compile(setup.model, backend=counter, dynamic=False, fullgraph=True)
    setup.compiled = True
    tmp_path.mkdir(exist_ok=True)
    trainer = Trainer(setup, tmp_path, RunLog(tmp_path, enabled=False))
    trainer.warm_up()
    assert counter.frame_count == 1
    val_loss, val_bpb = trainer.validate()
    assert counter.frame_count == 1  # no inference graph beside the training one
    assert 0 < val_loss < 10 and 0 < val_bpb < 10


@pytest.mark.parametrize("mix_order, multi_kernel", [(True, False), (False, True)])
def test_the_step_is_compiled_with_the_runs_inductor_settings(tiny_data_dir, monkeypatch, mix_order, multi_kernel):
    """--compile-tuning, --compile-mix-order and --compile-multi-kernel reach torch.compile's
    options (on the CPU the step stays eager, but the options are the ones CUDA would compile with)."""
    from windowgpt_cli import runtime
    from windowgpt_cli.distributed import DistContext
    from windowgpt_cli.train import trainer

    calls = []
    monkeypatch.setattr(trainer, "compiled", lambda fn, enabled, **options: calls.append(options) or fn)
    cfg = tiny_cfg(tiny_data_dir, compile_tuning="gemm", compile_mix_order=mix_order,
                   compile_multi_kernel=multi_kernel).resolved()
    setup = trainer.build_setup(cfg, DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    assert calls == [{"tuning": "gemm", "mix_order": mix_order, "multi_kernel": multi_kernel}]
    assert setup.forward is setup.model
    compiled = runtime.compiled(lambda x: x, True, **calls[0])
    assert (compiled.options.get("triton.mix_order_reduction", True)) is mix_order
    assert compiled.options.get("triton.multi_kernel", 0) == int(multi_kernel)


def test_warm_up_takes_one_micro_batch_per_step_and_undoes_itself(tiny_data_dir, tmp_path):
    from windowgpt_cli.distributed import DistContext
    from windowgpt_cli.train.trainer import RunLog, Trainer, build_setup

    cfg = tiny_cfg(tiny_data_dir, iterations=2, warmup_steps=3).resolved()
    setup = build_setup(cfg, DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    assert setup.grad_accum_steps > 1
    calls = []
    model_forward = setup.forward
    setup.forward = lambda x, y: calls.append(x.shape) or model_forward(x, y)
    trainer = Trainer(setup, tmp_path, RunLog(tmp_path, enabled=False))
    weights = {k: v.clone() for k, v in setup.model.state_dict().items()}
    stream = trainer.stream.state_dict()
    trainer.warm_up()
    assert len(calls) == 3  # one micro-batch per warm-up step
    assert all(torch.equal(v, weights[k]) for k, v in setup.model.state_dict().items())
    assert trainer.stream.state_dict() == stream and trainer.step == 0


def _one_step(data_dir, per_pass: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """(weights before, weights after one training step, its loss) with per_pass micro-batches a pass."""
    from windowgpt_cli.distributed import DistContext
    from windowgpt_cli.train.trainer import RunLog, Trainer, build_setup

    cfg = tiny_cfg(data_dir, iterations=1, warmup_steps=0, micro_batches_per_pass=per_pass).resolved()
    setup = build_setup(cfg, DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    assert setup.micro_batches_per_pass == per_pass and setup.passes_per_step == setup.grad_accum_steps // per_pass
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    trainer = Trainer(setup, data_dir, RunLog(data_dir, enabled=False))
    loss = trainer.train_step(trainer._direct_batch, 1.0)
    return before, setup.model.state_dict(), loss


@pytest.mark.slow
def test_micro_batches_in_one_pass_give_the_step_of_separate_passes(tiny_data_dir):
    start, separate, separate_loss = _one_step(tiny_data_dir, 1)
    _, together, together_loss = _one_step(tiny_data_dir, 2)
    assert sum(not torch.equal(start[k], v) for k, v in separate.items()) > 10  # the step moved the weights
    assert torch.allclose(separate_loss, together_loss, rtol=1e-6)
    for name, value in separate.items():  # the same update, to Newton-Schulz's bfloat16 rounding (~1%)
        update, other = value - start[name], together[name] - start[name]
        assert (update - other).norm() <= 0.03 * update.norm() + 1e-9, name


def test_micro_batches_per_pass_fit_the_gpu_memory_and_divide_the_step(monkeypatch):
    from types import SimpleNamespace

    from windowgpt_cli.errors import ConfigError
    from windowgpt_cli.train.trainer import TRAIN_MEMORY_FRACTION, micro_batches_per_pass_for, training_bytes_per_token

    cfg = RunConfig()  # the reference's model: 786,432 tokens in 8 micro-batches on one GPU
    cuda = torch.device("cuda")
    micro = training_bytes_per_token(cfg.model) * cfg.train.train_batch_tokens // 8
    for fitting, expected in ((0.5, 1), (1, 1), (3, 2), (7.9, 4), (8, 8), (100, 8)):
        memory = int(fitting * micro / TRAIN_MEMORY_FRACTION) + 1
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=memory))
        assert micro_batches_per_pass_for(cfg, 1, 8, cuda) == expected, fitting
    assert micro_batches_per_pass_for(cfg, 1, 8, torch.device("cpu")) == 1
    for gib, expected in ((139.8, 4), (79.2, 2), (39.4, 1)):  # an H200, an H100, a GPU of 40 GB
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: SimpleNamespace(total_memory=int(gib * 2 ** 30)))
        assert micro_batches_per_pass_for(cfg, 1, 8, cuda) == expected, gib
    # the fused loss keeps bf16 logits and their gradient only: more micro-batches fit
    big_vocab = RunConfig()
    big_vocab.model.vocab_size = 8192
    memory = int(3.5 * training_bytes_per_token(big_vocab.model) * cfg.train.train_batch_tokens // 8
                 / TRAIN_MEMORY_FRACTION)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=memory))
    monkeypatch.setattr("windowgpt_cli.train.trainer.triton_available", lambda device: True)
    assert micro_batches_per_pass_for(big_vocab, 1, 8, cuda) == 2
    big_vocab.train.fused_cross_entropy = True
    assert micro_batches_per_pass_for(big_vocab, 1, 8, cuda) == 4
    # over chunks of rows no logits are kept: all eight fit where the fused loss's four do
    memory = int(8 * training_bytes_per_token(big_vocab.model, True, True) * cfg.train.train_batch_tokens // 8
                 / TRAIN_MEMORY_FRACTION) + 1
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=memory))
    assert micro_batches_per_pass_for(big_vocab, 1, 8, cuda) == 4
    big_vocab.train.loss_chunk_rows = 4096
    assert micro_batches_per_pass_for(big_vocab, 1, 8, cuda) == 8
    cfg.train.micro_batches_per_pass = 3
    with pytest.raises(ConfigError, match="must divide grad_accum_steps=8"):
        micro_batches_per_pass_for(cfg, 1, 8, cuda)


def test_keep_checkpoints_keeps_the_last_k_and_force_removes_them(tiny_data_dir, tmp_path):
    args = ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(tmp_path / "run"),
            "--iterations", "6", "--warmup-steps", "0", "--train-batch-tokens", "2048", "--checkpoint-every", "2",
            "--keep-checkpoints", "2"]
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    kept = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*.pt"))
    assert kept == ["checkpoint-0000004.pt", "checkpoint-0000006.pt"]
    assert load_checkpoint(tmp_path / "run" / kept[0]).step == 4
    assert load_checkpoint(tmp_path / "run").step == 6
    again = runner.invoke(app, [*args[:-4], "--iterations", "1", "--force"], env=WIDE)
    assert again.exit_code == 0, again.output
    assert not list((tmp_path / "run").glob("checkpoint-*.pt"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_step_tuned_with_triton_products_trains_as_the_default_one(tiny_data_dir, tmp_path):
    """--compile-tuning gemm, --no-compile-mix-order and --compile-multi-kernel change which
    kernels run, not what a step computes: the same iterations end at the same loss to bf16's rounding."""
    losses = {}
    variants = {"default": [], "gemm": ["--compile-tuning", "gemm"], "no_mix_order": ["--no-compile-mix-order"],
                "multi_kernel": ["--compile-multi-kernel"]}
    for name, flags in variants.items():
        run = tmp_path / name
        result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(run),
                                          "--device", "cuda", "--compile", *flags, "--iterations", "10",
                                          "--warmdown-iters", "3"])
        assert result.exit_code == 0, result.output
        losses[name] = json.loads((run / "summary.json").read_text())["val_loss"]
    for name in ("gemm", "no_mix_order", "multi_kernel"):
        assert abs(losses[name] - losses["default"]) < 0.02 * losses["default"], losses
