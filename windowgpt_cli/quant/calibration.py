"""GPTQ calibration: Hessians of every block matrix's input over training batches.

The challenge counts calibration on training data as training, so `train --use-gptq`
collects the Hessians inside its wallclock budget, from the final (EMA) weights, and writes
them beside the checkpoint; `export` carries them along with the EMA weights, and
`quantize --gptq` uses them. Without them `quantize` calibrates the same batches itself,
after training, and says so. Either way the batches come from `calibration_batches` and the
sums from `quant.accumulate_hessians`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from ..config import RunConfig, grad_accum_steps_for
from ..data.loader import TokenStream
from ..distributed import all_reduce_
from ..errors import ArtifactError, ConfigError
from ..runtime import autocast, synchronize
from ..storage import tensorfile

FORMAT = "windowgpt.hessians"
FORMAT_VERSION = "1"


@dataclass
class Calibration:
    hessians: dict[tuple[str, ...], Tensor]  # weights that share one input -> averaged, damped E[x^T x]
    batches: int
    tokens: int
    seconds: float
    step: int | None = None  # the training step whose EMA weights were calibrated (None: after training)
    # tensors_sha256() of the weights they were collected under: by content, so a run's EMA
    # weights and their export give the same one
    weights_sha256: str = ""

    @property
    def layers(self) -> int:
        """Weight matrices covered (the reference's count: 6 per block)."""
        return sum(len(names) for names in self.hessians)


def calibration_batches(cfg: RunConfig, train_files: list[Path], rank: int = 0,
                        world_size: int = 1) -> Iterator[tuple[Tensor, Tensor]]:
    """The reference's calibration batches: gptq_calib_samples batches of train_batch_tokens /
    grad_accum_steps tokens from a fresh stream seeded with the run's seed. With N ranks,
    every rank draws the same batches and keeps every N-th sequence of each, so the ranks
    together see exactly what one process sees."""
    t = cfg.train
    accum = grad_accum_steps_for(cfg, 1)
    rows = t.train_batch_tokens // accum // t.train_seq_len
    if rows < world_size:
        raise ConfigError(f"calibration batches of {rows} sequences cannot be shared by {world_size} ranks; "
                          "raise --train-batch-tokens")
    stream = TokenStream(train_files, t.seed, vocab_size=cfg.model.vocab_size)
    for _ in range(cfg.quant.gptq_calib_samples):
        x, y = stream.next_batch(t.train_batch_tokens, t.train_seq_len, accum)
        yield x[rank::world_size], y[rank::world_size]


def calibrate(model: torch.nn.Module, cfg: RunConfig, train_files: list[Path], device: torch.device, *,
              rank: int = 0, world_size: int = 1, on_batch: Callable[[], None] | None = None) -> Calibration:
    """Hessians of the model's current weights over the calibration batches. Every rank sums
    its share; the sums are added up over the ranks, so N ranks take 1/N of the time."""
    synchronize(device)
    started = time.perf_counter()
    tokens = 0

    def counted() -> Iterator[tuple[Tensor, Tensor]]:
        nonlocal tokens
        for x, y in calibration_batches(cfg, train_files, rank, world_size):
            tokens += y.numel()
            yield x, y

    sums, _ = accumulate_hessians(model, counted(), device, on_batch, head=cfg.quant.quant_gptq_embed)
    for total in sums.values():
        all_reduce_(total)
    total_tokens = int(all_reduce_(torch.tensor(tokens, dtype=torch.int64, device=device)).item())
    hessians = finalize_hessians(sums, cfg.quant.gptq_calib_samples)
    synchronize(device)
    return Calibration(hessians, cfg.quant.gptq_calib_samples, total_tokens, time.perf_counter() - started)


# --- Hessians ---------------------------------------------------------------------------

HESSIAN_DAMPING = 0.01  # added (times the mean diagonal) when calibration ends


def collect_hessians(model: torch.nn.Module, batches: Iterable[tuple[Tensor, Tensor]], device: torch.device,
                     on_batch: Callable[[], None] | None = None, head: bool = False) -> dict[tuple[str, ...], Tensor]:
    """The calibration Hessians of the batches: their sums, averaged per batch and damped."""
    sums, count = accumulate_hessians(model, batches, device, on_batch, head)
    return finalize_hessians(sums, count)


def accumulate_hessians(model: torch.nn.Module, batches: Iterable[tuple[Tensor, Tensor]], device: torch.device,
                        on_batch: Callable[[], None] | None = None,
                        head: bool = False) -> tuple[dict[tuple[str, ...], Tensor], int]:
    """Sum x^T x of every block matrix's input over the batches (the model's
    `observe_linear_inputs`), as the reference, and with head of the output layer's input
    (GPTQ on the tied embedding); returns the sums and the number of batches."""
    sums: dict[tuple[str, ...], Tensor] = {}

    def accumulate(names: tuple[str, ...], x: Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        if names not in sums:
            sums[names] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float32, device=flat.device)
        with torch.autocast(device_type=flat.device.type, enabled=False):  # sum in float32
            sums[names].addmm_(flat.T, flat)

    was_training = model.training
    model.eval()
    count = 0
    try:
        with torch.no_grad(), autocast(device), model.observe_linear_inputs(accumulate, head):
            for inputs, targets in batches:
                model(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
                count += 1
                if on_batch:
                    on_batch()
    finally:
        model.train(was_training)
    return sums, count


def finalize_hessians(sums: Mapping[tuple[str, ...], Tensor], num_batches: int) -> dict[tuple[str, ...], Tensor]:
    """Average over batches and add 0.01 x the mean diagonal, so that every Hessian is
    positive definite before GPTQ adds its own damping."""
    out = {}
    for names, total in sums.items():
        h = total / max(num_batches, 1)
        damp = HESSIAN_DAMPING * torch.diag(h).mean().clamp_min(1e-6)
        out[names] = h + damp * torch.eye(h.shape[0], device=h.device)
    return out


# --- On disk ---------------------------------------------------------------------------

def save_hessians(path: Path, calibration: Calibration) -> Path:
    """One float32 tensor per input, named by the weights that share it (comma-separated)."""
    tensors = {",".join(names): h.detach().float().cpu() for names, h in calibration.hessians.items()}
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": "ema",
                "weights_sha256": calibration.weights_sha256, "step": str(calibration.step),
                "batches": str(calibration.batches), "tokens": str(calibration.tokens),
                "seconds": f"{calibration.seconds:.3f}"}
    return tensorfile.save(path, tensors, metadata)


def load_hessians(path: Path) -> Calibration:
    tensors, meta = tensorfile.load(path)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: not windowgpt Hessians of format version {FORMAT_VERSION}")
    try:
        return Calibration({tuple(key.split(",")): h for key, h in tensors.items()}, int(meta["batches"]),
                           int(meta["tokens"]), float(meta["seconds"]), int(meta["step"]), meta["weights_sha256"])
    except (KeyError, ValueError) as exc:
        raise ArtifactError(f"{path}: incomplete Hessian metadata ({exc})") from None
