"""Byte accounting: the tables, their .meta.npz file, its checks, and `windowgpt tokenizer-meta`."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from conftest import DATA_DEMO_CORPUS
from windowgpt_cli.cli.app import app
from windowgpt_cli.data.corpus import iter_documents
from windowgpt_cli.errors import DataError
from windowgpt_cli.data.tokenizer import (TRAINER_RECIPE, ByteLuts, build_byte_tables, count_text_bytes,
                                          default_meta_path, has_byte_fallback, load_byte_luts, load_sentencepiece,
                                          read_tokenizer_meta, resolve_tokenizer, tokenizer_vocab_size,
                                          write_tokenizer_meta)

WIDE = {"COLUMNS": "200"}


def run_cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env=WIDE)


def expected_tables_from_pieces(sp) -> dict[str, list]:
    """The tables read off the vocabulary piece by piece: a token stands for its piece with
    '▁' as a space; byte tokens for one byte; special tokens for nothing."""
    base, lead, boundary = [], [], []
    for token in range(sp.vocab_size()):
        special = sp.is_control(token) or sp.is_unknown(token) or sp.is_unused(token)
        piece = sp.id_to_piece(token)
        if special:
            size, space = 0, False
        elif sp.is_byte(token):
            assert piece.startswith("<0x") and piece.endswith(">")
            size, space = 1, False
        else:
            space = piece.startswith("▁")
            size = len(piece.replace("▁", " ").encode("utf-8")) - int(space)
        base.append(size)
        lead.append(space)
        boundary.append(special)
    return {"base_bytes": base, "has_leading_space": lead, "is_boundary_token": boundary}


def copy_tokenizer(src: Path, folder: Path, name: str = "tok.model") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(src, folder / name))


def tamper(meta_path: Path, out: Path, **changes) -> Path:
    """A copy of a .meta.npz with some entries replaced."""
    with np.load(meta_path, allow_pickle=False) as data:
        entries = {k: data[k] for k in data.files}
    entries.update(changes)
    buf = io.BytesIO()
    np.savez(buf, **entries)
    out.write_bytes(buf.getvalue())
    return out


# --- Tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["data_bytefallback_tokenizer", "data_fineweb_tokenizer", "data_multiword_tokenizer"])
def test_tables_equal_the_vocabulary_read_piece_by_piece(request, which):
    sp = load_sentencepiece(request.getfixturevalue(which))
    base, lead, boundary = build_byte_tables(sp, sp.vocab_size())
    assert (base.dtype, lead.dtype, boundary.dtype) == (np.int16, np.bool_, np.bool_)
    expected = expected_tables_from_pieces(sp)
    assert base.tolist() == expected["base_bytes"]
    assert lead.tolist() == expected["has_leading_space"]
    assert boundary.tolist() == expected["is_boundary_token"]


def test_tables_are_padded_with_zero_byte_boundaries(data_bytefallback_tokenizer):
    sp = load_sentencepiece(data_bytefallback_tokenizer)
    base, lead, boundary = build_byte_tables(sp, 600)
    assert len(base) == 600
    assert base[512:].tolist() == [0] * 88 and not lead[512:].any() and boundary[512:].all()
    assert len(build_byte_tables(sp, 100)[0]) == 512  # never shorter than the tokenizer


def test_byte_fallback_detection(data_bytefallback_tokenizer, data_fineweb_tokenizer):
    assert has_byte_fallback(load_sentencepiece(data_bytefallback_tokenizer))
    assert not has_byte_fallback(load_sentencepiece(data_fineweb_tokenizer))


def test_count_bytes_follows_the_reference_formula():
    # token 0: boundary; 1: "ab" with a space before it; 2: "c"
    luts = ByteLuts.from_numpy(np.array([0, 2, 1], dtype=np.int16), np.array([False, True, False]),
                               np.array([True, False, False]))
    prev = torch.tensor([[0, 2, 1], [1, 0, 2]])
    target = torch.tensor([[1, 1, 2], [2, 1, 1]])
    counted = luts.count_bytes(prev, target)
    assert counted.dtype == torch.float64 and counted.shape == prev.shape
    assert counted.tolist() == [[2.0, 3.0, 1.0], [1.0, 2.0, 3.0]]


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
@pytest.mark.slow
def test_with_byte_fallback_counted_bytes_equal_the_utf8_text(data_bytefallback_tokenizer, text):
    sp = load_sentencepiece(data_bytefallback_tokenizer)
    luts = load_byte_luts(data_bytefallback_tokenizer, None, sp.vocab_size())
    count = count_text_bytes(sp, luts, text)
    # What the tokenizer encodes: the normalized text with word markers as spaces, and no
    # space at the start of the document (its predecessor is BOS, never followed by one).
    encoded = sp.decode(sp.encode(text))
    assert count.unknown_tokens == 0
    assert count.counted_bytes == count.normalized_bytes == len(encoded.lstrip(" ").encode("utf-8"))


def test_pieces_that_span_words_count_each_inner_space_as_one_byte(data_multiword_tokenizer):
    sp = load_sentencepiece(data_multiword_tokenizer)
    luts = load_byte_luts(data_multiword_tokenizer, None, sp.vocab_size())
    text = "Most of the town walked in the rain and turned to the sea, then waited."
    spanning = [sp.id_to_piece(t) for t in sp.encode(text) if "\u2581" in sp.id_to_piece(t)[1:]]
    assert spanning  # the text is encoded with such pieces
    count = count_text_bytes(sp, luts, text)
    assert count.counted_bytes == count.normalized_bytes == len(text.encode("utf-8"))


@pytest.mark.parametrize("setting", [{"treat_whitespace_as_suffix": True},
                                     {"remove_extra_whitespaces": False, "allow_whitespace_only_pieces": True}])
def test_other_whitespace_recipes_count_the_text_they_encode(setting):
    """A user's own tokenizer may put '▁' at the end of its pieces or keep runs of spaces
    ('▁▁▁'): every '▁' a piece holds beyond the leading one is one byte of the text."""
    import sentencepiece as spm

    lines = [line for doc in iter_documents(DATA_DEMO_CORPUS) for line in doc.splitlines() if line.strip()]
    spaced = ["so  much   space  between    words"] * 50  # runs of spaces, kept by the second recipe
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines[:3000] + spaced), model_writer=model, vocab_size=512,
                                   max_sentence_length=1 << 16, num_threads=1, minloglevel=2,
                                   **{**TRAINER_RECIPE, **setting})
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert any("\u2581" in sp.id_to_piece(t)[1:] for t in range(sp.vocab_size()))  # such pieces exist
    luts = ByteLuts.from_numpy(*build_byte_tables(sp, sp.vocab_size()))
    for text in ["\n".join(lines[3000:3300]), spaced[0], "two  spaces,   three, and a tail  "]:
        count = count_text_bytes(sp, luts, text)
        assert count.counted_bytes == count.normalized_bytes, text[:40]


def test_without_byte_fallback_unknown_characters_count_nothing(data_fineweb_tokenizer):
    sp = load_sentencepiece(data_fineweb_tokenizer)
    luts = load_byte_luts(data_fineweb_tokenizer, None, 1024)
    assert count_text_bytes(sp, luts, "plain words here").discrepancy == 0
    count = count_text_bytes(sp, luts, "x = {a[1] # b@c}")
    assert count.unknown_tokens > 0 and count.counted_bytes < count.normalized_bytes


# --- The .meta.npz file ---------------------------------------------------------------------

def test_default_meta_path_follows_the_reference():
    assert default_meta_path(Path("d/sp.model")) == Path("d/sp.meta.npz")
    assert default_meta_path(Path("d/sp.bin")) == Path("d/sp.bin.meta.npz")


def test_written_meta_holds_the_reference_keys_and_tables(tmp_path, data_bytefallback_tokenizer):
    model = copy_tokenizer(data_bytefallback_tokenizer, tmp_path)
    path = write_tokenizer_meta(model)
    assert path == tmp_path / "tok.meta.npz"
    with np.load(path, allow_pickle=False) as data:
        assert set(data.files) == {"format_version", "tokenizer_kind", "source_model_name", "vocab_size",
                                   "base_bytes", "has_leading_space", "is_boundary_token"}
        assert data["base_bytes"].dtype == np.int16 and data["is_boundary_token"].dtype == np.bool_
    meta = read_tokenizer_meta(path)
    assert (meta["format_version"], meta["tokenizer_kind"], meta["vocab_size"]) == (1, "sentencepiece", 512)
    assert meta["source_model_name"] == "tok.model"
    tables = build_byte_tables(load_sentencepiece(model), 512)
    for key, table in zip(("base_bytes", "has_leading_space", "is_boundary_token"), tables):
        assert np.array_equal(meta[key], table)


def test_read_meta_refuses_other_versions_and_other_files(tmp_path, data_bytefallback_tokenizer):
    good = write_tokenizer_meta(data_bytefallback_tokenizer, tmp_path / "good.meta.npz")
    with pytest.raises(DataError, match="format_version 2 is not supported"):
        read_tokenizer_meta(tamper(good, tmp_path / "v2.meta.npz", format_version=np.int64(2)))
    (tmp_path / "junk.meta.npz").write_bytes(b"not a zip file")
    with pytest.raises(DataError, match=r"junk\.meta\.npz: not a readable tokenizer metadata file"):
        read_tokenizer_meta(tmp_path / "junk.meta.npz")
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(DataError, match="not tokenizer metadata"):
        read_tokenizer_meta(tmp_path / "other.npz")
    with pytest.raises(DataError, match="no such tokenizer metadata file"):
        read_tokenizer_meta(tmp_path / "absent.meta.npz")


def test_load_byte_luts_reads_the_meta_file_pads_and_refuses_tables_of_another_tokenizer(
        tmp_path, data_bytefallback_tokenizer):
    model = copy_tokenizer(data_bytefallback_tokenizer, tmp_path)
    computed = load_byte_luts(model, None, 512)  # no .meta.npz yet: computed from the model
    assert computed.table_size == 512
    meta = write_tokenizer_meta(model)
    from_file = load_byte_luts(model, None, 600)
    assert from_file.table_size == 600
    assert torch.equal(from_file.base_bytes[:512], computed.base_bytes)
    assert bool(from_file.is_boundary_token[599]) and int(from_file.base_bytes[599]) == 0
    base = read_tokenizer_meta(meta)["base_bytes"].copy()
    base[300] += 5
    tamper(meta, meta, base_bytes=base)  # now the file and the model disagree at token 300
    with pytest.raises(DataError, match="base_bytes differs at token id 300"):
        load_byte_luts(model, None, 512)
    only_meta = load_byte_luts(None, meta, 512)  # without the tokenizer there is nothing to compare with
    assert torch.equal(only_meta.base_bytes, torch.as_tensor(base))
    with pytest.raises(DataError, match="no tokenizer"):
        load_byte_luts(None, None, 512)
    with pytest.raises(DataError, match="no such tokenizer metadata file"):
        load_byte_luts(model, tmp_path / "elsewhere.meta.npz", 512)


def test_resolve_tokenizer_and_vocab_size(tmp_path, data_bytefallback_tokenizer):
    assert resolve_tokenizer(tmp_path, None) is None
    copy_tokenizer(data_bytefallback_tokenizer, tmp_path, "tokenizer.model")
    assert resolve_tokenizer(tmp_path, None) == tmp_path / "tokenizer.model"
    assert resolve_tokenizer(tmp_path, Path("other.model")) == Path("other.model")
    assert tokenizer_vocab_size(tmp_path / "tokenizer.model") == 512
    (tmp_path / "broken.model").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"broken\.model: not a readable SentencePiece model"):
        load_sentencepiece(tmp_path / "broken.model")


# --- windowgpt tokenizer-meta ---------------------------------------------------------------

def test_cli_writes_meta_beside_the_model(tmp_path, data_bytefallback_tokenizer):
    model = copy_tokenizer(data_bytefallback_tokenizer, tmp_path)
    result = run_cli("tokenizer-meta", model)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tok.meta.npz").is_file()
    assert "warning" not in result.stderr
    assert "byte accounting" in result.stdout and "Cyrillic" in result.stdout
    assert run_cli("tokenizer-meta", model, "--check", tmp_path / "tok.meta.npz").exit_code == 0


def test_cli_sample_counts_every_byte_with_byte_fallback(tmp_path, data_bytefallback_tokenizer):
    sample = tmp_path / "sample.txt"
    sample.write_text("Ünïcode — 漢字 and 🙂 plus [brackets] {braces} #@_=\n", encoding="utf-8")
    result = run_cli("tokenizer-meta", data_bytefallback_tokenizer, "--out", tmp_path / "m.meta.npz",
                     "--sample", sample, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["byte_fallback"] is True and report["action"] == "written"
    (row,) = report["samples"]
    assert row["label"] == "sample.txt" and row["discrepancy"] == 0 and row["counted_bytes"] > 0


def test_cli_warns_about_the_shared_tokenizer_without_byte_fallback(tmp_path, data_fineweb_tokenizer):
    result = run_cli("tokenizer-meta", data_fineweb_tokenizer, "--out", tmp_path / "x.meta.npz", "--json")
    assert result.exit_code == 0
    assert result.stderr.startswith("warning:") and "no byte fallback" in result.stderr
    report = json.loads(result.stdout)
    assert report["total"]["unknown_tokens"] > 0 and report["total"]["discrepancy"] < 0


@pytest.mark.parametrize("key, token_kind", [
    ("base_bytes", "byte"),  # byte-fallback tokens recorded as 3 bytes ("<0x..>" misread) instead of 1
    ("has_leading_space", "word"),
    ("is_boundary_token", "control"),
])
def test_cli_check_refuses_wrong_metadata(tmp_path, data_bytefallback_tokenizer, key, token_kind):
    sp = load_sentencepiece(data_bytefallback_tokenizer)
    pick = {"byte": sp.is_byte, "word": lambda t: sp.id_to_piece(t).startswith("▁"), "control": sp.is_control}
    token = next(t for t in range(sp.vocab_size()) if pick[token_kind](t))
    good = write_tokenizer_meta(data_bytefallback_tokenizer, tmp_path / "good.meta.npz")
    table = read_tokenizer_meta(good)[key].copy()
    table[token] = 3 if key == "base_bytes" else not table[token]
    bad = tamper(good, tmp_path / "bad.meta.npz", **{key: table})
    result = run_cli("tokenizer-meta", data_bytefallback_tokenizer, "--check", bad)
    assert result.exit_code == 1
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in result.output
    assert f"{key} differs at token id {token}" in message and "bad.meta.npz" in message


def test_cli_check_refuses_another_tokenizers_metadata(tmp_path, data_bytefallback_tokenizer,
                                                       data_fineweb_tokenizer):
    other = write_tokenizer_meta(data_fineweb_tokenizer, tmp_path / "fineweb.meta.npz")
    result = run_cli("tokenizer-meta", data_bytefallback_tokenizer, "--check", other)
    assert result.exit_code == 1 and "vocab_size is 1024, the tokenizer has 512" in result.stderr


def test_cli_bad_arguments_are_one_line_errors(tmp_path, data_bytefallback_tokenizer):
    for args in (("tokenizer-meta", tmp_path / "missing.model"),
                 ("tokenizer-meta", data_bytefallback_tokenizer, "--check", tmp_path / "x.npz",
                  "--out", tmp_path / "y"),
                 ("tokenizer-meta", data_bytefallback_tokenizer, "--check", tmp_path / "absent.meta.npz")):
        result = run_cli(*args)
        assert result.exit_code == 1
        assert result.stderr.startswith("error:") and result.stderr.strip().count("\n") == 0
