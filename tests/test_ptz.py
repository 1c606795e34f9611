"""The .ptz container and the safetensors reader/writer: exact round trips, strict
validation, and no loader that ever runs code from a file."""
from __future__ import annotations

import functools
import io
import json
import lzma
import pickle
import struct
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.artifacts import codecs, compressors, grouped, ptz
from windowgpt_cli.artifacts import weights as model_io
from windowgpt_cli.storage import tensorfile
from windowgpt_cli.artifacts.checkpoint import load_checkpoint
from windowgpt_cli.cli.app import app
from windowgpt_cli.config import tiny_preset
from windowgpt_cli.errors import ArtifactError
from windowgpt_cli.quant.gptq import quantize_state_dict

pytestmark = pytest.mark.usefixtures("quant_single_thread")
WIDE = {"COLUMNS": "200"}


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


# --- Safetensors ---------------------------------------------------------------------------

def test_tensor_file_round_trips_every_dtype():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 4, generator=g), "bf16": torch.randn(5, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(), "i8": torch.randint(-128, 128, (7,), dtype=torch.int8),
        "i16": torch.tensor([-300, 300], dtype=torch.int16), "i32": torch.tensor([[1 << 30]], dtype=torch.int32),
        "i64": torch.tensor([-(1 << 40)]), "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
    }
    data = tensorfile.dumps(tensors, {"note": "x"})
    assert struct.unpack("<Q", data[:8])[0] % 8 == 0
    back, meta = tensorfile.loads(data)
    assert meta == {"note": "x"} and list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)


def _with_header(header: dict, payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


@pytest.mark.parametrize("data", [
    b"\x01\x02",  # shorter than the length field
    struct.pack("<Q", 1 << 40) + b"{}",  # header length past the end
    struct.pack("<Q", 3) + b"{x}",  # not JSON
    _with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),  # truncated data
    _with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12),  # trailing bytes
    _with_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),  # size mismatch
    _with_header({"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),  # unknown dtype
    _with_header({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                  "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3),  # overlap
    _with_header({"a": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}}, b"\x02"),  # not a bool
    _with_header({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b""),  # negative shape
    _with_header({"__metadata__": {"k": 1}}, b""),  # metadata value not a string
    struct.pack("<Q", 47) + b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":1}',  # duplicate key
])
def test_malformed_tensor_files_raise_one_line_artifact_errors(data: bytes):
    with pytest.raises(ArtifactError) as excinfo:
        tensorfile.loads(data, source="x.safetensors")
    assert one_line_error(excinfo).startswith("x.safetensors")


# --- .ptz round trip ---------------------------------------------------------------------

def _artifact() -> ptz.PtzArtifact:
    g = torch.Generator().manual_seed(1)
    sd = {
        "tok_emb.weight": (torch.randn(1024, 80, generator=g) * 0.02).bfloat16(),
        "blocks.0.attn.c_q.weight": torch.randn(300, 240, generator=g) * 0.05,
        "blocks.0.mlp.proj.weight": torch.randn(240, 300, generator=g) * 0.05,
        "blocks.0.attn_scale": torch.rand(240, generator=g),
        "skip_weights": torch.rand(300, 240, generator=g),  # a large control tensor: kept in float32
        "bigram.scale": torch.tensor(0.05),
        "ids": torch.arange(5),
    }
    cfg = tiny_preset().resolved()
    return ptz.PtzArtifact(cfg, quantize_state_dict(sd), "cd" * 32, {"kind": "export", "sha256": "ef" * 32})


@pytest.mark.parametrize("compressor", compressors.COMPRESSOR_CHOICES)
def test_ptz_round_trip_restores_dequantized_tensors_and_config(tmp_path: Path, compressor: str):
    artifact = _artifact()
    path = tmp_path / "m.ptz"
    size = ptz.save(path, artifact, compressor)
    assert size == path.stat().st_size
    used = ptz.compressor_of(path.read_bytes())
    assert used == compressor or compressor == compressors.AUTO and used == compressors.GROUPS
    assert path.read_bytes()[:7] == b"WGPTZ" + bytes([ptz.FORMAT_VERSION, compressors.COMPRESSORS[used].id])
    back = ptz.load(path)
    assert back.config.to_dict() == artifact.config.to_dict()
    assert back.tokenizer_sha256 == artifact.tokenizer_sha256 and back.source == artifact.source
    assert list(back.tensors) == list(artifact.tensors)
    expected, got = artifact.dequantized(), back.dequantized()
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name
        assert back.tensors[name].scheme == artifact.tensors[name].scheme
        assert back.tensors[name].method == artifact.tensors[name].method


def test_loading_a_ptz_gives_banked_weights_for_the_model(tmp_path: Path):
    from windowgpt_cli.model.gpt import build_model
    from windowgpt_cli.model.state_dict import unbank_state_dict

    cfg = tiny_preset().resolved()
    torch.manual_seed(0)
    sd = build_model(cfg.model, torch.device("cpu")).state_dict()
    artifact = ptz.PtzArtifact(cfg, quantize_state_dict(unbank_state_dict(sd, cfg.model.num_layers)), "cd" * 32, {})
    ptz.save(tmp_path / "m.ptz", artifact)
    loaded = model_io.load_weights(tmp_path / "m.ptz")
    assert loaded.kind == "ptz" and set(loaded.state_dict) == set(sd)
    assert all(loaded.state_dict[k].shape == sd[k].shape for k in sd)
    _, model = model_io.build_model(tmp_path / "m.ptz", torch.device("cpu"))
    assert not model.training


# --- Files that are not a .ptz of this version -------------------------------------------

def _altered_payload(good: bytes) -> bytes:
    """A well-formed file whose payload differs from the hash in its header."""
    payload = ptz.decompress_payload(good, "x")
    flipped = payload[:-1] + bytes([payload[-1] ^ 1])
    return good[:ptz.HEADER_BYTES] + lzma.compress(flipped, preset=6)


def _broken_files(tmp_path: Path) -> dict[str, Path]:
    good = ptz.encode(_artifact())
    files = {
        "truncated": good[: len(good) // 2],
        "other version": good[:5] + bytes([ptz.FORMAT_VERSION + 1]) + good[6:],
        "not a ptz": b"hello, world\n" * 10,
        "empty": b"",
        "header only": good[:7],
        "unknown compressor": good[:6] + b"\xee" + good[7:],
        "trailing garbage": good + b"extra",
        "payload not safetensors": ptz.compress_payload(b"plain text", "lzma"),
        "bomb": ptz.compress_payload(b"\0" * 1000, "lzma")[:7] + ptz._SIZE_AND_HASH.pack(10, bytes(32))
        + lzma.compress(b"\0" * 50_000_000),
        "payload altered": _altered_payload(good),
    }
    out = {}
    for name, data in files.items():
        path = tmp_path / (name.replace(" ", "_") + ".ptz")
        path.write_bytes(data)
        out[name] = path
    return out


@pytest.mark.slow
def test_broken_ptz_files_raise_one_line_errors(tmp_path: Path):
    for name, path in _broken_files(tmp_path).items():
        with pytest.raises(ArtifactError) as excinfo:
            ptz.load(path)
        assert str(path) in one_line_error(excinfo), name
        with pytest.raises(ArtifactError):
            model_io.load_weights(path)


@pytest.mark.parametrize("command", ["eval", "quantize"])
@pytest.mark.slow
def test_broken_ptz_files_exit_1_with_one_line_through_the_cli(tmp_path: Path, command: str):
    runner = CliRunner()
    files = _broken_files(tmp_path)
    for name in ("truncated", "other version", "not a ptz"):
        args = [command, str(files[name])] + (["--data", str(tmp_path)] if command == "eval" else
                                               ["--out", str(tmp_path / "out.ptz")])
        result = runner.invoke(app, args, env=WIDE)
        assert result.exit_code == 1, (name, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, lines
    assert "version" in runner.invoke(app, ["quantize", str(files["other version"]), "--out",
                                            str(tmp_path / "o.ptz")], env=WIDE).output


# --- A planted pickle never runs --------------------------------------------------------

class _WritesMarker:
    """Unpickling this calls open(marker, "w"), creating the file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _planted_files(tmp_path: Path, marker: Path) -> dict[str, Path]:
    raw = pickle.dumps({"w": _WritesMarker(marker), "m": {}})
    zipped = io.BytesIO()
    torch.save({"format": "windowgpt.checkpoint", "payload": _WritesMarker(marker)}, zipped)
    files = {"pickle": raw, "lzma pickle": lzma.compress(raw, preset=6), "torch.save zip": zipped.getvalue()}
    out = {}
    for name, data in files.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "x.ptz").write_bytes(data)
        out[name] = folder / "x.ptz"
    return out


def test_the_planted_pickle_does_run_when_unpickled(tmp_path: Path):
    marker = tmp_path / "control_marker"
    pickle.loads(pickle.dumps(_WritesMarker(marker))).close()
    assert marker.exists()  # so the absence of the marker below means something


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_no_loader_runs_a_planted_pickle(tmp_path: Path):
    marker = tmp_path / "marker"
    loaders = {
        "ptz.load": ptz.load,
        "model_io.load_weights": model_io.load_weights,
        "model_io.build_model": lambda p: model_io.build_model(p, torch.device("cpu")),
        "checkpoint.load_checkpoint": load_checkpoint,
    }
    for kind, path in _planted_files(tmp_path, marker).items():
        for name, load in loaders.items():
            with pytest.raises(ArtifactError) as excinfo:
                load(path)
            one_line_error(excinfo)
            assert not marker.exists(), f"{name} ran the code in a {kind}"
        # a run directory whose checkpoint.pt is the planted file
        (path.parent / "checkpoint.pt").write_bytes(path.read_bytes())
        with pytest.raises(ArtifactError):
            model_io.load_weights(path.parent)
        assert not marker.exists()


def test_the_cli_refuses_a_planted_pickle_with_one_line(tmp_path: Path):
    marker = tmp_path / "marker"
    runner = CliRunner()
    for path in _planted_files(tmp_path, marker).values():
        for args in (["eval", str(path), "--data", str(tmp_path)],
                     ["quantize", str(path), "--out", str(tmp_path / "o.ptz")]):
            result = runner.invoke(app, args, env=WIDE)
            assert result.exit_code == 1, result.output
            assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output
    assert not marker.exists()


# --- The rANS compressor ----------------------------------------------------------------

def _codes(rows: int, cols: int, spread: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.clamp(torch.round(torch.randn(rows, cols, generator=g) * spread), -31, 31).to(torch.int8)


def test_rans_codes_int8_tensors_near_their_entropy_and_below_lzma():
    codes = _codes(400, 500, 4, 9)
    payload = tensorfile.dumps({"a.q": codes, "small.q": codes[:2, :10].contiguous(), "b": torch.randn(50)})
    counts = torch.bincount(codes.flatten().long() + 128).double()
    p = counts[counts > 0] / codes.numel()
    entropy_bytes = float(-(p * p.log2()).sum()) * codes.numel() / 8
    coded = ptz.compress_payload(payload, "rans")
    overhead = 4 * compressors.rans_lanes(codes.numel()) + 1_000  # lane states, header, table, the lzma-coded rest
    assert len(coded) <= entropy_bytes * 1.002 + overhead
    assert len(coded) < len(ptz.compress_payload(payload, "lzma"))
    assert ptz.decompress_payload(coded, "x") == payload


def test_rans_lanes_grow_with_the_symbols_within_bounds():
    lanes = [compressors.rans_lanes(n) for n in (0, 10_000, 4_000_000, 27_000_000, 10**9)]
    assert lanes == sorted(lanes) and lanes[0] == compressors.RANS_MIN_LANES and lanes[-1] == compressors.RANS_MAX_LANES
    assert all(n & (n - 1) == 0 for n in lanes)  # powers of two
    assert 27_000_000 // lanes[3] >= compressors.RANS_SYMBOLS_PER_LANE


def test_auto_codes_each_group_with_its_smallest_codec_and_layout():
    """Independent codes go to rans; codes repeating along columns to a transposed layout;
    the exhaustive search's sections are each the smallest of every codec and layout, and
    auto's (two layouts a section: its stand-in's choice and the bytes as stored) within 1%."""
    noisy = _codes(300, 400, 6, 3)
    rows = (torch.arange(200)[:, None] % 7 - 3).expand(200, 300).to(torch.int8).contiguous()  # constant rows
    payload = tensorfile.dumps({"blocks.0.attn.c_q.weight.q": noisy, "blocks.0.mlp.fc.weight.q": rows})
    auto = ptz.compress_payload(payload, compressors.AUTO)
    assert ptz.compressor_of(auto) == "groups" and ptz.decompress_payload(auto, "x") == payload
    _, sections = grouped.compress(payload, exhaustive=True)
    cost = {s.name: len(s.body) + grouped._order_bytes(s, s.transform) for s in sections}
    assert {s.name: s.transform for s in sections}["mlp/codes"] in ("transpose", "sort_transpose")
    _, chosen = grouped.compress(payload)
    assert {s.name: s.transform for s in chosen}["mlp/codes"] in ("transpose", "sort_transpose")
    assert sum(len(s.body) for s in chosen) <= 1.01 * sum(len(s.body) for s in sections)
    for codec in codecs.available():
        for transform in grouped.TRANSFORMS:
            _, alone = grouped.compress(payload, [codec], [transform])
            for s in alone:
                assert cost[s.name] <= len(s.body) + grouped._order_bytes(s, s.transform), (s.name, codec, transform)
    whole = min(len(ptz.compress_payload(payload, name)) for name in ("lzma", "rans"))
    assert len(auto) < whole


def _encodings(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(codec, bytes in) of every codecs.encode call from now on."""
    calls: list[tuple[str, int]] = []
    encode = codecs.encode
    monkeypatch.setattr(codecs, "encode", lambda codec, data: calls.append((codec, len(data))) or encode(codec, data))
    return calls


def test_on_a_large_section_slow_codecs_code_only_a_sample_unless_it_says_they_may_win(
        monkeypatch: pytest.MonkeyPatch):
    """Independent codes of low entropy (which the slow codecs code 3-14% above rANS): lzma,
    brotli and zstd code samples of 16 pieces, never the whole section; codes with long
    repeats: the slow codec the sample favours codes the whole section and is kept, as the
    exhaustive search keeps it."""
    monkeypatch.setattr(grouped, "SAMPLE_MIN_BYTES", 256 * 1024)
    monkeypatch.setattr(grouped, "SAMPLE_CHUNK", 8 * 1024)
    noisy = tensorfile.dumps({"blocks.0.mlp.fc.weight.q": _codes(1024, 1024, 1, 5)})
    calls = _encodings(monkeypatch)
    stream, sections = grouped.compress(noisy)
    section = sections[0]
    assert section.codec in ("rans", "rans_rows") and grouped.decompress(stream, len(noisy)) == noisy
    slow = [size for codec, size in calls if codec in grouped.SLOW_CODECS and size > 1024]  # not the map's
    assert slow and all(size == 16 * 8 * 1024 for size in slow), calls

    phrase = _codes(1, 2048, 6, 6).flatten()  # 2,048 random codes, then again and again
    payload = tensorfile.dumps({"blocks.0.mlp.fc.weight.q": phrase.repeat(256).reshape(512, 1024)})
    calls.clear()
    stream, (section,) = grouped.compress(payload)
    _, (best,) = grouped.compress(payload, exhaustive=True)
    assert section.codec in grouped.SLOW_CODECS and (section.codec, section.raw_bytes) in calls
    assert len(section.body) <= 1.01 * len(best.body) and grouped.decompress(stream, len(payload)) == payload


def _as_rans_v1(coded: bytes) -> bytes:
    """A 1024-lane stream of compressor id 3 rewritten as compressor id 2, the first rans
    format (the same stream without the lane count in its header)."""
    header, body = coded[:ptz.HEADER_BYTES], coded[ptz.HEADER_BYTES:]
    assert compressors._RANS_HEADER.unpack_from(body)[-1] == compressors.RANS_V1_LANES
    return (header[:6] + bytes([2]) + header[7:] + body[:compressors._RANS_V1_HEADER.size]
            + body[compressors._RANS_HEADER.size:])


def _rans_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[bytes, int]]:
    """An artifact coded by rans as written today and in the first format (id 2), each with
    the size of its rANS header."""
    artifact = _artifact()
    current = ptz.encode(artifact, "rans")
    with monkeypatch.context() as patch:
        patch.setattr(compressors, "rans_lanes", lambda symbols: compressors.RANS_V1_LANES)
        first = _as_rans_v1(ptz.encode(artifact, "rans"))
    return {"current": (current, compressors._RANS_HEADER.size), "first": (first, compressors._RANS_V1_HEADER.size)}


def test_the_first_rans_format_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    first, _ = _rans_streams(monkeypatch)["first"]
    (tmp_path / "old.ptz").write_bytes(first)
    back, artifact = ptz.load(tmp_path / "old.ptz"), _artifact()
    assert ptz.compressor_of(first) == "rans" and first[6] == 2
    expected, got = artifact.dequantized(), back.dequantized()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("version", ["current", "first"])
def test_rans_refuses_altered_or_truncated_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str):
    good, rans_header = _rans_streams(monkeypatch)[version]
    header = ptz.HEADER_BYTES + rans_header
    variants = {
        "truncated": good[:-3],
        "padded": good + b"\0\0",
        "word flipped": good[:-100] + bytes([good[-100] ^ 0x40]) + good[-99:],
        "state flipped": good[:header + 200] + bytes([good[header + 200] ^ 1]) + good[header + 201:],
        "header only": good[:header - 5],
        "side flipped": good[:header + 30] + bytes([good[header + 30] ^ 0x10]) + good[header + 31:],
    }
    if version == "current":
        lanes_at = header - 4
        for lanes in (0, compressors.RANS_MAX_LANES + 1, struct.unpack_from("<I", good, lanes_at)[0] // 2):
            variants[f"{lanes} lanes"] = good[:lanes_at] + struct.pack("<I", lanes) + good[header:]
    for name, data in variants.items():
        path = tmp_path / f"{name.replace(' ', '_')}.ptz"
        path.write_bytes(data)
        with pytest.raises(ArtifactError) as excinfo:
            ptz.load(path)
        assert one_line_error(excinfo).startswith(str(path)), name


@pytest.mark.slow
def test_decoding_refuses_a_corrupt_rans_stream_as_corrupt_payload(monkeypatch: pytest.MonkeyPatch):
    """Every prefix and every single-byte change of a small stream raises CorruptPayload
    (or decodes to exactly the payload, which the header's hash then confirms)."""
    payload = tensorfile.dumps({"a.q": _codes(64, 80, 3, 5), "b": torch.arange(6, dtype=torch.float32)})
    for lanes in (compressors.RANS_V1_LANES, 64):
        monkeypatch.setattr(compressors, "rans_lanes", lambda symbols: lanes)
        stream = ptz.compress_payload(payload, "rans")
        if lanes == compressors.RANS_V1_LANES:
            stream = _as_rans_v1(stream)
        decompress = functools.partial(compressors.decompress, stream[6])
        body = stream[ptz.HEADER_BYTES:]
        assert decompress(body, len(payload)) == payload
        for cut in range(0, len(body), 7):
            with pytest.raises(compressors.CorruptPayload):
                decompress(body[:cut], len(payload))
        for at in range(0, len(body), 5):
            altered = body[:at] + bytes([body[at] ^ 0x21]) + body[at + 1:]
            try:
                assert decompress(altered, len(payload)) == payload, at
            except compressors.CorruptPayload:
                pass
