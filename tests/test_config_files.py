"""Configuration files: the shipped examples, YAML, and errors that say what was meant."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from windowgpt_cli.cli.app import app
from windowgpt_cli.config import load_config_file, preset
from windowgpt_cli.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def printed_config(*args: str) -> dict:
    result = runner.invoke(app, ["train", "--print-config", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def makefile_flags(name: str) -> list[str]:
    """A Makefile variable's flags, its continuation lines joined and $(VARS) expanded."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    values = dict(re.findall(r"^(\w+) \?= (.*)$", text, re.M))
    value = values[name]
    while "$(" in value:
        value = re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], value)
    return shlex.split(value)


@pytest.mark.parametrize("name, same_as", [
    ("tiny", ["--preset", "tiny"]),
    ("frontier", ["--preset", "frontier"]),
    ("record", makefile_flags("RECORD_FLAGS")),
    ("smoke", makefile_flags("RECORD_FLAGS") + makefile_flags("SMOKE_FLAGS")),
])
def test_each_shipped_configuration_is_what_it_says(name: str, same_as: list[str]):
    assert printed_config("--config", str(REPO / "configs" / f"{name}.json")) == printed_config(*same_as)


def test_a_misspelled_or_misplaced_setting_says_what_was_meant(tmp_path: Path):
    cases = {
        '{"optim": {"matrix_lrr": 0.1}}': "unknown setting(s) matrix_lrr; did you mean matrix_lr?",
        '{"train": {"matrix_lr": 0.1}}': "unknown setting(s) matrix_lr; it belongs in [optim]",
        '{"optimizer": {"matrix_lr": 0.1}}': "unknown section(s) optimizer; did you mean optim?",
        '{"matrix_lr": 0.1}': "unknown section(s) matrix_lr; it belongs in [optim]",
        '{"train": {"zzz": 1}}': "unknown setting(s) zzz",
    }
    for text, message in cases.items():
        path = tmp_path / "c.json"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config_file(path)
        assert str(info.value).endswith(message), str(info.value)


def test_a_retired_setting_in_a_stored_configuration_is_read_and_dropped(tmp_path: Path):
    """Configurations written by a windowgpt that had the window backward's atomic dQ still load."""
    path = tmp_path / "c.json"
    path.write_text('{"train": {"window_atomic_dq": true, "iterations": 7}}')
    cfg = load_config_file(path, preset("tiny"))
    assert cfg.train.iterations == 7 and not hasattr(cfg.train, "window_atomic_dq")


@pytest.mark.parametrize("stored, fused_mlp, fold", [
    ('"fused_mlp": false, "fused_mlp_products": "quack", "fold_output_scales": false', "off", "off"),
    ('"fused_mlp": true, "fused_mlp_products": "quack", "fold_output_scales": true', "quack", "on"),
    ('"fused_mlp": true', "triton", "auto"),
    ('"fused_mlp": "auto", "fold_output_scales": "off"', "auto", "off"),
])
def test_the_older_switches_of_the_training_kernels_load_as_the_choices_they_made(tmp_path: Path, stored, fused_mlp,
                                                                                fold):
    """Configurations from before fused_mlp and fold_output_scales could be auto keep their run's choice."""
    path = tmp_path / "c.json"
    path.write_text('{"train": {%s}}' % stored)
    cfg = load_config_file(path, preset("tiny"))
    assert (cfg.train.fused_mlp, cfg.train.fold_output_scales) == (fused_mlp, fold)


def test_yaml_is_read_as_json_is(tmp_path: Path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text("# a comment\noptim:\n  matrix_lr: 0.01\nmodel:\n  window_attn_layers: [1, 3]\n")
    cfg = load_config_file(path, preset("tiny"))
    assert cfg.optim.matrix_lr == 0.01 and cfg.model.window_attn_layers == (1, 3)
    assert cfg.model.model_dim == preset("tiny").model.model_dim  # the rest from the base


@pytest.mark.parametrize("text, message", [
    ("optim:\n  matrix_lr: 0.1\n  matrix_lr: 0.2\n", "the key 'matrix_lr' appears twice"),
    ("optim: [\n", "not a valid YAML configuration"),
    ("!!python/object/apply:os.system ['true']\n", "not a valid YAML configuration"),  # plain data only
    ("- 1\n- 2\n", "expected an object of sections"),
])
def test_bad_yaml_is_one_clear_error(tmp_path: Path, text: str, message: str):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yml"
    path.write_text(text)
    result = runner.invoke(app, ["train", "--config", str(path), "--print-config"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


def test_yaml_without_pyyaml_is_refused_in_one_line(tmp_path: Path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_yaml(name, *args, **kwargs):
        if name == "yaml":
            raise ModuleNotFoundError("No module named 'yaml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    path = tmp_path / "c.yaml"
    path.write_text("optim: {}\n")
    with pytest.raises(ConfigError, match=r"reading YAML needs PyYAML \(pip install 'windowgpt\[yaml\]'\)"):
        load_config_file(path)
