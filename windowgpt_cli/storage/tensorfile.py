"""A small reader and writer of the safetensors file format, for torch tensors.

Layout: an 8-byte little-endian header length N, N bytes of JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`
(padded with spaces to a multiple of 8 bytes), then the tensors' raw little-endian bytes,
offsets counted from the end of the header. Reading checks every offset and size and never
unpickles anything, so a file from an untrusted source cannot run code.
"""
from __future__ import annotations

import functools
import json
import math
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ArtifactError
from .files import atomic_write_bytes

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# The format's dtype codes: torch's dtype names and their sizes. Headers are read with these
# alone (commands that only describe a file import no torch); tensors need torch.
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@functools.cache
def code_dtypes() -> dict[str, "torch.dtype"]:
    import torch

    return {code: getattr(torch, name) for code, name in DTYPE_NAMES.items()}


@functools.cache
def dtype_codes() -> dict["torch.dtype", str]:
    return {dtype: code for code, dtype in code_dtypes().items()}
METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000  # as the reference implementation: refuse absurd headers early
_LENGTH = struct.Struct("<Q")

if sys.byteorder != "little":  # tensors are written as the host lays them out
    raise ImportError("windowgpt's tensor files need a little-endian host")


def tensor_bytes(t: Tensor) -> bytes:
    """The raw bytes of a tensor in row-major order."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def dumps(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize tensors (in the given order) and string metadata to safetensors bytes."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("tensor file metadata must map strings to strings")
        header[METADATA_KEY] = dict(metadata)
    chunks: list[bytes] = []
    offset = 0
    for name, t in tensors.items():
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY} is reserved and cannot name a tensor")
        if t.dtype not in dtype_codes():
            raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in a tensor file")
        data = tensor_bytes(t)
        header[name] = {"dtype": dtype_codes()[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # keeps the data 8-byte aligned
    return _LENGTH.pack(len(text)) + text + b"".join(chunks)


def loads(data: bytes | bytearray | memoryview,
          source: str = "tensor file") -> tuple[dict[str, Tensor], dict[str, str]]:
    """Parse safetensors bytes into (tensors in file order, metadata); ArtifactError if malformed."""
    import numpy as np
    import torch

    view = memoryview(data)
    entries, metadata, data_start = layout(view, source)
    tensors: dict[str, Tensor] = {}
    for name, (code, shape, (begin, end)) in entries.items():
        dtype = code_dtypes()[code]
        if begin == end:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = np.frombuffer(view, dtype=np.uint8, count=end - begin, offset=data_start + begin).copy()
        if dtype == torch.bool and raw.size and raw.max() > 1:
            raise ArtifactError(f"{source}: tensor {name!r} holds bool values other than 0 and 1")
        tensors[name] = torch.from_numpy(raw).view(dtype).reshape(shape)
    return tensors, metadata


def save(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> Path:
    return atomic_write_bytes(path, dumps(tensors, metadata))


def load(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read tensor file ({exc.strerror or exc})") from None
    return loads(data, source=str(path))


Entry = tuple[str, tuple[int, ...], tuple[int, int]]  # dtype code, shape, offsets from data_start


def read_file_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """A file's entries and metadata, read from its header alone."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(_LENGTH.size)
            prefix += f.read(header_length(prefix, str(path)) - len(prefix))
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read tensor file ({exc.strerror or exc})") from None
    return read_header(prefix, str(path))


def header_length(prefix: bytes, source: str = "tensor file") -> int:
    """The length of a file's header (its first 8 bytes give it), checked for sense."""
    if len(prefix) < _LENGTH.size:
        raise ArtifactError(f"{source}: too short to be a tensor file ({len(prefix)} bytes)")
    (length,) = _LENGTH.unpack_from(prefix, 0)
    if length > MAX_HEADER_BYTES:
        raise ArtifactError(f"{source}: header length {length} is more than any tensor file's")
    return _LENGTH.size + length


def read_header(prefix: bytes, source: str = "tensor file") -> tuple[dict[str, Entry], dict[str, str]]:
    """The entries and metadata of a file's header, from its first header_length() bytes
    (the data itself unread, so its layout unchecked)."""
    entries, metadata, _ = _parse_header(memoryview(prefix), source)
    return entries, metadata


def layout(data: bytes | bytearray | memoryview,
           source: str = "tensor file") -> tuple[dict[str, Entry], dict[str, str], int]:
    """Check a file's header and layout: (entries in file order, metadata, start of the data)."""
    view = memoryview(data)
    entries, metadata, data_start = _parse_header(view, source)
    _check_layout(entries, len(view) - data_start, source)
    return entries, metadata, data_start


def _parse_header(view: memoryview, source: str) -> tuple[dict[str, Entry], dict[str, str], int]:
    if len(view) < _LENGTH.size:
        raise ArtifactError(f"{source}: too short to be a tensor file ({len(view)} bytes)")
    (header_len,) = _LENGTH.unpack_from(view, 0)
    if header_len > MAX_HEADER_BYTES or _LENGTH.size + header_len > len(view):
        raise ArtifactError(f"{source}: header length {header_len} does not fit a file of {len(view)} bytes")
    try:
        text = bytes(view[_LENGTH.size:_LENGTH.size + header_len]).decode("utf-8")
        raw = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{source}: tensor file header is not valid JSON ({_first_line(exc)})") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"{source}: tensor file header is not a JSON object")
    metadata = raw.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ArtifactError(f"{source}: {METADATA_KEY} must map strings to strings")
    entries = {name: _parse_entry(name, info, source) for name, info in raw.items()}
    return entries, metadata, _LENGTH.size + header_len


def _parse_entry(name: str, info: Any, source: str) -> Entry:
    where = f"{source}: tensor {name!r}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise ArtifactError(f"{where} needs exactly dtype, shape and data_offsets")
    code = info["dtype"] if isinstance(info["dtype"], str) and info["dtype"] in ITEM_SIZES else None
    if code is None:
        raise ArtifactError(f"{where} has unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not valid_shape(shape):
        raise ArtifactError(f"{where} has an invalid shape {str(shape)[:100]}")
    if not _is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise ArtifactError(f"{where} has invalid data_offsets {offsets!r}")
    expected = math.prod(shape) * ITEM_SIZES[code]
    if offsets[1] - offsets[0] != expected:
        raise ArtifactError(f"{where}: {offsets[1] - offsets[0]} bytes do not match shape {shape} of {info['dtype']}")
    return code, tuple(shape), (offsets[0], offsets[1])


def _check_layout(entries: Mapping[str, Entry], payload_size: int, source: str) -> None:
    """The tensors must tile the data section exactly: no gap, no overlap, nothing after."""
    cursor = 0
    for name, (_, _, (begin, end)) in sorted(entries.items(), key=lambda item: item[1][2]):
        if begin != cursor:
            raise ArtifactError(f"{source}: tensor {name!r} starts at byte {begin}, expected {cursor} (gap or overlap)")
        cursor = end
    if cursor != payload_size:
        raise ArtifactError(f"{source}: the header describes {cursor} data bytes but the file holds {payload_size} "
                            "(truncated or padded)")


MAX_DIMS, MAX_DIM = 8, 1 << 40  # no tensor of a sensible model comes near these


def valid_shape(shape: Any) -> bool:
    """A list of at most MAX_DIMS integers in 0..MAX_DIM (checked before any allocation)."""
    return _is_int_list(shape) and len(shape) <= MAX_DIMS and all(0 <= d <= MAX_DIM for d in shape)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key in header")
    return dict(pairs)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
