"""The quantization schemes beyond the reference's (k-sigma clipping, narrower embedding
codes, int8 gates, GPTQ on the embedding, LQER) and the per-group compressor, on CPU."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from windowgpt_cli.artifacts import codecs, compressors, grouped, ptz, rans_rows
from windowgpt_cli.artifacts.quantized import CONTROL, INT6, INT8, PASSTHROUGH
from windowgpt_cli.config import RunConfig, tiny_preset, validate
from windowgpt_cli.errors import ArtifactError, ConfigError
from windowgpt_cli.quant.calibration import collect_hessians
from windowgpt_cli.quant.gptq import quantize_state_dict
from windowgpt_cli.quant.lqer import add_corrections, quantize_factor
from windowgpt_cli.quant.schemes import QuantPlan, choose_scheme, quantize_tensor
from windowgpt_cli.storage import tensorfile

FIXTURE = Path(__file__).parent / "fixtures" / "v0.1.0-4052639"
SMALL = 100  # tensors of at most this many elements are kept: the test matrices are quantized


def plan(**settings) -> QuantPlan:
    return QuantPlan(passthrough_max_numel=SMALL, **settings)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Matrices of each category, with rows of unequal spread and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.2, 2.0, 96)[:, None]
    sd = {name: torch.randn(96, 128, generator=g) * spread for name in
          ("blocks.0.attn.c_q.weight", "blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight", "tok_emb.weight")}
    sd["blocks.0.mlp.fc.weight"][3, 5] = 40.0
    sd["skip_weights"] = torch.randn(2, 64, generator=g)
    return sd


def test_the_default_plan_quantizes_an_old_export_exactly_as_its_ptz():
    """The reference's scheme, byte for byte: codes, scales and kept values of the export's
    quantization equal those of the .ptz the previous version wrote from it."""
    from windowgpt_cli.artifacts.weights import load_weights
    from windowgpt_cli.model.state_dict import unbank_state_dict

    old = ptz.load(FIXTURE / "model.ptz")
    weights = load_weights(FIXTURE / "export")
    sd = unbank_state_dict(weights.state_dict, weights.config.model.num_layers)
    plan = QuantPlan.from_config(weights.config.quant)
    assert plan == QuantPlan(passthrough_max_numel=weights.config.quant.quant_passthrough_max_numel)
    new = quantize_state_dict(sd, plan=plan)
    assert list(new) == list(old.tensors)
    for name, qt in new.items():
        before = old.tensors[name]
        assert (qt.scheme, qt.method, qt.values.dtype) == (before.scheme, before.method, before.values.dtype), name
        assert torch.equal(qt.values, before.values), name
        assert (qt.scale is None) == (before.scale is None)
        assert qt.scale is None or torch.equal(qt.scale, before.scale)


def test_k_sigma_clipping_scales_each_row_by_its_spread():
    sd = _weights()
    sigma = plan(mlp_clip_sigmas=4.0, attn_clip_sigmas=6.0, embed_clip_sigmas=5.0, embed_bits=7)
    for name, k, limit in (("blocks.0.mlp.fc.weight", 4.0, 31), ("blocks.0.attn.c_q.weight", 6.0, 31),
                           ("tok_emb.weight", 5.0, 63)):
        qt = quantize_tensor(name, sd[name], sigma)
        w = sd[name]
        clip = k * w.std(dim=1, correction=0)  # whether or not any weight of the row reaches it
        assert torch.equal(qt.scale, (clip / limit).to(torch.float16)), name
        assert int(qt.values.abs().max()) <= limit and qt.method.endswith("sigma")
    assert choose_scheme("tok_emb.weight", sd["tok_emb.weight"], sigma) == "int7"
    # the outlier is clipped: its row keeps a fine grid, where the reference's max-based scale would not
    fc = quantize_tensor("blocks.0.mlp.fc.weight", sd["blocks.0.mlp.fc.weight"], sigma)
    reference = quantize_tensor("blocks.0.mlp.fc.weight", sd["blocks.0.mlp.fc.weight"], plan())
    assert fc.scale[3] < reference.scale[3]


def test_a_wide_sigma_clip_codes_gaussian_rows_in_fewer_values_and_bytes():
    """At 11.5 standard deviations no weight of a Gaussian row is clipped, yet the grid is
    the clip's, not the row's largest weight's: fewer distinct codes than the reference's
    search, so fewer compressed bytes, for a larger error."""
    import lzma

    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    wide = quantize_tensor("blocks.0.mlp.fc.weight", w, plan(mlp_clip_sigmas=11.5))
    reference = quantize_tensor("blocks.0.mlp.fc.weight", w, plan())
    assert int(wide.values.abs().max()) < 16 < int(reference.values.abs().max())
    assert len(lzma.compress(wide.values.numpy().tobytes())) < 0.8 * len(lzma.compress(
        reference.values.numpy().tobytes()))
    assert (wide.dequantize() - w).pow(2).mean() > (reference.dequantize() - w).pow(2).mean()


def test_without_the_scale_floor_small_rows_get_a_grid_of_their_own():
    """Rows whose largest weight is under 1: the reference's floor puts every one on the grid
    1 / 31; without it each row's scale follows its weights, by rounding and by GPTQ alike."""
    sd = {"blocks.0.mlp.fc.weight": torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.02}
    name, w = "blocks.0.mlp.fc.weight", sd["blocks.0.mlp.fc.weight"]
    floored, free = plan(), plan(scale_floor=False)
    assert torch.all(quantize_tensor(name, w, floored).scale == torch.tensor(1 / 31).half())
    rounded = quantize_tensor(name, w, free)
    assert torch.all(rounded.scale.float() < 1 / 31)
    assert (rounded.dequantize() - w).pow(2).mean() < 0.01 * (quantize_tensor(name, w, floored).dequantize() - w
                                                               ).pow(2).mean()
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(3))
    hessians = {(name,): x.T @ x}
    by_gptq = quantize_state_dict(sd, hessians=hessians, plan=free)[name]
    assert by_gptq.method == "gptq" and torch.all(by_gptq.scale.float() < 1 / 31)
    assert torch.all(quantize_state_dict(sd, hessians=hessians, plan=floored)[name].scale.float() >= 1 / 31 - 1e-4)


def test_narrower_embedding_codes_and_int8_gates():
    sd = _weights()
    plan = QuantPlan(embed_bits=5, gates_int8=True, passthrough_max_numel=1000)
    emb = quantize_tensor("tok_emb.weight", sd["tok_emb.weight"], plan)
    assert emb.scheme == "int5" and int(emb.values.abs().max()) <= 15
    gate = quantize_tensor("skip_weights", sd["skip_weights"], plan)
    assert gate.scheme == INT8 and gate.method == "max" and gate.values.shape == (2, 64)
    assert torch.allclose(gate.dequantize(), sd["skip_weights"], atol=float(gate.scale.max()) / 2 + 1e-6)
    assert quantize_tensor("skip_weights", sd["skip_weights"], QuantPlan(passthrough_max_numel=1000)).scheme \
        == PASSTHROUGH
    assert choose_scheme("skip_weights", torch.zeros(20, 100), QuantPlan(passthrough_max_numel=1000)) == CONTROL


def test_lqer_factors_are_asymmetric_codes_that_bound_their_groups():
    values = torch.randn(37, 5) * 3 + 1  # 185 values: the last group of 64 is partial
    factor = quantize_factor(values, 4, 64)
    assert factor.codes.dtype == torch.uint8 and int(factor.codes.max()) <= 15 and factor.scale.numel() == 3
    assert torch.allclose(factor.dequantize(64), values, atol=float(factor.scale.float().max()) / 2 + 1e-3)


def test_lqer_corrects_the_matrices_of_largest_error_and_lowers_it():
    sd = _weights()
    settings = plan(lqer_rank=8, lqer_top_k=2, lqer_factor_bits=8, lqer_group_size=32)
    base = quantize_state_dict(sd, plan=plan())
    errors = {n: float((sd[n] - qt.dequantize()).pow(2).sum()) for n, qt in base.items()
              if qt.scheme in (INT6, INT8) and n != "skip_weights"}
    corrected = quantize_state_dict(sd, plan=settings)
    chosen = [n for n, qt in corrected.items() if qt.correction is not None]
    assert sorted(chosen) == sorted(sorted(errors, key=errors.get)[-2:])
    for name in chosen:
        after = float((sd[name] - corrected[name].dequantize()).pow(2).sum())
        assert after < errors[name], name
        assert corrected[name].correction.rank == 8
    # low-rank errors are removed almost entirely
    low = {"blocks.0.mlp.fc.weight": torch.randn(96, 2) @ torch.randn(2, 128) * 0.002}  # below half a step
    tensors = quantize_state_dict(low, plan=plan())
    before = float((low["blocks.0.mlp.fc.weight"] - tensors["blocks.0.mlp.fc.weight"].dequantize()).pow(2).sum())
    add_corrections(low, tensors, plan(lqer_rank=4, lqer_top_k=1, lqer_factor_bits=8, lqer_group_size=16),
                    torch.device("cpu"))
    after = float((low["blocks.0.mlp.fc.weight"] - tensors["blocks.0.mlp.fc.weight"].dequantize()).pow(2).sum())
    assert after < 0.05 * before


def test_every_scheme_survives_the_ptz_round_trip(tmp_path: Path):
    sd = _weights()
    settings = plan(mlp_clip_sigmas=4, attn_clip_sigmas=5, embed_clip_sigmas=6, embed_bits=7, gates_int8=True,
                    lqer_rank=3, lqer_top_k=2)
    tensors = quantize_state_dict(sd, plan=settings)
    errors = {n: 0.01 for n in tensors}
    artifact = ptz.PtzArtifact(tiny_preset(), tensors, "ab" * 32, {}, 31, errors)
    for compressor in ("lzma", compressors.AUTO):
        path = tmp_path / f"{compressor}.ptz"
        ptz.save(path, artifact, compressor)
        back = ptz.load(path)
        assert back.errors == errors
        for name, qt in tensors.items():
            assert back.tensors[name].scheme == qt.scheme and back.tensors[name].method == qt.method
            assert torch.equal(back.tensors[name].dequantize(), qt.dequantize()), name
            assert (back.tensors[name].correction is None) == (qt.correction is None)
        described = ptz.describe(path)
        corrected = {n for n, q in tensors.items() if q.correction}
        assert {n for n, t in described.tensors.items() if t.lqer_rank} == corrected
        assert all(t.error == 0.01 for t in described.tensors.values())


def _metadata_edit(data: bytes, edit) -> bytes:
    """A .ptz whose payload metadata `edit` changed (re-hashed, so that only the check of
    what the metadata says can refuse it)."""
    payload = ptz.decompress_payload(data, "x")
    stored, metadata = tensorfile.loads(payload, "x")
    meta = json.loads(metadata[ptz.METADATA_KEY])
    edit(meta, stored)
    return ptz.compress_payload(tensorfile.dumps(stored, {ptz.METADATA_KEY: json.dumps(meta)}), "lzma")


def test_altered_lqer_descriptions_and_codes_are_refused_in_one_line():
    sd = _weights()
    tensors = quantize_state_dict(sd, plan=plan(lqer_rank=2, lqer_top_k=1, lqer_factor_bits=3))
    name = next(n for n, qt in tensors.items() if qt.correction is not None)
    good = ptz.encode(ptz.PtzArtifact(tiny_preset(), tensors, "ab" * 32, {}), "lzma")

    def rank(meta, stored):
        meta["tensors"][name]["lqer"]["rank"] = 3

    def huge(meta, stored):
        meta["tensors"][name]["lqer"]["group_size"] = 1 << 40

    def codes(meta, stored):
        stored[f"{name}.lqer_a.q"] = torch.full_like(stored[f"{name}.lqer_a.q"], 9)  # over 3 bits

    def missing(meta, stored):
        del stored[f"{name}.lqer_b.offset"]

    for edit, words in ((rank, "do not match"), (huge, "invalid LQER"), (codes, "exceed 3 bits"),
                        (missing, "lacks")):
        with pytest.raises(ArtifactError, match=words) as err:
            ptz.decode(_metadata_edit(good, edit))
        assert "\n" not in str(err.value)


def test_gptq_quantizes_the_embedding_on_the_output_layers_hessian():
    from windowgpt_cli.model.gpt import build_model
    from windowgpt_cli.model.state_dict import unbank_state_dict

    cfg = tiny_preset()
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (2, 64))
    hessians = collect_hessians(model, [(x, x)], torch.device("cpu"), head=True)
    assert hessians[("tok_emb.weight",)].shape == (cfg.model.model_dim, cfg.model.model_dim)
    assert ("tok_emb.weight",) not in collect_hessians(model, [(x, x)], torch.device("cpu"))
    sd = unbank_state_dict(model.state_dict(), cfg.model.num_layers)
    plan = QuantPlan(passthrough_max_numel=1024, embed_bits=7, gptq_embed=True)
    tensors = quantize_state_dict(sd, hessians=hessians, plan=plan)
    emb = tensors["tok_emb.weight"]
    assert (emb.scheme, emb.method) == ("int7", "gptq") and int(emb.values.abs().max()) <= 63
    without = quantize_state_dict(sd, hessians=hessians, plan=QuantPlan(passthrough_max_numel=1024, embed_bits=7))
    assert without["tok_emb.weight"].method == ""
    # its error in the output layer's own metric is no larger than rounding's
    h = hessians[("tok_emb.weight",)]
    w = sd["tok_emb.weight"].float()

    def output_error(qt):
        e = w - qt.dequantize().float()
        return float(torch.einsum("ij,jk,ik->", e, h, e))

    assert output_error(emb) <= output_error(without["tok_emb.weight"])


def test_gptq_on_the_embedding_needs_gptq_and_tied_embeddings():
    cfg = RunConfig()
    cfg.quant.quant_gptq_embed = True
    with pytest.raises(ConfigError, match="needs use_gptq"):
        validate(cfg)
    cfg.quant.use_gptq = True
    cfg.model.tie_embeddings = False
    with pytest.raises(ConfigError, match="tied embeddings"):
        validate(cfg)


# --- The per-group compressor ----------------------------------------------------------------

def _payload() -> bytes:
    g = torch.Generator().manual_seed(3)
    similar = torch.randn(1, 256, generator=g).repeat(64, 1) + 0.3 * torch.randn(64, 256, generator=g)
    rows = similar[torch.randperm(64, generator=g)]
    return tensorfile.dumps({
        "blocks.0.mlp.fc.weight.q": torch.clamp(torch.round(rows * 4), -31, 31).to(torch.int8),
        "blocks.0.attn.c_q.weight.q": torch.randint(-5, 6, (40, 100), generator=g).to(torch.int8),
        "blocks.0.attn.c_q.weight.scale": torch.rand(40, generator=g).to(torch.float16),
        "tok_emb.weight": torch.randn(100, 30, generator=g).to(torch.float16),
        "small": torch.ones(3),
    }, {"note": "x"})


@pytest.mark.parametrize("transform", grouped.TRANSFORMS)
@pytest.mark.parametrize("codec", ["lzma", "rans", "brotli", "zstd"])
def test_every_codec_and_layout_restores_the_payload(codec: str, transform: str):
    if codecs.missing_package(codec):
        pytest.skip(f"{codec} needs {codecs.missing_package(codec)}")
    payload = _payload()
    stream, sections = grouped.compress(payload, [codec], [transform])
    assert grouped.decompress(stream, len(payload)) == payload
    # rANS of bytes comes with its by-rows variant, for int8 matrices laid out as stored or
    # transposed: only where the search leaves them one of those layouts
    by_rows = codec == "rans" and transform in ("none", "shuffle", "transpose")
    used = {s.codec for s in sections}
    assert codec in used and used <= ({codec, "rans_rows"} if by_rows else {codec})
    assert all(s.transform in (transform, "none") for s in sections)
    with pytest.raises(compressors.CorruptPayload):
        grouped.decompress(stream, len(payload) - 1)  # never more than the header declares


def test_similarity_sort_puts_near_duplicate_rows_side_by_side():
    base = torch.randn(8, 64)
    rows = torch.cat([base, base + 0.01 * torch.randn(8, 64)])[torch.randperm(16)]
    order = grouped.similarity_order(rows.numpy())
    assert sorted(order.tolist()) == list(range(16))
    pairs = sum(float((rows[a] - rows[b]).norm()) < 1 for a, b in zip(order[:-1], order[1:]))
    assert pairs >= 7


def test_a_sorted_layout_pays_for_its_permutation_only_where_it_is_smaller():
    payload = _payload()
    _, sorted_only = grouped.compress(payload, ["lzma"], ["sort"])
    _, plain = grouped.compress(payload, ["lzma"], ["none"])
    _, either = grouped.compress(payload, ["lzma"], ["none", "sort"], exhaustive=True)
    mlp = {s.name: s for s in sorted_only}["mlp/codes"]
    cost = {"sort": len(mlp.body) + 2 * 64, "none": len({s.name: s for s in plain}["mlp/codes"].body)}
    assert {s.name: s for s in either}["mlp/codes"].transform == min(cost, key=cost.get)


def _matrices_of_unequal_rows() -> list[np.ndarray]:
    """int8 code matrices whose rows spread unequally, as on the reference's fixed grid."""
    rng = np.random.default_rng(0)
    return [np.clip(np.round(rng.normal(size=(64, 96)) * np.linspace(0.3, 6, 64)[rng.permutation(64), None]),
                    -31, 31).astype(np.int8) for _ in range(3)] + [np.zeros((5, 7), np.int8)]


def test_rans_by_rows_codes_each_class_of_rows_with_its_own_table():
    mats = _matrices_of_unequal_rows()
    data, shapes = b"".join(m.tobytes() for m in mats), [m.shape for m in mats]
    body = rans_rows.encode(data, shapes)
    assert rans_rows.decode(body, shapes, len(data)) == data
    assert len(body) < 0.95 * len(codecs.encode("rans", data))  # one table for all rows
    classes = rans_rows.row_classes(mats[0].view(np.uint8) ^ np.uint8(0x80))
    spread = mats[0].astype(float).std(axis=1)
    assert spread[classes == 0].max() <= spread[classes == rans_rows.ROW_CLASSES - 1].min()
    # the grouped compressor takes it where it is smallest, and restores the payload
    payload = tensorfile.dumps({f"blocks.{i}.mlp.fc.weight.q": torch.from_numpy(m) for i, m in enumerate(mats[:3])},
                               {})
    stream, sections = grouped.compress(payload, ["lzma", "rans"])
    assert {s.name: s.codec for s in sections}["mlp/codes"] == "rans_rows"
    assert grouped.decompress(stream, len(payload)) == payload


def test_rans_by_rows_of_the_transposed_codes_takes_classes_of_columns():
    """Codes whose columns spread unequally (each input channel its own scale, as trained
    codes are): the compressor codes them by rows of the transposed layout, and restores them."""
    rng = np.random.default_rng(2)
    mats = [np.clip(np.round(rng.normal(size=(64, 96)) * np.linspace(0.3, 6, 96)[rng.permutation(96)]),
                    -31, 31).astype(np.int8) for _ in range(3)]
    payload = tensorfile.dumps({f"blocks.{i}.mlp.fc.weight.q": torch.from_numpy(m) for i, m in enumerate(mats)}, {})
    stream, sections = grouped.compress(payload, ["lzma", "rans"])
    mlp = {s.name: s for s in sections}["mlp/codes"]
    assert (mlp.codec, mlp.transform) == ("rans_rows", "transpose")
    as_stored = rans_rows.encode(b"".join(m.tobytes() for m in mats), [m.shape for m in mats])
    assert len(mlp.body) < 0.95 * len(as_stored)
    assert grouped.decompress(stream, len(payload)) == payload


def test_rans_by_rows_codes_more_matrices_than_tables_fit_a_byte():
    """Over 64 matrices make more than 256 tables (four classes each): each symbol still
    finds its own."""
    mats = [np.full((3, 5), i % 7 - 3, np.int8) for i in range(70)]
    data, shapes = b"".join(m.tobytes() for m in mats), [m.shape for m in mats]
    assert rans_rows.decode(rans_rows.encode(data, shapes), shapes, len(data)) == data


def test_corrupt_rans_by_rows_sections_are_refused_as_corrupt_payloads():
    mats = _matrices_of_unequal_rows()
    data, shapes = b"".join(m.tobytes() for m in mats), [m.shape for m in mats]
    body = rans_rows.encode(data, shapes)
    rng = np.random.default_rng(1)
    bad = [body[:-3], body + b"\0", body[:10], b""]
    for _ in range(40):  # flipped bytes anywhere: refused or (in the words) decoded to other bytes
        at = int(rng.integers(len(body)))
        bad.append(body[:at] + bytes([body[at] ^ int(rng.integers(1, 256))]) + body[at + 1:])
    for data_bad in bad:
        try:
            assert rans_rows.decode(data_bad, shapes, len(data)) != data
        except compressors.CorruptPayload:
            pass
    with pytest.raises(compressors.CorruptPayload):
        rans_rows.decode(body, shapes[:-1], len(data))  # other shapes than coded
    with pytest.raises(compressors.CorruptPayload):
        rans_rows.decode(body, shapes, len(data) - 1)  # more than declared


def test_corrupt_grouped_streams_are_refused_as_corrupt_payloads():
    payload = _payload()
    stream, _ = grouped.compress(payload, ["lzma", "rans"])
    bad = {
        "truncated": stream[:-5],
        "padded": stream + b"\0",
        "flipped": stream[:-40] + bytes([stream[-40] ^ 0xFF]) + stream[-39:],
        "huge map": grouped._HEADER.pack(10, 1 << 62, 0) + stream[grouped._HEADER.size:],
        "no header": stream[:5],
    }
    for name, data in bad.items():
        with pytest.raises(compressors.CorruptPayload):
            grouped.decompress(data, len(payload))
    # a map whose row order repeats a row
    label = b"mlp/codes"
    raw = (struct.pack("<I", 1) + bytes([len(label)]) + label
           + grouped._SECTION.pack(codecs.CODEC_IDS["lzma"], grouped.TRANSFORMS.index("sort"), 4, 0, 1)
           + grouped._RANGE.pack(0, 4, 2, 2, 1) + struct.pack("<HH", 0, 0))
    with pytest.raises(ValueError, match="not a permutation"):
        grouped._parse_map(raw, 100)
    fixed = raw[:-4] + struct.pack("<HH", 1, 0)
    assert grouped._parse_map(fixed, 100)[0][0].ranges[0].order.tolist() == [1, 0]


def test_a_missing_codec_package_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    payload = _payload()
    if codecs.missing_package("brotli") is None:
        stream, _ = grouped.compress(payload, ["brotli"])
        monkeypatch.setattr(codecs, "missing_package", lambda codec: "brotli" if codec == "brotli" else None)
        with pytest.raises(compressors.CorruptPayload, match="needs the brotli package"):
            grouped.decompress(stream, len(payload))
    monkeypatch.setattr(codecs, "missing_package", lambda codec: "zstandard" if codec == "zstd" else None)
    assert "zstd" not in codecs.available()
    with pytest.raises(ConfigError, match=r"pip install 'windowgpt\[compress\]'"):
        compressors.compress(payload, "zstd")
    id_, body = compressors.compress(payload, compressors.AUTO)  # auto leaves it out
    assert all(s["codec"] != "zstd" for s in grouped.describe_sections(body, len(payload)))


def test_the_map_alone_describes_a_grouped_ptz_and_its_prefix():
    payload = _payload()
    data = ptz.compress_payload(payload, compressors.AUTO)
    sections = ptz.sections_of(data)
    assert {s["section"] for s in sections} >= {"mlp/codes", "attn/codes"}
    assert sum(s["raw_bytes"] for s in sections) < len(payload)
    n = struct.unpack_from("<Q", payload)[0] + 8
    assert compressors.payload_prefix(compressors.COMPRESSORS["groups"].id, data[ptz.HEADER_BYTES:], n,
                                      len(payload)) == payload[:n]
