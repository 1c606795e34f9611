"""The `.ptz` artifact: a quantized model in a format that cannot run code.

Layout: the magic bytes `WGPTZ`, one byte of format version, one byte naming the
compressor, the payload's size (8 bytes, little-endian) and sha256 (32 bytes), then the
compressed payload. Decompression stops at the declared size, so a small file cannot
inflate beyond it, and the payload must match its hash. The payload is a safetensors file (see
`tensorfile`) holding the int8 codes, scales and kept tensors, whose metadata holds one
JSON document: the format version, the run configuration, how each tensor was quantized
(scheme, original dtype, shape), the tokenizer's sha256 and where the weights came from.

Compressors (`compressors`): the reference's `lzma`, `rans`, `brotli`, `zstd`, and `auto`,
which codes each tensor group apart with the codec and byte layout that make it smallest
(`grouped`; the header names it `groups`). `python3 bench/compressors.py MODEL.ptz` measures
them on a model's payload.

The reference wrote an lzma-compressed pickle; loading one can execute arbitrary code, so
windowgpt never unpickles an artifact, and anything that is not a `.ptz` of this version
is refused with one line.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import RunConfig
from ..errors import ArtifactError, ConfigError
from ..record.codesize import is_packed_code
from ..storage import tensorfile
from ..storage.files import atomic_write_bytes, is_sha256
from . import compressors, grouped
from .quantized import (
    CONTROL,
    PASSTHROUGH,
    SCHEMES,
    LowRank,
    LowRankFactor,
    QuantizedTensor,
    code_limit,
    dequantize_state_dict,
)
from .shapes import check_tensors

if TYPE_CHECKING:  # describing a .ptz needs no torch (`inspect`); decoding it does
    from torch import Tensor

MAGIC = b"WGPTZ"
FORMAT_VERSION = 2  # 2: the payload's size and sha256 in the header
_SIZE_AND_HASH = struct.Struct("<Q32s")
HEADER_BYTES = len(MAGIC) + 2 + _SIZE_AND_HASH.size
METADATA_KEY = "windowgpt.ptz"
# Artifacts are meant to fit in 16 MB compressed; no payload of a sensible model nears this.
MAX_PAYLOAD_BYTES = 1 << 30
# Reading holds the payload, its decoded tensors and the decoder's working arrays at once.
READ_MEMORY_FACTOR = 3
DTYPES = set(tensorfile.DTYPE_NAMES.values())  # torch's names of the dtypes a tensor may have had


@dataclass
class PtzArtifact:
    config: RunConfig
    tensors: dict[str, QuantizedTensor]  # per-layer names (model.unbank_state_dict)
    tokenizer_sha256: str | None = None
    source: dict[str, Any] = field(default_factory=dict)  # where the weights came from
    clip_range: int = 31
    errors: dict[str, float] = field(default_factory=dict)  # per tensor: quantization's relative squared error

    def dequantized(self) -> dict[str, Tensor]:
        return dequantize_state_dict(self.tensors)


# --- Writing -----------------------------------------------------------------------------

LOW_RANK_PARTS = ("a", "b")
LOW_RANK_KEYS = ("q", "scale", "offset")


def low_rank_keys(name: str) -> list[str]:
    """The stored tensors of a matrix's LQER correction."""
    return [f"{name}.lqer_{part}.{key}" for part in LOW_RANK_PARTS for key in LOW_RANK_KEYS]


def payload_tensors(tensors: dict[str, QuantizedTensor]) -> dict[str, Tensor]:
    """The stored tensors: `name.q` (codes) and `name.scale` for quantized ones, `name` for
    kept ones, and `name.lqer_{a,b}.{q,scale,offset}` for corrections; all codes first, then
    kept tensors, then scales, then corrections, so that like bytes are contiguous for the
    compressor."""
    codes = {name + ".q": qt.values for name, qt in tensors.items() if qt.scale is not None}
    kept = {name: qt.values for name, qt in tensors.items() if qt.scale is None}
    scales = {name + ".scale": qt.scale for name, qt in tensors.items() if qt.scale is not None}
    corrections = {}
    for name, qt in tensors.items():
        if qt.correction is not None:
            factors = (qt.correction.a, qt.correction.b)
            values = [t for f in factors for t in (f.codes, f.scale, f.offset)]
            corrections.update(zip(low_rank_keys(name), values))
    return {**codes, **kept, **scales, **corrections}


def payload_bytes(artifact: PtzArtifact) -> bytes:
    """The uncompressed payload: a safetensors file."""
    meta = {
        "format_version": FORMAT_VERSION,
        "config": artifact.config.to_dict(),
        "clip_range": artifact.clip_range,
        "tensors": {name: _tensor_meta(qt, artifact.errors.get(name)) for name, qt in artifact.tensors.items()},
        "tokenizer_sha256": artifact.tokenizer_sha256,
        "source": artifact.source,
    }
    text = json.dumps(meta, separators=(",", ":"))
    return tensorfile.dumps(payload_tensors(artifact.tensors), {METADATA_KEY: text})


def _tensor_meta(qt: QuantizedTensor, error: float | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"scheme": qt.scheme, "dtype": str(qt.dtype).removeprefix("torch."), "shape": list(qt.shape)}
    if qt.method:
        meta["method"] = qt.method
    if qt.correction is not None:
        meta["lqer"] = {"rank": qt.correction.rank, "bits": qt.correction.bits, "group_size": qt.correction.group_size}
    if error is not None:
        meta["error"] = float(f"{error:.4g}")
    return meta


def encode(artifact: PtzArtifact, compressor: str = compressors.DEFAULT_COMPRESSOR) -> bytes:
    return compress_payload(payload_bytes(artifact), compressor)


def compress_payload(payload: bytes, compressor: str = compressors.DEFAULT_COMPRESSOR) -> bytes:
    """The .ptz bytes; its header names the compressor used (`compressor_of`), which for
    "auto" is `groups`."""
    compressor_id, body = compressors.compress(payload, compressor)
    digest = hashlib.sha256(payload).digest()
    return MAGIC + bytes([FORMAT_VERSION, compressor_id]) + _SIZE_AND_HASH.pack(len(payload), digest) + body


def sections_of(data: bytes) -> list[dict[str, Any]]:
    """A `groups`-coded .ptz's sections (codec, transform, sizes), from its map alone; []
    for the whole-payload compressors."""
    _check_header(data, ".ptz")
    if data[len(MAGIC) + 1] != compressors.COMPRESSORS[compressors.GROUPS].id:
        return []
    size = _SIZE_AND_HASH.unpack_from(data, len(MAGIC) + 2)[0]
    try:
        return grouped.describe_sections(data[HEADER_BYTES:], size)
    except compressors.CorruptPayload as exc:
        raise ArtifactError(f".ptz: {exc}") from None


def compressor_of(data: bytes) -> str:
    """The name of the compressor a .ptz's header names ("id N" for an unknown id)."""
    return compressors.name_of(data[len(MAGIC) + 1])


def save(path: Path, artifact: PtzArtifact, compressor: str = compressors.DEFAULT_COMPRESSOR) -> int:
    """Write the artifact atomically; returns its size in bytes."""
    data = encode(artifact, compressor)
    atomic_write_bytes(path, data)
    return len(data)


# --- Describing without decoding -----------------------------------------------------------

@dataclass
class TensorDescription:
    scheme: str
    dtype: str  # torch's name
    shape: tuple[int, ...]
    method: str
    stored_bytes: int  # codes and scales (and corrections), or the kept values
    error: float | None = None  # quantization's relative squared error, where recorded
    lqer_rank: int = 0


@dataclass
class PtzDescription:
    """What a .ptz holds, read from its header and its payload's header alone (`inspect`):
    the payload is neither decoded whole nor checked against its hash."""

    version: int
    compressor: str
    payload_bytes: int
    config: RunConfig
    tensors: dict[str, TensorDescription]
    tokenizer_sha256: str | None
    source: dict[str, Any]
    clip_range: int


def describe(path: Path) -> PtzDescription:
    path = Path(path)
    data = _read_file(path)
    _check_header(data, str(path))
    compressor_id, size = data[len(MAGIC) + 1], _SIZE_AND_HASH.unpack_from(data, len(MAGIC) + 2)[0]
    body = data[HEADER_BYTES:]
    try:
        head = compressors.payload_prefix(compressor_id, body, 8, size)
        prefix = None if head is None else compressors.payload_prefix(
            compressor_id, body, tensorfile.header_length(head, f"{path} (payload)"), size)
    except compressors.CorruptPayload as exc:
        raise ArtifactError(f"{path}: {exc}") from None
    if prefix is None:  # a compressor that keeps no prefix apart: decode it all
        prefix = decompress_payload(data, str(path))
    entries, metadata = tensorfile.read_header(prefix, f"{path} (payload)")
    meta = _parse_metadata(metadata, str(path))
    config = _config(meta, str(path))
    stored = {name: end - begin for name, (_, _, (begin, end)) in entries.items()}
    tensors = {}
    for name, info in meta["tensors"].items():
        where = f"{path}: tensor {name!r}"
        scheme, dtype, shape, method = _description(info, where)
        keys = _stored_keys(name, scheme, info, where)
        if not all(k in stored for k in keys):
            raise ArtifactError(f"{where}: payload lacks {next(k for k in keys if k not in stored)!r}")
        error = info.get("error") if isinstance(info.get("error"), (int, float)) else None
        rank = _lqer_description(info, where)[0] if "lqer" in info else 0
        tensors[name] = TensorDescription(scheme, dtype, shape, method, sum(stored[k] for k in keys), error, rank)
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    return PtzDescription(data[len(MAGIC)], compressors.name_of(compressor_id), size, config, tensors,
                          meta.get("tokenizer_sha256"), source, meta.get("clip_range"))


# --- Reading -----------------------------------------------------------------------------

def load(path: Path) -> PtzArtifact:
    path = Path(path)
    return decode(_read_file(path), str(path))


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a directory, not a .ptz file") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _config(meta: dict[str, Any], source: str) -> RunConfig:
    try:
        return RunConfig.from_dict(meta["config"], source=f"{source} config")
    except ConfigError as exc:
        raise ArtifactError(str(exc)) from None


def check_model_tensors(artifact: PtzArtifact, source: str) -> None:
    """The artifact's tensors are exactly those its configuration's model holds."""
    check_tensors(artifact.config.model, {name: (qt.shape, qt.dtype) for name, qt in artifact.tensors.items()},
                  source, per_layer=True)


def decode(data: bytes, source: str = ".ptz") -> PtzArtifact:
    payload = decompress_payload(data, source)
    stored, metadata = tensorfile.loads(payload, source=f"{source} (payload)")
    meta = _parse_metadata(metadata, source)
    config = _config(meta, source)
    clip_range = meta.get("clip_range")
    if not isinstance(clip_range, int) or not 1 <= clip_range <= 127:
        raise ArtifactError(f"{source}: invalid clip_range {clip_range!r}")
    tensors = _rebuild_tensors(meta["tensors"], stored, clip_range, source)
    tokenizer = meta.get("tokenizer_sha256")
    if not is_sha256(tokenizer):
        raise ArtifactError(f"{source}: records no tokenizer sha256")
    source_info = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    errors = {name: float(info["error"]) for name, info in meta["tensors"].items()
              if isinstance(info.get("error"), (int, float))}
    return PtzArtifact(config, tensors, tokenizer, source_info, clip_range, errors)


def decompress_payload(data: bytes, source: str) -> bytes:
    _check_header(data, source)
    compressor_id = data[len(MAGIC) + 1]
    size, digest = _SIZE_AND_HASH.unpack_from(data, len(MAGIC) + 2)
    import torch

    from ..runtime import memory_bytes

    need, have = READ_MEMORY_FACTOR * size, memory_bytes(torch.device("cpu"))
    if have is not None and need > have:
        raise ArtifactError(f"{source}: declares a payload of {size:,} bytes; reading it needs about "
                            f"{need / 2**30:.1f} GiB of memory, more than the {have / 2**30:.1f} GiB available")
    try:
        payload = compressors.decompress(compressor_id, data[HEADER_BYTES:], size)
    except compressors.CorruptPayload as exc:
        raise ArtifactError(f"{source}: {exc}") from None
    if len(payload) != size:
        raise ArtifactError(f"{source}: the payload is {len(payload):,} bytes, the header declares {size:,}")
    if hashlib.sha256(payload).digest() != digest:
        raise ArtifactError(f"{source}: the payload does not match the sha256 in its header (corrupt or altered)")
    return payload


def _check_header(data: bytes, source: str) -> None:
    """The .ptz header: magic, version, a known compressor and a payload of sensible size."""
    if data[:len(MAGIC)] != MAGIC:
        raise ArtifactError(f"{source}: not a windowgpt .ptz file{_foreign_format_hint(data)}")
    if len(data) < HEADER_BYTES:
        raise ArtifactError(f"{source}: truncated .ptz header ({len(data)} bytes)")
    version, compressor_id = data[len(MAGIC)], data[len(MAGIC) + 1]
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{source}: .ptz format version {version} is not supported (this windowgpt reads "
                            f"version {FORMAT_VERSION}); quantize the model again")
    if not compressors.is_known(compressor_id):
        raise ArtifactError(f"{source}: unknown compressor id {compressor_id}")
    (size, _) = _SIZE_AND_HASH.unpack_from(data, len(MAGIC) + 2)
    if size > MAX_PAYLOAD_BYTES:
        raise ArtifactError(f"{source}: declares a payload of {size:,} bytes, more than the {MAX_PAYLOAD_BYTES:,} "
                            "any artifact needs")


def _foreign_format_hint(data: bytes) -> str:
    if is_packed_code(data):
        return " (it is packed code, the archive `windowgpt pack` writes: the model is the .ptz quantize wrote)"
    if data[:6] == b"\xfd7zXZ\x00" or data[:1] == b"\x80" or data[:2] == b"PK":
        return (" (it looks like a pickle, compressed or in a torch.save zip, as the reference writes; "
                "windowgpt never unpickles, since that can run code)")
    return ""


def _parse_metadata(metadata: dict[str, str], source: str) -> dict[str, Any]:
    if METADATA_KEY not in metadata:
        raise ArtifactError(f"{source}: payload has no {METADATA_KEY} metadata")
    try:
        meta = json.loads(metadata[METADATA_KEY])
    except ValueError:
        raise ArtifactError(f"{source}: {METADATA_KEY} metadata is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ArtifactError(f"{source}: payload format version {version!r} is not supported "
                            f"(expected {FORMAT_VERSION})")
    if not isinstance(meta.get("config"), dict) or not isinstance(meta.get("tensors"), dict):
        raise ArtifactError(f"{source}: metadata lacks the config or the tensor list")
    return meta


def _rebuild_tensors(described: dict[str, Any], stored: dict[str, Tensor], clip_range: int,
                     source: str) -> dict[str, QuantizedTensor]:
    tensors: dict[str, QuantizedTensor] = {}
    used: set[str] = set()
    for name, info in described.items():
        where = f"{source}: tensor {name!r}"
        qt = _rebuild_one(name, info, stored, clip_range, where)
        tensors[name] = qt
        used.update(_stored_keys(name, qt.scheme, info, where))
    extra = sorted(set(stored) - used)
    if extra:
        raise ArtifactError(f"{source}: payload holds tensors the metadata does not describe ({extra[0]}, ...)")
    return tensors


def _description(info: Any, where: str) -> tuple[str, str, tuple[int, ...], str]:
    """A tensor's (scheme, dtype, shape, method) as the metadata describes it, each checked
    for type and bounds before anything is allocated."""
    shape = info.get("shape") if isinstance(info, dict) else None
    if (not isinstance(info, dict) or not isinstance(info.get("scheme"), str) or info["scheme"] not in SCHEMES
            or not isinstance(info.get("dtype"), str) or info["dtype"] not in DTYPES
            or not isinstance(info.get("method", ""), str) or not tensorfile.valid_shape(shape)):
        raise ArtifactError(f"{where} has an invalid description {str(info)[:200]}")
    return info["scheme"], info["dtype"], tuple(shape), info.get("method", "")


def _rebuild_one(name: str, info: Any, stored: dict[str, Tensor], clip_range: int, where: str) -> QuantizedTensor:
    import torch

    scheme, dtype_name, shape, method = _description(info, where)
    dtype = getattr(torch, dtype_name)
    if scheme in (PASSTHROUGH, CONTROL):
        values = _stored(stored, name, where)
        expected = {CONTROL: {torch.float32}, PASSTHROUGH: {torch.float16} if dtype.is_floating_point else {dtype}}
        if values.dtype not in expected[scheme] or tuple(values.shape) != shape:
            raise ArtifactError(f"{where} is stored as {values.dtype} {tuple(values.shape)}, "
                                f"which does not match {scheme} {shape}")
        return QuantizedTensor(scheme, dtype, values, None, method)
    codes, scale = _stored(stored, name + ".q", where), _stored(stored, name + ".scale", where)
    limit = code_limit(scheme, clip_range)
    scale_shape = (shape[0],) if len(shape) == 2 else ()
    if codes.dtype != torch.int8 or tuple(codes.shape) != shape or tuple(scale.shape) != scale_shape \
            or not scale.dtype.is_floating_point:
        raise ArtifactError(f"{where}: stored codes or scales do not match its {scheme} description")
    if codes.numel() and int(codes.to(torch.int16).abs().max()) > limit:
        raise ArtifactError(f"{where}: codes exceed the {scheme} range of +-{limit}")
    correction = _rebuild_correction(name, info, shape, stored, where) if "lqer" in info else None
    return QuantizedTensor(scheme, dtype, codes, scale, method, correction)


def _stored_keys(name: str, scheme: str, info: dict[str, Any], where: str) -> list[str]:
    """The payload tensors that hold one described tensor."""
    if scheme in (PASSTHROUGH, CONTROL):
        return [name]
    keys = [name + ".q", name + ".scale"]
    if "lqer" in info:
        _lqer_description(info, where)
        keys += low_rank_keys(name)
    return keys


LQER_BOUNDS = {"rank": (1, 256), "bits": (2, 8), "group_size": (1, 1 << 16)}


def _lqer_description(info: dict[str, Any], where: str) -> tuple[int, int, int]:
    lqer = info.get("lqer")
    if not isinstance(lqer, dict) or not all(isinstance(lqer.get(k), int) and not isinstance(lqer.get(k), bool)
                                             and lo <= lqer[k] <= hi for k, (lo, hi) in LQER_BOUNDS.items()):
        raise ArtifactError(f"{where} has an invalid LQER description {str(lqer)[:200]}")
    if len(info.get("shape", ())) != 2:
        raise ArtifactError(f"{where}: an LQER correction needs a matrix")
    return lqer["rank"], lqer["bits"], lqer["group_size"]


def _rebuild_correction(name: str, info: dict[str, Any], shape: tuple[int, ...], stored: dict[str, Tensor],
                        where: str) -> LowRank:
    import torch

    rank, bits, group = _lqer_description(info, where)
    factor_shapes = ((shape[0], rank), (rank, shape[1]))
    factors = []
    keys = iter(low_rank_keys(name))
    for factor_shape in factor_shapes:
        codes, scale, offset = (_stored(stored, next(keys), where) for _ in LOW_RANK_KEYS)
        groups = -(-factor_shape[0] * factor_shape[1] // group)
        if codes.dtype != torch.uint8 or tuple(codes.shape) != factor_shape or any(
                t.dtype != torch.float16 or tuple(t.shape) != (groups,) for t in (scale, offset)):
            raise ArtifactError(f"{where}: its stored LQER factors do not match rank {rank}, groups of {group}")
        if codes.numel() and int(codes.max()) >= 1 << bits:
            raise ArtifactError(f"{where}: LQER codes exceed {bits} bits")
        factors.append(LowRankFactor(codes, scale, offset))
    return LowRank(factors[0], factors[1], bits, group)


def _stored(stored: dict[str, Tensor], key: str, where: str) -> Tensor:
    if key not in stored:
        raise ArtifactError(f"{where}: payload lacks {key!r}")
    return stored[key]


def is_ptz(path: Path) -> bool:
    """Whether a file is a .ptz (quantize may replace it), by its magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False
