"""Scoring a model on the validation tokens: val_loss (nats per token) and val_bpb.

Three evaluations, each with the reference's arithmetic (bf16 autocast forward, float32
cross-entropy, float64 sums of nats, tokens and bytes; bpb = nats / ln 2 / bytes):

- standard: consecutive non-overlapping sequences (the reference's `eval_val`). It takes
  any `loss_fn(x, y) -> mean loss`, so the training loop can pass its compiled model.
- sliding: a window of seq_len tokens every `stride` tokens; the first window scores all
  its tokens, every later one only its last `stride` (`eval_val_sliding`).
- ttt: the sliding windows grouped into chunks by the first token they score; each chunk
  is scored, then trained on (score-first test-time training, `eval_val_sliding_ttt`;
  see `ttt`).

Positions: the validation tokens t[0..N] give N targets; target p is t[p + 1], predicted
from t[..p]. A window starting at ws reads t[ws .. ws + len - 1] and predicts the targets
ws .. ws + len - 1.

Sliding scoring has no Python loop over windows. `plan_windows` lists the windows and
the part of each that is scored (a pure function, tested on its own); every window becomes
rows of `stride` scored positions (the first window, which scores everything, several
rows); fixed-size batches of rows are gathered from the tokens on the device, the trunk runs
over whole windows and the output layer only at the scored positions, and the sums stay on
the device until the end.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelConfig
from ..data.tokenizer import ByteLuts
from ..distributed import all_reduce_
from ..errors import ConfigError, DataError
from ..model.gpt import GPT
from ..runtime import autocast, compiled, run_in_threads, synchronize, triton_available

LN2 = math.log(2.0)
NATS, TOKENS, BYTES = 0, 1, 2  # the three float64 sums every evaluation accumulates

LossFn = Callable[[Tensor, Tensor], Tensor]
BatchProgress = Callable[[int, int], None]  # (batches done, batches in all)
Log = Callable[[str], None]


# --- Results ----------------------------------------------------------------------------

def bits_per_byte(nats: float, tokens: float, n_bytes: float) -> tuple[float, float]:
    """(val_loss, val_bpb) from the sums, in the reference's order of operations."""
    val_loss = nats / tokens
    return val_loss, val_loss / LN2 * (tokens / n_bytes)


@dataclass
class ChunkScore:
    """What one TTT chunk contributed (summed over ranks), scored before training on it."""

    loss_sum: float
    tokens: int
    bytes: int

    @property
    def val_bpb(self) -> float | None:
        """None for a chunk that scored nothing."""
        return bits_per_byte(self.loss_sum, self.tokens, self.bytes)[1] if self.tokens and self.bytes else None


@dataclass
class EvalResult:
    mode: str  # standard | sliding | ttt
    val_loss: float
    val_bpb: float
    loss_sum: float  # nats over all scored tokens
    tokens: int  # scored tokens (with multiplicity)
    bytes: int
    seconds: float
    seq_len: int
    stride: int  # 0 for standard
    batch_seqs: int  # sequences or windows per forward pass
    per_chunk: list[ChunkScore] = field(default_factory=list)  # ttt only
    timings: dict[str, float] = field(default_factory=dict)  # seconds of the phases inside `seconds`
    ttt_steps: dict[str, int] = field(default_factory=dict)  # ttt only: how its training steps ran

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def make_result(mode: str, sums: Tensor, seconds: float, seq_len: int, stride: int, batch_seqs: int,
            per_chunk: list[ChunkScore] | None = None, timings: dict[str, float] | None = None) -> EvalResult:
    nats, tokens, n_bytes = sums.tolist()
    if tokens <= 0 or n_bytes <= 0:
        raise DataError("nothing was scored: the validation tokens stand for no bytes")
    val_loss, val_bpb = bits_per_byte(nats, tokens, n_bytes)
    return EvalResult(mode, val_loss, val_bpb, nats, int(tokens), int(n_bytes), seconds, seq_len, stride,
                      batch_seqs, per_chunk or [], {k: round(v, 3) for k, v in (timings or {}).items()})




def rank_share(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """The [begin, end) of `count` items that one rank takes, as the reference splits them."""
    return count * rank // world_size, count * (rank + 1) // world_size


# --- Batch size -------------------------------------------------------------------------

CPU_BATCH_WINDOWS = 32  # the reference's batch
MAX_AUTO_BATCH_WINDOWS = 512  # on an H200, 6% faster per window than 256


def activation_bytes_per_token(cfg: ModelConfig, full_logits: bool) -> int:
    """A bound on what one token keeps alive at the peak of an inference forward: the float32
    residual stream, x0 and the encoder's skip outputs, one block's largest temporaries (its
    MLP hidden layer, its q, k and v), and the float32 logits where every position is scored."""
    residual = 4 * cfg.model_dim * (cfg.num_layers // 2 + 4)
    block = 4 * cfg.mlp_dim + 2 * (cfg.model_dim + 2 * cfg.kv_dim)
    logits = 8 * cfg.vocab_size if full_logits else 0
    return residual + block + logits


def even_batch(rows: int, most: int) -> int:
    """The batch that covers `rows` in as few batches of at most `most` rows as can, with
    the least padding: the last batch is nearly full instead of nearly empty."""
    batches = max(1, math.ceil(rows / most))
    return math.ceil(rows / batches)


def batch_windows(requested: int, cfg: ModelConfig, seq_len: int, device: torch.device, *,
                  full_logits: bool = False) -> int:
    """`requested` windows per forward pass, or for 0 as many as fit: on CUDA the largest
    power of two whose activations take at most half the free memory (at most
    MAX_AUTO_BATCH_WINDOWS), elsewhere CPU_BATCH_WINDOWS."""
    if requested > 0:
        return requested
    if device.type != "cuda":
        return CPU_BATCH_WINDOWS
    free_bytes, _ = torch.cuda.mem_get_info(device)
    fitting = free_bytes // 2 // (seq_len * activation_bytes_per_token(cfg, full_logits))
    return max(1, min(MAX_AUTO_BATCH_WINDOWS, 1 << max(int(fitting).bit_length() - 1, 0)))


# --- Standard evaluation ----------------------------------------------------------------

def evaluate_standard(loss_fn: LossFn, val_tokens: Tensor, luts: ByteLuts, *, seq_len: int, batch_tokens: int,
                      device: torch.device, rank: int = 0, world_size: int = 1,
                      progress: BatchProgress | None = None, training_graph: bool = False) -> EvalResult:
    """The reference's `eval_val`: consecutive sequences of seq_len, each token scored once.

    loss_fn(x, y) returns the mean cross-entropy of a [B, seq_len] batch (a GPT, or the
    same compiled); its sum is taken as mean * B * seq_len. batch_tokens is this rank's batch
    (the reference: val_batch_size // (world_size * grad_accum_steps)), in whole sequences.
    The rank scores sequences [total * rank // world, total * (rank + 1) // world); sums are
    all-reduced when torch.distributed is initialized. The module's train/eval mode is left
    alone: the model behaves the same in both.

    training_graph=True runs loss_fn as training calls it, so that a compiled training
    forward serves without compiling another graph: every batch has the same shape (the
    last is padded with rows whose targets cross-entropy ignores) and autograd stays on
    (each batch's graph is dropped at once).
    """
    if batch_tokens < seq_len:
        raise ConfigError(f"the evaluation batch ({batch_tokens} tokens per rank) must hold at least one "
                          f"sequence of {seq_len}")
    start = sync_clock(device)
    batch_seqs = batch_tokens // seq_len
    total_seqs = (val_tokens.numel() - 1) // seq_len
    first, last = rank_share(total_seqs, rank, world_size)
    tokens = val_tokens[first * seq_len: last * seq_len + 1].to(device=device, dtype=torch.int64)
    luts = luts.to(device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    batches = range(0, last - first, batch_seqs)
    with contextlib.nullcontext() if training_graph else torch.inference_mode():
        for done, begin in enumerate(batches, 1):
            end = min(begin + batch_seqs, last - first)
            local = tokens[begin * seq_len: end * seq_len + 1]
            x, y = local[:-1].view(-1, seq_len), local[1:].view(-1, seq_len)
            with autocast(device):
                loss = loss_fn(*_padded(x, y, batch_seqs) if training_graph else (x, y)).detach()
            sums[NATS] += loss.to(torch.float64) * y.numel()
            sums[TOKENS] += y.numel()
            sums[BYTES] += luts.count_bytes(x, y).sum()
            if progress is not None:
                progress(done, len(batches))
    all_reduce_(sums)
    return make_result("standard", sums, sync_clock(device) - start, seq_len, 0, batch_seqs)


IGNORED_TARGET = -100  # F.cross_entropy's default ignore_index


def _padded(x: Tensor, y: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """x, y grown to `rows` rows; the added targets are ignored by the loss."""
    missing = rows - x.shape[0]
    if missing <= 0:
        return x, y
    return F.pad(x, (0, 0, 0, missing)), F.pad(y, (0, 0, 0, missing), value=IGNORED_TARGET)


def sync_clock(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


# --- Which windows score what -----------------------------------------------------------

@dataclass(frozen=True)
class WindowPlan:
    """Sliding windows over the targets 0..total-1 (int64 tensors, one entry per window):
    window w reads starts[w] .. starts[w] + lengths[w] - 1 and scores the targets at window
    offsets scored_from[w] .. lengths[w] - 1."""

    starts: Tensor
    lengths: Tensor
    scored_from: Tensor

    def __len__(self) -> int:
        return int(self.starts.numel())

    @property
    def scored_begin(self) -> Tensor:
        return self.starts + self.scored_from

    @property
    def scored_end(self) -> Tensor:
        return self.starts + self.lengths

    def select(self, index: Tensor | slice) -> "WindowPlan":
        return WindowPlan(self.starts[index], self.lengths[index], self.scored_from[index])


def plan_windows(total_tokens: int, seq_len: int, stride: int, *, min_length: int = 1,
                 score_once: bool = False) -> WindowPlan:
    """The reference's windows: starts range(0, total, stride), each seq_len long or cut at
    the end; kept when at least min_length long or first (plain sliding evaluation keeps all,
    min_length=1; TTT uses min_length=stride). The first window scores all of itself, every
    other its last `stride` targets.

    Like the reference, the windows that start after the last full one all end at the end,
    so they score the final targets again (each with less context); and min_length=stride
    can drop a short last window that alone scores the final targets (when the stride does
    not divide the token count). score_once=True trims each window to what earlier windows
    left unscored, drops those left with nothing, and keeps short windows that still score
    something, so that every target is scored exactly once.
    """
    if total_tokens < 1:
        raise DataError("no validation targets to score")
    if not 0 < stride <= seq_len:
        raise ConfigError(f"the stride ({stride}) must be in 1..seq_len ({seq_len})")
    starts = torch.arange(0, total_tokens, stride, dtype=torch.int64)
    lengths = (starts + seq_len).clamp(max=total_tokens) - starts
    keep = (lengths >= (1 if score_once else min_length)) | (starts == 0)
    starts, lengths = starts[keep], lengths[keep]
    scored_from = torch.where(starts == 0, 0, (lengths - stride).clamp(min=0))
    if score_once:
        ends = starts + lengths  # non-decreasing
        scored_so_far = torch.cat([ends.new_zeros(1), ends[:-1]])
        scored_from = torch.maximum(scored_from, scored_so_far - starts)
        keep = scored_from < lengths
        starts, lengths, scored_from = starts[keep], lengths[keep], scored_from[keep]
    return WindowPlan(starts, lengths, scored_from)


def chunk_windows(plan: WindowPlan, chunk_tokens: int, total_tokens: int) -> list[Tensor]:
    """For each TTT chunk of chunk_tokens targets, the indices of the windows whose first
    scored target falls in it (a window past the last chunk goes to the last)."""
    num_chunks = (total_tokens + chunk_tokens - 1) // chunk_tokens
    chunk_of = (plan.scored_begin // chunk_tokens).clamp(max=num_chunks - 1)
    order = torch.argsort(chunk_of, stable=True)
    counts = torch.bincount(chunk_of, minlength=num_chunks).tolist()
    return list(torch.split(order, counts))


# --- Sliding scoring on the device ------------------------------------------------------

def rows_per_window(plan: WindowPlan, width: int) -> Tensor:
    """How many rows of `width` scored positions each window of the plan takes."""
    return (plan.lengths - plan.scored_from + width - 1) // width


class WindowScorer:
    """Scores the windows of a plan in batches of `batch_rows` rows of `width` positions.

    A window scoring n targets takes ceil(n / width) rows (so the first window, which
    scores a whole window, takes several rows of the same input). The last batch is padded
    with empty rows, so a compiled scorer sees one shape only.
    """

    def __init__(self, model: GPT, tokens: Tensor, luts: ByteLuts, *, seq_len: int, width: int, batch_rows: int,
                 device: torch.device, compile_model: bool, fused: bool = False, autotune: bool = False,
                 other_builds: Iterable[Callable[[], object]] = ()):
        if batch_rows < 1:
            raise ConfigError(f"the evaluation batch ({batch_rows} windows) must hold at least one window")
        built = sync_clock(device)
        self.model, self.tokens, self.luts = model, tokens, luts
        self.seq_len, self.width, self.batch_rows, self.device = seq_len, width, batch_rows, device
        # Logits leave the forward in the autocast dtype and the loss is taken outside it, as
        # the reference's sliding evaluation does: the same roundings, the same numbers.
        # A row's scored positions are a run (`GPT.hidden_states`' query_runs): where the last
        # block attends in windows, the one before it works only where the last one reads.
        # Fused, the forward's element-wise steps are ready-made kernels (seconds to build);
        # otherwise the whole forward may be compiled, where one pass over the data does not
        # repay Inductor's autotuning (autotune=False). A caller's own kernel builds
        # (other_builds) run beside the scorer's.
        if fused:
            from ..model.fused_ops import FusedOps

            ops = FusedOps()
            ops.warm_up(model, seq_len, width, other_builds)
            self.logits_fn = functools.partial(model.logits_at, ops=ops, query_runs=True)
        else:
            run_in_threads(other_builds, device)
            self.logits_fn = compiled(functools.partial(model.logits_at, query_runs=True), compile_model,
                                      autotune=autotune)
        self.window_offsets = torch.arange(seq_len, device=device)
        self.row_offsets = torch.arange(width, device=device)
        # set-up (kernel builds) and the first batch (what compiles at its first call)
        self.timings = {"scorer_setup": sync_clock(device) - built}

    def rows(self, plan: WindowPlan) -> tuple[Tensor, Tensor, Tensor]:
        """(window start, first scored window offset, window length) of every row, padded to
        whole batches with rows of length 0."""
        per_window = rows_per_window(plan, self.width)
        window = torch.repeat_interleave(torch.arange(len(plan)), per_window)
        first_row = torch.repeat_interleave(torch.cumsum(per_window, 0) - per_window, per_window)
        first = plan.scored_from[window] + (torch.arange(window.numel()) - first_row) * self.width
        rows = torch.stack([plan.starts[window], first, plan.lengths[window]])
        padding = -rows.size(1) % self.batch_rows
        return F.pad(rows, (0, padding)).to(self.device).unbind(0)

    def score(self, plan: WindowPlan, progress: BatchProgress | None = None) -> Tensor:
        """float64 [nats, tokens, bytes] of the plan's scored targets (this rank's, not reduced)."""
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        starts, first, lengths = self.rows(plan)
        num_batches = starts.numel() // self.batch_rows
        with torch.inference_mode():
            for b in range(num_batches):
                batch = slice(b * self.batch_rows, (b + 1) * self.batch_rows)
                first_call = "first_batch" not in self.timings
                begun = sync_clock(self.device) if first_call else 0.0
                sums += self._score_batch(starts[batch], first[batch], lengths[batch])
                if first_call:
                    self.timings["first_batch"] = sync_clock(self.device) - begun
                if progress is not None:
                    progress(b + 1, num_batches)
        return sums

    def _score_batch(self, starts: Tensor, first: Tensor, lengths: Tensor) -> Tensor:
        last_index = self.tokens.numel() - 1
        inside = self.window_offsets < lengths[:, None]
        window_index = (starts[:, None] + self.window_offsets).clamp(max=last_index)
        inputs = torch.where(inside, self.tokens[window_index], 0)  # padded with 0 as the reference
        positions = first[:, None] + self.row_offsets
        scored = positions < lengths[:, None]
        positions = positions.clamp(max=self.seq_len - 1)
        absolute = starts[:, None] + positions
        targets = self.tokens[(absolute + 1).clamp(max=last_index)]
        previous = self.tokens[absolute.clamp(max=last_index)]
        with autocast(self.device):
            logits = self.logits_fn(inputs, positions)
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        zero = nll.new_zeros((), dtype=torch.float64)
        return torch.stack([
            torch.where(scored, nll.to(torch.float64), zero).sum(),
            scored.sum().to(torch.float64),
            torch.where(scored, self.luts.count_bytes(previous, targets), zero).sum(),
        ])


def device_tokens(val_tokens: Tensor, device: torch.device) -> Tensor:
    return val_tokens.to(device=device, dtype=torch.int64)


def should_compile(compile_model: bool | None, device: torch.device) -> bool:
    """An explicit choice, or by default compile on CUDA only (the CPU's compile outlasts a pass)."""
    return device.type == "cuda" if compile_model is None else compile_model


def should_fuse(fused: bool | None, device: torch.device) -> bool:
    """Whether sliding scoring runs the fused kernels: an explicit choice, by default where they can."""
    if fused and not triton_available(device):
        raise ConfigError("the fused kernels need a CUDA device and Triton; pass --no-fused")
    return triton_available(device) if fused is None else fused


def evaluate_sliding(model: GPT, val_tokens: Tensor, luts: ByteLuts, *, seq_len: int, stride: int,
                     device: torch.device, batch_seqs: int = 0, rank: int = 0, world_size: int = 1,
                     score_once: bool = False, compile_model: bool | None = None, fused: bool | None = None,
                     progress: BatchProgress | None = None) -> EvalResult:
    """The reference's `eval_val_sliding` (windows from `plan_windows`, min_length=1).

    The rank scores windows [W * rank // world, W * (rank + 1) // world); sums are
    all-reduced when torch.distributed is initialized. batch_seqs windows (rows; 0: as many as
    fit, see `batch_windows`) go through the model at once, with the fused kernels (default:
    where they can run, see `should_fuse`) or else through torch.compile with compile_model
    (default: on CUDA).
    """
    start = sync_clock(device)
    total_tokens = val_tokens.numel() - 1
    plan = plan_windows(total_tokens, seq_len, stride, score_once=score_once)
    plan = plan.select(slice(*rank_share(len(plan), rank, world_size)))
    batch_rows = batch_windows(batch_seqs, model.cfg, seq_len, device)
    if batch_seqs <= 0:  # a batch of its own choosing: as large, but no emptier at the end than it must be
        batch_rows = even_batch(int(rows_per_window(plan, stride).sum()), batch_rows)
    scorer = WindowScorer(model, device_tokens(val_tokens, device), luts.to(device), seq_len=seq_len, width=stride,
                          batch_rows=batch_rows, device=device, compile_model=should_compile(compile_model, device),
                          fused=should_fuse(fused, device))
    sums = scorer.score(plan, progress)
    all_reduce_(sums)
    return make_result("sliding", sums, sync_clock(device) - start, seq_len, stride, scorer.batch_rows,
                   timings=scorer.timings)





