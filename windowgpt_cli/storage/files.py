"""Writing files and directories atomically, and fingerprinting them.

Every artifact goes to a temporary file (or directory) beside its destination and is
renamed into place, so an interrupted stage never leaves a half-written output under the
final name. Every rename goes through `rename`, one primitive that tests can interrupt.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, TypeVar

from ..errors import ArtifactError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def rename(src: Path, dst: Path) -> None:
    """The one rename that publishes an output (atomic on one filesystem)."""
    os.replace(src, dst)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory; give a file name to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # Cleanup on errors and Ctrl-C only: a kill leaves a hidden temporary file, never a partial output.
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; artifacts are ordinary files
        rename(Path(tmp), path)
    except BaseException:  # an error, Ctrl-C or SIGTERM
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def publish_dir(final: Path, build: Callable[[Path], T]) -> T:
    """Build a directory in a temporary sibling, then put it in place of `final`.

    An existing `final` is replaced only once the new one is complete: at any moment
    `final` is the previous complete directory, the new complete one, or (between the
    two renames) absent.
    """
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise ArtifactError(f"{final}: exists and is not a directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        result = build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            rename(final, old / final.name)
        rename(tmp, final)
    except BaseException:  # an error, Ctrl-C or SIGTERM
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    return _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def finite_json(obj: Any) -> Any:
    """obj with every NaN or infinity replaced by None: JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def json_text(obj: Any, indent: int | None = 2) -> str:
    """Strict JSON (non-finite numbers become null)."""
    return json.dumps(finite_json(obj), indent=indent, allow_nan=False)


def read_json_object(path: Path, error: type[Exception] = ArtifactError, hint: str = "") -> dict[str, Any]:
    """A JSON file holding one object; `error` (with the hint appended) when it is not."""
    suffix = f"; {hint}" if hint else ""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise error(f"{path}: not readable JSON{suffix}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: not a JSON object{suffix}")
    return value


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object, or None where there is none to read (optional files, and the checks
    of whether a file is a command's own output)."""
    try:
        return read_json_object(path)
    except ArtifactError:
        return None


def starts_with(path: Path, mark: str) -> bool:
    """Whether a file begins with the text `mark` (a command's own output names itself so);
    only that many bytes are read."""
    data = mark.encode("utf-8")
    try:
        with open(path, "rb") as f:
            return f.read(len(data)) == data
    except OSError:
        return False


def atomic_write_json(path: Path, obj: Any) -> Path:
    return atomic_write_text(path, json_text(obj) + "\n")


def atomic_torch_save(obj: Any, path: Path) -> Path:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getvalue())


def tensors_sha256(tensors: dict[str, torch.Tensor] | None) -> str:
    """A fingerprint of named tensors: names, dtypes, shapes and bytes, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors or {}):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
