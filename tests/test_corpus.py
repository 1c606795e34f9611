"""Reading documents from JSON lines (plain, xz, gzip) and text files, and naming bad records."""
from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

import pytest

from windowgpt_cli.data.corpus import check_inputs, iter_corpus, iter_documents, read_chunks
from windowgpt_cli.errors import DataError

DOCS = ["first document\nwith two lines", "", "ünïcödé ✓ 日本語 🚀", "a \"quoted\" \\ text\r\nand a CR"]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path.name.lower().endswith(".xz"):
        data = lzma.compress(data)
    elif path.name.lower().endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def jsonl_lines(texts: list[str]) -> list[str]:
    return [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.xz", "docs.jsonl.gz", "DOCS.JSONL.GZ"])
def test_jsonl_documents_come_back_in_order(tmp_path, name):
    path = write_jsonl(tmp_path / name, jsonl_lines(DOCS))
    assert list(iter_documents(path)) == DOCS


def test_blank_lines_are_skipped_and_line_numbers_still_count(tmp_path):
    path = write_jsonl(tmp_path / "gaps.jsonl", ['{"text": "a"}', "", "   ", '{"text": "b"}', "{broken"])
    with pytest.raises(DataError, match=r"gaps\.jsonl: line 5: invalid JSON"):
        list(iter_documents(path))
    write_jsonl(path, ['{"text": "a"}', "", '{"text": "b"}'])
    assert list(iter_documents(path)) == ["a", "b"]


def test_text_file_is_one_document_verbatim(tmp_path):
    path = tmp_path / "book.txt"
    text = "Title\r\n\r\nChapter one — naïve.\n\n\nEnd.\n"
    path.write_bytes(text.encode("utf-8"))
    assert list(iter_documents(path)) == [text]


def test_small_chunks_keep_order_and_line_numbers(tmp_path):
    texts = [f"document {i} " + "x" * (i % 7) for i in range(50)]
    path = write_jsonl(tmp_path / "many.jsonl.xz", jsonl_lines(texts))
    chunks = list(read_chunks(path, chunk_bytes=100))
    assert len(chunks) > 5
    assert [c.first_line for c in chunks] == [1] + [sum(len(c.records) for c in chunks[:i]) + 1
                                                   for i in range(1, len(chunks))]
    assert chunks[-1].raw_position == path.stat().st_size
    assert list(iter_documents(path)) == texts


def test_corpus_reads_files_in_the_given_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", jsonl_lines(["a1", "a2"]))
    b = tmp_path / "b.txt"
    b.write_text("b as a whole", encoding="utf-8")
    assert list(iter_corpus([b, a])) == ["b as a whole", "a1", "a2"]


@pytest.mark.parametrize("line, message", [
    ("not json", r"line 2: invalid JSON"),
    ('{"title": "no text"}', r'line 2: field "text" must be a string \(missing\)'),
    ('{"text": 42}', r'line 2: field "text" must be a string \(a int\)'),
    ('{"text": null}', r'line 2: field "text" must be a string \(a NoneType\)'),
    ('["text"]', r"line 2: expected a JSON object"),
])
def test_bad_records_name_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl.gz", ['{"text": "fine"}', line, '{"text": "never read"}'])
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz: " + message) as info:
        list(iter_documents(path))
    assert "\n" not in str(info.value)


def test_invalid_utf8_names_the_line(tmp_path):
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl: line 2: not valid UTF-8 \(byte 0xe9"):
        list(iter_documents(jsonl))
    txt = tmp_path / "latin1.txt"
    txt.write_bytes(b"line one\nline two\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"latin1\.txt: line 3: not valid UTF-8"):
        list(iter_documents(txt))


def test_truncated_archive_is_a_data_error(tmp_path):
    full = write_jsonl(tmp_path / "full.jsonl.xz", jsonl_lines([f"document {i}" for i in range(2000)]))
    cut = tmp_path / "cut.jsonl.xz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(DataError, match=r"cut\.jsonl\.xz: line \d+: cannot decompress"):
        list(iter_documents(cut))


def test_check_inputs_refuses_missing_unsupported_and_directories(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", jsonl_lines(["x"]))
    assert check_inputs([good]) == [good]
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        check_inputs([good, tmp_path / "missing.jsonl"])
    (tmp_path / "data.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match=r"data\.csv: unsupported input type; use \.jsonl"):
        check_inputs([tmp_path / "data.csv"])
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(DataError, match=r"folder\.jsonl: not a file"):
        check_inputs([tmp_path / "folder.jsonl"])
