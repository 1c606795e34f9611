"""Device choice, mixed precision and seeding, shared by every stage."""
from __future__ import annotations

import contextlib
import importlib.util
import random
import resource
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from .errors import ConfigError


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA device is available")
    if name not in {"cpu", "cuda"}:
        raise ConfigError(f"device {name!r} must be auto, cpu or cuda")
    return torch.device(name)


def use_cpu_threads(threads: int, device: torch.device) -> None:
    """Run torch's CPU work on `threads` threads (0: leave torch's choice) where the model
    runs on the CPU. Set once per process: torch keeps its thread pool."""
    if device.type == "cpu" and threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matrix products on x's device run in: autocast's where it is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def autocast(device: torch.device, cache: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA as the reference; full float32 on the CPU. cache=False: without
    autocast's cache of cast weights, which a CUDA graph's replays would read stale."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def enable_fast_math(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


# Inductor settings for graphs that run over one pass of data (evaluation). By default each
# element-wise kernel is built in two variants and both are benchmarked on the GPU at the
# first call; for a pass of a few hundred batches that costs more than it saves.
ONE_PASS_OPTIONS = {"triton.autotune_pointwise": False}
# Inductor settings per TrainConfig.compile_tuning: with max_autotune_gemm each matrix
# product's shape is benchmarked as cuBLAS and as Triton templates, and a chosen template
# takes the element-wise work that follows it as its epilogue.
TUNING_OPTIONS: dict[str, dict | None] = {
    "default": None,
    "gemm": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"},
    "full": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON",
             "coordinate_descent_tuning": True},
}

# Inductor fuses a reduction along each row (a norm's backward) with sums along the columns of
# the same rows (per-channel gradients) into one "mix-order" kernel, each program walking its
# rows one at a time. Where many tensors meet (the parallel lanes' backward), torch 2.11 makes
# one such kernel with some thirty loads, where later Inductors stop at ten because its
# registers spill (pytorch/pytorch#179423); off, the column sums get kernels of their own.
MIX_ORDER_OFF = {"triton.mix_order_reduction": False}
# Inductor holds a row whole in registers (one read of it) only up to 1,024 columns; a longer
# row's reduction loops over it, and a kernel that needs the row's result before it writes
# (a row's scale for float8) reads the row twice. With multi-kernels each row reduction of up
# to 16,384 columns is built both ways and the faster one kept at its first call.
MULTI_KERNEL_ON = {"triton.multi_kernel": 1}


class _Compiled:
    """fn compiled into one static graph, as the reference compiles its model. Should this
    torch build find a graph break, it says so once and compiles the pieces instead."""

    def __init__(self, fn, options: dict | None):
        self.fn, self.options = fn, options
        self.run = torch.compile(fn, dynamic=False, fullgraph=True, options=options)
        self.checked = False

    def __call__(self, *args, **kwargs):
        if self.checked:
            return self.run(*args, **kwargs)
        try:
            out = self.run(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            print(f"warning: torch.compile found a graph break ({type(exc).__name__}); compiling in pieces",
                  file=sys.stderr)
            self.run = torch.compile(self.fn, dynamic=False, options=self.options)
            out = self.run(*args, **kwargs)
        self.checked = True
        return out


def compiled(fn, enabled: bool = True, *, autotune: bool = True, tuning: str = "default", mix_order: bool = True,
             multi_kernel: bool = False):
    """torch.compile with static shapes (one graph per shape) when enabled, else fn.
    autotune=False suits a graph that runs over the data once (see ONE_PASS_OPTIONS);
    tuning names TUNING_OPTIONS' settings, for graphs that run many times; mix_order=False
    keeps Inductor from fusing a reduction along rows with one along columns (MIX_ORDER_OFF);
    multi_kernel=True builds long rows' reductions both ways and keeps the faster (MULTI_KERNEL_ON)."""
    if not enabled:
        return fn
    options = dict((TUNING_OPTIONS[tuning] if autotune else ONE_PASS_OPTIONS) or {})
    for wanted, settings in ((not mix_order, MIX_ORDER_OFF), (multi_kernel, MULTI_KERNEL_ON)):
        if wanted:  # an Inductor without such a setting has no such kernels: nothing to set
            options.update({key: value for key, value in settings.items() if inductor_has(key)})
    return _Compiled(fn, options or None)


def inductor_has(key: str) -> bool:
    """Whether this torch's Inductor has the setting `key` ("section.name" or "name"), which
    torch.compile's options may then set."""
    import torch._inductor.config as inductor

    *sections, name = key.split(".")
    for section in sections:
        inductor = getattr(inductor, section, None)
    return inductor is not None and hasattr(inductor, name)


def triton_available(device: torch.device) -> bool:
    """Whether Triton kernels can run here: CUDA with Triton."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def has_tma(device: torch.device) -> bool:
    """Whether a CUDA device has the tensor memory accelerator that the persistent product
    kernels load through: compute capability 9.0 (Hopper) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def imports_cleanly(load: Callable[[], object]) -> bool:
    """Whether load() (importing a kernel package's modules) succeeds: a package installed for
    another CUDA or torch raises anything from ImportError to OSError, and then counts as absent."""
    try:
        load()
    except Exception:  # whatever stops the import
        return False
    return True


def hopper_or_blackwell(device: torch.device) -> bool:
    """Whether a CUDA device is of compute capability 9 (Hopper) or 10 (Blackwell): the GPUs
    FlashAttention-4 and quack's CuTe kernels build for."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)


def run_in_threads(tasks: Iterable[Callable[[], object]], device: torch.device) -> None:
    """Run tasks in parallel threads on `device`, without autograd; for kernel builds, which
    mostly wait on compiler processes, so that their waits overlap. Re-raises a task's error."""
    with threads_meanwhile(tasks, device):
        pass


@contextlib.contextmanager
def threads_meanwhile(tasks: Iterable[Callable[[], object]], device: torch.device) -> Iterator[None]:
    """Run the block while tasks run as `run_in_threads` runs them; after the block, wait for
    them and re-raise a task's error."""
    tasks = list(tasks)
    if not tasks:
        yield
        return

    def run(task: Callable[[], object]) -> None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), \
                torch.inference_mode():
            task()

    with ThreadPoolExecutor(max_workers=len(tasks)) as pool:
        futures = [pool.submit(run, task) for task in tasks]
        yield
        for future in futures:
            future.result()


@contextlib.contextmanager
def device_started_meanwhile(device: torch.device) -> Iterator[None]:
    """Run the block while a thread starts the CUDA context (a few hundred milliseconds, the
    first time a process touches the GPU), for a block of CPU work that releases the GIL
    (reading and decompressing an artifact); nothing elsewhere. Re-raises the thread's error."""
    if device.type != "cuda":
        yield
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = pool.submit(torch.zeros, 1, device=device)
        yield
        started.result()


def device_name(device: torch.device) -> str:
    """The GPU's name ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def phase(name: str) -> contextlib.AbstractContextManager:
    """A named range in torch.profiler's traces (bench/train_profile.py attributes GPU time
    to a step's phases by them); nothing at all when no profiler runs."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bytes(device: torch.device) -> int | None:
    """The memory a model on this device may use: the GPU's, or the host's available memory
    (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    available = [_meminfo_kib("/proc/meminfo", "MemAvailable")]
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]  # a limit on this process's address space
    if limit != resource.RLIM_INFINITY:
        in_use = _meminfo_kib("/proc/self/status", "VmSize")
        available.append(limit // 1024 - (in_use or 0))
    known = [kib for kib in available if kib is not None]
    return max(0, min(known)) * 1024 if known else None


def _meminfo_kib(path: str, key: str) -> int | None:
    """A `Key:   N kB` line of a /proc file, in KiB (None where there is none)."""
    try:
        with open(path, encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields[key].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: CUDA's out-of-memory error, or the CPU allocator's."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


@contextlib.contextmanager
def out_of_memory_as_error(device: torch.device, doing: str, remedy: str) -> Iterator[None]:
    """A failed allocation inside the block as one ConfigError line: what ran out, while
    doing what, and what to lower (remedy), instead of a traceback."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise ConfigError(f"{device} ran out of memory while {doing} ({cause}); {remedy}") from None
