"""The command line explains itself: help for every option from the configuration's
documentation, -h, the resolved configuration, and configuration files over presets."""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from windowgpt_cli.cli.app import app
from windowgpt_cli.config import GROUP_TYPES, RunConfig, group_fields, tiny_preset

REPO = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "200"}
COMMANDS = sorted(typer.main.get_command(app).commands)


def run_cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=WIDE)


def flags(command: str) -> dict[str, object]:
    """Every option of a command by each of its names."""
    click_command = typer.main.get_command(app).commands[command]
    return {name: p for p in click_command.params for name in (*p.opts, *p.secondary_opts)}


def test_every_configuration_field_is_documented():
    missing = [f"{group}.{f.name}" for group in GROUP_TYPES for f in group_fields(group)
               if not f.metadata.get("help", "").strip()]
    assert not missing, f"fields without a help sentence (use config.setting(default, help)): {missing}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_h_equals_help(command):
    params = typer.main.get_command(app).commands[command].params
    undocumented = [p.name for p in params if not (getattr(p, "help", None) or "").strip()]
    assert not undocumented, undocumented
    long, short = run_cli(command, "--help"), run_cli(command, "-h")
    assert long.exit_code == 0 and long.output == short.output
    assert "Usage:" in long.output


def test_root_help_takes_h_and_offers_completion():
    result = run_cli("-h")
    assert result.exit_code == 0 and result.output == run_cli("--help").output
    assert "--install-completion" in result.output
    assert all(command in result.output for command in COMMANDS)


def test_train_help_shows_the_documentation_and_both_presets_defaults():
    out = " ".join(run_cli("train", "--help").output.replace("│", " ").split())
    assert "Seed of the batch sampler; -1 = seed. [default: -1; in -1..18446744073709551615]" in out
    assert "Optimizer steps the schedule is planned for. [default: 20000; tiny preset: 60; in 0..2147483647]" in out
    assert "0 = full causal attention everywhere. [default: 0; tiny preset: 32; in 0..4194304]" in out


def test_stages_that_start_from_an_artifact_say_so():
    ttt = " ".join(run_cli("eval-ttt", "--help").output.replace("│", " ").split())
    assert "Passes over each scored chunk; 0 = score only, no training. [default: from the artifact; in 0..1000]" in ttt
    assert "[default: 3" not in ttt
    quant = flags("quantize")
    names = {p.name for p in quant.values()}
    assert {f.name for f in group_fields("quant")} <= names
    for old, new in (("--clip-range", "--quant-clip-range"), ("--calib-batches", "--gptq-calib-samples"),
                     ("--gptq", "--use-gptq"), ("--no-gptq", "--no-use-gptq")):
        assert quant[old] is quant[new]


def printed_config(*args) -> dict:
    result = run_cli("train", *args, "--print-config")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_print_config_is_the_resolved_configuration_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed = printed_config("--preset", "tiny", "--data", "shards", "--train-seq-len-long", "256",
                             "--num-gpus-long", "1")
    expected = dataclasses.replace(tiny_preset(), train=dataclasses.replace(
        tiny_preset().train, train_seq_len_long=256, num_gpus_long=1))
    assert printed["model"]["rope_train_seq_len"] == 256  # derived from the longest sequence length
    assert printed["data"]["data_path"] == str(tmp_path / "shards")
    printed["model"]["rope_train_seq_len"] = expected.model.rope_train_seq_len
    printed["data"]["data_path"] = ""
    assert RunConfig.from_dict(printed) == expected


def test_preset_then_file_then_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\niterations = 7\nwarmdown_iters = 3\n[model]\nnum_layers = 5\n'
                    'window_attn_layers = [1, 4]\n')
    cfg = printed_config("--preset", "tiny", "--config", toml, "--warmdown-iters", "2")
    assert (cfg["train"]["iterations"], cfg["train"]["warmdown_iters"]) == (7, 2)  # file, then the flag
    assert (cfg["model"]["num_layers"], cfg["model"]["window_attn_layers"]) == (5, [1, 4])
    assert cfg["model"]["model_dim"] == tiny_preset().model.model_dim  # the rest: the preset

    js = tmp_path / "run.json"
    js.write_text(json.dumps({"optim": {"matrix_lr": 0.05}}))
    cfg = printed_config("--config", js)
    assert cfg["optim"]["matrix_lr"] == 0.05
    assert cfg["model"]["num_layers"] == RunConfig().model.num_layers  # no preset: the reference's


def test_a_saved_configuration_round_trips(tmp_path):
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(printed_config("--preset", "tiny", "--iterations", "11")))
    assert printed_config("--config", saved) == printed_config("--preset", "tiny", "--iterations", "11")


@pytest.mark.parametrize("text,suffix,message", [
    ("[train]\niterations = 'many'\n", ".toml", "iterations: 'many' is not a valid int"),
    ("[train\n", ".toml", "not a valid TOML configuration"),
    ('{"train": {"iterationz": 3}}', ".json", "unknown setting(s) iterationz"),
    ('{"trian": {}}', ".json", "unknown section(s) trian"),
])
def test_a_bad_configuration_file_is_a_one_line_error(tmp_path, text, suffix, message):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    result = run_cli("train", "--config", path, "--print-config")
    assert result.exit_code == 1 and message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_dry_run_checks_the_data_without_training(tiny_data_dir, tmp_path):
    result = run_cli("train", "--preset", "tiny", "--data", tiny_data_dir, "--out", tmp_path / "run", "--dry-run")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["data_path"] == str(tiny_data_dir)
    assert "1 train and 1 val shard(s)" in result.output and not (tmp_path / "run").exists()
    bad = run_cli("train", "--preset", "tiny", "--data", tiny_data_dir, "--vocab-size", "512", "--dry-run")
    assert bad.exit_code == 1 and "has 1024 tokens but vocab_size=512" in bad.output


def test_dry_run_checks_what_the_settings_need(tiny_data_dir, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a))
    result = run_cli("train", "--preset", "tiny", "--data", tiny_data_dir, "--logger", "tensorboard", "--dry-run")
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == ("error: --logger tensorboard needs the optional extra: pip "
                                                      "install 'windowgpt[tensorboard]'")


def test_training_out_of_memory_is_one_line_with_what_to_lower(tiny_data_dir, tmp_path, monkeypatch):
    from windowgpt_cli.train import run

    def runs_out(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(run, "_train_locked", runs_out)
    result = run_cli("train", "--preset", "tiny", "--data", tiny_data_dir, "--out", tmp_path / "run")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        "error: cpu ran out of memory while training (MemoryError); lower --train-batch-tokens, raise "
        "--grad-accum-steps, or train a smaller model; the last checkpoint, if any, is unchanged"), result.stderr


def test_the_default_preset_on_a_cpu_says_how_slow_and_what_instead(tiny_data_dir):
    from windowgpt_cli.config import apply_overrides
    from windowgpt_cli.train.run import cpu_slowness

    default = apply_overrides(RunConfig(), {"train": {"device": "cpu", "cpu_threads": 2}})
    line = cpu_slowness(default)
    assert line is not None and "roughly" in line and line.endswith("--preset tiny")
    assert "26.9M parameters" in line and "(2 threads)" in line
    assert cpu_slowness(apply_overrides(tiny_preset(), {"train": {"device": "cpu"}})) is None
    result = run_cli("train", "--data", tiny_data_dir, "--device", "cpu", "--dry-run")
    assert result.exit_code == 0 and "warning: training 26.9M parameters" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_flags_bare_and_one_example_that_parses(command):
    text = run_cli(command, "--help").output
    assert "<bool>" not in text and "list[" not in text
    examples = [line.strip() for line in text.splitlines() if line.strip().startswith("Example:")]
    assert len(examples) == 1, text
    words = shlex.split(examples[0].removeprefix("Example:").split("  (")[0])
    assert words[:2] == ["windowgpt", command]
    known = flags(command)
    assert all(w in known for w in words if w.startswith("--")), (words, sorted(known))


def test_make_help_lists_every_target():
    makefile = (REPO / "Makefile").read_text()
    targets = {t for line in makefile.splitlines() if line.startswith(".PHONY:") for t in line.split()[1:]}
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = set(re.findall(r"^make ([\w-]+)", shown, re.M))
    assert targets - {"help"} <= listed, targets - listed


HEAVY_MODULES = ("torch", "numpy", "sentencepiece")

# Runs `python -m windowgpt_cli --help`, then every command's --help and -h, and --help of the
# packed record's command line, and prints the heavy modules imported by then.
HELP_PROBE = """
import sys
from typer.testing import CliRunner
heavy = set(sys.argv[1:])
sys.argv = ["windowgpt", "--help"]
from windowgpt_cli.cli.app import main
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
import typer
from windowgpt_cli.cli.app import app
from windowgpt_cli.cli.record_app import app as record_app
for each, help_flags in ((app, ("--help", "-h")), (record_app, ("--help",))):
    for command in ([], *([c] for c in sorted(typer.main.get_command(each).commands))):
        for flag in help_flags:
            result = CliRunner().invoke(each, [*command, flag])
            assert result.exit_code == 0 and "Usage:" in result.output, (command, flag, result.output)
print(sorted(heavy & set(sys.modules)))
"""


@pytest.mark.slow
def test_help_imports_neither_torch_nor_numpy():
    """--help answers at once: the heavy modules are imported only when a command runs."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", HELP_PROBE, *HEAVY_MODULES], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().splitlines()[-1] == "[]", probe.stdout[-2000:]


def test_quantize_help_names_every_compressor():
    from windowgpt_cli.artifacts import compressors

    text = " ".join(run_cli("quantize", "--help").output.replace("│", " ").split())
    assert all(name in text for name in compressors.COMPRESSOR_CHOICES)
    assert f"[default: {compressors.DEFAULT_COMPRESSOR}]" in text


EXIT_PROBE = """
import sys
from windowgpt_cli.entry import exit_process

def main():
    case = sys.argv[1]
    sys.stdout.write("written, no newline")  # buffered: stdout is a pipe here
    sys.stderr.write("note")
    if case == "code":
        sys.exit(3)
    if case == "message":
        sys.exit("a message")
    if case == "error":
        raise ValueError("a bug")

exit_process(main)
print("never reached")
"""


@pytest.mark.parametrize("case,code", [("done", 0), ("code", 3), ("message", 1), ("error", 1)])
def test_the_process_ends_with_the_command_status_and_its_output_written(case, code):
    """The entry point ends the process without the interpreter's teardown: nothing after
    it runs, and what the command printed is all there."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EXIT_PROBE, case], capture_output=True, text=True, timeout=120)
    assert done.returncode == code
    assert done.stdout == "written, no newline"
    assert done.stderr.startswith("note")
    if case == "message":
        assert done.stderr == "notea message\n"
    if case == "error":
        assert "ValueError: a bug" in done.stderr


ENTRY_PROBE = """
import atexit, runpy, sys
atexit.register(lambda: print("teardown ran"))
sys.argv = ["windowgpt", *sys.argv[1:]]
runpy.run_module("windowgpt_cli", run_name="__main__")
"""


@pytest.mark.parametrize("args,code,stream", [(["--version"], 0, "stdout"), (["no-such-command"], 2, "stderr")])
def test_python_m_windowgpt_cli_ends_without_the_interpreters_teardown(args, code, stream):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ENTRY_PROBE, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == code
    assert ("windowgpt " if code == 0 else "no-such-command") in getattr(done, stream)
    assert "teardown ran" not in done.stdout


# Runs the commands that only read (inspect, compare, report) on a run, an export and a .ptz,
# then prints whether torch was imported.
READ_ONLY_PROBE = """
import sys
from typer.testing import CliRunner
from windowgpt_cli.cli.app import app
run, export, ptz = sys.argv[1:4]
for args in (["inspect", run], ["inspect", export], ["inspect", ptz], ["compare", run, export, ptz],
             ["report", run], ["report", ptz], ["inspect", "--json", ptz]):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (args, result.output)
print("torch" in sys.modules)
"""


@pytest.mark.slow
def test_the_commands_that_only_read_import_no_torch(tmp_path):
    import shutil
    import sys

    old = tmp_path / "old"
    shutil.copytree(REPO / "tests" / "fixtures" / "v0.1.0-4052639", old)
    probe = subprocess.run([sys.executable, "-c", READ_ONLY_PROBE, str(old / "run"), str(old / "export"),
                            str(old / "model.ptz")], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip().splitlines()[-1] == "False"
    assert (old / "run" / "report.md").is_file() and (old / "model.ptz.report.json").is_file()
