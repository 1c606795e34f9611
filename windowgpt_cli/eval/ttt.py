"""Score-first test-time training (the reference's `eval_val_sliding_ttt`): the sliding
windows grouped into chunks by the first token they score; each chunk is scored, then
trained on with SGD, so no token is scored by a model that has seen it."""
from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from ..config import TTTConfig
from ..data.tokenizer import ByteLuts
from ..distributed import all_reduce_, average_gradients, is_initialized
from ..model.attention import window_kernel_builds
from ..model.gpt import GPT
from ..model.state_dict import bank_slots
from ..runtime import autocast, compiled
from .scoring import (
    ChunkScore,
    EvalResult,
    Log,
    WindowScorer,
    batch_windows,
    bits_per_byte,
    chunk_windows,
    device_tokens,
    make_result,
    plan_windows,
    rank_share,
    should_compile,
    should_fuse,
    sync_clock,
)


@dataclass
class TTTParameters:
    """What TTT trains: `trainable` go to SGD; of those, the bank slices in `frozen_slices`
    get their gradient zeroed (with SGD, momentum and no weight decay, they never move).
    The other parameters are frozen by being left out of SGD (and of the gradient norm):
    they keep requires_grad, so graphs compiled before TTT (the scorer's) stay valid."""

    trainable: list[nn.Parameter]
    frozen_slices: list[tuple[nn.Parameter, Tensor]]  # (bank, slot indices)
    unfrozen_count: int
    frozen_count: int


def frozen_bank_slots(num_layers: int, frozen_layers: int) -> dict[str, list[int]]:
    """The bank slots that hold the matrices of layers 0..frozen_layers-1."""
    prefixes = tuple(f"blocks.{i}." for i in range(frozen_layers))
    return {bank: sorted(slot for slot, name in slots if name.startswith(prefixes))
            for bank, slots in bank_slots(num_layers).items()}


def select_ttt_parameters(model: GPT, freeze_blocks: int, freeze_bank_slices: bool) -> TTTParameters:
    """Freeze the parameters of the first freeze_blocks blocks (their scalars, as the
    reference) and, with freeze_bank_slices, also those blocks' slices of the banks (the
    reference leaves them trainable)."""
    frozen_layers = min(freeze_blocks, model.num_layers)
    prefixes = tuple(f"blocks.{i}." for i in range(frozen_layers))
    trainable: list[nn.Parameter] = []
    frozen_count = 0
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            frozen_count += p.numel()
        else:
            trainable.append(p)
    frozen_slices = []
    if freeze_bank_slices and frozen_layers:
        for bank, slots in frozen_bank_slots(model.num_layers, frozen_layers).items():
            param = getattr(model, bank)
            frozen_slices.append((param, torch.tensor(slots, dtype=torch.int64, device=param.device)))
            frozen_count += len(slots) * param[0].numel()
    total = sum(p.numel() for p in model.parameters())
    return TTTParameters(trainable, frozen_slices, total - frozen_count, frozen_count)


@dataclass
class ChunkProgress:
    chunk: int  # 1-based
    num_chunks: int
    loss_sum: float  # running sums over chunks 1..chunk, this rank
    tokens: float
    bytes: float

    @property
    def val_bpb(self) -> float:
        return bits_per_byte(self.loss_sum, self.tokens, self.bytes)[1] if self.tokens and self.bytes else float("nan")


def capture_cuda_graph(step: Callable[[], None], stream: torch.cuda.Stream, pool: tuple[int, int] | None = None
                       ) -> Callable[[], None]:
    """step's kernels captured on `stream` as a CUDA graph (its memory from `pool`, a
    `torch.cuda.graph_pool_handle()`, where given), and the graph's replay. Capturing
    launches nothing: the step has not run when this returns."""
    graph = torch.cuda.CUDAGraph()
    # The outer context gives the current stream back even when ending a failed capture
    # raises (torch.cuda.graph's exit then skips restoring it).
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=pool, stream=stream):
            step()
    except Exception:
        _end_generator_capture(stream)
        raise
    return graph.replay


def _end_generator_capture(stream: torch.cuda.Stream) -> None:
    """After a failed capture: torch ends it without ending the capture mode of the CUDA
    random generator it registered, so every later draw of the process would raise ("Offset
    increment outside graph capture"). A capture of one small step, run to its end, ends it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        torch.zeros(1, device=stream.device).add_(1)


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """The block's kernels on `stream` (None: the current stream), after the current stream's
    work so far and before its later work."""
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


@dataclass
class _ShapeStep:
    """One batch shape's recorded step: the tensors it reads its batch from, and what
    replays it (None until it is captured)."""

    x: Tensor
    y: Tensor
    replay: Callable[[], None] | None = None


class ChunkTrainer:
    """SGD with momentum on the chunk's whole sequences, the reference's TTT step.

    A step is: gradients (zeroed, forward under autocast, backward, all-reduced over
    ranks, frozen bank slices zeroed, clipped to the global norm), then the SGD update.
    Eagerly that is thousands of kernel launches, so with `ttt_cuda_graphs` in one process
    (and an uncompiled forward) the gradient part is recorded once per batch shape
    and replayed: on CUDA as a CUDA graph, elsewhere (no graphs) by calling it again, which
    keeps the same bookkeeping testable on the CPU. A replay reads fixed addresses, so the
    batch is copied into the shape's x, y and the gradients are zeroed in place, never
    freed. The SGD update runs eagerly after each replay, as in the eager step: a graph
    would keep the learning rate it was captured with, and torch's SGD reads a tensor
    learning rate back with .item() (foreach or not), which a capture forbids; outside the
    graph the update is a few foreach launches, the eager step's numbers by construction.

    No step is lost to warming up: a shape's first step runs eagerly (on a side stream,
    as capturing wants) and is a real step; it creates the gradients, cuDNN's plans and
    the like (its kernels are built before, side by side: `kernel_builds`).
    The shape's second step is captured, which runs nothing, then replayed once: that
    replay is the second step. Should a capture fail, a one-line warning says so and that
    step and every later one run as eager steps.

    The shapes' graphs share one memory pool: a captured step's batch and gradients live
    outside it and everything it allocates inside dies within the step, so the graphs,
    replayed one at a time, can reuse each other's memory: the largest step's, not the sum
    (a remainder batch per chunk length would otherwise hold one more step's activations
    each). `release()` gives even that back, between uses.
    """

    def __init__(self, model: GPT, params: TTTParameters, ttt: TTTConfig, tokens: Tensor, *, seq_len: int,
                 device: torch.device, rank: int, world_size: int, compile_model: bool, fused: bool = False):
        self.model, self.params, self.ttt, self.tokens = model, params, ttt, tokens
        self.seq_len, self.device, self.rank, self.world_size = seq_len, device, rank, world_size
        self.compile_model = compile_model
        # Uncompiled, the costliest element-wise steps may run as fused kernels (fused).
        self.training_ops = None
        if fused and not compile_model:
            from ..model.fused_train_ops import TrainingOps  # imports Triton

            self.training_ops = TrainingOps()
            self.loss_fn = functools.partial(model, ops=self.training_ops)
        else:
            self.loss_fn = compiled(model, compile_model)
        self.optimizer = torch.optim.SGD(params.trainable, lr=ttt.ttt_lr, momentum=ttt.ttt_momentum)
        # Several ranks all-reduce their gradients between backward and clipping (NCCL
        # inside a graph is left alone); a compiled forward keeps its eager steps too.
        self.recording = ttt.ttt_cuda_graphs and world_size == 1 and not compile_model
        self.stream = torch.cuda.Stream(device) if self.recording and device.type == "cuda" else None
        self.shapes: dict[int, _ShapeStep] = {}  # by sequences per step
        self.pool = torch.cuda.graph_pool_handle() if self.stream is not None else None
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}  # steps run eagerly; records; replays

    def release(self) -> None:
        """Drop the recorded steps and give their memory back to the device (a caller that
        needs it between phases of training); the next step of each shape records again."""
        self.shapes = {}
        if self.stream is not None:
            self.pool = torch.cuda.graph_pool_handle()
            torch.cuda.empty_cache()

    def kernel_builds(self) -> list[Callable[[], object]]:
        """The builds of the kernels its steps run (the window attention's, gradients too,
        and the fused steps'; none without training), for the caller to run side by side
        before the first step (`runtime.run_in_threads`)."""
        if self.ttt.ttt_epochs <= 0:
            return []
        builds = window_kernel_builds(self.model.cfg, self.model.attention_backend, self.seq_len, self.device,
                                      eager=not self.compile_model, backward=True)
        if self.training_ops is not None:
            builds += self.training_ops.kernel_builds(self.model, self.seq_len)
        return builds

    def train_chunk(self, chunk_start: int, chunk_end: int, lr: float) -> None:
        chunk_seqs = (chunk_end - chunk_start) // self.seq_len
        if chunk_seqs <= 0:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        first, last = rank_share(chunk_seqs, self.rank, self.world_size)
        bs = self.ttt.ttt_batch_seqs
        # Every rank takes the same number of steps (gradients are all-reduced each step);
        # a rank without sequences for a step contributes a zero gradient.
        steps = math.ceil(math.ceil(chunk_seqs / self.world_size) / bs)
        for _ in range(self.ttt.ttt_epochs):
            for step in range(steps):
                begin, end = min(first + step * bs, last), min(first + (step + 1) * bs, last)
                self._step(chunk_start + begin * self.seq_len, end - begin)

    def _step(self, token_start: int, num_seqs: int) -> None:
        if self.recording:
            self._recorded_gradients(token_start, num_seqs)
        else:
            self._eager_gradients(token_start, num_seqs)
        self.optimizer.step()

    def _batch(self, token_start: int, num_seqs: int) -> tuple[Tensor, Tensor]:
        local = self.tokens[token_start: token_start + num_seqs * self.seq_len + 1]
        return local[:-1].view(num_seqs, self.seq_len), local[1:].view(num_seqs, self.seq_len)

    def _backward(self, x: Tensor, y: Tensor) -> None:
        with autocast(self.device):
            loss = self.loss_fn(x, y)
        loss.backward()

    def _finish_gradients(self) -> None:
        for bank, slots in self.params.frozen_slices:
            if bank.grad is not None:
                bank.grad.index_fill_(0, slots, 0.0)
        torch.nn.utils.clip_grad_norm_(self.params.trainable, self.ttt.ttt_grad_clip)

    def _eager_gradients(self, token_start: int, num_seqs: int) -> None:
        self.model.zero_grad(set_to_none=True)  # frozen parameters get gradients too: drop them
        if num_seqs > 0:
            self._backward(*self._batch(token_start, num_seqs))
        else:
            for p in self.params.trainable:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1 and is_initialized():
            average_gradients(self.params.trainable)
        self._finish_gradients()
        self.counts["eager"] += 1

    def _gradients_in_place(self, shape: _ShapeStep) -> None:
        """The recorded part of a step: the gradients of the batch in shape.x, shape.y, into
        the gradient tensors the first step created (zeroed in place: 0 + g is g). Frozen
        parameters' gradients are zeroed too, so they hold one step's, as eagerly."""
        self.model.zero_grad(set_to_none=False)
        self._backward(shape.x, shape.y)
        self._finish_gradients()

    def _recorded_gradients(self, token_start: int, num_seqs: int) -> None:
        x, y = self._batch(token_start, num_seqs)
        shape = self.shapes.get(num_seqs)
        if shape is None:  # the shape's first step: eager and real, it warms the capture up
            shape = self.shapes[num_seqs] = _ShapeStep(x.clone(), y.clone())
            with _on_stream(self.stream):
                self._gradients_in_place(shape)
            self.counts["eager"] += 1
            return
        shape.x.copy_(x)
        shape.y.copy_(y)
        if shape.replay is None:
            shape.replay = self._capture(functools.partial(self._gradients_in_place, shape))
            if shape.replay is None:  # the capture failed: eager steps from here on, on this stream
                self.recording = False
                self._eager_gradients(token_start, num_seqs)
                return
        shape.replay()  # for a shape captured just now, this is the step's only run
        self.counts["replayed"] += 1

    def _capture(self, step: Callable[[], None]) -> Callable[[], None] | None:
        """What replays step: its CUDA graph; without CUDA, step itself. None, after a
        one-line warning, when the capture fails."""
        if self.stream is None:
            self.counts["captured"] += 1
            return step
        try:
            replay = capture_cuda_graph(step, self.stream, self.pool)
        except Exception as exc:  # whatever the step cannot capture
            reason = (str(exc).strip().splitlines() or [""])[0][:200]
            print(f"warning: TTT's training step could not be captured as a CUDA graph "
                  f"({type(exc).__name__}: {reason}); training eagerly", file=sys.stderr)
            return None
        self.counts["captured"] += 1
        return replay


def ttt_learning_rate(base_lr: float, chunk: int, num_chunks: int) -> float:
    """Cosine decay across chunks, from base_lr at the first to 0 at the last."""
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * chunk / max(num_chunks - 1, 1)))


def evaluate_ttt(model: GPT, val_tokens: Tensor, luts: ByteLuts, ttt: TTTConfig, *, seq_len: int, stride: int,
                 device: torch.device, batch_seqs: int = 0, rank: int = 0, world_size: int = 1,
                 score_once: bool = False, compile_model: bool | None = None, fused: bool | None = None,
                 compile_training: bool | None = None, on_chunk: Callable[[ChunkProgress], None] | None = None,
                 log: Log | None = None) -> EvalResult:
    """The reference's `eval_val_sliding_ttt`: score-first test-time training.

    Windows (`plan_windows` with min_length=stride) go to the chunk of ttt_chunk_tokens
    targets holding the first target they score. For each chunk in order: its windows are
    scored under inference mode (split over ranks), then, except for the last chunk, the
    model trains on the chunk's whole sequences of seq_len for ttt_epochs epochs (batches of
    ttt_batch_seqs split over ranks, gradients averaged) with SGD and momentum at a cosine-
    decayed learning rate. Every target is therefore scored before any update that could have
    seen it. The model's weights are changed. Scoring runs the fused kernels (fused, default:
    where they can run) or else compiles its forward with compile_model (default: on CUDA);
    with fused, uncompiled training steps run `model.fused_train_ops.TrainingOps`' fused steps too.
    compile_training (default: off) compiles the training step's: TTT trains a few
    small batches per chunk in one pass over the data, too little to repay compiling a
    backward graph. Uncompiled, in one process, ttt.ttt_cuda_graphs replays the steps as
    CUDA graphs (see `ChunkTrainer`); `result.ttt_steps` counts the steps run eagerly, the
    steps captured and the replays.
    `result.per_chunk` holds each chunk's sums; on_chunk sees running sums after each chunk.
    """
    start = sync_clock(device)
    log = log or (lambda message: None)
    compile_model = should_compile(compile_model, device)
    compile_training = False if compile_training is None else compile_training
    total_tokens = val_tokens.numel() - 1
    plan = plan_windows(total_tokens, seq_len, stride, min_length=stride, score_once=score_once)
    chunks = chunk_windows(plan, ttt.ttt_chunk_tokens, total_tokens)
    num_chunks = len(chunks)
    log(f"ttt_sliding:start chunks={num_chunks} chunk_tokens={ttt.ttt_chunk_tokens} total_windows={len(plan)} "
        f"stride={stride} ttt_lr={ttt.ttt_lr} ttt_epochs={ttt.ttt_epochs} freeze_blocks={ttt.ttt_freeze_blocks}")
    params = select_ttt_parameters(model, ttt.ttt_freeze_blocks, ttt.ttt_freeze_bank_slices)
    log(f"ttt_sliding:params unfrozen={params.unfrozen_count} frozen={params.frozen_count}")
    tokens = device_tokens(val_tokens, device)
    fused = should_fuse(fused, device)
    trainer = ChunkTrainer(model, params, ttt, tokens, seq_len=seq_len, device=device, rank=rank,
                           world_size=world_size, compile_model=compile_training, fused=fused)
    scorer = WindowScorer(model, tokens, luts.to(device), seq_len=seq_len, width=stride,
                          batch_rows=batch_windows(batch_seqs, model.cfg, seq_len, device), device=device,
                          compile_model=compile_model, fused=fused, other_builds=trainer.kernel_builds())
    chunk_sums = torch.zeros(num_chunks, 3, dtype=torch.float64, device=device)
    training_seconds = 0.0
    try:
        for ci, windows in enumerate(chunks):
            if windows.numel() == 0:
                continue  # as the reference: no windows, no training either
            mine = windows[slice(*rank_share(windows.numel(), rank, world_size))]
            chunk_sums[ci] = scorer.score(plan.select(mine))
            if ci < num_chunks - 1 and ttt.ttt_epochs > 0:
                chunk_start, chunk_end = ci * ttt.ttt_chunk_tokens, min((ci + 1) * ttt.ttt_chunk_tokens, total_tokens)
                begun = sync_clock(device)
                trainer.train_chunk(chunk_start, chunk_end, ttt_learning_rate(ttt.ttt_lr, ci, num_chunks))
                training_seconds += sync_clock(device) - begun
            if on_chunk is not None:
                on_chunk(ChunkProgress(ci + 1, num_chunks, *chunk_sums[: ci + 1].sum(0).tolist()))
    finally:
        model.zero_grad(set_to_none=True)
    all_reduce_(chunk_sums)
    per_chunk = [ChunkScore(nats, int(n), int(b)) for nats, n, b in chunk_sums.tolist()]
    result = make_result("ttt", chunk_sums.sum(0), sync_clock(device) - start, seq_len, stride, scorer.batch_rows,
                     per_chunk, {**scorer.timings, "ttt_training": training_seconds})
    result.ttt_steps = dict(trainer.counts)
    return result
