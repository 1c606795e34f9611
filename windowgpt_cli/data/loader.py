"""What training and scoring read: the validation tokens (`load_validation_tokens`), and the
training batches, from the reference's coprime-stride multi-shard sampler, with prefetch.

Each shard is read as non-overlapping windows of seq_len + 1 tokens starting at a random
phase, visited in a random coprime-stride order so every window is seen once per pass.
Each batch mixes windows from several shards chosen with probabilities that favour
shards with more unseen windows, and the mix widens as training progresses. All
randomness comes from one generator seeded by the configured seed, so a run is
reproducible, and its state is saved in checkpoints.
"""
from __future__ import annotations

import math
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError
from .shards import check_vocab, list_shards, load_tokens, open_shard, read_token_count

PROGRESS_BATCHES = 1800.0  # batches over which the shard mix widens


class ShardCursor:
    """Position in one shard's random pass over its windows."""

    __slots__ = ("phase", "block_count", "next", "start", "stride")

    def __init__(self, phase: int, block_count: int, start: int, stride: int):
        self.phase, self.block_count, self.next, self.start, self.stride = phase, block_count, 0, start, stride

    @property
    def remaining(self) -> int:
        return self.block_count - self.next


class TokenStream:
    """Samples [B, seq_len] input/target batches for one rank of `world_size`."""

    def __init__(self, files: list[Path], seed: int, rank: int = 0, world_size: int = 1, vocab_size: int | None = None):
        if not files:
            raise DataError("no training shards given")
        self.files = [Path(f) for f in files]
        self.rank, self.world_size, self.vocab_size = rank, world_size, vocab_size
        self.num_tokens = np.array([read_token_count(f) for f in self.files], dtype=np.int64)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.cursors: dict[int, ShardCursor] = {}
        self.batches_built = 0
        self._maps: dict[int, np.ndarray] = {}
        self._checked: set[int] = set()

    # --- state for checkpoints ---

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "batches_built": self.batches_built,
            "cursors": {str(i): [c.phase, c.block_count, c.next, c.start, c.stride] for i, c in self.cursors.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.batches_built = int(state["batches_built"])
        self.cursors = {}
        for key, (phase, count, nxt, start, stride) in state["cursors"].items():
            cursor = ShardCursor(int(phase), int(count), int(start), int(stride))
            cursor.next = int(nxt)
            self.cursors[int(key)] = cursor

    # --- sampling ---

    def _coprime_stride(self, n: int) -> int:
        if n <= 1:
            return 1
        while True:
            s = int(self.rng.integers(1, n))
            if math.gcd(s, n) == 1:
                return s

    def _new_cursor(self, shard: int, seq_len: int) -> ShardCursor:
        n = int(self.num_tokens[shard])
        max_phase = min(seq_len - 1, max(0, n - seq_len - 1))
        phase = int(self.rng.integers(max_phase + 1)) if max_phase > 0 else 0
        block_count = (n - 1 - phase) // seq_len
        start = int(self.rng.integers(block_count)) if block_count > 1 else 0
        return ShardCursor(phase, block_count, start, self._coprime_stride(block_count))

    def _take(self, shard: int, seq_len: int, count: int) -> list[tuple[int, int]]:
        """The next `count` window offsets of a shard, starting a new pass when needed."""
        taken: list[tuple[int, int]] = []
        while len(taken) < count:
            cursor = self.cursors.get(shard)
            if cursor is None or cursor.remaining <= 0:
                cursor = self.cursors[shard] = self._new_cursor(shard, seq_len)
            n = min(count - len(taken), cursor.remaining)
            blocks = (cursor.start + (cursor.next + np.arange(n)) * cursor.stride) % cursor.block_count
            taken.extend((shard, cursor.phase + int(b) * seq_len) for b in blocks)
            cursor.next += n
        return taken

    def _shard_probabilities(self, eligible: np.ndarray, seq_len: int, progress: float) -> np.ndarray:
        remaining = np.array([
            float(max(self.cursors[s].remaining, 1)) if s in self.cursors
            else float((self.num_tokens[s] - 1) // seq_len)
            for s in eligible.tolist()
        ])
        weights = np.power(remaining, 0.90 - 0.40 * progress)
        total = float(weights.sum())
        if not np.isfinite(total) or total <= 0.0:
            weights, total = np.ones(len(eligible)), float(len(eligible))
        return weights / total

    def sample_windows(self, global_seqs: int, seq_len: int) -> list[tuple[int, int]]:
        """(shard, offset) of the next global batch's windows, interleaved across shards."""
        eligible = np.nonzero((self.num_tokens - 1) // seq_len > 0)[0]
        if eligible.size == 0:
            raise DataError(f"every training shard is shorter than one sequence of {seq_len + 1} tokens")
        progress = min(self.batches_built / PROGRESS_BATCHES, 1.0)
        probs = self._shard_probabilities(eligible, seq_len, progress)
        n_eligible = eligible.size
        low = min(max(8, self.world_size), n_eligible, global_seqs)
        high = min(max(32, self.world_size * 8), n_eligible, global_seqs)
        mix = max(1, min(int(round(low + progress * (high - low))), n_eligible, global_seqs))
        picked = self.rng.choice(n_eligible, size=mix, replace=False, p=probs)
        shards = eligible[picked]
        counts = np.ones(mix, dtype=np.int64)
        if global_seqs > mix:
            picked_probs = probs[picked] / probs[picked].sum()
            counts += self.rng.multinomial(global_seqs - mix, picked_probs).astype(np.int64)
        order = self.rng.permutation(mix)
        buckets = []
        for shard, count in zip(shards[order].tolist(), counts[order].tolist()):
            bucket = self._take(int(shard), seq_len, int(count))
            if len(bucket) > 1:
                bucket = [bucket[int(k)] for k in self.rng.permutation(len(bucket))]
            buckets.append(bucket)
        return self._interleave(buckets)

    def _interleave(self, buckets: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
        """Round-robin over the buckets in a fresh random order each round."""
        windows: list[tuple[int, int]] = []
        active = [b for b in buckets if b]
        while active:
            still_active = []
            for k in self.rng.permutation(len(active)).tolist():
                windows.append(active[k].pop())
                if active[k]:
                    still_active.append(active[k])
            active = still_active
        return windows

    def _tokens(self, shard: int) -> np.ndarray:
        if shard not in self._maps:
            self._maps[shard] = open_shard(self.files[shard])
        return self._maps[shard]

    def next_batch(self, global_tokens: int, seq_len: int, grad_accum_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch as contiguous CPU int64 tensors (inputs, targets): every
        batch has one layout, so a compiled model sees one set of strides (validation too)."""
        local_seqs = global_tokens // (self.world_size * grad_accum_steps) // seq_len
        if local_seqs < 1:
            raise DataError(f"train_batch_tokens={global_tokens} gives no full sequence of {seq_len} tokens per "
                            f"micro-batch on {self.world_size} rank(s) x {grad_accum_steps} accumulation steps")
        windows = self.sample_windows(local_seqs * self.world_size, seq_len)[self.rank::self.world_size]
        self.batches_built += 1
        batch = np.empty((local_seqs, seq_len + 1), dtype=np.int64)
        offsets = np.arange(seq_len + 1)
        for shard in {s for s, _ in windows}:
            rows = [i for i, (s, _) in enumerate(windows) if s == shard]
            starts = np.array([windows[i][1] for i in rows])
            tokens = self._tokens(shard)
            batch[rows] = tokens[starts[:, None] + offsets]
            self._check_vocab(shard, batch[rows])
        tensor = torch.from_numpy(batch)
        return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()

    def next_pass(self, global_tokens: int, seq_len: int, grad_accum_steps: int,
                  per_pass: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The next per_pass micro-batches, concatenated: what one forward and backward takes."""
        if per_pass == 1:
            return self.next_batch(global_tokens, seq_len, grad_accum_steps)
        parts = [self.next_batch(global_tokens, seq_len, grad_accum_steps) for _ in range(per_pass)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    def _check_vocab(self, shard: int, rows: np.ndarray) -> None:
        if self.vocab_size is None:
            return
        if shard not in self._checked:  # one full pass per shard, then trust it
            check_vocab(self._tokens(shard), self.vocab_size, str(self.files[shard]))
            self._checked.add(shard)


class Prefetcher:
    """Builds batches (per_pass micro-batches each) in a background thread into pinned
    memory, so the GPU never waits for the sampler; its state is the stream's state after
    the last batch taken."""

    def __init__(self, stream: TokenStream, global_tokens: int, seq_len: int, grad_accum_steps: int,
                 device: torch.device, depth: int = 16, per_pass: int = 1):
        self.stream, self.device = stream, device
        self.args = (global_tokens, seq_len, grad_accum_steps, per_pass)
        self.pin = device.type == "cuda"
        self._state = stream.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                x, y = self.stream.next_pass(*self.args)
                item = (x, y, self.stream.state_dict())
                if self.pin:
                    item = (item[0].pin_memory(), item[1].pin_memory(), item[2])
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # surfaced on the next take()
            self._queue.put(exc)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        x, y, self._state = item
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def load_validation_tokens(data_dir: Path, seq_len: int, vocab_size: int, files: list[Path] | None = None) -> Tensor:
    """All val shards concatenated (`files`, as a verified manifest lists them; default: the
    directory's), cut to a whole number of seq_len sequences plus the one token the last
    target needs (the reference's truncation); uint16."""
    files = list_shards(data_dir, "val") if files is None else files
    tokens = load_tokens(files)
    usable = ((tokens.numel() - 1) // seq_len) * seq_len
    if usable <= 0:
        raise DataError(f"{data_dir}: the validation shards hold {tokens.numel()} tokens, too few for one "
                        f"sequence of {seq_len} (+1)")
    tokens = tokens[: usable + 1].contiguous()
    check_vocab(tokens.numpy(), vocab_size, f"{data_dir} (validation shards)")
    return tokens
