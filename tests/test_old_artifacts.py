"""Artifacts written by an earlier windowgpt (tests/fixtures/, see its README) still load,
score as they did, and feed the later stages."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from windowgpt_cli.artifacts.checkpoint import load_checkpoint
from windowgpt_cli.artifacts.export import EXPORT_WEIGHTS, export
from windowgpt_cli.data.prepare import prepare
from windowgpt_cli.eval.evaluate import evaluate_artifact, ttt_evaluate_artifact
from windowgpt_cli.quant.quantize import quantize
from windowgpt_cli.storage import tensorfile

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "v0.1.0-4052639"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
KINDS = {"run": "run", "export": "export", "model.ptz": "model.ptz"}


@pytest.fixture(scope="module")
def old(tmp_path_factory) -> Path:
    """A copy of the fixtures (scoring writes its results beside an artifact) and the data
    they were scored on, prepared again from the demo corpus with their tokenizer."""
    root = tmp_path_factory.mktemp("old")
    for name in ("run", "export", "model.ptz", "tokenizer.model"):
        source = FIXTURES / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, root / name)
    data = EXPECTED["data"]
    prepare([REPO / data["corpus"]], root / "data", tokenizer=root / "tokenizer.model",
            val_fraction=data["val_fraction"], workers=1)
    return root


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("stride", ["0", "16"])
def test_old_artifacts_score_as_they_did(old, kind, stride):
    record = evaluate_artifact(old / kind, old / "data", settings={"eval": {"eval_stride": int(stride)}},
                               device="cpu").record
    val_bpb, tokens, n_bytes = EXPECTED["scores"][kind][stride]
    assert (record["tokens"], record["bytes"]) == (tokens, n_bytes)
    assert record["val_bpb"] == pytest.approx(val_bpb, abs=1e-6)


@pytest.mark.slow
def test_an_old_ptz_scores_as_it_did_with_test_time_training(old):
    record = ttt_evaluate_artifact(old / "model.ptz", old / "data", device="cpu").record
    val_bpb, tokens = EXPECTED["scores"]["model.ptz ttt"]
    assert record["tokens"] == tokens
    assert record["val_bpb"] == pytest.approx(val_bpb, abs=1e-5)


@pytest.mark.slow
def test_an_old_run_exports_its_weights_byte_for_byte_and_quantizes(old, tmp_path):
    ckpt = load_checkpoint(old / "run")
    assert ckpt.step == 6
    export(old / "run", tmp_path / "export")
    new, new_meta = tensorfile.load(tmp_path / "export" / EXPORT_WEIGHTS)
    before, before_meta = tensorfile.load(old / "export" / EXPORT_WEIGHTS)
    assert list(new) == list(before)
    assert all(tensorfile.tensor_bytes(new[k]) == tensorfile.tensor_bytes(before[k]) for k in new)
    assert (before_meta["format"], new_meta["format"]) == ("windowgpt.export", "pt")  # now standard metadata
    report = quantize(old / "export", tmp_path / "model.ptz", device="cpu")
    assert report["within_budget"]
    record = evaluate_artifact(tmp_path / "model.ptz", old / "data", settings={"eval": {"eval_stride": 16}},
                               device="cpu").record
    assert record["val_bpb"] == pytest.approx(EXPECTED["scores"]["model.ptz"]["16"][0], abs=1e-6)
