"""Parallel Muon for the parameter banks, AdamW for the rest, the schedule, EMA and SWA."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import OptimConfig, TrainConfig
from ..distributed import is_initialized
from ..model.gpt import GPT
from ..model.state_dict import is_control_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The Polar Express paper's quintics (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932),
# one per iteration, the last repeated beyond the list; all but the last divided by a safety
# factor of 1.01 (a, b, c by 1.01, 1.01^3, 1.01^5), as the paper does for bfloat16.
_POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_COEFFICIENTS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS[:-1]) \
    + _POLAR_EXPRESS[-1:]


def ns_coefficients(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations (`OptimConfig.muon_ns_coefficients`)."""
    if name == "reference":
        return [NS_COEFFICIENTS] * steps
    table = POLAR_EXPRESS_COEFFICIENTS
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def newton_schulz5(g: Tensor, steps: int = 5, eps: float = 1e-7, coefficients: str = "reference") -> Tensor:
    """Approximately orthogonalize each matrix of a batch [B, M, N] (or one [M, N]) in bf16."""
    x = g.bfloat16()
    squeeze = x.ndim == 2
    if squeeze:
        x = x.unsqueeze(0)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in ns_coefficients(coefficients, steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if transposed:
        x = x.mT
    return x.squeeze(0) if squeeze else x


def unit_rows(update: Tensor, eps: float = 1e-7) -> Tensor:
    """Each row of each matrix [..., M, N] (one output channel) scaled to unit length, its norm
    taken in float32: MuonEq-R's equilibration, so that the orthogonalization starts from rows
    of equal weight. A rank's shard holds whole matrices, so each rank does it alone."""
    return update / update.float().norm(dim=-1, keepdim=True).clamp_min(eps).to(update.dtype)


@dataclass
class _Bank:
    param: Tensor
    rows: int  # matrices in the bank
    scale: float  # sqrt(max(1, M/N)): keeps the update's RMS independent of shape
    # With several ranks (rows padded up to a multiple of the world size):
    padded_grad: Tensor | None = None  # [padded rows, M, N], the wire dtype
    shard: Tensor | None = None  # this rank's rows of the averaged gradient, bf16
    shard_momentum: Tensor | None = None
    full_update: Tensor | None = None  # [padded rows, M, N], the wire dtype

    def shard_rows(self, rank: int) -> slice:
        n = self.shard.shape[0]
        return slice(rank * n, (rank + 1) * n)


class _Then:
    """An asynchronous collective and the local work that completes it once it lands."""

    def __init__(self, work: Any, then: Callable[[], None]):
        self.work, self.then = work, then

    def wait(self) -> None:
        self.work.wait()
        self.then()


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, then Newton-Schulz orthogonalization of each bank matrix.

    With several ranks the bank gradients are reduce-scattered right after backward
    (`launch_reduce_scatters`), each rank orthogonalizes its shard of the matrices, and an
    all-gather returns the full update; the next bank's work overlaps the all-gather.
    On NCCL this is the reference's bf16 reduce-scatter / all-gather. Other backends (gloo
    on the CPU) may lack those collectives, bf16 and AVG, so they all-reduce the float32
    gradient and gather float32 lists instead: the same update, one rounding fewer.

    `state_dict` stores every bank's full momentum, as one process would (with several
    ranks it gathers the shards, so every rank must call it); `load_state_dict` cuts out
    this rank's shard. A saved state therefore does not depend on the world size.
    """

    def __init__(self, params: list[Tensor], lr: float, momentum: float, backend_steps: int,
                 weight_decay: float = 0.0, nesterov: bool = True, ns_coefficients: str = "reference",
                 row_normalize: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, backend_steps=backend_steps,
                                      nesterov=nesterov, weight_decay=weight_decay))
        # Settings, not state: a checkpoint's groups need not hold them.
        self.ns_coefficients, self.row_normalize = ns_coefficients, row_normalize
        self._banks: list[_Bank] | None = None
        self._pending: list[Any] | None = None
        self._nccl = False

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if is_initialized() else 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def _build(self) -> list[_Bank]:
        if self._banks is None:
            ws = self.world_size
            self._nccl = self.sharded and dist.get_backend() == "nccl"
            wire = torch.bfloat16 if self._nccl else torch.float32
            banks = []
            for group in self.param_groups:
                for p in group["params"]:
                    bank = _Bank(p, p.shape[0], max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5)
                    if ws > 1:
                        padded = -(-bank.rows // ws) * ws
                        bank.padded_grad = torch.zeros(padded, *p.shape[1:], device=p.device, dtype=wire)
                        bank.shard = torch.zeros(padded // ws, *p.shape[1:], device=p.device, dtype=torch.bfloat16)
                        bank.shard_momentum = torch.zeros_like(bank.shard)
                        bank.full_update = torch.zeros_like(bank.padded_grad)
                    banks.append(bank)
            banks.sort(key=lambda b: -b.param.numel())  # biggest communication first
            self._banks = banks
        return self._banks

    # --- the two collectives ---

    def _start_reduce_scatter(self, bank: _Bank) -> Any:
        """Average padded_grad across ranks into this rank's shard (asynchronously)."""
        if self._nccl:
            return dist.reduce_scatter_tensor(bank.shard, bank.padded_grad, op=dist.ReduceOp.AVG, async_op=True)
        work = dist.all_reduce(bank.padded_grad, op=dist.ReduceOp.SUM, async_op=True)
        mine = bank.shard_rows(self.rank)
        return _Then(work, lambda: bank.shard.copy_(bank.padded_grad[mine].div_(self.world_size)))

    def _start_all_gather(self, out: Tensor, shard: Tensor) -> Any:
        """Every rank's shard, in rank order, into out (asynchronously)."""
        if self._nccl:
            return dist.all_gather_into_tensor(out, shard, async_op=True)
        return dist.all_gather(list(out.chunk(self.world_size)), shard.to(out.dtype), async_op=True)

    # --- the step ---

    def launch_reduce_scatters(self) -> None:
        """Start averaging each bank's gradient across ranks, one shard per rank."""
        banks = self._build()
        if not self.sharded:
            return
        self._pending = []
        for bank in banks:
            if bank.param.grad is None:
                self._pending.append(None)
                continue
            bank.padded_grad[:bank.rows].copy_(bank.param.grad)
            bank.padded_grad[bank.rows:].zero_()
            self._pending.append(self._start_reduce_scatter(bank))

    @torch.no_grad()
    def step(self, closure=None):
        banks = self._build()
        group = self.param_groups[0]
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        sharded = self._pending is not None
        gathering: tuple[Any, _Bank] | None = None
        for i, bank in enumerate(banks):
            if bank.param.grad is None:
                continue
            if gathering is not None:
                self._apply(gathering, lr, wd)
                gathering = None
            if sharded and self._pending[i] is not None:
                self._pending[i].wait()
                grad, buf = bank.shard, bank.shard_momentum
            else:
                grad = bank.param.grad.bfloat16()
                state = self.state[bank.param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
            buf.mul_(momentum).add_(grad)
            update = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
            if self.row_normalize:
                update = unit_rows(update)
            update = newton_schulz5(update, steps=group["backend_steps"], coefficients=self.ns_coefficients)
            if sharded:
                gathering = (self._start_all_gather(bank.full_update, update), bank)
            else:
                _apply_update(bank.param, update, lr * bank.scale, lr * wd)
        if gathering is not None:
            self._apply(gathering, lr, wd)
        self._pending = None

    @staticmethod
    def _apply(gathering: tuple[Any, _Bank], lr: float, wd: float) -> None:
        handle, bank = gathering
        handle.wait()
        _apply_update(bank.param, bank.full_update[:bank.rows], lr * bank.scale, lr * wd)

    # --- state ---

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.sharded:
            index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            for bank in self._build():
                state["state"][index[id(bank.param)]] = {"momentum_buffer": self._gathered_momentum(bank)}
        return state

    def _gathered_momentum(self, bank: _Bank) -> Tensor:
        full = torch.empty_like(bank.full_update)
        self._start_all_gather(full, bank.shard_momentum).wait()
        return full[:bank.rows].to(torch.bfloat16)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():  # loading casts buffers to the float32 banks' dtype
            state["momentum_buffer"] = state["momentum_buffer"].bfloat16()
        if self.sharded:
            for bank in self._build():
                saved = self.state.pop(bank.param, {}).get("momentum_buffer")
                bank.shard_momentum.zero_()
                if saved is not None:
                    rows = saved[bank.shard_rows(self.rank)]  # the last ranks' shards may end in padding
                    bank.shard_momentum[:rows.shape[0]].copy_(rows)


def _apply_update(p: Tensor, update: Tensor, step: float, decay: float) -> None:
    if decay > 0.0:
        p.mul_(1.0 - decay)
    p.add_(update.to(dtype=p.dtype), alpha=-step)


# --- The optimizer table -----------------------------------------------------------------

@dataclass
class Optimizers:
    """The reference's optimizer split: banks -> Muon; token-like tables -> AdamW at the
    embedding rate; control tensors and small projections -> AdamW at the scalar rate; an
    untied head -> Adam."""

    muon: Muon
    adams: list[torch.optim.Optimizer]
    replicated: list[Tensor] = field(default_factory=list)  # all-reduced by hand across ranks

    @property
    def all(self) -> list[torch.optim.Optimizer]:
        return [self.adams[0], self.muon, *self.adams[1:]]

    def zero_grad(self) -> None:
        for opt in self.all:
            opt.zero_grad(set_to_none=True)

    def set_lr_scale(self, scale: float) -> None:
        for opt in self.all:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * scale

    def set_muon_momentum(self, momentum: float) -> None:
        for group in self.muon.param_groups:
            group["momentum"] = momentum

    def step_adams(self) -> None:
        for opt in self.adams:
            opt.step()

    def state_dict(self) -> list[dict[str, Any]]:
        return [opt.state_dict() for opt in self.all]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for opt, state in zip(self.all, states, strict=True):
            opt.load_state_dict(state)


def build_optimizers(model: GPT, cfg: OptimConfig) -> Optimizers:
    fused = next(model.parameters()).is_cuda
    token_lr = cfg.tied_embed_lr if model.cfg.tie_embeddings else cfg.embed_lr
    token_tables = [model.tok_emb.weight]
    scalars = [p for name, p in model.blocks.named_parameters() if p.ndim < 2 or is_control_tensor(name)]
    scalars += [model.skip_weights, *model.smear.parameters()]
    scalars += [p for p in (model.skip_gates, model.lane_mix) if p is not None]
    for extra in (model.bigram, model.ve_shared):
        if extra is not None:
            token_tables.append(extra.embed.weight)
            scalars += ([extra.proj.weight] if extra.proj is not None else []) + [extra.scale]
    scalars += list(model.ve_layer_scales)
    adam = dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=fused)
    token_wd = cfg.adam_wd if cfg.embed_wd == -1 else cfg.embed_wd
    tok = torch.optim.AdamW([{"params": [p], "lr": token_lr, "base_lr": token_lr} for p in token_tables],
                            weight_decay=token_wd, **adam)
    scalar = torch.optim.AdamW([{"params": scalars, "lr": cfg.scalar_lr, "base_lr": cfg.scalar_lr}],
                               weight_decay=cfg.adam_wd, **adam)
    muon = Muon([model.qo_bank, model.kv_bank, model.mlp_up_bank, model.mlp_down_bank], lr=cfg.matrix_lr,
                momentum=cfg.muon_momentum, backend_steps=cfg.muon_backend_steps, weight_decay=cfg.muon_wd,
                ns_coefficients=cfg.muon_ns_coefficients, row_normalize=cfg.muon_row_normalize)
    for group in muon.param_groups:
        group["base_lr"] = cfg.matrix_lr
    adams: list[torch.optim.Optimizer] = [tok, scalar]
    replicated = token_tables + scalars
    if model.lm_head is not None:
        adams.append(torch.optim.Adam([{"params": [model.lm_head.weight], "lr": cfg.head_lr, "base_lr": cfg.head_lr}],
                                      **adam))
        replicated.append(model.lm_head.weight)
    _check_every_parameter_has_one_optimizer(model, [muon, *adams])
    return Optimizers(muon, adams, replicated)


def _check_every_parameter_has_one_optimizer(model: GPT, optimizers: list[torch.optim.Optimizer]) -> None:
    owned = [id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]]
    assert len(owned) == len(set(owned)), "a parameter is in two optimizers"
    missing = [n for n, p in model.named_parameters() if id(p) not in set(owned)]
    assert not missing, f"parameters without an optimizer: {missing}"


# --- Schedule ----------------------------------------------------------------------------

def lr_scale(step: int, elapsed_ms: float, train: TrainConfig, wallclock_ms: float | None) -> float:
    """1 until warm-down, then linear to min_lr_fraction (0, the reference's), over the last
    warmdown_iters steps, or, under a wallclock cap, over the time that many steps take at
    the current pace (at most warmdown_max_fraction of the budget); with warmdown_fraction,
    over that fraction of the iterations or of the budget instead."""
    scale = _warmdown_scale(step, elapsed_ms, train, wallclock_ms)
    floor = train.min_lr_fraction
    return scale if floor == 0 else floor + (1.0 - floor) * scale


def _warmdown_scale(step: int, elapsed_ms: float, train: TrainConfig, wallclock_ms: float | None) -> float:
    by_fraction = train.warmdown_fraction > 0
    warmdown_steps = round(train.warmdown_fraction * train.iterations) if by_fraction else train.warmdown_iters
    if warmdown_steps <= 0 and not (by_fraction and wallclock_ms is not None):
        return 1.0
    if wallclock_ms is None:
        start = max(train.iterations - warmdown_steps, 0)
        if start <= step < train.iterations:
            return max((train.iterations - step) / max(warmdown_steps, 1), 0.0)
        return 1.0
    if by_fraction:
        warmdown_ms = train.warmdown_fraction * wallclock_ms
    else:
        warmdown_ms = min(warmdown_steps * (elapsed_ms / max(step, 1)), train.warmdown_max_fraction * wallclock_ms)
    remaining_ms = max(wallclock_ms - elapsed_ms, 0.0)
    return remaining_ms / max(warmdown_ms, 1e-9) if remaining_ms <= warmdown_ms else 1.0


def muon_momentum_at(step: int, cfg: OptimConfig) -> float:
    frac = min(step / cfg.muon_momentum_warmup_steps, 1.0) if cfg.muon_momentum_warmup_steps > 0 else 1.0
    return (1 - frac) * cfg.muon_momentum_warmup_start + frac * cfg.muon_momentum


# --- Weight averages ---------------------------------------------------------------------

class WeightAverages:
    """EMA of every weight (float32) and the SWA running sum, updated with foreach ops."""

    def __init__(self, model: GPT, ema_decay: float, warmup: bool = True):
        self.names = list(model.state_dict())
        self.decay, self.warmup = ema_decay, warmup
        self.ema = [t.detach().float().clone() for t in model.state_dict().values()]
        self.swa: list[Tensor] | None = None
        self.swa_count = 0

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update_ema(self, model: GPT, step: int) -> None:
        decay = self.decay_at(step)
        current = [t.detach().float() for t in model.state_dict().values()]
        torch._foreach_mul_(self.ema, decay)
        torch._foreach_add_(self.ema, current, alpha=1.0 - decay)

    @torch.no_grad()
    def add_swa_snapshot(self, model: GPT) -> None:
        current = [t.detach().float() for t in model.state_dict().values()]
        if self.swa is None:
            self.swa = [t.clone() for t in current]
        else:
            torch._foreach_add_(self.swa, current)
        self.swa_count += 1

    def ema_state(self) -> dict[str, Tensor]:
        return {n: t.detach().cpu().clone() for n, t in zip(self.names, self.ema)}

    def swa_state(self) -> dict[str, Tensor] | None:
        return None if self.swa is None else {n: t.detach().cpu().clone() for n, t in zip(self.names, self.swa)}

    def load(self, ema: dict[str, Tensor], swa: dict[str, Tensor] | None, swa_count: int) -> None:
        device = self.ema[0].device
        self.ema = [ema[n].to(device).float() for n in self.names]
        self.swa = None if swa is None else [swa[n].to(device).float() for n in self.names]
        self.swa_count = swa_count
