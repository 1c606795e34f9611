"""Phased per-document LoRA test-time training (`eval-ttt --method lora`), score-first.

Documents begin at BOS (the stream's first token begins one too). A document's targets are
its own tokens after its BOS and the next document's BOS, each predicted from this document
alone; so the documents' targets cover the stream's exactly once. A document is scored in
chunks of ttt_lora_chunk_tokens, in order: each chunk by the model plus the document's own
LoRA adapters over a window of the document that ends with the chunk, and then, where the
document has a later chunk, the adapters take one AdamW step on that chunk's mean loss (with
ttt_lora_train_span=window: on the mean loss of every target of the document that the
window holds, all scored by then). The adapters start afresh with every document. With
ttt_lora_context=stream a window reaches back across document boundaries to earlier tokens,
as sliding evaluation's do (for a model trained on packed documents, whose predictions lean
on the documents before). Documents are scored side by side, each row of a batch with its
own adapters (batched products), longest first, so that a batch's rows end together; a
window is padded on its right, which a causal model never reads.

Global phases: the first ttt_lora_prefix_docs documents, in stream order, fall into
ttt_lora_phases equal groups. Once a group is scored entirely, the model itself trains on
that group's tokens (with ttt_lora_phase_span=prefix: on every group's so far) as `--method
chunks` trains (`ttt.ChunkTrainer`: SGD with ttt_lr, ttt_epochs, ...), and the later groups
are scored by the model so changed. Within a group the model never changes and adapters
are per document, so the order of its documents is free: a token's score depends only on
tokens before it in the stream (its own document's, those of the documents of earlier
groups, and with stream context those its window reads).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import TTTConfig, lora_targets
from ..data.tokenizer import BOS_ID, ByteLuts
from ..distributed import all_reduce_
from ..model.gpt import GPT
from ..model.ops import TORCH_OPS, TorchOps
from ..runtime import autocast
from .scoring import BYTES, NATS, TOKENS, ChunkScore, EvalResult, Log, make_result, sync_clock
from .ttt import ChunkProgress, ChunkTrainer, select_ttt_parameters, ttt_learning_rate

ADAPTER_SEED = 0  # the adapters' first matrices are drawn from it: the same numbers on every run
WINDOW_ROUNDING = 64  # window lengths are rounded up to a multiple (fewer shapes for the kernels)


# --- Documents and their chunks -------------------------------------------------------------

@dataclass(frozen=True)
class Document:
    """Targets start..end-1 of the stream (target p is token p + 1, predicted from tokens
    start..p): the document's tokens after its BOS at `start`, and the next one's BOS."""

    index: int  # in stream order
    start: int
    end: int

    @property
    def targets(self) -> int:
        return self.end - self.start


def find_documents(tokens: Tensor, bos_id: int = BOS_ID) -> list[Document]:
    """The documents of the stream `tokens` (N + 1 tokens, N targets): one at 0 and one at
    every BOS before the last token; their targets partition 0..N-1."""
    targets = tokens.numel() - 1
    if targets < 1:
        return []
    bos = (tokens[:targets] == bos_id).nonzero().flatten().tolist()
    starts = sorted({0, *bos})
    ends = starts[1:] + [targets]
    return [Document(i, s, e) for i, (s, e) in enumerate(zip(starts, ends))]


def phase_groups(documents: list[Document], phases: int, prefix_docs: int) -> list[list[Document]]:
    """The documents in groups, in stream order: `phases` equal groups of the first
    prefix_docs (at most all), then the rest (possibly none). The model trains after each
    of the first `phases` groups."""
    prefix = min(prefix_docs, len(documents)) if phases > 0 else 0
    bounds = [round(prefix * k / phases) for k in range(phases + 1)] if prefix else [0]
    groups = [documents[a:b] for a, b in zip(bounds, bounds[1:])]
    return groups + [documents[bounds[-1]:]]


@dataclass(frozen=True)
class ChunkRows:
    """One chunk of each document of a batch, as rows: tokens ws..ws+T-1 of the stream feed a
    row (ws: the window's start), and the row's positions `queries` score targets ws + q."""

    window_start: Tensor  # [B] int64
    window_len: Tensor  # [B] the real (unpadded) lengths
    queries: Tensor  # [B, C] positions within the row, clamped into it where not valid
    valid: Tensor  # [B, C] bool: which queries score a target
    trains: Tensor  # [B] bool: the document has a later chunk, so its adapters learn from this one
    width: int  # T, the rows' padded length
    document_first: Tensor  # [B] the row position of the document's first target the window holds

    def window_targets(self) -> Tensor:
        """[B, T] bool: the row positions that predict a target of the row's document up to
        the chunk's end (all scored by the time the adapters train on them)."""
        at = torch.arange(self.width, dtype=torch.int64)[None, :]
        return (at >= self.document_first[:, None]) & (at < self.window_len[:, None])


def chunk_rows(docs: list[Document], index: int, chunk_tokens: int, seq_len: int,
               rounding: int = WINDOW_ROUNDING, stream_context: bool = False) -> ChunkRows:
    """The rows of chunk `index` of each document (a document past its last chunk scores
    nothing). Chunk j of a document scores its targets start + j C .. (end or start + (j+1) C)
    - 1 from a window of at most seq_len tokens that ends with them: tokens of the document
    only, or with stream_context, of the stream (earlier documents too, as sliding
    evaluation reads them)."""
    start = torch.tensor([d.start for d in docs], dtype=torch.int64)
    end = torch.tensor([d.end for d in docs], dtype=torch.int64)
    chunk_start = start + index * chunk_tokens
    chunk_end = torch.minimum(chunk_start + chunk_tokens, end)
    count = (chunk_end - chunk_start).clamp(min=0)
    window_start = (chunk_end - seq_len).clamp(min=0) if stream_context else torch.maximum(start, chunk_end - seq_len)
    window_len = (chunk_end - window_start).clamp(min=1)
    longest = int(window_len.max())
    width = min(max(seq_len, longest), math.ceil(longest / rounding) * rounding)
    offsets = torch.arange(chunk_tokens, dtype=torch.int64)
    valid = offsets[None, :] < count[:, None]
    queries = (chunk_start - window_start)[:, None] + offsets[None, :]
    queries = torch.where(valid, queries, window_len[:, None] - 1).clamp(0, width - 1)
    trains = chunk_end < end
    return ChunkRows(window_start, window_len, queries, valid, trains, width, (start - window_start).clamp(min=0))


# --- Adapters --------------------------------------------------------------------------------

def adapted_shapes(model: GPT, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """{weight name: (in, out)} of the matrices the targets name."""
    cfg, shapes = model.cfg, {}
    parts = {"q": ("attn.c_q", cfg.model_dim, cfg.model_dim), "k": ("attn.c_k", cfg.model_dim, cfg.kv_dim),
             "v": ("attn.c_v", cfg.model_dim, cfg.kv_dim), "o": ("attn.proj", cfg.model_dim, cfg.model_dim),
             "up": ("mlp.fc", cfg.model_dim, cfg.mlp_dim), "down": ("mlp.proj", cfg.mlp_dim, cfg.model_dim)}
    for target in targets:
        if target == "head":
            shapes[model.head_name] = (cfg.model_dim, cfg.vocab_size)
            continue
        part, fan_in, fan_out = parts[target]
        for layer in range(cfg.num_layers):
            shapes[f"blocks.{layer}.{part}.weight"] = (fan_in, fan_out)
    return shapes


class BatchedLoRA(nn.Module):
    """Low-rank adapters, one set per row of a batch: for the weight W (out x in) of row b,
    the product's output gains x A_b^T B_b^T, with B_b (out x rank) zero, so a fresh adapter
    changes nothing, and A_b (rank x in) drawn uniformly within +-1/sqrt(in), the same for
    every row: a document scores alike in any row of any batch. Called as a
    `model.gpt.LinearAdapter`."""

    def __init__(self, shapes: dict[str, tuple[int, int]], rows: int, rank: int, device: torch.device):
        super().__init__()
        self.keys = {name: name.replace(".", "_") for name in shapes}
        generator = torch.Generator().manual_seed(ADAPTER_SEED)
        self.down = nn.ParameterDict()
        self.up = nn.ParameterDict()
        for name, (fan_in, fan_out) in shapes.items():
            bound = 1.0 / math.sqrt(fan_in)
            first = (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound
            self.down[self.keys[name]] = nn.Parameter(first.to(device).expand(rows, -1, -1).clone())
            self.up[self.keys[name]] = nn.Parameter(torch.zeros(rows, fan_out, rank, device=device))
        self.rows: Tensor | None = None  # the rows the batch holds now (None: all, in order)

    def forward(self, name: str, x: Tensor) -> Tensor | None:
        key = self.keys.get(name)
        if key is None:
            return None
        a, b = self.down[key], self.up[key]
        if self.rows is not None:  # only the documents still being scored
            a, b = a.index_select(0, self.rows), b.index_select(0, self.rows)
        return torch.bmm(torch.bmm(x, a.to(x.dtype).transpose(1, 2)), b.to(x.dtype).transpose(1, 2))


@contextlib.contextmanager
def frozen(model: GPT) -> Iterator[None]:
    """The model's parameters without gradients (the adapters' backward needs none of theirs)."""
    states = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in states:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, wanted in states:
            p.requires_grad_(wanted)


# --- Scoring a batch of documents ---------------------------------------------------------

@dataclass
class BatchScorer:
    """Scores batches of documents chunk by chunk, training each row's adapters between."""

    model: GPT
    tokens: Tensor  # the stream, on the device
    luts: ByteLuts  # on the device
    ttt: TTTConfig
    seq_len: int
    device: torch.device
    ops: TorchOps = TORCH_OPS

    def __post_init__(self) -> None:
        self.shapes = adapted_shapes(self.model, lora_targets(self.ttt.ttt_lora_targets))
        self.steps = 0  # adapter steps taken (each over a batch's rows)
        self.chunks = 0  # chunk forwards

    def score(self, docs: list[Document], sums: Tensor, on_target: Callable[[Tensor, Tensor], None] | None = None
              ) -> None:
        """Add the documents' nats, targets and bytes to sums [3] (float64, on the device).
        on_target(positions, nats), where given, sees each scored target's stream position."""
        ttt = self.ttt
        lora = BatchedLoRA(self.shapes, len(docs), ttt.ttt_lora_rank, self.device)
        optimizer = torch.optim.AdamW(lora.parameters(), lr=ttt.ttt_lora_lr, weight_decay=ttt.ttt_lora_weight_decay,
                                      betas=(ttt.ttt_lora_beta1, ttt.ttt_lora_beta2), eps=1e-10)
        chunk_tokens = ttt.ttt_lora_chunk_tokens
        num_chunks = max(math.ceil(d.targets / chunk_tokens) for d in docs)
        with frozen(self.model), self.model.adapt_linears(lora):
            for index in range(num_chunks):
                # Documents that have ended drop out of the batch (their adapters stay unused).
                active = [b for b, d in enumerate(docs) if index * chunk_tokens < d.targets]
                lora.rows = None if len(active) == len(docs) else torch.tensor(active, device=self.device)
                rows = chunk_rows([docs[b] for b in active], index, chunk_tokens, self.seq_len,
                                  stream_context=ttt.ttt_lora_context == "stream")
                trains = bool(rows.trains.any())
                with torch.set_grad_enabled(trains):
                    nats, valid = self._chunk(rows, sums, on_target)
                if trains:
                    per_doc = (nats * valid).sum(1) / valid.sum(1).clamp(min=1)  # valid: the targets trained on
                    (per_doc * rows.trains.to(self.device)).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    self.steps += 1
                self.chunks += 1

    def _chunk(self, rows: ChunkRows, sums: Tensor, on_target: Callable[[Tensor, Tensor], None] | None
               ) -> tuple[Tensor, Tensor]:
        """Score the rows' valid targets into sums; (the nats of the targets an adapter step
        trains on, with the graph to the adapters where gradients are on; which those are)."""
        positions = rows.window_start.to(self.device)[:, None] + torch.arange(rows.width, device=self.device)
        positions = torch.minimum(positions, (rows.window_start + rows.window_len - 1).to(self.device)[:, None])
        x = self.tokens[positions]
        queries, valid = rows.queries.to(self.device), rows.valid.to(self.device)
        whole = self.ttt.ttt_lora_train_span == "window"  # logits at every row position, the chunk's among them
        asked = torch.arange(rows.width, device=self.device).expand(len(queries), -1) if whole else queries
        targets = self.tokens[positions.gather(1, asked) + 1]
        with autocast(self.device):
            logits = self.model.logits_at(x, asked, self.ops)
        trained = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        nats = trained.gather(1, queries) if whole else trained
        targets = targets.gather(1, queries) if whole else targets
        with torch.no_grad():
            scored = nats.detach().double() * valid
            n_bytes = self.luts.count_bytes(x.gather(1, queries), targets) * valid
            sums[NATS] += scored.sum()
            sums[TOKENS] += valid.sum()
            sums[BYTES] += n_bytes.sum()
            if on_target is not None:
                at = positions.gather(1, queries)
                on_target(at[valid], nats.detach()[valid])
        return (trained, rows.window_targets().to(self.device)) if whole else (nats, valid)


def batches(docs: list[Document], batch_docs: int) -> list[list[Document]]:
    """The documents longest first (ties in stream order), in batches of batch_docs."""
    ordered = sorted(docs, key=lambda d: (-d.targets, d.index))
    return [ordered[i: i + batch_docs] for i in range(0, len(ordered), batch_docs)]


# --- The evaluation ------------------------------------------------------------------------

def train_phase(trainer: ChunkTrainer, groups: list[list[Document]], g: int, ttt: TTTConfig, log: Log) -> None:
    """Global phase g + 1, once group g is scored: the model trains on group g's targets (with
    ttt_lora_phase_span=prefix: on those of every group up to g), at phase g's learning rate."""
    since = groups[0] if ttt.ttt_lora_phase_span == "prefix" else groups[g]
    first, last = since[0].start, groups[g][-1].end
    trainer.train_chunk(first, last, ttt_learning_rate(ttt.ttt_lr, g, ttt.ttt_lora_phases + 1))
    trainer.release()  # the steps' recorded memory back to the scoring, which needs it next
    log(f"ttt_lora:phase {g + 1}/{ttt.ttt_lora_phases} trained on documents "
        f"{since[0].index}..{groups[g][-1].index} (targets {first}..{last - 1})")


def evaluate_lora_ttt(model: GPT, val_tokens: Tensor, luts: ByteLuts, ttt: TTTConfig, *, seq_len: int,
                      device: torch.device, rank: int = 0, world_size: int = 1, fused: bool = False,
                      on_batch: Callable[[ChunkProgress], None] | None = None, log: Log | None = None,
                      on_target: Callable[[Tensor, Tensor], None] | None = None) -> EvalResult:
    """Score-first per-document LoRA TTT with global phases (see the module's docstring).
    Each rank scores every world_size-th document of each group (longest first); the sums
    are reduced over ranks at the end. The model's weights are changed by the phases. With
    fused (CUDA), the steps run `model.fused_train_ops.TrainingOps`' fused kernels.
    `result.per_chunk` holds each group's sums; on_batch sees running sums after each batch."""
    start = sync_clock(device)
    log = log or (lambda message: None)
    tokens = val_tokens.to(device=device, dtype=torch.int64)
    documents = find_documents(val_tokens)
    groups = phase_groups(documents, ttt.ttt_lora_phases, ttt.ttt_lora_prefix_docs)
    ops = TORCH_OPS
    if fused:
        from ..model.fused_train_ops import TrainingOps  # imports Triton

        ops = TrainingOps()
    scorer = BatchScorer(model, tokens, luts.to(device), ttt, seq_len, device, ops)
    mine = [batches(group[rank::world_size], ttt.ttt_lora_batch_docs) for group in groups]
    total_batches = sum(len(b) for b in mine)
    log(f"ttt_lora:start documents={len(documents)} groups={[len(g) for g in groups]} "
        f"rank={ttt.ttt_lora_rank} targets={ttt.ttt_lora_targets} lr={ttt.ttt_lora_lr} "
        f"chunk={ttt.ttt_lora_chunk_tokens} train_span={ttt.ttt_lora_train_span} batch_docs={ttt.ttt_lora_batch_docs} "
        f"adapter_parameters={sum(i + o for i, o in scorer.shapes.values()) * ttt.ttt_lora_rank:,}/document")
    trainer = None
    if ttt.ttt_lora_phases > 0 and ttt.ttt_epochs > 0:
        params = select_ttt_parameters(model, ttt.ttt_freeze_blocks, ttt.ttt_freeze_bank_slices)
        trainer = ChunkTrainer(model, params, ttt, tokens, seq_len=seq_len, device=device, rank=rank,
                               world_size=world_size, compile_model=False, fused=fused)
    group_sums = torch.zeros(len(groups), 3, dtype=torch.float64, device=device)
    done, timings = 0, {"adapters": 0.0, "phases": 0.0}
    try:
        for g, group_batches in enumerate(mine):
            begun = sync_clock(device)
            for batch in group_batches:
                scorer.score(batch, group_sums[g], on_target)
                done += 1
                if on_batch is not None:
                    on_batch(ChunkProgress(done, total_batches, *group_sums[: g + 1].sum(0).tolist()))
            timings["adapters"] += sync_clock(device) - begun
            if trainer is not None and g < len(groups) - 1 and g < ttt.ttt_lora_phases and groups[g]:
                begun = sync_clock(device)
                train_phase(trainer, groups, g, ttt, log)
                timings["phases"] += sync_clock(device) - begun
    finally:
        model.zero_grad(set_to_none=True)
    all_reduce_(group_sums)
    per_group = [ChunkScore(nats, int(n), int(b)) for nats, n, b in group_sums.tolist()]
    result = make_result("ttt_lora", group_sums.sum(0), sync_clock(device) - start, seq_len, 0,
                         ttt.ttt_lora_batch_docs, per_group, timings)
    result.ttt_steps = {"adapter_steps": scorer.steps, "chunk_forwards": scorer.chunks,
                        **({f"phase_{k}": v for k, v in trainer.counts.items()} if trainer is not None else {})}
    return result
