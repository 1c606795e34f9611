"""What a `torch.save` file holds, read without torch: its pickle unpickled by an unpickler
that knows only the few names a checkpoint uses (dicts, tensors and their storages), each
tensor read as its shape and dtype, its data left unread. For commands that only describe
a run (`inspect`, `compare`, `report`), which then answer without importing torch; loading
a checkpoint to use it goes through `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import math
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ArtifactError

# torch's storage classes by name, with their dtypes and element sizes
STORAGES = {
    "DoubleStorage": ("float64", 8), "FloatStorage": ("float32", 4), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
}
MAX_PICKLE_BYTES = 1 << 28  # a checkpoint's pickle holds names and numbers; its tensors lie apart


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the file, as its shape and dtype."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.itemsize

    def __getitem__(self, index: int) -> "TensorInfo":  # a slice of a bank: one layer's matrix
        if not self.shape or not 0 <= index < self.shape[0]:
            raise IndexError(index)
        return TensorInfo(self.shape[1:], self.dtype, self.itemsize)


@dataclass(frozen=True)
class _StorageType:
    dtype: str
    itemsize: int


def _rebuild_tensor(storage: _StorageType, offset: int, size: Any, *rest: Any) -> TensorInfo:
    shape = tuple(size)
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise pickle.UnpicklingError("a tensor of an invalid shape")
    return TensorInfo(shape, storage.dtype, storage.itemsize)


class _Describer(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in STORAGES:
            return _StorageType(*STORAGES[name])
        raise pickle.UnpicklingError(f"refuses {module}.{name}")

    def persistent_load(self, pid: Any) -> _StorageType:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError("an unknown persistent reference")
        return pid[1]


def describe_torch_file(path: Path) -> Any:
    """The object a torch.save file holds, its tensors as `TensorInfo`; ArtifactError if it
    is not such a file or holds anything else."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(names) != 1:
                raise ArtifactError(f"{path}: not a torch checkpoint (no data.pkl)")
            info = archive.getinfo(names[0])
            if info.file_size > MAX_PICKLE_BYTES:
                raise ArtifactError(f"{path}: its pickle is larger than any checkpoint's")
            with archive.open(info) as f:
                return _Describer(f).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
            AttributeError, IndexError) as exc:
        raise ArtifactError(f"{path}: not a readable windowgpt checkpoint ({type(exc).__name__})") from None
