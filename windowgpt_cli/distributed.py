"""Process groups under torchrun (one process per GPU, on one host or several)."""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .runtime import resolve_device


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or (dist.is_available() and dist.is_initialized())


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_name: str = "auto") -> DistContext:
    """Join the process group torchrun describes (nccl on CUDA, gloo on CPU); a plain
    process is rank 0 of 1. torchrun's variables are read here, at the edge, only."""
    if not launched_by_torchrun():
        return DistContext(0, 1, 0, resolve_device(device_name))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30), **kwargs)
    return DistContext(rank, world_size, local_rank, device)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if is_initialized():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}[op])
    return tensor


def average_gradients(params) -> None:
    """Average each parameter's gradient over the ranks (gloo has no AVG: sum, then divide)."""
    if not is_initialized():
        return
    nccl = dist.get_backend() == "nccl"
    for p in params:
        if p.grad is not None:
            if nccl:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            else:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(dist.get_world_size())


def gather_from_ranks(value) -> list:
    """Every rank's value (picklable), in rank order; every rank must call it."""
    if not is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group. On success every rank first waits for the others: a rank
    that tore its connections down while another still used them could abort that one at
    exit. With an exception in flight (called from a `finally`) there is no waiting, since
    the other ranks may never come."""
    if is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()
