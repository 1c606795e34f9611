"""`windowgpt prepare`: documents to shards and back, the manifest, the split, and bad input."""
from __future__ import annotations

import json
import lzma
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from windowgpt_cli.storage.files import sha256_file
from windowgpt_cli.cli.app import app
from windowgpt_cli.errors import ConfigError, DataError
from windowgpt_cli.data.shards import list_shards, load_tokens, read_token_count
from windowgpt_cli.data.prepare import prepare
from windowgpt_cli.data.encoding import validation_score
from windowgpt_cli.data.tokenizer import check_tokenizer_meta, load_sentencepiece

WIDE = {"COLUMNS": "200"}
WORDS = ("river stone light garden window quiet number seven café naïve Zürich 東京 дом λόγος "
         "rocket 🚀 price 42 and 3.14 then").split()


def run_cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env=WIDE)


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Single-spaced lines without edges: text that nmt_nfkc leaves exactly as it is."""
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for i in range(count)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    data = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")
    path.write_bytes(lzma.compress(data) if path.name.endswith(".xz") else data)
    return path


def split_documents(tokens: np.ndarray) -> list[list[int]]:
    """The documents of a token stream: each starts at a BOS (id 1)."""
    starts = np.flatnonzero(tokens == 1)
    assert starts.size and starts[0] == 0, "a stream must start with BOS"
    return [tokens[a + 1:b].tolist() for a, b in zip(starts, [*starts[1:], tokens.size])]


def decoded_split(data_dir: Path, split: str) -> list[str]:
    sp = load_sentencepiece(data_dir / "tokenizer.model")
    return [sp.decode(doc) for doc in split_documents(load_tokens(list_shards(data_dir, split)).numpy())]


@pytest.fixture()
def corpus(tmp_path) -> tuple[list[str], list[Path]]:
    docs = make_documents(240)
    files = [write_jsonl(tmp_path / "part_a.jsonl.xz", docs[:150]), write_jsonl(tmp_path / "part_b.jsonl", docs[150:])]
    return docs, files


def test_shards_decode_back_to_the_documents(tmp_path, corpus, data_bytefallback_tokenizer):
    docs, files = corpus
    result = prepare(files, tmp_path / "data", tokenizer=data_bytefallback_tokenizer, val_fraction=0.2,
                     shard_tokens=700, workers=1)
    in_val = [validation_score(d) < 0.2 for d in docs]
    assert 0 < sum(in_val) < len(docs)
    assert decoded_split(result.data_dir, "train") == [d for d, v in zip(docs, in_val) if not v]
    assert decoded_split(result.data_dir, "val") == [d for d, v in zip(docs, in_val) if v]


def test_token_streams_are_the_reference_encoding(tmp_path, corpus, data_bytefallback_tokenizer):
    docs, files = corpus
    result = prepare(files, tmp_path / "data", tokenizer=data_bytefallback_tokenizer, val_fraction=0.2,
                     shard_tokens=500, workers=2)
    sp = load_sentencepiece(data_bytefallback_tokenizer)
    for split, wanted in (("train", False), ("val", True)):
        chosen = [d for d in docs if (validation_score(d) < 0.2) == wanted]
        reference = np.concatenate([np.array([1, *sp.encode(d)], dtype=np.uint16) for d in chosen])
        ours = load_tokens(list_shards(result.data_dir, split)).numpy()
        assert np.array_equal(ours, reference)


def test_manifest_agrees_with_shard_headers(tmp_path, corpus, data_bytefallback_tokenizer):
    docs, files = corpus
    data_dir = tmp_path / "data"
    manifest = prepare(files, data_dir, tokenizer=data_bytefallback_tokenizer, val_fraction=0.2,
                       shard_tokens=600, workers=1).manifest
    assert json.loads((data_dir / "manifest.json").read_text()) == manifest
    for split in ("train", "val"):
        info = manifest["splits"][split]
        shards = list_shards(data_dir, split)
        assert [p.name for p in shards] == [s["file"] for s in info["shards"]]
        counts = [read_token_count(p) for p in shards]
        assert counts == [s["tokens"] for s in info["shards"]]
        assert all(c == 600 for c in counts[:-1]) and 0 < counts[-1] <= 600
        tokens = load_tokens(shards).numpy()
        assert sum(counts) == info["tokens"] == tokens.size
        assert info["documents"] == int(np.count_nonzero(tokens == 1))
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == len(docs)
    assert sum(s["text_bytes"] for s in manifest["splits"].values()) == sum(len(d.encode()) for d in docs)
    assert manifest["tokenizer"]["sha256"] == sha256_file(data_dir / "tokenizer.model") \
        == sha256_file(data_bytefallback_tokenizer)
    assert manifest["tokenizer"]["vocab_size"] == 512 and manifest["settings"]["val_fraction"] == 0.2
    assert [i["sha256"] for i in manifest["inputs"]] == [sha256_file(f) for f in files]
    assert [i["bytes"] for i in manifest["inputs"]] == [f.stat().st_size for f in files]
    check_tokenizer_meta(data_dir / "tokenizer.meta.npz", data_dir / "tokenizer.model")


def test_validation_split_does_not_depend_on_input_order(tmp_path, corpus, data_bytefallback_tokenizer):
    docs, files = corpus
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    reordered = [write_jsonl(tmp_path / "one.jsonl", shuffled[:100]),
                 write_jsonl(tmp_path / "two.jsonl", shuffled[100:])]
    first = prepare(files, tmp_path / "first", tokenizer=data_bytefallback_tokenizer, val_fraction=0.2, workers=1)
    second = prepare(reordered[::-1], tmp_path / "second", tokenizer=data_bytefallback_tokenizer,
                     val_fraction=0.2, workers=1)
    val_first, val_second = decoded_split(first.data_dir, "val"), decoded_split(second.data_dir, "val")
    assert sorted(val_first) == sorted(val_second) and val_first
    assert first.manifest["splits"]["val"]["tokens"] == second.manifest["splits"]["val"]["tokens"]


def test_val_files_form_the_validation_split(tmp_path, corpus, data_bytefallback_tokenizer):
    docs, files = corpus
    held_out = write_jsonl(tmp_path / "held_out.jsonl", make_documents(5, seed=9))
    result = prepare(files, tmp_path / "data", tokenizer=data_bytefallback_tokenizer, val_inputs=[held_out],
                     workers=2)
    assert decoded_split(result.data_dir, "train") == docs
    assert decoded_split(result.data_dir, "val") == make_documents(5, seed=9)
    assert [i["split"] for i in result.manifest["inputs"]] == ["train", "train", "val"]


def test_rerun_replaces_earlier_shards(tmp_path, corpus, data_bytefallback_tokenizer):
    _, files = corpus
    data_dir = tmp_path / "data"
    prepare(files, data_dir, tokenizer=data_bytefallback_tokenizer, val_fraction=0.2, shard_tokens=300, workers=1)
    assert len(list_shards(data_dir, "train")) > 2
    prepare(files, data_dir, tokenizer=data_bytefallback_tokenizer, val_fraction=0.2, workers=1)
    assert [p.name for p in list_shards(data_dir, "train")] == ["fineweb_train_000000.bin"]


def test_demo_corpus_trains_a_tokenizer_and_prepares(tmp_path, data_demo_corpus):
    """What `make demo` runs: the recipe tokenizer is trained, and validation is large enough."""
    data_dir = tmp_path / "demo"
    result = run_cli("prepare", data_demo_corpus, "--out", data_dir, "--vocab-size", "1024",
                     "--val-fraction", "0.05", "--workers", "2")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["tokenizer"]["trained"] and manifest["tokenizer"]["byte_fallback"]
    assert manifest["splits"]["val"]["tokens"] >= 20_000
    sp = load_sentencepiece(data_dir / "tokenizer.model")
    assert sp.vocab_size() == 1024
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert sp.encode("2024") == [sp.piece_to_id(c) for c in "2024"]  # digits are split
    assert not sp.id_to_piece(sp.encode("hello")[0]).startswith("▁")  # no dummy prefix
    assert sp.normalize("ｆｕｌｌ ﬁt") == "full▁fit"  # nmt_nfkc
    check_tokenizer_meta(data_dir / "tokenizer.meta.npz", data_dir / "tokenizer.model")


def test_a_trained_tokenizer_does_not_depend_on_the_machine(tmp_path, data_demo_corpus, monkeypatch):
    """The same prepare on machines of 1 and 8 cores (all of them encoding) writes the same
    tokenizer file, so data prepared elsewhere scores a model trained on this machine's."""
    shas = []
    for cores in (1, 8):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        data_dir = tmp_path / f"cores{cores}"
        prepare([data_demo_corpus], data_dir, vocab_size=1024, val_fraction=0.05)
        shas.append(json.loads((data_dir / "manifest.json").read_text())["tokenizer"]["sha256"])
    assert shas[0] == shas[1]


def test_matches_make_shards_script(tmp_path, shared_dir, data_fineweb_tokenizer):
    """The reference's own shard script gives the same token streams on the same files."""
    script = shared_dir / "seed" / "make_shards.py"
    if not script.is_file():
        pytest.skip(f"{script} is missing")
    src = tmp_path / "src"
    src.mkdir()
    docs = make_documents(300, seed=3) + ["Brackets [x] {y} #tag @user snake_case = 1\n\nnew paragraph"]
    write_jsonl(src / "train_00.jsonl.xz", docs[:200])
    write_jsonl(src / "train_01.jsonl.xz", docs[200:])
    write_jsonl(src / "val.jsonl.xz", make_documents(40, seed=4))
    subprocess.run([sys.executable, str(script), str(src), str(tmp_path / "ref"), str(data_fineweb_tokenizer)],
                   check=True, capture_output=True)
    result = run_cli("prepare", src / "train_00.jsonl.xz", src / "train_01.jsonl.xz", "--val", src / "val.jsonl.xz",
                     "--tokenizer", data_fineweb_tokenizer, "--out", tmp_path / "ours", "--workers", "2")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("warning:") and "no byte fallback" in result.stderr
    for split in ("train", "val"):
        ours = load_tokens(list_shards(tmp_path / "ours", split)).numpy()
        reference = load_tokens(list_shards(tmp_path / "ref", split)).numpy()
        assert ours.size == reference.size and np.array_equal(ours, reference)


# --- Bad input ------------------------------------------------------------------------------

def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    message = result.stderr.strip()
    assert message.startswith("error:") and "\n" not in message
    return message


def test_bad_inputs_are_one_line_errors(tmp_path, data_bytefallback_tokenizer):
    good = write_jsonl(tmp_path / "good.jsonl", make_documents(30))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"text": "fine"}\n{"text": "fine"}\n{"body": "elsewhere"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    (tmp_path / "table.csv").write_text("text\nx\n")
    tok = ["--tokenizer", data_bytefallback_tokenizer]
    cases = [
        ((tmp_path / "missing.jsonl", *tok), "missing.jsonl: no such file"),
        ((bad_json, *tok), "bad.jsonl: line 2: invalid JSON"),
        ((no_text, *tok), 'no_text.jsonl: line 3: field "text" must be a string'),
        ((empty, *tok), "empty.jsonl: no training documents"),
        ((empty,), "empty.jsonl: no text to train a tokenizer on"),
        ((tmp_path / "table.csv", *tok), "table.csv: unsupported input type"),
        ((good, "--vocab-size", "70000"), "--vocab-size 70000 must be in 2..65536"),
            ((good, "--vocab-size", "0"), "--vocab-size 0 must be in 2..65536"),
        ((good, *tok, "--val-fraction", "0.5", "--val", good), "either --val files or --val-fraction"),
        ((good, *tok, "--val", good), "given both as an input and as --val"),
        ((good, *tok, "--val-fraction", "1.5"), "--val-fraction 1.5 must be between 0 and 1"),
        ((good, *tok, "--vocab-size", "1024"), "--vocab-size 1024 does not match"),
        ((good, "--tokenizer", tmp_path / "none.model"), "none.model: no such tokenizer file"),
    ]
    for args, expected in cases:
        message = one_line_error(run_cli("prepare", *args, "--out", tmp_path / "out", "--workers", "1"))
        assert expected in message, (args, message)


def test_an_empty_validation_split_is_refused(tmp_path, data_bytefallback_tokenizer):
    docs = [d for d in make_documents(40) if validation_score(d) >= 0.01]
    small = write_jsonl(tmp_path / "small.jsonl", docs)
    with pytest.raises(DataError, match="no validation documents fall under --val-fraction 0.01"):
        prepare([small], tmp_path / "out", tokenizer=data_bytefallback_tokenizer, workers=1)
    with pytest.raises(ConfigError, match="shard_tokens=0"):
        prepare([small], tmp_path / "out", tokenizer=data_bytefallback_tokenizer, shard_tokens=0)


@pytest.mark.parametrize("vocab", [4096, 8192])
@pytest.mark.slow
def test_the_larger_vocabularies_train_with_byte_fallback_and_a_model_takes_them(data_demo_corpus, tmp_path, vocab):
    """The final records' tokenizer sizes, trained by prepare on the user's corpus: byte
    fallback on, byte tables of that size, and a model that trains and scores on them
    (train takes vocab_size from the data's tokenizer)."""
    from windowgpt_cli.data.tokenizer import has_byte_fallback, load_byte_luts

    data = tmp_path / f"sp{vocab}"
    prepare([data_demo_corpus], data, vocab_size=vocab, val_fraction=0.05)
    sp = load_sentencepiece(data / "tokenizer.model")
    assert sp.vocab_size() == vocab and has_byte_fallback(sp)
    assert load_byte_luts(data / "tokenizer.model", None, vocab).table_size == vocab
    if vocab != 8192:  # the frontier preset's size trains below; one is enough
        return
    run = tmp_path / "run"
    trained = run_cli("train", "--preset", "tiny", "--data", str(data), "--out", str(run), "--iterations", "2",
                      "--warmdown-iters", "1")
    assert trained.exit_code == 0, trained.output
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == vocab
    scored = run_cli("eval", str(run), "--data", str(data), "--json")
    assert scored.exit_code == 0 and json.loads(scored.stdout)["val_bpb"] > 0
