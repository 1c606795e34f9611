"""A file of torch.compile's caches (Inductor's graphs and kernels, AOTAutograd's graphs,
autotuning choices), so that a process on a fresh machine starts with what another one
compiled: `train --compile-cache FILE` loads it before the warm-up and writes it after.

The file is MAGIC, one JSON line that describes it (the torch, Triton and device it was made
with, a digest of its artifacts' keys, the payload's bytes and sha256), then the bytes of
`torch.compiler.save_cache_artifacts()`. Torch keys each cached graph by its code, shapes
and settings, so a file of another model or settings only misses; one made with another
torch, Triton or device is not loaded at all (its kernels would not be this machine's).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, WindowGPTError
from .files import atomic_write_bytes, sha256_bytes, starts_with
from .outputs import claim_file

MAGIC = "windowgpt compile cache\n"
KIND = "a compile cache"
FLAG = "--compile-cache"


def is_compile_cache(path: Path) -> bool:
    return Path(path).is_file() and starts_with(path, MAGIC)


def claim_compile_cache(path: Path) -> Path:
    """The path, when it names nothing yet or a compile cache (refused: a user's file, a folder)."""
    return claim_file(path, KIND, is_compile_cache, flag=FLAG)


def machine() -> dict[str, Any]:
    """What a compiled kernel depends on beyond the graph: torch, Triton and the device."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = {"type": "cpu"}
    if torch.cuda.is_available():
        device = {"type": "cuda", "name": torch.cuda.get_device_name(),
                  "capability": list(torch.cuda.get_device_capability())}
    return {"torch": torch.__version__, "triton": triton_version, "device": device}


@dataclass
class CompileCache:
    header: dict[str, Any]
    payload: bytes


def read_compile_cache(path: Path) -> CompileCache:
    """The file's header and payload, checked against each other (ArtifactError otherwise)."""
    data = Path(path).read_bytes()
    magic = MAGIC.encode()
    end = data.find(b"\n", len(magic))
    if not data.startswith(magic) or end < 0:
        raise ArtifactError(f"{path}: not {KIND} windowgpt wrote")
    try:
        header = json.loads(data[len(magic):end])
    except ValueError:
        header = None
    payload = data[end + 1:]
    if not isinstance(header, dict) or header.get("bytes") != len(payload) \
            or header.get("sha256") != sha256_bytes(payload):
        raise ArtifactError(f"{path}: {KIND} whose payload does not match its header (damaged)")
    return CompileCache(header, payload)


def load_compile_cache(path: Path) -> str:
    """Put the file's caches where torch.compile looks first; the log line that says what
    was loaded, or why nothing was."""
    import torch

    path = Path(path)
    if not path.exists():
        return f"compile_cache: {path} does not exist yet; it will hold what this run compiles"
    try:
        cache = read_compile_cache(path)
    except (ArtifactError, OSError) as error:
        return f"compile_cache: {error}; compiling anew, and replacing it"
    here, made = machine(), cache.header.get("machine")
    if made != here:
        return (f"compile_cache: {path} was made with {_describe(made)}, not this {_describe(here)}; "
                "compiling anew, and replacing it")
    try:
        info = torch.compiler.load_cache_artifacts(cache.payload)
    except Exception as error:  # a cache only spares time: it never ends a run
        return f"compile_cache: {path} could not be loaded ({type(error).__name__}: {error}); compiling anew"
    count = _artifact_count(info) if info is not None else 0
    return f"compile_cache: loaded {count} cached artifacts ({len(cache.payload):,} bytes) from {path}"


def save_compile_cache(path: Path) -> str:
    """Write what this process compiled or loaded (atomically, over a compile cache only,
    and not where the file already holds it); the log line that says so, or why it was not
    written (the run goes on either way)."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return f"compile_cache: nothing was compiled (the model runs eagerly here); {path} left as it was"
    payload, info = saved
    count, keys = _artifact_count(info), _artifact_keys(info)
    if _held(path) == (machine(), keys):  # what it loaded: nothing new to write
        return f"compile_cache: {path} already holds these {count} artifacts; left as it was"
    header = {"machine": machine(), "artifacts": count, "keys": keys, "bytes": len(payload),
              "sha256": sha256_bytes(payload), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        claim_compile_cache(path)
        atomic_write_bytes(path, MAGIC.encode() + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
    except (OSError, WindowGPTError) as error:  # the run goes on without it
        return f"compile_cache: not written ({error})"
    return f"compile_cache: wrote {count} artifacts ({len(payload):,} bytes) to {path}"


def _held(path: Path) -> tuple[Any, Any] | None:
    """The machine and artifact keys' digest of the compile cache at path, or None where there is none."""
    try:
        header = read_compile_cache(path).header
    except (ArtifactError, OSError):
        return None
    return header.get("machine"), header.get("keys")


def _artifact_count(info: Any) -> int:
    """The artifacts in torch's CacheInfo, of every kind."""
    return sum(len(keys) for keys in info.artifacts.values())


def _artifact_keys(info: Any) -> str:
    """A digest of the artifacts' kinds and keys in torch's CacheInfo: what a file holds
    (its bytes differ from one save of the same artifacts to the next)."""
    names = sorted(f"{kind}:{key}" for kind, keys in info.artifacts.items() for key in keys)
    return sha256_bytes("\n".join(names).encode())


def _describe(made: Any) -> str:
    if not isinstance(made, dict):
        return "an unknown machine"
    device = made.get("device") or {}
    name = device.get("name") or device.get("type", "?")
    return f"torch {made.get('torch')}, Triton {made.get('triton')} on {name}"
