"""The tokenizer options of `prepare`: case markers (`--case-markers`: the text transform, the
tokenizer it trains, its byte accounting, the shards and the generated text), the script
split and the sample a tokenizer learns from."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from windowgpt_cli.data.case_ops import (
    ALLCAPS,
    CAPNEXT,
    MARKERS,
    STAND_IN,
    TITLE,
    decode_case,
    encode_case,
    has_case_markers,
    marker_bytes,
)
from windowgpt_cli.data.corpus import iter_documents
from windowgpt_cli.data.prepare import prepare
from windowgpt_cli.data.shards import list_shards, load_tokens
from windowgpt_cli.data.tokenizer import (
    ByteLuts,
    TextCodec,
    build_byte_tables,
    count_text_bytes,
    load_sentencepiece,
    train_sentencepiece,
)
from windowgpt_cli.data.tokenizer_options import DEFAULT_TRAIN_SAMPLE_BYTES, TokenizerOptions
from windowgpt_cli.generate.decoding import continuation

from conftest import DATA_DEMO_CORPUS, DATA_MULTILINGUAL
from test_prepare import make_documents, one_line_error, run_cli, split_documents, write_jsonl

TRICKY = [
    "Hello World", "  Hello", "NASA said iPhone McDonald's is OK. I am.", "a  Hello\n\nTHE END",
    "İstanbul ǅ Kelvin \u212a x", "literal \ue001 and \ue000x", "COVID19 x", "Straße GROSS ÀB ΑΘΗΝΑ Αθήνα",
    "", " ", "A", "ends with I", "x\ue003", DATA_MULTILINGUAL.upper(), DATA_MULTILINGUAL.title(),
]
ALPHABET = "aZ ÀéßİıǅK\u212aΣσς\n\t0_.'-\ue000\ue001\ue002\ue003😀Ⅻⅻ"


def without_markers(text: str) -> str:
    return "".join(STAND_IN if c in MARKERS else c for c in text)


@pytest.mark.parametrize("text", TRICKY)
def test_decoding_gives_back_the_text(text):
    assert decode_case(encode_case(text)) == without_markers(text)


def test_random_texts_come_back_and_keep_their_bytes():
    """Any text comes back (the markers' own characters as STAND_IN, of their three bytes);
    what is not a marker has the original's UTF-8 length."""
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 24)))
        encoded = encode_case(text)
        assert decode_case(encoded) == without_markers(text), (text, encoded)
        counted = sum(0 if c in MARKERS else len(c.encode("utf-8")) for c in encoded)
        assert counted == len(text.encode("utf-8")), (text, encoded)


def test_the_markers_stand_before_the_space_that_precedes_a_word():
    assert encode_case("Hello World") == f"{TITLE}hello{TITLE} world"
    assert encode_case("the NASA way") == f"the{ALLCAPS} nasa way"
    assert encode_case("an iPhone") == f"an i{CAPNEXT}phone"
    assert encode_case("by McDonald") == f"by{TITLE} mc{CAPNEXT}donald"
    assert encode_case("\n Start") == f"\n {TITLE}start"  # leading whitespace: the tokenizer drops it
    assert encode_case("x \ue001") == f"x {STAND_IN}"
    assert encode_case("İstanbul") == "İstanbul"  # its lower case is two characters: kept as it is


def test_a_models_output_decodes_whatever_its_markers():
    """Markers out of place (a sampled text) still decode, and a text cut after CAPNEXT loses
    only that marker, so streamed text grows by its end."""
    assert decode_case(f"{ALLCAPS}{ALLCAPS} ab, {TITLE}") == " AB, "
    assert decode_case(f"i{CAPNEXT}") == "i" and decode_case(f"i{CAPNEXT}phone") == "iPhone"


@pytest.fixture(scope="session")
def case_tokenizer(tmp_path_factory) -> Path:
    texts = [DATA_MULTILINGUAL, *iter_documents(DATA_DEMO_CORPUS)]
    path = tmp_path_factory.mktemp("case_tokenizer") / "case512.model"
    path.write_bytes(train_sentencepiece(texts, 512, max_bytes=300_000, options=TokenizerOptions(case_markers=True)))
    return path


def test_the_tokenizer_holds_the_markers_as_pieces_that_count_their_bytes(case_tokenizer, data_bytefallback_tokenizer):
    """The tokenizer carries SIGNATURE; the markers are pieces, alone and merged with what
    comes before them, and count no bytes."""
    sp = load_sentencepiece(case_tokenizer)
    assert has_case_markers(sp) and not has_case_markers(load_sentencepiece(data_bytefallback_tokenizer))
    base_bytes, has_leading_space, _ = build_byte_tables(sp, sp.vocab_size())
    pieces = {sp.id_to_piece(t): t for t in range(sp.vocab_size()) if marker_bytes(sp.id_to_piece(t))}
    assert set(MARKERS) <= set(pieces) and len(pieces) > len(MARKERS)  # BPE merges them with their neighbours
    for piece, token in pieces.items():
        text = piece.removeprefix("\u2581")
        assert base_bytes[token] == len(text.encode("utf-8")) - 3 * sum(map(text.count, MARKERS)), piece
    assert [int(base_bytes[pieces[m]]) for m in MARKERS] == [0, 0, 0]


def test_bits_per_byte_count_the_original_texts_bytes(case_tokenizer, data_bytefallback_tokenizer):
    """The tables count each document's bytes as its text has them, markers and all, and as
    the tokenizer without markers counts them; the markers make the documents shorter."""
    case_sp, plain_sp = load_sentencepiece(case_tokenizer), load_sentencepiece(data_bytefallback_tokenizer)
    case_luts = ByteLuts.from_numpy(*build_byte_tables(case_sp, case_sp.vocab_size()))
    plain_luts = ByteLuts.from_numpy(*build_byte_tables(plain_sp, plain_sp.vocab_size()))
    dropped = "A ROW! *happy* \x7f\x7f Now, \u200b Then  \t Two"  # characters normalization drops, beside spaces
    docs = [*list(iter_documents(DATA_DEMO_CORPUS))[:40], *TRICKY[:8], DATA_MULTILINGUAL.title(), dropped]
    case_tokens = plain_tokens = 0
    for doc in docs:
        case, plain = count_text_bytes(case_sp, case_luts, doc), count_text_bytes(plain_sp, plain_luts, doc)
        assert case.counted_bytes == case.normalized_bytes == plain.counted_bytes, doc[:80]
        case_tokens, plain_tokens = case_tokens + case.tokens, plain_tokens + plain.tokens
    assert case_tokens < plain_tokens


def test_prepare_with_case_markers_encodes_documents_that_decode_back(tmp_path, data_bytefallback_tokenizer):
    docs = [d.title() if i % 3 == 0 else d.upper() if i % 3 == 1 else d for i, d in enumerate(make_documents(90))]
    data = tmp_path / "corpus.jsonl"
    write_jsonl(data, docs)
    result = prepare([data], tmp_path / "data", vocab_size=400, val_fraction=0.2, workers=2,
                     tokenizer_options=TokenizerOptions(case_markers=True))
    info = result.manifest["tokenizer"]
    assert info["case_markers"] and info["trained"]
    codec = TextCodec(load_sentencepiece(result.data_dir / "tokenizer.model"))
    decoded = [codec.decode(d) for s in ("train", "val")
               for d in split_documents(load_tokens(list_shards(result.data_dir, s)).numpy())]
    assert sorted(decoded) == sorted(docs)
    tokens = load_tokens(list_shards(result.data_dir, "train")).numpy()
    assert any(marker_bytes(codec.sp.id_to_piece(int(t))) for t in np.unique(tokens))
    plain = prepare([data], tmp_path / "plain", tokenizer=data_bytefallback_tokenizer, val_fraction=0.2, workers=1)
    assert not plain.manifest["tokenizer"]["case_markers"]
    again = prepare([data], tmp_path / "again", tokenizer=result.data_dir / "tokenizer.model", val_fraction=0.2,
                    workers=1)  # the tokenizer decides: the same shards without the flag
    assert again.manifest["tokenizer"]["case_markers"]
    assert again.manifest["splits"] == result.manifest["splits"]


def test_tokenizer_options_that_do_not_apply_are_errors(tmp_path, data_bytefallback_tokenizer):
    data = write_jsonl(tmp_path / "corpus.jsonl", make_documents(30))
    out = tmp_path / "out"
    message = one_line_error(run_cli("prepare", data, "--tokenizer", data_bytefallback_tokenizer, "--case-markers",
                                     "--out", out, "--workers", "1"))
    assert "--case-markers" in message and "has no case markers" in message
    assert not out.exists()
    for option in ("--case-markers", "--no-split-scripts", "--no-split-words", "--tokenizer-sample-bytes=1000"):
        message = one_line_error(run_cli("prepare", "--index", tmp_path, option))
        assert "no tokenizer options" in message
    for option in ("--no-split-scripts", "--no-split-words"):
        message = one_line_error(run_cli("prepare", data, "--tokenizer", data_bytefallback_tokenizer, option,
                                         "--out", out, "--workers", "1"))
        assert f"{option} trains a tokenizer" in message and not out.exists()


def test_generated_text_comes_back_with_its_capitals(case_tokenizer):
    codec = TextCodec(load_sentencepiece(case_tokenizer))
    start, whole = codec.encode("The report from"), codec.encode("The report from NASA and McDonald said Hello")
    assert whole[:len(start)] == start
    prompt, new = [1, *start], whole[len(start):]
    text = continuation(codec, prompt, new)
    assert text == " NASA and McDonald said Hello"
    shown = ""
    for end in range(1, len(new) + 1):  # as `generate` streams it: every prefix extends the last
        partial = continuation(codec, prompt, new[:end])
        assert partial.startswith(shown), (shown, partial)
        shown = partial
    assert codec.decode(codec.encode("  Two  Spaces")) == "Two Spaces"  # as the tokenizer normalizes it


def load_sentencepiece_bytes(model: bytes):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=model)


def mixed_pieces(sp) -> list[str]:
    """Pieces with a letter and a character of no script (punctuation)."""
    pieces = (sp.id_to_piece(t).removeprefix("\u2581") for t in range(sp.vocab_size()) if not sp.is_byte(t))
    return [p for p in pieces if any(c.isalpha() for c in p) and any(c in ".,;:!?'\"" for c in p)]


def multiword_pieces(sp) -> list[str]:
    """Pieces that span a space ('▁' after their first character)."""
    return [p for p in map(sp.id_to_piece, range(sp.vocab_size())) if "\u2581" in p[1:]]


@pytest.mark.parametrize("option, crossing", [("split_scripts", mixed_pieces), ("split_words", multiword_pieces)])
def test_without_a_split_pieces_cross_it_and_the_tables_count_the_text(tmp_path, option, crossing):
    """split_scripts off (SentencePiece's split_by_unicode_script): pieces join letters and
    punctuation; split_words off (split_by_whitespace): pieces span words. Either way fewer
    tokens, and the byte tables count exactly the text they encode (a space inside a piece is
    one byte, not the three of '▁')."""
    texts = [DATA_MULTILINGUAL, *iter_documents(DATA_DEMO_CORPUS)]
    tokenizers = {split: load_sentencepiece_bytes(train_sentencepiece(
        texts, 512, max_bytes=300_000, options=TokenizerOptions(**{option: split}))) for split in (True, False)}
    assert not crossing(tokenizers[True]) and crossing(tokenizers[False])
    docs = list(iter_documents(DATA_DEMO_CORPUS))[:40]
    counts = {}
    for split, sp in tokenizers.items():
        luts = ByteLuts.from_numpy(*build_byte_tables(sp, sp.vocab_size()))
        counted = [count_text_bytes(sp, luts, doc) for doc in docs]
        assert all(c.counted_bytes == c.normalized_bytes for c in counted)
        counts[split] = sum(c.tokens for c in counted)
    assert counts[False] < counts[True]


def test_the_tokenizers_sample_is_an_option_of_training_one(tmp_path, data_bytefallback_tokenizer):
    data = write_jsonl(tmp_path / "corpus.jsonl", make_documents(600))
    shas = {}
    for sample in ("20000", None):
        out = tmp_path / f"data_{sample}"
        args = ("--tokenizer-sample-bytes", sample) if sample else ()
        result = run_cli("prepare", data, "--out", out, "--vocab-size", "400", "--workers", "1", "--json", *args)
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["settings"]["tokenizer_sample_bytes"] == int(sample or DEFAULT_TRAIN_SAMPLE_BYTES)
        shas[sample] = manifest["tokenizer"]["sha256"]
    assert shas["20000"] != shas[None]  # the first 20 kB of text make another tokenizer than all of it
    message = one_line_error(run_cli("prepare", data, "--tokenizer", data_bytefallback_tokenizer, "--out",
                                     tmp_path / "x", "--tokenizer-sample-bytes", "20000"))
    assert "--tokenizer-sample-bytes trains a tokenizer" in message
    message = one_line_error(run_cli("prepare", data, "--out", tmp_path / "y", "--tokenizer-sample-bytes", "0"))
    assert "--tokenizer-sample-bytes 0 must be" in message
